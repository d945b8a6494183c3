"""The fast paths against the plain ones they replace: each fused kernel of `ds4_mlx.models.kernels` on
the GPU backend that runs it (Metal or CUDA; skipped where MLX has no GPU, as on this CPU CI: the device
run is in docs/PERFORMANCE.md), and the per-backend choices of `models/` (attention, expert
products) against each other, on any device."""

import os

import mlx.core as mx
import pytest

from ds4_mlx.models import kernels

HAS_GPU = mx.metal.is_available() or mx.cuda.is_available()


def check_hc_mix(T, H, hc=4, iters=20, eps=1e-6, seed=0, dtype=mx.float32, normed=False):
    key = mx.random.key(seed)
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    mix = 3 * mx.random.normal((T, (2 + hc) * hc), key=k1)
    scale = mx.random.uniform(0.5, 2.0, (3,), key=k2)
    base = mx.random.normal(((2 + hc) * hc,), key=k3)
    streams = mx.random.normal((T, hc, H), key=k4)
    norm = (mx.random.uniform(0.5, 2.0, (H,), key=k5).astype(dtype), 1e-6) if normed else ()
    with mx.stream(mx.gpu):
        previous = mx.default_device()
        mx.set_default_device(mx.gpu)
        try:
            assert kernels.backend() in ("metal", "cuda")
            got = kernels.hc_mix(mix, scale, base, streams, iters, eps, dtype, *norm)
            # x in float32, or normed from x rounded to `dtype` as the kernel's
            want = kernels.hc_mix_reference(mix, scale, base, streams, iters, eps, *((dtype,) + norm if normed else ()))
            mx.eval(got, want)
        finally:
            mx.set_default_device(previous)
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == mx.float32
    # x is the float32 mix rounded once to `dtype`: within its rounding of the float32 definition's (normed,
    # within the roundings of the norm's product and of its weight's)
    x_tolerance = 1e-5 if dtype == mx.float32 else mx.finfo(dtype).eps * (2 if normed else 1)
    for name, g, w, tolerance in zip(("x", "post", "comb"), got, want, (x_tolerance, 1e-5, 1e-5)):
        assert g.shape == w.shape, name
        err = float(mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max())
        assert err <= tolerance * max(1.0, float(mx.abs(w.astype(mx.float32)).max())), \
            f"{name}: max |diff| {err:.2e} (T={T}, H={H})"
    # the comb matrix is doubly stochastic after Sinkhorn: columns sum to 1 (to within eps)
    assert float(mx.abs(got[2].sum(axis=-2) - 1).max()) < 1e-4


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,H,dtype", [(1, 4096, mx.float32), (3, 64, mx.float32), (517, 4096, mx.float32),
                                       (1, 4096, mx.bfloat16), (3, 64, mx.float16)])
@pytest.mark.parametrize("normed", [False, True], ids=["mix", "mix-and-norm"])
def test_hc_mix_kernel_matches_reference(T, H, dtype, normed):
    check_hc_mix(T, H, dtype=dtype, normed=normed)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,H,dtype", [(1, 4096, mx.bfloat16), (6, 4096, mx.float32), (517, 64, mx.bfloat16)])
def test_hc_post_kernel_matches_float64(T, H, dtype):
    """HC post (the sub-layer's output into each stream, plus the streams' 4 x 4 mix) against float64."""
    import numpy as np

    k1, k2, k3, k4 = mx.random.split(mx.random.key(T), 4)
    out = mx.random.normal((T, H), key=k1).astype(dtype)
    streams, post, comb = (mx.random.normal(s, key=k) for s, k in (((T, 4, H), k2), ((T, 4), k3), ((T, 4, 4), k4)))
    got = on_cuda(kernels.hc_post, out, streams, post, comb)
    o, s, p, c = (np.array(a.astype(mx.float32), np.float64) for a in (out, streams, post, comb))
    want = p[:, :, None] * o[:, None, :] + np.einsum("tji,tjh->tih", c, s)
    assert got.shape == (T, 4, H) and got.dtype == mx.float32
    assert np.abs(np.array(got) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,H,m,dtype", [(1, 4096, 24, mx.bfloat16), (8, 4096, 24, mx.float32),
                                         (3, 64, 4, mx.bfloat16)])
def test_hc_post_project_kernel_matches_float64(T, H, m, dtype):
    """HC post with the next projection of the streams it writes (RMS-normed, times fn) against float64."""
    import numpy as np

    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(T), 5)
    out = mx.random.normal((T, H), key=k1).astype(dtype)
    streams, post, comb = (mx.random.normal(s, key=k) for s, k in (((T, 4, H), k2), ((T, 4), k3), ((T, 4, 4), k4)))
    fn = mx.random.normal((m, 4 * H), key=k5) / 64
    got_streams, got_mix = on_cuda(kernels.hc_post_project, out, streams, post, comb, fn, 1e-6)
    o, s, p, c, f = (np.array(a.astype(mx.float32), np.float64) for a in (out, streams, post, comb, fn))
    want_streams = p[:, :, None] * o[:, None, :] + np.einsum("tji,tjh->tih", c, s)
    flat = want_streams.reshape(T, -1)
    want_mix = flat / np.sqrt((flat * flat).mean(axis=-1, keepdims=True) + 1e-6) @ f.T
    assert got_streams.shape == (T, 4, H) and got_mix.shape == (T, m) and got_mix.dtype == mx.float32
    assert np.abs(np.array(got_streams) - want_streams).max() <= 1e-5 * np.abs(want_streams).max()
    assert np.abs(np.array(got_mix) - want_mix).max() <= 1e-5 * np.abs(want_mix).max()


def on_cuda(kernel, *args):
    """`kernel(*args)` evaluated on the GPU, or a skip where that is not CUDA."""
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        if kernels.backend() != "cuda":
            pytest.skip("CUDA only")
        out = kernel(*args)
        mx.eval(out)
        return out
    finally:
        mx.set_default_device(previous)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("hd,capacity,pos,ratio,n_rows,top_k,dtype,q_dtype", [
    (512, 127, 8191, 4, 2100, 512, mx.float16, mx.float32),   # CSA: the indexer's choice, a ring of just the window
    (512, 127, 8191, 4, 2100, 0, mx.float16, mx.float32),     # CSA before the indexer selects: the valid rows
    (512, 170, 9000, 128, 80, 0, mx.float16, mx.float32),     # HCA, a ring with rewind history
    (64, 135, 300, 0, 0, 0, mx.float32, mx.float32),          # sliding window only, float32 rows
    (512, 127, 8191, 4, 2100, 512, mx.float16, mx.bfloat16),  # queries in the bfloat16 compute dtype
    (128, 127, 1000, 4, 300, 5, mx.bfloat16, mx.bfloat16),    # 8-byte words a lane, picks not a multiple of 4
])
def test_decode_attention_kernel_matches_reference(hd, capacity, pos, ratio, n_rows, top_k, dtype, q_dtype):
    """Three tokens decoded together from rows 3, 0 and 2 of a pool of four sessions: one at `pos`, one in its
    first window, one in between; with `top_k`, the first and last pick their rows and the one in its first
    window reads all."""
    nh, window, B, S = 8, 128, 3, 4
    positions = mx.array([pos, 40, pos - 700 if ratio else pos - 3], mx.int32)
    pool_rows = mx.array([3, 0, 2], mx.int32)
    k = mx.random.split(mx.random.key(hd + pos), 6)
    q = mx.random.normal((B, nh, hd), key=k[0]).astype(q_dtype)
    ring = mx.random.normal((S * capacity, hd), key=k[1]).astype(dtype)  # a pool's, flat
    fresh = mx.random.normal((B, hd), key=k[2]).astype(dtype)
    rows = mx.random.normal((S * n_rows, hd), key=k[3]).astype(dtype) if ratio else None
    visible = (pos - 700 + 1) // ratio if ratio else 0  # the fewest rows a picking token sees
    selected = (mx.stack([mx.random.permutation(visible, key=key)[:top_k] for key in mx.random.split(k[4], B)])
                .astype(mx.uint32) if top_k else None)  # argsort's
    picks = mx.array([True, False, True]) if top_k else None
    sinks = mx.random.normal((nh,), key=k[5])
    got = on_cuda(kernels.decode_attention, q, ring, fresh, rows, selected, positions, sinks, window, ratio, None,
                  picks, pool_rows, False, (capacity, n_rows))
    # the reference on the CPU: CUDA's float32 matrix products run on TF32 tensor cores
    with mx.stream(mx.cpu):
        want = kernels.decode_attention_rows_reference(q, ring, fresh, rows, selected, positions, sinks, window, ratio,
                                                       picks=picks, pool_rows=pool_rows, per_session=(capacity, n_rows))
    assert got.shape == (B, nh, hd) and got.dtype == mx.float32
    err = float(mx.abs(got - want).max())
    assert err <= 1e-5 * max(1.0, float(mx.abs(want).max())), f"max |diff| {err:.2e}"


def test_decode_attention_rows_are_each_tokens_own():
    """The batched definition is the one-token definition row by row (what the pool's exactness rests on),
    a token in its first window included: its rows before position 0 are masked, not read."""
    nh, hd, window, capacity, n_rows = 4, 32, 8, 12, 6
    k = mx.random.split(mx.random.key(0), 6)
    q, ring = mx.random.normal((2, nh, hd), key=k[0]), mx.random.normal((2, capacity, hd), key=k[1])
    fresh, rows = mx.random.normal((2, hd), key=k[2]), mx.random.normal((2, n_rows, hd), key=k[3])
    selected, sinks = mx.array([[1, 4, 0], [2, 0, 1]], mx.uint32), mx.random.normal((nh,), key=k[4])
    positions = mx.array([23, 3], mx.int32)
    got = kernels.decode_attention_rows_reference(q, ring, fresh, rows, selected, positions, sinks, window, 4,
                                                  picks=mx.array([True, False]))
    for b, chosen in ((0, selected[0]), (1, None)):
        want = kernels.decode_attention_reference(q[b], ring[b], fresh[b : b + 1], rows[b], chosen, positions[b],
                                                  sinks, window, 4)
        assert float(mx.abs(got[b] - want).max()) == 0.0
    junk = ring.at[1, (3 - 7) % capacity :].add(100.0)  # the slots of positions -4 .. -1
    again = kernels.decode_attention_rows_reference(q, junk, fresh, rows, selected, positions, sinks, window, 4,
                                                    picks=mx.array([True, False]))
    assert float(mx.abs(again[1] - got[1]).max()) == 0.0


