"""Numerics shared by the layers: rotary embeddings (YaRN), the rounding of cached rows to the formats ds4
stores them in (FP8, FP4, float16), and writing rows into a cache array."""

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np


def reshaped(x, *shape):
    """`x.reshape(*shape)`, its -1 worked out first: MLX makes no graph node for a reshape to the shape x
    already has only when that shape is spelled out (a decoded token's graph costs host time per node)."""
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        if known:
            shape = tuple(x.size // known if n == -1 else n for n in shape)
    return x.reshape(shape)


def yarn_inv_freq(dim, base, scaling):
    """Inverse frequencies of the rotary pairs; YaRN blends interpolated and original frequencies
    (magnitude scaling is cancelled, as in the official model)."""
    inv = 1.0 / (base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
    if not scaling:
        return inv
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.get("beta_fast", 32.0))), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow", 1.0))), dim - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dim // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: original frequency, 0: interpolated by `factor`
    return inv / factor * (1 - keep) + inv * keep


class Rope:
    """Interleaved-pair rotary embedding on the last `dim` features of each head."""

    def __init__(self, dim, base, scaling=None):
        self.dim = dim
        self.periods = 1.0 / yarn_inv_freq(dim, base, scaling)  # mx.fast.rope takes 1 / frequency
        self._full = {}
        mx.eval(self.periods)  # a lazy array would tie the model to the building thread's stream

    def full_periods(self, width):
        """Periods for all `width` features: infinite for the leading pairs, whose angle is then 0 and
        which come out unchanged (exactly), so a whole head rotates in one op with no split."""
        if width not in self._full:
            full = mx.concatenate([mx.full(((width - self.dim) // 2,), mx.inf), self.periods])
            mx.eval(full)
            self._full[width] = full
        return self._full[width]

    def __call__(self, x, start, step=1, inverse=False, shape=None):
        """x [T, ..., D] holds positions start, start + step, ... along its first axis; or, with `start`
        an int array [T], row t is at position start[t] (tokens of several sessions decoded together).
        -> x rotated, in `shape` (default x's). Each reshape is a node of the graph: a caller that makes x
        as [T, heads, 1, D] (the per-row layout) and names the shape it wants saves both of its views."""
        T, D = x.shape[0], x.shape[-1]
        shape = x.shape if shape is None else shape
        if isinstance(start, mx.array) and start.ndim == 1:
            t = reshaped(x, T, -1, 1, D)  # one position per row: mx.fast.rope's per-batch offsets
            t = mx.fast.rope(t, D, traditional=True, base=None, scale=-1.0 if inverse else 1.0, offset=start,
                             freqs=self.full_periods(D))
            return reshaped(t, *shape)
        t = x.reshape(x.shape[0], -1, D).swapaxes(0, 1)  # mx.fast.rope wants [.., T, D]
        t = mx.fast.rope(t, D, traditional=True, base=None, scale=-step if inverse else step,
                         offset=start if step == 1 else start // step, freqs=self.full_periods(D))
        return reshaped(t.swapaxes(0, 1), *shape)


@lru_cache(maxsize=64)
def counting(n):
    """0, 1, ..., n - 1 (int32, as `mx.arange(n)`) as data: a constant of a compiled graph. An `mx.arange`
    in one is a kernel on every call (compiling folds no constants)."""
    return mx.array(np.arange(n, dtype=np.int32))


def fp8_e4m3_sim(x, block=64, width=None):
    """Round trip through FP8 E4M3 with a power-of-two scale per `block` values (ds4's KV rows) of the
    first `width` features (all by default); the others come back unchanged. -> float32"""
    shape = x.shape
    width = shape[-1] if width is None else width
    block = min(block, width)  # tiny test models have narrower heads
    if width % block:
        raise ValueError(f"FP8 blocks of {block} values do not tile the {width} features to round")
    if shape[-1] % block:  # blocks that do not tile the whole row (tiny test models)
        return mx.concatenate([fp8_e4m3_sim(x[..., :width], block), x[..., width:].astype(mx.float32)], axis=-1)
    x = x.reshape(shape[:-1] + (shape[-1] // block, block)).astype(mx.float32)
    amax = mx.maximum(mx.max(mx.abs(x), axis=-1, keepdims=True), 1e-4)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 448.0)))
    v = mx.clip(x / scale, -448.0, 448.0)
    v = mx.from_fp8(mx.to_fp8(v), dtype=mx.float32) * scale
    if width < shape[-1]:  # the blocks past `width` kept by a select (a slice and a concatenation are copies)
        v = mx.where(mx.array(np.arange(shape[-1] // block) < width // block)[:, None], v, x)
    return v.reshape(shape)


# the E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 as steps: (threshold, whether a tie steps up, the step); a
# tie steps up where the value above has the even grid index
_FP4_STEPS = ((0.25, False, 0.5), (0.75, True, 0.5), (1.25, False, 0.5), (1.75, True, 0.5), (2.5, False, 1.0),
              (3.5, True, 1.0), (5.0, False, 2.0))


def fp4_e2m1_round(v):
    """Nearest E2M1 value to v (|v| <= 6), ties to the even grid index. The grid value is the sum of the
    steps passed (exact: halves up to 6), element-wise ops only, which fuse into one kernel (a lookup in
    a table of the grid would be a gather kernel of its own)."""
    a = mx.abs(v)
    steps = sum(mx.where((a >= t) if tie_up else (a > t), step, 0.0) for t, tie_up, step in _FP4_STEPS)
    return mx.sign(v) * steps


def fp4_e2m1_sim(x, block=32):
    shape = x.shape
    block = min(block, shape[-1])
    x = x.reshape(shape[:-1] + (shape[-1] // block, block)).astype(mx.float32)
    amax = mx.maximum(mx.max(mx.abs(x), axis=-1, keepdims=True), 7.052966e-38)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 6.0)))
    v = fp4_e2m1_round(mx.clip(x / scale, -6.0, 6.0))
    return (v * scale).reshape(shape)


def f16_round(x):
    return x.astype(mx.float16).astype(x.dtype)


def hadamard(x):
    """The normalised Hadamard transform, in float32, that precedes the indexer's FP4 rounding (ds4's)."""
    return mx.hadamard_transform(x.astype(mx.float32), scale=1.0 / math.sqrt(x.shape[-1]))


def write_rows(rows, at, values):
    """`rows` [n, width] with `values` [k, width] at rows `at` [k] or [k, 1] (int32: ring slots, buffer rows;
    the cache's slots are [k, 1], which takes no view to expand). A scatter, which MLX runs in place when
    nothing else holds `rows` (one launch; a slice update at a computed index is two on CUDA, and a kernel
    writing a copy is slower: the rings hold the rewind history)."""
    return mx.put_along_axis(rows, at if at.ndim == 2 else at[:, None], values.astype(rows.dtype), axis=0)
