"""`ds4-mlx bench`: speed and memory figures. Every sub-command prints a table of its figures, or with
--json one JSON object with them on the last line.

On a CPU the model benches default to the tiny preset (seconds); real widths there take hours, so they
first measure a few tokens and say how long the whole run will take."""

import argparse
import json
import sys
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ds4_mlx.models.deepseek_v4 import ModelArgs, Model


def random_model(args: ModelArgs, *, seed=0, expert_bits=None, quant_sim=False, dtype=mx.float32):
    """A model with random weights drawn in MLX (fast at real widths). With `expert_bits`, the routed
    experts are random affine-quantized weights, never materialised in float (group 64 at 2 bits, as the
    converter writes the q2 file's experts; group 32 otherwise)."""
    model = Model(args, quant_sim=quant_sim)
    if expert_bits:
        group = 64 if expert_bits == 2 else 32
        model.apply_quantization({f"layers.{i}.ffn.experts.{p}": {"group_size": group, "bits": expert_bits,
                                                                   "mode": "affine"}
                                  for i in range(args.num_hidden_layers) for p in ("gate", "up", "down")})
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    params = {}
    for name, v in tree_flatten(model.parameters()):
        if name.endswith("tid2eid"):  # distinct experts per token
            rows = np.argsort(rng.random((v.shape[0], args.n_routed_experts)), axis=1)[:, : v.shape[1]]
            params[name] = mx.array(rows.astype(np.int32))
        elif v.dtype == mx.uint32:  # packed quantized codes
            params[name] = mx.random.randint(0, 2**31, v.shape).astype(mx.uint32)
        elif name.endswith(".scales"):
            params[name] = mx.full(v.shape, 2.0 / (2**expert_bits) / np.sqrt(v.shape[-1] * group), dtype)
        elif name.endswith(".biases"):
            params[name] = mx.full(v.shape, -1.0 / np.sqrt(v.shape[-1] * group), dtype)
        elif name.endswith("norm.weight"):
            params[name] = (1 + 0.1 * mx.random.normal(v.shape)).astype(dtype)
        elif v.ndim >= 2:
            params[name] = (mx.random.normal(v.shape) / np.sqrt(v.shape[-1])).astype(dtype)
        else:  # sinks, biases, HC base/scale
            params[name] = (0.5 * mx.random.normal(v.shape)).astype(dtype)
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def real_args(layers=2, **overrides):
    """V4 Flash widths with a few layers: a CSA and an HCA layer first, as the real model's layers 2 and 3."""
    ratios = ([4, 128] * layers)[:layers]
    return ModelArgs(num_hidden_layers=layers, compress_ratios=ratios, num_hash_layers=0, **overrides)


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (flags, defaults chosen at run time)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def register(subparsers):
    p = subparsers.add_parser("bench", help="speed and memory benchmarks",
                              description="Speed and memory benchmarks. Each prints a table of its figures, "
                                          "or with --json one JSON object on the last line. On a CPU, model, "
                                          "rewind and speed use the tiny test model unless --preset real.")
    sub = p.add_subparsers(dest="bench", required=True)
    for name, fn, extra in BENCHES:
        q = sub.add_parser(name, help=fn.__doc__.splitlines()[0], description=fn.__doc__,
                           formatter_class=_HelpWithDefaults)
        q.add_argument("--json", action="store_true", help="print one JSON object on the last line instead of a table")
        q.add_argument("--device", choices=["cpu", "gpu"], default=None, help="(default: MLX's default device)")
        extra(q)
        q.set_defaults(func=lambda a, fn=fn: _run(fn, a))


def _run(fn, args):
    from ds4_mlx.bench_report import format_figures

    if args.device:
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    on_cpu = mx.default_device() == mx.cpu
    if getattr(args, "preset", "") is None:  # the model benches: real widths take hours on a CPU
        args.preset = "tiny" if on_cpu else "real"
    if getattr(args, "contexts", "") is None:  # a 32k prefill takes minutes on a CPU even for the tiny model
        args.contexts = "2048,8192" if on_cpu else "2048,8192,32768"
    figures = fn(args)
    figures["device"] = str(mx.default_device())
    print(json.dumps(figures) if args.json else format_figures(figures))
    return 0


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def build_model(a):
    """The bench's model: the tiny test model, or real widths with random quantized experts, `--layers`
    of [CSA, HCA, ...] or with `--full` the real model's 43 layers and layer kinds; cast to `--dtype`."""
    if a.preset == "tiny":
        from ds4_mlx.testing import tiny_args

        model = random_model(tiny_args(), seed=0)
    else:
        overrides = {"n_routed_experts": a.experts} if getattr(a, "experts", None) else {}
        args = ModelArgs(**overrides) if a.full else real_args(a.layers, **overrides)
        model = random_model(args, seed=0, expert_bits=a.expert_bits or None,
                             dtype=mx.bfloat16 if a.dtype == "bfloat16" else mx.float32)
    if a.dtype != "float32":
        model.cast(getattr(mx, a.dtype))
    return model


