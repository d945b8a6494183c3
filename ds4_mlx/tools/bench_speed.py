"""`ds4-mlx bench speed`: prefill and decode tokens/s at real V4 Flash widths, peak memory, the decode
roofline fraction, optionally transformers' DeepseekV4ForCausalLM timed on the same layers (`--peer`),
and with `--profile` where one decode step and one prefill chunk spend their time."""

import gc
import os
import statistics
import sys
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from ds4_mlx.cache.geometry import rows_done

# HBM bandwidth used for the roofline: H200 141 GB HBM3e, 4.8 TB/s (NVIDIA's figure)
BANDWIDTH = {"cuda": 4.8e12}


class _NullTokenizer:
    """What `stream_generate` needs from a tokenizer, for a model with random weights."""

    eos_id = -1

    def decode(self, ids):
        return ""


def _weight_bytes_per_token(model):
    """Bytes of weights one decode step reads: all but the routed experts, plus k of them a layer."""
    from mlx.utils import tree_flatten

    args, total = model.args, 0
    for name, v in tree_flatten(model.parameters()):
        if name.startswith("embed.") or name.endswith("tid2eid"):
            continue  # one row of the embedding; the hash table is indexed
        if ".ffn.experts." in name:
            total += v.nbytes * args.num_experts_per_tok / args.n_routed_experts
        else:
            total += v.nbytes
    return total


def _cache_bytes_read(model, context):
    """Bytes of cache one decode step reads at `context`: window rows, plus compressed rows (all of an
    HCA layer's, top-k of a CSA layer's, and the CSA indexer's keys)."""
    args, total = model.args, 0
    for i in range(args.num_hidden_layers):
        ratio = args.compress_ratios[i]
        rows = args.sliding_window
        if ratio == 4:
            rows += min(args.index_topk, rows_done(context, 4))
            total += rows_done(context, 4) * args.index_head_dim * 4
        elif ratio:
            rows += rows_done(context, ratio)
        total += rows * args.head_dim * 4
    return total


