"""GGUF weight blocks kept as they are in the file (routed experts in Q2_K, IQ2_XXS, Q4_K), and how they
are computed here.

`dequantize` is the plain definition, in MLX ops: the `gguf` package's values, same operations in the
same order (bit for bit on the CPU). `path()` picks how an expert product runs:
- "kquant": mlx-kquant (`pip install 'ds4-mlx[kquant]'`), its `gather_qmm` on GGUF wire bytes for
  half-precision inputs and its `dequantize` then MLX's product for float32 ones (its products return
  bfloat16 for float32 inputs, which the exact mode cannot take). The default on Metal when installed;
  DS4_MLX_KQUANT=1 forces it on the CPU (where it installs), DS4_MLX_KQUANT=0 turns it off.
- "reference": `dequantize` then MLX's product, on any backend (exact, slow). On CUDA, rows of a few
  tokens (decode) go through a kernel that dequantizes as it reads (`kernels.gguf_rows`) instead, and
  bigger batches dequantize each expert in one launch (`kernels.gguf_dequantize`): the model's
  `GGUFSwitchLinear` picks among them.
"""

import os
from functools import lru_cache

import numpy as np
import mlx.core as mx
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

CODECS = {T.Q2_K: "q2_k", T.IQ2_XXS: "iq2_xxs", T.Q4_K: "q4_k"}  # mlx-kquant's names of the types kept
TYPES = {name: t for t, name in CODECS.items()}


def row_bytes(codec, cols):
    block, size = GGML_QUANT_SIZES[TYPES[codec]]
    return cols // block * size


@lru_cache(maxsize=None)
def kquant():
    """The mlx_kquant module, or None when it is not installed (or does not load with this MLX)."""
    try:
        import mlx_kquant
    except Exception:  # ImportError, or a build against another MLX that fails to load
        return None
    return mlx_kquant


def path():
    """"kquant" or "reference" (see the module's docstring), for the default device."""
    forced = os.environ.get("DS4_MLX_KQUANT")
    if forced == "0" or kquant() is None:
        return "reference"
    if forced == "1" or (mx.default_device() == mx.gpu and mx.metal.is_available()):
        return "kquant"
    return "reference"


def native_available():
    """Whether this machine computes GGUF-block experts at a usable speed: mlx-kquant installed, or a
    CUDA GPU (dequantize-then-product there). Elsewhere only the slow reference path would."""
    return kquant() is not None or mx.cuda.is_available()


_NO_SCALES = None


def placeholder_scales():
    global _NO_SCALES
    if _NO_SCALES is None:  # mlx-kquant reads scales from the wire bytes; its `scales` argument is unused
        _NO_SCALES = mx.zeros((1,), mx.float16)
        mx.eval(_NO_SCALES)
    return _NO_SCALES


# where each type's float16 block scales sit, and the scale that gives values of about 1/sqrt(width)
# times the given factor (random codes: IQ2_XXS values average ~40 d, Q2_K's d * sc * q ~11 d)
_BLOCK_SCALES = {"iq2_xxs": [(0, 1 / 40)], "q2_k": [(80, 1 / 11), (82, 1 / 22)]}


def random_blocks(codec, shape, seed):
    """Valid random blocks of `codec` (IQ2_XXS or Q2_K), uint8 `shape` [..., rows, row bytes], drawn in
    MLX: random codes (every byte pattern is valid in these types), block scales set so the values have
    about 1/sqrt(width). For benchmarks and the kernels' self-checks."""
    size = row_bytes(codec, 256)
    width = shape[-1] // size * 256
    raw = mx.random.randint(0, 256, (*shape[:-1], shape[-1] // size, size), dtype=mx.uint16,
                            key=mx.random.key(seed)).astype(mx.uint8)
    parts, at = [], 0
    for offset, factor in _BLOCK_SCALES[codec]:
        scale = mx.full(raw.shape[:-1] + (1,), factor / np.sqrt(width), mx.float16)
        parts += [raw[..., at:offset], mx.view(scale, mx.uint8)]
        at = offset + 2
    parts.append(raw[..., at:])
    return mx.concatenate(parts, axis=-1).reshape(shape)


# ---------------------------------------------------------------------------------------------
# The plain definitions


@lru_cache(maxsize=None)
def _iq2xxs_source():
    """IQ2_XXS's lattice (numpy float32 [256, 8]) and its 128 sign bytes, from the `gguf` package."""
    gguf.quants.IQ2_XXS.init_grid()
    return (gguf.quants.IQ2_XXS.grid.reshape(256, 8).astype(np.float32),
            np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8))


