"""Reading `deepseek4` GGUF files into MLX layouts, tensor by tensor and chunk by chunk.

Everything is numpy on row chunks, so memory stays bounded whatever the tensor size. Every GGUF block
format is row-local (a row of `ne0` values is a whole number of blocks), so a chunk of rows converts
on its own. Chunks are read with positioned reads, not through `GGUFReader`'s memmap: pages touched
through a mapping count in the process's RSS until the kernel reclaims them, plain reads do not.
"""

import math
import os
import re

import numpy as np
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGUFReader, GGMLQuantizationType as T

from ds4_mlx.models import deepseek_v4 as dsv4

FLOAT_TYPES = {T.F32, T.F16, T.BF16}
EXACT_TYPES = {T.Q8_0, T.Q4_K, T.MXFP4}  # repacked bit for bit into an MLX format
REQUANT_TYPES = {T.Q2_K, T.IQ2_XXS}  # 16-element sub-blocks / codebooks: MLX cannot hold them as is
SUPPORTED = FLOAT_TYPES | EXACT_TYPES | REQUANT_TYPES | {T.I32}
# MLX affine formats tried for Q2_K / IQ2_XXS, smallest first: (bits, group size)
REQUANT_CANDIDATES = [(2, 64), (2, 32), (3, 64), (3, 32)]

# Matrices the model keeps in float even when the file quantizes them (router, indexer weights,
# compressor projections, embedding): small, or read in ways QuantizedLinear does not cover.
_FLOAT_PARAMS = re.compile(r"(^embed|\.ffn\.gate|\.indexer\.proj|\.compressor\.(kv|gate))\.weight$")

CHUNK_ELEMENTS = 1 << 23  # ~32 MB of float32 per chunk: bounded memory, big enough for numpy speed


def keeps_quantized(path: str, ndim: int) -> bool:
    """Whether a quantized GGUF tensor at model path `path` stays quantized (Linear or expert weights)."""
    return path.endswith(".weight") and ndim in (2, 3) and not _FLOAT_PARAMS.search(path)


