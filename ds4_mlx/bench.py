"""`ds4-mlx bench`: speed and memory figures. Every sub-command takes --json and then prints one
JSON object with its figures on the last line."""

import json
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ds4_mlx.models.deepseek_v4 import ModelArgs, Model


def random_model(args: ModelArgs, *, seed=0, expert_bits=None, quant_sim=False, dtype=mx.float32):
    """A model with random weights drawn in MLX (fast at real widths). With `expert_bits`, the routed
    experts are random affine-quantized weights (group 32) and are never materialised in float."""
    model = Model(args, quant_sim=quant_sim)
    if expert_bits:
        model.apply_quantization({f"layers.{i}.ffn.experts.{p}": {"group_size": 32, "bits": expert_bits,
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
            params[name] = mx.full(v.shape, 2.0 / (2**expert_bits) / np.sqrt(v.shape[-1] * 32), dtype)
        elif name.endswith(".biases"):
            params[name] = mx.full(v.shape, -1.0 / np.sqrt(v.shape[-1] * 32), dtype)
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


def register(subparsers):
    p = subparsers.add_parser("bench", help="speed and memory benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    for name, fn, extra in BENCHES:
        q = sub.add_parser(name, help=fn.__doc__.splitlines()[0])
        q.add_argument("--json", action="store_true", help="print one JSON object on the last line")
        q.add_argument("--device", choices=["cpu", "gpu"], default=None)
        extra(q)
        q.set_defaults(func=lambda a, fn=fn: _run(fn, a))


def _run(fn, args):
    if args.device:
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    figures = fn(args)
    figures["device"] = str(mx.default_device())
    if args.json:
        print(json.dumps(figures))
    return 0


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _model_for(a):
    if a.preset == "tiny":
        from ds4_mlx.testing import tiny_args

        return random_model(tiny_args(), seed=0)
    overrides = {}
    if a.experts:
        overrides["n_routed_experts"] = a.experts
    return random_model(real_args(a.layers, **overrides), seed=0, expert_bits=a.expert_bits)


def _model_options(q):
    q.add_argument("--preset", choices=["real", "tiny"], default="real",
                   help="real: V4 Flash widths with --layers layers and random quantized experts")
    q.add_argument("--layers", type=int, default=2)
    q.add_argument("--experts", type=int, default=None, help="routed experts (default 256)")
    q.add_argument("--expert-bits", type=int, default=4, help="random affine-quantized experts; 0: float")


def bench_model(a):
    """Prefill and decode tokens/s of a model of given dims (random weights)."""
    from ds4_mlx.session import Session

    model = _model_for(a)
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
    figures = {"layers": model.args.num_hidden_layers, "hidden": model.args.hidden_size,
               "experts": model.args.n_routed_experts, "expert_bits": a.expert_bits, "prompt": a.prompt,
               "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}
    print(f"prefill {figures['prefill_tok_s']:.1f} tok/s ({a.prompt} tokens), "
          f"decode {figures['decode_tok_s']:.2f} tok/s (median of {a.decode} steps)")
    return figures


def _bench_model_options(q):
    _model_options(q)
    q.add_argument("--prompt", type=int, default=512)
    q.add_argument("--decode", type=int, default=16)
    q.add_argument("--repeats", type=int, default=1)


def bench_rewind(a):
    """Resend after an aborted stream against a cold prefill, at several context lengths."""
    from ds4_mlx.session import Session

    model = _model_for(a)
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        prompt = rng.integers(0, vocab, ctx).tolist()
        s = Session(model)
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
               "max_logit_diff": max(diffs), "session_mb": s.nbytes / 2**20}
        rows.append(row)
        print(f"ctx {ctx}: cold {cold_s:.2f} s, resend {row['resend_s'] * 1000:.1f} ms "
              f"(computed {row['computed']} tokens), ratio {row['ratio']:.5f}, "
              f"max |logit diff| {row['max_logit_diff']:.2e}, session {row['session_mb']:.0f} MB")
    return {"generated": a.generated, "results": rows}


def _bench_rewind_options(q):
    _model_options(q)
    q.add_argument("--contexts", default="2048,8192,32768")
    q.add_argument("--generated", type=int, default=37, help="tokens streamed before the abort")
    q.add_argument("--repeats", type=int, default=3)


def bench_convert(a):
    """Convert a synthetic GGUF of real V4 Flash widths: peak RSS and MB/s."""
    from ds4_mlx.convert.bench import bench_convert as run

    return run(size_gb=a.size_gb)


def _bench_convert_options(q):
    q.add_argument("--size-gb", type=float, default=4.0)


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
    ("load", bench_load, _bench_load_options),
]
