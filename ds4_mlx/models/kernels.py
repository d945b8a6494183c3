"""Fused GPU kernels for the model's hot paths, each with the plain-MLX function it replaces.

The plain function is the definition: the CPU runs it, and tests/test_kernels.py checks each kernel
against it on the backend that runs the kernel (Metal or CUDA). Every kernel also checks itself the
first time a process uses it on a backend (`Kernel.backend`): small random inputs through the kernel
and the definition, and one warning line and the definition from then on if they disagree.
`use_kernels(False)`, `ds4-mlx --no-kernels` or DS4_MLX_KERNELS=0 run the definitions everywhere (for
profiling, or to rule a kernel out), graphs compiled before included (`generation`). The switch only
swaps kernels for their definitions: which algorithm runs (`backend`'s choices) stays the same.
"""

import os
import sys
from functools import lru_cache, partial

import mlx.core as mx
import numpy as np

from ds4_mlx.cache.geometry import ring_slot, rows_visible, window_reach
from ds4_mlx.models.numerics import counting, f16_round, fp4_e2m1_sim, fp8_e4m3_sim, reshaped

_enabled = os.environ.get("DS4_MLX_KERNELS", "1") != "0"
_generation = 0


def use_kernels(on: bool):
    global _enabled, _generation
    _enabled = on
    _generation += 1


def generation() -> int:
    """Changes whenever kernels are switched on or off: compiled graphs keyed by it are traced anew."""
    return _generation


def backend():
    """'metal', 'cuda' or None (CPU) for the default device, whatever the kernel switch says."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


# MLX's CUDA backend keys a compiled custom kernel by its name and template arguments alone, not by the
# dtypes of its inputs and outputs: a kernel whose dtypes vary from call to call names them in its
# template arguments too (its inputs' by `_dtype_keys`), else a call at new dtypes would run the code compiled
# for the first.


def _dtype_keys(inputs):
    """Template arguments naming each input's dtype (see above)."""
    return [(f"TYPE_{i}", a.dtype) for i, a in enumerate(inputs)]


class Kernel:
    """A custom kernel beside its plain definition. `launches`: backend -> a function with the
    definition's signature; `sample()`: small random inputs for the self-check; `tolerance`: the largest
    difference from the definition allowed there, relative to the definition's largest value. A sample
    may be a list of input tuples, one for each form the kernel takes. `compared(inputs, result)`, where
    given, is the form of a result compared (for results whose order the definition leaves open)."""

    def __init__(self, name, definition, sample, tolerance, compared=None):
        self.name, self.definition, self.sample, self.tolerance = name, definition, sample, tolerance
        self.compared = compared
        self.launches = {}
        self.verdicts = {}  # backend -> whether the kernel passed its self-check there

    def backend(self):
        """The backend whose launch to use now, or None for the definition: kernels switched off, no
        launch for this backend, or a failed self-check."""
        kind = backend()
        if not _enabled or kind not in self.launches:
            return None
        if kind not in self.verdicts:
            self.verdicts[kind] = self._self_check(kind)
        return kind if self.verdicts[kind] else None

    def _self_check(self, kind):
        try:
            samples = self.sample()
            for inputs in samples if isinstance(samples, list) else [samples]:
                got = self.launches[kind](*inputs)
                with mx.stream(mx.cpu):  # the definition in exact float32 (a GPU may use TF32 tensor cores)
                    want = self.definition(*inputs)
                got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
                if self.compared is not None:
                    got, want = self.compared(inputs, got), self.compared(inputs, want)
                error = bound = 0.0
                for g, w in zip(got, want):
                    w = w.astype(mx.float32)
                    error = max(error, mx.abs(g.astype(mx.float32) - w).max().item())
                    bound = max(bound, self.tolerance * mx.abs(w).max().item())
                if not error <= bound:  # True for NaN too
                    break
            else:
                return True
            detail = f"max difference {error:.3g}, allowed {bound:.3g}"
        except Exception as e:  # a kernel that does not compile or launch is off as well
            detail = " ".join(str(e).split()) or type(e).__name__
        print(f"ds4-mlx: warning: custom kernel {self.name} disagrees with its definition on {kind} ({detail}); "
              "using the definition", file=sys.stderr)
        return False


def _random(*shape, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed + sum(shape)))


# ---------------------------------------------------------------------------------------------
# Hyper-connection mixing: sigmoid gates, softmax + Sinkhorn on the 4x4 stream mix, and the collapse
# of the streams into one sub-layer input. As plain MLX this is ~230 tiny ops a call; fused, one launch.