@lru_cache(maxsize=None)
def _iq2xxs_tables():
    """IQ2_XXS's lattice [256, 8] and sign patterns [128, 8] (+-1 a value)."""
    lattice, ksigns = _iq2xxs_source()
    bits = (ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    grid, signs = mx.array(lattice), mx.array(np.where(bits == 0, 1.0, -1.0).astype(np.float32))
    mx.eval(grid, signs)
    return grid, signs


@lru_cache(maxsize=None)
def iq2xxs_kernel_tables(packed=False):
    """IQ2_XXS's lattice (float32 [256 * 8]; `packed`: its values as uint8, which they all fit) and its 128
    sign bytes (uint8), as kernel inputs."""
    lattice, ksigns = _iq2xxs_source()
    lattice = lattice.reshape(-1)
    grid, ksigns = mx.array(lattice.astype(np.uint8) if packed else lattice), mx.array(ksigns)
    mx.eval(grid, ksigns)
    return grid, ksigns


def _f16(b):
    """uint8 [..., 2] -> float32 [...]."""
    return mx.view(b, mx.float16)[..., 0].astype(mx.float32)


def dequantize(raw, codec):
    """uint8 blocks (numpy or mx) [..., row bytes] -> float32 mx [..., cols], the values
    `gguf.quants.dequantize` gives (same operations in the same order)."""
    raw = mx.array(raw)
    lead, nbytes = raw.shape[:-1], raw.shape[-1]
    qtype = TYPES[codec]
    block, size = GGML_QUANT_SIZES[qtype]
    cols = nbytes // size * block
    b = raw.reshape(-1, nbytes // size, size)
    rows = b.shape[0]
    if qtype == T.Q2_K:  # scales[16] (low nibble sc, high nibble m), qs[64], d, dmin
        sc, qs = b[..., :16], b[..., 16:80]
        d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
        dl = (d * (sc & 0xF).astype(mx.float32))[..., None]
        ml = (dmin * (sc >> 4).astype(mx.float32))[..., None]
        shift = mx.array([0, 2, 4, 6], mx.uint8).reshape(4, 1)
        q = (qs.reshape(rows, -1, 2, 1, 32) >> shift) & 3  # [.., half, shift, 32]
        q = q.reshape(rows, -1, 16, 16).astype(mx.float32)
        out = dl * q - ml
    elif qtype == T.IQ2_XXS:  # d, then 8 sub-blocks of (4 grid indices, 4 x 7 sign bits + 4-bit scale)
        grid, signs = _iq2xxs_tables()
        d = _f16(b[..., :2])
        qs = mx.view(b[..., 2:], mx.uint32).reshape(rows, -1, 8, 2)
        db = d[..., None] * (0.5 + (qs[..., 1] >> 28).astype(mx.float32)) * 0.25
        s = (qs[..., 1:2] >> mx.array([0, 7, 14, 21], mx.uint32)) & 0x7F  # [.., 8, 4]
        idx = mx.view(qs[..., 0], mx.uint8).reshape(rows, -1, 8, 4)
        out = db[..., None, None] * grid[idx.astype(mx.uint32)] * signs[s]
    elif qtype == T.Q4_K:  # d, dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32, 128 bytes of nibbles
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        s = b[..., 4:16]
        sc = mx.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        m = mx.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        dl = (d * sc.astype(mx.float32))[..., None]
        ml = (dmin * m.astype(mx.float32))[..., None]
        q = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> mx.array([0, 4], mx.uint8).reshape(2, 1)
        q = (q & 0xF).reshape(rows, -1, 8, 32).astype(mx.float32)
        out = dl * q - ml
    else:
        raise ValueError(f"no MLX dequantizer for {qtype.name}")
    return out.reshape(*lead, cols)
