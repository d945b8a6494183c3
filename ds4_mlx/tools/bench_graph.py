"""`ds4-mlx bench graph`: the nodes of one decoded token's graph (or of a pooled step of B streams, of a
verify of K drafted rows, or of a prompt chunk's routed experts) as MLX's CUDA build runs it, counted on
any machine. A decoded token is bound by the host's time, which grows with every node (a kernel's
encoding, or a view's bookkeeping), so this count is what the kernel work cuts; a GPU is needed only to
time it (`bench kernels`).

The step takes the CUDA path: the backend's choices, and every custom kernel of `models/kernels.py` and
every fused op of MLX's that runs as one kernel on a GPU (RMS norm, RoPE, softmax, SDPA) as a stand-in
node of its outputs' shapes. Nothing past the prefill that sets up the context is evaluated; the graph is
read back through `mx.export_to_dot`. MLX's compiled element-wise graphs are one node each, as on the
GPU."""

import contextlib
import os
import re
import tempfile
from collections import Counter

import mlx.core as mx
import numpy as np

VIEWS = {"Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "Broadcast", "Flatten", "Unflatten", "AsStrided"}
STAND_IN = "kernel (ours or MLX's fused op)"


@contextlib.contextmanager
def cuda_path():
    """The model's CUDA choices, each custom kernel launch and fused op a stand-in: `mx.depends` of
    placeholders (zeros of its outputs' shapes) on the op's inputs."""
    from ds4_mlx.models import kernels, linear, moe

    def stand_in(inputs, shapes, dtypes):
        placeholders = [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
        return mx.depends(placeholders, [a for a in inputs if isinstance(a, mx.array)])

    def cuda_kernel(**_):
        return lambda inputs, output_shapes, output_dtypes, **__: stand_in(inputs, output_shapes, output_dtypes)

    def like_first(*args, **kwargs):
        return stand_in(list(args) + list(kwargs.values()), [args[0].shape], [args[0].dtype])[0]

    def attention(q, k, v, **kwargs):
        return stand_in([q, k, v] + list(kwargs.values()), [q.shape[:-1] + v.shape[-1:]], [q.dtype])[0]

    patches = [(kernels, "backend", lambda: "cuda"), (linear, "backend", lambda: "cuda"),
               (moe, "backend", lambda: "cuda"), (mx.fast, "cuda_kernel", cuda_kernel),
               (mx.fast, "rms_norm", like_first), (mx.fast, "rope", like_first), (mx, "softmax", like_first),
               (mx.fast, "scaled_dot_product_attention", attention)]
    checked = [k for k in vars(kernels).values() if isinstance(k, kernels.Kernel)]
    checked += [k for table in vars(kernels).values() if isinstance(table, dict)
                for k in table.values() if isinstance(k, kernels.Kernel)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    verdicts = [(k, dict(k.verdicts)) for k in checked]
    factories = [f for f in vars(kernels).values() if hasattr(f, "cache_clear")]  # they keep what they made
    was_on = kernels._enabled

    def forget_traces_and_kernels(on):
        kernels.use_kernels(on)  # a new generation: compiled graphs are traced anew
        for f in factories:
            f.cache_clear()

    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        for k in checked:
            k.verdicts["cuda"] = True
        forget_traces_and_kernels(True)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        for k, v in verdicts:
            k.verdicts = v
        forget_traces_and_kernels(was_on)  # nothing traced or made with the stand-ins outlives them


def count_nodes(outputs):
    """Nodes of the graph that computes `outputs`, by primitive: the stand-ins under STAND_IN, the
    placeholders they are made of not counted."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "graph.dot")
        mx.export_to_dot(path, outputs)
        text = open(path).read()
    labels = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)"', text))
    inputs, producer, outputs = {}, {}, Counter()
    for source, target in re.findall(r'^"?(\w+)"? -> "?(\w+)"?$', text, re.M):
        if source in labels:  # a node's output array
            producer[target] = source
            outputs[source] += 1
        else:  # in the order of the node's inputs
            inputs.setdefault(target, []).append(source)
    made_up = set()  # the stand-ins' placeholders: a Depends' first inputs (as many as its outputs), and
    # all that makes them (zeros of a shape: a few nodes on a scalar)
    stack = [producer.get(a) for node, label in labels.items() if label == "Depends"
             for a in inputs.get(node, [])[: outputs[node]]]
    while stack:
        node = stack.pop()
        if node is not None and node not in made_up:
            made_up.add(node)
            stack += [producer.get(a) for a in inputs.get(node, [])]
    counts = Counter(label for node, label in labels.items() if node not in made_up)
    if "Depends" in counts:
        counts[STAND_IN] = counts.pop("Depends")
    return counts


def _step_graph(model, sessions, rows):
    """The lazy graph of one step: each session's next token (one session: its own step; several: the
    pool's), or `rows` drafted tokens verified on one session (logits at every row)."""
    from ds4_mlx.cache.pool import Pool

    caches = [s.cache for s in sessions]
    if rows > 1:
        ids = mx.array([sessions[0].tokens[-rows:]], dtype=mx.int32)
        return model.forward(ids, [[c.view(rows) for c in caches[0]]])
    ids = mx.array([[s.tokens[-1]] for s in sessions], dtype=mx.int32)
    if len(sessions) == 1:
        return model.forward(ids, [[c.view(1) for c in caches[0]]], last_only=True)
    pool = Pool(caches)
    mx.eval(pool.arrays)  # built before the step, as a server's pool is
    return model.forward(ids, pool.views(caches), last_only=True)


def _experts_graph(tokens):
    """The lazy graph of a prompt chunk's routed experts (`MoE._experts`) at Flash's widths and expert count,
    GGUF blocks as the q2 file holds them, each token's experts drawn at random. Nothing is evaluated but
    the rows' counts a path may read."""
    from ds4_mlx.models.args import ModelArgs
    from ds4_mlx.models.linear import GGUFSwitchLinear
    from ds4_mlx.models.moe import MoE

    args = ModelArgs()
    H, I, E = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
    layer = MoE(args, args.num_hash_layers)  # a top-k layer; its arrays stay unevaluated zeros
    for name, codec, inputs, outputs in (("gate", "iq2_xxs", H, I), ("up", "iq2_xxs", H, I), ("down", "q2_k", I, H)):
        layer.experts[name] = GGUFSwitchLinear(E, inputs, outputs, codec)
    picks = np.argsort(np.random.default_rng(0).random((tokens, E)), axis=1)[:, : args.num_experts_per_tok]
    return layer._experts(mx.zeros((tokens, H), mx.bfloat16), mx.array(picks.astype(np.int32)))


def bench_graph(a):
    """Nodes of each step's graph (a decoded token, a pooled step of B streams, a verify of K rows) on the
    CUDA path, by kind, for a model of every layer kind at widths that hold the q2 layout's blocks
    (`--like q2`, native experts); and of a prompt chunk's routed experts at Flash's widths."""
    from ds4_mlx.models.args import ModelArgs
    from ds4_mlx.session import Session
    from ds4_mlx.tools.bench_kernels import forks
    from ds4_mlx.tools.random_model import published_model
    from ds4_mlx.tools.testing import tiny_args

    args = tiny_args(hidden_size=256, moe_intermediate_size=256)
    if a.full:  # the real model's layers and their kinds, the heavy ratio at the tiny model's
        real, heavy = ModelArgs(), args.compress_ratios[3]
        args = tiny_args(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=real.num_hidden_layers,
                         compress_ratios=[r if r in (0, 4) else heavy for r in real.compress_ratios],
                         num_hash_layers=real.num_hash_layers)
    model = published_model(args, "q2", native=True, quant_sim=a.quant_sim)
    model.cast(mx.bfloat16)
    rng = np.random.default_rng(0)
    first = Session(model)
    first.sync(rng.integers(0, args.vocab_size, a.context).tolist())
    results = []
    for spec in a.shapes.split(","):
        kind, _, n = spec.partition(":")
        n = int(n or 1)
        if kind not in ("decode", "verify", "experts"):
            raise ValueError(f"unknown shape {spec!r}: use decode, decode:B, verify:K or experts:T")
        streams, rows = (n, 1) if kind == "decode" else (1, n)
        layers = 1 if kind == "experts" else args.num_hidden_layers
        with cuda_path():
            if kind == "experts":
                counts = count_nodes([_experts_graph(n)])
            else:
                counts = count_nodes(list(_step_graph(model, forks(first, streams) if streams > 1 else [first],
                                                      rows)))
        views = sum(v for k, v in counts.items() if k in VIEWS)
        kernels = sum(counts.values()) - views
        results.append({"shape": spec, "streams": streams, "rows": rows, "nodes": sum(counts.values()),
                        "kernels": kernels, "views": views, "per_layer": round(sum(counts.values()) / layers, 1),
                        "most": ", ".join(f"{k} {n}" for k, n in counts.most_common(6))})
        print(f"{spec}: {sum(counts.values())} nodes ({kernels} kernels, {views} views), {layers} layer(s)",
              flush=True)
        for kind, n in counts.most_common():
            print(f"    {n:5d}  {kind}", flush=True)
    kinds = Counter(args.layer_type(i) for i in range(args.num_hidden_layers))
    return {"layers": args.num_hidden_layers, "quant_sim": a.quant_sim,
            "layer_kinds": ", ".join(f"{k} {n}" for k, n in kinds.items()),
            "context": a.context, "results": results}


def options(q):
    q.add_argument("--context", type=int, default=64, help="tokens the sessions hold (the tiny model's window is 8, "
                   "its ratios 4 and 16)")
    q.add_argument("--shapes", default="decode,decode:8,verify:6",
                   help="comma-separated: decode (one token), decode:B (B streams from a pool in one step), "
                   "verify:K (K drafted rows on one session, logits at every row), experts:T (one layer's "
                   "routed experts for a prompt chunk of T tokens, Flash's widths and 256 GGUF experts, on the "
                   "path DS4_MLX_EXPERT_PATH and DS4_MLX_SPAN_BYTES choose)")
    q.add_argument("--quant-sim", action="store_true", help="ds4's roundings of the cached rows (FP8 kv rows, FP4 "
                   "index rows), as loading a file gives by default")
    q.add_argument("--full", action="store_true", help="the real model's layers, their kinds (window, ratio 4, "
                   "the heavy ratio) and hash layers, at the tiny model's widths")
