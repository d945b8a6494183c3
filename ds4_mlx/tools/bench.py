"""`ds4-mlx bench`: speed and memory figures. Every sub-command prints a table of its figures, or with
--json one JSON object with them, alone on stdout: progress goes to stderr.

On a CPU the model benches default to the tiny preset (seconds); real widths there take hours, so they
first measure a few tokens and say how long the whole run will take."""

import argparse
import contextlib
import json
import sys
import statistics
import time

import mlx.core as mx
import numpy as np

from ds4_mlx.tools import (bench_distributed, bench_graph, bench_kernels, bench_load, bench_memory, bench_parity,
                           bench_speculative, bench_speed)
from ds4_mlx.tools.random_model import expert_bits, like_option, model_from_flags


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (flags, defaults chosen at run time)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def register(subparsers):
    p = subparsers.add_parser("bench", help="speed and memory benchmarks",
                              description="Speed and memory benchmarks. Each prints a table of its figures, "
                                          "or with --json one JSON object instead (progress goes to stderr). On a CPU, model, "
                                          "rewind and speed use the tiny test model unless --preset real.")
    sub = p.add_subparsers(dest="bench", required=True)
    for name, fn, extra in BENCHES:
        q = sub.add_parser(name, help=fn.__doc__.splitlines()[0], description=fn.__doc__,
                           formatter_class=_HelpWithDefaults)
        q.add_argument("--json", action="store_true", help="print one JSON object, alone on stdout, instead of a table")
        q.add_argument("--device", choices=["cpu", "gpu"], default=None, help="(default: MLX's default device)")
        extra(q)
        q.set_defaults(func=lambda a, fn=fn: _run(fn, a))


def _run(fn, args):
    from ds4_mlx.tools.bench_report import format_figures

    if args.device:
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    on_cpu = mx.default_device() == mx.cpu
    if getattr(args, "preset", "") is None:  # the model benches: real widths take hours on a CPU
        args.preset = "tiny" if on_cpu else "real"
    # the model benches' contexts: a 32k prefill takes minutes on a CPU even for the tiny model
    if hasattr(args, "preset") and getattr(args, "contexts", "") is None:
        args.contexts = "2048,8192" if on_cpu else "2048,8192,32768"
    # progress, and anything a library prints, goes to stderr: stdout holds the table or the JSON alone
    with contextlib.redirect_stdout(sys.stderr):
        figures = fn(args)
    figures["device"] = str(mx.default_device())
    print(json.dumps(figures) if args.json else format_figures(figures), flush=True)
    return 0


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _model_for(a, *, prefill_tokens: int, decode_steps: int):
    """`model_from_flags`; real widths on a CPU first time a short prefill and two decode steps and say how
    long `prefill_tokens` and `decode_steps` will take (a lower bound: attention grows with context)."""
    on_cpu = mx.default_device() == mx.cpu and a.preset != "tiny"
    if on_cpu:
        print("real V4 Flash widths on a CPU: building the model and timing a few tokens to estimate the run...",
              file=sys.stderr, flush=True)
    model = model_from_flags(a)
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
    q.add_argument("--expert-bits", type=int, default=None,
                   help="random affine-quantized experts; 0: float (default: 4)")
    like_option(q)
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
        s = Session(model, rewind_slack=0, **({"max_chunk": a.chunk} if a.chunk else {}))
        s.layers_per_turn = a.layers_per_turn
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
               "expert_bits": expert_bits(a), "like": a.like, "quant_sim": a.quant_sim, "prompt": a.prompt,
               "chunk": a.chunk, "layers_per_turn": a.layers_per_turn,
               "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}
    return figures


def _bench_model_options(q):
    _model_options(q)
    q.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    q.add_argument("--decode", type=int, default=16, help="decode steps (their median is reported)")
    q.add_argument("--repeats", type=int, default=1, help="runs (their median is reported)")
    q.add_argument("--chunk", type=int, default=None, help="prefill chunk (the grid; default: the session's)")
    q.add_argument("--layers-per-turn", type=int, default=None,
                   help="evaluate a chunk this many layers at a time, as a server does beside other streams")


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
    return {"layers": model.args.num_hidden_layers, "expert_bits": expert_bits(a), "like": a.like,
            "quant_sim": a.quant_sim, "dtype": a.dtype, "generated": a.generated, "results": rows}


def _bench_rewind_options(q):
    _model_options(q)
    q.add_argument("--contexts", default=None, help="context lengths, comma-separated (default: 2048,8192 on a "
                   "CPU, 2048,8192,32768 on a GPU)")
    q.add_argument("--generated", type=int, default=37, help="tokens streamed before the abort")
    q.add_argument("--repeats", type=int, default=3, help="resends per context (their median is reported)")
    q.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the session's)")


def bench_convert(a):
    """Converter: the published files' converted sizes; a synthetic GGUF's peak RSS and MB/s.

    V4 Flash 0731's four files with the path their experts take on Metal, CUDA and the CPU; the original
    q2/q4 files with the requantization's error and speed."""
    from ds4_mlx.tools.bench_convert import run

    return run(size_gb=a.size_gb, rows=a.rows, expert_bits=a.expert_bits, group_size=a.group_size)