class TensorPlan:
    """One GGUF tensor: where it goes in the model and how it is converted."""

    def __init__(self, t, path):
        self.name, self.path, self.type = t.name, path, t.tensor_type
        self.shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order: [.., out, in]
        self.cols = self.shape[-1]
        self.rows = math.prod(self.shape[:-1])
        block, size = GGML_QUANT_SIZES[self.type]
        self.row_bytes = self.cols // block * size
        self.offset, self.nbytes = int(t.data_offset), int(t.n_bytes)
        self.quantized = self.type not in FLOAT_TYPES | {T.I32} and keeps_quantized(path, len(self.shape))
        self.fmt = None  # {"group_size", "bits", "mode"} once chosen
        if self.quantized and self.type not in REQUANT_TYPES:
            self.fmt = _EXACT_FORMATS[self.type]

    @property
    def module(self):
        return self.path[: -len(".weight")]

    def outputs(self):
        """[(param name, numpy dtype, shape)] this tensor becomes (needs `fmt` chosen)."""
        lead = self.shape[:-1]
        if not self.quantized:
            return [(self.path, np.int32 if self.type == T.I32 else np.float32, self.shape)]
        g, b, mode = self.fmt["group_size"], self.fmt["bits"], self.fmt["mode"]
        out = [(self.module + ".weight", np.uint32, lead + (self.cols * b // 32,)),
               (self.module + ".scales", np.uint8 if mode == "mxfp4" else np.float32, lead + (self.cols // g,))]
        if mode == "affine":
            out.append((self.module + ".biases", np.float32, lead + (self.cols // g,)))
        return out

    def output_names(self):
        """Names of `outputs()`, known before a Q2_K / IQ2_XXS format is chosen."""
        if not self.quantized:
            return [self.path]
        affine = self.fmt is None or self.fmt["mode"] == "affine"
        return [self.module + s for s in (".weight", ".scales", ".biases")[: 3 if affine else 2]]

    def chunk_rows(self):
        return max(1, CHUNK_ELEMENTS // self.cols)


_EXACT_FORMATS = {
    T.Q8_0: {"group_size": 32, "bits": 8, "mode": "affine"},
    T.Q4_K: {"group_size": 32, "bits": 4, "mode": "affine"},
    T.MXFP4: {"group_size": 32, "bits": 4, "mode": "mxfp4"},
}


class GGUFModel:
    """A `deepseek4` GGUF file. The constructor validates it and raises a one-line ValueError
    naming the file and the problem (unreadable, wrong architecture, missing key or tensor,
    unknown tensor, unsupported type)."""

    def __init__(self, path):
        self.path = str(path)
        try:
            self.reader = GGUFReader(self.path, "r")
        except Exception as e:  # gguf raises many types on corrupt or truncated input
            raise ValueError(f"{path}: not a readable GGUF file (corrupt or truncated: {_one_line(e)})") from None
        try:
            self.metadata = {k: f.contents() for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        except Exception as e:
            raise ValueError(f"{path}: corrupt GGUF metadata ({_one_line(e)})") from None
        arch = self.metadata.get("general.architecture")
        if arch != "deepseek4":
            raise ValueError(f"{path}: architecture is {arch!r}, expected 'deepseek4'")
        by_name = {t.name: t for t in self.reader.tensors}
        embd = by_name.get("token_embd.weight")
        if embd is None:
            raise ValueError(f"{path}: missing tensor token_embd.weight")
        try:
            self.args = dsv4.args_from_gguf(self.metadata, vocab_size=int(embd.shape[1]))
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"{path}: {_one_line(e)}") from None
        have = {re.sub(r"\.(weight|bias)$", "", n) for n in by_name}
        for name in dsv4.expected_gguf_names(self.args):
            if name not in have:
                raise ValueError(f"{path}: missing tensor {name}")
        self.tensors = []
        for t in self.reader.tensors:
            path_ = dsv4.mlx_name(t.name)
            if path_ is None:
                raise ValueError(f"{path}: unknown tensor {t.name}")
            if t.tensor_type not in SUPPORTED:
                raise ValueError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")
            self.tensors.append(TensorPlan(t, path_))
        self.total_bytes = sum(p.nbytes for p in self.tensors)

    def iter_weights(self, quantization: dict, log=None):
        """Yield (param path, mx.array); record each quantized module's format in `quantization`."""
        import mlx.core as mx

        with open(self.path, "rb") as f:
            for plan in self.tensors:
                arrays = {}
                for r0, r1, chunk, _ in convert_chunks(f, plan, log):
                    for name, dtype, shape in plan.outputs():
                        if name not in arrays:
                            arrays[name] = np.empty((plan.rows,) + tuple(shape[-1:]), dtype)
                        arrays[name][r0:r1] = chunk[name]
                if plan.quantized:
                    quantization[plan.module] = dict(plan.fmt)
                for name, dtype, shape in plan.outputs():
                    yield name, mx.array(arrays.pop(name).reshape(shape))


def _one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


def read_rows(f, plan, r0, r1):
    """Raw bytes of rows [r0, r1) as uint8 [r1 - r0, row_bytes]."""
    n = (r1 - r0) * plan.row_bytes
    buf = np.empty(n, np.uint8)
    f.seek(plan.offset + r0 * plan.row_bytes)
    if f.readinto(memoryview(buf)) != n:
        raise ValueError(f"tensor {plan.name}: data extends past the end of the file")
    return buf.reshape(r1 - r0, plan.row_bytes)


def convert_chunks(f, plan, log=None):
    """Yield (row start, row end, {param name: numpy rows}, raw bytes read) over the tensor.

    For Q2_K / IQ2_XXS it first picks the MLX format on a sample of rows and reports the measured
    error of the whole tensor through `log` at the end."""
    if plan.quantized and plan.fmt is None:
        plan.fmt, errors = choose_requant_format(f, plan)
    err2 = ref2 = 0.0
    step = plan.chunk_rows()
    for r0 in range(0, plan.rows, step):
        r1 = min(plan.rows, r0 + step)
        raw = read_rows(f, plan, r0, r1)
        if not plan.quantized:
            yield r0, r1, {plan.path: to_float(raw, plan.type, plan.cols)}, raw.nbytes
            continue
        if plan.type in REQUANT_TYPES:
            w = to_float(raw, plan.type, plan.cols)
            q = requantize(w, plan.fmt["bits"], plan.fmt["group_size"])
            err2 += _sq_err(w, q, plan.fmt)
            ref2 += float(np.square(w, dtype=np.float64).sum())
        else:
            q = repack(raw, plan.type, plan.cols)
        yield r0, r1, {plan.module + "." + k: v for k, v in q.items()}, raw.nbytes
    if plan.type in REQUANT_TYPES and plan.quantized and log is not None:
        tried = ", ".join(f"{b}-bit g{g} {e:.4f}" for (b, g), e in errors.items())
        log(f"{plan.module}: {plan.type.name} -> affine {plan.fmt['bits']}-bit g{plan.fmt['group_size']}, "
            f"relative RMS error {math.sqrt(err2 / max(ref2, 1e-30)):.4f} (sampled: {tried})")


# ----------------------------------------------------------------------------------------------
# float and integer tensors


def to_float(raw, qtype, cols):
    """Rows of any supported type as float32 [rows, cols] (I32 stays int32)."""
    if qtype == T.F32:
        return raw.view(np.float32).reshape(-1, cols)
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32).reshape(-1, cols)
    if qtype == T.BF16:  # bf16 is the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, cols)
    if qtype == T.I32:
        return raw.view(np.int32).reshape(-1, cols)
    return gguf.quants.dequantize(raw, qtype).reshape(-1, cols)


# ----------------------------------------------------------------------------------------------
# exact repacking: Q8_0, Q4_K, MXFP4


def _pack4(codes):
    """uint8 4-bit codes [rows, n] -> uint32 [rows, n / 8], element 0 in the low bits (MLX order)."""
    b = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.ascontiguousarray(b).view(np.uint32)


def _f16(b):
    """Two bytes a block (last axis) as float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def repack(raw, qtype, cols):
    """Rows of Q8_0 / Q4_K / MXFP4 as the arrays `mx.quantize` would give for the same values."""
    rows = raw.shape[0]
    if qtype == T.Q8_0:  # 32 int8 codes, f16 d: w = d*q = d*(q+128) - 128*d
        blocks = raw.reshape(rows, cols // 32, 34)
        d = _f16(blocks[..., :2])
        codes = np.ascontiguousarray(blocks[..., 2:] ^ np.uint8(0x80))  # int8 + 128 as uint8
        return {"weight": codes.reshape(rows, cols).view(np.uint32), "scales": d, "biases": -128.0 * d}
    if qtype == T.Q4_K:  # 8 sub-blocks of 32: w = d*sc_j*q - dmin*m_j, 6-bit sc/m packed in 12 bytes
        nb = cols // 256
        blocks = raw.reshape(rows, nb, 144)
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        s = blocks[..., 4:16].astype(np.uint8)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = blocks[..., 16:].reshape(rows, nb, 4, 1, 32)
        # each 32 bytes hold sub-block 2c in the low nibbles and 2c+1 in the high nibbles
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(rows, cols)
        return {"weight": _pack4(codes), "scales": (d * sc.astype(np.float32)).reshape(rows, nb * 8),
                "biases": -(dmin * m.astype(np.float32)).reshape(rows, nb * 8)}
    if qtype == T.MXFP4:  # E8M0 byte + 16 bytes: elements 0-15 in low nibbles, 16-31 in high
        blocks = raw.reshape(rows, cols // 32, 17)
        qs = blocks[..., 1:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)
        # ggml's doubled E2M1 table and half E8M0 cancel, so the scale byte is MLX's as is
        return {"weight": _pack4(codes), "scales": np.ascontiguousarray(blocks[..., 0])}
    raise ValueError(f"no exact MLX layout for {qtype.name}")


# ----------------------------------------------------------------------------------------------
# Q2_K / IQ2_XXS: dequantize, then requantize to MLX affine


def pack_bits(codes, bits):
    """uint8 codes [rows, n] -> uint32 [rows, n * bits / 32]: MLX packs a little-endian bit stream."""
    b = np.unpackbits(codes[..., None], axis=-1, bitorder="little")[..., :bits]
    return np.packbits(b.reshape(codes.shape[0], -1), axis=-1, bitorder="little").view(np.uint32)


def requantize(w, bits, group_size):
    """Float rows -> MLX affine arrays, fitted by least squares rather than min/max.

    The source formats put few distinct levels in a group (IQ2_XXS: +-8, 25, 43 times a scale), so
    spanning the group's range with fewer than 2^bits - 1 steps, then refitting scale and bias to
    the codes, often lands on those levels; each group keeps its best try."""
    rows = w.shape[0]
    x = w.reshape(-1, group_size).astype(np.float32)
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    top = 2**bits - 1
    best = None
    for steps in range(top, (top + 1) // 2 - 1, -1):
        s = np.maximum((hi - lo) / steps, 1e-30)
        b = lo
        for _ in range(2):  # round, then least-squares (scale, bias) for those codes
            q = np.clip(np.rint((x - b) / s), 0, top)
            n, sq, sx = group_size, q.sum(1, keepdims=True), x.sum(1, keepdims=True)
            den = n * (q * q).sum(1, keepdims=True) - sq * sq
            ok = den > 0
            s_new = np.where(ok, (n * (q * x).sum(1, keepdims=True) - sq * sx) / np.where(ok, den, 1), s)
            b = np.where(ok, (sx - s_new * sq) / n, b)
            s = np.where(s_new > 0, s_new, s)
        q = np.clip(np.rint((x - b) / s), 0, top)
        err = np.square(s * q + b - x).sum(1)
        if best is None:
            best = [err, q, s, b]
        else:
            better = err < best[0]
            for i, v in enumerate((err, q, s, b)):
                best[i] = np.where(better[:, None] if v.ndim == 2 else better, v, best[i])
    _, q, s, b = best
    return {"weight": pack_bits(q.astype(np.uint8).reshape(rows, -1), bits),
            "scales": s.reshape(rows, -1).astype(np.float32), "biases": b.reshape(rows, -1).astype(np.float32)}


def dequantize_affine(q, group_size, bits):
    import mlx.core as mx

    return np.array(mx.dequantize(mx.array(q["weight"]), mx.array(q["scales"]), mx.array(q["biases"]),
                                  group_size=group_size, bits=bits))


def _sq_err(w, q, fmt):
    d = dequantize_affine(q, fmt["group_size"], fmt["bits"]) - w
    return float(np.square(d, dtype=np.float64).sum())


def choose_requant_format(f, plan, sample_rows=256):
    """The affine format with the lowest error on rows spread over the tensor (all experts).

    More bits always help, so this is 3-bit unless the tensor's width rules a group out; the
    measurement is kept for the log. Returns (fmt, {(bits, group): relative RMS error})."""
    idx = np.unique(np.linspace(0, plan.rows - 1, min(plan.rows, sample_rows)).astype(np.int64))
    w = np.concatenate([to_float(read_rows(f, plan, i, i + 1), plan.type, plan.cols) for i in idx])
    ref = max(float(np.square(w, dtype=np.float64).sum()), 1e-30)
    errors = {}
    for bits, g in REQUANT_CANDIDATES:
        if plan.cols % g == 0:
            errors[(bits, g)] = math.sqrt(_sq_err(w, requantize(w, bits, g), {"group_size": g, "bits": bits}) / ref)
    bits, g = min(errors, key=lambda k: (errors[k], k))
    return {"group_size": g, "bits": bits, "mode": "affine"}, errors