def measure_context(model, context, decode_steps, chunk, rng):
    """Cold prefill of `context` random tokens, then `decode_steps` pipelined greedy tokens."""
    from ds4_mlx.generate import SamplingParams, stream_generate
    from ds4_mlx.session import Session

    vocab = model.args.vocab_size
    session = Session(model, rewind_slack=0, max_chunk=chunk, checkpoint_every=1 << 30)
    session.sync(rng.integers(0, vocab, min(chunk, context)).tolist())  # kernel warm-up (JIT, autotune)
    mx.eval(session.logits)
    session.reset()
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    prompt = rng.integers(0, vocab, context).tolist()
    t = time.perf_counter()
    mx.eval(session.sync(prompt))
    prefill_s = time.perf_counter() - t
    stamps = []
    for chunk_out in stream_generate(session, _NullTokenizer(), prompt, max_tokens=decode_steps,
                                     sampling=SamplingParams(temperature=0), stop_ids=[]):
        stamps.append(time.perf_counter())
    steps = np.diff(stamps)
    steady = steps[len(steps) // 4 :]  # past MLX's kernel warm-up at this context
    decode_s = float(statistics.median(steady))
    return {"context": context, "prefill_s": prefill_s, "prefill_tok_s": context / prefill_s,
            "decode_tok_s": 1 / decode_s, "decode_ms": decode_s * 1000,
            "peak_gib": mx.get_peak_memory() / 2**30, "session_mib": session.nbytes / 2**20}


# ---------------------------------------------------------------------------------------------- profile


@contextmanager
def _timed_parts(times, detail=False):
    """Evaluate and time each part of every layer (HC pre, attention, MoE, HC post) as it is called.
    The syncs between parts inflate every figure a little; the split is what the profile is for. The
    parts run uncompiled (DS4_MLX_COMPILE=0): a compiled graph has no parts to time."""
    from ds4_mlx.models import attention
    from ds4_mlx.models.hyper import HyperConnection, HyperHead
    from ds4_mlx.models.linear import QuantizedGroupedLinear, QuantizedLinear
    from ds4_mlx.models.moe import MoE

    patched = []
    compile_setting = os.environ.get("DS4_MLX_COMPILE")
    os.environ["DS4_MLX_COMPILE"] = "0"

    def wrap(owner, name, label, static=False):
        fn = getattr(owner, name)
        original = owner.__dict__[name] if isinstance(owner, type) else fn

        def timed(*args, **kw):
            mx.eval([a for a in args if isinstance(a, mx.array)])
            t = time.perf_counter()
            out = fn(*args, **kw)
            mx.eval(out)
            times[label] = times.get(label, 0.0) + time.perf_counter() - t
            return out

        patched.append((owner, name, original))
        setattr(owner, name, staticmethod(timed) if static else timed)

    try:  # a part that cannot be wrapped puts back those that were
        wrap(HyperConnection, "pre", "hc_pre")
        wrap(HyperConnection, "post", "hc_post", static=True)
        wrap(attention.Attention, "project", "attention")
        wrap(attention.Attention, "attend", "attention")
        wrap(MoE, "__call__", "moe")
        wrap(HyperHead, "__call__", "head")
        if detail:  # inside attention (nested: these are part of its figure)
            wrap(attention.Attention, "_compress", "attn.compress")
            wrap(attention.Attention, "_top_rows", "attn.select")
            wrap(attention, "attend", "attn.attend")
            wrap(attention, "decode_attention", "attn.attend")
            # quantized dense products wherever they are (attention, shared experts, head), dequantizing included
            wrap(QuantizedLinear, "__call__", "dense.quantized")
            wrap(QuantizedGroupedLinear, "__call__", "dense.quantized")
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
        if compile_setting is None:
            del os.environ["DS4_MLX_COMPILE"]
        else:
            os.environ["DS4_MLX_COMPILE"] = compile_setting


def profile(model, context, chunk, rng):
    """Per-part seconds of one prefill chunk (the last of a `context` prefill) and one decode step."""
    from ds4_mlx.session import Session

    vocab = model.args.vocab_size
    s = Session(model, rewind_slack=0, max_chunk=chunk, checkpoint_every=1 << 30)
    mx.eval(s.sync(rng.integers(0, vocab, context - chunk).tolist()))
    out = {}
    for label, tokens in (("prefill_chunk", chunk), ("decode_step", 1)):
        for _ in range(2 if tokens == 1 else 1):  # decode: the second step, past kernel warm-up
            times = {}
            ids = rng.integers(0, vocab, tokens).tolist()
            with _timed_parts(times, detail=True):
                t = time.perf_counter()
                mx.eval(s._feed(ids))
                times["total"] = time.perf_counter() - t
        # graph building alone (no evaluation), for the same work; the second time, once it is traced
        snap = s.snapshot()
        for _ in range(2):
            t = time.perf_counter()
            model(mx.array([ids], dtype=mx.int32), s.cache, last_only=True)
            times["graph_build"] = time.perf_counter() - t
            s.restore(snap)
        times["other"] = times["total"] - sum(v for k, v in times.items()
                                              if k not in ("total", "graph_build") and "." not in k)
        out[label] = {k: round(v * 1000, 3) for k, v in times.items()}
        out[label]["tokens"] = tokens
    return out


# ---------------------------------------------------------------------------------------------- dense


def dense_products(a):
    """Quantized dense products at prefill sizes: quantized_matmul against dequantize + dense product.

    Milliseconds of each quantized dense product of a layer (and the head) at several row counts,
    through mx.quantized_matmul and through the weight dequantized once plus a dense product (the two
    paths of `QuantizedLinear`), the dequantization alone, and the dense product of a kept dequantized
    copy (what keeping one would save): where `DEQUANTIZE_FROM_ROWS` should sit."""
    from ds4_mlx.models import linear

    args = _bench_args(a)
    dtype = getattr(mx, a.dtype)
    H, nh, hd, G = args.hidden_size, args.num_attention_heads, args.head_dim, args.o_groups
    shapes = {"q_a": (H, args.q_lora_rank), "q_b": (args.q_lora_rank, nh * hd), "kv": (H, hd),
              "o_a": (G, nh * hd // G, args.o_lora_rank), "o_b": (G * args.o_lora_rank, H),
              "shared_up": (H, args.moe_intermediate_size), "shared_down": (args.moe_intermediate_size, H),
              "lm_head": (H, args.vocab_size)}
    fmt = {"group_size": a.group_size, "bits": a.bits, "mode": "affine"}
    rows_list = [int(r) for r in a.rows.split(",")]
    results, crossover = [], {}
    forced = os.environ.get("DS4_MLX_DENSE_PATH")
    try:
        for name, shape in shapes.items():
            dense = linear.GroupedLinear(*shape) if len(shape) == 3 else linear.Linear(*shape)
            dense.weight = (mx.random.normal(dense.weight.shape) / np.sqrt(dense.weight.shape[-1])).astype(dtype)
            layer = dense.to_quantized(**fmt)
            layer.weight, layer.scales, layer.biases = mx.quantize(dense.weight, **fmt)
            kept = linear.dequantized(layer, dtype)
            mx.eval(layer.parameters(), kept)
            del dense
            width = shape[-2] if len(shape) == 3 else shape[0]
            for rows in rows_list:
                x = mx.random.normal((rows, G, width) if len(shape) == 3 else (rows, width)).astype(dtype)
                row = {"product": name, "rows": rows}
                for path in linear.DENSE_PATHS:
                    os.environ["DS4_MLX_DENSE_PATH"] = path
                    row[f"{path}_ms"] = _median_ms(lambda: layer(x), a.repeats)
                row["dequantize_weight_ms"] = _median_ms(lambda: linear.dequantized(layer, dtype), a.repeats)
                row["kept_copy_ms"] = _median_ms(lambda: linear.grouped_product(x, kept) if len(shape) == 3
                                                 else x @ kept.T, a.repeats)
                results.append(row)
                if row["dequantize_ms"] < row["quantized_ms"] and name not in crossover:
                    crossover[name] = rows
                print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
    finally:
        if forced is None:
            os.environ.pop("DS4_MLX_DENSE_PATH", None)
        else:
            os.environ["DS4_MLX_DENSE_PATH"] = forced
    return {"preset": a.preset, "dtype": a.dtype, "format": f"affine {a.bits}-bit g{a.group_size}",
            "dequantize_faster_from_rows": ", ".join(f"{k} {v}" for k, v in crossover.items()) or "never",
            "results": results}


def _bench_args(a):
    from ds4_mlx.tools.random_model import real_args
    from ds4_mlx.tools.testing import tiny_args

    return tiny_args() if a.preset == "tiny" else real_args(1)


def _median_ms(fn, repeats):
    mx.eval(fn())  # warm-up: kernel compilation
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def dense_options(q):
    q.add_argument("--preset", choices=["real", "tiny"], default=None,
                   help="real: V4 Flash widths; tiny: the test model's (default: tiny on a CPU, real on a GPU)")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="compute dtype")
    q.add_argument("--rows", default="1,8,16,32,64,128,512,2048", help="row counts, comma-separated")
    q.add_argument("--bits", type=int, default=8)
    q.add_argument("--group-size", type=int, default=32)
    q.add_argument("--repeats", type=int, default=5, help="timed calls a case (their median is reported)")


# ---------------------------------------------------------------------------------------------- peer


def peer_transformers(model_args, contexts, decode_steps, rng):
    """transformers' DeepseekV4ForCausalLM (eager, bf16, dense experts, same layer kinds and widths) on
    the GPU: prefill tok/s (one forward) and decode tok/s (median step after warm-up)."""
    import torch

    from ds4_mlx.tools.testing import hf_config
    from transformers import DeepseekV4ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cfg = hf_config(model_args)
    cfg.torch_dtype = torch.bfloat16
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            peer = DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    rows = []
    for context in contexts:
        ids = torch.tensor(rng.integers(0, model_args.vocab_size, (1, context)), device=device)
        try:
            with torch.no_grad():
                peer(ids[:, :256], use_cache=False)  # warm-up
                sync()
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                out = peer(ids, use_cache=True)
                sync()
                prefill_s = time.perf_counter() - t
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                steps = []
                for _ in range(decode_steps):
                    t = time.perf_counter()
                    out = peer(token, past_key_values=cache, use_cache=True)
                    token = out.logits[:, -1:].argmax(-1)
                    sync()
                    steps.append(time.perf_counter() - t)
            decode_s = statistics.median(steps[len(steps) // 4 :])
            rows.append({"context": context, "prefill_tok_s": context / prefill_s, "decode_tok_s": 1 / decode_s,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None})
        except torch.OutOfMemoryError:
            rows.append({"context": context, "error": "out of memory"})
        finally:
            out = cache = None
            if device == "cuda":
                torch.cuda.empty_cache()
    del peer
    return rows


# ---------------------------------------------------------------------------------------------- command


def bench_speed(a):
    """Prefill/decode tok/s at real widths against the roofline (and transformers with --peer)."""
    from ds4_mlx.tools.random_model import expert_bits, model_from_flags
    from ds4_mlx.models.kernels import backend

    model = model_from_flags(a)
    rng = np.random.default_rng(0)
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.preset == "tiny":
        contexts = [min(c, 512) for c in contexts[:1]]
    bandwidth = a.bandwidth_gbs * 1e9 if a.bandwidth_gbs else BANDWIDTH.get(backend())
    weights = _weight_bytes_per_token(model)
    rows = []
    for context in contexts:
        row = measure_context(model, context, a.decode, a.chunk, rng)
        read = weights + _cache_bytes_read(model, context)
        row["decode_bytes_read"] = read
        row["roofline_fraction"] = read * row["decode_tok_s"] / bandwidth if bandwidth else None
        rows.append(row)
        print(f"ctx {context:>6}: prefill {row['prefill_tok_s']:8.0f} tok/s ({row['prefill_s']:.2f} s), decode "
              f"{row['decode_tok_s']:6.1f} tok/s ({row['decode_ms']:.2f} ms), peak {row['peak_gib']:.1f} GiB"
              + (f", roofline {row['roofline_fraction']:.1%}" if bandwidth else ""), file=sys.stderr, flush=True)
    figures = {"preset": a.preset, "layers": model.args.num_hidden_layers, "hidden": model.args.hidden_size,
               "experts": model.args.n_routed_experts, "expert_bits": expert_bits(a), "like": a.like,
               "quant_sim": a.quant_sim, "expert_format": a.expert_format if a.preset == "real" else "affine",
               "dtype": a.dtype,
               "chunk": a.chunk, "backend": backend() or "cpu", "bandwidth_bytes_s": bandwidth,
               "weight_bytes_per_token": weights, "results": rows}
    if a.profile:
        figures["profile"] = profile(model, max(a.chunk * 2, a.profile_context), a.chunk, rng)
        for part, times in figures["profile"].items():
            print(part, " ".join(f"{k} {v}" for k, v in times.items()), "(ms)", file=sys.stderr)
    if a.peer:
        args = model.args
        del model
        gc.collect()
        mx.clear_cache()
        peer = peer_transformers(args, contexts, a.decode, rng)
        figures["peer"] = {"name": "transformers eager bf16, dense experts", "results": peer}
        for ours, theirs in zip(rows, peer):
            if "error" in theirs:
                print(f"ctx {ours['context']:>6}: transformers {theirs['error']}", file=sys.stderr)
                continue
            for key in ("prefill_tok_s", "decode_tok_s"):
                ours[f"{key}_vs_peer"] = ours[key] / theirs[key]
            print(f"ctx {ours['context']:>6}: transformers prefill {theirs['prefill_tok_s']:.0f} tok/s, decode "
                  f"{theirs['decode_tok_s']:.1f} tok/s; ours x{ours['prefill_tok_s_vs_peer']:.2f} prefill, "
                  f"x{ours['decode_tok_s_vs_peer']:.2f} decode", file=sys.stderr, flush=True)
    return figures


def options(q):
    from ds4_mlx.tools.random_model import like_option

    q.add_argument("--preset", choices=["real", "tiny"], default=None,
                   help="real: V4 Flash widths, [CSA, HCA] layers with random quantized experts; tiny: the test "
                        "model (default: tiny on a CPU, where real widths need tens of GB and hours)")
    q.add_argument("--layers", type=int, default=4)
    q.add_argument("--full", action="store_true", help="all 43 layers of the real model")
    q.add_argument("--expert-bits", type=int, default=None,
                   help="random affine-quantized experts; 0: float (default: 4)")
    like_option(q)
    q.add_argument("--expert-format", choices=["affine", "q2"], default="affine",
                   help="q2: the published q2 file's experts kept native (random valid IQ2_XXS gate/up, Q2_K "
                        "down blocks) instead of affine --expert-bits ones (real preset; --like q2 keeps them "
                        "native where the converter does)")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="compute dtype (float32 keeps the exact mode)")
    q.add_argument("--contexts", default="2048,8192,32768")
    q.add_argument("--decode", type=int, default=64, help="decode steps timed at each context")
    q.add_argument("--chunk", type=int, default=2048, help="prefill chunk")
    q.add_argument("--peer", choices=["transformers"], default=None)
    q.add_argument("--profile", action="store_true", help="per-part times of a decode step and a prefill chunk")
    q.add_argument("--profile-context", type=int, default=8192, help="context of the profiled steps")
    q.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="device bandwidth for the roofline (default: 4800 on CUDA, the H200)")


# ---------------------------------------------------------------------------------------------- plot


def plot(figures, png_path, before=None):
    """Tokens/s against context (prefill and decode) from `bench speed --json` figures, with the peer's
    and, optionally, `before` ({"context", "prefill_tok_s", "decode_tok_s"} rows) for comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = f"{figures['like']} layout" if figures.get("like") else f"{figures['expert_bits']}-bit experts"
    series = [(f"ds4-mlx ({figures['dtype']}, {layout})", figures["results"], "o-")]
    if "peer" in figures:
        series.append(("transformers eager (bf16, dense experts)", [r for r in figures["peer"]["results"]
                                                                     if "error" not in r], "s--"))
    if before:
        series.append(("ds4-mlx before", before, "x:"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("prefill_tok_s", "decode_tok_s"), ("prefill", "decode")):
        for label, rows, style in series:
            ax.plot([r["context"] for r in rows], [r[key] for r in rows], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{title}, {figures['layers']} layers at V4 Flash widths ({figures['backend']})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":  # python -m ds4_mlx.tools.bench_speed FIGURES.json OUT.png [BEFORE.json]
    import json

    before = json.load(open(sys.argv[3]))["results"] if len(sys.argv) > 3 else None
    plot(json.load(open(sys.argv[1])), sys.argv[2], before)
