"""`ds4-mlx bench batch`: decode tok/s of several sessions stepped together (`step_together`), against one."""

import statistics
import sys
import time

import mlx.core as mx
import numpy as np


def bench_batch(a):
    """Aggregate and per-stream decode tok/s of 1, 2, 4, 8 sessions decoded in one forward."""
    from ds4_mlx.bench import _model_for
    from ds4_mlx.session import Session, step_together

    counts = [int(n) for n in a.streams.split(",")]
    context = a.context or (512 if a.preset == "tiny" else 8192)
    model = _model_for(a, prefill_tokens=context, decode_steps=sum(counts) * a.decode)
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, context).tolist()
    first = Session(model)
    first.sync(prompt)
    rows = []
    for n in counts:
        sessions = []
        for b in range(n):  # forks of one prefill, each a few tokens shorter: their blocks close at other steps
            s = Session(model)
            s.restore(first.snapshot())
            s.trim(context - 1 - b % 4)
            sessions.append(s)
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
    return {"preset": a.preset, "layers": model.args.num_hidden_layers, "dtype": a.dtype,
            "expert_bits": a.expert_bits if a.preset == "real" else 0, "context": context, "results": rows}


def batch_options(q):
    from ds4_mlx.bench import _model_options

    _model_options(q)
    q.add_argument("--streams", default="1,2,4,8", help="stream counts, comma-separated")
    q.add_argument("--context", type=int, default=None, help="tokens each stream holds (default: 512 for the "
                   "tiny model, 8192 at real widths)")
    q.add_argument("--decode", type=int, default=16, help="decode steps timed (their median is reported)")
