"""Reading `deepseek4` GGUF files (one file or llama.cpp's split shards) into MLX layouts, tensor by
tensor and chunk by chunk.

Work happens on row chunks, so memory stays bounded whatever the tensor size. Every GGUF block format
is row-local (a row of `ne0` values is a whole number of blocks), so a chunk of rows converts on its
own. Chunks are read with positioned reads, not through `GGUFReader`'s memmap: pages touched through a
mapping count in the process's RSS until the kernel reclaims them, plain reads do not.

Output dtypes: F32, F16 and BF16 tensors keep their type. Every other tensor either keeps the GGUF's
values exactly or becomes float32: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K keep MLX affine codes of
their bits, group 32 (float16 scales and biases, float32 where float16 does not hold them exactly),
MXFP4 its E8M0 byte scales; tensors of the other types (Q6_K, Q3_K, IQ4_XS, ...: sub-blocks of 16 or
codebooks) and quantized tensors the model keeps in float (router, HC and compressor projections...) are
dequantized to float32. Routed experts are the exception: native GGUF blocks where the runtime computes
them, else requantized to MLX affine (a second rounding, said in `GGUFModel.notice`).
"""

import hashlib
import math
import os
import re
from pathlib import Path

import numpy as np
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGUFReader, GGMLQuantizationType as T

from ds4_mlx.convert import EXPERT_BITS, GROUP_SIZES
from ds4_mlx.models import gguf_blocks, gguf_names

FLOAT_TYPES = {T.F32, T.F16, T.BF16}
# repacked into an MLX format that holds their values exactly (`repack`)
_EXACT_FORMATS = {
    **dict.fromkeys([T.Q8_0], {"group_size": 32, "bits": 8, "mode": "affine"}),
    **dict.fromkeys([T.Q4_0, T.Q4_1, T.Q4_K], {"group_size": 32, "bits": 4, "mode": "affine"}),
    **dict.fromkeys([T.Q5_0, T.Q5_1, T.Q5_K], {"group_size": 32, "bits": 5, "mode": "affine"}),
    T.MXFP4: {"group_size": 32, "bits": 4, "mode": "mxfp4"},
}
EXACT_TYPES = set(_EXACT_FORMATS)
# the other types the `gguf` package dequantizes (16-element sub-blocks, codebooks): MLX cannot hold
# them as they are, so routed experts are requantized to affine and other tensors become float32
REQUANT_TYPES = {T.Q2_K, T.Q3_K, T.Q6_K, T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
                 T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0, T.NVFP4}
# routed experts of these types keep their GGUF blocks as they are (`GGUFSwitchLinear`), unless the user
# asks for affine experts (--expert-bits) or the machine has no native path
NATIVE_TYPES = set(gguf_blocks.CODECS)
_ROUTED_EXPERTS = re.compile(r"\.ffn\.experts\.(gate|up|down)\.weight$")
SUPPORTED = FLOAT_TYPES | EXACT_TYPES | REQUANT_TYPES | {T.I32}

# Matrices the model keeps in float even when the file quantizes them (router, indexer weights,
# compressor projections): small, or read in ways QuantizedLinear does not cover.
_FLOAT_PARAMS = re.compile(r"(\.ffn\.gate|\.indexer\.proj|\.compressor\.(kv|gate))\.weight$")
# Types whose MLX affine form holds every value exactly. The embedding stays quantized in them (its
# rows are dequantized in float32 by `linear.Embedding`); the other parameters the model keeps in
# float are stored in that form too and dequantized to float32 on load (`loader.unpack_floats`), which
# keeps a converted folder near its GGUF's size.
EXACT_AFFINE = {t for t, fmt in _EXACT_FORMATS.items() if fmt["mode"] == "affine"}
# scales d * sc (a float16 times a 6-bit integer) need up to 17 significant bits: float32 from the start
_WIDE_SCALES = {T.Q4_K, T.Q5_K}