def hc_mix_reference(mix, scale, base, streams, iters, eps, dtype=mx.float32, weight=None, norm_eps=0.0):
    """mix [T, (2+hc)*hc] float32, streams [T, hc, H] -> (x [T, H] rounded once to `dtype`, then normed by an
    RMS norm of `weight` [H] where given (the sub-layer's own norm), post [T, hc], comb [T, hc, hc])."""
    T, hc, H = streams.shape
    pre = mx.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * mx.sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mix[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(T, hc, hc)  # [source, destination]
    comb = mx.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    x = (pre[:, :, None] * streams).sum(axis=1).astype(dtype)
    if weight is not None:
        x = mx.fast.rms_norm(x, weight.astype(dtype), norm_eps)
    return x, post, comb


# One threadgroup per token. Thread (j, k) of the first HC * HC holds entry [j][k] of the stream mix in
# shared memory; the softmax and each Sinkhorn round read a row or a column there, with barriers between
# the reads and the writes. All threads then collapse the streams, feature by feature (coalesced reads).
_HC_BODY = """
    const int W = (2 + HC) * HC;
    const int j = tid / HC, k = tid % HC;
    const bool mine = tid < HC * HC;
    if (tid < HC) {
        shared_pre[tid] = 1.0f / (1.0f + exp(-(mix[t * W + tid] * scale[0] + base[tid]))) + EPS;
        post[t * HC + tid] = 2.0f / (1.0f + exp(-(mix[t * W + HC + tid] * scale[1] + base[HC + tid])));
    }
    float v = mine ? mix[t * W + 2 * HC + tid] * scale[2] + base[2 * HC + tid] : 0.0f;
    if (mine) c[tid] = v;
    BARRIER;
    float s = 0.0f, m = -1e30f;
    if (mine) {
        for (int i = 0; i < HC; ++i) m = fmax(m, c[j * HC + i]);
        for (int i = 0; i < HC; ++i) s += exp(c[j * HC + i] - m);
        v = exp(v - m) / s + EPS;
    }
    for (int it = 0; it < ITERS; ++it) {
        if (it > 0) {  // rows
            BARRIER;
            if (mine) c[tid] = v;
            BARRIER;
            s = 0.0f;
            if (mine) { for (int i = 0; i < HC; ++i) s += c[j * HC + i]; v /= s + EPS; }
        }
        BARRIER;  // columns
        if (mine) c[tid] = v;
        BARRIER;
        s = 0.0f;
        if (mine) { for (int i = 0; i < HC; ++i) s += c[i * HC + k]; v /= s + EPS; }
    }
    if (mine) comb[t * HC * HC + tid] = v;
#ifndef NORM_EPS
    for (int h = tid; h < H; h += GROUP) {
        float acc = 0.0f;
        for (int i = 0; i < HC; ++i) acc += shared_pre[i] * streams[(t * HC + i) * H + h];
        x[t * H + h] = acc;
    }
#else
    // then the sub-layer's RMS norm of the rounded x, rounded as MLX's: x times the normalizer to X_TYPE,
    // then times the weight in X_TYPE; the thread's values wait in registers
    constexpr int MINE = (H + GROUP - 1) / GROUP;
    float kept[MINE], squares = 0.0f;
    for (int n = 0; n < MINE; ++n) {
        const int h = tid + n * GROUP;
        float acc = 0.0f;
        if (h < H)
            for (int i = 0; i < HC; ++i) acc += shared_pre[i] * streams[(t * HC + i) * H + h];
        kept[n] = static_cast<float>(static_cast<X_TYPE>(acc));
        squares += kept[n] * kept[n];
    }
    total[tid] = squares;
    for (int half = GROUP / 2; half > 0; half /= 2) {
        BARRIER;
        if (tid < half) total[tid] += total[tid + half];
    }
    BARRIER;
    const float normalizer = RSQRT(total[0] / H + NORM_EPS);
    for (int n = 0; n < MINE; ++n) {
        const int h = tid + n * GROUP;
        if (h < H) x[t * H + h] = weight[h] * static_cast<X_TYPE>(kept[n] * normalizer);
    }
#endif
"""
_GROUP = 256
_HEADS = {
    "metal": "const int t = threadgroup_position_in_grid.x, tid = thread_position_in_threadgroup.x;\n"
             "threadgroup float shared_pre[HC], c[HC * HC], total[GROUP];\n"
             "#define BARRIER threadgroup_barrier(mem_flags::mem_threadgroup)\n#define RSQRT metal::rsqrt\n",
    "cuda": "const int t = blockIdx.x, tid = threadIdx.x;\n"
            "__shared__ float shared_pre[HC], c[HC * HC], total[GROUP];\n#define BARRIER __syncthreads()\n"
            "#define RSQRT rsqrtf\n",
}


def _hc_mix_sample():
    T, hc, H = 3, 4, 64
    return (_random(T, (2 + hc) * hc), 1 + 0.1 * _random(3), 0.1 * _random((2 + hc) * hc), _random(T, hc, H),
            20, 1e-6, mx.float32, 1 + 0.1 * _random(H), 1e-6)


HC_MIX = Kernel("hc_mix", hc_mix_reference, _hc_mix_sample, 1e-4)


@lru_cache(maxsize=None)
def _hc_kernel(kind, eps, norm_eps):
    defines = f"#define EPS {float(eps)!r}f\n#define GROUP {_GROUP}\n"
    if norm_eps is not None:
        defines += f"#define NORM_EPS {float(norm_eps)!r}f\n"
    make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
    return make(name=f"ds4_hc_mix_{abs(hash((eps, norm_eps)))}",
                input_names=["mix", "scale", "base", "streams"] + ([] if norm_eps is None else ["weight"]),
                output_names=["x", "post", "comb"], source=defines + _HEADS[kind] + _HC_BODY)


def hc_mix(mix, scale, base, streams, iters, eps, dtype=mx.float32, weight=None, norm_eps=0.0):
    """`hc_mix_reference`, fused into one kernel on Metal and CUDA (float32 throughout; x is written in
    `dtype`, the sub-layer's compute dtype, normed in the same launch where `weight` is given)."""
    kind = HC_MIX.backend()
    if kind is None:
        return hc_mix_reference(mix, scale, base, streams, iters, eps, dtype, weight, norm_eps)
    return HC_MIX.launches[kind](mix, scale, base, streams, iters, eps, dtype, weight, norm_eps)


def _hc_mix_kernel(kind, mix, scale, base, streams, iters, eps, dtype=mx.float32, weight=None, norm_eps=0.0):
    T, hc, H = streams.shape
    f32 = mx.float32
    inputs = [mix.astype(f32), scale.astype(f32), base.astype(f32), streams.astype(f32)]
    return _hc_kernel(kind, eps, None if weight is None else norm_eps)(
        inputs=inputs + ([] if weight is None else [weight.astype(dtype)]),
        template=[("HC", hc), ("ITERS", iters), ("H", H), ("X_TYPE", dtype)],
        grid=(T * _GROUP, 1, 1), threadgroup=(_GROUP, 1, 1),
        output_shapes=[(T, H), (T, hc), (T, hc, hc)], output_dtypes=[dtype, f32, f32])


HC_MIX.launches.update({kind: partial(_hc_mix_kernel, kind) for kind in ("metal", "cuda")})


# ---------------------------------------------------------------------------------------------
# Attention over each token's own keys with a sink logit per head: the plain definition, which the model
# runs for any number of tokens and the fused decode attention below is checked against.

# attention over each token's own keys: "sdpa" (mx.fast.scaled_dot_product_attention, one query a batch)
# or "matmul" (two batched products over the token's heads), for prefill chunks (T > 1); decode uses sdpa.
# On the H200, 4 layers at 8k: prefill 8,286 tok/s with matmul against 5,806 with sdpa, decode 188 tok/s
# with sdpa against 176 with matmul. DS4_MLX_ATTENTION overrides both.
ATTENTION_PATHS = {"cuda": "matmul"}


def attention_path(tokens):
    default = ATTENTION_PATHS.get(backend(), "sdpa") if tokens > 1 else "sdpa"
    return os.environ.get("DS4_MLX_ATTENTION") or default


def attend(q, keys, mask, sinks, scale):
    """Each token's heads q [T, nh, hd] over its own keys (= values) [T, K, hd] where mask [T, K] (None:
    all), with a per-head sink logit in the softmax denominator. -> [T, nh, hd]"""
    if attention_path(q.shape[0]) == "sdpa":
        keys = keys[:, None]
        out = mx.fast.scaled_dot_product_attention(q[:, :, None, :], keys, keys, scale=scale, sinks=sinks,
                                                   mask=None if mask is None else mask[:, None, None, :])
        return out[:, :, 0, :]
    # as two batched products over a token's heads (M = nh rows each)
    scores = (q @ keys.swapaxes(-1, -2)) * scale
    if mask is not None:
        scores = mx.where(mask[:, None, :], scores, -mx.inf)
    return _softmax_with_sinks(scores, sinks[:, None]) @ keys


@partial(mx.compile, shapeless=True)
def _softmax_with_sinks(scores, sinks):
    top = mx.maximum(scores.max(axis=-1, keepdims=True), sinks)
    e = mx.exp(scores - top)
    return e / (e.sum(axis=-1, keepdims=True) + mx.exp(sinks - top))


# ---------------------------------------------------------------------------------------------
# Decode attention: one token's heads over its window (read from the ring in place) and its compressed
# rows, with a sink logit per head; B such tokens (sessions decoded together, `cache/pool.py`) at once.
# As plain MLX this is a gather, a concatenation, a cast, the mask and SDPA, which at head_dim 512 falls
# back to ~10 plain ops a token; fused, one launch for all B. CUDA only for now: Metal runs the plain
# function until a Mac can test a port.


def decode_attention_reference(q, ring, fresh, rows, selected, pos, sinks, window, ratio, home=None):
    """q [nh, hd]: one token at `pos` (an int array) over its window: the positions before it from `ring`
    (position p in slot p % capacity; those before position 0 masked), then the rows `fresh` [f, hd] of
    the f positions up to its own (f = 1: its own row), and over compressed rows: rows[selected] where the
    indexer chose them, else the (pos + 1) // ratio valid rows of `rows` (none for ratio 0); `attend` on
    those keys, float32. With `home` (row, capacity, n; row an int array), `ring` and `rows` are a pool's,
    flat ([S * capacity, hd], [S * n, hd]), and the token's are its row's of them (read where needed: a
    ring's row is not copied whole). -> [nh, hd] float32"""
    f32 = mx.float32
    f = min(fresh.shape[0], window)
    row, capacity, n = (None, ring.shape[-2], None if rows is None else rows.shape[-2]) if home is None else home

    def mine(array, index, size):
        return array[index] if row is None else array[row * size + index]

    keys = [mine(ring, ring_slot(pos - window_reach(window) + counting(window - f), capacity), capacity), fresh[-f:]]
    mask = [pos - window_reach(window) + counting(window) >= 0]
    if selected is not None:
        keys.append(mine(rows, selected, n))
        mask.append(mx.ones(selected.shape, mx.bool_))
    elif ratio:
        keys.append(rows if row is None else mine(rows, counting(n), n))
        mask.append(counting(n) < rows_visible(pos, ratio))
    keys = mx.concatenate(keys).astype(f32)
    return attend(q.astype(f32)[None], keys[None], mx.concatenate(mask)[None], sinks.astype(f32),
                  q.shape[-1] ** -0.5)[0]


def _own(rows):
    """A session's own rows [n, hd]: `rows` itself, or the one row of a batch [1, n, hd]."""
    return rows if rows.ndim == 2 else rows.reshape(rows.shape[1:])


def decode_attention_rows_reference(q, ring, fresh, rows, selected, pos, sinks, window, ratio, visible=None,
                                    picks=None, pool_rows=None, consecutive=False, per_session=None):
    """`decode_attention_reference` for each of B tokens: q [B, nh, hd], fresh [B, hd], selected [B, k] or
    None, pos [B]; token b's ring and compressed rows are row b of ring [B, capacity, hd] and rows [B, n,
    hd] (or None), or with `pool_rows`, row `pool_rows[b]` of a pool's, flat: ring [S * capacity, hd] and
    rows [S * n, hd], `per_session` (capacity, n); one token's may be its session's own [capacity, hd] and
    [n, hd]; `picks` [B] bool: the tokens that read their `selected` rows (None: all of them), the others
    read all their valid rows. `consecutive`: the tokens are one session's positions pos[0], pos[0] + 1,
    ... (a verify's rows), its own ring and rows: the ring holds the positions before pos[0], and token b's
    window ends in fresh[: b + 1]. `visible`: what the kernel is handed ([B] int32, `decode_attention`),
    computed here from `pos`. -> [B, nh, hd]"""
    out = []
    for b in range(q.shape[0]):
        if consecutive:
            mine = (_own(ring), None if rows is None else _own(rows), None)
        elif pool_rows is None and q.shape[0] == 1:  # a session's own step: its ring as it is or by a reshape
            # (read through an index, the compiled step copied the whole ring to write it: tests/test_session.py)
            mine = (_own(ring), None if rows is None else _own(rows), None)
        elif pool_rows is None:  # the tokens' own rows: views, no copy
            mine = (ring[b], None if rows is None else rows[b], None)
        else:
            mine = (ring, rows, (pool_rows[b], *per_session))

        def one(chosen):
            return decode_attention_reference(q[b], mine[0], fresh[: b + 1] if consecutive else fresh[b : b + 1],
                                              mine[1], chosen, pos[b], sinks, window, ratio, home=mine[2])
        if selected is None:
            out.append(one(None))
        elif picks is None:
            out.append(one(selected[b]))
        else:
            out.append(mx.where(picks[b], one(selected[b]), one(None)))
    return mx.stack(out)


# One block a head of one token (grid: heads by tokens). Each warp runs an online softmax over every
# NW-th key, CHUNK keys at a time (their loads and sums independent, one update of the softmax for the
# chunk: a key at a time was a chain of dependent round trips; two at head dim 512, whose four keys would
# take every register a thread of 512 may have), its lanes holding E contiguous dims each
# (read as wide words); the warps' partial sums merge with the sink at the end. Token b's ring and
# compressed rows are row pool_rows[b] of theirs.
_ATTEND_CUDA = """
    constexpr int E = HD / 32, NW = GROUP / 32, CHUNK = E > 8 ? 2 : 4;  // a chunk's keys in registers: 32 at most
    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const bool pick = SELECT && picks[b];
    const int n_rows = pick ? K : visible[b], keys = W + n_rows;
    const int before_zero = max(W - 1 - pos[b], 0);  // window rows at positions before 0
    // the window's rows in the ring; the rest are fresh rows, up to the token's own (CONSECUTIVE: a verify's
    // rows, each reading the rows before it)
    const int from_ring = W - 1 - (CONSECUTIVE ? min(b, W - 1) : 0);
    const size_t head = ((size_t)b * NH + h) * HD, row = CONSECUTIVE ? 0 : pool_rows[b];
    const float scale = rsqrtf((float)HD), minus_infinity = -__int_as_float(0x7f800000);
    float qv[E], acc[E];
    load_floats<E>(q + head + lane * E, qv);
    for (int e = 0; e < E; ++e) { qv[e] *= scale; acc[e] = 0.0f; }
    float m = minus_infinity, l = 0.0f;
    for (int j0 = warp * CHUNK; j0 < keys; j0 += NW * CHUNK) {
        float k[CHUNK][E], s[CHUNK];
        for (int u = 0; u < CHUNK; ++u) {
            const int j = j0 + u;
            s[u] = minus_infinity;
            for (int e = 0; e < E; ++e) k[u][e] = 0.0f;
            if (j < before_zero || j >= keys) continue;
            decltype(ring) key;
            if (j < from_ring) key = ring + (row * CAP + (pos[b] - (W - 1) + j) % CAP) * HD;  // a position >= 0
            else if (j < W) key = fresh + (size_t)(b + j - (W - 1)) * HD;
            else key = rows + (row * R + (pick ? selected[(size_t)b * K + j - W] : j - W)) * HD;
            load_floats<E>(key + lane * E, k[u]);
            s[u] = 0.0f;
            for (int e = 0; e < E; ++e) s[u] += qv[e] * k[u][e];
        }
        for (int o = 16; o > 0; o /= 2)
            for (int u = 0; u < CHUNK; ++u) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
        float top = m;
        for (int u = 0; u < CHUNK; ++u) top = fmaxf(top, s[u]);
        if (top == minus_infinity) continue;  // no key of the chunk is visible, nor any before it
        const float c = expf(m - top);
        l *= c;
        for (int e = 0; e < E; ++e) acc[e] *= c;
        for (int u = 0; u < CHUNK; ++u) {
            const float weight = expf(s[u] - top);
            l += weight;
            for (int e = 0; e < E; ++e) acc[e] += weight * k[u][e];
        }
        m = top;
    }
    __shared__ float part_m[NW], part_l[NW], part_acc[NW * HD];
    if (lane == 0) { part_m[warp] = m; part_l[warp] = l; }
    for (int e = 0; e < E; ++e) part_acc[warp * HD + lane * E + e] = acc[e];
    __syncthreads();
    float top = sinks[h];
    for (int w = 0; w < NW; ++w) top = fmaxf(top, part_m[w]);
    float total = expf(sinks[h] - top);
    for (int w = 0; w < NW; ++w) total += part_l[w] * expf(part_m[w] - top);
    for (int d = tid; d < HD; d += GROUP) {
        float o = 0.0f;
        for (int w = 0; w < NW; ++w) o += part_acc[w * HD + d] * expf(part_m[w] - top);
        out[head + d] = o / total;
    }
"""
_ATTEND_GROUP = 512


@lru_cache(maxsize=None)
def _attend_kernel():
    return mx.fast.cuda_kernel(name="ds4_decode_attention",
                               input_names=["q", "ring", "fresh", "rows", "selected", "picks", "pool_rows", "visible",
                                            "pos", "sinks"],
                               output_names=["out"], source=_ATTEND_CUDA, header=_LOADS)


def decode_attention(q, ring, fresh, rows, selected, pos, sinks, window, ratio, visible=None, picks=None,
                     pool_rows=None, consecutive=False, per_session=None):
    """`decode_attention_rows_reference`, one kernel on CUDA (head dims of 32 times a power of two, up to 512:
    the warps' partial sums fill 32 KB of shared memory at 512). `visible`: each token's visible compressed
    rows ([B] int32, from the cache's slots), else computed from `pos`. One token's ring and rows may be
    its session's own, unbatched (no view to make)."""
    if not fused_decode_attention(q.shape[-1]):
        return decode_attention_rows_reference(q, ring, fresh, rows, selected, pos, sinks, window, ratio,
                                               picks=picks, pool_rows=pool_rows, consecutive=consecutive,
                                               per_session=per_session)
    return DECODE_ATTENTION.launches[DECODE_ATTENTION.backend()](q, ring, fresh, rows, selected, pos, sinks, window,
                                                                 ratio, visible, picks, pool_rows, consecutive,
                                                                 per_session)


def fused_decode_attention(head_dim):
    """Whether `decode_attention` runs as one kernel here, at this head dim (32 times a power of two)."""
    lanes = head_dim // 32
    return DECODE_ATTENTION.backend() is not None and head_dim % 32 == 0 and head_dim <= 512 and not lanes & (lanes - 1)


def _decode_attention_sample():
    """Two tokens of a pool of three sessions: one past its first window that picks its rows, one in its
    first window that reads all; and a verify's three rows on one session, the first reading all."""
    nh, hd, capacity, n_rows = 4, 64, 16, 8
    pooled = (_random(2, nh, hd), _random(3 * capacity, hd), _random(2, hd), _random(3 * n_rows, hd),
              mx.array([[0, 3, 5], [1, 2, 0]], mx.uint32), mx.array([21, 5], mx.int32), _random(nh), 8, 4, None,
              mx.array([True, False]), mx.array([2, 0], mx.int32), False, (capacity, n_rows))
    verify = (_random(3, nh, hd), _random(capacity, hd), _random(3, hd), _random(n_rows, hd),
              mx.array([[0, 3, 5], [1, 2, 0], [4, 1, 2]], mx.uint32), mx.array([22, 23, 24], mx.int32), _random(nh),
              8, 4, None, mx.array([False, True, True]), None, True)
    return [pooled, verify]


@lru_cache(maxsize=64)
def _all_picked(n):
    """[n] int32 ones as data: no nodes in the step's graph (`mx.ones` is two)."""
    return mx.array(np.ones(n, np.int32))


def _decode_attention_cuda(q, ring, fresh, rows, selected, pos, sinks, window, ratio, visible=None, picks=None,
                           pool_rows=None, consecutive=False, per_session=None):
    B, nh, hd = q.shape
    i32 = mx.int32
    if visible is None:
        visible = rows_visible(pos, ratio) if ratio else _first_rows(B)
    visible = visible.astype(i32).reshape(B)
    if rows is None:  # sliding window only: placeholders the kernel never reads
        rows = ring
    if picks is None:
        picks = _all_picked(B)
    if pool_rows is None:
        pool_rows = counting(B)
    capacity, n = per_session or (ring.shape[-2], rows.shape[-2])  # a session's rows (a pool's are flat)
    inputs = [q, ring, fresh.astype(ring.dtype), rows.astype(ring.dtype),  # q: the kernel widens it
              visible if selected is None else selected, picks.astype(i32), pool_rows.astype(i32), visible,
              pos.astype(i32).reshape(B), sinks.astype(mx.float32)]
    return _attend_kernel()(
        inputs=inputs,
        template=[("HD", hd), ("NH", nh), ("W", window), ("CAP", capacity), ("R", n),
                  ("SELECT", selected is not None), ("K", 0 if selected is None else selected.shape[1]),
                  ("CONSECUTIVE", consecutive), ("GROUP", _ATTEND_GROUP), *_dtype_keys(inputs)],
        grid=(nh * _ATTEND_GROUP, B, 1), threadgroup=(_ATTEND_GROUP, 1, 1),
        output_shapes=[(B, nh, hd)], output_dtypes=[mx.float32])[0]


DECODE_ATTENTION = Kernel("decode_attention", decode_attention_rows_reference, _decode_attention_sample, 1e-4)
DECODE_ATTENTION.launches["cuda"] = _decode_attention_cuda


# ---------------------------------------------------------------------------------------------
# RoPE with the RMS norm before it and the cast after it, for a few tokens: the queries and kv rows, the
# indexer's queries, the attention output's inverse rotation. As MLX ops each is a norm and a rotation
# with a reshape to RoPE's per-row layout on each side, and a cast; here one launch of one warp a row.


def norm_rope_reference(x, rope, positions, width, norm=None, inverse=False, shape=None, dtype=None):
    """x [T, ...]: T tokens at `positions` [T] (int32), each rows of `width` features. `norm` = (weight or
    None, eps): rms_norm of each row first; then `rope` (a `numerics.Rope`, forward or `inverse`) in RoPE's
    per-row layout, returned in `shape` (default x's), cast to `dtype` (default x's)."""
    t = reshaped(x, x.shape[0], -1, 1, width)
    if norm is not None:
        t = mx.fast.rms_norm(t, *norm)
    y = rope(t, positions, inverse=inverse, shape=x.shape if shape is None else shape)
    return y if dtype is None else y.astype(dtype)


# A lane holds VALUES contiguous features (whole pairs) of its warp's row. Rounded as the MLX ops are:
# the normed value to x's dtype, then times the weight in it; the rotation in float32 from those, to x's
# dtype, then to the output's. The pair form takes a second array's rows after the first's (the kv row
# after the queries' heads: one launch), with their own weight, a row a token.
_NORM_ROPE_CUDA = """
    constexpr int VALUES = D < 64 ? 2 : D / 32, PAIRS = VALUES / 2, FIRST_ROTATED = (D - ROTATED) / 2;
    const int all_rows = blockIdx.x * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (all_rows >= ROWS + ROWS2) return;
    const bool second = all_rows >= ROWS;
    const int row = second ? all_rows - ROWS : all_rows;
    const auto* x_in = second ? X2 : x;
    const auto* scale = second ? WEIGHT2 : weight;
    const bool weighted = second ? WEIGHTED2 : WEIGHTED;
    const bool mine = lane * VALUES < D;  // narrow rows leave lanes idle
    float v[VALUES] = {};
    if (mine) load_floats<VALUES>(x_in + (size_t)row * D + lane * VALUES, v);
    if (NORM) {
        float squares = 0.0f;
        for (int i = 0; i < VALUES; ++i) squares += v[i] * v[i];
        for (int o = 16; o > 0; o /= 2) squares += __shfl_xor_sync(0xffffffff, squares, o);
        const float normalizer = rsqrtf(squares / D + EPS);
        for (int i = 0; i < VALUES && mine; ++i) {
            v[i] = rounded_as(x, v[i] * normalizer);
            if (weighted) v[i] = rounded_as(x, static_cast<float>(scale[lane * VALUES + i]) * v[i]);
        }
    }
    const float position = (INVERSE ? -1.0f : 1.0f) * static_cast<float>(positions[second ? row : row / HEADS]);
    for (int p = 0; p < PAIRS; ++p) {
        const int pair = lane * PAIRS + p;
        float a = v[2 * p], b = v[2 * p + 1];
        if (mine && pair >= FIRST_ROTATED) {  // an idle lane's pair is past `periods`
            const float theta = position * (1.0f / periods[pair - FIRST_ROTATED]);
            const float c = cos(theta), s = sin(theta);
            v[2 * p] = a * c - b * s;
            v[2 * p + 1] = a * s + b * c;
        }
    }
    const size_t at = (size_t)row * D + lane * VALUES;  // the two outputs' dtypes may differ
    for (int i = 0; i < VALUES && mine; ++i)
        second ? store(Y2 + at + i, rounded_as(x, v[i])) : store(y + at + i, rounded_as(x, v[i]));
"""
_NORM_ROPE_WARPS = 4


@lru_cache(maxsize=None)
def _norm_rope_kernel(eps, pair=False):
    # the single form's second array is none: its names stand for the first's (never reached)
    single = "#define X2 x\n#define WEIGHT2 weight\n#define Y2 y\n#define ROWS2 0\n#define WEIGHTED2 0\n"
    return mx.fast.cuda_kernel(name=f"ds4_norm_rope{'_pair' if pair else ''}_{abs(hash(eps))}",
                               input_names=["x", "weight", "periods", "positions"]
                               + (["x2", "weight2"] if pair else []),
                               output_names=["y"] + (["y2"] if pair else []),
                               source=f"#define EPS {float(eps)!r}f\n" + ("#define X2 x2\n#define WEIGHT2 weight2\n"
                                                                         "#define Y2 y2\n" if pair else single)
                               + _NORM_ROPE_CUDA, header=_LOADS)


def _norm_rope_cuda(x, rope, positions, width, norm=None, inverse=False, shape=None, dtype=None):
    rows = x.size // width
    weight, eps = norm if norm is not None else (None, 0.0)
    inputs = [x, x if weight is None else weight.astype(x.dtype), rope.periods, positions.astype(mx.int32)]
    return _norm_rope_kernel(eps)(
        inputs=inputs,
        template=[("D", width), ("ROTATED", rope.dim), ("ROWS", rows), ("HEADS", rows // x.shape[0]),
                  ("NORM", norm is not None), ("WEIGHTED", weight is not None), ("INVERSE", inverse),
                  ("WARPS", _NORM_ROPE_WARPS), *_dtype_keys(inputs), ("Y_TYPE", x.dtype if dtype is None else dtype)],
        grid=(-(-rows // _NORM_ROPE_WARPS) * _NORM_ROPE_WARPS * 32, 1, 1), threadgroup=(_NORM_ROPE_WARPS * 32, 1, 1),
        output_shapes=[x.shape if shape is None else shape], output_dtypes=[x.dtype if dtype is None else dtype])[0]


def norm_rope_pair_reference(x, x2, rope, positions, width, norm, norm2, shape=None, dtype2=None):
    """(`norm_rope_reference` of x with `norm` in `shape`, and of x2 [T, width] with `norm2`, cast to `dtype2`)."""
    return (norm_rope_reference(x, rope, positions, width, norm, shape=shape),
            norm_rope_reference(x2, rope, positions, width, norm2, dtype=dtype2))


def _norm_rope_pair_cuda(x, x2, rope, positions, width, norm, norm2, shape=None, dtype2=None):
    rows = x.size // width
    (weight, eps), weight2 = norm, norm2[0]
    inputs = [x, x if weight is None else weight.astype(x.dtype), rope.periods, positions.astype(mx.int32), x2,
              x2 if weight2 is None else weight2.astype(x.dtype)]
    return tuple(_norm_rope_kernel(eps, pair=True)(
        inputs=inputs,
        template=[("D", width), ("ROTATED", rope.dim), ("ROWS", rows), ("ROWS2", x2.shape[0]),
                  ("HEADS", rows // x.shape[0]), ("NORM", True), ("WEIGHTED", weight is not None),
                  ("WEIGHTED2", weight2 is not None), ("INVERSE", False), ("WARPS", _NORM_ROPE_WARPS),
                  *_dtype_keys(inputs), ("Y_TYPE", x.dtype), ("Y2_TYPE", dtype2 or x.dtype)],
        grid=(-(-(rows + x2.shape[0]) // _NORM_ROPE_WARPS) * _NORM_ROPE_WARPS * 32, 1, 1),
        threadgroup=(_NORM_ROPE_WARPS * 32, 1, 1),
        output_shapes=[x.shape if shape is None else shape, x2.shape], output_dtypes=[x.dtype, dtype2 or x.dtype]))


def _norm_rope_pair_sample():
    from ds4_mlx.models.numerics import Rope

    rope, positions = Rope(16, 10000.0), mx.array([5, 900, 70000], mx.int32)
    return [(_random(3, 256), _random(3, 64, seed=1), rope, positions, 64, (None, 1e-6), (1 + 0.1 * _random(64), 1e-6),
             (3, 4, 64)),
            (_random(3, 256).astype(mx.bfloat16), _random(3, 64, seed=1).astype(mx.bfloat16), rope, positions, 64,
             (None, 1e-6), (1 + 0.1 * _random(64), 1e-6), (3, 4, 64), mx.float32)]


NORM_ROPE_PAIR = Kernel("norm_rope_pair", norm_rope_pair_reference, _norm_rope_pair_sample, 1e-2)
NORM_ROPE_PAIR.launches["cuda"] = _norm_rope_pair_cuda


def norm_rope_pair(x, x2, rope, positions, width, norm, norm2, shape=None, dtype2=None):
    """`norm_rope_pair_reference`: two arrays of rows at the same positions normed (each its own weight, one
    eps) and rotated in one kernel on CUDA where `norm_rope` would take each; the second cast to `dtype2`
    there (the kv row as its ring holds it: no cast of its own)."""
    fits = (norm[1] == norm2[1] and x.dtype == x2.dtype and x2.shape == (x.shape[0], width)
            and _norm_rope_fits(x, positions, width))
    if not fits or NORM_ROPE_PAIR.backend() is None:
        return (norm_rope(x, rope, positions, width, norm, shape=shape),
                norm_rope(x2, rope, positions, width, norm2, dtype=dtype2))
    return NORM_ROPE_PAIR.launches["cuda"](x, x2, rope, positions, width, norm, norm2, shape, dtype2)


def _norm_rope_sample():
    from ds4_mlx.models.numerics import Rope

    rope = Rope(16, 10000.0)
    positions = mx.array([5, 900, 70000], mx.int32)
    return [(_random(3, 256).astype(mx.bfloat16), rope, positions, 64, (None, 1e-6), False, (3, 4, 64)),
            (_random(3, 64, seed=1), rope, positions, 64, (1 + 0.1 * _random(64), 1e-6)),
            (_random(3, 2, 64, seed=2), rope, positions, 64, None, True, (3, 128), mx.bfloat16)]


NORM_ROPE = Kernel("norm_rope", norm_rope_reference, _norm_rope_sample, 1e-2)
NORM_ROPE.launches["cuda"] = _norm_rope_cuda


def _norm_rope_fits(x, positions, width):
    """Whether the kernel takes these rows: a position each token (an int start, as the drafters pass, is
    positions start, start + 1, ...), and a lane's features a whole number of pairs loaded in whole words
    (an even number under 64, else a power of two times 64)."""
    lanes_values = 2 if width < 64 else width // 32
    return (isinstance(positions, mx.array) and positions.shape == (x.shape[0],) and x.shape[0] <= FEW_ROWS_MAX
            and width % 2 == 0 and (width < 64 or width % 64 == 0 and lanes_values & (lanes_values - 1) == 0))


def norm_rope(x, rope, positions, width, norm=None, inverse=False, shape=None, dtype=None):
    """`norm_rope_reference` in one kernel on CUDA, for up to FEW_ROWS_MAX tokens at positions [T] and rows
    of an even number of features under 64 or a power of two times 64 (`_norm_rope_fits`)."""
    if not _norm_rope_fits(x, positions, width) or NORM_ROPE.backend() is None:
        return norm_rope_reference(x, rope, positions, width, norm, inverse, shape, dtype)
    return NORM_ROPE.launches["cuda"](x, rope, positions, width, norm, inverse, shape, dtype)


# ---------------------------------------------------------------------------------------------
# A kv row as the cache stores it under `quant_sim` (ds4's rounding): its first `width` features through
# FP8 E4M3 with a power-of-two scale per block of 64, then every feature through float16. As MLX ops it is
# a launch for each step (the block maxima, the scales, the clip, each conversion, the select, the casts);
# here one launch, 2 values a thread (`block_scale`), the same functions in the same order (MLX's CUDA ops
# are these calls).


def kv_rounding_reference(x, width, dtype):
    """x [T, D] -> `fp8_e4m3_sim` of its first `width` features, then `f16_round`, as `dtype`."""
    return f16_round(fp8_e4m3_sim(x, width=width)).astype(dtype)


# Shared by the two roundings of cached rows: a thread's two values from x[at] on (zeros past the end) and
# the power-of-two scale of their block of BLOCK values (BLOCK / 2 lanes; every lane takes part in the
# shuffles), MLX's `power(2, ceil(log2(max(amax, low) / top)))` with the CUDA functions its ops call.
_BLOCK_SCALE = """
template <int BLOCK, typename T>
__device__ inline float block_scale(const T* x, size_t at, size_t n, float v[2], float low, float top) {
    v[0] = v[1] = 0.0f;
    if (at < n) { v[0] = static_cast<float>(x[at]); v[1] = static_cast<float>(x[at + 1]); }
    float amax = fmaxf(fabsf(v[0]), fabsf(v[1]));
    for (int o = BLOCK / 4; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    return powf(2.0f, ceilf(log2f(fmaxf(amax, low) / top)));
}
"""


def _pairs_launch(size):
    """grid and threadgroup of a kernel whose threads take two values each of `size`."""
    warps = -(-size // 64)
    return (warps * 32, 1, 1), (min(warps, 8) * 32, 1, 1)


_KV_ROUNDING_CUDA = """
    const size_t at = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    float v[2];
    const float scale = block_scale<BLOCK>(x, at, (size_t)ROWS * D, v, 1e-4f, 448.0f);
    if (at >= (size_t)ROWS * D) return;
    if (at % D < WIDTH)
        for (int i = 0; i < 2; ++i)
            v[i] = static_cast<float>(__nv_fp8_e4m3(fminf(fmaxf(v[i] / scale, -448.0f), 448.0f))) * scale;
    for (int i = 0; i < 2; ++i) store(y + at + i, __half2float(__float2half_rn(v[i])));
"""


@lru_cache(maxsize=None)
def _kv_rounding_kernel():
    return mx.fast.cuda_kernel(name="ds4_kv_rounding", input_names=["x"], output_names=["y"],
                               source=_KV_ROUNDING_CUDA, header="#include <cuda_fp8.h>\n" + _LOADS + _BLOCK_SCALE)


def _kv_block(width):
    return min(64, width)  # `fp8_e4m3_sim`'s block for rows this narrow


def _kv_rounding_cuda(x, width, dtype):
    T, D = x.shape
    grid, threadgroup = _pairs_launch(x.size)
    return _kv_rounding_kernel()(
        inputs=[x], template=[("ROWS", T), ("D", D), ("WIDTH", width), ("BLOCK", _kv_block(width)),
                              *_dtype_keys([x]), ("Y_TYPE", dtype)],
        grid=grid, threadgroup=threadgroup, output_shapes=[x.shape], output_dtypes=[dtype])[0]


def _kv_rounding_sample():
    x = _random(3, 512) * mx.array([1e-3, 1.0, 40.0])[:, None]  # rows whose blocks take different scales
    return [(x.astype(mx.bfloat16), 448, mx.float16), (x.reshape(48, 32), 16, mx.float16)]


KV_ROUNDING = Kernel("kv_rounding", kv_rounding_reference, _kv_rounding_sample, 1e-6)
KV_ROUNDING.launches["cuda"] = _kv_rounding_cuda


def kv_rounding(x, width, dtype):
    """`kv_rounding_reference`: one kernel on CUDA for up to FEW_ROWS_MAX rows of blocks of a power of two
    values from 4 on (those `fp8_e4m3_sim` takes without a concatenation)."""
    (T, D), block = x.shape, _kv_block(width)
    fits = T <= FEW_ROWS_MAX and 4 <= block and block & (block - 1) == 0 and width % block == D % block == 0
    if not fits or width > D or KV_ROUNDING.backend() is None:
        return kv_rounding_reference(x, width, dtype)
    return KV_ROUNDING.launches["cuda"](x, width, dtype)


# The indexer's rows and queries after their Hadamard transform under `quant_sim`: FP4 E2M1 with a
# power-of-two scale per block of 32, then float16 (`fp4_e2m1_sim`, `f16_round`). As MLX ops it is a
# launch for each step (the block maxima, the scales, the rounding, the casts); here one, 2 values a
# thread (`block_scale`), the grid steps summed as `fp4_e2m1_round` sums them (exactly).


def fp4_rounding_reference(x):
    """x float32 [..., n] (n a multiple of 32) -> `f16_round(fp4_e2m1_sim(x))`, float32."""
    return f16_round(fp4_e2m1_sim(x))


_FP4_ROUNDING_CUDA = """
    const size_t at = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    float v[2];
    const float scale = block_scale<BLOCK>(x, at, N, v, 7.052966e-38f, 6.0f);
    if (at >= (size_t)N) return;
    for (int i = 0; i < 2; ++i) {
        const float c = fminf(fmaxf(v[i] / scale, -6.0f), 6.0f), a = fabsf(c);
        const float steps = (a > 0.25f ? 0.5f : 0.0f) + (a >= 0.75f ? 0.5f : 0.0f) + (a > 1.25f ? 0.5f : 0.0f)
                          + (a >= 1.75f ? 0.5f : 0.0f) + (a > 2.5f ? 1.0f : 0.0f) + (a >= 3.5f ? 1.0f : 0.0f)
                          + (a > 5.0f ? 2.0f : 0.0f);
        const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
        y[at + i] = __half2float(__float2half_rn(sign * steps * scale));
    }
"""


@lru_cache(maxsize=None)
def _fp4_rounding_kernel():
    return mx.fast.cuda_kernel(name="ds4_fp4_rounding", input_names=["x"], output_names=["y"],
                               source=_FP4_ROUNDING_CUDA, header=_BLOCK_SCALE)


def _fp4_rounding_cuda(x):
    grid, threadgroup = _pairs_launch(x.size)
    return _fp4_rounding_kernel()(
        inputs=[x], template=[("N", x.size), ("BLOCK", min(32, x.shape[-1]))], grid=grid, threadgroup=threadgroup,
        output_shapes=[x.shape], output_dtypes=[mx.float32])[0]


def _fp4_rounding_sample():
    x = _random(3, 4, 128) * mx.array([1e-3, 1.0, 40.0])[:, None, None]
    return [(x,), (x[:1, :1, :96],), (x[:2, :, :16],)]


FP4_ROUNDING = Kernel("fp4_rounding", fp4_rounding_reference, _fp4_rounding_sample, 1e-6)
FP4_ROUNDING.launches["cuda"] = _fp4_rounding_cuda


def fp4_rounding(x):
    """`fp4_rounding_reference`: one kernel on CUDA for a few tokens' float32 rows of whole blocks
    (`fp4_e2m1_sim`'s: 32 values, or the row where it is shorter, a power of two from 4 on)."""
    block = min(32, x.shape[-1])
    few = x.size <= FEW_ROWS_MAX * 64 * 128  # a few tokens' indexer queries (64 heads of 128)
    fits = x.dtype == mx.float32 and few and 4 <= block and block & (block - 1) == 0 and x.shape[-1] % block == 0
    if not fits or FP4_ROUNDING.backend() is None:
        return fp4_rounding_reference(x)
    return FP4_ROUNDING.launches["cuda"](x)


# ---------------------------------------------------------------------------------------------
# The indexer's picks for a few queries, in two launches where MLX takes five and a copy (two products, the
# ReLU, the mask, a sort): the scores (one warp four rows at a time, a lane two of the 64 heads, the query
# held transposed in shared memory), then a stable top-k of each query's scores (one block a query: a
# radix select of the k-th key, the keys below it and the lowest rows equal to it, a bitonic sort of
# those by key and row). A query may read its own session's rows of a pool's flat buffer.


def index_scores_reference(qi, w, rows, visible, pool_rows, columns):
    """qi float32 [T, heads, dim], head weights w [T, heads]; query t scores rows pool_rows[t] * columns + c
    of `rows` [*, dim] for c < columns (the ReLU of each head's product, weighted over the heads); columns at
    or past visible[t] are -inf. -> [T, columns] float32."""
    own = rows[pool_rows[:, None] * columns + counting(columns)[None, :]]
    scores = (w[:, None, :] @ mx.maximum(qi @ own.swapaxes(-1, -2), 0))[:, 0]
    return mx.where(counting(columns)[None, :] < visible[:, None], scores, -mx.inf)


_INDEX_SCORES_CUDA = """
    constexpr int HL = NH / 32;  // a lane's heads; a warp takes ROWS rows, four at a time
    __shared__ float q_t[D * (NH + 1)];  // [dim][head], a row padded so that the transposing writes spread
    __shared__ float weight[NH];
    __shared__ float staged[WARPS][4][D];
    const int t = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int i = threadIdx.x; i < NH * D; i += WARPS * 32) q_t[(i % D) * (NH + 1) + i / D] = qi[(size_t)t * NH * D + i];
    for (int i = threadIdx.x; i < NH; i += WARPS * 32) weight[i] = w[(size_t)t * NH + i];
    __syncthreads();
    const int seen = visible[t];
    const size_t base = (size_t)pool_rows[t] * COLUMNS;
    const int first = (blockIdx.x * WARPS + warp) * ROWS;
    for (int r0 = first; r0 < first + ROWS && r0 < COLUMNS; r0 += 4) {
        const float masked = __int_as_float(0xff800000);  // -inf
        float s[4] = {masked, masked, masked, masked};
        if (r0 < seen) {
            for (int j = 0; j < 4; ++j)
                for (int d = lane; d < D; d += 32)
                    staged[warp][j][d] = r0 + j < seen ? static_cast<float>(rows[(base + r0 + j) * D + d]) : 0.0f;
            __syncwarp();
            float acc[4][HL] = {};
            for (int d = 0; d < D; ++d) {
                float q[HL];
                for (int h = 0; h < HL; ++h) q[h] = q_t[d * (NH + 1) + lane + 32 * h];
                for (int j = 0; j < 4; ++j) {
                    const float r = staged[warp][j][d];
                    for (int h = 0; h < HL; ++h) acc[j][h] = fmaf(q[h], r, acc[j][h]);
                }
            }
            for (int j = 0; j < 4; ++j) {
                float v = 0.0f;
                for (int h = 0; h < HL; ++h) v += fmaxf(acc[j][h], 0.0f) * weight[lane + 32 * h];
                for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
                if (r0 + j < seen) s[j] = v;
            }
            __syncwarp();
        }
        for (int j = 0; j < 4; ++j)
            if (lane == j && r0 + j < COLUMNS) scores[(size_t)t * COLUMNS + r0 + j] = s[j];
    }
"""
_INDEX_SCORES_WARPS, _INDEX_SCORES_ROWS = 4, 8  # warps a block, rows a warp


@lru_cache(maxsize=None)
def _index_scores_kernel():
    return mx.fast.cuda_kernel(name="ds4_index_scores", input_names=["qi", "w", "rows", "visible", "pool_rows"],
                               output_names=["scores"], source=_INDEX_SCORES_CUDA)


def _index_scores_cuda(qi, w, rows, visible, pool_rows, columns):
    T, heads, dim = qi.shape
    inputs = [qi, w, rows, visible.astype(mx.int32), pool_rows.astype(mx.int32)]
    blocks = -(-columns // (_INDEX_SCORES_WARPS * _INDEX_SCORES_ROWS))
    return _index_scores_kernel()(
        inputs=inputs, template=[("NH", heads), ("D", dim), ("COLUMNS", columns), ("WARPS", _INDEX_SCORES_WARPS),
                                 ("ROWS", _INDEX_SCORES_ROWS), *_dtype_keys(inputs)],
        grid=(blocks * 32 * _INDEX_SCORES_WARPS, T, 1), threadgroup=(32 * _INDEX_SCORES_WARPS, 1, 1),
        output_shapes=[(T, columns)], output_dtypes=[mx.float32])[0]


def _index_scores_sample():
    """Three queries on a pool of two sessions' 21 rows (one sees them all, one a few, one none), and two
    on one session's float16 rows."""
    pooled = (_random(3, 32, 16), _random(3, 32), _random(42, 16), mx.array([21, 6, 0], mx.int32),
              mx.array([1, 0, 1], mx.int32), 21)
    shared = (_random(2, 64, 128, seed=1), _random(2, 64, seed=1), _random(37, 128, seed=1).astype(mx.float16),
              mx.array([37, 30], mx.int32), mx.array([0, 0], mx.int32), 37)
    return [pooled, shared]


def _finite_and_masked(inputs, result):
    """Scores compared as their finite values and where they are -inf (a difference of two -inf is NaN)."""
    (scores,) = result
    masked = mx.isinf(scores)
    return mx.where(masked, 0.0, scores), masked.astype(mx.float32)


INDEX_SCORES = Kernel("index_scores", index_scores_reference, _index_scores_sample, 1e-4, compared=_finite_and_masked)
INDEX_SCORES.launches["cuda"] = _index_scores_cuda


def top_rows_reference(scores, k):
    """Each query's k rows of the highest scores [T, C] (of equal ones the lowest row first), in that order:
    MLX's stable sort. -> [T, min(k, C)] uint32."""
    return mx.argsort(-scores, axis=-1)[:, :k]


_TOP_ROWS_CUDA = """
    __shared__ unsigned hist[256];
    __shared__ unsigned long long picked[KP];  // key << 32 | row
    __shared__ unsigned warp_counts[THREADS / 32];
    __shared__ unsigned found[2];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const float* s = scores + (size_t)t * C;
    auto key = [&](int c) {  // ascending keys: descending scores, -0 as +0
        unsigned u = __float_as_uint(s[c]);
        if (u == 0x80000000u) u = 0u;
        return (u & 0x80000000u) ? u : ~(u | 0x80000000u);
    };
    // the K-th smallest key, a byte at a time from the top: `prefix` its bytes so far, `want` its rank among
    // the keys that begin with them
    unsigned prefix = 0u, mask = 0u, want = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += THREADS) hist[i] = 0u;
        __syncthreads();
        for (int c = tid; c < C; c += THREADS) {
            const unsigned k = key(c);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (warp == 0) {  // the byte whose keys hold the want-th: a scan of the counts, 8 a lane
            unsigned mine[8], sum = 0u;
            for (int i = 0; i < 8; ++i) { mine[i] = hist[lane * 8 + i]; sum += mine[i]; }
            unsigned inclusive = sum;
            for (int o = 1; o < 32; o *= 2) {
                const unsigned v = __shfl_up_sync(0xffffffff, inclusive, o);
                if (lane >= o) inclusive += v;
            }
            const int owner = __ffs(__ballot_sync(0xffffffff, inclusive >= want)) - 1;
            if (lane == owner) {
                unsigned below = inclusive - sum;
                int i = 0;
                while (below + mine[i] < want) below += mine[i++];
                found[0] = prefix | (unsigned)(lane * 8 + i) << shift;
                found[1] = want - below;
            }
        }
        __syncthreads();
        prefix = found[0], want = found[1], mask |= 255u << shift;
        __syncthreads();
    }
    // the keys below the K-th in any order (the sort orders them), then the `want` lowest rows at it
    const unsigned below_count = K - want;
    if (tid == 0) found[0] = 0u;
    __syncthreads();
    for (int c = tid; c < C; c += THREADS) {
        const unsigned k = key(c);
        if (k < prefix) picked[atomicAdd(&found[0], 1u)] = (unsigned long long)k << 32 | (unsigned)c;
    }
    unsigned taken = 0u;
    for (int c0 = 0; c0 < C && taken < want; c0 += THREADS) {
        const int c = c0 + tid;
        const bool tie = c < C && key(c) == prefix;
        const unsigned ballot = __ballot_sync(0xffffffff, tie);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        unsigned before = 0u, total = 0u;
        for (int i = 0; i < THREADS / 32; ++i) { before += i < warp ? warp_counts[i] : 0u; total += warp_counts[i]; }
        const unsigned rank = taken + before + __popc(ballot & ((1u << lane) - 1u));
        if (tie && rank < want) picked[below_count + rank] = (unsigned long long)prefix << 32 | (unsigned)c;
        taken += total;
        __syncthreads();
    }
    for (int i = K + tid; i < KP; i += THREADS) picked[i] = ~0ull;
    for (int size = 2; size <= KP; size *= 2)  // bitonic: ascending by key, then row
        for (int stride = size / 2; stride > 0; stride /= 2) {
            __syncthreads();
            for (int i = tid; i < KP / 2; i += THREADS) {
                const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const unsigned long long a = picked[lo], b = picked[hi];
                if ((a > b) == ((lo & size) == 0)) picked[lo] = b, picked[hi] = a;
            }
        }
    __syncthreads();
    for (int i = tid; i < K; i += THREADS) picks[(size_t)t * K + i] = (unsigned)picked[i];
"""
TOP_ROWS_MAX = 4096  # picks a query: KP keys of 8 bytes fill 32 KB of shared memory
_TOP_ROWS_THREADS = 1024  # a block, a query


@lru_cache(maxsize=None)
def _top_rows_kernel():
    return mx.fast.cuda_kernel(name="ds4_top_rows", input_names=["scores"], output_names=["picks"],
                               source=_TOP_ROWS_CUDA)


def _top_rows_cuda(scores, k):
    T, C = scores.shape
    K = min(k, C)
    return _top_rows_kernel()(
        inputs=[scores],
        template=[("C", C), ("K", K), ("KP", 1 << (K - 1).bit_length()), ("THREADS", _TOP_ROWS_THREADS)],
        grid=(_TOP_ROWS_THREADS * T, 1, 1), threadgroup=(_TOP_ROWS_THREADS, 1, 1), output_shapes=[(T, K)],
        output_dtypes=[mx.uint32])[0]


def _top_rows_sample():
    """Scores of few distinct values (long runs of ties at the k-th), both zeros, masked rows; more rows than
    a block's threads, and fewer rows than k."""
    levels = mx.array([-2.0, -0.0, 0.0, 0.5, 3.0, -mx.inf])
    many = levels[mx.random.randint(0, 6, (3, 2500), key=mx.random.key(3))]
    few = levels[mx.random.randint(0, 6, (2, 40), key=mx.random.key(4))]
    return [(many, 512), (many[:, :700], 64), (few, 64)]


TOP_ROWS = Kernel("top_rows", top_rows_reference, _top_rows_sample, 0.0)
TOP_ROWS.launches["cuda"] = _top_rows_cuda


@lru_cache(maxsize=64)
def _first_rows(n):
    """[n] int32 zeros as data (no node of a step's graph): every query reads the rows from the first on, and
    a sliding layer's tokens see no compressed rows."""
    return mx.array(np.zeros(n, np.int32))


def index_top_rows(qi, w, rows, visible, k, pool_rows=None, columns=None):
    """`top_rows_reference(index_scores_reference(...), k)` in two launches on CUDA for a few queries (the
    rows from row 0 on where `pool_rows` is None, `columns` of them, all by default); None where the kernels do
    not apply (the caller runs its own path)."""
    T, heads, dim = qi.shape
    columns = rows.shape[0] if columns is None else columns
    shared_bytes = 4 * (dim * (heads + 1) + heads + _INDEX_SCORES_WARPS * 4 * dim)
    fits = (T <= FEW_ROWS_MAX and heads % 32 == 0 and shared_bytes <= 48 * 1024 and min(k, columns) <= TOP_ROWS_MAX
            and qi.dtype == w.dtype == mx.float32 and visible.shape == (T,))
    if not fits or INDEX_SCORES.backend() is None or TOP_ROWS.backend() is None:
        return None
    scores = _index_scores_cuda(qi, w, rows, visible, _first_rows(T) if pool_rows is None else pool_rows, columns)
    return _top_rows_cuda(scores, k)


# ---------------------------------------------------------------------------------------------
# What a compressed layer's tokens log from themselves, for a few tokens: each compressor's kv and score
# row (x through its stacked matrix, in the product's dtype, as float32 plus the score offsets of the
# token's place in its block) and the indexer's head weights (x through its map, times a scale). Three
# products, two gathers of offsets and three element-wise kernels as MLX ops; here one launch over the maps
# laid end to end (a block two rows of one map for up to 8 tokens, a thread 16-byte words of the rows).


def logged_rows_reference(x, in_blocks, maps):
    """x [T, H] through each map (w [N, H], then offsets [m, N] float32 read at row in_blocks[t], or a float
    scale): -> a tuple of [T, N] float32, x @ w.T in the product's dtype, then plus the offsets or times the
    scale."""
    out = []
    for w, extra in maps:
        y = (x @ w.T).astype(mx.float32)
        out.append(y + extra[in_blocks] if isinstance(extra, mx.array) else y * extra)
    return tuple(out)


_LOGGED_ROWS_CUDA = """
    constexpr int PER = 16 / sizeof(w0[0]), WORDS = H / PER, STEPS = (WORDS + GROUP - 1) / GROUP;
    const int tid = threadIdx.x, first = blockIdx.y * BATCH;
    const int tokens = TOKENS - first < BATCH ? TOKENS - first : BATCH;
    int row = blockIdx.x * ROWS, map = 0;  // the block's rows: rows `row` on of map `map`
    if (MAPS > 1 && row >= N0) row -= N0, map = 1;
    if (MAPS > 2 && map == 1 && row >= N1) row -= N1, map = 2;
    const auto* w = map == 0 ? w0 : map == 1 ? W1 : W2;
    const int n = map == 0 ? N0 : map == 1 ? N1 : N2;
    uint4 words[STEPS][ROWS];  // every word of the block's rows this thread reads, in flight at once
    for (int s = 0; s < STEPS; ++s)
        for (int r = 0; r < ROWS; ++r)
            if (tid + s * GROUP < WORDS)
                words[s][r] = reinterpret_cast<const uint4*>(w + (size_t)(row + r) * H)[tid + s * GROUP];
    float acc[ROWS][BATCH] = {};
    for (int t = 0; t < tokens; ++t)
        for (int s = 0; s < STEPS; ++s) {
            const int c = tid + s * GROUP;
            if (c >= WORDS) break;
            float v[PER];
            load_floats<PER>(x + (size_t)(first + t) * H + c * PER, v);
            for (int r = 0; r < ROWS; ++r) {
                const auto* e = reinterpret_cast<const decltype(pointee(w0))*>(&words[s][r]);
                for (int j = 0; j < PER; ++j) acc[r][t] += static_cast<float>(e[j]) * v[j];
            }
        }
    float v = block_sums<ROWS, BATCH, GROUP>(acc, tid);
    if (tid >= ROWS * BATCH || tid % BATCH >= tokens) return;
    const int t = first + tid % BATCH, col = row + tid / BATCH;
    v = rounded_as(x, v);  // the product in x's dtype, as MLX's
    if (map == 0) y0[(size_t)t * N0 + col] = v + ape0[(size_t)in_blocks[t] * N0 + col];
    else if (map == 1) Y1[(size_t)t * N1 + col] = v + APE1[(size_t)in_blocks[t] * N1 + col];
    else Y2[(size_t)t * N2 + col] = v * SCALE;
"""
_LOGGED_GROUP, _LOGGED_ROWS, _LOGGED_BATCH = 128, 2, 8


@lru_cache(maxsize=None)
def _logged_rows_kernel(maps, scale):
    """The kernel for `maps` maps: one or two compressors' (offsets), then the indexer's (`scale`)."""
    inputs, outputs = ["x", "in_blocks", "w0", "ape0"], ["y0"]
    defines = f"#define MAPS {maps}\n#define SCALE {float(scale)!r}f\n"
    if maps > 1:
        inputs += ["w1", "ape1"]
        outputs += ["y1"]
    if maps > 2:
        inputs += ["w2"]
        outputs += ["y2"]
    # the names a kernel of fewer maps lacks stand for the first map's (those lines are never reached)
    defines += "".join(f"#define {name.upper()} {name if name in inputs + outputs else name[:-1] + '0'}\n"
                       for name in ("w1", "ape1", "y1", "w2", "y2"))
    return mx.fast.cuda_kernel(name=f"ds4_logged_rows_{maps}_{abs(hash(scale))}", input_names=inputs,
                               output_names=outputs, source=defines + _LOGGED_ROWS_CUDA, header=_LOADS)


def _logged_rows_cuda(x, in_blocks, maps):
    T, H = x.shape
    batch = min(T, _LOGGED_BATCH)
    scale = maps[2][1] if len(maps) > 2 else 0.0
    inputs = [x, in_blocks.astype(mx.int32)]
    for w, extra in maps:
        inputs += [w] + ([extra.astype(mx.float32)] if isinstance(extra, mx.array) else [])
    sizes = [w.shape[0] for w, _ in maps] + [0] * (3 - len(maps))
    return tuple(_logged_rows_kernel(len(maps), scale)(
        inputs=inputs,
        template=[("TOKENS", T), ("H", H), ("N0", sizes[0]), ("N1", sizes[1]), ("N2", sizes[2]), ("ROWS", _LOGGED_ROWS),
                  ("BATCH", batch), ("GROUP", _LOGGED_GROUP), *_dtype_keys(inputs)],
        grid=(sum(sizes) // _LOGGED_ROWS * _LOGGED_GROUP, -(-T // batch), 1), threadgroup=(_LOGGED_GROUP, 1, 1),
        output_shapes=[(T, w.shape[0]) for w, _ in maps], output_dtypes=[mx.float32] * len(maps)))


def _logged_rows_sample():
    """Two compressors and the indexer's map for 9 tokens (two batches), and one compressor for one token."""
    x, blocks = _random(9, 256), mx.array([0, 1, 2, 3, 0, 1, 2, 3, 1], mx.int32)
    three = ((_random(16, 256, seed=1), _random(4, 16, seed=2)), (_random(8, 256, seed=3), _random(4, 8, seed=4)),
             (_random(6, 256, seed=5), 0.125))
    return [(x, blocks, three), (x[:1], blocks[:1], three[:1])]


LOGGED_ROWS = Kernel("logged_rows", logged_rows_reference, _logged_rows_sample, 1e-4)
LOGGED_ROWS.launches["cuda"] = _logged_rows_cuda


def logged_rows(x, in_blocks, maps):
    """`logged_rows_reference` in one launch on CUDA for a few tokens: up to two compressors' maps (offsets)
    then at most one scaled; None where the kernel does not apply (a quantized map: None for its w; other
    dtypes; the caller then runs its own path)."""
    T, H = x.shape
    kinds = [isinstance(extra, mx.array) for _, extra in maps]
    fits = (T <= FEW_ROWS_MAX and 1 <= len(maps) <= 3 and kinds[: min(2, len(maps))] == [True] * min(2, len(maps))
            and (len(maps) < 3 or not kinds[2]) and all(w is not None and w.dtype == x.dtype and w.shape[1] == H
                                                         and w.shape[0] % _LOGGED_ROWS == 0 for w, _ in maps)
            and (H * x.itemsize) % 16 == 0 and in_blocks is not None)
    if not fits or LOGGED_ROWS.backend() is None:
        return None
    return LOGGED_ROWS.launches["cuda"](x, in_blocks, maps)


# ---------------------------------------------------------------------------------------------
# A compressor's finished rows: a pooled step's (one decoded token of each of B sessions: each token's
# open block pooled from its ring's rows, its own row fresh), or the blocks a step of one session
# completes (a verify's, a prefill chunk's: their rows in the ring or among the step's own), normed and
# rotated to the block's first position. As MLX ops that is a gather (or two and a concatenation), the
# own row's select, the halves' selects, a softmax, a product and a sum, the norm and the rotation; here
# one launch, a block a pooled row and a thread a pair of channels, the softmax in three passes over the
# rows as MLX takes it (maximum, sum, weights).


def pool_blocks_reference(logged, ratio, head_dim, overlap, prev_valid=None):
    """Logged rows of whole blocks [n, rows, 2 * width] -> pooled rows [n, head_dim] (a compressor's pooling): a
    per-channel softmax of the scores over the rows weighting the kv values; with overlap (width twice the
    head dim) each block comes after the one before it, which gives the first half of the channels and whose
    scores count only where `prev_valid`."""
    W, d = logged.shape[-1] // 2, head_dim
    kv, score = logged[..., :W], logged[..., W:]
    if overlap:
        # the block before gives the first half of the channels and the block itself the second: a select
        # by row, which fuses, where concatenating the halves would copy each
        before = (counting(logged.shape[1]) < ratio)[None, :, None]
        kv = mx.where(before, kv[..., :d], kv[..., d:])
        score = mx.where(before, mx.where(prev_valid, score[..., :d], -mx.inf), score[..., d:])
    weights = mx.softmax(score.astype(mx.float32), axis=1)
    return (weights * kv).sum(axis=1)


def _finished_rows(logged, rows, norm_weight, rope, ratio, overlap, eps):
    """Logged rows of blocks [n, span, 2 * width] pooled, normed and rotated to their blocks' first positions
    (blocks `rows` [n]) -> [n, head_dim] float32."""
    pooled = pool_blocks_reference(logged, ratio, norm_weight.shape[0], overlap,
                                   (rows >= 1)[:, None, None] if overlap else None)
    return norm_rope_reference(pooled, rope, rows * ratio, pooled.shape[-1], (norm_weight.astype(pooled.dtype), eps))


def pooled_rows_reference(fresh, ring, block, in_blocks, open_row, norm_weight, rope, ratio, overlap, eps):
    """Each token's open block pooled (`pool_blocks_reference`: the ring's rows `block` [B, n], the token's
    own row, n - ratio + in_blocks[b], from `fresh` [B, 2 * width]), normed with `norm_weight` and rotated to
    the block's first position, open_row * ratio: -> [B, head_dim] float32."""
    n = block.shape[1]
    logged = ring[block]
    own = (counting(n)[None, :] == (n - ratio + in_blocks)[:, None])[..., None]
    logged = mx.where(own, fresh.astype(ring.dtype)[:, None, :], logged)
    return _finished_rows(logged, open_row, norm_weight, rope, ratio, overlap, eps)


def completed_rows_reference(fresh, ring, sources, rows, norm_weight, rope, ratio, overlap, eps):
    """The blocks a step of T tokens completes (`RingSlots.blocks` [n, span]: ring rows, or -1 - a row of the
    step's `fresh` [T, 2 * width]) pooled, normed and rotated to their first positions (blocks `rows` [n]):
    -> [n, head_dim] float32."""
    theirs = fresh.astype(ring.dtype)[mx.maximum(-1 - sources, 0)]
    logged = mx.where((sources < 0)[..., None], theirs, ring[mx.maximum(sources, 0)])
    return _finished_rows(logged, rows, norm_weight, rope, ratio, overlap, eps)


_POOLED_ROWS_CUDA = """
    constexpr int W = OVERLAP ? 2 * D : D, FIRST_ROTATED = (D - ROTATED) / 2, WARPS = (D / 2 + 31) / 32;
    const int b = blockIdx.x, pair = threadIdx.x, lane = pair % 32;
    const bool mine = pair < D / 2;  // the block is whole warps: the last one's spare lanes add zeros
    const int own = SOURCES ? -1 : N - M + in_blocks[b];
    const bool prev_valid = !OVERLAP || open_row[b] >= 1;
    const float minus_inf = __int_as_float(0xff800000);
    // row r's value `at`: a ring row's, or one of the step's own rows from `fresh`, as the ring holds it (the
    // pooled form: the token's own row; else a negative slot, -1 - the step's row)
    auto value = [&](int r, int at) {
        const int slot = block[(size_t)b * N + r];
        const bool fresh_row = SOURCES ? slot < 0 : r == own;
        return fresh_row ? rounded_as(ring, static_cast<float>(fresh[(size_t)(SOURCES ? -1 - slot : b) * 2 * W + at]))
                         : static_cast<float>(ring[(size_t)slot * 2 * W + at]);
    };
    float v[2] = {0.0f, 0.0f};
    for (int k = 0; k < 2 && mine; ++k) {
        const int c = 2 * pair + k;
        auto half = [&](int r) { return OVERLAP && r >= M ? D : 0; };
        auto score = [&](int r) { return OVERLAP && r < M && !prev_valid ? minus_inf : value(r, W + half(r) + c); };
        float top = minus_inf, total = 0.0f, sum = 0.0f;
        for (int r = 0; r < N; ++r) top = fmaxf(top, score(r));
        for (int r = 0; r < N; ++r) total += expf(score(r) - top);
        for (int r = 0; r < N; ++r) sum += expf(score(r) - top) / total * value(r, half(r) + c);
        v[k] = sum;
    }
    __shared__ float squares[WARPS];
    float s = v[0] * v[0] + v[1] * v[1];
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
    if (lane == 0) squares[pair / 32] = s;
    __syncthreads();
    s = 0.0f;
    for (int w = 0; w < WARPS; ++w) s += squares[w];
    if (!mine) return;
    const float normalizer = rsqrtf(s / D + EPS);
    for (int k = 0; k < 2; ++k) v[k] = static_cast<float>(weight[2 * pair + k]) * (v[k] * normalizer);
    if (pair >= FIRST_ROTATED) {
        const float theta = static_cast<float>(open_row[b] * M) * (1.0f / periods[pair - FIRST_ROTATED]);
        const float c = cos(theta), sn = sin(theta), a = v[0];
        v[0] = a * c - v[1] * sn;
        v[1] = a * sn + v[1] * c;
    }
    y[(size_t)b * D + 2 * pair] = v[0];
    y[(size_t)b * D + 2 * pair + 1] = v[1];
"""


@lru_cache(maxsize=None)
def _pooled_rows_kernel(eps):
    return mx.fast.cuda_kernel(name=f"ds4_pooled_rows_{abs(hash(eps))}",
                               input_names=["fresh", "ring", "block", "in_blocks", "open_row", "weight", "periods"],
                               output_names=["y"], source=f"#define EPS {float(eps)!r}f\n" + _POOLED_ROWS_CUDA,
                               header=_LOADS)


def _pooled_rows_cuda(fresh, ring, block, in_blocks, open_row, norm_weight, rope, ratio, overlap, eps, sources=False):
    """The launch of both forms: with `sources`, `block` holds `RingSlots.blocks` and `in_blocks` is unread."""
    B, n = block.shape
    d = norm_weight.shape[0]
    inputs = [fresh, ring, block.astype(mx.int32), in_blocks.astype(mx.int32), open_row.astype(mx.int32), norm_weight,
              rope.periods]  # the weight read in its dtype: a cast would be a launch every step
    return _pooled_rows_kernel(eps)(
        inputs=inputs, template=[("N", n), ("M", ratio), ("D", d), ("OVERLAP", overlap), ("ROTATED", rope.dim),
                                 ("SOURCES", sources), *_dtype_keys(inputs)],
        grid=(B * _whole_warps(d // 2), 1, 1), threadgroup=(_whole_warps(d // 2), 1, 1), output_shapes=[(B, d)],
        output_dtypes=[mx.float32])[0]


def _whole_warps(threads):
    return -(-threads // 32) * 32


def _pooled_rows_sample():
    """Three tokens of a pool of two sessions' rings (8 rows of 2 x 2 x 64 values): the overlapping kind (the
    first token's block with none before it), then the plain kind over a ring of float16, at a head dim of 64
    (whole warps of pairs) and 32 (a warp with spare lanes)."""
    from ds4_mlx.models.numerics import Rope

    rope, ring = Rope(16, 10000.0), _random(16, 256)
    block = mx.array([[0, 0, 0, 0, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 1, 2, 3]], mx.int32)
    overlapping = (_random(3, 256, seed=1), ring, block, mx.array([1, 3, 0], mx.int32), mx.array([0, 5, 9], mx.int32),
                   1 + 0.1 * _random(64, seed=2), rope, 4, True, 1e-6)
    plain = (_random(2, 128, seed=3), ring.reshape(32, 128).astype(mx.float16), block[:2], mx.array([7, 2], mx.int32),
             mx.array([3, 1], mx.int32), 1 + 0.1 * _random(64, seed=4), rope, 8, False, 1e-6)
    narrow = (_random(2, 64, seed=3), ring.reshape(64, 64), block[:2], mx.array([7, 2], mx.int32),
              mx.array([3, 1], mx.int32), 1 + 0.1 * _random(32, seed=4), rope, 8, False, 1e-6)
    return [overlapping, plain, narrow]


POOLED_ROWS = Kernel("pooled_rows", pooled_rows_reference, _pooled_rows_sample, 1e-4)
POOLED_ROWS.launches["cuda"] = _pooled_rows_cuda


def _completed_rows_sample():
    """Two blocks a step of 6 tokens completes on one session's ring of 16 rows, some of their rows the
    step's own (the overlapping kind, the first block with none before it); one of the plain kind."""
    *_, norm_weight, rope, _, _, eps = _pooled_rows_sample()[0]
    ring, fresh = _random(16, 256), _random(6, 256, seed=5)
    sources = mx.array([[0, 0, 0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, -1, -2, -3]], mx.int32)
    plain = (fresh[:, :128], ring.reshape(32, 128).astype(mx.float16), mx.array([[9, 10, 11, -1, -2, -3, -4, -5]],
             mx.int32), mx.array([7], mx.int32), norm_weight, rope, 8, False, eps)
    return [(fresh, ring, sources, mx.array([0, 1], mx.int32), norm_weight, rope, 4, True, eps), plain]


COMPLETED_ROWS = Kernel("completed_rows", completed_rows_reference, _completed_rows_sample, 1e-4)
COMPLETED_ROWS.launches["cuda"] = lambda fresh, ring, sources, rows, *rest: _pooled_rows_cuda(
    fresh, ring, sources, rows, rows, *rest, sources=True)


def _finishes_in_one_launch(kernel, fresh, norm_weight, overlap):
    """Whether the finished-rows kernel takes a compressor of this head dim (its pairs a block's threads)."""
    d = norm_weight.shape[0]
    return d % 2 == 0 and d // 2 <= 1024 and fresh.shape[-1] == 2 * d * (2 if overlap else 1) and kernel.backend()


def pooled_rows(fresh, ring, block, in_blocks, open_row, norm_weight, rope, ratio, overlap, eps):
    """`pooled_rows_reference`, one launch on CUDA."""
    if not _finishes_in_one_launch(POOLED_ROWS, fresh, norm_weight, overlap):
        return pooled_rows_reference(fresh, ring, block, in_blocks, open_row, norm_weight, rope, ratio, overlap, eps)
    return POOLED_ROWS.launches["cuda"](fresh, ring, block, in_blocks, open_row, norm_weight, rope, ratio, overlap, eps)


def completed_rows(fresh, ring, sources, rows, norm_weight, rope, ratio, overlap, eps):
    """`completed_rows_reference`, one launch on CUDA."""
    if not _finishes_in_one_launch(COMPLETED_ROWS, fresh, norm_weight, overlap):
        return completed_rows_reference(fresh, ring, sources, rows, norm_weight, rope, ratio, overlap, eps)
    return COMPLETED_ROWS.launches["cuda"](fresh, ring, sources, rows, norm_weight, rope, ratio, overlap, eps)


# ---------------------------------------------------------------------------------------------
# The hyper-connections' mixing weights for a few tokens: RMS-normalised flattened streams times `fn`.
# A matrix product over [1, 16384] x [16384, 24] is a matrix-vector product with 24 rows, which keeps
# 24 warps busy for ~23 us on the H200; here one block an output (it recomputes the norm: 64 KB of L2).


def hc_project_reference(streams, fn, eps):
    """streams [T, ...] float32 (a token's values flattened: n of them), fn [m, n] float32 -> rms_norm of
    each token's values @ fn.T, [T, m] float32."""
    return mx.fast.rms_norm(streams.reshape(streams.shape[0], -1), None, eps) @ fn.T


# A block's dot products with a row of `fn` and sums of squares added up, by warps and then the warps'
# sums in order: the dot over the RMS of the n values, in every thread (a block of GROUP threads).
_NORMED_DOT = """
template <int GROUP>
__device__ inline float normed_dot(float dot, float squares, int n) {
    __shared__ float part_dot[GROUP / 32], part_squares[GROUP / 32];
    for (int d = 16; d > 0; d /= 2) {
        dot += __shfl_xor_sync(0xffffffff, dot, d);
        squares += __shfl_xor_sync(0xffffffff, squares, d);
    }
    if (threadIdx.x % 32 == 0) { part_dot[threadIdx.x / 32] = dot; part_squares[threadIdx.x / 32] = squares; }
    __syncthreads();
    dot = squares = 0.0f;
    for (int w = 0; w < GROUP / 32; ++w) { dot += part_dot[w]; squares += part_squares[w]; }
    return dot * rsqrtf(squares / n + EPS);
}
"""
_HC_PROJECT_CUDA = """
    const int t = blockIdx.x / M, o = blockIdx.x % M, tid = threadIdx.x;
    float dot = 0.0f, squares = 0.0f;
    for (int i = tid; i < N; i += GROUP) {
        const float v = flat[t * N + i];
        dot += v * fn[o * N + i];
        squares += v * v;
    }
    const float normed = normed_dot<GROUP>(dot, squares, N);
    if (tid == 0) out[t * M + o] = normed;
"""
_PROJECT_GROUP = 256
HC_PROJECT_MAX_TOKENS = 8  # past this a matrix product reads `fn` once for all the tokens


@lru_cache(maxsize=None)
def _hc_project_kernel(eps):
    return mx.fast.cuda_kernel(name=f"ds4_hc_project_{abs(hash(eps))}", input_names=["flat", "fn"],
                               output_names=["out"], source=_HC_PROJECT_CUDA,
                               header=f"#define EPS {float(eps)!r}f\n" + _NORMED_DOT)


def hc_project(streams, fn, eps):
    """`hc_project_reference`, one kernel on CUDA for up to HC_PROJECT_MAX_TOKENS tokens (reading streams
    flat, so that no reshape, a node of each step's graph, comes before it)."""
    kind = HC_PROJECT.backend()
    if kind is None or streams.shape[0] > HC_PROJECT_MAX_TOKENS:
        return hc_project_reference(streams, fn, eps)
    return HC_PROJECT.launches[kind](streams, fn, eps)


def _hc_project_cuda(streams, fn, eps):
    T, n = streams.shape[0], streams.size // streams.shape[0]
    m = fn.shape[0]
    f32 = mx.float32
    return _hc_project_kernel(eps)(
        inputs=[streams.astype(f32), fn.astype(f32)], template=[("N", n), ("M", m), ("GROUP", _PROJECT_GROUP)],
        grid=(T * m * _PROJECT_GROUP, 1, 1), threadgroup=(_PROJECT_GROUP, 1, 1),
        output_shapes=[(T, m)], output_dtypes=[f32])[0]


HC_PROJECT = Kernel("hc_project", hc_project_reference, lambda: (_random(2, 1024), _random(24, 1024), 1e-6), 1e-4)
HC_PROJECT.launches["cuda"] = _hc_project_cuda


# ---------------------------------------------------------------------------------------------
# The hyper-connections' post: the sub-layer's output into each stream, plus the 4 x 4 mix of the streams.
# As a compiled graph it is one kernel, but its terms read eight slices of `comb` and the streams, view
# nodes that cost the host on every layer; here one thread a feature of a token, writing it in every stream.


@mx.compile
def hc_post_reference(out, streams, post, comb):
    """out [T, H] (the sub-layer's, any dtype), streams [T, hc, H], post [T, hc], comb [T, hc, hc] float32 ->
    post * out + comb's mix of the streams, [T, hc, H] float32. The mix as element-wise terms (a matrix
    product would run on TF32 tensor cores on CUDA), in the order j = 0, 1, ...."""
    into = comb.swapaxes(1, 2)  # [T, to, from]
    mixed = sum(into[:, :, j : j + 1] * streams[:, j : j + 1] for j in range(streams.shape[1]))
    return post[:, :, None] * out[:, None, :].astype(mx.float32) + mixed


_HC_POST_CUDA = """
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)ROWS * H) return;
    const size_t t = i / H, h = i % H;
    float s[HC];
    for (int j = 0; j < HC; ++j) s[j] = streams[(t * HC + j) * H + h];
    const float o = static_cast<float>(out[t * H + h]);
    for (int to = 0; to < HC; ++to) {
        float mixed = comb[(t * HC) * HC + to] * s[0];
        for (int j = 1; j < HC; ++j) mixed += comb[(t * HC + j) * HC + to] * s[j];
        y[(t * HC + to) * H + h] = post[t * HC + to] * o + mixed;
    }
"""


@lru_cache(maxsize=None)
def _hc_post_kernel():
    return mx.fast.cuda_kernel(name="ds4_hc_post", input_names=["out", "streams", "post", "comb"],
                               output_names=["y"], source=_HC_POST_CUDA)


def _hc_post_cuda(out, streams, post, comb):
    T, hc, H = streams.shape
    f32 = mx.float32
    inputs = [out, streams.astype(f32), post.astype(f32), comb.astype(f32)]
    return _hc_post_kernel()(
        inputs=inputs, template=[("ROWS", T), ("HC", hc), ("H", H), *_dtype_keys(inputs)],
        grid=(-(-T * H // 256) * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(T, hc, H)],
        output_dtypes=[f32])[0]


HC_POST = Kernel("hc_post", hc_post_reference,
                 lambda: (_random(3, 64).astype(mx.bfloat16), _random(3, 4, 64), _random(3, 4), _random(3, 4, 4)), 1e-5)
HC_POST.launches["cuda"] = _hc_post_cuda


def hc_post(out, streams, post, comb):
    """`hc_post_reference`, one kernel on CUDA (no view nodes)."""
    kind = HC_POST.backend()
    return hc_post_reference(out, streams, post, comb) if kind is None else HC_POST.launches[kind](out, streams, post,
                                                                                                  comb)


# ---------------------------------------------------------------------------------------------
# A sub-layer's HC post with the next HC projection of the streams it writes (the MoE's pre after the
# attention's post), for a few tokens: `hc_project`'s blocks, one an output, each computing the post's streams
# as it reads them (the old streams are in L2 for all the blocks), the first block of each token writing them.


def hc_post_project_reference(out, streams, post, comb, fn, eps):
    """`hc_post_reference`, then `hc_project_reference` of its streams with `fn` [m, hc * H] -> (streams
    [T, hc, H], mix [T, m]), float32."""
    mixed = hc_post_reference(out, streams, post, comb)
    T, hc, H = mixed.shape
    return mixed, hc_project_reference(mixed.reshape(T, hc * H), fn, eps)


# Thread `tid` takes features tid, tid + GROUP, ... of every stream (post's order of terms per value).
_HC_POST_PROJECT_CUDA = """
    const int t = blockIdx.x / M, o = blockIdx.x % M, tid = threadIdx.x;
    float p[HC], c[HC][HC];  // c[from][to]
    for (int to = 0; to < HC; ++to) {
        p[to] = post[t * HC + to];
        for (int j = 0; j < HC; ++j) c[j][to] = comb[(t * HC + j) * HC + to];
    }
    float dot = 0.0f, squares = 0.0f;
    for (int h = tid; h < H; h += GROUP) {
        float s[HC];
        for (int j = 0; j < HC; ++j) s[j] = streams[(t * HC + j) * H + h];
        const float x = static_cast<float>(out[t * H + h]);
        for (int to = 0; to < HC; ++to) {
            float mixed = c[0][to] * s[0];
            for (int j = 1; j < HC; ++j) mixed += c[j][to] * s[j];
            const float v = p[to] * x + mixed;
            if (o == 0) y[(t * HC + to) * H + h] = v;
            dot += v * fn[(size_t)o * HC * H + to * H + h];
            squares += v * v;
        }
    }
    const float normed = normed_dot<GROUP>(dot, squares, HC * H);
    if (tid == 0) mix[t * M + o] = normed;
"""


@lru_cache(maxsize=None)
def _hc_post_project_kernel(eps):
    return mx.fast.cuda_kernel(name=f"ds4_hc_post_project_{abs(hash(eps))}",
                               input_names=["out", "streams", "post", "comb", "fn"], output_names=["y", "mix"],
                               source=_HC_POST_PROJECT_CUDA, header=f"#define EPS {float(eps)!r}f\n" + _NORMED_DOT)


def _hc_post_project_cuda(out, streams, post, comb, fn, eps):
    T, hc, H = streams.shape
    m = fn.shape[0]
    f32 = mx.float32
    inputs = [out, streams.astype(f32), post.astype(f32), comb.astype(f32), fn.astype(f32)]
    return tuple(_hc_post_project_kernel(eps)(
        inputs=inputs, template=[("HC", hc), ("H", H), ("M", m), ("GROUP", _PROJECT_GROUP), *_dtype_keys(inputs)],
        grid=(T * m * _PROJECT_GROUP, 1, 1), threadgroup=(_PROJECT_GROUP, 1, 1),
        output_shapes=[(T, hc, H), (T, m)], output_dtypes=[f32, f32]))


def _hc_post_project_sample():
    T, hc, H = 3, 4, 64
    return (_random(T, H).astype(mx.bfloat16), _random(T, hc, H), _random(T, hc), _random(T, hc, hc),
            _random(24, hc * H), 1e-6)


HC_POST_PROJECT = Kernel("hc_post_project", hc_post_project_reference, _hc_post_project_sample, 1e-4)
HC_POST_PROJECT.launches["cuda"] = _hc_post_project_cuda


def hc_post_project(out, streams, post, comb, fn, eps):
    """`hc_post_project_reference`: one kernel on CUDA for up to HC_PROJECT_MAX_TOKENS tokens, else
    `hc_post` and `hc_project`."""
    if streams.shape[0] > HC_PROJECT_MAX_TOKENS or HC_POST_PROJECT.backend() is None:
        mixed = hc_post(out, streams, post, comb)
        return mixed, hc_project(mixed, fn, eps)
    return HC_POST_PROJECT.launches["cuda"](out, streams, post, comb, fn, eps)


# ---------------------------------------------------------------------------------------------
# The router of a MoE layer for a few tokens. As plain MLX it is a cast, the float32 product with the
# router's weight, the scores, an argpartition (a full sort on CUDA), a slice, a gather and the
# normalisation, each a launch. Here two: the logits over many blocks (the weight is the large read),
# then one warp a token for the scores, the choice and the weights. One launch would need a counter
# zeroed before each call, and `init_value` fills every output with a launch of its own.


def _routing_weights(scores, chosen, scaling):
    weights = mx.take_along_axis(scores, chosen, axis=-1)
    return weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * scaling


@mx.compile
def route_top_k(logits, bias, k, scaling):
    """sqrt(softplus) scores; top-k on the biased scores, weights from the unbiased ones, normalised and
    scaled. -> (experts [T, k], weights [T, k])."""
    scores = mx.sqrt(mx.logaddexp(logits.astype(mx.float32), 0.0))
    chosen = mx.argpartition(-(scores + bias), k - 1, axis=-1)[:, :k]
    return chosen, _routing_weights(scores, chosen, scaling)


@mx.compile
def route_hashed(logits, chosen, scaling):
    """The same weights for experts fixed by the token id (hash layers)."""
    return _routing_weights(mx.sqrt(mx.logaddexp(logits.astype(mx.float32), 0.0)), chosen, scaling)


def router_reference(x, weight, bias, k, scaling):
    """x [T, H] (any float dtype), the router's weight [E, H] and bias [E] float32 -> `route_top_k` of
    the float32 logits: (experts [T, k] in no particular order, weights [T, k] float32)."""
    return route_top_k(x.astype(mx.float32) @ weight.T, bias, k, scaling)


def hashed_router_reference(x, weight, tid2eid, ids, scaling):
    """A hash layer's experts, tid2eid [vocab, k] of the token ids [T], and `route_hashed` of the float32
    logits -> (experts [T, k], weights [T, k] float32)."""
    chosen = tid2eid[ids]
    return chosen, route_hashed(x.astype(mx.float32) @ weight.T, chosen, scaling)


# Logits: a block takes ROWS rows of the weight for up to BATCH tokens (grid y: groups of tokens), its
# threads over the rows' 16-byte words, each word applied to every token's matching values.
_ROUTER_LOGITS_CUDA = """
    constexpr int WORDS = H / 4, STEPS = (WORDS + GROUP - 1) / GROUP, STAGE = STEPS < 8 ? STEPS : 8;
    const int row = blockIdx.x * ROWS, first = blockIdx.y * BATCH, tid = threadIdx.x;
    const int tokens = TOKENS - first < BATCH ? TOKENS - first : BATCH;
    float acc[ROWS][BATCH] = {};
    for (int s0 = 0; s0 < STEPS; s0 += STAGE) {
        float w[STAGE][ROWS][4] = {};  // all of a stage's words in flight at once
        for (int s = 0; s < STAGE; ++s) {
            const int c = tid + (s0 + s) * GROUP;
            for (int r = 0; r < ROWS; ++r)
                if (c < WORDS) load_floats<4>(weight + (size_t)(row + r) * H + 4 * c, w[s][r]);
        }
        for (int t = 0; t < BATCH; ++t) {
            if (t >= tokens) break;
            for (int s = 0; s < STAGE; ++s) {
                const int c = tid + (s0 + s) * GROUP;
                if (c >= WORDS) break;
                float v[4];
                load_floats<4>(x + (size_t)(first + t) * H + 4 * c, v);
                for (int r = 0; r < ROWS; ++r)
                    acc[r][t] += w[s][r][0] * v[0] + w[s][r][1] * v[1] + w[s][r][2] * v[2] + w[s][r][3] * v[3];
            }
        }
    }
    const float sum = block_sums<ROWS, BATCH, GROUP>(acc, tid);
    if (tid < ROWS * BATCH && tid % BATCH < tokens) logits[(size_t)(first + tid % BATCH) * E + row + tid / BATCH] = sum;
"""

# The score of a logit, sqrt(softplus) with softplus as MLX's logaddexp(logit, 0)
_ROUTER_SCORE = """
__device__ inline float router_score(float logit) {
    const float high = fmaxf(logit, 0.0f), low = fminf(logit, 0.0f);
    return sqrtf(high + log1pf(expf(low - high)));
}
"""

# One warp a token; lane i holds experts i, i + 32, ... The k picks, each the warp's largest biased score
# not yet taken (of equal ones the lowest expert: MLX's stable sort on CUDA picks the same), in that order.
_ROUTER_TOP_K_CUDA = """
    constexpr int PER = (E + 31) / 32;
    const int t = blockIdx.x, lane = threadIdx.x;
    float score[PER], biased[PER];
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        score[i] = e < E ? router_score(logits[t * E + e]) : 0.0f;
        biased[i] = e < E ? score[i] + bias[e] : 0.0f;
    }
    unsigned taken = 0;
    float mine = 0.0f, total = 0.0f;  // lane j: the score of the j-th pick
    for (int j = 0; j < K; ++j) {
        float best = 0.0f, best_score = 0.0f;
        int best_e = E;  // none yet
        for (int i = 0; i < PER; ++i) {
            const int e = lane + 32 * i;
            if (e < E && !(taken >> i & 1) && (best_e == E || biased[i] > best)) {
                best = biased[i]; best_score = score[i]; best_e = e;
            }
        }
        for (int d = 16; d > 0; d /= 2) {
            const float other = __shfl_xor_sync(0xffffffff, best, d);
            const float other_score = __shfl_xor_sync(0xffffffff, best_score, d);
            const int other_e = __shfl_xor_sync(0xffffffff, best_e, d);
            if (other_e < E && (best_e == E || other > best || (other == best && other_e < best_e))) {
                best = other; best_score = other_score; best_e = other_e;
            }
        }
        if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
        if (lane == j) { chosen[t * K + j] = best_e; mine = best_score; }
        total += best_score;
    }
    if (lane < K) weights[t * K + lane] = mine / (total + 1e-20f) * SCALING;
"""

# A hash layer's experts come from its table by the token id: lane j < k takes the j-th.
_ROUTER_HASHED_CUDA = """
    const int t = blockIdx.x, lane = threadIdx.x;
    const auto e = lane < K ? tid2eid[(size_t)ids[t] * K + lane] : 0;
    if (lane < K) chosen[t * K + lane] = e;
    const float mine = lane < K ? router_score(logits[t * E + e]) : 0.0f;
    float total = 0.0f;
    for (int j = 0; j < K; ++j) total += __shfl_sync(0xffffffff, mine, j);
    if (lane < K) weights[t * K + lane] = mine / (total + 1e-20f) * SCALING;
"""
_ROUTER_GROUP, _ROUTER_ROWS, _ROUTER_BATCH = 128, 2, 8


@lru_cache(maxsize=None)
def _router_kernels(scaling):
    scaled = f"#define SCALING {float(scaling)!r}f\n"
    suffix = abs(hash(scaling))
    logits = mx.fast.cuda_kernel(name="ds4_router_logits", input_names=["x", "weight"], output_names=["logits"],
                                 header=_LOADS, source=_ROUTER_LOGITS_CUDA)
    top_k = mx.fast.cuda_kernel(name=f"ds4_router_top_k_{suffix}", input_names=["logits", "bias"],
                                output_names=["chosen", "weights"], header=_ROUTER_SCORE,
                                source=scaled + _ROUTER_TOP_K_CUDA)
    hashed = mx.fast.cuda_kernel(name=f"ds4_router_hashed_{suffix}", input_names=["logits", "tid2eid", "ids"],
                                 output_names=["chosen", "weights"], header=_ROUTER_SCORE,
                                 source=scaled + _ROUTER_HASHED_CUDA)
    return logits, top_k, hashed


def _router_logits_cuda(x, weight, scaling):
    (T, H), E = x.shape, weight.shape[0]
    batch = min(T, _ROUTER_BATCH)
    inputs = [x, weight]
    return _router_kernels(scaling)[0](
        inputs=inputs, template=[("TOKENS", T), ("H", H), ("E", E), ("ROWS", _ROUTER_ROWS), ("BATCH", batch),
                                 ("GROUP", _ROUTER_GROUP), *_dtype_keys(inputs)],
        grid=(E // _ROUTER_ROWS * _ROUTER_GROUP, -(-T // batch), 1), threadgroup=(_ROUTER_GROUP, 1, 1),
        output_shapes=[(T, E)], output_dtypes=[mx.float32])[0]


def _router_cuda(x, weight, bias, k, scaling):
    T, E = x.shape[0], weight.shape[0]
    inputs = [_router_logits_cuda(x, weight, scaling), bias.astype(mx.float32)]
    return tuple(_router_kernels(scaling)[1](
        inputs=inputs, template=[("E", E), ("K", k)], grid=(32 * T, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(T, k), (T, k)], output_dtypes=[mx.uint32, mx.float32]))


def _hashed_router_cuda(x, weight, tid2eid, ids, scaling):
    T, (E, k) = x.shape[0], (weight.shape[0], tid2eid.shape[1])
    inputs = [_router_logits_cuda(x, weight, scaling), tid2eid, ids]
    return tuple(_router_kernels(scaling)[2](
        inputs=inputs, template=[("E", E), ("K", k), *_dtype_keys(inputs)], grid=(32 * T, 1, 1),
        threadgroup=(32, 1, 1), output_shapes=[(T, k), (T, k)], output_dtypes=[tid2eid.dtype, mx.float32]))


def _router_fits(x, weight, k):
    """Whether the kernels take these shapes: a few tokens, rows of whole 16-byte words, at most 1024
    experts (a bit each of a lane's word) and k at most a warp."""
    (T, H), (E, width) = x.shape, weight.shape
    return (T <= FEW_ROWS_MAX and H == width and H % 4 == 0 and E % _ROUTER_ROWS == 0 and E <= 1024
            and k <= min(32, E) and weight.dtype == mx.float32)


def _routing_matrix(inputs, result):
    """The chosen experts' weights in their columns of [T, E]: what the router gives, in any order."""
    chosen, weights = result
    dense = mx.zeros((chosen.shape[0], inputs[1].shape[0]), mx.float32)
    return (mx.put_along_axis(dense, chosen.astype(mx.int32), weights.astype(mx.float32), axis=-1),)


def _router_sample():
    """Forms with no near ties between the k-th and the next biased score."""
    return [(_random(1, 256).astype(mx.bfloat16), _random(64, 256) / 16, 0.1 * _random(64), 6, 2.5),
            (_random(10, 256), _random(64, 256) / 16, 0.1 * _random(64, seed=1), 6, 2.5)]


def _hashed_router_sample():
    tid2eid = mx.array([[5, 0, 63], [7, 8, 9], [1, 2, 3], [60, 61, 62], [4, 40, 44]])
    return (_random(3, 256).astype(mx.bfloat16), _random(64, 256) / 16, tid2eid, mx.array([4, 0, 2]), 1.5)


ROUTER = Kernel("router", router_reference, _router_sample, 1e-4, compared=_routing_matrix)
ROUTER.launches["cuda"] = _router_cuda
HASHED_ROUTER = Kernel("hashed_router", hashed_router_reference, _hashed_router_sample, 1e-4, compared=_routing_matrix)
HASHED_ROUTER.launches["cuda"] = _hashed_router_cuda


def router(x, weight, bias, k, scaling):
    """`router_reference`, two kernels on CUDA for up to FEW_ROWS_MAX tokens: the experts by falling biased
    score (of equal scores the lowest expert), and their weights."""
    kind = ROUTER.backend() if _router_fits(x, weight, k) else None
    if kind is None:
        return router_reference(x, weight, bias, k, scaling)
    return ROUTER.launches[kind](x, weight, bias, k, scaling)


def hashed_router(x, weight, tid2eid, ids, scaling):
    """`hashed_router_reference`, two kernels on CUDA for up to FEW_ROWS_MAX tokens (the experts' lookup
    in the second)."""
    kind = HASHED_ROUTER.backend() if _router_fits(x, weight, tid2eid.shape[1]) and ids.shape == x.shape[:1] \
        else None
    if kind is None:
        return hashed_router_reference(x, weight, tid2eid, ids, scaling)
    return HASHED_ROUTER.launches[kind](x, weight, tid2eid, ids, scaling)


# ---------------------------------------------------------------------------------------------
# Routed experts of a few tokens. MLX's gather_qmv reads a 2-bit expert matrix at ~0.45 TB/s on the
# H200 (34 us for 6 experts' gate, up or down), and the SwiGLU, routing weights and sum are more
# launches; here two kernels: gate and up with the clamped SwiGLU, then down summed with the weights.


@mx.compile
def clamped_swiglu(gate, up, limit):
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return gate * mx.sigmoid(gate) * up


# `clamped_swiglu` in the kernels that end with it (the gate and up products of the experts' kernels)
_CLAMPED_SWIGLU = """
__device__ inline float clamped_swiglu(float gate, float up, float limit) {
    gate = fminf(gate, limit);
    return gate / (1.0f + expf(-gate)) * fminf(fmaxf(up, -limit), limit);
}
"""


def routed_experts_reference(x, chosen, weights, gate, up, down, limit):
    """x [T, H]; chosen, weights [T, k]; gate, up, down: (packed weights, scales, biases, group size,
    bits) of affine-quantized expert stacks [E, out, in]. -> [T, H] float32, the weighted sum over j of
    down(clamped_swiglu(gate(x), up(x))) through expert chosen[:, j]."""

    def product(v, matrix):
        w, scales, biases, group_size, bits = matrix
        return mx.gather_qmm(v, w, scales, biases, rhs_indices=chosen, transpose=True,
                             group_size=group_size, bits=bits)

    xs = x.astype(mx.float32)[:, None, None, :]
    h = clamped_swiglu(product(xs, gate), product(xs, up), limit)
    return (product(h, down)[:, :, 0, :] * weights[..., None]).sum(axis=1)


# Each warp takes ROWS output rows of one token (and, for gate and up, one chosen expert). A lane reads
# 16 bytes of every row at a time (64 values at 2 bits) with the matching float4s of the input, and
# applies each word's scale and bias to the word's whole dot product.
_EXPERTS_HEADER = _CLAMPED_SWIGLU + """
template <int BITS, int GS, int IN, int N, typename W, typename S>
__device__ void quantized_dots(const float* x, const W* w, const S* scales, const S* biases, int lane,
                               float* acc) {
  constexpr int PER = 32 / BITS, CHUNK = 4 * PER, MASK = (1 << BITS) - 1;
  for (int c = lane; c < IN / CHUNK; c += 32) {
    uint4 words[N];
#pragma unroll
    for (int n = 0; n < N; ++n) words[n] = reinterpret_cast<const uint4*>(w[n])[c];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int first = c * CHUNK + q * PER;
      float xv[PER], xsum = 0.0f;
#pragma unroll
      for (int v = 0; v < PER; v += 4) {
        const float4 f = *reinterpret_cast<const float4*>(x + first + v);
        xv[v] = f.x; xv[v + 1] = f.y; xv[v + 2] = f.z; xv[v + 3] = f.w;
      }
#pragma unroll
      for (int i = 0; i < PER; ++i) xsum += xv[i];
#pragma unroll
      for (int n = 0; n < N; ++n) {
        const uint32_t word = reinterpret_cast<const uint32_t*>(&words[n])[q];
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) dot += xv[i] * (float)((word >> (BITS * i)) & MASK);
        acc[n] += (float)scales[n][first / GS] * dot + (float)biases[n][first / GS] * xsum;
      }
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n)
    for (int o = 16; o > 0; o /= 2) acc[n] += __shfl_xor_sync(0xffffffff, acc[n], o);
}
"""

_GATE_UP_CUDA = """
    constexpr int JOBS = OUT / ROWS, WORDS = IN * BITS / 32;
    const int lane = threadIdx.x % 32, job = blockIdx.x * (GROUP / 32) + threadIdx.x / 32;
    if (job >= TOKENS * K * JOBS) return;
    const int tk = job / JOBS, row = (job % JOBS) * ROWS;
    decltype(gate_w) w[2 * ROWS];
    decltype(gate_s) s[2 * ROWS], b[2 * ROWS];
    for (int r = 0; r < ROWS; ++r) {
        const size_t at = (size_t)chosen[tk] * OUT + row + r;
        w[r] = gate_w + at * WORDS; s[r] = gate_s + at * (IN / GS); b[r] = gate_b + at * (IN / GS);
        w[ROWS + r] = up_w + at * WORDS; s[ROWS + r] = up_s + at * (IN / GS); b[ROWS + r] = up_b + at * (IN / GS);
    }
    float acc[2 * ROWS] = {};
    quantized_dots<BITS, GS, IN, 2 * ROWS>(x + (tk / K) * IN, w, s, b, lane, acc);
    if (lane == 0) {
        for (int r = 0; r < ROWS; ++r) {
            h[tk * OUT + row + r] = clamped_swiglu(acc[r], acc[ROWS + r], LIMIT);
        }
    }
"""

_DOWN_CUDA = """
    constexpr int JOBS = OUT / ROWS, WORDS = IN * BITS / 32;
    const int lane = threadIdx.x % 32, job = blockIdx.x * (GROUP / 32) + threadIdx.x / 32;
    if (job >= TOKENS * JOBS) return;
    const int t = job / JOBS, row = (job % JOBS) * ROWS;
    float acc[ROWS] = {};
    for (int j = 0; j < K; ++j) {
        decltype(down_w) w[ROWS];
        decltype(down_s) s[ROWS], b[ROWS];
        for (int r = 0; r < ROWS; ++r) {
            const size_t at = (size_t)chosen[t * K + j] * OUT + row + r;
            w[r] = down_w + at * WORDS; s[r] = down_s + at * (IN / GS); b[r] = down_b + at * (IN / GS);
        }
        float part[ROWS] = {};
        quantized_dots<BITS, GS, IN, ROWS>(h + (t * K + j) * IN, w, s, b, lane, part);
        for (int r = 0; r < ROWS; ++r) acc[r] += weights[t * K + j] * part[r];
    }
    if (lane == 0)
        for (int r = 0; r < ROWS; ++r) y[t * OUT + row + r] = acc[r];
"""
_EXPERT_GROUP, _EXPERT_ROWS = 256, 2


@lru_cache(maxsize=None)
def _expert_kernels(limit):
    gate_up = mx.fast.cuda_kernel(
        name=f"ds4_experts_gate_up_{abs(hash(limit))}",
        input_names=["x", "chosen", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b"],
        output_names=["h"], header=_EXPERTS_HEADER, source=f"#define LIMIT {float(limit)!r}f\n" + _GATE_UP_CUDA)
    down = mx.fast.cuda_kernel(
        name="ds4_experts_down", input_names=["h", "chosen", "weights", "down_w", "down_s", "down_b"],
        output_names=["y"], header=_EXPERTS_HEADER, source=_DOWN_CUDA)
    return gate_up, down


def _fits(matrix, rows):
    """Whether the kernels read this quantized stack: 2, 4 or 8 bits with biases, rows of whole
    16-byte chunks, groups of whole words."""
    w, scales, biases, group_size, bits = matrix
    out, inp = scales.shape[1], scales.shape[2] * group_size
    return (biases is not None and bits in (2, 4, 8) and inp % (128 // bits) == 0
            and group_size % (32 // bits) == 0 and out % rows == 0)


def routed_experts(x, chosen, weights, gate, up, down, limit):
    """`routed_experts_reference` in two kernels on CUDA; None where they do not apply (the caller then
    runs its own path)."""
    kind = ROUTED_EXPERTS.backend()
    if kind is None or not all(_fits(m, _EXPERT_ROWS) for m in (gate, up, down)) or gate[3:] != up[3:] \
            or gate[1].dtype != up[1].dtype:
        return None
    return ROUTED_EXPERTS.launches[kind](x, chosen, weights, gate, up, down, limit)


def _routed_experts_sample():
    E, H, I, T, k = 4, 256, 128, 2, 2

    def stack(out, inp, seed):
        w, scales, biases = mx.quantize(0.05 * _random(E, out, inp, seed=seed), group_size=64, bits=2)
        return w, scales, biases, 64, 2

    chosen = mx.array([[0, 3], [2, 0]], mx.uint32)
    return (_random(T, H), chosen, mx.softmax(_random(T, k), axis=-1), stack(I, H, 1), stack(I, H, 2),
            stack(H, I, 3), 10.0)


def _routed_experts_cuda(x, chosen, weights, gate, up, down, limit):
    rows = _EXPERT_ROWS
    (T, k), f32 = chosen.shape, mx.float32
    inner, hidden = gate[1].shape[1], down[1].shape[1]
    gate_up_kernel, down_kernel = _expert_kernels(limit)

    def launch(kernel, inputs, matrix, jobs, out):
        _, _, _, group_size, bits = matrix
        return kernel(inputs=inputs, output_shapes=[out], output_dtypes=[f32],
                      template=[("BITS", bits), ("GS", group_size), ("IN", matrix[1].shape[2] * group_size),
                                ("OUT", matrix[1].shape[1]), ("K", k), ("TOKENS", T), ("ROWS", rows),
                                ("GROUP", _EXPERT_GROUP), *_dtype_keys(inputs)],
                      grid=(-(-jobs * 32 // _EXPERT_GROUP) * _EXPERT_GROUP, 1, 1),
                      threadgroup=(_EXPERT_GROUP, 1, 1))[0]

    h = launch(gate_up_kernel, [x.astype(f32), chosen, *gate[:3], *up[:3]], gate, T * k * inner // rows,
               (T, k, inner))
    return launch(down_kernel, [h, chosen, weights.astype(f32), *down[:3]], down, T * hidden // rows,
                  (T, hidden))


ROUTED_EXPERTS = Kernel("routed_experts", routed_experts_reference, _routed_experts_sample, 1e-4)
ROUTED_EXPERTS.launches["cuda"] = _routed_experts_cuda


# Reads of x in any float dtype as 8- or 16-byte words, and stores in the output's dtype (an input's or
# output's pointer type follows its array's dtype): a kernel takes the compute dtype's rows as they are,
# where a cast to float32 before it and back after would each be a kernel.
_LOADS = _CLAMPED_SWIGLU + """
template <int BYTES> struct Word;
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };

template <int COUNT, typename T>
__device__ inline void aligned_floats(const T* p, float* v) {  // p on a word of COUNT values (at most 16 bytes)
    constexpr int BYTES = COUNT * sizeof(T) < 16 ? COUNT * sizeof(T) : 16, PER = BYTES / sizeof(T);
    for (int i = 0; i < COUNT / PER; ++i) {
        const typename Word<BYTES>::type raw = reinterpret_cast<const typename Word<BYTES>::type*>(p)[i];
        const T* e = reinterpret_cast<const T*>(&raw);
        for (int j = 0; j < PER; ++j) v[i * PER + j] = static_cast<float>(e[j]);
    }
}

template <int COUNT, typename T>
__device__ inline void load_floats(const T* p, float* v) {
    constexpr int BYTES = COUNT * sizeof(T) < 16 ? COUNT * sizeof(T) : 16;
    if (reinterpret_cast<unsigned long long>(p) % BYTES) {  // a row-contiguous view may start off a word
        for (int j = 0; j < COUNT; ++j) v[j] = static_cast<float>(p[j]);
        return;
    }
    aligned_floats<COUNT>(p, v);
}

template <typename T>
T pointee(const T*);  // the type p points to, as decltype(pointee(p))

// COUNT values from p as they are, on a word where p is on one: held as loaded, converted where used
template <int COUNT, typename T>
__device__ inline void load_values(const T* p, T* v) {
    constexpr int BYTES = COUNT * sizeof(T) < 16 ? COUNT * sizeof(T) : 16, PER = BYTES / sizeof(T);
    using W = typename Word<BYTES>::type;
    if (reinterpret_cast<unsigned long long>(p) % BYTES) {
        for (int j = 0; j < COUNT; ++j) v[j] = p[j];
        return;
    }
    for (int i = 0; i < COUNT / PER; ++i) reinterpret_cast<W*>(v)[i] = reinterpret_cast<const W*>(p)[i];
}

template <typename T>
__device__ inline void store(T* p, float v) { *p = static_cast<T>(v); }

template <typename T>
__device__ inline float rounded_as(const T*, float v) { return static_cast<float>(static_cast<T>(v)); }  // v as T holds it

// A word copied from global to shared memory without waiting for it (cp.async, 16-byte words on sm_80 and
// later): a thread's copies are all in flight at once, and `copies_done` waits for them. Otherwise each
// copy is a load the following store waits on, a round trip at a time.
template <typename W>
__device__ inline void copy_word(W* shared, const W* global) {
#if __CUDA_ARCH__ >= 800
    if (sizeof(W) == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                     :: "r"((unsigned)__cvta_generic_to_shared(shared)), "l"(global));
        return;
    }
#endif
    *shared = *global;
}

__device__ inline void copies_done() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// A pair's row of x and, where `tables`, IQ2_XXS's lattice and sign bytes, copied into a block's shared
// memory by its `threads` threads (both bodies of the GGUF rows kernel); the caller waits (`copies_done`)
template <typename T>
__device__ inline void stage_row_and_tables(uint8_t* x_bytes, int bytes, const T* xv, uint2* grid_bytes,
                                            uint8_t* sign_bytes, const uint8_t* lattice, const uint8_t* ksigns,
                                            bool tables, int threads) {
    if (reinterpret_cast<unsigned long long>(xv) % 16 == 0) {
        for (int i = threadIdx.x; i < bytes / 16; i += threads)
            copy_word(reinterpret_cast<uint4*>(x_bytes) + i, reinterpret_cast<const uint4*>(xv) + i);
    } else {  // a row-contiguous view may start off a word
        for (int i = threadIdx.x; i < bytes; i += threads) x_bytes[i] = reinterpret_cast<const uint8_t*>(xv)[i];
    }
    for (int i = threadIdx.x; tables && i < 256 * 8 / 16; i += threads)
        copy_word(reinterpret_cast<uint4*>(grid_bytes) + i, reinterpret_cast<const uint4*>(lattice) + i);
    for (int i = threadIdx.x; tables && i < 128 / 16; i += threads)
        copy_word(reinterpret_cast<uint4*>(sign_bytes) + i, reinterpret_cast<const uint4*>(ksigns) + i);
}

// The sums over a block of GROUP threads of each one's acc[ROWS][BATCH]: thread i < ROWS * BATCH gets that of
// row i / BATCH and token i % BATCH (the others 0), warp by warp in order
template <int ROWS, int BATCH, int GROUP>
__device__ inline float block_sums(float (&acc)[ROWS][BATCH], int tid) {
    __shared__ float part[GROUP / 32][ROWS * BATCH];
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < BATCH; ++t) {
            for (int d = 16; d > 0; d /= 2) acc[r][t] += __shfl_xor_sync(0xffffffff, acc[r][t], d);
            if (tid % 32 == 0) part[tid / 32][r * BATCH + t] = acc[r][t];
        }
    __syncthreads();
    float sum = 0.0f;
    for (int w = 0; w < GROUP / 32 && tid < ROWS * BATCH; ++w) sum += part[w][tid];
    return sum;
}

// Byte j of `bytes` as a float, exactly and without an integer conversion: the byte set as the low bits of
// 2^23's mantissa, then 2^23 taken away.
template <int J>
__device__ inline float small_int(uint32_t bytes) {
    uint32_t bits;  // the selector an immediate, 2^23's top byte a register kept across calls
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(bits) : "r"(bytes), "r"(0x4B000000u), "n"(0x7440 | J));
    return __int_as_float(bits) - 8388608.0f;
}

// Tensor-core helpers for bfloat16 and float16 x, overloaded on x's pointer type: two codes (bytes J * 2 and
// J * 2 + 1 of a word) as x's type (every integer to 255 is exact in both), a pair of ones, and the
// m16n8k16 product c += a b with float32 sums (sm_80 and later).
template <int J>
__device__ inline uint32_t code_pair(const __nv_bfloat16*, uint32_t bytes) {
    // the codes as float32 integers hold no bits below bfloat16's: their top halves are the pair
    const uint32_t low = __float_as_uint(small_int<2 * J>(bytes)), high = __float_as_uint(small_int<2 * J + 1>(bytes));
    uint32_t pair;
    asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(pair) : "r"(low), "r"(high));
    return pair;
}

template <int J>
__device__ inline uint32_t code_pair(const __half*, uint32_t bytes) {
    uint32_t pair;  // each code as the low bits of 1024's mantissa, then 1024 taken away
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(pair) : "r"(bytes), "r"(0x64646464u), "n"(0x4040 | (2 * J + 1) << 8 | 2 * J));
    asm("sub.f16x2 %0, %0, %1;" : "+r"(pair) : "r"(0x64006400u));
    return pair;
}

__device__ inline uint32_t one_pair(const __nv_bfloat16*) { return 0x3F803F80u; }
__device__ inline uint32_t one_pair(const __half*) { return 0x3C003C00u; }

__device__ inline void mma_16816(const __nv_bfloat16*, float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ inline void mma_16816(const __half*, float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Codes under 128 as x's type through their bits (the GGUF rows kernel's tensor-core body): each code byte
// under a high byte of 2^7 (bfloat16) or 2^10 (float16), that high byte's sign bit set where the code is
// negative, less that power of two signed alike: exact.
__device__ inline uint32_t power_bytes(const __nv_bfloat16*) { return 0x43434343u; }
__device__ inline uint32_t power_bytes(const __half*) { return 0x64646464u; }

// The high bytes of four codes whose signs are the 4 bits of `nibble` (bit k: code k negative)
template <typename T>
__device__ inline uint32_t sign_high_bytes(const T* x, uint32_t nibble) {
    return ((nibble * 0x10204080u) & 0x80808080u) | power_bytes(x);  // bit k to bit 8 k + 7
}

__device__ inline uint32_t pair_less(const __nv_bfloat16*, uint32_t v, uint32_t c) {  // v - c, two at a time
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(c), "r"(0xBF80BF80u), "r"(v));
    return d;
}

__device__ inline uint32_t pair_less(const __half*, uint32_t v, uint32_t c) {
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(c), "r"(0xBC00BC00u), "r"(v));
    return d;
}

// Codes B and B + 1 (bytes of `codes`) under bytes B and B + 1 of `high`, as a pair of x's type
template <int B, typename T>
__device__ inline uint32_t signed_pair(const T* x, uint32_t codes, uint32_t high) {
    uint32_t v, power;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v)
        : "r"(codes), "r"(high), "n"(B | (4 + B) << 4 | (B + 1) << 8 | (5 + B) << 12));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(power) : "r"(high), "r"(0u), "n"(4 | B << 4 | 4 << 8 | (B + 1) << 12));
    return pair_less(x, v, power);
}

// Codes B and B + 1 (non-negative) as a pair of x's type
template <int B, typename T>
__device__ inline uint32_t small_code_pair(const T* x, uint32_t codes) {
    uint32_t v;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v)
        : "r"(codes), "r"(power_bytes(x)), "n"(B | 4 << 4 | (B + 1) << 8 | 5 << 12));
    return pair_less(x, v, power_bytes(x) & 0xFF00FF00u);
}

// Eight 16-bit values from p as one word (`aligned`: p on 16 bytes; a row-contiguous view may start off one)
template <typename T>
__device__ inline uint4 eight_values(const T* p, bool aligned) {
    if (aligned) return *reinterpret_cast<const uint4*>(p);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return make_uint4(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16, h[4] | (uint32_t)h[5] << 16,
                      h[6] | (uint32_t)h[7] << 16);
}
"""


# ---------------------------------------------------------------------------------------------
# Routed experts kept in GGUF blocks (IQ2_XXS, Q2_K), for a few tokens: one warp an output row of one
# (token, expert) pair, its lanes over the row's blocks, dequantizing as they read (the IQ2_XXS lattice
# and sign tables come from the `gguf` package, as inputs). The product of `linear.gguf_gather_product`.

# One unit of a block decoded, for the dequantizing kernel below (the rows kernel decodes its units inline,
# from a row staged in shared memory). Q2_K (scales[16] as sc | m << 4, qs[64] of 4
# values a byte, then d and dmin): code byte `byte` holds the values at[0..3] of its 256-value block.
# IQ2_XXS (d, then 8 sub-blocks of 4 lattice indices and a word of 4 x 7 sign bits and a scale): unit
# `unit` of 32 is the 8 values from unit * 8 on.
_GGUF_UNITS = """
__device__ inline void q2k_unit(const uint8_t* blk, int byte, float v[4], int at[4]) {
    const int half = byte / 32, l = byte % 32;
    const float d = __half2float(*reinterpret_cast<const __half*>(blk + 80));
    const float dmin = __half2float(*reinterpret_cast<const __half*>(blk + 82));
    const uint8_t q = blk[16 + byte];
    for (int i = 0; i < 4; ++i) {
        at[i] = half * 128 + i * 32 + l;
        const uint8_t sc = blk[at[i] / 16];
        v[i] = d * (float)(sc & 0xF) * (float)((q >> (2 * i)) & 3) - dmin * (float)(sc >> 4);
    }
}

template <typename S>
__device__ inline void iq2xxs_unit(const uint8_t* blk, int unit, const float* lattice, const S* ksigns, float v[8]) {
    const int sub = unit / 4, g = unit % 4;
    const uint8_t* sb = blk + 2 + sub * 8;
    const uint32_t aux = sb[4] | (sb[5] << 8) | (sb[6] << 16) | ((uint32_t)sb[7] << 24);
    const float db = __half2float(*reinterpret_cast<const __half*>(blk)) * (0.5f + (float)(aux >> 28)) * 0.25f;
    const float* point = lattice + sb[g] * 8;
    const int signs = ksigns[(aux >> (7 * g)) & 127];
    for (int k = 0; k < 8; ++k) v[k] = db * point[k] * ((signs >> k) & 1 ? -1.0f : 1.0f);
}
"""

# The product of a few rows. A block of WARPS warps takes 2 x WARPS consecutive output rows of one pair,
# two a warp. Every global read comes first, all at once: the pair's row of x, each warp's weight rows
# (wide words) and the IQ2_XXS tables, into shared memory; the block waits once, then each warp decodes
# its rows from there, each value of x it reads meeting both rows. (Reads where they were used left each
# warp a chain of round trips, and a float lattice in shared memory conflicted on its banks.) Codes
# become floats through their bits, with no integer conversion. A Q2_K lane takes 4 code bytes (16
# values, each group of 4 contiguous in x); an IQ2_XXS lane takes 8 values of one sub-block.
_GGUF_ROWS_CUDA = """
    typedef typename Word<WORD>::type word;
    constexpr int ROW_WORDS = IN / 256 * BLOCK / WORD, BLOCK_ROWS = WARPS * 2, WARP_OUTS = GLU ? 1 : 2;
    constexpr int BLOCKS_A_PAIR = (OUT + WARPS * WARP_OUTS - 1) / (WARPS * WARP_OUTS);
    __shared__ __align__(16) uint8_t x_bytes[IN * sizeof(x[0])];
    __shared__ __align__(16) uint2 grid_bytes[CODEC == 1 ? 256 : 2];
    __shared__ __align__(16) uint8_t sign_bytes[128];
    __shared__ __align__(16) word staged[BLOCK_ROWS][ROW_WORDS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int pair = blockIdx.x / BLOCKS_A_PAIR;
    const int first = (blockIdx.x % BLOCKS_A_PAIR) * WARPS * WARP_OUTS + warp * WARP_OUTS;
    // this warp's rows: two, or at the end one (decoded twice, stored once) or none; GLU: row `first` of the
    // gate matrix and of the up one, or none
    const int outs = OUT - first < WARP_OUTS ? OUT - first : WARP_OUTS;
    const int rows = GLU ? (outs > 0 ? 2 : 0) : outs;
    for (int r = 0; r < rows; ++r) {
        const uint8_t* matrix = GLU && r == 1 ? up_w : w;
        const size_t row = (size_t)indices[pair] * OUT + first + (GLU ? 0 : r);
        const word* source = reinterpret_cast<const word*>(matrix + row * (ROW_WORDS * WORD));
        for (int i = lane; i < ROW_WORDS; i += 32) copy_word(&staged[warp * 2 + r][i], source + i);
    }
    const auto* xv = x + (size_t)(pair / (PAIRS / XROWS)) * IN;  // consecutive pairs share a row of x
    stage_row_and_tables(x_bytes, sizeof(x_bytes), xv, grid_bytes, sign_bytes, lattice, ksigns, CODEC == 1,
                         WARPS * 32);
    copies_done();
    __syncthreads();
    if (rows <= 0) return;
    const auto* xs = reinterpret_cast<decltype(&x[0])>(x_bytes);
    const uint8_t* row_bytes[2] = {reinterpret_cast<const uint8_t*>(staged[warp * 2]),
                                   reinterpret_cast<const uint8_t*>(staged[warp * 2 + rows - 1])};
    float acc[2] = {0.0f, 0.0f};
    if (CODEC == 0) {
        const int byte = (lane % 16) * 4, half = byte / 32, l = byte % 32;
        for (int b = lane / 16; b < IN / 256; b += 2) {
            uint32_t q[2];
            float d[2], dmin[2];
            for (int r = 0; r < 2; ++r) {
                const uint8_t* blk = row_bytes[r] + b * BLOCK;
                q[r] = *reinterpret_cast<const uint32_t*>(blk + 16 + byte);
                d[r] = __half2float(*reinterpret_cast<const __half*>(blk + 80));
                dmin[r] = __half2float(*reinterpret_cast<const __half*>(blk + 82));
            }
            for (int i = 0; i < 4; ++i) {
                float e[4];  // 4 values of x this lane takes in block b: both rows' codes meet them
                aligned_floats<4>(xs + b * 256 + half * 128 + i * 32 + l, e);
                const float sum = (e[0] + e[1]) + (e[2] + e[3]);
                for (int r = 0; r < 2; ++r) {
                    const uint32_t sc = row_bytes[r][b * BLOCK + half * 8 + i * 2 + l / 16];
                    const uint32_t codes = (q[r] >> (2 * i)) & 0x03030303u;
                    const float dot = small_int<0>(codes) * e[0] + small_int<1>(codes) * e[1]
                                    + small_int<2>(codes) * e[2] + small_int<3>(codes) * e[3];
                    acc[r] += d[r] * small_int<0>(sc & 0xF) * dot - dmin[r] * small_int<0>(sc >> 4) * sum;
                }
            }
        }
    } else {
        const int sub = lane / 4, g = lane % 4;
        for (int b = 0; b < IN / 256; ++b) {
            float e[8];  // the 8 values of x this lane takes in block b
            aligned_floats<8>(xs + b * 256 + lane * 8, e);
            for (int r = 0; r < 2; ++r) {
                const uint8_t* blk = row_bytes[r] + b * BLOCK;
                const uint16_t* sb = reinterpret_cast<const uint16_t*>(blk + 2 + sub * 8);
                const uint32_t aux = sb[2] | ((uint32_t)sb[3] << 16);
                const float db = __half2float(*reinterpret_cast<const __half*>(blk)) * (0.5f + small_int<0>(aux >> 28)) * 0.25f;
                const uint2 point = grid_bytes[blk[2 + sub * 8 + g]];
                const uint32_t signs = sign_bytes[(aux >> (7 * g)) & 127];
                float sum = 0.0f;
                const float value[8] = {small_int<0>(point.x), small_int<1>(point.x), small_int<2>(point.x),
                                        small_int<3>(point.x), small_int<0>(point.y), small_int<1>(point.y),
                                        small_int<2>(point.y), small_int<3>(point.y)};
                for (int k = 0; k < 8; ++k)
                    sum += __int_as_float(__float_as_int(value[k]) ^ ((signs << (31 - k)) & 0x80000000u)) * e[k];
                acc[r] += db * sum;
            }
        }
    }
    for (int r = 0; r < 2; ++r)
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
    if (lane == 0 && GLU) {
        store(y + (size_t)pair * OUT + first, clamped_swiglu(acc[0], acc[1], LIMIT));
    } else if (lane == 0) {
        for (int r = 0; r < rows; ++r) store(y + (size_t)pair * OUT + first + r, acc[r] * PAIR_WEIGHT);
    }
"""
# The rows kernel's tensor-core body, for bfloat16 and float16 x: a block of 4 warps takes 16 rows of one pair
# (GLU: a tile's 8 rows of the gate matrix and the same 8 of the up one) as the A operand of m16n8k16 products,
# the warps taking the row's blocks of 256 in turn, and x as B (every column the same row of x). A lane takes 8
# values of a row in each span of 32 (IQ2_XXS: one lattice point; Q2_K: 4 codes in each of two groups of 16),
# and the x beside them, so that both operands permute a span alike. Codes become x's type through their
# bits: a code byte under a byte of 2^7 (bfloat16) or 2^10 (float16), the sign bit set from IQ2_XXS's signs,
# then that power of two (signed alike) taken away, exactly. A span's or group's product is scaled in float32
# into the running sums, as the float body scales its sums.
_GGUF_ROWS_MMA_CUDA = """
    typedef typename Word<WORD>::type word;
    constexpr int WARPS = 4, OUTS = GLU ? 8 : 16, TILES = (OUT + OUTS - 1) / OUTS, ROW_BYTES = IN / 256 * BLOCK;
    __shared__ __align__(16) uint8_t x_bytes[IN * sizeof(x[0])];
    __shared__ __align__(16) uint8_t staged[16][STRIDE];
    __shared__ __align__(16) uint2 grid_bytes[CODEC == 1 ? 256 : 1];
    __shared__ __align__(16) uint8_t sign_bytes[CODEC == 1 ? 128 : 16];
    __shared__ float partial[WARPS][16];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int pair = blockIdx.x / TILES, tile = blockIdx.x % TILES;
    for (int r = warp; r < 16; r += WARPS) {  // A's rows; past the output's end, left unset and never stored
        const int out_row = tile * OUTS + r % OUTS;
        if (out_row >= OUT) continue;
        const uint8_t* matrix = GLU && r >= 8 ? up_w : w;
        const size_t row = (size_t)indices[pair] * OUT + out_row;
        const word* source = reinterpret_cast<const word*>(matrix + row * ROW_BYTES);
        for (int i = lane; i < ROW_BYTES / WORD; i += 32) copy_word(reinterpret_cast<word*>(staged[r]) + i, source + i);
    }
    const auto* xv = x + (size_t)(pair / (PAIRS / XROWS)) * IN;  // consecutive pairs share a row of x
    stage_row_and_tables(x_bytes, sizeof(x_bytes), xv, grid_bytes, sign_bytes, lattice, ksigns, CODEC == 1,
                         WARPS * 32);
    copies_done();
    __syncthreads();
    const auto* xs = reinterpret_cast<decltype(&x[0])>(x_bytes);
    const int row8 = lane / 4, quad = lane % 4;  // the fragments' groupID and threadID_in_group
    const uint8_t* rows[2] = {staged[row8], staged[row8 + 8]};
    float acc[2] = {0.0f, 0.0f};
    for (int b = warp; b < IN / 256; b += WARPS) {
        if (CODEC == 1) {
            float d[2];
            for (int r = 0; r < 2; ++r) d[r] = __half2float(*reinterpret_cast<const __half*>(rows[r] + b * BLOCK));
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                const uint4 xq = *reinterpret_cast<const uint4*>(xs + b * 256 + s * 32 + quad * 8);
                uint32_t a[2][4];  // [k-tile][A register]
                float db[2];
                for (int r = 0; r < 2; ++r) {
                    const uint8_t* sb = rows[r] + b * BLOCK + 2 + s * 8;
                    const uint32_t aux = *reinterpret_cast<const uint16_t*>(sb + 4)
                                       | (uint32_t)*reinterpret_cast<const uint16_t*>(sb + 6) << 16;
                    db[r] = d[r] * (0.5f + small_int<0>(aux >> 28)) * 0.25f;
                    const uint2 point = grid_bytes[sb[quad]];
                    const uint32_t signs = sign_bytes[(aux >> (7 * quad)) & 127];
                    const uint32_t high_lo = sign_high_bytes(x, signs & 0xF), high_hi = sign_high_bytes(x, signs >> 4);
                    a[0][r] = signed_pair<0>(x, point.x, high_lo);
                    a[0][r + 2] = signed_pair<2>(x, point.x, high_lo);
                    a[1][r] = signed_pair<0>(x, point.y, high_hi);
                    a[1][r + 2] = signed_pair<2>(x, point.y, high_hi);
                }
                float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_16816(x, dot, a[0], xq.x, xq.y);
                mma_16816(x, dot, a[1], xq.z, xq.w);
                acc[0] += db[0] * dot[0];
                acc[1] += db[1] * dot[2];
            }
        } else {
            uint32_t codes[2][4], scales[2][4];
            float d[2], dmin[2];
            for (int r = 0; r < 2; ++r) {
                const uint8_t* blk = rows[r] + b * BLOCK;
                for (int j = 0; j < 4; ++j) {  // j: the half of 128 (j / 2) and of 32 (j % 2) the codes are in
                    codes[r][j] = *reinterpret_cast<const uint32_t*>(blk + 16 + (j / 2) * 32 + (j % 2) * 16 + quad * 4);
                    scales[r][j] = *reinterpret_cast<const uint32_t*>(blk + j * 4);
                }
                d[r] = __half2float(*reinterpret_cast<const __half*>(blk + 80));
                dmin[r] = __half2float(*reinterpret_cast<const __half*>(blk + 82));
            }
            // the block's sums of scale * code * x and of minimum * x: both factors small integers, exact in A
            float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f}, low[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int g = 0; g < 16; ++g) {  // group g: x[16 g, 16 g + 16), codes g / 8 * 2 + g % 2 shifted by g % 8 / 2
                const uint2 xq = *reinterpret_cast<const uint2*>(xs + b * 256 + g * 16 + quad * 4);
                uint32_t a[4], m[4];
                for (int r = 0; r < 2; ++r) {
                    const uint32_t sc = scales[r][g / 4] >> (8 * (g % 4));
                    const uint32_t c = (codes[r][g / 8 * 2 + g % 2] >> (2 * (g % 8 / 2))) & 0x03030303u;
                    const uint32_t scaled = c * (sc & 0xF);  // each byte at most 3 * 15: no carries
                    a[r] = small_code_pair<0>(x, scaled);
                    a[r + 2] = small_code_pair<2>(x, scaled);
                    m[r] = m[r + 2] = small_code_pair<0>(x, ((sc >> 4) & 0xF) * 0x101u);
                }
                mma_16816(x, dot, a, xq.x, xq.y);
                mma_16816(x, low, m, xq.x, xq.y);
            }
            for (int r = 0; r < 2; ++r) acc[r] += d[r] * dot[2 * r] - dmin[r] * low[2 * r];
        }
    }
    if (quad == 0) {  // every column of B is the same row of x: column 0's sums
        partial[warp][row8] = acc[0];
        partial[warp][row8 + 8] = acc[1];
    }
    __syncthreads();
    const int out_row = tile * OUTS + threadIdx.x;
    if (threadIdx.x >= OUTS || out_row >= OUT) return;
    float v = 0.0f, u = 0.0f;
    for (int k = 0; k < WARPS; ++k) v += partial[k][threadIdx.x];
    if (GLU) {
        for (int k = 0; k < WARPS; ++k) u += partial[k][threadIdx.x + 8];
        store(y + (size_t)pair * OUT + out_row, clamped_swiglu(v, u, LIMIT));
    } else {
        store(y + (size_t)pair * OUT + out_row, v * PAIR_WEIGHT);
    }
"""
_GGUF_CODECS = {"q2_k": 0, "iq2_xxs": 1}


@lru_cache(maxsize=None)
def _gguf_rows_kernel(limit=None, weighted=False, tensor_cores=False):
    """The rows kernel; with `limit`, its GLU form (gate and up matrices, the clamped SwiGLU of the two);
    `weighted`: each pair's row times its weight (`pair_weights`) before the rounding; `tensor_cores`: the
    body for bfloat16 and float16 x."""
    glu = limit is not None
    defines = f"#define GLU {int(glu)}\n#define LIMIT {float(limit or 0)!r}f\n" + ("" if glu else "#define up_w w\n")
    defines += f"#define PAIR_WEIGHT {'pair_weights[pair]' if weighted else '1.0f'}\n"
    name = "ds4_gguf_expert_rows" + (f"_glu_{abs(hash(limit))}" if glu else "") + ("_weighted" if weighted else "")
    inputs = ["x", "w", "indices", "lattice", "ksigns"] + ["up_w"] * glu + ["pair_weights"] * weighted
    body = _GGUF_ROWS_MMA_CUDA if tensor_cores else _GGUF_ROWS_CUDA
    return mx.fast.cuda_kernel(name=name + "_mma" * tensor_cores, input_names=inputs, output_names=["y"],
                               source=defines + body, header=_LOADS)


def _word(row_bytes):
    """The widest word (of 16, 8, 4 and 2 bytes) that a row of `row_bytes` bytes is made of: rows of one
    array then start on such words."""
    return next(size for size in (16, 8, 4, 2) if row_bytes % size == 0)


_SHARED_BYTES = 48 * 1024  # a block's static shared memory


@lru_cache(maxsize=None)
def _gguf_rows_warps(codec, inp, itemsize, row_bytes):
    """Warps a block of the rows kernel (16, 8 or 4: the most whose staged x, tables and rows fit shared
    memory), or None where even 4 do not fit."""
    tables = 256 * 8 + 128 if codec == "iq2_xxs" else 0
    return next((warps for warps in (16, 8, 4) if inp * itemsize + tables + 2 * warps * row_bytes <= _SHARED_BYTES),
                None)


def _gguf_rows_cuda(x, w, indices, codec, up=None, limit=None, weights=None, tensor_cores=None):
    """x [..., in] (X rows, X dividing P), w uint8 [E, out, row bytes], indices [...] (P pairs, in order) ->
    [..., out] (indices' shape) in x's dtype: pair p's row of x (row p // (P / X)) through expert indices[p];
    with `up` (w's shape) and `limit`, the clamped SwiGLU of that (the gate) and the same through `up`; with
    `weights` (float32, P of them), pair p's row times weights[p]. Kernels read every array flat: no
    reshape, a node of each step's graph, is needed for any of them. `tensor_cores`: which body
    (`_gguf_rows_tensor_cores` where None)."""
    from ds4_mlx.models import gguf_blocks

    rows, inp, out, pairs = x.size // x.shape[-1], x.shape[-1], w.shape[1], indices.size
    lattice, ksigns = gguf_blocks.iq2xxs_kernel_tables(packed=True)
    inputs = [x, w, indices, lattice, ksigns] + ([] if up is None else [up])
    inputs += [] if weights is None else [weights.astype(mx.float32)]
    if tensor_cores is None:
        tensor_cores = _gguf_rows_tensor_cores(x, codec, w.shape[-1], up is not None)
    if tensor_cores:  # 4 warps a block, 16 A rows: 16 outputs, or 8 of the gate and up matrices
        threads, outs_a_block, body = 128, 16 if up is None else 8, ("STRIDE", _gguf_rows_stride(w.shape[-1]))
    else:  # a warp's two rows: two outputs, or one of the gate and up matrices
        warps = _gguf_rows_warps(codec, inp, x.itemsize, w.shape[-1])
        threads, outs_a_block, body = warps * 32, warps * (2 if up is None else 1), ("WARPS", warps)
    return _gguf_rows_kernel(limit, weights is not None, tensor_cores)(
        inputs=inputs,
        template=[("CODEC", _GGUF_CODECS[codec]), ("IN", inp), ("OUT", out), ("PAIRS", pairs), ("XROWS", rows),
                  ("BLOCK", gguf_blocks.row_bytes(codec, 256)), ("WORD", _word(w.shape[-1])), body,
                  *_dtype_keys(inputs)],
        grid=(pairs * -(-out // outs_a_block) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(*indices.shape, out)], output_dtypes=[x.dtype])[0]


def gguf_rows_reference(x, w, indices, codec, weights=None):
    """`_gguf_rows_cuda`'s definition: each pair's expert dequantized (`gguf_blocks.dequantize`), then its
    product with its row of x, in float32 (times its weight, where given), rounded to x's dtype; [...,
    out] in indices' shape."""
    from ds4_mlx.models import gguf_blocks

    pairs, x = indices.reshape(-1), x.reshape(-1, x.shape[-1])
    matrices = gguf_blocks.dequantize(w[pairs], codec)  # [P, out, in]
    rows = mx.repeat(x.astype(mx.float32), pairs.size // x.shape[0], axis=0)
    y = (rows[:, None, :] @ matrices.swapaxes(-1, -2))[:, 0, :]
    y = y if weights is None else y * weights.reshape(-1, 1).astype(mx.float32)
    return y.reshape(*indices.shape, -1).astype(x.dtype)


def _gguf_rows_sample(codec):
    from ds4_mlx.models import gguf_blocks

    w = gguf_blocks.random_blocks(codec, (3, 8, gguf_blocks.row_bytes(codec, 512)), seed=5)
    return _random(2, 512), w, mx.array([2, 0, 1, 2], mx.uint32), codec  # two pairs a row of x


def _gguf_rows_weighted_sample(codec):
    return (*_gguf_rows_sample(codec), mx.array([0.5, -1.25, 2.0, 0.125], mx.float32))


GGUF_ROWS = {codec: Kernel(f"gguf_rows_{codec}", gguf_rows_reference, partial(_gguf_rows_sample, codec), 1e-4)
             for codec in _GGUF_CODECS}
GGUF_ROWS_WEIGHTED = {codec: Kernel(f"gguf_rows_weighted_{codec}", gguf_rows_reference,
                                    partial(_gguf_rows_weighted_sample, codec), 1e-4) for codec in _GGUF_CODECS}
for _kernel in (*GGUF_ROWS.values(), *GGUF_ROWS_WEIGHTED.values()):
    _kernel.launches["cuda"] = lambda x, w, indices, codec, weights=None: _gguf_rows_cuda(x, w, indices, codec,
                                                                                          weights=weights)
GGUF_ROWS_MAX_PAIRS = 64  # past this a prefill chunk's dequantize-then-product reads each expert once


def gguf_rows_glu_reference(x, gate, up, indices, codec, limit):
    """clamped_swiglu of `gguf_rows_reference`'s products through two matrices, in float32."""
    return clamped_swiglu(gguf_rows_reference(x.astype(mx.float32), gate, indices, codec),
                          gguf_rows_reference(x.astype(mx.float32), up, indices, codec), limit)


def _gguf_rows_glu_sample(codec):
    from ds4_mlx.models import gguf_blocks

    x, gate, indices, codec = _gguf_rows_sample(codec)
    return x, gate, gguf_blocks.random_blocks(codec, gate.shape, seed=6), indices, codec, 2.0


GGUF_ROWS_GLU = {codec: Kernel(f"gguf_rows_glu_{codec}", gguf_rows_glu_reference,
                               partial(_gguf_rows_glu_sample, codec), 1e-4) for codec in _GGUF_CODECS}
for _kernel in GGUF_ROWS_GLU.values():
    _kernel.launches["cuda"] = lambda x, gate, up, indices, codec, limit: _gguf_rows_cuda(x, gate, indices, codec,
                                                                                           up, limit)


def _gguf_rows_stride(row_bytes):
    """Bytes between the tensor-core body's staged rows: an odd number of 16-byte words, so that the 8 rows
    of one load fall on different banks."""
    words = -(-row_bytes // 16)
    return 16 * (words + 1 - words % 2)


def _gguf_rows_mma_fits(codec, inp, itemsize, row_bytes):
    """Whether the tensor-core body's x, staged rows and tables fit a block's shared memory."""
    tables = 256 * 8 + 128 if codec == "iq2_xxs" else 0
    return inp * itemsize + 16 * _gguf_rows_stride(row_bytes) + tables + 4 * 16 * 4 <= _SHARED_BYTES


def _gguf_rows_tensor_cores(x, codec, row_bytes, glu):
    """Whether the tensor-core body takes x (bfloat16 or float16, fits, its self-check passed): a function of
    the shapes and dtype, never of the pairs."""
    return (x.dtype in (mx.bfloat16, mx.float16) and _gguf_rows_mma_fits(codec, x.shape[-1], x.itemsize, row_bytes)
            and (GGUF_ROWS_GLU_MMA if glu else GGUF_ROWS_MMA).backend() == "cuda")


def _gguf_rows_mma_samples(glu):
    """`_gguf_rows_sample`'s inputs in bfloat16 and float16 for each codec (weighted, or through a second
    matrix for the GLU form): a row of 512 (two blocks), 8 output rows (half a tile)."""
    samples = []
    for codec in _GGUF_CODECS:
        x, *rest = _gguf_rows_glu_sample(codec) if glu else _gguf_rows_weighted_sample(codec)
        samples += [(x.astype(dtype), *rest) for dtype in (mx.bfloat16, mx.float16)]
    return samples


# x and the result 16-bit: the definition's float32 rounded to them may differ from the kernel's in the last bit
GGUF_ROWS_MMA = Kernel("gguf_rows_tensor_cores", gguf_rows_reference, partial(_gguf_rows_mma_samples, False), 1e-2)
GGUF_ROWS_MMA.launches["cuda"] = lambda x, w, indices, codec, weights=None: _gguf_rows_cuda(
    x, w, indices, codec, weights=weights, tensor_cores=True)
GGUF_ROWS_GLU_MMA = Kernel("gguf_rows_glu_tensor_cores", gguf_rows_glu_reference,
                           partial(_gguf_rows_mma_samples, True), 1e-2)
GGUF_ROWS_GLU_MMA.launches["cuda"] = lambda x, gate, up, indices, codec, limit: _gguf_rows_cuda(
    x, gate, indices, codec, up, limit, tensor_cores=True)


def _gguf_rows_apply(kernel, x, w, indices, codec):
    inp = x.shape[-1]
    return not (kernel is None or indices.size > GGUF_ROWS_MAX_PAIRS or indices.size % (x.size // inp) or inp % 256
                or _gguf_rows_warps(codec, inp, x.itemsize, w.shape[-1]) is None or kernel.backend() is None)


def gguf_rows(x, w, indices, codec, weights=None):
    """`gguf_rows_reference`, one kernel on CUDA for up to GGUF_ROWS_MAX_PAIRS pairs; None where the kernel
    does not apply (the caller then runs its own path)."""
    kernel = (GGUF_ROWS if weights is None else GGUF_ROWS_WEIGHTED).get(codec)
    if not _gguf_rows_apply(kernel, x, w, indices, codec):
        return None
    return kernel.launches[kernel.backend()](x, w, indices, codec, weights)


def gguf_rows_glu(x, gate, up, indices, codec, limit):
    """`gguf_rows_glu_reference` in x's dtype, one kernel on CUDA (`gguf_rows`'s, reading both matrices); None
    where it does not apply."""
    kernel = GGUF_ROWS_GLU.get(codec)
    if gate.shape != up.shape or not _gguf_rows_apply(kernel, x, gate, indices, codec):
        return None
    return kernel.launches[kernel.backend()](x, gate, up, indices, codec, limit)


# Whole experts of a prefill chunk dequantized in one launch (one thread a byte of Q2_K codes, or a group
# of 8 IQ2_XXS values), for the dequantize-then-product path; plain MLX takes ~20 ops a matrix.
_GGUF_DEQUANTIZE_CUDA = """
    const size_t u = (size_t)blockIdx.x * GROUP + threadIdx.x;
    constexpr int UNITS = CODEC == 0 ? 64 : 32;  // per block of 256 values
    if (u >= (size_t)ROWS * (IN / 256) * UNITS) return;
    const size_t block = u / UNITS;
    const uint8_t* blk = w + block * BLOCK;
    auto* out = y + block * 256;
    float v[8];
    int at[4];
    if (CODEC == 0) {
        q2k_unit(blk, u % 64, v, at);
        for (int i = 0; i < 4; ++i) store(out + at[i], v[i]);
    } else {
        iq2xxs_unit(blk, u % 32, lattice, ksigns, v);
        for (int k = 0; k < 8; ++k) store(out + (u % 32) * 8 + k, v[k]);
    }
"""


@lru_cache(maxsize=None)
def _gguf_dequantize_kernel():
    return mx.fast.cuda_kernel(name="ds4_gguf_dequantize", input_names=["w", "lattice", "ksigns"],
                               output_names=["y"], source=_GGUF_DEQUANTIZE_CUDA, header=_LOADS + _GGUF_UNITS)


def _gguf_dequantize_cuda(w, codec, dtype):
    from ds4_mlx.models import gguf_blocks

    block = gguf_blocks.row_bytes(codec, 256)
    rows, inp = w.size // w.shape[-1], w.shape[-1] // block * 256
    lattice, ksigns = gguf_blocks.iq2xxs_kernel_tables()
    units = rows * (inp // 256) * (64 if codec == "q2_k" else 32)
    return _gguf_dequantize_kernel()(
        inputs=[w, lattice, ksigns],
        template=[("CODEC", _GGUF_CODECS[codec]), ("IN", inp), ("ROWS", rows), ("BLOCK", block),
                  ("GROUP", _EXPERT_GROUP), ("OUT_TYPE", dtype)],
        grid=(-(-units // _EXPERT_GROUP) * _EXPERT_GROUP, 1, 1), threadgroup=(_EXPERT_GROUP, 1, 1),
        output_shapes=[(*w.shape[:-1], inp)], output_dtypes=[dtype])[0]


def _gguf_dequantize_sample(codec):
    from ds4_mlx.models import gguf_blocks

    w = gguf_blocks.random_blocks(codec, (2, 8, gguf_blocks.row_bytes(codec, 512)), seed=6)
    return [(w, codec, dtype) for dtype in (mx.float32, mx.bfloat16, mx.float16)]


def _gguf_dequantize_definition(w, codec, dtype):
    from ds4_mlx.models import gguf_blocks

    return gguf_blocks.dequantize(w, codec).astype(dtype)


# a value a float32 rounding away from the definition's may round to the neighbouring 16-bit value
GGUF_DEQUANTIZE = {codec: Kernel(f"gguf_dequantize_{codec}", _gguf_dequantize_definition,
                                 partial(_gguf_dequantize_sample, codec), 2.0 ** -8) for codec in _GGUF_CODECS}
for _kernel in GGUF_DEQUANTIZE.values():
    _kernel.launches["cuda"] = _gguf_dequantize_cuda


def gguf_dequantize(w, codec, dtype=mx.float32):
    """`gguf_blocks.dequantize` as `dtype` values, each rounded once from float32, in one kernel on CUDA
    (float32 values and a cast would write and read several times the bytes); None where it does not
    apply."""
    kernel = GGUF_DEQUANTIZE.get(codec)
    kind = None if kernel is None else kernel.backend()
    return None if kind is None else kernel.launches[kind](w, codec, dtype)


# ---------------------------------------------------------------------------------------------
# 8-bit affine products of a few rows (a decoded token, a verify, a batched step): the attention
# projections, the grouped output projection, the shared expert and the head of the published files (Q8_0).
# MLX's quantized product re-reads the weight for each row past the first and takes a tensor-core kernel
# from a few rows on. Here a block takes R output rows and its warps split the input; a row's sums follow
# the spans a thread takes (a function of K alone), then a fixed warp and block reduction: its bits do not
# depend on the rows beside it. `G` groups: output row n reads x's group n / (N / G) (the grouped map). The
# result is stored in x's dtype.
# Two bodies compute the block's sums. float32 x (the exact mode): threads split the input in 16-wide
# chunks, read each row's 16 codes as one word and apply them to every row of x in float32. bfloat16 and
# float16 x: tensor cores (the body below), where the float32 body spends a multiply-add a row on each weight
# and is no longer memory bound from a few rows on.
# Two variants save a launch each: GLU reads a second map (the shared expert's up beside its gate; a block's
# last R / 2 rows are the up map's) and writes the clamped SwiGLU of the two products; ADD writes
# `addend` plus the product rounded to the output dtype, as the plain sum of the two rounds.
_FEW_ROWS_HEAD = """
    constexpr int NG = N / G, OUT_R = GLU ? R / 2 : R;
    __shared__ float partial[WARPS][R * M];
    // PAIR: the blocks past the first map's rows take the second map's (its own arrays and output)
    const bool second_map = PAIR && blockIdx.x * OUT_R >= N;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, out0 = blockIdx.x * OUT_R - (second_map ? N : 0);
    const int g = G == 1 ? 0 : out0 / NG;  // OUT_R divides NG: the block's rows share a group
    // block row r: the first map's row out0 + r, or (GLU) the up map's row out0 + r - OUT_R
    auto map_row = [&](int r, bool& second) {
        second = GLU && r >= OUT_R || second_map;
        return (size_t)out0 + (GLU && r >= OUT_R ? r - OUT_R : r);
    };
"""
_FEW_ROWS_FLOAT = """
    constexpr int CHUNKS = K / 16;
    float acc[R][M];
    for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    for (int c = threadIdx.x; c < CHUNKS; c += 32 * WARPS) {
        const int k0 = c * 16;
        float wf[R][16], scale[R], bias[R];
        for (int r = 0; r < R; ++r) {
            bool second;
            const size_t row = map_row(r, second);
            const uint4 codes = reinterpret_cast<const uint4*>((second ? UP_W : w) + row * (K / 4))[c];
            const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
            for (int j = 0; j < 16; ++j) wf[r][j] = (float)((words[j / 4] >> (8 * (j % 4))) & 0xFF);
            scale[r] = static_cast<float>((second ? UP_SCALES : scales)[row * (K / GS) + k0 / GS]);
            bias[r] = static_cast<float>((second ? UP_BIASES : biases)[row * (K / GS) + k0 / GS]);
        }
        for (int m = 0; m < M; ++m) {
            float xv[16], total = 0.0f;
            load_floats<16>(x + ((size_t)m * G + g) * K + k0, xv);
            for (int j = 0; j < 16; ++j) total += xv[j];
            for (int r = 0; r < R; ++r) {
                float dot = 0.0f;
                for (int j = 0; j < 16; ++j) dot += wf[r][j] * xv[j];
                acc[r][m] += scale[r] * dot + bias[r] * total;
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
            for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane == 0) partial[warp][r * M + m] = v;
        }
"""
# The tensor-core body: a warp's A operand is the block's 16 rows of codes as exact integers, B up to 8 rows
# of x a tile (a row of x is always the same column of the same tile), over spans of 32 inputs, U spans a
# step for loads in flight. A thread reads 8 codes of a row and the 8 values of x beside them, so that both
# operands permute a span's inputs alike and a span stays in one quantization group: a span's sums of q * x
# and of x (the latter by a product with ones) are scaled into the running sums with the group's scale and
# bias. U and the warps are functions of K alone.
_FEW_ROWS_MMA = """
    static_assert(R == 16 && GS % 32 == 0 && K % (32 * U) == 0, "a tile of 16 rows, spans of 32 in a group");
    constexpr int SPANS = K / 32, TILES = (M + 7) / 8;
    constexpr int BATCH = TILES > 1 && U > 1 ? U / 2 : U;  // spans loaded at once: fewer for two tiles of x's
    // rows (registers), taken in the same order
    const int row8 = lane / 4, quad = lane % 4;  // the fragments' groupID and threadID_in_group
    bool second_lo, second_hi;
    const size_t row_lo = map_row(row8, second_lo), row_hi = map_row(row8 + 8, second_hi);
    const uint8_t* codes_lo = reinterpret_cast<const uint8_t*>((second_lo ? UP_W : w) + row_lo * (K / 4)) + 8 * quad;
    const uint8_t* codes_hi = reinterpret_cast<const uint8_t*>((second_hi ? UP_W : w) + row_hi * (K / 4)) + 8 * quad;
    const auto* scales_lo = (second_lo ? UP_SCALES : scales) + row_lo * (K / GS);
    const auto* scales_hi = (second_hi ? UP_SCALES : scales) + row_hi * (K / GS);
    const auto* biases_lo = (second_lo ? UP_BIASES : biases) + row_lo * (K / GS);
    const auto* biases_hi = (second_hi ? UP_BIASES : biases) + row_hi * (K / GS);
    const bool x_words = reinterpret_cast<unsigned long long>(x) % 16 == 0;
    const uint32_t ones[4] = {one_pair(x), one_pair(x), one_pair(x), one_pair(x)};
    float acc[TILES][4];
    for (int t = 0; t < TILES; ++t) for (int i = 0; i < 4; ++i) acc[t][i] = 0.0f;
    for (int s0 = warp * U; s0 < SPANS; s0 += WARPS * U)  // the warp's steps, a step's spans in batches
    for (int s1 = s0; s1 < s0 + U; s1 += BATCH) {
        uint2 lo[BATCH], hi[BATCH];
        uint4 xs[BATCH][TILES];
        using Scale = decltype(pointee(scales_lo));
        alignas(16) Scale s_lo[BATCH], s_hi[BATCH], b_lo[BATCH], b_hi[BATCH];  // the spans' groups' scales, biases
        if (GS == 32) {  // a span a group: the step's in one word each
            load_values<BATCH>(scales_lo + s1, s_lo);
            load_values<BATCH>(scales_hi + s1, s_hi);
            load_values<BATCH>(biases_lo + s1, b_lo);
            load_values<BATCH>(biases_hi + s1, b_hi);
        } else {
            for (int u = 0; u < BATCH; ++u) {
                const int group = (s1 + u) * 32 / GS;
                s_lo[u] = scales_lo[group], s_hi[u] = scales_hi[group], b_lo[u] = biases_lo[group], b_hi[u] = biases_hi[group];
            }
        }
        for (int u = 0; u < BATCH; ++u) {
            lo[u] = *reinterpret_cast<const uint2*>(codes_lo + (s1 + u) * 32);
            hi[u] = *reinterpret_cast<const uint2*>(codes_hi + (s1 + u) * 32);
            for (int t = 0; t < TILES; ++t) {
                const int m = t * 8 + row8;
                xs[u][t] = m < M ? eight_values(x + ((size_t)m * G + g) * K + (s1 + u) * 32 + 8 * quad, x_words)
                                 : make_uint4(0, 0, 0, 0);
            }
        }
        for (int u = 0; u < BATCH; ++u) {
            // A for the span's two k-tiles: bytes 0, 1 of each word at k 2 quad, 2 quad + 1, bytes 2, 3 at 8 more
            const uint32_t a0[4] = {code_pair<0>(x, lo[u].x), code_pair<0>(x, hi[u].x),
                                    code_pair<1>(x, lo[u].x), code_pair<1>(x, hi[u].x)};
            const uint32_t a1[4] = {code_pair<0>(x, lo[u].y), code_pair<0>(x, hi[u].y),
                                    code_pair<1>(x, lo[u].y), code_pair<1>(x, hi[u].y)};
            for (int t = 0; t < TILES; ++t) {
                float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f}, total[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_16816(x, dot, a0, xs[u][t].x, xs[u][t].y);
                mma_16816(x, dot, a1, xs[u][t].z, xs[u][t].w);
                mma_16816(x, total, ones, xs[u][t].x, xs[u][t].y);
                mma_16816(x, total, ones, xs[u][t].z, xs[u][t].w);
                const float sl = static_cast<float>(s_lo[u]), sh = static_cast<float>(s_hi[u]);
                const float bl = static_cast<float>(b_lo[u]), bh = static_cast<float>(b_hi[u]);
                acc[t][0] += sl * dot[0] + bl * total[0];
                acc[t][1] += sl * dot[1] + bl * total[1];
                acc[t][2] += sh * dot[2] + bh * total[2];
                acc[t][3] += sh * dot[3] + bh * total[3];
            }
        }
    }
    for (int t = 0; t < TILES; ++t)  // accumulator i: block row row8 + 8 (i / 2), x row 8 t + 2 quad + i % 2
        for (int i = 0; i < 4; ++i) {
            const int m = t * 8 + 2 * quad + i % 2;
            if (m < M) partial[warp][(row8 + 8 * (i / 2)) * M + m] = acc[t][i];
        }
"""
_FEW_ROWS_TAIL = """
    __syncthreads();
    for (int i = threadIdx.x; i < OUT_R * M; i += 32 * WARPS) {
        const size_t at = (size_t)(i % M) * (second_map ? N2 : N) + out0 + i / M;
        float v = 0.0f;
        for (int k = 0; k < WARPS; ++k) v += partial[k][i];
        if (GLU) {
            float u = 0.0f;
            for (int k = 0; k < WARPS; ++k) u += partial[k][OUT_R * M + i];
            v = clamped_swiglu(v, u, LIMIT);
        }
        if (ADD) {  // the addend's terms summed, then the two rounded as the plain sums are
            float terms = 0.0f;
            for (int j = 0; j < TERMS; ++j)
                terms += static_cast<float>(addend[((size_t)(i % M) * TERMS + j) * N + out0 + i / M]);
            v = rounded_as(y, terms) + rounded_as(y, v);
        }
        store((second_map ? y2 : y) + at, v);
    }
"""
FEW_ROWS_MAX = 16
_FEW_ROWS_VARIANTS = {  # variant -> (extra inputs, defines)
    "plain": ([], "#define GLU 0\n#define ADD 0\n#define PAIR 0\n"),
    "glu": (["up_w", "up_scales", "up_biases"], "#define GLU 1\n#define ADD 0\n#define PAIR 0\n"),
    "add": (["addend"], "#define GLU 0\n#define ADD 1\n#define PAIR 0\n"),
    "pair": (["up_w", "up_scales", "up_biases"], "#define GLU 0\n#define ADD 0\n#define PAIR 1\n"),
}


@lru_cache(maxsize=None)
def _few_rows_kernel(variant="plain", limit=0.0, tensor_cores=False):
    extra, defines = _FEW_ROWS_VARIANTS[variant]
    up = "up_" if variant in ("glu", "pair") else ""  # the second map's arrays: the first's, where there is none
    defines += f"#define UP_W {up}w\n#define UP_SCALES {up}scales\n#define UP_BIASES {up}biases\n"
    if variant != "add":
        defines += "#define addend y\n#define TERMS 1\n"
    if variant != "pair":
        defines += "#define y2 y\n#define N2 N\n"
    name = "ds4_few_rows_q8" + ("_mma" if tensor_cores else "") + ("" if variant == "plain" else f"_{variant}") + (
        f"_{abs(hash(limit))}" if variant == "glu" else "")
    body = _FEW_ROWS_MMA if tensor_cores else _FEW_ROWS_FLOAT
    return mx.fast.cuda_kernel(name=name, input_names=["x", "w", "scales", "biases"] + extra,
                               output_names=["y", "y2"] if variant == "pair" else ["y"],
                               source=defines + f"#define LIMIT {float(limit)!r}f\n" + _FEW_ROWS_HEAD + body
                               + _FEW_ROWS_TAIL, header=_LOADS)


def few_rows_reference(x, w, scales, biases, group_size):
    """x [M, groups, K] through 8-bit affine maps w [groups, out, K / 4] -> [M, groups, out] float32."""
    weights = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, 8)
    return (x.astype(mx.float32).swapaxes(0, 1) @ weights.swapaxes(-1, -2)).swapaxes(0, 1)


def _few_rows_launch(variant, x, w, scales, biases, group_size, extra=(), limit=0.0, tensor_cores=None):
    """x [M, groups, K] with maps w [groups, out, K / 4] -> [M, groups, out]; or x [M, K] with one map w [out,
    K / 4] -> [M, out] (no views of a layer's arrays: each would be a node of every step's graph). The pair
    variant: x [M, K] through w and a second map [out2, K / 4] (`extra`) -> ([M, out], [M, out2]).
    `tensor_cores`: which body (`_few_rows_tensor_cores` where None)."""
    M, K, G = x.shape[0], x.shape[-1], x.shape[1] if x.ndim == 3 else 1
    N = w.size // w.shape[-1]
    N2 = extra[0].shape[0] if variant == "pair" else 0
    if tensor_cores is None:
        tensor_cores = _few_rows_tensor_cores(variant, x, K, N // G, N2, group_size)
    if tensor_cores:
        rows, span_steps = 16, _span_step(K)
        warps = min(8, K // 32 // span_steps)  # a function of K alone (see above), as the float body's
    else:
        rows = 2 if M > 8 or w.shape[-2] % 4 or N2 % 4 else 4  # output rows a block takes: more share x's
        # loads, until the registers of M rows run out (a GLU block reads two maps' rows for each)
        span_steps, warps = 1, min(8, max(1, K // 16 // 64))  # a thread takes a few chunks: a function of K
    out_rows = rows // 2 if variant == "glu" else rows
    inputs = [x, w, scales, biases, *extra]
    shapes = [(M, G, N // G) if x.ndim == 3 else (M, N)] + ([(M, N2)] if variant == "pair" else [])
    y = _few_rows_kernel(variant, limit, tensor_cores)(
        inputs=inputs,
        template=[("M", M), ("G", G), ("K", K), ("N", N), ("GS", group_size), ("R", rows), ("WARPS", warps),
                  ("U", span_steps), *([("N2", N2)] if variant == "pair" else []),
                  *([("TERMS", extra[0].size // (M * N))] if variant == "add" else []), *_dtype_keys(inputs)],
        grid=((N + N2) // out_rows * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=shapes, output_dtypes=[x.dtype] * len(shapes))
    return tuple(y) if variant == "pair" else y[0]


def _few_rows_tensor_cores(variant, x, K, NG, N2, group_size):
    """Whether the tensor-core body takes a product: 16-bit x, a shape whose blocks of 16 rows and spans of 32
    inputs tile it (a choice of the shape alone, never of the number of rows), and the body's own self-check
    passed (`FEW_ROWS_MMA`: every variant's samples are float32, which the other body takes)."""
    block = 8 if variant == "glu" else 16
    return (x.dtype in (mx.bfloat16, mx.float16) and group_size % 32 == 0 and K % 32 == 0 and NG % block == 0
            and N2 % block == 0 and FEW_ROWS_MMA.backend() == "cuda")


def _span_step(K):
    """Spans of 32 inputs a warp's step reads: several loads in flight, where K allows."""
    return next(u for u in (4, 2, 1) if K // 32 % u == 0)


def _quantized(seed, groups, out, inp):
    w, scales, biases = mx.quantize(0.05 * _random(groups, out, inp, seed=seed), group_size=32, bits=8)
    return w, scales.astype(mx.float16), biases.astype(mx.float16)


def _few_rows_sample():
    return _random(3, 2, 256, seed=8), *_quantized(7, 2, 6, 256), 32


FEW_ROWS = Kernel("few_rows_q8", few_rows_reference, _few_rows_sample, 1e-4)
FEW_ROWS.launches["cuda"] = partial(_few_rows_launch, "plain")


def _few_rows_exact_samples():
    """x in bfloat16 and in float16 through the tensor-core body, every output exact in both (one value of
    x a row and group, a power of two times codes less 128), so that the output's rounding costs nothing
    against the definition's float32; two tiles of rows, two groups of maps, spans of two quantization
    groups of 32, and of one of 64."""
    rows, groups, out, inp = 11, 2, 16, 128
    rng = np.random.default_rng(5)
    w = mx.array(rng.integers(0, 256, (groups, out, inp), dtype=np.uint8).view(np.uint32))
    x = np.zeros((rows, groups, inp), np.float32)
    for m in range(rows):
        x[m, np.arange(groups), rng.integers(0, inp, groups)] = rng.choice([-2.0, -1.0, 1.0, 2.0], groups)
    samples = []
    for dtype, group_size in ((mx.bfloat16, 32), (mx.float16, 32), (mx.bfloat16, 64)):
        scales = 2.0 ** -rng.integers(6, 10, (groups, out, inp // group_size))
        samples.append((mx.array(x, dtype), w, mx.array(scales, mx.float16), mx.array(-128 * scales, mx.float16),
                        group_size))
    return samples


FEW_ROWS_MMA = Kernel("few_rows_q8_tensor_cores", few_rows_reference, _few_rows_exact_samples, 1e-4)
FEW_ROWS_MMA.launches["cuda"] = partial(_few_rows_launch, "plain", tensor_cores=True)


def few_rows_glu_reference(x, gate_w, gate_scales, gate_biases, up_w, up_scales, up_biases, group_size, limit):
    """clamped_swiglu of x's products with two maps (`few_rows_reference`'s) -> [M, 1, out] float32."""
    return clamped_swiglu(few_rows_reference(x, gate_w, gate_scales, gate_biases, group_size),
                          few_rows_reference(x, up_w, up_scales, up_biases, group_size), limit)


def _few_rows_glu_cuda(x, gate_w, gate_scales, gate_biases, up_w, up_scales, up_biases, group_size, limit):
    return _few_rows_launch("glu", x, gate_w, gate_scales, gate_biases, group_size, (up_w, up_scales, up_biases),
                            limit)


FEW_ROWS_GLU = Kernel("few_rows_q8_glu", few_rows_glu_reference,
                      lambda: (_random(3, 1, 256, seed=8), *_quantized(7, 1, 8, 256), *_quantized(9, 1, 8, 256), 32, 2.0),
                      1e-4)
FEW_ROWS_GLU.launches["cuda"] = _few_rows_glu_cuda


def few_rows_pair_reference(x, w, scales, biases, w2, scales2, biases2, group_size):
    """x [M, K] through two maps (`few_rows_reference`'s) -> ([M, out], [M, out2]) float32."""
    return tuple(few_rows_reference(x[:, None], *m, group_size)[:, 0] for m in ((w, scales, biases),
                                                                              (w2, scales2, biases2)))


def _few_rows_pair_cuda(x, w, scales, biases, w2, scales2, biases2, group_size):
    return _few_rows_launch("pair", x, w, scales, biases, group_size, (w2, scales2, biases2))


FEW_ROWS_PAIR = Kernel("few_rows_q8_pair", few_rows_pair_reference,
                       lambda: (_random(3, 256, seed=8), *(a[0] for a in _quantized(7, 1, 8, 256)),
                                *(a[0] for a in _quantized(9, 1, 12, 256)), 32), 1e-4)
FEW_ROWS_PAIR.launches["cuda"] = _few_rows_pair_cuda


def few_rows_add_reference(x, w, scales, biases, group_size, addend):
    """The sum of addend's terms plus `few_rows_reference`'s product, float32: addend [M, terms, outputs] (the
    outputs of every group), or the product's shape (one term)."""
    product = few_rows_reference(x, w, scales, biases, group_size)
    terms = addend.astype(mx.float32).reshape(product.shape[0], -1, product[0].size).sum(axis=1)
    return terms.reshape(product.shape) + product


def _few_rows_add_sample():
    """An addend of one term on two groups of maps, and one of six terms (a token's routed experts) on a map."""
    return [(*_few_rows_sample(), _random(3, 2, 6, seed=10)),
            (_random(3, 1, 256, seed=12), *_quantized(11, 1, 16, 256), 32, _random(3, 6, 16, seed=13))]


FEW_ROWS_ADD = Kernel("few_rows_q8_add", few_rows_add_reference, _few_rows_add_sample, 1e-4)
FEW_ROWS_ADD.launches["cuda"] = lambda x, w, scales, biases, group_size, addend: _few_rows_launch(
    "add", x, w, scales, biases, group_size, (addend,))


def _few_rows_apply(kernel, x, w, scales, biases, group_size, bits, mode):
    """Whether a few-row kernel takes this product on this backend."""
    return not (bits != 8 or mode != "affine" or biases is None or x.shape[0] > FEW_ROWS_MAX or x.shape[-1] % 16
                or group_size % 16 or w.shape[-2] % 2 or kernel.backend() is None)


def few_rows(x, w, scales, biases, group_size, bits, mode, addend=None):
    """`few_rows_reference` (in x's dtype), one kernel on CUDA for up to FEW_ROWS_MAX rows of 8-bit affine
    maps; with `addend` (x's dtype; [M, terms, out] or the product's shape), the sum of its terms plus that,
    rounded as the plain sums are. None where the kernel does not apply (the caller then runs its own path)."""
    kernel = FEW_ROWS if addend is None else FEW_ROWS_ADD
    if not _few_rows_apply(kernel, x, w, scales, biases, group_size, bits, mode):
        return None
    return kernel.launches["cuda"](x, w, scales, biases, group_size, *(() if addend is None else (addend,)))


def few_rows_pair(x, first, second):
    """`few_rows_pair_reference` (in x's dtype) in one kernel on CUDA, x [M, K]; `first`, `second`: (w, scales,
    biases, group_size, bits, mode) of two maps of one input width and format. None where the kernel does
    not apply."""
    if (first[2] is None or second[2] is None or first[0].ndim != 2 or second[0].ndim != 2
            or first[0].shape[1] != second[0].shape[1] or second[0].shape[0] % 2 or first[3:] != second[3:]
            or [a.dtype for a in first[1:3]] != [a.dtype for a in second[1:3]] or x.ndim != 2
            or not _few_rows_apply(FEW_ROWS_PAIR, x, *first)):
        return None
    return FEW_ROWS_PAIR.launches["cuda"](x, *first[:3], *second[:3], first[3])


def few_rows_glu(x, gate, up, limit):
    """`few_rows_glu_reference` (in x's dtype) in one kernel on CUDA, x [M, 1, K] or [M, K]; `gate`, `up`: (w,
    scales, biases, group_size, bits, mode) of two maps of one shape. None where the kernel does not apply."""
    if (gate[2] is None or up[2] is None  # no biases (mxfp4, nvfp4): not the kernel's, nor dtypes to compare
            or gate[0].shape != up[0].shape or [a.dtype for a in gate[1:3]] != [a.dtype for a in up[1:3]] or gate[3:] != up[3:]
            or (x.ndim == 3 and x.shape[1] != 1) or not _few_rows_apply(FEW_ROWS_GLU, x, *gate)):
        return None
    return FEW_ROWS_GLU.launches["cuda"](x, *gate[:3], *up[:3], gate[3], limit)
