"""The fast paths against the plain ones they replace: each fused kernel of `ds4_mlx.models.kernels` on
the GPU backend that runs it (Metal or CUDA; skipped where MLX has no GPU, as on this CPU CI: the device
run is in docs/PERFORMANCE.md), and the per-backend choices of `deepseek_v4` (attention, expert
products) against each other, on any device."""

import mlx.core as mx
import pytest

from ds4_mlx.models import kernels

HAS_GPU = mx.metal.is_available() or mx.cuda.is_available()


def check_hc_mix(T, H, hc=4, iters=20, eps=1e-6, seed=0):
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    mix = 3 * mx.random.normal((T, (2 + hc) * hc), key=k1)
    scale = mx.random.uniform(0.5, 2.0, (3,), key=k2)
    base = mx.random.normal(((2 + hc) * hc,), key=k3)
    streams = mx.random.normal((T, hc, H), key=k4)
    with mx.stream(mx.gpu):
        previous = mx.default_device()
        mx.set_default_device(mx.gpu)
        try:
            assert kernels.backend() in ("metal", "cuda")
            got = kernels.hc_mix(mix, scale, base, streams, iters, eps)
            want = kernels.hc_mix_reference(mix, scale, base, streams, iters, eps)
            mx.eval(got, want)
        finally:
            mx.set_default_device(previous)
    for name, g, w in zip(("x", "post", "comb"), got, want):
        assert g.shape == w.shape and g.dtype == mx.float32, name
        err = float(mx.abs(g - w).max())
        assert err <= 1e-5 * max(1.0, float(mx.abs(w).max())), f"{name}: max |diff| {err:.2e} (T={T}, H={H})"
    # the comb matrix is doubly stochastic after Sinkhorn: columns sum to 1 (to within eps)
    assert float(mx.abs(got[2].sum(axis=-2) - 1).max()) < 1e-4


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,H", [(1, 4096), (3, 64), (517, 4096)])
def test_hc_mix_kernel_matches_reference(T, H):
    check_hc_mix(T, H)


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
@pytest.mark.parametrize("hd,capacity,pos,ratio,n_rows,top_k,dtype", [
    (512, 127, 8191, 4, 2100, 512, mx.float16),    # CSA: the indexer's choice, a ring of just the window
    (512, 127, 8191, 4, 2100, 0, mx.float16),      # CSA before the indexer selects: the valid rows
    (512, 170, 9000, 128, 80, 0, mx.float16),      # HCA, a ring with rewind history
    (64, 135, 300, 0, 0, 0, mx.float32),           # sliding window only, float32 rows
])
def test_decode_attention_kernel_matches_reference(hd, capacity, pos, ratio, n_rows, top_k, dtype):
    nh, window = 8, 128
    k = mx.random.split(mx.random.key(hd + pos), 6)
    q = mx.random.normal((nh, hd), key=k[0])
    ring = mx.random.normal((capacity, hd), key=k[1]).astype(dtype)
    fresh = mx.random.normal((1, hd), key=k[2]).astype(dtype)
    rows = mx.random.normal((n_rows, hd), key=k[3]).astype(dtype) if ratio else None
    visible = (pos + 1) // ratio if ratio else 0
    selected = mx.random.permutation(visible, key=k[4])[:top_k].astype(mx.uint32) if top_k else None  # argpartition's
    sinks = mx.random.normal((nh,), key=k[5])
    position = mx.array(pos)
    got = on_cuda(kernels.decode_attention, q, ring, fresh, rows, selected, position, sinks, window, ratio)
    # the reference on the CPU: CUDA's float32 matrix products run on TF32 tensor cores
    with mx.stream(mx.cpu):
        want = kernels.decode_attention_reference(q, ring, fresh, rows, selected, position, sinks, window, ratio)
    assert got.shape == (nh, hd) and got.dtype == mx.float32
    err = float(mx.abs(got - want).max())
    assert err <= 1e-5 * max(1.0, float(mx.abs(want).max())), f"max |diff| {err:.2e}"


@pytest.mark.parametrize("T,K", [(1, 700), (37, 19)])
def test_attention_paths_agree(monkeypatch, T, K):
    from ds4_mlx.models import deepseek_v4 as dv

    k1, k2, k3, k4 = mx.random.split(mx.random.key(T), 4)
    q, keys = mx.random.normal((T, 8, 64), key=k1), mx.random.normal((T, K, 64), key=k2)
    mask = mx.random.uniform(key=k3, shape=(T, K)) < 0.7
    mask[:, 0] = True  # every query sees at least one key, as the window's own row guarantees
    sinks = mx.random.normal((8,), key=k4)
    for m in (mask, None):
        out = {}
        for path in ("sdpa", "matmul"):
            monkeypatch.setenv("DS4_MLX_ATTENTION", path)
            out[path] = dv.attend(q, keys, m, sinks, 64 ** -0.5)
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


def test_grouped_output_projection_float_and_quantized():
    """`each` (row j through map j) as a batched product, and through gather_qmm when quantized."""
    from ds4_mlx.models.deepseek_v4 import SwitchLinear

    k1, k2 = mx.random.split(mx.random.key(3))
    linear = SwitchLinear(4, 64, 32)
    linear.weight = mx.random.normal(linear.weight.shape, key=k1)
    x = mx.random.normal((5, 4, 64), key=k2)
    want = mx.stack([x[:, j] @ linear.weight[j].T for j in range(4)], axis=1)
    assert float(mx.abs(linear.each(x) - want).max()) < 1e-4
    quantized = linear.to_quantized(group_size=32, bits=8)
    quantized.weight, quantized.scales, quantized.biases = mx.quantize(linear.weight, 32, 8)
    dequantized = mx.dequantize(quantized.weight, quantized.scales, quantized.biases, 32, 8)
    want = mx.stack([x[:, j] @ dequantized[j].T for j in range(4)], axis=1)
    assert float(mx.abs(quantized.each(x) - want).max()) < 1e-3


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
    from ds4_mlx.models import deepseek_v4 as dv
    from ds4_mlx.tools.testing import tiny_args

    model = random_model(tiny_args(0), seed=0)
    ids = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, (1, 300)), dtype=mx.int32)
    whole = model(ids)
    monkeypatch.setattr(dv, "INDEXER_TILE_BYTES", 1)  # one compressed row a tile
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
