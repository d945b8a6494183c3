"""Rows of GGUF types MLX cannot hold as they are (Q2_K, IQ2_XXS, Q6_K, ...) -> MLX affine arrays,
computed in MLX (on the GPU when there is one).

These formats have 16-wide sub-blocks or codebooks, so rows are dequantized to float32, exactly as the
`gguf` package does, then refitted to affine codes.
"""

import numpy as np
import mlx.core as mx
import gguf.quants
from gguf import GGML_QUANT_SIZES

from ds4_mlx.models import gguf_blocks


def affine_format(qtype, expert_bits=None, group_size=None) -> tuple:
    """(bits, group size) of the affine format `qtype` is requantized to: the user's choice, else the
    whole bits of the type's codes (at least 2), group 64 up to 3 bits and 32 above. That stays near the
    GGUF's own bits a weight (Q2_K 2.625 and IQ2_XXS 2.0625 -> 2.5 with a float16 scale and bias a group
    of 64), which keeps the published q2 file within 1.15x its size (`ds4-mlx bench convert`)."""
    block, size = GGML_QUANT_SIZES[qtype]
    bits = max(2, int(size * 8 / block))
    return expert_bits or bits, group_size or (64 if bits <= 3 else 32)


def dequantize(raw, qtype, cols):
    """uint8 rows (numpy or mx) [rows, row bytes] -> float32 mx [rows, cols], the `gguf` package's values
    (through MLX where `gguf_blocks` decodes the type, else the package's own numpy)."""
    if qtype in gguf_blocks.CODECS:
        return gguf_blocks.dequantize(raw, gguf_blocks.CODECS[qtype]).reshape(-1, cols)
    return mx.array(gguf.quants.dequantize(np.asarray(raw), qtype).reshape(-1, cols))


_ITERS = 4


def _starts(top):
    """(shrink, steps) starting points of the fit: the group's range spanned by the last few step
    counts down to about half of 2^bits - 1 (which can land on the source's levels exactly), and the
    range shrunk by a fraction at each end (outliers cost less than the bulk)."""
    half = (top + 1) // 2
    return [(0.0, st) for st in range(top, max(half, top - 3) - 1, -1)] + \
        [(shrink, st) for shrink in (0.1, 0.2, 0.3) for st in (top, half)]
_compiled = {}


def requantize(w, bits, group_size):
    """Float rows (mx or numpy) -> (packed uint32 codes, scales, biases), the last two float32 mx arrays.

    A least-squares fit rather than MLX's min/max: the source formats put few distinct levels in a
    group, so each group tries several starting ranges, alternates rounding to codes with the exact
    least-squares (scale, bias) of those codes, and keeps its best try. The plain range is one of the
    starts, so this is never worse than `mx.quantize` plus its refit."""
    w = mx.array(w, mx.float32)
    fit = lambda x: _fit(x, bits, group_size)
    if on_gpu():  # fused kernels; MLX's CPU backend ran the compiled graph slower
        key = (bits, group_size)
        fit = _compiled[key] = _compiled.get(key) or mx.compile(fit)
    q, s, b = fit(w.reshape(-1, group_size))
    rows = w.shape[0]
    return pack(q.reshape(rows, -1), bits), s.reshape(rows, -1), b.reshape(rows, -1)


def on_gpu():
    return mx.default_device() == mx.gpu


def _fit(x, bits, group_size):
    top = 2**bits - 1
    n, sx = group_size, x.sum(1, keepdims=True)
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    best = None
    for shrink, steps in _starts(top):
        b = lo + shrink * (hi - lo)
        s = mx.maximum((1 - 2 * shrink) * (hi - lo) / steps, 1e-30)
        for _ in range(_ITERS):  # round, then the least-squares (scale, bias) of those codes
            q = mx.clip(mx.round((x - b) / s), 0, top)
            sq = q.sum(1, keepdims=True)
            den = n * (q * q).sum(1, keepdims=True) - sq * sq
            ok = den > 0
            s_new = mx.where(ok, (n * (q * x).sum(1, keepdims=True) - sq * sx) / mx.where(ok, den, 1), s)
            b = mx.where(ok, (sx - s_new * sq) / n, b)
            s = mx.where(s_new > 0, s_new, s)
        q = mx.clip(mx.round((x - b) / s), 0, top)
        err = mx.square(s * q + b - x).sum(1, keepdims=True)
        if best is None:
            best = (err, q, s, b)
        else:
            better = err < best[0]
            best = tuple(mx.where(better, v, o) for v, o in zip((err, q, s, b), best))
    _, q, s, b = best
    s = mx.where(q.max(1, keepdims=True) == 0, 0.0, s)  # a constant group: its scale is unused
    return q.astype(mx.uint32), s, b


def pack(codes, bits):
    """uint32 codes [rows, n] -> uint32 [rows, n * bits / 32] in MLX's layout: a little-endian bit stream."""
    rows, n = codes.shape
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        return (codes.reshape(rows, n // per, per) << shifts).sum(-1).astype(mx.uint32)
    # 3, 5, 6 bits: 8 codes make `bits` whole bytes; build them in 64-bit words
    c = codes.astype(mx.uint64).reshape(rows, n // 8, 8) << mx.arange(0, 8 * bits, bits, dtype=mx.uint64)
    word = c.sum(-1, keepdims=True).astype(mx.uint64)
    byte = ((word >> mx.arange(0, 8 * bits, 8, dtype=mx.uint64)) & 0xFF).astype(mx.uint8)
    return mx.view(byte.reshape(rows, -1), mx.uint32)


def convert_rows(raw, qtype, cols, bits, group_size):
    """GGUF rows of `qtype` -> ({"weight", "scales", "biases"} numpy, squared error, squared reference),
    the errors measured against the GGUF's own dequantized values."""
    w = dequantize(raw, qtype, cols)
    q, s, b = requantize(w, bits, group_size)
    err = mx.square(mx.dequantize(q, s, b, group_size=group_size, bits=bits) - w).sum()
    ref = mx.square(w).sum()
    mx.eval(q, s, b, err, ref)
    return {"weight": np.array(q), "scales": np.array(s), "biases": np.array(b)}, err.item(), ref.item()