def fp8_e4m3_then_f16(x, width, block=64):
    """ds4's rounding of kv rows in float64, apart from MLX: a power-of-two scale per block of the first
    `width` features, the nearest E4M3 value (ties to even; 3 mantissa bits, subnormal below 2^-6), then
    the nearest float16."""
    import numpy as np

    v = np.array(x, np.float64)
    for r in range(v.shape[0]):
        for b in range(0, width, block):
            blk = v[r, b : b + block]
            scale = 2.0 ** np.ceil(np.log2(max(np.abs(blk).max(), 1e-4) / 448.0))
            c = np.clip(blk / scale, -448.0, 448.0)
            step = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(c), 2.0 ** -6))), -6) - 3)
            v[r, b : b + block] = np.round(c / step) * step * scale  # np.round takes ties to even
    return v.astype(np.float16)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,dtype", [(1, mx.bfloat16), (6, mx.float32), (16, mx.bfloat16)])
def test_kv_rounding_kernel_matches_float64(T, dtype):
    """A kv row as the cache stores it under quant_sim (head dim 512, the first 448 features through FP8),
    rows of very different sizes, bit for bit against a float64 rounding that uses no MLX op."""
    import numpy as np

    x = (mx.random.normal((T, 512), key=mx.random.key(T)) * mx.power(10.0, mx.arange(T) % 9 - 5.0)[:, None]).astype(dtype)
    got = on_cuda(kernels.kv_rounding, x, 448, mx.float16)
    want = fp8_e4m3_then_f16(np.array(x.astype(mx.float32)), 448)
    assert got.dtype == mx.float16 and np.array_equal(np.array(got), want)


def fp4_e2m1_then_f16(x, block=32):
    """The indexer's FP4 rounding in float64, apart from MLX: a power-of-two scale per block, the nearest
    E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even one of the grid), then the nearest float16."""
    import numpy as np

    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    v = np.array(x, np.float64).reshape(-1, block)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(v).max(axis=1, keepdims=True), 7.052966e-38) / 6.0))
    c = np.clip(v / scale, -6.0, 6.0)
    gap = np.abs(np.abs(c)[..., None] - grid) + 1e-12 * (np.arange(8) % 2)  # a tie goes to the even index
    return (np.sign(c) * grid[gap.argmin(axis=-1)] * scale).reshape(np.shape(x)).astype(np.float16)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("shape", [(1, 64, 128), (6, 64, 128), (16, 64, 128), (3, 128)])
def test_fp4_rounding_kernel_matches_float64(shape):
    """The indexer's queries (64 heads of 128) and rows after their Hadamard transform under quant_sim,
    bit for bit against a float64 E2M1 rounding that uses no MLX op."""
    import numpy as np

    x = mx.random.normal(shape, key=mx.random.key(shape[0])) * mx.power(10.0, mx.arange(shape[0]) % 9 - 5.0).reshape(
        (-1,) + (1,) * (len(shape) - 1))
    got = on_cuda(kernels.fp4_rounding, x)
    assert got.dtype == mx.float32 and np.array_equal(np.array(got), fp4_e2m1_then_f16(np.array(x)))


def index_scores_float64(qi, w, rows, visible):
    """The indexer's scores in float64 with numpy: each head's product with each row, ReLU, weighted over the
    heads; rows at or past a query's visible count -inf."""
    import numpy as np

    qi, w, rows = (np.array(a.astype(mx.float32), np.float64) for a in (qi, w, rows))
    scores = np.einsum("th,thc->tc", w, np.maximum(np.einsum("thd,tcd->thc", qi, rows), 0))
    return np.where(np.arange(rows.shape[1])[None, :] < np.array(visible)[:, None], scores, -np.inf)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,columns,dtype,pooled", [(1, 2048, mx.float32, False), (6, 2048, mx.float16, False),
                                                    (3, 16384, mx.bfloat16, True), (16, 301, mx.float32, True)])
def test_index_scores_kernel_matches_float64(T, columns, dtype, pooled):
    """The real indexer's widths (64 heads of 128): a decoded token, a verify's rows, sessions of a pool reading
    their own rows of its flat buffer (some of them seeing none or part of them)."""
    import numpy as np

    qi, w = mx.random.normal((T, 64, 128), key=mx.random.key(T)), mx.random.normal((T, 64), key=mx.random.key(9))
    sessions = 3 if pooled else 1
    rows = mx.random.normal((sessions * columns, 128), key=mx.random.key(columns)).astype(dtype)
    pool_rows = mx.array(np.arange(T) % sessions, mx.int32)
    visible = mx.array(np.linspace(0, columns, T).astype(np.int32) if pooled else [columns - t for t in range(T)],
                       mx.int32)
    got = on_cuda(kernels._index_scores_cuda, qi, w, rows, visible, pool_rows, columns)
    own = np.array(rows.astype(mx.float32)).reshape(sessions, columns, 128)[np.array(pool_rows)]
    want = index_scores_float64(qi, w, mx.array(own), visible)
    got = np.array(got)
    assert got.shape == (T, columns) and np.array_equal(np.isinf(got), np.isinf(want))
    finite = ~np.isinf(want)
    assert np.abs(got[finite] - want[finite]).max(initial=0) <= 1e-5 * np.abs(want[finite]).max(initial=1)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,columns,k,levels", [(1, 2048, 512, 0), (6, 2048, 512, 7), (2, 43813, 512, 50),
                                                (3, 300, 512, 4), (4, 5000, 4096, 3)])
def test_top_rows_kernel_is_a_stable_sort(T, columns, k, levels):
    """The picks are numpy's stable sort of the negated scores, cut at k, in its order: distinct scores, or few
    values (long runs of equal ones across the k-th, both zeros among them), masked rows, fewer rows than k."""
    import numpy as np

    rng = np.random.default_rng(columns + levels)
    if levels:
        palette = np.concatenate([[-1.5, -0.0, 0.0, 2.0, 7.0, -np.inf, 0.25], np.arange(43) / 4.0])[:levels]
        scores = rng.choice(palette, (T, columns)).astype(np.float32)
    else:
        scores = rng.standard_normal((T, columns)).astype(np.float32)
    scores[:, columns - columns // 5 :] = -np.inf  # the rows past a session's visible ones
    got = on_cuda(kernels._top_rows_cuda, mx.array(scores), k)
    want = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    assert got.dtype == mx.uint32 and np.array_equal(np.array(got), want)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
def test_indexer_picks_of_the_kernels_are_the_plain_paths():
    """`index_top_rows` against the same scores and sort as MLX ops, on a pool's flat rows."""
    import numpy as np

    T, columns = 4, 3000
    qi, w = mx.random.normal((T, 64, 128), key=mx.random.key(1)), mx.random.normal((T, 64), key=mx.random.key(2))
    rows = mx.random.normal((2 * columns, 128), key=mx.random.key(3))
    visible, pool_rows = mx.array([3000, 2999, 700, 513], mx.int32), mx.array([0, 1, 1, 0], mx.int32)
    got = on_cuda(kernels.index_top_rows, qi, w, rows, visible, 512, pool_rows, columns)
    with mx.stream(mx.cpu):
        want = kernels.top_rows_reference(kernels.index_scores_reference(qi, w, rows, visible, pool_rows, columns), 512)
    # near-equal scores may sum to either order: the picks agree on all but a few
    same = np.mean([len(set(a) & set(b)) / 512 for a, b in zip(np.array(got), np.array(want))])
    assert got.shape == (T, 512) and same > 0.99


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,dtype,maps", [(1, mx.bfloat16, 3), (6, mx.float32, 3), (16, mx.bfloat16, 2),
                                          (3, mx.float16, 1)])
def test_logged_rows_kernel_matches_float64(T, dtype, maps):
    """A compressed layer's logged rows at the real widths (4096 -> the ratio-4 compressor's 2048 kv and score
    values, the indexer compressor's 512, the indexer's 64 head weights; the heavy compressor's 1024), against
    float64 of the same inputs with each product rounded to x's dtype."""
    import numpy as np

    sizes = {3: (2048, 512, 64), 2: (2048, 512), 1: (1024,)}[maps]
    x = mx.random.normal((T, 4096), key=mx.random.key(T)).astype(dtype)
    ws = [(0.02 * mx.random.normal((n, 4096), key=mx.random.key(n))).astype(dtype) for n in sizes]
    extras = [mx.random.normal((4, n), key=mx.random.key(n + 1)) for n in sizes[:2]] + [0.011] * (maps == 3)
    in_blocks = mx.array(np.arange(T) % 4, mx.int32)
    got = on_cuda(kernels.logged_rows, x, in_blocks, list(zip(ws, extras)))
    assert got is not None and len(got) == maps
    xs = np.array(x.astype(mx.float32), np.float64)
    for y, w, extra in zip(got, ws, extras):
        product = xs @ np.array(w.astype(mx.float32), np.float64).T
        with mx.stream(mx.cpu):
            product = np.array(mx.array(product.astype(np.float32)).astype(dtype).astype(mx.float32), np.float64)
        want = product + np.array(extra)[np.array(in_blocks)] if isinstance(extra, mx.array) else product * extra
        ulp = 0.0 if dtype == mx.float32 else 2.0 ** -7  # a product's rounding may go either way
        bound = ulp * np.abs(product) + 1e-5 * np.abs(product).max()
        assert y.dtype == mx.float32 and np.all(np.abs(np.array(y) - want) <= bound)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("use", ["queries", "kv", "output", "indexer", "float32"])