def _bench_convert_options(q):
    q.add_argument("--size-gb", type=float, default=5.3,
                   help="synthetic file to convert: at least this many GB, in whole layers at real widths (the "
                        "smallest, one layer with the embeddings and head, is 5.3 GB); 0: none")
    q.add_argument("--rows", type=int, default=2048, help="rows of each real-width tensor measured")
    q.add_argument("--expert-bits", type=int, default=None)
    q.add_argument("--group-size", type=int, default=None)


def bench_batch(a):
    """Aggregate and per-stream decode tok/s of 1, 2, 4, 8 sessions decoded in one forward."""
    from ds4_mlx.session import Session, step_together

    counts = [int(n) for n in a.streams.split(",")]
    context = a.context or (512 if a.preset == "tiny" else 8192)
    model = _model_for(a, prefill_tokens=context, decode_steps=sum(counts) * a.decode)
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, context).tolist()
    first = Session(model)
    first.sync(prompt)
    mx.clear_cache()  # decode from an empty buffer cache, as stream_generate does after a prefill
    rows = []
    for n in counts:
        sessions = bench_kernels.forks(first, n)
        tokens = mx.array([s.tokens[-1] for s in sessions], dtype=mx.int32)
        steps = []
        for i in range(a.decode + 2):  # two warm-up steps build the graphs
            start = time.perf_counter()
            logits = step_together(sessions, tokens)
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
            for s in sessions:  # the server reads every id before its next step
                s.settle()
            steps.append(time.perf_counter() - start)
        step_s = statistics.median(steps[2:])
        rows.append({"streams": n, "aggregate_tok_s": n / step_s, "per_stream_tok_s": 1 / step_s,
                     "step_ms": step_s * 1000})
        print(f"{n} streams: {n / step_s:.1f} tok/s together, {1 / step_s:.1f} each ({step_s * 1000:.2f} ms a step)",
              file=sys.stderr, flush=True)
        del sessions
        mx.clear_cache()
    one = rows[0]["aggregate_tok_s"] if counts[0] == 1 else None
    for row in rows:
        row["speedup"] = row["aggregate_tok_s"] / one if one else None
    verifies = _verify_costs(first, [int(n) for n in a.verify.split(",")] if a.verify else [], a.decode,
                             1000 / one if one else None)
    return {"preset": a.preset, "layers": model.args.num_hidden_layers, "dtype": a.dtype,
            "expert_bits": expert_bits(a), "like": a.like, "quant_sim": a.quant_sim, "context": context,
            "results": rows, "verify": verifies}


def _verify_costs(session, row_counts, repeats, step_ms):
    """The time of a verify of k drafted tokens on a live session (logits at every row, then trimmed back),
    against one decoded token's `step_ms`."""
    rng = np.random.default_rng(1)
    out = []
    for k in row_counts:
        times = []
        for _ in range(repeats + 2):  # two warm-up verifies build the graphs
            draft = rng.integers(0, session.model.args.vocab_size, k).tolist()
            start = time.perf_counter()
            mx.eval(session.verify(draft))
            session.trim(len(session.tokens) - k)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[2:]) * 1000
        out.append({"rows": k, "verify_ms": ms, "vs_one_token": ms / step_ms if step_ms else None})
        print(f"verify of {k} rows: {ms:.2f} ms" + (f" ({ms / step_ms:.2f}x one token)" if step_ms else ""),
              file=sys.stderr, flush=True)
    return out


def _bench_batch_options(q):
    _model_options(q)
    q.add_argument("--streams", default="1,2,4,8", help="stream counts, comma-separated")
    q.add_argument("--context", type=int, default=None, help="tokens each stream holds (default: 512 for the "
                   "tiny model, 8192 at real widths)")
    q.add_argument("--decode", type=int, default=16, help="decode steps timed (their median is reported)")
    q.add_argument("--verify", default="", help="also time a verify of this many drafted tokens on a live session "
                   "(comma-separated, e.g. 2,4,6), against one decoded token")


BENCHES = [
    ("model", bench_model, _bench_model_options),
    ("rewind", bench_rewind, _bench_rewind_options),
    ("convert", bench_convert, _bench_convert_options),
    ("speed", bench_speed.bench_speed, bench_speed.options),
    ("dense", bench_speed.dense_products, bench_speed.dense_options),
    ("memory", bench_memory.bench_memory, bench_memory.memory_options),
    ("load", bench_load.bench_load, bench_load.bench_load_options),
    ("parity", bench_parity.bench_parity, bench_parity.parity_options),
    ("batch", bench_batch, _bench_batch_options),
    ("kernels", bench_kernels.bench_kernels, lambda q: (_model_options(q), bench_kernels.options(q))),
    ("gguf-rows", bench_kernels.bench_gguf_rows, bench_kernels.gguf_rows_options),
    ("few-rows", bench_kernels.bench_few_rows, bench_kernels.few_rows_options),
    ("graph", bench_graph.bench_graph, bench_graph.options),
    ("distributed", bench_distributed.bench_distributed, bench_distributed.options),
    ("speculative", bench_speculative.bench_speculative, lambda q: (_model_options(q), bench_speculative.options(q))),
]
