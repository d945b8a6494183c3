"""Models with random weights for the benchmarks and the tests: any widths, drawn in MLX, optionally
with affine-quantized routed experts; and the benchmarks' model chosen by their flags."""

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


def model_from_flags(a):
    """The bench's model: the tiny test model, or real widths with random quantized experts, `--layers`
    of [CSA, HCA, ...] or with `--full` the real model's 43 layers and layer kinds; cast to `--dtype`."""
    if a.preset == "tiny":
        from ds4_mlx.tools.testing import tiny_args

        model = random_model(tiny_args(), seed=0)
    else:
        overrides = {"n_routed_experts": a.experts} if getattr(a, "experts", None) else {}
        args = ModelArgs(**overrides) if a.full else real_args(a.layers, **overrides)
        model = random_model(args, seed=0, expert_bits=a.expert_bits or None,
                             dtype=mx.bfloat16 if a.dtype == "bfloat16" else mx.float32)
    if a.dtype != "float32":
        model.cast(getattr(mx, a.dtype))
    return model