def test_norm_rope_kernel_matches_reference(use):
    """Real widths: a token's 64 query heads of 512 (normed, no weight), its kv row (normed with a
    weight), the attention output's inverse rotation (float32 in, bfloat16 out), the indexer's 64 heads
    of 128 (bfloat16 rounded, float32 out); against the MLX ops on the same GPU."""
    from ds4_mlx.models.numerics import Rope

    T, key = 3, mx.random.key(7)
    positions = mx.array([0, 8191, 1_000_003], mx.int32)
    rope = Rope(64, 160000.0)
    bf = mx.bfloat16
    weight = (1 + 0.1 * mx.random.normal((512,), key=key)).astype(bf)
    x = mx.random.normal((T, 64 * 512), key=key)
    args = {"queries": (x.astype(bf), rope, positions, 512, (None, 1e-6), False, (T, 64, 512)),
            "kv": (x[:, :512].astype(bf), rope, positions, 512, (weight, 1e-6)),
            "output": (x.reshape(T, 64, 512), rope, positions, 512, None, True, (T, 8, 4096), bf),
            "indexer": (x[:, : 64 * 128].astype(bf), rope, positions, 128, None, False, (T, 64, 128), mx.float32),
            "float32": (x[:, :512], rope, positions, 512, (weight.astype(mx.float32), 1e-6))}[use]
    got = on_cuda(kernels.norm_rope, *args)
    want = on_cuda(kernels.norm_rope_reference, *args)
    assert got.shape == want.shape and got.dtype == want.dtype
    err, top = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()), float(mx.abs(want).max())
    # a bfloat16 result may round the other way where the two compute the norm or the angle a bit apart
    assert err <= (1e-5 if use == "float32" else 2 ** -7) * top, f"max |diff| {err:.2e}"


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,dtype,kv_dtype", [(1, mx.bfloat16, None), (6, mx.float32, None),
                                              (6, mx.bfloat16, mx.float32)])
def test_norm_rope_pair_is_each_launch_alone(T, dtype, kv_dtype):
    """The queries' heads and the kv row in one launch (the kv row cast as its ring holds it, or not): the same
    bits as each in its own (real widths)."""
    from ds4_mlx.models.numerics import Rope

    positions = mx.arange(8185, 8185 + T).astype(mx.int32)
    rope, key = Rope(64, 160000.0), mx.random.key(T)
    q = mx.random.normal((T, 64 * 512), key=key).astype(dtype)
    kv = mx.random.normal((T, 512), key=mx.random.key(1)).astype(dtype)
    weight = (1 + 0.1 * mx.random.normal((512,), key=mx.random.key(2))).astype(dtype)
    got = on_cuda(kernels.norm_rope_pair, q, kv, rope, positions, 512, (None, 1e-6), (weight, 1e-6), (T, 64, 512),
                  kv_dtype)
    alone = (on_cuda(kernels.norm_rope, q, rope, positions, 512, (None, 1e-6), False, (T, 64, 512)),
             on_cuda(kernels.norm_rope, kv, rope, positions, 512, (weight, 1e-6), False, None, kv_dtype))
    for g, a in zip(got, alone):
        assert g.shape == a.shape and g.dtype == a.dtype and mx.array_equal(g, a).item()


def finished_rows_float64(logged, rows, weight, periods, ratio, overlap, eps):
    """A compressor's finished rows in float64 with numpy (but the rotation's angle): the per-channel softmax
    over each block's logged rows [n, span, 2 * width], the RMS norm, the rotation of the last pairs to the
    block's first position (blocks `rows`)."""
    import numpy as np

    n, d = logged.shape[0], weight.size
    W = logged.shape[-1] // 2
    kv, score = logged[..., :W], logged[..., W:]
    if overlap:
        before = (np.arange(logged.shape[1]) < ratio)[None, :, None]
        kv = np.where(before, kv[..., :d], kv[..., d:])
        valid = (np.array(rows) >= 1)[:, None, None]
        score = np.where(before, np.where(valid, score[..., :d], -np.inf), score[..., d:])
    e = np.exp(score - score.max(axis=1, keepdims=True))
    pooled = (e / e.sum(axis=1, keepdims=True) * kv).sum(axis=1)
    y = pooled / np.sqrt((pooled ** 2).mean(axis=1, keepdims=True) + eps) * np.array(weight.astype(mx.float32))
    periods = np.array(periods, np.float32)
    first = d // 2 - periods.size
    # the angle as the kernels and MLX's RoPE take it, in float32 (at position 2^18 that alone is ~1e-2 off)
    theta = ((np.array(rows) * ratio).astype(np.float32)[:, None] * (np.float32(1) / periods)[None, :]).astype(
        np.float64)
    a, b = y[:, 2 * first :: 2].copy(), y[:, 2 * first + 1 :: 2].copy()
    y[:, 2 * first :: 2], y[:, 2 * first + 1 :: 2] = a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)
    return y


def _compressor_case(head_dim, ratio, dtype, B):
    """A ring of a pool of 3 sessions at the real widths, fresh rows, a norm weight and the compressors' RoPE."""
    import numpy as np

    from ds4_mlx.models.numerics import Rope

    overlap = ratio == 4
    n, width = (2 if overlap else 1) * ratio, (2 if overlap else 1) * head_dim
    capacity = n + 8
    rng = np.random.default_rng(head_dim + ratio)
    ring = mx.array(rng.standard_normal((3 * capacity, 2 * width)), dtype)
    fresh = mx.array(rng.standard_normal((B, 2 * width)), mx.float32)
    weight = mx.array(1 + 0.1 * rng.standard_normal(head_dim), mx.bfloat16)
    return rng, overlap, n, capacity, ring, fresh, weight, Rope(64, 160000.0)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("head_dim,ratio,dtype", [(512, 4, mx.float32), (128, 4, mx.float32), (512, 128, mx.float16)])
