"""Q2_K and IQ2_XXS quantizers in numpy, for tests and `ds4-mlx bench convert`.

The `gguf` package only dequantizes these two types, and requantization error depends on how codes are
distributed, so measuring it on uniformly random bytes says little about real files. These follow
llama.cpp's reference quantizers in structure (no importance matrix):
- Q2_K: per 16-value sub-block a min/max affine fit, refined once by least squares, with its scale and
  min rounded to 4 bits of the block's fp16 `d` / `dmin`.
- IQ2_XXS: per 8 values, signs from the weights (an odd count of minus signs flips the smallest value,
  as the format stores even parity) and the nearest of the 256 lattice points in magnitude; per 32-value
  sub-block the best of a few scales, then the least-squares scale, rounded to 4 bits of the block's `d`.
Outputs are GGUF block bytes, rows of `quantize(w, qtype)` for float32 `w` [rows, cols], cols % 256 == 0.
"""

import numpy as np
import gguf.quants
from gguf import GGMLQuantizationType as T


def realistic_weights(rows, cols, rng, std=0.02):
    """Heavy-tailed rows (Student-t, 5 degrees of freedom) with per-row scales spread 2x either way,
    closer to trained weight matrices than a Gaussian."""
    w = rng.standard_t(5, (rows, cols)) / np.sqrt(5 / 3)
    return (w * std * np.exp2(rng.uniform(-1, 1, (rows, 1)))).astype(np.float32)


def quantize(w, qtype):
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    blocks = w.reshape(-1, 256)
    out = _q2_k(blocks) if qtype == T.Q2_K else _iq2_xxs(blocks) if qtype == T.IQ2_XXS else None
    if out is None:
        raise ValueError(f"no reference quantizer for {qtype.name}")
    return out.reshape(rows, -1)


def _f16_bytes(x):
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q2_k(x):
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / 3
    # refine each sub-block's (scale, min) by least squares on its first codes
    q = np.clip(np.rint((sub - lo[..., None]) / np.maximum(scale, 1e-30)[..., None]), 0, 3)
    sq, sqq, sx, sqx = q.sum(-1), (q * q).sum(-1), sub.sum(-1), (q * sub).sum(-1)
    den = 16 * sqq - sq * sq
    ok = den > 0
    s_fit = np.where(ok, (16 * sqx - sq * sx) / np.where(ok, den, 1), scale)
    lo_fit = np.where(ok, (sx - s_fit * sq) / 16, lo)
    good = (s_fit > 0) & (lo_fit <= 0)
    scale, lo = np.where(good, s_fit, scale), np.where(good, lo_fit, lo)
    d = (scale.max(-1) / 15).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / 15).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0, 15)
    m = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 15)
    dl, ml = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint((sub + ml) / np.where(dl > 0, dl, 1)), 0, 3).astype(np.uint8).reshape(n, 2, 4, 32)
    qs = (q << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(2, dtype=np.uint8)  # [n, half, 32]
    scales = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4))
    return np.concatenate([scales, qs.reshape(n, 64), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


_GRID = None


def _grid():
    global _GRID
    if _GRID is None:
        gguf.quants.IQ2_XXS.init_grid()
        _GRID = gguf.quants.IQ2_XXS.grid.reshape(256, 8).astype(np.float32)
    return _GRID


def _nearest(a, grid, g2):
    """Index of the nearest grid row to each row of `a` [N, 8]."""
    return np.argmin(g2[None, :] - 2 * a @ grid.T, axis=1)


def _iq2_xxs(x):
    n = x.shape[0]
    grid = _grid()
    g2 = (grid * grid).sum(1)
    groups = x.reshape(n, 8, 4, 8)  # [block, sub-block, group of 8, 8]
    neg = groups < 0
    a = np.abs(groups)
    odd = neg.sum(-1) % 2 == 1  # the format stores an even count of minus signs: flip the smallest
    flip = odd[..., None] & (np.arange(8) == a.argmin(-1)[..., None])
    neg ^= flip
    a = np.where(flip, -a, a)  # the flipped value now costs its own magnitude twice over
    flat = a.reshape(-1, 8)
    amax = np.maximum(np.abs(groups).reshape(n, 8, 32).max(-1), 1e-30)
    best_err, best_s = None, None
    for top in (20.0, 25.0, 33.0, 43.0):  # the sub-block's largest value lands on this grid level
        s = amax / top
        idx = _nearest((flat / np.repeat(s.reshape(-1), 4)[:, None]), grid, g2)
        g = grid[idx].reshape(n, 8, 32)
        av = a.reshape(n, 8, 32)
        s_ls = np.maximum((av * g).sum(-1) / (g * g).sum(-1), 1e-30)
        err = np.square(s_ls[..., None] * g - av).sum(-1)
        if best_err is None:
            best_err, best_s = err, s_ls
        else:
            take = err < best_err
            best_err, best_s = np.where(take, err, best_err), np.where(take, s_ls, best_s)
    # sub-block scale = d * (0.5 + sc) / 4 with a 4-bit sc
    d = (best_s.max(-1) * 4 / 15.5).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(best_s * 4 / np.where(d > 0, d, 1)[:, None] - 0.5), 0, 15)
    s = np.maximum(d[:, None] * (0.5 + sc) / 4, 1e-30)
    idx = _nearest(flat / np.repeat(s.reshape(-1), 4)[:, None], grid, g2).astype(np.uint32).reshape(n, 8, 4)
    sign7 = (neg.astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(-1, dtype=np.uint32) & 0x7F  # [n, 8, 4]
    w0 = (idx << np.array([0, 8, 16, 24], np.uint32)).sum(-1, dtype=np.uint32)
    w1 = (sign7 << np.array([0, 7, 14, 21], np.uint32)).sum(-1, dtype=np.uint32) | (sc.astype(np.uint32) << 28)
    qs = np.stack([w0, w1], -1).reshape(n, 16).view(np.uint8)
    return np.concatenate([_f16_bytes(d), qs], axis=1)