def _model_for(a, *, prefill_tokens: int, decode_steps: int):
    """`build_model`; real widths on a CPU first time a short prefill and two decode steps and say how
    long `prefill_tokens` and `decode_steps` will take (a lower bound: attention grows with context)."""
    on_cpu = mx.default_device() == mx.cpu and a.preset != "tiny"
    if on_cpu:
        print("real V4 Flash widths on a CPU: building the model and timing a few tokens to estimate the run...",
              file=sys.stderr, flush=True)
    model = build_model(a)
    if on_cpu:
        per_token, per_step = _time_tokens(model)
        estimate = prefill_tokens * per_token + decode_steps * per_step
        print(f"this run prefills {prefill_tokens:,} tokens and decodes {decode_steps:,}: at the {per_token:.2f} s "
              f"per prefill token and {per_step:.2f} s per decode step measured here, at least "
              f"{_duration(estimate)} more. --preset tiny takes seconds; real figures need Apple Silicon or CUDA "
              "(--device gpu).", file=sys.stderr, flush=True)
    return model


def _time_tokens(model, prompt=32):
    from ds4_mlx.session import Session

    s = Session(model, rewind_slack=0)
    ids = np.random.default_rng(0).integers(0, model.args.vocab_size, prompt).tolist()
    prefill_s, logits = _timed(lambda: s.sync(ids))
    token = int(mx.argmax(logits))
    step_s, _ = _timed(lambda: [mx.eval(s.step(token)) for _ in range(2)])
    return prefill_s / prompt, step_s / 2


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _model_options(q):
    q.add_argument("--preset", choices=["real", "tiny"], default=None,
                   help="real: V4 Flash widths with --layers layers and random quantized experts; tiny: the "
                        "test model (default: tiny on a CPU, real on a GPU)")
    q.add_argument("--layers", type=int, default=2, help="layers at real widths")
    q.add_argument("--full", action="store_true", help="all 43 layers of the real model (--expert-bits 2 "
                   "--dtype bfloat16 fits one 141 GB GPU)")
    q.add_argument("--experts", type=int, default=None, help="routed experts at real widths (default: 256)")
    q.add_argument("--expert-bits", type=int, default=4, help="random affine-quantized experts; 0: float")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="compute dtype (float32 keeps the exact mode)")