CHUNK_ELEMENTS = 1 << 23  # ~32 MB of float32 per chunk: bounded memory, big enough for fast array ops

# safetensors dtype of a float tensor kept as it is in the file (BF16 travels as uint16 in numpy)
_KEPT = {T.F32: ("F32", np.float32), T.F16: ("F16", np.float16), T.BF16: ("BF16", np.uint16), T.I32: ("I32", np.int32)}
SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def keeps_quantized(path: str, ndim: int, qtype) -> bool:
    """Whether a quantized GGUF tensor at model path `path` stays quantized: Linear weights in a type
    MLX holds exactly, the embedding in `EXACT_AFFINE`, routed experts in any type."""
    if path == "embed.weight":
        return qtype in EXACT_AFFINE
    if _ROUTED_EXPERTS.search(path):
        return ndim == 3
    return qtype in EXACT_TYPES and path.endswith(".weight") and ndim in (2, 3) and not _FLOAT_PARAMS.search(path)


class WidenScales(Exception):
    """A chunk's scales or biases do not fit float16: the tensor is redone with float32 ones."""


class TensorPlan:
    """One GGUF tensor: where it goes in the model and how it is converted."""

    def __init__(self, t, path, file, requant_format, native_experts):
        self.name, self.path, self.type, self.file = t.name, path, t.tensor_type, file
        self.shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order: [.., out, in]
        self.cols = self.shape[-1]
        self.rows = math.prod(self.shape[:-1])
        block, size = GGML_QUANT_SIZES[self.type]
        self.row_bytes = self.cols // block * size
        self.offset, self.nbytes = int(t.data_offset), int(t.n_bytes)
        self.quantized = self.type not in FLOAT_TYPES | {T.I32} and keeps_quantized(path, len(self.shape), self.type)
        # stored as codes: quantized in the model, or a float parameter held exactly until load
        self.packed = self.quantized or (self.type in EXACT_AFFINE and self.cols % 32 == 0)
        # of scales and biases: "F32" when float16 does not hold them
        self.scale_dtype = "F32" if self.type in _WIDE_SCALES else "F16"
        self.fmt = None  # {"group_size", "bits", "mode"}, or {"gguf_type"} for native blocks
        self.native = (native_experts and self.type in NATIVE_TYPES and len(self.shape) == 3
                       and bool(_ROUTED_EXPERTS.search(path)))
        if self.native:
            self.fmt = {"gguf_type": gguf_blocks.CODECS[self.type]}
        elif self.packed and not self.quantized:
            self.fmt = dict(_EXACT_FORMATS[self.type])
        elif self.quantized:
            if self.type in REQUANT_TYPES:
                bits, group = requant_format(self.type)
                if self.cols % group:
                    raise ValueError(f"tensor {self.name}: width {self.cols} is not a multiple of group size {group}")
                self.fmt = {"group_size": group, "bits": bits, "mode": "affine"}
            else:
                self.fmt = dict(_EXACT_FORMATS[self.type])

    @property
    def module(self):
        return self.path[: -len(".weight")]

    def array_name(self, part):
        """Name of the stored array `part` ("weight", "scales", "biases"): a quantized module's own, or
        beside a packed float parameter's path."""
        if part == "weight":
            return self.path
        return f"{self.module if self.quantized else self.path}.{part}"

    def record(self, quantization: dict, packed: dict):
        """Note this tensor's format: quantized modules in `quantization`, packed floats in `packed`."""
        if self.quantized:
            quantization[self.module] = dict(self.fmt)
        elif self.packed:
            packed[self.path] = dict(self.fmt)

    def outputs(self):
        """[(param name, safetensors dtype, shape)] this tensor becomes."""
        lead = self.shape[:-1]
        if not self.packed:
            return [(self.path, _KEPT[self.type][0] if self.type in _KEPT else "F32", self.shape)]
        if self.native:
            return [(self.path, "U8", lead + (self.row_bytes,))]
        g, b, mode = self.fmt["group_size"], self.fmt["bits"], self.fmt["mode"]
        out = [(self.path, "U32", lead + (self.cols * b // 32,)),
               (self.array_name("scales"), "U8" if mode == "mxfp4" else self.scale_dtype, lead + (self.cols // g,))]
        if mode == "affine":
            out.append((self.array_name("biases"), self.scale_dtype, lead + (self.cols // g,)))
        return out

    def chunk_rows(self):
        return max(1, CHUNK_ELEMENTS // self.cols)


def split_files(path):
    """The files of a model: one .gguf, all `NAME-0000i-of-0000N.gguf` shards given any of them or
    their folder. Raises ValueError naming what is missing."""
    path = Path(path)
    if path.is_dir():
        firsts = sorted(p for p in path.glob("*-00001-of-*.gguf"))
        if len(firsts) != 1:
            alone = sorted(path.glob("*.gguf"))
            if len(firsts) == 0 and len(alone) == 1:
                return alone
            if not alone:
                raise ValueError(f"{path}: no GGUF files here (and no config.json of a converted model)")
            raise ValueError(f"{path}: expected one set of GGUF shards (NAME-00001-of-0000N.gguf), "
                             f"found {len(firsts) or 'no'} first shards")
        path = firsts[0]
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    n = int(m.group(3))
    files = [path.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{path}: missing shard {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return files


def _open_reader(path):
    try:
        return GGUFReader(str(path), "r")
    except Exception as e:  # gguf raises many types on corrupt or truncated input
        raise ValueError(f"{path}: not a readable GGUF file (corrupt or truncated: {_one_line(e)})") from None


class GGUFModel:
    """A `deepseek4` GGUF model (one file or its split shards). The constructor validates it and
    raises a one-line ValueError naming the file and the problem (unreadable, wrong architecture,
    missing key, tensor or shard, unknown tensor, unsupported type).

    `experts`: "native" keeps routed experts of `NATIVE_TYPES` in their GGUF blocks, "affine" requantizes
    Q2_K / IQ2_XXS ones (and repacks Q4_K ones) to MLX affine; by default native where the machine has a
    native path (`gguf_blocks.native_available`), else affine, with `notice` saying what that costs.
    `expert_bits` / `group_size` choose the affine format (and imply "affine"); by default
    `requant.affine_format`'s."""

    def __init__(self, path, *, expert_bits=None, group_size=None, experts=None):
        from ds4_mlx.convert.requant import affine_format

        self.files = [str(f) for f in split_files(path)]
        self.path = self.files[0]
        readers = [_open_reader(f) for f in self.files]
        self.reader = readers[0]
        try:
            self.metadata = {k: f.contents() for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        except Exception as e:
            raise ValueError(f"{self.path}: corrupt GGUF metadata ({_one_line(e)})") from None
        arch = self.metadata.get("general.architecture")
        if arch != "deepseek4":
            raise ValueError(f"{self.path}: architecture is {arch!r}, expected 'deepseek4'")
        if expert_bits is not None and expert_bits not in EXPERT_BITS:
            raise ValueError(f"--expert-bits must be one of {', '.join(map(str, EXPERT_BITS))}, got {expert_bits}")
        if group_size is not None and group_size not in GROUP_SIZES:
            raise ValueError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")

        if experts not in (None, "native", "affine"):
            raise ValueError(f"--experts must be native or affine, got {experts}")
        if experts == "native" and (expert_bits or group_size):
            raise ValueError("--expert-bits and --group-size choose affine experts: not with --experts native")
        if experts is None:
            experts = "affine" if expert_bits or group_size or not gguf_blocks.native_available() else "native"
        auto_affine = experts == "affine" and not (expert_bits or group_size)

        def requant_format(qtype):
            return affine_format(qtype, expert_bits, group_size)

        found = [(t, f) for r, f in zip(readers, self.files) for t in r.tensors]
        by_name = {t.name: t for t, _ in found}
        embd = by_name.get("token_embd.weight")
        if embd is None:
            raise ValueError(f"{self.path}: missing tensor token_embd.weight")
        try:
            self.args = gguf_names.args_from_gguf(self.metadata, vocab_size=int(embd.shape[1]))
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"{self.path}: {_one_line(e)}") from None
        have = {re.sub(r"\.(weight|bias)$", "", n) for n in by_name}
        for name in gguf_names.expected_gguf_names(self.args):
            if name not in have:
                raise ValueError(f"{self.path}: missing tensor {name}")
        self.tensors = []
        for t, file in found:
            path_ = gguf_names.mlx_name(t.name)
            if path_ is None:
                raise ValueError(f"{file}: unknown tensor {t.name}")
            if t.tensor_type not in SUPPORTED:
                raise ValueError(f"{file}: tensor {t.name} has unsupported type {t.tensor_type.name}")
            try:
                self.tensors.append(TensorPlan(t, path_, file, requant_format, experts == "native"))
            except ValueError as e:
                raise ValueError(f"{file}: {e}") from None
        self.total_bytes = sum(p.nbytes for p in self.tensors)
        requantized = sorted({p.type.name for p in self.tensors
                              if p.quantized and not p.native and p.type in REQUANT_TYPES})
        self.needs_requant = bool(requantized)
        notices = []
        here = [t for t in requantized if T[t] in NATIVE_TYPES]
        if here and auto_affine:
            notices.append(f"{' / '.join(here)} experts have no fast native path on this machine (it needs "
                           "mlx-kquant: pip install 'ds4-mlx[kquant]', macOS 26.2+ on Apple Silicon; or a CUDA GPU): "
                           "requantizing them to MLX affine 2-bit, which adds an error of about 0.3 of each expert's RMS "
                           "(a second rounding); `--experts native` keeps the file's blocks (exact, on a slow "
                           "reference path here)")
        nowhere = [t for t in requantized if T[t] not in NATIVE_TYPES]
        if nowhere:
            notices.append(f"{' / '.join(nowhere)} experts have no native path in ds4-mlx: requantizing them to MLX "
                           "affine (a second rounding; each tensor's error is logged)")
        widened = [p for p in self.tensors if p.type in REQUANT_TYPES and not p.quantized]
        if widened:
            extra = sum(p.rows * p.cols * 4 - p.nbytes for p in widened) / 2**30
            notices.append(f"{len(widened)} tensors in {' / '.join(sorted({p.type.name for p in widened}))} outside "
                           f"the routed experts have no exact MLX layout: kept as float32 (+{extra:.2f} GiB)")
        self.notice = "; ".join(notices) or None

    def fingerprint(self):
        """Names this model's files by size, modification time and a hash of each header (the bytes
        before the first tensor's data), so an edited or replaced file gets a new name."""
        h = hashlib.sha256()
        for f in self.files:
            st = os.stat(f)
            first = min((p.offset for p in self.tensors if p.file == f), default=st.st_size)
            with open(f, "rb") as fh:
                h.update(fh.read(min(first, 1 << 24)))
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return f"{sum(os.path.getsize(f) for f in self.files)}-{h.hexdigest()[:16]}"

    def iter_weights(self, quantization: dict, packed: dict, log=None):
        """Yield (array name, mx.array); record each tensor's format (`TensorPlan.record`)."""
        import mlx.core as mx

        with OpenFiles() as files:
            for plan in self.tensors:
                arrays = {}
                for part in tensor_chunks(files[plan.file], plan, log):
                    if part is None:  # redone with float32 scales
                        arrays = {}
                        continue
                    r0, r1, chunk, _ = part
                    for name, dtype, shape in plan.outputs():
                        if name not in arrays:
                            arrays[name] = np.empty((plan.rows,) + tuple(shape[-1:]), chunk[name].dtype)
                        arrays[name][r0:r1] = chunk[name]
                plan.record(quantization, packed)
                for name, dtype, shape in plan.outputs():
                    a = mx.array(arrays.pop(name).reshape(shape))
                    yield name, mx.view(a, mx.bfloat16) if dtype == "BF16" else a


class OpenFiles(dict):
    """path -> open binary file, opened on first use, all closed on exit."""

    def __missing__(self, path):
        f = self[path] = open(path, "rb")
        return f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self.values():
            f.close()


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


def to_scales(x, dtype, exact):
    """float32 scales or biases -> numpy float16 for "F16", float32 for "F32". Raises WidenScales where
    float16 would overflow or flush a non-zero value to zero, or, when `exact`, change any value."""
    x = np.asarray(x, np.float32)
    if dtype == "F32":
        return x
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    if exact and not np.array_equal(h.astype(np.float32), x):
        raise WidenScales
    if not np.isfinite(h).all() or ((h == 0) & (x != 0)).any():
        raise WidenScales
    return h


def tensor_chunks(f, plan, log=None):
    """`convert_chunks`, redone from the start with float32 scales when float16 does not hold the
    tensor's scales or biases (rare): None comes before the redo, and what came before it is void."""
    try:
        yield from convert_chunks(f, plan, log)
    except WidenScales:
        plan.scale_dtype = "F32"  # holds them all: no second redo
        yield None
        yield from convert_chunks(f, plan, log)


def convert_chunks(f, plan, log=None):
    """Yield (row start, row end, {param name: numpy rows}, raw bytes read) over the tensor.

    For Q2_K / IQ2_XXS the whole tensor's relative RMS error is reported through `log` at the end.
    Raises WidenScales when float16 does not hold a chunk's scales or biases."""
    from ds4_mlx.convert import requant

    err2 = ref2 = 0.0
    step = plan.chunk_rows()
    if plan.type in REQUANT_TYPES and plan.quantized and not plan.native and requant.on_gpu():  # fewer, bigger GPU launches
        step *= 4
    for r0 in range(0, plan.rows, step):
        r1 = min(plan.rows, r0 + step)
        raw = read_rows(f, plan, r0, r1)
        if plan.native:
            yield r0, r1, {plan.path: raw}, raw.nbytes
            continue
        if not plan.packed:
            kept = raw.view(_KEPT[plan.type][1]).reshape(-1, plan.cols) if plan.type in _KEPT \
                else to_float(raw, plan.type, plan.cols)
            yield r0, r1, {plan.path: kept}, raw.nbytes
            continue
        if plan.type in REQUANT_TYPES:
            q, e2, w2 = requant.convert_rows(raw, plan.type, plan.cols, plan.fmt["bits"], plan.fmt["group_size"])
            err2, ref2 = err2 + e2, ref2 + w2
        else:
            q = repack(raw, plan.type, plan.cols)
        if plan.fmt["mode"] == "affine":  # repacked types keep their values exactly
            exact = plan.type in EXACT_TYPES
            q = {k: v if k == "weight" else to_scales(v, plan.scale_dtype, exact) for k, v in q.items()}
        yield r0, r1, {plan.array_name(k): v for k, v in q.items()}, raw.nbytes
    if plan.type in REQUANT_TYPES and plan.quantized and not plan.native and log is not None:
        log(f"{plan.module}: {plan.type.name} -> affine {plan.fmt['bits']}-bit g{plan.fmt['group_size']}, "
            f"relative RMS error {math.sqrt(err2 / max(ref2, 1e-30)):.4f}")


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
# exact repacking: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, MXFP4


def _pack(codes, bits):
    """uint8 codes [rows, n] -> uint32 [rows, n * bits / 32] in MLX's layout: a little-endian bit stream."""
    if bits == 4:
        b = codes[:, 0::2] | (codes[:, 1::2] << 4)
    else:
        b = np.packbits(((codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(codes.shape[0], -1),
                        axis=-1, bitorder="little")
    return np.ascontiguousarray(b).view(np.uint32)


def _f16(b):
    """Two bytes a block (last axis) as float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs):
    """16 bytes a block [..., 16] -> its 32 4-bit codes: elements 0-15 in the low nibbles, 16-31 high."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _high_bits(qh):
    """4 bytes a block [..., 4] -> the fifth bit of its 32 codes (bit j of the little-endian word), as 16 or 0."""
    return (np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little") << 4).astype(np.uint8)


def _k_scales(s):
    """K-quants' 12 bytes of 6-bit scales and mins [..., 12] -> (sc, m) [..., 8] as float32."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def repack(raw, qtype, cols):
    """Rows of an `EXACT_TYPES` type as the arrays `mx.quantize` would give for the same values: codes,
    and scales and biases with scale * code + bias = the value, as ggml computes it."""
    rows, nb = raw.shape[0], cols // 32
    if qtype == T.Q8_0:  # 32 int8 codes, f16 d: w = d*q = d*(q+128) - 128*d
        blocks = raw.reshape(rows, nb, 34)
        d = _f16(blocks[..., :2])
        codes = np.ascontiguousarray(blocks[..., 2:] ^ np.uint8(0x80))  # int8 + 128 as uint8
        return {"weight": codes.reshape(rows, cols).view(np.uint32), "scales": d, "biases": -128.0 * d}
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):  # f16 d [, f16 m] [, 4 bytes of fifth bits], 16 bytes of nibbles
        with_min, five = qtype in (T.Q4_1, T.Q5_1), qtype in (T.Q5_0, T.Q5_1)
        head = 4 if with_min else 2
        blocks = raw.reshape(rows, nb, head + 4 * five + 16)
        d = _f16(blocks[..., :2])
        codes = _nibbles(blocks[..., -16:])
        if five:
            codes = codes | _high_bits(blocks[..., head:head + 4])
        bits = 5 if five else 4
        # w = d*q + m, or d*(q - 2^(bits-1)) = d*q - 2^(bits-1)*d
        bias = _f16(blocks[..., 2:4]) if with_min else -float(2 ** (bits - 1)) * d
        return {"weight": _pack(codes.reshape(rows, cols), bits), "scales": d, "biases": bias}
    if qtype in (T.Q4_K, T.Q5_K):  # 8 sub-blocks of 32: w = d*sc_j*q - dmin*m_j, 6-bit sc/m packed in 12 bytes
        five = qtype == T.Q5_K
        nk = cols // 256
        blocks = raw.reshape(rows, nk, 176 if five else 144)
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        sc, m = _k_scales(blocks[..., 4:16])
        # each 32 bytes hold sub-block 2c in the low nibbles and 2c+1 in the high nibbles; Q5_K's 32 bytes
        # of fifth bits give sub-block j's from bit j of each byte
        qs = blocks[..., 48 if five else 16:].reshape(rows, nk, 4, 1, 32)
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(rows, nk, 8, 32)
        if five:
            qh = blocks[..., 16:48]
            codes = codes | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        return {"weight": _pack(codes.reshape(rows, cols), 5 if five else 4),
                "scales": (d * sc).reshape(rows, nk * 8), "biases": -(dmin * m).reshape(rows, nk * 8)}
    if qtype == T.MXFP4:  # E8M0 byte + 16 bytes: elements 0-15 in low nibbles, 16-31 in high
        blocks = raw.reshape(rows, nb, 17)
        codes = _nibbles(blocks[..., 1:]).reshape(rows, cols)
        # ggml's doubled E2M1 table and half E8M0 cancel, so the scale byte is MLX's as is
        return {"weight": _pack(codes, 4), "scales": np.ascontiguousarray(blocks[..., 0])}
    raise ValueError(f"no exact MLX layout for {qtype.name}")
