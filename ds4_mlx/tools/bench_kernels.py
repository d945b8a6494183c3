"""`ds4-mlx bench kernels`: what one forward launches on a CUDA GPU, kernel by kernel.

For each shape (a decoded token, a verify of k rows, a batched step of B streams) it times the host's
share (building and encoding the graph) and records the GPU's kernels with PyTorch's profiler:
CUPTI sees every kernel of the process, MLX's included. The table groups kernels by kind, per step."""

import argparse
import importlib.util
import re
import statistics
import sys
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np

from ds4_mlx.tools.random_model import model_from_flags

# kinds of kernels, first match wins; the names are MLX's CUDA kernels and ours (ds4_*)
KINDS = [
    ("quantized product (experts)", r"gather_q"),
    ("quantized product (dense)", r"qmv|qmm|fp_q"),
    ("ours", r"ds4_"),
    ("matrix product", r"gemv|gemm|cublas|cutlass|nvjet|matmul|xmma"),
    ("fused element-wise", r"cu::[A-Z][a-z0-9]"),  # a compiled graph's kernel, named after its ops
    ("rms norm", r"rms"),
    ("rope", r"rope"),
    ("sort / top-k", r"sort|partition|radix"),
    ("scatter / slice update", r"scatter|slice_update"),
    ("gather", r"gather"),
    ("copy", r"copy"),
    ("reduction", r"reduce|logsumexp|softmax"),
    ("arange / fill", r"arange|fill|iota"),
    ("element-wise", r"binary|unary|ternary"),
]


def _kind(name):
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def _short(name, width=100):
    """A kernel's name without its parameter list; its template arguments stay (they tell MLX's kernels of
    one name apart: a gather's element type and dimensions)."""
    name = name.replace("(anonymous namespace)", "{anonymous}").split("(")[0]
    name = " ".join(name.replace("{anonymous}", "(anonymous namespace)").split())
    return name if len(name) <= width else name[: width - 1] + "~"


def forks(first, n):
    """n sessions forked from `first`'s prefill, each a few tokens shorter than it: their compressed blocks
    close at different steps, as a server's streams' do."""
    from ds4_mlx.session import Session

    sessions = []
    for b in range(n):
        s = Session(first.model)
        s.restore(first.snapshot())
        s.trim(len(first.tokens) - 1 - b % 4)
        sessions.append(s)
    return sessions


def _shapes(model, a):
    """(label, step) pairs: each step builds one lazy forward and returns (output, settle)."""
    from ds4_mlx.session import Session, step_together

    context = a.context
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    first = Session(model)
    first.sync(rng.integers(0, vocab, context).tolist())
    mx.clear_cache()

    def batch(n):
        sessions = forks(first, n)
        tokens = [mx.array([s.tokens[-1] for s in sessions], dtype=mx.int32)]

        def step():
            logits = step_together(sessions, tokens[0])
            tokens[0] = mx.argmax(logits, axis=-1).astype(mx.int32)

            def settle():
                for s in sessions:
                    s.settle()
            return tokens[0], settle
        return step

    def verify(k):
        def step():
            draft = rng.integers(0, vocab, k).tolist()
            logits = first.verify(draft)
            return logits, lambda: first.trim(len(first.tokens) - k)
        return step

    out = []
    for spec in a.shapes.split(","):
        kind, _, n = spec.partition(":")
        n = int(n or 1)
        if kind == "decode":
            out.append(("decode" if n == 1 else f"batch of {n}", batch(n)))
        elif kind == "verify":
            out.append((f"verify of {n} rows", verify(n)))
        else:
            raise ValueError(f"unknown shape {spec!r}: use decode, decode:B or verify:K")
    return out


def _host_times(step, repeats):
    """Medians of the time until the step's call returns (building and encoding its graph: decode starts
    the evaluation itself; a verify waits for it) and of the whole step."""
    host, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, settle = step()
        t1 = time.perf_counter()
        mx.eval(out)
        settle()
        host.append(t1 - t0), total.append(time.perf_counter() - t0)
    return {"host_ms": statistics.median(host) * 1000, "step_ms": statistics.median(total) * 1000}