def test_pooled_rows_kernel_matches_float64(head_dim, ratio, dtype):
    """A pooled step's compressor rows at the real widths (the ratio-4 compressor's 512 channels and the
    indexer compressor's 128, overlapping; the heavy ratio's 128 rows of 512), 5 tokens of a pool of 3
    sessions' rings, one token's block the first (no block before it)."""
    import numpy as np

    B = 5
    rng, overlap, n, capacity, ring, fresh, weight, rope = _compressor_case(head_dim, ratio, dtype, B)
    block = mx.array(np.array([0, 1, 2, 0, 1])[:, None] * capacity + rng.integers(0, capacity, (B, n)), mx.int32)
    in_blocks, open_row = mx.array(rng.integers(0, ratio, B), mx.int32), mx.array([0, 3, 70, 2047, 5], mx.int32)
    got = on_cuda(kernels.pooled_rows, fresh, ring, block, in_blocks, open_row, weight, rope, ratio, overlap, 1e-6)
    logged = np.array(ring.astype(mx.float32), np.float64)[np.array(block)]
    logged[np.arange(B), n - ratio + np.array(in_blocks)] = np.array(fresh.astype(dtype).astype(mx.float32))
    want = finished_rows_float64(logged, open_row, weight, np.array(rope.periods), ratio, overlap, 1e-6)
    assert got.shape == (B, head_dim) and got.dtype == mx.float32
    assert np.abs(np.array(got) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("head_dim,ratio,dtype,T", [(512, 4, mx.float32, 6), (128, 4, mx.float32, 6),
                                                    (512, 128, mx.float16, 300)])
def test_completed_rows_kernel_matches_float64(head_dim, ratio, dtype, T):
    """The blocks a step completes at the real widths: a verify's 6 rows completing two ratio-4 blocks (the
    indexer compressor's too), a prefill piece of 300 tokens completing two heavy blocks; their rows in
    the ring (a ring slot) or among the step's own (-1 - the row), as `RingSlots.blocks` gives them."""
    import numpy as np

    from ds4_mlx.cache.slots import block_sources

    rng, overlap, n, capacity, ring, fresh, weight, rope = _compressor_case(head_dim, ratio, dtype, T)
    ring = ring[:capacity] if ratio == 4 else mx.concatenate([ring] * 3)[: 3 * ratio]  # one session's ring
    start = 8186 if ratio == 4 else 16384 - 50
    first, last = start // ratio, (start + T) // ratio
    sources = block_sources(start, first, last, ratio, ring.shape[0])
    rows = mx.arange(first, last).astype(mx.int32)
    got = on_cuda(kernels.completed_rows, fresh, ring, sources, rows, weight, rope, ratio, overlap, 1e-6)
    s = np.array(sources)
    logged = np.where((s < 0)[..., None], np.array(fresh.astype(dtype).astype(mx.float32), np.float64)[np.maximum(-1 - s, 0)],
                      np.array(ring.astype(mx.float32), np.float64)[np.maximum(s, 0)])
    want = finished_rows_float64(logged, rows, weight, np.array(rope.periods), ratio, overlap, 1e-6)
    assert (s < 0).any() and (s >= 0).any() and got.shape == (last - first, head_dim)
    assert np.abs(np.array(got) - want).max() <= 1e-5 * np.abs(want).max()


def test_decode_attention_of_a_verify_is_each_row_decoded_in_turn():
    """A verify's rows (`consecutive`: one session's positions p, p + 1, ..., their fresh rows not yet in
    the ring) attend as if decoded one at a time, each after the rows before it were written into the ring;
    with a window shorter than the rows, the later rows' windows are fresh rows only."""
    nh, hd, capacity, n_rows, T = 4, 32, 24, 6, 6
    k = mx.random.split(mx.random.key(1), 6)
    q, ring = mx.random.normal((T, nh, hd), key=k[0]), mx.random.normal((capacity, hd), key=k[1])
    fresh, rows = mx.random.normal((T, hd), key=k[2]), mx.random.normal((n_rows, hd), key=k[3])
    selected, sinks = mx.random.randint(0, n_rows, (T, 3), key=k[4]).astype(mx.uint32), mx.random.normal((nh,), key=k[5])
    for window, start in ((8, 21), (8, 2), (4, 30)):
        positions = mx.arange(start, start + T, dtype=mx.int32)
        got = kernels.decode_attention_rows_reference(q, ring, fresh, rows, selected, positions, sinks, window, 4,
                                                      consecutive=True)
        written = mx.array(ring)
        for b in range(T):
            want = kernels.decode_attention_reference(q[b], written, fresh[b : b + 1], rows, selected[b],
                                                      positions[b], sinks, window, 4)
            assert float(mx.abs(got[b] - want).max()) == 0.0, (window, start, b)
            written[(start + b) % capacity] = fresh[b]


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("hd,start,ratio,top_k,window,dtype", [
    (512, 8190, 4, 512, 128, mx.bfloat16),  # CSA past its first window: the indexer's picks, real widths
    (512, 9000, 128, 0, 128, mx.bfloat16),  # HCA: every visible row
    (512, 60, 4, 0, 128, mx.float32),       # the first window: rows before position 0 masked
    (64, 300, 0, 0, 4, mx.float32),         # a window shorter than the rows: the last rows' are fresh only
])
def test_decode_attention_kernel_of_a_verify_matches_reference(hd, start, ratio, top_k, window, dtype):
    """Six drafted rows of one session verified in one launch (`consecutive`), its own ring and rows."""
    nh, T, capacity = 8, 6, 170
    n_rows = (start + T) // ratio if ratio else 0
    positions = mx.arange(start, start + T, dtype=mx.int32)
    k = mx.random.split(mx.random.key(hd + start), 6)
    q = mx.random.normal((T, nh, hd), key=k[0]).astype(mx.bfloat16)
    ring = mx.random.normal((capacity, hd), key=k[1]).astype(dtype)
    fresh = mx.random.normal((T, hd), key=k[2]).astype(dtype)
    rows = mx.random.normal((n_rows, hd), key=k[3]).astype(dtype) if ratio else None
    selected = (mx.stack([mx.random.permutation((start + 1) // ratio, key=key)[:top_k] for key in mx.random.split(k[4], T)])
                .astype(mx.uint32) if top_k else None)
    sinks = mx.random.normal((nh,), key=k[5])
    got = on_cuda(kernels.decode_attention, q, ring, fresh, rows, selected, positions, sinks, window, ratio, None,
                  None, None, True)
    with mx.stream(mx.cpu):
        want = kernels.decode_attention_rows_reference(q, ring, fresh, rows, selected, positions, sinks, window, ratio,
                                                       consecutive=True)
    assert got.shape == (T, nh, hd) and got.dtype == mx.float32
    err = float(mx.abs(got - want).max())
    assert err <= 1e-5 * max(1.0, float(mx.abs(want).max())), f"max |diff| {err:.2e}"


@pytest.mark.parametrize("T,K", [(1, 700), (37, 19)])
def test_attention_paths_agree(monkeypatch, T, K):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(T), 4)
    q, keys = mx.random.normal((T, 8, 64), key=k1), mx.random.normal((T, K, 64), key=k2)
    mask = mx.random.uniform(key=k3, shape=(T, K)) < 0.7
    mask[:, 0] = True  # every query sees at least one key, as the window's own row guarantees
    sinks = mx.random.normal((8,), key=k4)
    for m in (mask, None):
        out = {}
        for path in ("sdpa", "matmul"):
            monkeypatch.setenv("DS4_MLX_ATTENTION", path)
            out[path] = kernels.attend(q, keys, m, sinks, 64 ** -0.5)
        assert float(mx.abs(out["sdpa"] - out["matmul"]).max()) < 1e-5


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_expert_paths_agree(monkeypatch, dtype):
    """The per-expert loop (rows rounded up to 16 in half precision) and sorted gather_qmm give the same
    routed outputs (4-bit experts)."""
    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    model = random_model(tiny_args(0, num_hash_layers=0), expert_bits=4, dtype=dtype)
    moe = model.layers[0].ffn
    k1, k2 = mx.random.split(mx.random.key(1))
    x = mx.random.normal((50, model.args.hidden_size), key=k1).astype(dtype)
    chosen = mx.random.randint(0, model.args.n_routed_experts, (50, model.args.num_experts_per_tok), key=k2)
    out = {}
    for path in ("gather", "loop"):
        monkeypatch.setenv("DS4_MLX_EXPERT_PATH", path)
        out[path] = moe._experts(x, chosen)
    assert out["loop"].shape == (50, model.args.num_experts_per_tok, model.args.hidden_size)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(out["gather"] - out["loop"]).max()) < tolerance * float(mx.abs(out["gather"]).max())
    # new expert weights are seen by the loop's cached per-expert views
    moe.update(random_model(tiny_args(0, num_hash_layers=0), seed=1, expert_bits=4, dtype=dtype).layers[0].ffn
               .parameters())
    assert float(mx.abs(moe._experts(x, chosen) - out["loop"]).max()) > 0
    monkeypatch.setenv("DS4_MLX_EXPERT_PATH", "gather")
    regathered = moe._experts(x, chosen)
    monkeypatch.setenv("DS4_MLX_EXPERT_PATH", "loop")
    assert float(mx.abs(regathered - moe._experts(x, chosen)).max()) < tolerance * float(mx.abs(regathered).max())


def test_compiled_parts_see_new_parameters():
    """The compiled projections and MoE read the module's parameters at every call, not at tracing."""
    from mlx.utils import tree_flatten

    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    args = tiny_args(0)
    model, other = random_model(args, seed=0), random_model(args, seed=1)
    ids = mx.array([[3]])
    first = model(ids, model.make_cache())  # one token: compiled MoE and attention projections
    model.update(other.parameters())
    again = model(ids, model.make_cache())
    assert float(mx.abs(again - other(ids, other.make_cache())).max()) == 0
    assert float(mx.abs(again - first).max()) > 0
    assert len(tree_flatten(model.parameters())) == len(tree_flatten(other.parameters()))


def test_indexer_tiles_do_not_change_the_logits(monkeypatch):
    import numpy as np

    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.models import attention
    from ds4_mlx.tools.testing import tiny_args

    model = random_model(tiny_args(0), seed=0)
    ids = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, (1, 300)), dtype=mx.int32)
    whole = model(ids)
    monkeypatch.setattr(attention, "INDEXER_TILE_BYTES", 1)  # one compressed row a tile
    assert float(mx.abs(model(ids) - whole).max()) == 0


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,m", [(1, 24), (3, 4), (8, 24)])
def test_hc_project_kernel_matches_reference(T, m):
    k1, k2 = mx.random.split(mx.random.key(T))
    flat, fn = 3 * mx.random.normal((T, 16384), key=k1), mx.random.normal((m, 16384), key=k2) / 64
    got = on_cuda(kernels.hc_project, flat, fn, 1e-6)
    with mx.stream(mx.cpu):
        want = kernels.hc_project_reference(flat, fn, 1e-6)
    assert got.shape == (T, m)
    assert float(mx.abs(got - want).max()) <= 1e-5 * float(mx.abs(want).max())


def quantized_experts(n, out, inp, bits, group_size, dtype, key):
    w = mx.random.normal((n, out, inp), key=key) / inp**0.5
    packed, scales, biases = mx.quantize(w, group_size, bits)
    return packed, scales.astype(dtype), biases.astype(dtype), group_size, bits


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,k,H,I,bits,group_size,dtype,ids", [
    (1, 6, 4096, 2048, 2, 64, mx.float16, mx.uint32),    # V4 Flash widths, 2-bit experts, top-k's ids
    (1, 6, 4096, 2048, 4, 64, mx.bfloat16, mx.int32),    # a hash layer's ids
    (3, 2, 256, 128, 8, 32, mx.float32, mx.uint32),      # a few tokens, 8-bit: a group holds two 16-byte chunks
    (2, 6, 512, 256, 2, 32, mx.bfloat16, mx.int32),      # a 2-bit chunk holds two groups
])
def test_routed_experts_kernel_matches_reference(T, k, H, I, bits, group_size, dtype, ids):
    keys = mx.random.split(mx.random.key(bits + T), 6)
    n = 16
    x = mx.random.normal((T, H), key=keys[0])
    chosen = mx.random.randint(0, n, (T, k), key=keys[1]).astype(ids)
    weights = mx.random.uniform(0.1, 2.0, (T, k), key=keys[2])
    gate, up = (quantized_experts(n, I, H, bits, group_size, dtype, key) for key in keys[3:5])
    down = quantized_experts(n, H, I, bits, group_size, dtype, keys[5])
    limit = 0.5  # low enough that the clamps act
    got = on_cuda(kernels.routed_experts, x, chosen, weights, gate, up, down, limit)
    with mx.stream(mx.cpu):
        want = kernels.routed_experts_reference(x, chosen, weights, gate, up, down, limit)
    assert got.shape == (T, H) and got.dtype == mx.float32
    err = float(mx.abs(got - want).max())
    assert err <= 2e-5 * float(mx.abs(want).max()), f"max |diff| {err:.2e}"