def bench_model(a):
    """Prefill and decode tokens/s of a model of given dims (random weights)."""
    from ds4_mlx.session import Session

    model = _model_for(a, prefill_tokens=a.repeats * a.prompt, decode_steps=a.repeats * a.decode)
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    prefill, decode = [], []
    for _ in range(a.repeats):
        s = Session(model, rewind_slack=0)
        prompt = rng.integers(0, vocab, a.prompt).tolist()
        t, logits = _timed(lambda: s.sync(prompt))
        prefill.append(a.prompt / t)
        token = int(mx.argmax(logits))
        steps = []
        for _ in range(a.decode):
            t, logits = _timed(lambda: s.step(token))
            token = int(mx.argmax(logits))
            steps.append(t)
        decode.append(1 / statistics.median(steps))
    figures = {"preset": a.preset, "layers": model.args.num_hidden_layers, "hidden": model.args.hidden_size,
               "experts": model.args.n_routed_experts,
               "expert_bits": a.expert_bits if a.preset == "real" else 0, "prompt": a.prompt,
               "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}
    return figures


def _bench_model_options(q):
    _model_options(q)
    q.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    q.add_argument("--decode", type=int, default=16, help="decode steps (their median is reported)")
    q.add_argument("--repeats", type=int, default=1, help="runs (their median is reported)")


def bench_rewind(a):
    """Resend after an aborted stream against a cold prefill, at several context lengths."""
    from ds4_mlx.session import Session

    contexts = [int(c) for c in a.contexts.split(",")]
    model = _model_for(a, prefill_tokens=sum(contexts) + a.repeats * len(contexts),
                       decode_steps=a.repeats * a.generated * len(contexts))
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for ctx in contexts:
        prompt = rng.integers(0, vocab, ctx).tolist()
        s = Session(model, **({"max_chunk": a.chunk} if a.chunk else {}))
        mx.reset_peak_memory()
        cold_s, cold_logits = _timed(lambda: s.sync(prompt))
        resend, computed, diffs = [], [], []
        for _ in range(a.repeats):
            token = int(mx.argmax(s.logits))
            for _ in range(a.generated):  # the stream the client aborted
                token = int(mx.argmax(s.step(token)))
            t, logits = _timed(lambda: s.sync(prompt))
            resend.append(t)
            computed.append(s.last_sync["computed"])
            diffs.append(float(mx.abs(logits - cold_logits).max()))
        row = {"context": ctx, "cold_s": cold_s, "resend_s": statistics.median(resend),
               "ratio": statistics.median(resend) / cold_s, "computed": max(computed),
               "max_logit_diff": max(diffs), "session_mb": s.nbytes / 2**20,
               "peak_gib": mx.get_peak_memory() / 2**30}
        rows.append(row)
        print(f"ctx {ctx}: cold {cold_s:.2f} s, resend {row['resend_s'] * 1000:.1f} ms "
              f"(computed {row['computed']} tokens), ratio {row['ratio']:.5f}, "
              f"max |logit diff| {row['max_logit_diff']:.2e}, session {row['session_mb']:.0f} MB, "
              f"peak {row['peak_gib']:.1f} GiB",
              file=sys.stderr, flush=True)  # progress: the table (or JSON) on stdout comes at the end
    return {"layers": model.args.num_hidden_layers, "expert_bits": a.expert_bits if a.preset == "real" else 0,
            "dtype": a.dtype, "generated": a.generated, "results": rows}


def _bench_rewind_options(q):
    _model_options(q)
    q.add_argument("--contexts", default=None, help="context lengths, comma-separated (default: 2048,8192 on a "
                   "CPU, 2048,8192,32768 on a GPU)")
    q.add_argument("--generated", type=int, default=37, help="tokens streamed before the abort")
    q.add_argument("--repeats", type=int, default=3, help="resends per context (their median is reported)")
    q.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the session's)")


def bench_convert(a):
    """Converter: the published q2/q4 files' converted size, error and speed; a synthetic GGUF's peak RSS and MB/s."""
    from ds4_mlx.convert.bench import run

    return run(size_gb=a.size_gb, rows=a.rows, expert_bits=a.expert_bits, group_size=a.group_size)


def _bench_convert_options(q):
    q.add_argument("--size-gb", type=float, default=5.3,
                   help="synthetic file to convert: at least this many GB, in whole layers at real widths (the "
                        "smallest, one layer with the embeddings and head, is 5.3 GB); 0: none")
    q.add_argument("--rows", type=int, default=2048, help="rows of each real-width tensor measured")
    q.add_argument("--expert-bits", type=int, default=None)
    q.add_argument("--group-size", type=int, default=None)


def bench_speed(a):
    """Prefill and decode tok/s at real widths, against the roofline and transformers."""
    from ds4_mlx.bench_speed import bench_speed as run

    return run(a)


def _bench_speed_options(q):
    from ds4_mlx.bench_speed import options

    options(q)


def bench_memory(a):
    """Session memory at real widths (43 layers) at several context lengths, no forward pass."""
    from ds4_mlx.cache.bench import bench_memory as run

    return run(a)


def _bench_memory_options(q):
    from ds4_mlx.cache.bench import memory_options

    memory_options(q)


def bench_load(a):
    """Many streaming clients with random aborts against one server: errors, mismatches, latency, RSS."""
    from ds4_mlx.server.load_bench import bench_load as run

    return run(a)


def _bench_load_options(q):
    from ds4_mlx.server.load_bench import bench_load_options

    bench_load_options(q)


BENCHES = [
    ("model", bench_model, _bench_model_options),
    ("rewind", bench_rewind, _bench_rewind_options),
    ("convert", bench_convert, _bench_convert_options),
    ("speed", bench_speed, _bench_speed_options),
    ("memory", bench_memory, _bench_memory_options),
    ("load", bench_load, _bench_load_options),
]
