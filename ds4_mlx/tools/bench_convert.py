"""Convert benchmark: a synthetic `deepseek4` GGUF at real V4 Flash widths, converted in a child process.

Reports throughput and the child's peak RSS against the bound (2 GB + the largest tensor).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

_PATTERN_BYTES = 1 << 26  # one 64 MB block pattern, repeated: content does not matter for speed


def tensor_type(name, shape, experts):
    """The type a published V4 Flash GGUF gives tensor `name`; `experts` = (gate/up type, down type).
    Attention projections, shared experts and head Q8_0; the rest F16 (matrices) or F32."""
    from gguf import GGMLQuantizationType as T

    base = name.rsplit(".", 1)[0].split(".", 2)[-1]
    if base in ("ffn_gate_exps", "ffn_up_exps"):
        return experts[0]
    if base == "ffn_down_exps":
        return experts[1]
    if base.startswith("attn_") and base[5:] in ("q_a", "q_b", "kv", "output_a", "output_b") \
            or base.endswith("shexp") or base == "output":
        return T.Q8_0
    if base == "ffn_gate_tid2eid":
        return T.I32
    return T.F16 if len(shape) > 1 else T.F32


def _plan(size_gb):
    """(args, {name: (numpy shape, type)}): real widths, layers added until the file reaches size_gb.
    Experts: gate/up Q4_K, down MXFP4; attention, shared experts and head Q8_0; the rest F16/F32."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from ds4_mlx.models.args import ModelArgs
    from ds4_mlx.demo import gguf_shapes

    layers = 1
    while True:
        ratios = [[0, 4, 128][i % 3] for i in range(layers)]
        args = ModelArgs(num_hidden_layers=layers, compress_ratios=ratios, num_hash_layers=1)
        plan = {name: (shape, tensor_type(name, shape, (T.Q4_K, T.MXFP4)))
                for name, shape in gguf_shapes(args).items()}
        nbytes = {n: int(np.prod(s)) * GGML_QUANT_SIZES[t][1] // GGML_QUANT_SIZES[t][0] for n, (s, t) in plan.items()}
        if sum(nbytes.values()) >= size_gb * 1e9:
            return args, plan, nbytes
        layers += 1


def _pattern(qtype, row_bytes, rng):
    """About 64 MB of valid rows of `qtype` (sane scales, random codes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    rows = max(1, _PATTERN_BYTES // row_bytes)
    raw = rng.integers(0, 256, (rows, row_bytes // size, size), dtype=np.uint8)
    if qtype in (T.Q8_0, T.Q4_K):
        raw[..., 0:2] = np.array([0.002], np.float16).view(np.uint8)
    if qtype == T.Q4_K:
        raw[..., 2:4] = np.array([0.01], np.float16).view(np.uint8)
    if qtype == T.MXFP4:
        raw[..., 0] = 120
    if qtype in (T.F16, T.F32, T.I32):  # plain values, small and finite
        dt = {T.F16: np.float16, T.F32: np.float32, T.I32: np.int32}[qtype]
        vals = (rng.standard_normal(rows * row_bytes // np.dtype(dt).itemsize) * 0.02)
        if qtype == T.I32:
            vals = rng.integers(0, 256, vals.shape)
        return vals.astype(dt).view(np.uint8).reshape(rows, row_bytes)
    return raw.reshape(rows, row_bytes)


def write_synthetic_gguf(path, size_gb=4.0, seed=0):
    """Write the synthetic file tensor by tensor (bounded memory). Returns (bytes, largest tensor bytes)."""
    from gguf import GGML_QUANT_SIZES, GGUFWriter, GGMLQuantizationType as T

    from ds4_mlx.tools.testing import _add_metadata, gguf_metadata

    args, plan, nbytes = _plan(size_gb)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "deepseek4")
    for k, v in gguf_metadata(args).items():
        _add_metadata(w, k, v)
    for name, (shape, t) in plan.items():
        if t in (T.F16, T.F32, T.I32):
            w.add_tensor_info(name, shape, {T.F16: np.float16, T.F32: np.float32, T.I32: np.int32}[t], nbytes[name])
        else:
            row = shape[-1] // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1]
            w.add_tensor_info(name, tuple(shape[:-1]) + (row,), np.uint8, nbytes[name], raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    w.write_padding(f, f.tell())
    patterns = {}
    for name, (shape, t) in plan.items():
        row = nbytes[name] // int(np.prod(shape[:-1]))
        key = (t, row)
        if key not in patterns:
            patterns[key] = _pattern(t, row, rng)
        pat, left = patterns[key].reshape(-1), nbytes[name]
        while left:
            n = min(left, pat.size)
            f.write(memoryview(pat[:n]))
            left -= n
        w.write_padding(f, nbytes[name])
    w.close()
    return sum(nbytes.values()), max(nbytes.values())


def bench_convert(size_gb=4.0, workdir=None) -> dict:
    """Write a synthetic GGUF of at least `size_gb` GB, convert it in a child process, clean up.

    Returns {gguf_gb, largest_tensor_gb, output_gb, write_s, convert_s, mb_per_s, peak_rss_gb,
    rss_bound_gb, within_bound}. MB/s is GGUF bytes read per second of conversion."""
    folder = tempfile.mkdtemp(prefix="ds4-bench-convert-", dir=workdir)
    try:
        src, out = os.path.join(folder, "synthetic.gguf"), os.path.join(folder, "out")
        t0 = time.perf_counter()
        total, largest = write_synthetic_gguf(src, size_gb)
        write_s = time.perf_counter() - t0
        code = ("import sys; from ds4_mlx.convert.cli import convert; "
                "convert(sys.argv[1], sys.argv[2], progress=False, log=lambda m: None)")
        t0 = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-c", code, src, out], stdout=2, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(child.pid, 0)
        convert_s = time.perf_counter() - t0
        err = child.stderr.read().decode(errors="replace").strip()
        child.stderr.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"convert failed: {err.splitlines()[-1] if err else status}")
        out_bytes = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
        peak = usage.ru_maxrss * 1024  # Linux reports KiB
        bound = 2e9 + largest
        return {"gguf_gb": round(total / 1e9, 3), "largest_tensor_gb": round(largest / 1e9, 3),
                "output_gb": round(out_bytes / 1e9, 3), "write_s": round(write_s, 1),
                "convert_s": round(convert_s, 1), "mb_per_s": round(total / 1e6 / convert_s, 1),
                "peak_rss_gb": round(peak / 1e9, 3), "rss_bound_gb": round(bound / 1e9, 3),
                "within_bound": peak <= bound}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# the published q2 / q4 files: converted size projected from real-width tensors, error, speed

PUBLISHED = {"q2": ("IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K")}  # routed experts' (gate/up, down) types
# V4 PRO's files, which only several machines hold (docs/distributed.md): its q2 (ds4's
# DeepSeek-V4-Pro-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-Instruct-imatrix-0813.gguf) and its q4, split in two shards
PUBLISHED.update({"pro_q2": PUBLISHED["q2"], "pro_q4": PUBLISHED["q4"]})
RATIO_TARGETS = {"q2": 1.02, "q4": 1.02}  # converted size / GGUF size, native experts


# V4 Flash 0731's files, each `NAME-0731.gguf`: their routed experts' (gate/up, down) types; ds4f-q2-q4
# has Q4_K experts in its last `_Q4_LAYERS` layers (37-42 of 43) and q2's elsewhere. The other tensors
# are as `tensor_type` says for every file.
FILES_0731 = {"ds4f-q2": ("IQ2_XXS", "Q2_K"), "ds4f-q2-q4": ("IQ2_XXS", "Q2_K"), "ds4f-q4": ("Q4_K", "Q4_K"),
              "ds4f-mxfp4": ("MXFP4", "MXFP4")}
_Q4_LAYERS = 6


def experts_0731(file, layer, layers):
    """The (gate/up, down) type names of layer `layer`'s routed experts, of `layers`, in 0731 file `file`."""
    if file == "ds4f-q2-q4" and layer >= layers - _Q4_LAYERS:
        return FILES_0731["ds4f-q4"]
    return FILES_0731[file]


def file_types(file, args):
    """{GGUF tensor name: (numpy shape, type)} of 0731 file `file` for a model of `args`."""
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.demo import gguf_shapes

    out = {}
    for name, shape in gguf_shapes(args).items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        experts = tuple(T[n] for n in experts_0731(file, layer, args.num_hidden_layers))
        out[name] = (shape, tensor_type(name, shape, experts))
    return out


def expert_paths(types) -> dict:
    """{"metal", "cuda", "cpu"}: how routed experts of these GGUF type names run there by default
    (`GGUFModel`): the file's blocks where the backend has a native path for them, else MLX formats."""
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.convert.gguf import EXACT_TYPES, NATIVE_TYPES, _EXACT_FORMATS
    from ds4_mlx.convert.requant import affine_format

    def in_mlx(t):
        if T[t] in EXACT_TYPES:
            fmt = _EXACT_FORMATS[T[t]]
            return f"MLX {fmt['mode']} {fmt['bits']}-bit (exact)"
        bits, group = affine_format(T[t])
        return f"MLX affine {bits}-bit g{group} (requantized)"

    blocks = "file's blocks (exact)"
    ways = {"metal": lambda t: f"{blocks} with the kquant extra, else {in_mlx(t)}" if T[t] in NATIVE_TYPES
            else in_mlx(t),
            "cuda": lambda t: blocks if T[t] in NATIVE_TYPES else in_mlx(t),
            "cpu": in_mlx}
    out = {}
    for backend, way in ways.items():
        said = {}  # phrase -> the types it covers, in order
        for t in types:
            said.setdefault(way(t), []).append(t)
        out[backend] = "; ".join(f"{', '.join(ts)}: {phrase}" for phrase, ts in said.items())
    return out


def project_file(file, args=None) -> dict:
    """0731 file `file`'s size and its converted folder's, from the converter's own plan of each tensor
    (`TensorPlan`: exact, headers aside): with native experts (Metal with the kquant extra, CUDA) and
    with affine ones (the CPU, Metal without it), and `experts`: the path they take on each backend."""
    from types import SimpleNamespace

    from gguf import GGML_QUANT_SIZES

    from ds4_mlx.convert.gguf import TensorPlan
    from ds4_mlx.convert.requant import affine_format
    from ds4_mlx.convert.writer import ITEMSIZE
    from ds4_mlx.models.args import ModelArgs
    from ds4_mlx.models.gguf_names import mlx_name

    args = args or ModelArgs()
    gguf_bytes, folder = 0, {True: 0, False: 0}
    experts = set()
    for name, (shape, t) in file_types(file, args).items():
        block, size = GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(shape)) // block * size
        gguf_bytes += nbytes
        if "_exps." in name:
            experts.add(t.name)
        tensor = SimpleNamespace(name=name, tensor_type=t, shape=np.array(shape[::-1]), data_offset=0, n_bytes=nbytes)
        for native in folder:
            plan = TensorPlan(tensor, mlx_name(name), None, affine_format, native)
            folder[native] += sum(ITEMSIZE[dtype] * int(np.prod(out)) for _, dtype, out in plan.outputs())
    order = [t for t in ("IQ2_XXS", "Q2_K", "Q4_K", "MXFP4") if t in experts]
    return {"file": f"{file}-0731", "gguf_gib": round(gguf_bytes / 2**30, 2),
            "native_gib": round(folder[True] / 2**30, 2), "native_ratio": round(folder[True] / gguf_bytes, 4),
            "affine_gib": round(folder[False] / 2**30, 2), "affine_ratio": round(folder[False] / gguf_bytes, 4),
            "experts": expert_paths(order)}