def test_routed_experts_kernel_reads_whole_word_formats_only():
    """3-bit values straddle words: such stacks go the plain way (the kernel answers None)."""
    keys = mx.random.split(mx.random.key(3), 4)
    assert not kernels._fits(quantized_experts(4, 64, 128, 3, 64, mx.float16, keys[0]), rows=2)
    for bits, key in zip((2, 4, 8), keys[1:]):
        assert kernels._fits(quantized_experts(4, 64, 128, bits, 64, mx.float16, key), rows=2)


def router_case(T, E, H, dtype, seed):
    """x [T, H] in `dtype`, a router weight [E, H] and bias [E] float32 with logits of order one."""
    keys = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((T, H), key=keys[0]).astype(dtype)
    weight = mx.random.normal((E, H), key=keys[1]) / H**0.5
    return x, weight, 0.1 * mx.random.normal((E,), key=keys[2])


def router_float64(x, weight, bias):
    """Logits, scores and biased scores of a router in float64."""
    import numpy as np

    logits = np.array(x.astype(mx.float32), np.float64) @ np.array(weight, np.float64).T
    scores = np.sqrt(np.logaddexp(logits, 0.0))
    return scores, scores + np.array(bias, np.float64)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,E,H,k,dtype", [
    (1, 256, 4096, 6, mx.bfloat16),   # V4 Flash widths, a decoded token
    (6, 256, 4096, 6, mx.float32),    # a verify
    (10, 256, 4096, 6, mx.float16),   # past one group of tokens
    (16, 256, 4096, 6, mx.bfloat16),  # the most tokens the kernels take
    (3, 8, 64, 2, mx.float32),        # a tiny model's router
])
def test_router_kernel_matches_float64(T, E, H, k, dtype):
    """The experts by falling biased score (compared where the k-th and the next are apart) and their
    weights from the unbiased scores, against float64."""
    import numpy as np

    x, weight, bias = router_case(T, E, H, dtype, seed=T + E)
    chosen, weights = on_cuda(kernels.router, x, weight, bias, k, 2.5)
    assert chosen.shape == weights.shape == (T, k) and weights.dtype == mx.float32
    scores, biased = router_float64(x, weight, bias)
    chosen = np.array(chosen).astype(np.int64)
    order = np.argsort(-biased, axis=1, kind="stable")
    ranked = np.take_along_axis(biased, order, 1)
    apart = ranked[:, k - 1] - ranked[:, k] > 1e-5  # else either expert may be the k-th
    assert apart.sum() >= T - 1
    assert (chosen[apart] == order[apart, :k]).all()  # the same experts, in the same order
    picked = np.take_along_axis(scores, chosen, 1)
    want = picked / picked.sum(axis=1, keepdims=True) * 2.5
    assert np.abs(np.array(weights) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
def test_router_kernel_takes_the_lowest_of_equal_experts():
    """Experts 9 and 5 share their row and a bias that puts them first: 5 is picked first, as MLX's stable
    sort on CUDA picks in the definition."""
    import numpy as np

    x, weight, bias = (np.array(a) for a in router_case(4, 64, 256, mx.float32, seed=1))
    weight[[5, 9]], bias[[5, 9]] = weight[3], 10.0
    x, weight, bias = mx.array(x), mx.array(weight), mx.array(bias)
    chosen, weights = on_cuda(kernels.router, x, weight, bias, 1, 1.0)
    assert chosen[:, 0].tolist() == [5] * 4 and weights[:, 0].tolist() == [1.0] * 4
    want, _ = on_cuda(kernels.router_reference, x, weight, bias, 1, 1.0)
    assert want[:, 0].tolist() == [5] * 4


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,dtype,table", [(1, mx.bfloat16, mx.int32), (7, mx.float32, mx.uint32)])
def test_hashed_router_kernel_matches_float64(T, dtype, table):
    """A hash layer's experts from its table by the token ids, and their weights against float64."""
    import numpy as np

    x, weight, _ = router_case(T, 256, 4096, dtype, seed=T)
    tid2eid = mx.random.permutation(256, key=mx.random.key(T))[:60].reshape(10, 6).astype(table)
    ids = mx.array([(3 * i + 1) % 10 for i in range(T)], dtype=mx.int32)
    chosen, weights = on_cuda(kernels.hashed_router, x, weight, tid2eid, ids, 1.5)
    want_chosen = np.array(tid2eid)[np.array(ids)]
    assert chosen.dtype == table and (np.array(chosen) == want_chosen).all()
    scores, _ = router_float64(x, weight, mx.zeros((256,)))
    picked = np.take_along_axis(scores, want_chosen.astype(np.int64), 1)
    want = picked / picked.sum(axis=1, keepdims=True) * 1.5
    assert weights.shape == (T, 6) and np.abs(np.array(weights) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
def test_kernels_pass_their_self_checks():
    """On a GPU every kernel with a launch there passes its self-check (else the tests above would
    compare the definition with itself)."""
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        kind = kernels.backend()
        every = [k for k in vars(kernels).values() if isinstance(k, kernels.Kernel)]
        every += [k for table in vars(kernels).values() if isinstance(table, dict) for k in table.values()
                  if isinstance(k, kernels.Kernel)]
        assert len(every) >= 10
        for kernel in every:
            if kind in kernel.launches:
                assert kernel.backend() == kind, kernel.name
    finally:
        mx.set_default_device(previous)


# ---------------------------------------------------------------------------------------------------------
# the self-check and the switch, on any device: a fake backend whose hc_mix launch is injected


@pytest.fixture
def fake_backend(monkeypatch):
    """A backend named "fake" for the default device; kernels start unchecked and switched on."""
    monkeypatch.setattr(kernels, "backend", lambda: "fake")
    monkeypatch.setattr(kernels.HC_MIX, "verdicts", {})
    monkeypatch.setattr(kernels, "_enabled", True)
    return lambda launch: monkeypatch.setitem(kernels.HC_MIX.launches, "fake", launch)


def _tiny_logits(model, n=12):
    ids = mx.array([[(7 * i) % model.args.vocab_size for i in range(n)]], dtype=mx.int32)
    cache = model.make_cache()
    outs = [model(ids[:, :n - 4], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(n - 4, n)]
    return mx.concatenate(outs, axis=1)  # a prefill, then decoded tokens (compiled graphs)


def _plain_logits(model):
    kernels.use_kernels(False)
    try:
        return _tiny_logits(model)
    finally:
        kernels.use_kernels(True)


def test_a_wrong_kernel_turns_itself_off(fake_backend, capsys):
    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    def wrong(*args):
        x, post, comb = kernels.hc_mix_reference(*args)
        return x + 1.0, post, comb

    fake_backend(wrong)
    model = random_model(tiny_args(0))
    got = _tiny_logits(model)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "custom kernel hc_mix disagrees" in err and "fake" in err
    assert kernels.HC_MIX.verdicts == {"fake": False}
    assert mx.array_equal(got, _plain_logits(model)).item()
    _tiny_logits(model)
    assert capsys.readouterr().err == ""  # checked once a process and backend


def test_a_kernel_wrong_in_one_of_its_forms_turns_itself_off(monkeypatch, capsys):
    """A self-check of several samples (one a form the kernel takes: here decode attention's pooled tokens
    and a verify's rows) passes only where every sample agrees."""
    monkeypatch.setattr(kernels, "backend", lambda: "fake")
    monkeypatch.setattr(kernels, "_enabled", True)
    kernel = kernels.DECODE_ATTENTION
    monkeypatch.setattr(kernel, "verdicts", {})

    def wrong_on_a_verify(*args):
        out = kernel.definition(*args)
        return out + 1.0 if args[-1] is True else out

    monkeypatch.setitem(kernel.launches, "fake", wrong_on_a_verify)
    assert kernel.backend() is None and kernel.verdicts == {"fake": False}
    assert "decode_attention disagrees" in capsys.readouterr().err
    monkeypatch.setattr(kernel, "verdicts", {})
    monkeypatch.setitem(kernel.launches, "fake", kernel.definition)
    assert kernel.backend() == "fake"


def test_every_self_check_runs_with_its_definition_as_the_launch(monkeypatch, capsys):
    """On any device, each kernel's samples, definition and comparison go through its self-check, with the
    definition standing in for the launch: a sample or comparison that could not run would turn a right
    kernel off on a GPU."""
    monkeypatch.setattr(kernels, "backend", lambda: "fake")
    monkeypatch.setattr(kernels, "_enabled", True)
    every = [k for k in vars(kernels).values() if isinstance(k, kernels.Kernel)]
    every += [k for table in vars(kernels).values() if isinstance(table, dict) for k in table.values()
              if isinstance(k, kernels.Kernel)]
    assert len(every) >= 20
    for kernel in every:
        monkeypatch.setattr(kernel, "verdicts", {})
        monkeypatch.setitem(kernel.launches, "fake", kernel.definition)
        assert kernel.backend() == "fake", (kernel.name, capsys.readouterr().err)


def test_the_routers_self_check_takes_any_order_of_the_same_experts(monkeypatch, capsys):
    """The definition leaves the order of the chosen experts open: a launch that returns them in another
    order (with their weights) passes; one that swaps an expert for another does not."""
    monkeypatch.setattr(kernels, "backend", lambda: "fake")
    monkeypatch.setattr(kernels, "_enabled", True)
    kernel = kernels.ROUTER

    def reversed_order(*args):
        chosen, weights = kernel.definition(*args)
        return chosen[:, ::-1], weights[:, ::-1]

    def one_expert_off(*args):
        chosen, weights = kernel.definition(*args)
        return mx.concatenate([(chosen[:, :1] + 1) % args[1].shape[0], chosen[:, 1:]], axis=1), weights

    for launch, passes in ((reversed_order, True), (one_expert_off, False)):
        monkeypatch.setattr(kernel, "verdicts", {})
        monkeypatch.setitem(kernel.launches, "fake", launch)
        assert (kernel.backend() == "fake") is passes
    assert "router disagrees" in capsys.readouterr().err


def test_moe_routes_a_few_tokens_through_the_router_kernels(monkeypatch):
    """Top-k and hash layers take the router kernels for up to FEW_ROWS_MAX tokens (decoded ones in the
    compiled graph included) and the plain routing past that; a quantized router always the plain one."""
    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    monkeypatch.setattr(kernels, "backend", lambda: "fake")
    monkeypatch.setattr(kernels, "_enabled", True)
    calls = []
    for kernel in (kernels.ROUTER, kernels.HASHED_ROUTER):
        def launch(*args, _kernel=kernel):
            calls.append((_kernel.name, args[0].shape[0]))
            return _kernel.definition(*args)

        monkeypatch.setattr(kernel, "verdicts", {"fake": True})
        monkeypatch.setitem(kernel.launches, "fake", launch)
    ids = mx.array([list(range(1, 22))], dtype=mx.int32)
    for quantized_routers in (0, 1):
        model = random_model(tiny_args(0))
        for layer in model.layers[len(model.layers) - quantized_routers:]:
            layer.ffn.gate = layer.ffn.gate.to_quantized(group_size=32, bits=8)
        cache = model.make_cache()
        calls.clear()
        mx.eval(model(ids[:, :20], cache=cache), model(ids[:, 20:], cache=cache))  # a prefill, a decoded token
        assert sorted(calls) == [("hashed_router", 1)] * 3 + [("router", 1)] * (3 - quantized_routers)


def test_switching_kernels_off_reaches_compiled_graphs(fake_backend, capsys):
    """A kernel right on its self-check's sizes but wrong at the model's: on, it changes the answer,
    compiled decode graphs included; switched off, every graph runs the definition again."""
    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    def wrong_when_wide(*args):
        x, post, comb = kernels.hc_mix_reference(*args)
        return (x + 1.0 if x.shape[-1] > 64 else x), post, comb

    fake_backend(wrong_when_wide)
    args = tiny_args(0, hidden_size=128)
    plain = _plain_logits(random_model(args))  # a model of its own: its own compiled graphs
    model = random_model(args)
    with_kernel = _tiny_logits(model)  # compiles the decode graphs with the kernel in them
    assert kernels.HC_MIX.verdicts == {"fake": True} and capsys.readouterr().err == ""
    assert not mx.allclose(with_kernel[:, -1], plain[:, -1]).item()
    assert mx.array_equal(_plain_logits(model), plain).item()


def test_the_switch_keeps_the_algorithm(monkeypatch):
    """Switching kernels off swaps kernels for their definitions only: the per-backend choices stay."""
    from ds4_mlx.models import moe

    monkeypatch.delenv("DS4_MLX_EXPERT_PATH", raising=False)
    monkeypatch.delenv("DS4_MLX_ATTENTION", raising=False)
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(moe, "backend", lambda: "cuda")
    on = (moe.expert_path(), kernels.attention_path(16))
    kernels.use_kernels(False)
    try:
        assert (moe.expert_path(), kernels.attention_path(16)) == on == ("loop", "matmul")
    finally:
        kernels.use_kernels(True)


def test_no_kernels_flag(monkeypatch, tmp_path, capsys):
    from ds4_mlx import cli

    monkeypatch.setattr(kernels, "_enabled", True)
    monkeypatch.setenv("DS4_MLX_KERNELS", "1")
    assert cli.main(["--no-kernels", "convert", str(tmp_path / "none.gguf"), str(tmp_path / "out"), "--quiet"]) == 1
    assert "no such file" in capsys.readouterr().err
    assert not kernels._enabled and os.environ["DS4_MLX_KERNELS"] == "0"


GGUF_ROWS_SHAPES = [(6, 1, 2048, 4096, 0), (12, 12, 4096, 2048, 0), (36, 6, 2048, 4096, 0), (3, 3, 8, 256, 0),
                    (6, 2, 41, 512, 1)]


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("codec", ["iq2_xxs", "q2_k"])
@pytest.mark.parametrize("pairs,rows,out,inp,offset,dtype",
                         [(*shape, dtype) for shape in GGUF_ROWS_SHAPES for dtype in (mx.float32, mx.bfloat16)]
                         + [(*shape, mx.float16) for shape in GGUF_ROWS_SHAPES[3:]])
def test_gguf_rows_kernel_matches_gguf(codec, pairs, rows, out, inp, offset, dtype):
    """The kernel for routed experts kept in GGUF blocks against the `gguf` package's dequantization: each
    pair's row of x (consecutive pairs share one: a token's experts), x and the result in x's dtype. Rows
    a block takes need not divide the output rows, and an odd count leaves a warp one row; x may be a view
    that starts `offset` values into its array, off a wide word. 16-bit x takes the tensor-core body."""
    import numpy as np
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.models import gguf_blocks

    w = gguf_blocks.random_blocks(codec, (16, out, gguf_blocks.row_bytes(codec, inp)), seed=pairs)
    x = mx.random.normal((rows * inp + offset,), key=mx.random.key(out)).astype(dtype)[offset:].reshape(rows, inp)
    indices = mx.random.randint(0, 16, (pairs,), key=mx.random.key(inp)).astype(mx.uint32)
    got = on_cuda(kernels.gguf_rows, x, w, indices, codec)
    assert on_cuda(kernels._gguf_rows_tensor_cores, x, codec, w.shape[-1], False) == (dtype != mx.float32)
    values = gguf.quants.dequantize(np.array(w), T[codec.upper()])  # [16, out, inp]
    xs = np.repeat(np.array(x.astype(mx.float32), np.float64), pairs // rows, axis=0)
    want = np.einsum("pi,poi->po", xs, values[np.array(indices)].astype(np.float64))
    assert got.shape == (pairs, out) and got.dtype == dtype
    tolerance = 1e-5 if dtype == mx.float32 else 1e-2  # the result rounded to 16 bits
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= tolerance * np.abs(want).max()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("codec", ["iq2_xxs", "q2_k"])
@pytest.mark.parametrize("pairs,rows,out", [(6, 1, 2048), (36, 6, 2048), (6, 1, 41)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gguf_rows_glu_kernel_matches_gguf(codec, pairs, rows, out, dtype):
    """The rows kernel's GLU form (a token's gate and up experts and the clamped SwiGLU in one launch)
    against float64 over the `gguf` package's dequantization; an odd output count leaves a block's last
    warps no row."""
    import numpy as np
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.models import gguf_blocks

    inp, limit = 4096, 2.0
    gate, up = (gguf_blocks.random_blocks(codec, (16, out, gguf_blocks.row_bytes(codec, inp)), seed=seed)
                for seed in (pairs, pairs + 1))
    x = mx.random.normal((rows, inp), key=mx.random.key(out)).astype(dtype)
    indices = mx.random.randint(0, 16, (pairs,), key=mx.random.key(inp)).astype(mx.uint32)
    got = on_cuda(kernels.gguf_rows_glu, x, gate, up, indices, codec, limit)
    assert on_cuda(kernels._gguf_rows_tensor_cores, x, codec, gate.shape[-1], True) == (dtype != mx.float32)
    xs = np.repeat(np.array(x.astype(mx.float32), np.float64), pairs // rows, axis=0)
    g, u = (np.einsum("pi,poi->po", xs, gguf.quants.dequantize(np.array(m), T[codec.upper()])[np.array(indices)]
                      .astype(np.float64)) for m in (gate, up))
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    want = g / (1 + np.exp(-g)) * u
    assert got.shape == (pairs, out) and got.dtype == dtype
    tolerance = 1e-5 if dtype == mx.float32 else 1e-2
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= tolerance * np.abs(want).max()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
def test_gguf_expert_rows_match_the_plain_experts():
    """A few tokens' routed GGUF experts in the rows kernel's two launches (`linear.gguf_expert_rows`: gate,
    up and SwiGLU; then down) against the plain path with the kernels off, token by token and expert by
    expert (a hash layer may pick one expert twice)."""
    from ds4_mlx.models import gguf_blocks
    from ds4_mlx.models.linear import GGUFSwitchLinear, gguf_expert_rows

    experts = {}
    for name, codec, inp, out in (("gate", "iq2_xxs", 512, 256), ("up", "iq2_xxs", 512, 256), ("down", "q2_k", 256, 512)):
        experts[name] = GGUFSwitchLinear(8, inp, out, codec)
        experts[name].weight = gguf_blocks.random_blocks(codec, experts[name].weight.shape, seed=len(name))
    x = mx.random.normal((3, 512), key=mx.random.key(4)).astype(mx.bfloat16)
    chosen = mx.array([[0, 5], [7, 1], [3, 3]], mx.int32)
    got = on_cuda(gguf_expert_rows, experts, x, chosen, 2.0)
    weights = mx.array([[0.5, 1.5], [-0.25, 2.0], [1.0, 0.75]], mx.float32)
    weighted = on_cuda(gguf_expert_rows, experts, x, chosen, 2.0, weights)

    def plain():
        e, rows = experts, x[:, None, None, :]
        h = kernels.clamped_swiglu(e["gate"](rows, chosen), e["up"](rows, chosen), 2.0)
        return e["down"](h, chosen)[:, :, 0, :]

    kernels.use_kernels(False)
    try:
        want = on_cuda(plain)
    finally:
        kernels.use_kernels(True)
    assert got.shape == want.shape == (3, 2, 512) and got.dtype == mx.bfloat16
    err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    assert err <= 2e-2 * float(mx.abs(want.astype(mx.float32)).max())  # bfloat16 roundings of h and y
    want = want.astype(mx.float32) * weights[..., None]
    assert weighted.dtype == mx.bfloat16
    assert float(mx.abs(weighted.astype(mx.float32) - want).max()) <= 2e-2 * float(mx.abs(want).max())


def test_gguf_rows_definition_matches_gguf():
    """The kernel's definition, on any device, against the `gguf` package (the CUDA test's oracle too), and in
    the shape of its indices."""
    import numpy as np
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    for codec in ("iq2_xxs", "q2_k"):
        x, w, indices, _ = kernels._gguf_rows_sample(codec)
        values = gguf.quants.dequantize(np.array(w), T[codec.upper()])
        xs = np.repeat(np.array(x, np.float64), indices.size // x.shape[0], axis=0)  # pairs sharing rows of x
        want = np.einsum("pi,poi->po", xs, values[np.array(indices)].astype(np.float64))
        got = np.array(kernels.gguf_rows_reference(x, w, indices, codec))
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert kernels.gguf_rows(x, w, indices, codec) is None  # no kernel on the CPU: the caller's own path
        # a token's experts as the router gives them ([T, k]): the same rows in that shape
        by_token = kernels.gguf_rows_reference(x, w, indices.reshape(x.shape[0], -1), codec)
        assert by_token.shape == (x.shape[0], indices.size // x.shape[0], w.shape[1])
        assert (np.array(by_token).reshape(got.shape) == got).all()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("codec", ["iq2_xxs", "q2_k"])
def test_gguf_dequantize_kernel_matches_gguf(codec):
    import numpy as np
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.models import gguf_blocks

    w = gguf_blocks.random_blocks(codec, (3, 2048, gguf_blocks.row_bytes(codec, 4096)), seed=9)
    got = on_cuda(kernels.gguf_dequantize, w, codec)
    assert got.dtype == mx.float32
    want = gguf.quants.dequantize(np.array(w), T[codec.upper()])
    assert np.abs(np.array(got) - want).max() <= 1e-6 * np.abs(want).max()  # a fused multiply-add at most
    for dtype in (mx.bfloat16, mx.float16):  # written in the product's dtype, each value rounded once
        got = on_cuda(kernels.gguf_dequantize, w, codec, dtype)
        assert got.dtype == dtype
        rounded = np.array(mx.array(want).astype(dtype).astype(mx.float32))
        assert np.abs(np.array(got.astype(mx.float32)) - rounded).max() <= 2.0 ** -8 * np.abs(want).max()


def _few_rows_case(rows, groups, out, inp, dtype, seed=None):
    w, scales, biases = mx.quantize(0.02 * mx.random.normal((groups, out, inp), key=mx.random.key(seed or out)),
                                    group_size=32, bits=8)
    x = mx.random.normal((rows, groups, inp), key=mx.random.key(rows)).astype(dtype)
    return x, w, scales.astype(mx.float16), biases.astype(mx.float16)


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("groups,out,inp", [(1, 1024, 4096), (8, 1024, 4096), (1, 4096, 2048)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_few_rows_kernel_matches_dequantized_product(groups, out, inp, dtype):
    """The 8-bit product of a few rows against float64 products of MLX's own dequantization, and each row
    the same bits whatever the number of rows beside it (a decoded token, a verify, a batched step; 16-bit
    x on tensor cores, 8 rows a tile), and wherever x starts (a view off a 16-byte word)."""
    import numpy as np

    x, w, scales, biases = _few_rows_case(16, groups, out, inp, dtype)
    with mx.stream(mx.cpu):
        weights = np.array(mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), 32, 8), np.float64)
    want = np.einsum("mgk,gok->mgo", np.array(x.astype(mx.float32), np.float64), weights)
    for rows in (16, 1, 6, 8, 9):
        got = on_cuda(kernels.few_rows, x[:rows], w, scales, biases, 32, 8, "affine")
        assert got.shape == (rows, groups, out) and got.dtype == dtype
        tolerance = 1e-5 if dtype == mx.float32 else 1e-2
        assert np.abs(np.array(got.astype(mx.float32)) - want[:rows]).max() <= tolerance * np.abs(want).max()
        if rows == 16:
            every = np.array(got.astype(mx.float32))
        else:
            assert (np.array(got.astype(mx.float32)) == every[:rows]).all()
        if groups == 1:  # one map as a layer holds it, x as a decoded token's rows: the same bits, no views
            flat = on_cuda(kernels.few_rows, x[:rows, 0], w[0], scales[0], biases[0], 32, 8, "affine")
            assert flat.shape == (rows, out) and mx.array_equal(flat, got[:, 0]).item()
    shifted = mx.concatenate([mx.zeros((1,), dtype), x[:6].reshape(-1)])[1:].reshape(6, groups, inp)
    got = on_cuda(kernels.few_rows, shifted, w, scales, biases, 32, 8, "affine")
    assert (np.array(got.astype(mx.float32)) == every[:6]).all()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_few_rows_glu_and_add_match_float64(dtype):
    """The shared expert's two fused forms at real widths: gate and up with the clamped SwiGLU (4096 -> 2048),
    and down plus the routed experts' sum (2048 -> 4096; or plus their six rows, summed in the launch),
    against float64 over MLX's dequantization; each row the same bits whatever the number of rows beside it."""
    import numpy as np

    def float64(w, scales, biases):
        with mx.stream(mx.cpu):
            return np.array(mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), 32, 8)[0],
                            np.float64)

    limit = 2.0
    x, *gate = _few_rows_case(16, 1, 2048, 4096, dtype)
    up = _few_rows_case(1, 1, 2048, 4096, dtype, seed=1)[1:]
    h, *down = _few_rows_case(16, 1, 4096, 2048, dtype)
    addend = mx.random.normal((16, 1, 4096), key=mx.random.key(3)).astype(dtype)
    xs = np.array(x.astype(mx.float32), np.float64)[:, 0]
    g, u = xs @ float64(*gate).T, xs @ float64(*up).T
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    want_glu = g / (1 + np.exp(-g)) * u
    want_add = np.array(addend.astype(mx.float32), np.float64)[:, 0] + np.array(
        h.astype(mx.float32), np.float64)[:, 0] @ float64(*down).T
    terms = mx.random.normal((16, 6, 4096), key=mx.random.key(4)).astype(dtype)
    want_terms = want_add - np.array(addend.astype(mx.float32), np.float64)[:, 0] + np.array(
        terms.astype(mx.float32), np.float64).sum(axis=1)
    tolerance = 1e-5 if dtype == mx.float32 else 1e-2
    for rows in (16, 1, 6, 9):
        glu = on_cuda(kernels.few_rows_glu, x[:rows], (*gate, 32, 8, "affine"), (*up, 32, 8, "affine"), limit)
        added = on_cuda(lambda *a: kernels.few_rows(*a, addend=addend[:rows]), h[:rows], *down, 32, 8, "affine")
        summed = on_cuda(lambda *a: kernels.few_rows(*a, addend=terms[:rows]), h[:rows], *down, 32, 8, "affine")
        for got, want in ((glu, want_glu), (added, want_add), (summed, want_terms)):
            assert got.shape == (rows, 1, want.shape[-1]) and got.dtype == dtype
            assert np.abs(np.array(got.astype(mx.float32))[:, 0] - want[:rows]).max() <= tolerance * np.abs(want).max()
        if rows == 16:
            every = [np.array(glu.astype(mx.float32)), np.array(added.astype(mx.float32))]
        else:
            assert (np.array(glu.astype(mx.float32)) == every[0][:rows]).all()
            assert (np.array(added.astype(mx.float32)) == every[1][:rows]).all()


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_few_rows_pair_is_each_product_alone(dtype):
    """Two maps that read the same rows in one launch (the queries' first map, 4096 -> 1024, and the kv
    rows', 4096 -> 512): each output the same bits as its own product, and that against float64."""
    import numpy as np

    x, *first = _few_rows_case(16, 1, 1024, 4096, dtype)
    second = _few_rows_case(1, 1, 512, 4096, dtype, seed=1)[1:]
    first, second = [a[0] for a in first], [a[0] for a in second]  # as a layer holds them: [out, in]
    with mx.stream(mx.cpu):
        weights = np.array(mx.dequantize(*first[:1], first[1].astype(mx.float32), first[2].astype(mx.float32), 32, 8),
                           np.float64)
    for rows in (1, 6, 16):
        a, b = on_cuda(kernels.few_rows_pair, x[:rows, 0], (*first, 32, 8, "affine"), (*second, 32, 8, "affine"))
        assert a.shape == (rows, 1024) and b.shape == (rows, 512) and a.dtype == b.dtype == dtype
        assert mx.array_equal(a, on_cuda(kernels.few_rows, x[:rows, 0], *first, 32, 8, "affine")).item()
        assert mx.array_equal(b, on_cuda(kernels.few_rows, x[:rows, 0], *second, 32, 8, "affine")).item()
        want = np.array(x[:rows, 0].astype(mx.float32), np.float64) @ weights.T
        tolerance = 1e-5 if dtype == mx.float32 else 1e-2
        assert np.abs(np.array(a.astype(mx.float32)) - want).max() <= tolerance * np.abs(want).max()



def test_few_rows_tensor_core_samples_are_exact():
    """The tensor-core body's self-check allows 1e-4 of the largest output, less than its output's rounding to
    bfloat16: each sample's products, in float64 over the codes as bytes, are exact in x's dtype and are
    what the definition gives."""
    import numpy as np

    for x, w, scales, biases, group_size in kernels._few_rows_exact_samples():
        codes = np.array(w).view(np.uint8).astype(np.float64)
        affine = [np.repeat(np.array(a.astype(mx.float32), np.float64), group_size, -1) for a in (scales, biases)]
        want = np.einsum("mgk,gok->mgo", np.array(x.astype(mx.float32), np.float64), codes * affine[0] + affine[1])
        assert (np.array(mx.array(want.astype(np.float32)).astype(x.dtype).astype(mx.float32)) == want).all()
        assert (np.array(kernels.few_rows_reference(x, w, scales, biases, group_size)) == want).all()

def test_few_rows_definition_matches_quantized_matmul():
    """The kernel's definition, on any device, against mx.quantized_matmul; no kernel on the CPU."""
    import numpy as np

    x, w, scales, biases = _few_rows_case(3, 2, 8, 256, mx.float32)
    got = np.array(kernels.few_rows_reference(x, w, scales, biases, 32))
    for g in range(2):
        want = mx.quantized_matmul(x[:, g], w[g], scales[g].astype(mx.float32), biases[g].astype(mx.float32),
                                   transpose=True, group_size=32, bits=8)
        assert np.abs(got[:, g] - np.array(want)).max() <= 1e-5 * np.abs(np.array(want)).max()
    assert kernels.few_rows(x, w, scales, biases, 32, 8, "affine") is None



def test_shared_expert_without_biases_takes_the_plain_path():
    """Shared-expert maps quantized without biases (mxfp4: no affine offsets) are not the few-row kernels';
    the fused SwiGLU and the sum take the plain products (a crash on the missing biases before)."""
    from ds4_mlx.models.linear import Linear, plus_product, swiglu_product

    k = mx.random.split(mx.random.key(4), 4)
    gate, up, down = (Linear(64, 32), Linear(64, 32), Linear(32, 64))
    gate, up, down = (m.to_quantized(group_size=32, bits=4, mode="mxfp4") for m in (gate, up, down))
    for m, key in zip((gate, up, down), k):
        m.update({"weight": mx.random.randint(0, 2 ** 32, m.weight.shape, mx.uint32, key=key),
                  "scales": mx.full(m.scales.shape, 127, mx.uint8)})  # codes times 2^0
    x, addend = mx.random.normal((2, 64), key=k[3]), mx.ones((2, 64))

    def product(m, v):
        return mx.quantized_matmul(v, m.weight, m.scales, None, transpose=True, group_size=32, bits=4, mode="mxfp4")

    g, u = mx.minimum(product(gate, x), 7.0), mx.clip(product(up, x), -7.0, 7.0)
    want = g * mx.sigmoid(g) * u
    got = swiglu_product(gate, up, x, 7.0)
    assert mx.allclose(got, want, rtol=1e-5, atol=0) and float(mx.abs(want).max()) > 1
    assert mx.allclose(plus_product(down, got, addend), addend + product(down, got), rtol=1e-5, atol=0)
    terms = mx.stack([addend, 2 * addend, -addend], axis=1)  # a token's routed rows, summed first
    assert mx.allclose(plus_product(down, got, terms), 2 * addend + product(down, got), rtol=1e-5, atol=0)


def _recorded_launches(monkeypatch, *factories):
    """Replace the named kernel factories with one whose launches record their template arguments (and
    return zeros): what MLX's CUDA backend keys a compiled custom kernel by, with its name."""
    seen = []

    def factory(*_, **__):
        def launch(inputs, template, output_shapes, output_dtypes, **_):
            seen.append(tuple(template))
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return launch

    for name in factories:
        monkeypatch.setattr(kernels, name, factory)
    return seen


def test_kernels_name_the_dtypes_they_are_launched_at(monkeypatch):
    """A kernel launched at other dtypes differs in its template arguments: MLX's CUDA backend would
    otherwise run the code it compiled for the first dtypes (reading bfloat16 values as float32)."""
    seen = _recorded_launches(monkeypatch, "_hc_kernel", "_attend_kernel")
    mix, scale, base, streams, iters, eps, _, weight, norm_eps = kernels._hc_mix_sample()
    for dtype in (mx.float32, mx.bfloat16):
        kernels._hc_mix_kernel("cuda", mix, scale, base, streams, iters, eps, dtype, weight, norm_eps)
    q, ring, fresh, rows, selected, pos, sinks, window, ratio, *rest = kernels._decode_attention_sample()[0]
    for q_dtype, row_dtype in ((mx.float32, mx.float32), (mx.bfloat16, mx.float32), (mx.float32, mx.float16)):
        kernels._decode_attention_cuda(q.astype(q_dtype), ring.astype(row_dtype), fresh, rows, selected, pos, sinks,
                                       window, ratio, *rest)
    assert seen[0] != seen[1] and len(set(seen[2:])) == 3


def test_norm_rope_is_named_by_its_dtypes(monkeypatch):
    seen = _recorded_launches(monkeypatch, "_norm_rope_kernel")
    x, rope, positions, width, norm, inverse, shape = kernels._norm_rope_sample()[0]
    for dtype in (mx.float32, mx.bfloat16):
        kernels._norm_rope_cuda(x.astype(dtype), rope, positions, width, norm, inverse, shape)
    for out in (mx.float32, mx.bfloat16):  # the output's dtype too (the attention output's inverse rotation)
        kernels._norm_rope_cuda(x, rope, positions, width, norm, inverse, shape, out)
    assert seen[0] != seen[1] and seen[2] != seen[3]


def test_norm_rope_takes_the_drafters_int_start(monkeypatch):
    """The drafters pass `_project` an int start: the MLX ops, not the kernel's positions [T]."""
    monkeypatch.setattr(kernels.NORM_ROPE, "backend", lambda: "cuda")
    x, rope, _, width, norm, inverse, shape = kernels._norm_rope_sample()[0]
    want = kernels.norm_rope_reference(x, rope, 7, width, norm, inverse, shape)
    assert mx.array_equal(kernels.norm_rope(x, rope, 7, width, norm, inverse, shape), want).item()


def test_gguf_rows_are_named_by_their_input_dtype(monkeypatch):
    seen = _recorded_launches(monkeypatch, "_gguf_rows_kernel")
    x, w, indices, codec = kernels._gguf_rows_sample("q2_k")
    for dtype in (mx.float32, mx.bfloat16):
        kernels._gguf_rows_cuda(x.astype(dtype), w, indices, codec)
    assert seen[0] != seen[1]


def test_few_rows_and_routed_experts_are_named_by_their_dtypes(monkeypatch):
    """The few-row product at another x or scales dtype, and the fused routed experts at another scales
    dtype (the converter widens a tensor's scales to float32 where float16 cannot hold them), differ in
    their template arguments."""
    seen = _recorded_launches(monkeypatch, "_few_rows_kernel")
    x, w, scales, biases, group_size = kernels._few_rows_sample()
    for x_dtype, scale_dtype in ((mx.float32, mx.float16), (mx.bfloat16, mx.float16), (mx.float32, mx.float32)):
        kernels.FEW_ROWS.launches["cuda"](x.astype(x_dtype), w, scales.astype(scale_dtype),
                                          biases.astype(scale_dtype), group_size)
    assert len(set(seen)) == 3

    experts = []

    def launch(inputs, template, output_shapes, output_dtypes, **_):
        experts.append(tuple(template))
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(kernels, "_expert_kernels", lambda limit: (launch, launch))
    x, chosen, weights, gate, up, down, limit = kernels._routed_experts_sample()
    for scale_dtype in (mx.float16, mx.float32):
        wide = [(m[0], m[1].astype(scale_dtype), m[2].astype(scale_dtype), *m[3:]) for m in (gate, up, down)]
        kernels._routed_experts_cuda(x, chosen, weights, *wide, limit)
    assert experts[0] != experts[2] and experts[1] != experts[3]  # gate/up, then down, at each dtype


@pytest.mark.parametrize("variant", ["flash", "pro"])
def test_gguf_rows_kernel_fits_every_real_width(variant):
    """The expert rows kernel stages x and each warp's rows in a block's shared memory: at V4 Flash's and
    V4 PRO's widths, in every compute dtype, some block size fits (else decode takes the slow path), and the
    tensor-core body's block fits for 16-bit x."""
    from ds4_mlx.models import gguf_blocks
    from ds4_mlx.models.args import ModelArgs
    from ds4_mlx.models.variants import pro_args

    args = pro_args() if variant == "pro" else ModelArgs()
    H, inner = args.hidden_size, args.moe_intermediate_size
    for codec, inp in (("iq2_xxs", H), ("q2_k", inner)):
        for itemsize in (2, 4):
            assert kernels._gguf_rows_warps(codec, inp, itemsize, gguf_blocks.row_bytes(codec, inp)) is not None
        assert kernels._gguf_rows_mma_fits(codec, inp, 2, gguf_blocks.row_bytes(codec, inp))  # bfloat16, float16


def test_fused_verify_crossing_index_topk_matches_decoding_one_at_a_time(monkeypatch):
    """A verify whose last rows' indexer picks but whose first rows see fewer rows than index_topk: through
    the decode kernel's path (forced here: `decode_attention` runs its definition off CUDA) the first rows
    read all their visible rows, as decoding them one at a time does, not the picks' rows past them."""
    from ds4_mlx.models import attention
    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    monkeypatch.setenv("DS4_MLX_COMPILE", "0")  # traces are cached per module
    monkeypatch.setattr(attention, "fused_decode_attention", lambda head_dim: True)
    args = tiny_args(0)
    model = random_model(args, seed=0)
    ids = mx.random.randint(0, args.vocab_size, (1, 28), key=mx.random.key(3))
    start = 20  # positions 20 .. 27: rows visible 5, ..., 7 against index_topk 6
    assert (start + 1) // 4 < args.index_topk < 28 // 4
    verified, decoded = model.make_cache(), model.make_cache()
    model(ids[:, :start], verified)
    model(ids[:, :start], decoded)
    got = model(ids[:, start:], verified)[0]
    want = mx.concatenate([model(ids[:, p : p + 1], decoded)[0] for p in range(start, 28)])
    assert float(mx.abs(got - want).max()) < 1e-5