def _kernels(step, repeats, top):
    import torch.profiler as tp

    with tp.profile(activities=[tp.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            out, settle = step()
            mx.eval(out)
            settle()
    by_name = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.name and not e.name.startswith("Memcpy"):
            entry = by_name[e.name]
            entry[0] += 1
            entry[1] += getattr(e, "device_time", None) or e.cuda_time
    kinds = defaultdict(lambda: [0, 0.0])
    for name, (calls, us) in by_name.items():
        kinds[_kind(name)][0] += calls
        kinds[_kind(name)][1] += us
    per = lambda calls, us: {"calls": calls / repeats, "us": us / repeats}
    listed = sorted(by_name.items(), key=lambda kv: -kv[1][1])[: top or None]
    return {"kernels": sum(c for c, _ in by_name.values()) / repeats,
            "gpu_ms": sum(u for _, u in by_name.values()) / repeats / 1000,
            "kinds": {k: per(*v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
            "top": [{"name": _short(n), "kind": _kind(n), **per(*v)} for n, v in listed]}


def bench_kernels(a):
    """Kernels a forward launches on CUDA (count and GPU time by kind) and the host's share of a step."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        raise SystemExit("bench kernels needs MLX's CUDA build on an NVIDIA GPU (it reads CUPTI through PyTorch)")
    if importlib.util.find_spec("torch") is None:
        raise SystemExit("bench kernels needs PyTorch (its profiler reads the GPU's kernels)")
    model = model_from_flags(a)
    results = []
    for label, step in _shapes(model, a):
        for _ in range(3):  # warm-up: graphs traced, kernels compiled
            out, settle = step()
            mx.eval(out)
            settle()
        row = {"shape": label, **_host_times(step, a.repeats), **_kernels(step, a.repeats, a.top)}
        results.append(row)
        print(f"{label}: {row['step_ms']:.2f} ms a step (host {row['host_ms']:.2f}), "
              f"{row['kernels']:.0f} kernels, {row['gpu_ms']:.2f} ms of GPU time", file=sys.stderr, flush=True)
        for kind, v in row["kinds"].items():
            print(f"    {kind:32s} {v['calls']:7.1f} {v['us'] / 1000:8.3f} ms", file=sys.stderr)
        for t in row["top"]:
            print(f"    {t['calls']:7.1f} {t['us']:9.1f} us  {t['name']}", file=sys.stderr)
    return {"layers": model.args.num_hidden_layers, "like": a.like, "quant_sim": a.quant_sim, "dtype": a.dtype,
            "context": a.context, "results": results}


def options(q):
    q.add_argument("--context", type=int, default=8192, help="tokens the session holds")
    q.add_argument("--shapes", default="decode,verify:6,decode:8",
                   help="comma-separated: decode (one token), decode:B (B streams in one step), verify:K")
    q.add_argument("--repeats", type=int, default=8, help="steps timed and profiled per shape")
    q.add_argument("--top", type=_count, default=25, help="kernels listed by name, most GPU time first (0: all)")


def bench_gguf_rows(a):
    """The GGUF expert rows kernel alone at real widths: microseconds a launch and bandwidth.

    Each shape is a product of the q2 layout's routed experts (gate or up: IQ2_XXS, down: Q2_K) for
    `pairs` (token, expert) pairs, six a token: a decoded token, a verify or a batch. A timed evaluation
    holds many launches on experts drawn afresh each (as a forward's layers read weights the cache has not
    seen), so the launch and the wait are spread over them."""
    from ds4_mlx.models import gguf_blocks, kernels
    from ds4_mlx.tools.random_model import real_args

    if kernels.backend() != "cuda":
        raise SystemExit("bench gguf-rows needs MLX's CUDA build on an NVIDIA GPU")
    for codec in kernels.GGUF_ROWS:  # else every launch is None, and evaluating nothing looks fast
        if kernels.GGUF_ROWS[codec].backend() is None:
            raise SystemExit(f"bench gguf-rows: the {codec} rows kernel is off here (--no-kernels, "
                             "DS4_MLX_KERNELS=0, or it failed its self-check: see the warning above)")
    args, dtype = real_args(1), getattr(mx, a.dtype)
    H, inner, experts = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
    results = []
    for name, codec, out, inp in (("gate or up", "iq2_xxs", inner, H), ("down", "q2_k", H, inner)):
        w = gguf_blocks.random_blocks(codec, (experts, out, gguf_blocks.row_bytes(codec, inp)), seed=1)
        mx.eval(w)
        for pairs in a.pairs:
            x = mx.random.normal((pairs // 6, inp)).astype(dtype)
            draws = [mx.random.randint(0, experts, (a.launches, pairs), key=mx.random.key(r)).astype(mx.uint32)
                     for r in range(a.repeats + 1)]
            mx.eval(x, draws)

            def launches(indices):
                return [kernels.gguf_rows(x, w, indices[i], codec) for i in range(a.launches)]

            mx.eval(launches(draws[0]))  # warm-up: the kernel compiled
            times = []
            for indices in draws[1:]:
                t = time.perf_counter()
                mx.eval(launches(indices))
                times.append((time.perf_counter() - t) / a.launches)
            us = statistics.median(times) * 1e6
            gb_s = pairs * w[0].nbytes / (us * 1e-6) / 1e9
            results.append({"product": name, "codec": codec, "pairs": pairs, "us": round(us, 2),
                            "gb_s": round(gb_s, 1)})
            print(f"{name:10s} {codec:8s} {pairs:3d} pairs: {us:8.2f} us a launch, {gb_s:7.1f} GB/s", file=sys.stderr,
                  flush=True)
        del w
    return {"dtype": a.dtype, "results": results}


# The few-row products of the published layout at real widths: (name, variant, input, output, groups)
FEW_ROWS_SHAPES = [("q_a", "plain", 4096, 1024, 1), ("q_b", "plain", 1024, 32768, 1), ("kv", "plain", 4096, 512, 1),
                   ("wo_a (grouped)", "plain", 4096, 8192, 8), ("wo_b", "plain", 1024, 8192, 1),
                   ("shared gate+up", "glu", 4096, 2048, 1), ("shared down+", "add", 2048, 4096, 1),
                   ("head", "plain", 4096, 129280, 1)]


def bench_few_rows(a):
    """The 8-bit few-row product alone at real widths (`FEW_ROWS_SHAPES`), each body on the same inputs:
    float32 sums (the exact mode's, and 16-bit x's before the tensor cores) and tensor cores (16-bit x).
    The launches cycle through copies of the weight that together outgrow the L2 cache, as a forward's
    layers do."""
    from ds4_mlx.models import kernels

    if kernels.backend() != "cuda":
        raise SystemExit("bench few-rows needs MLX's CUDA build on an NVIDIA GPU")
    if kernels.FEW_ROWS.backend() is None or kernels.FEW_ROWS_MMA.backend() is None:
        raise SystemExit("bench few-rows: a few-row kernel is off here (--no-kernels, DS4_MLX_KERNELS=0, or it "
                         "failed its self-check: see the warning above)")
    dtype, results = getattr(mx, a.dtype), []
    bodies = [("float", False)] + ([("tensor cores", True)] if dtype != mx.float32 else [])
    for name, variant, inp, out, groups in FEW_ROWS_SHAPES:
        maps = 2 if variant == "glu" else 1
        copies = max(1, min(128, -(-256 * 2**20 // (maps * out * inp))))
        weights = [[mx.quantize(0.02 * mx.random.normal((groups, out // groups, inp), key=mx.random.key(c * 2 + i)),
                                group_size=32, bits=8) for i in range(maps)] for c in range(copies)]
        weights = [[(w, s.astype(mx.float16), b.astype(mx.float16)) for w, s, b in c] for c in weights]
        mx.eval(weights)
        for rows in a.rows:
            x = mx.random.normal((rows, groups, inp) if groups > 1 else (rows, inp)).astype(dtype)
            addend = mx.zeros((rows, out), dtype)
            mx.eval(x, addend)
            row = {"product": name, "in": inp, "out": out, "rows": rows}
            for body, tensor_cores in bodies:
                def launches(r):
                    ys = []
                    for i in range(r * a.launches, (r + 1) * a.launches):
                        first, *second = weights[i % copies]
                        w, s, b = first if groups > 1 else (m[0] for m in first)
                        extra = (addend,) if variant == "add" else tuple(m[0] for m in second[0]) if second else ()
                        ys.append(kernels._few_rows_launch(variant, x, w, s, b, 32, extra, 2.0, tensor_cores))
                    return ys

                mx.eval(launches(0))  # warm-up: the kernel compiled
                times = []
                for r in range(1, a.repeats + 1):
                    t = time.perf_counter()
                    mx.eval(launches(r))
                    times.append((time.perf_counter() - t) / a.launches)
                us = statistics.median(times) * 1e6
                row[f"{body} us"] = round(us, 2)
                row[f"{body} GB/s"] = round(maps * out * inp * 36 / 32 / (us * 1e-6) / 1e9, 1)
            results.append(row)
            print("  ".join(f"{k}: {v}" for k, v in row.items()), file=sys.stderr, flush=True)
        del weights
    return {"dtype": a.dtype, "results": results}


def _row_counts(text):
    """--rows: comma-separated row counts the few-row kernels take."""
    from ds4_mlx.models.kernels import FEW_ROWS_MAX

    counts = [int(r) if r.strip().isdigit() else 0 for r in text.split(",")]
    if any(not 0 < r <= FEW_ROWS_MAX for r in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each count from 1 to {FEW_ROWS_MAX}")
    return counts


def few_rows_options(q):
    q.add_argument("--rows", type=_row_counts, default="1,6,8,16", help="rows of x, comma-separated (1-16)")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="x's dtype")
    q.add_argument("--launches", type=_positive, default=20, help="launches an evaluation")
    q.add_argument("--repeats", type=_positive, default=7,
                   help="timed evaluations a shape (their median is reported)")

def _pair_counts(text):
    """--pairs: comma-separated multiples of 6 (a token's experts share its row of x), as far as the kernel
    applies."""
    from ds4_mlx.models.kernels import GGUF_ROWS_MAX_PAIRS

    counts = [int(p) if p.strip().isdigit() else 0 for p in text.split(",")]
    if any(p <= 0 or p % 6 for p in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each count a positive multiple of 6 (six pairs a token)")
    if max(counts) > GGUF_ROWS_MAX_PAIRS:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {GGUF_ROWS_MAX_PAIRS} pairs (past that decode "
                                         "takes another path)")
    return counts


def _count(text):
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number, 0 or more")
    return int(text)


def _positive(text):
    if not text.strip().isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive whole number")
    return int(text)


def gguf_rows_options(q):
    q.add_argument("--pairs", type=_pair_counts, default="6,12,36,48",
                   help="(token, expert) pairs a launch, comma-separated multiples of 6")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="x's dtype")
    q.add_argument("--launches", type=_positive, default=43, help="launches an evaluation (one a layer of a forward)")
    q.add_argument("--repeats", type=_positive, default=7,
                   help="timed evaluations a shape (their median is reported)")