def published_weights(variant):
    """{type name: weights} of the published file (every other tensor as `tensor_type` says)."""
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.models.args import ModelArgs
    from ds4_mlx.demo import gguf_shapes

    from ds4_mlx.models.variants import pro_args

    experts = tuple(T[n] for n in PUBLISHED[variant])
    counts = {}
    for name, shape in gguf_shapes(pro_args() if variant.startswith("pro") else ModelArgs()).items():
        t = tensor_type(name, shape, experts).name
        counts[t] = counts.get(t, 0) + int(np.prod(shape))
    return counts


def _source_rows(qtype, rows, cols, rng):
    """GGUF rows of `qtype` at a real width: the reference quantizer's codes for heavy-tailed weights
    (Q2_K, IQ2_XXS), the gguf package's quantizer (Q8_0), valid random blocks (Q4_K: no quantizer)."""
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.convert import reference_quant as Q

    if qtype in (T.Q2_K, T.IQ2_XXS):
        return Q.quantize(Q.realistic_weights(rows, cols, rng), qtype)
    if qtype == T.Q8_0:
        return gguf.quants.quantize(Q.realistic_weights(rows, cols, rng), qtype)
    return _pattern(qtype, cols // 256 * 144, rng)[:rows]


def measure_types(rows=2048, cols=4096, seed=0, expert_bits=None, group_size=None):
    """Per quantized type: bytes a weight once converted, relative RMS error against the gguf
    package's dequantization, and weights converted a second (raw bytes in, stored arrays out)."""
    import gguf.quants
    import mlx.core as mx
    from gguf import GGMLQuantizationType as T

    from ds4_mlx.convert import gguf as G, requant

    rng = np.random.default_rng(seed)
    out = {}
    for qtype in (T.IQ2_XXS, T.Q2_K, T.Q4_K, T.Q8_0):
        raw = _source_rows(qtype, rows, cols, rng)
        ref = gguf.quants.dequantize(raw, qtype)
        if qtype in G.REQUANT_TYPES:
            bits, group = requant.affine_format(qtype, expert_bits, group_size)
            requant.convert_rows(raw, qtype, cols, bits, group)  # warm-up (kernel compilation)
        else:
            bits, group = G._EXACT_FORMATS[qtype]["bits"], G._EXACT_FORMATS[qtype]["group_size"]
        t0 = time.perf_counter()
        if qtype in G.REQUANT_TYPES:
            q = requant.convert_rows(raw, qtype, cols, bits, group)[0]
        else:
            q = G.repack(raw, qtype, cols)
        exact = qtype in G.EXACT_TYPES  # stored as the converter does: Q4_K's scales in float32
        q = {k: v if k == "weight" else G.to_scales(v, "F32" if qtype == T.Q4_K else "F16", exact)
             for k, v in q.items()}
        seconds = time.perf_counter() - t0
        got = np.array(mx.dequantize(mx.array(q["weight"]), mx.array(q["scales"]).astype(mx.float32),
                                     mx.array(q["biases"]).astype(mx.float32), group_size=group, bits=bits))
        out[qtype.name] = {
            "format": f"affine {bits}-bit g{group}",
            "bytes_per_weight": sum(a.nbytes for a in q.values()) / ref.size,
            "rel_rms": float(np.sqrt(np.square(got - ref).sum() / np.square(ref).sum())),
            "weights_per_s": ref.size / seconds}
    return out


def project_published(per_type, native=True):
    """{variant: (GGUF bytes, converted bytes, seconds to convert the quantized weights)} of the published
    files from `measure_types`' figures (reading the file aside). `native`: routed experts keep their
    GGUF blocks (their types appear nowhere else in these files), else the affine figures."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from ds4_mlx.convert.gguf import NATIVE_TYPES
    from ds4_mlx.convert.writer import ITEMSIZE  # float tensors are kept as they are

    out = {}
    for variant in PUBLISHED:
        src = dst = seconds = 0
        for t, n in published_weights(variant).items():
            block, size = GGML_QUANT_SIZES[T[t]]
            src += n * size / block
            if native and T[t] in NATIVE_TYPES:  # copied as they are
                dst += n * size / block
                continue
            dst += n * (ITEMSIZE[t] if t in ITEMSIZE else per_type[t]["bytes_per_weight"])
            seconds += n / per_type[t]["weights_per_s"] if t in per_type else 0
        out[variant] = (src, dst, seconds)
    return out


def bench_published(rows=2048, expert_bits=None, group_size=None) -> dict:
    """`q2_gib`, `q4_gib` (converted with native experts), their GGUF sizes and ratios, the affine
    alternative (`q2_affine_gib`...: experts requantized or repacked to MLX affine), per-type figures,
    and the device."""
    import mlx.core as mx

    per_type = measure_types(rows=rows, expert_bits=expert_bits, group_size=group_size)
    result = {}
    for variant, (src, dst, seconds) in project_published(per_type).items():
        result[f"{variant}_gguf_gib"] = round(src / 2**30, 2)
        result[f"{variant}_gib"] = round(dst / 2**30, 2)
        result[f"{variant}_ratio"] = round(dst / src, 4)
        result[f"{variant}_convert_min"] = round(seconds / 60, 1)
    for variant, (src, dst, seconds) in project_published(per_type, native=False).items():
        result[f"{variant}_affine_gib"] = round(dst / 2**30, 2)
        result[f"{variant}_affine_ratio"] = round(dst / src, 4)
        result[f"{variant}_affine_convert_min"] = round(seconds / 60, 1)
    result["types"] = {t: {k: (round(v, 5) if isinstance(v, float) else v) for k, v in f.items()}
                       for t, f in per_type.items()}
    result["device"] = str(mx.default_device())
    return result


def run(size_gb=4.0, rows=2048, expert_bits=None, group_size=None) -> dict:
    """`ds4-mlx bench convert`'s figures: the published files' projection against their size targets,
    a row per quantized type, a row per 0731 file (`project_file`), then (size_gb > 0) a synthetic file's
    conversion. `ds4-mlx bench` prints them as tables, or as JSON."""
    files = [project_file(file) for file in FILES_0731]
    figures = {"files_0731": [{k: v for k, v in row.items() if k != "experts"} for row in files],
               "experts_0731": [{"file": row["file"], "backend": backend, "experts": way}
                                for row in files for backend, way in row["experts"].items()]}
    for key, value in bench_published(rows=rows, expert_bits=expert_bits, group_size=group_size).items():
        figures[key] = [{"type": t, **f} for t, f in value.items()] if key == "types" else value  # a table's rows
        if key.endswith("_ratio") and key.removesuffix("_ratio") in RATIO_TARGETS:
            figures[key + "_target"] = RATIO_TARGETS[key.removesuffix("_ratio")]
    if size_gb > 0:
        figures.update(bench_convert(size_gb))
    return figures


if __name__ == "__main__":
    import json

    print(json.dumps(run(float(sys.argv[1]) if len(sys.argv) > 1 else 4.0)))
