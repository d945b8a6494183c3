"""Models with random weights for the benchmarks and the tests: any widths, drawn in MLX, optionally
with affine-quantized routed experts; and the benchmarks' model chosen by their flags."""

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.deepseek_v4 import Model
from ds4_mlx.models.linear import file_weights, held_transposed


# `--expert-format q2`: the published q2 file's routed experts, kept in their GGUF blocks
NATIVE_EXPERT_FORMATS = {"q2": {"gate": "iq2_xxs", "up": "iq2_xxs", "down": "q2_k"}}


def random_model(args: ModelArgs, *, seed=0, expert_bits=None, quant_sim=False, dtype=mx.float32,
                 expert_format="affine"):
    """A model with random weights drawn in MLX (fast at real widths). With `expert_bits`, the routed
    experts are random affine-quantized weights, never materialised in float (group 64 at 2 bits, as the
    converter writes the q2 file's experts; group 32 otherwise). `expert_format` "q2": random valid
    IQ2_XXS gate/up and Q2_K down blocks, kept native (`NATIVE_EXPERT_FORMATS`), instead."""
    from ds4_mlx.models import gguf_blocks

    model = Model(args, quant_sim=quant_sim)
    codecs = {}
    if expert_format != "affine":
        codecs = {f"layers.{i}.ffn.experts.{p}.weight": codec for i in range(args.num_hidden_layers)
                  for p, codec in NATIVE_EXPERT_FORMATS[expert_format].items()}
        model.apply_quantization({name.removesuffix(".weight"): {"gguf_type": codec} for name, codec in codecs.items()})
    elif expert_bits:
        group = 64 if expert_bits == 2 else 32
        model.apply_quantization({f"layers.{i}.ffn.experts.{p}": {"group_size": group, "bits": expert_bits,
                                                                   "mode": "affine"}
                                  for i in range(args.num_hidden_layers) for p in ("gate", "up", "down")})
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    params = {}
    for name, v in file_weights(model).items():  # drawn as a file holds them, then held as the model does
        if name.endswith("tid2eid"):  # distinct experts per token
            rows = np.argsort(rng.random((v.shape[0], args.n_routed_experts)), axis=1)[:, : v.shape[1]]
            params[name] = mx.array(rows.astype(np.int32))
        elif name in codecs:
            params[name] = gguf_blocks.random_blocks(codecs[name], v.shape, seed + len(params))
            mx.eval(params[name])  # one stack's temporaries at a time (the full model's are ~80 GB)
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
    model.update(tree_unflatten(list(held_transposed(model, params).items())))
    mx.eval(model.parameters())
    return model


def real_args(layers=2, **overrides):
    """V4 Flash widths with a few layers: a CSA and an HCA layer first, as the real model's layers 2 and 3."""
    ratios = ([4, 128] * layers)[:layers]
    return ModelArgs(num_hidden_layers=layers, compress_ratios=ratios, num_hash_layers=0, **overrides)


def model_from_flags(a):
    """The bench's model: the tiny test model, or real widths with random quantized experts, `--layers`
    of [CSA, HCA, ...] or with `--full` the real model's 43 layers and layer kinds; with `--like` every
    weight in the type and layout converting that published file gives; cast to `--dtype`."""
    if a.like and a.expert_bits is not None:
        raise ValueError("--expert-bits and --like both set the experts' format: give one")
    if a.preset == "tiny":
        from ds4_mlx.tools.testing import tiny_args

        # with --like, expert widths that hold the file's 64-wide groups
        args = tiny_args(moe_intermediate_size=64) if a.like else tiny_args()
        model = published_model(args, a.like, quant_sim=a.quant_sim) if a.like else random_model(args, seed=0)
    else:
        overrides = {"n_routed_experts": a.experts} if getattr(a, "experts", None) else {}
        args = ModelArgs(**overrides) if a.full else real_args(a.layers, **overrides)
        if a.like:
            model = published_model(args, a.like, quant_sim=a.quant_sim)
        else:
            bits = 4 if a.expert_bits is None else a.expert_bits
            model = random_model(args, seed=0, expert_bits=bits or None,
                                 dtype=mx.bfloat16 if a.dtype == "bfloat16" else mx.float32,
                                 expert_format=getattr(a, "expert_format", "affine"))
    if a.dtype != "float32":
        model.cast(getattr(mx, a.dtype))
    return model


def expert_bits(a):
    """The routed experts' bits a bench reports: --expert-bits's (4 by default), None for the tiny
    model's float experts and for a --like layout (its plan says)."""
    if a.preset == "tiny" or a.like:
        return None
    return 4 if a.expert_bits is None else a.expert_bits


def published_layout(args: ModelArgs, variant: str, native: bool):
    """({file param: (safetensors dtype, shape)}, {module: quantization format}) of the folder that
    converting the published `variant` file ("q2" or "q4") of a model of `args` gives: the converter's
    own plan (`convert.gguf.TensorPlan`) applied to the published files' tensor types
    (`tools.bench_convert.tensor_type`), so the bench and the converter cannot drift apart. `native`: the
    routed experts keep their GGUF blocks (the converter's choice where it has a fast path for them)."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as T

    from ds4_mlx.tools.bench_convert import PUBLISHED, tensor_type
    from ds4_mlx.convert.gguf import TensorPlan
    from ds4_mlx.convert.requant import affine_format
    from ds4_mlx.demo import gguf_shapes
    from ds4_mlx.models.gguf_names import mlx_name

    experts = tuple(T[n] for n in PUBLISHED[variant])
    arrays, quantization = {}, {}
    for name, shape in gguf_shapes(args).items():
        tensor = SimpleNamespace(name=name, tensor_type=tensor_type(name, shape, experts),
                                 shape=np.array(shape[::-1]), data_offset=0, n_bytes=0)  # GGML order
        plan = TensorPlan(tensor, mlx_name(name), None, affine_format, native)
        if plan.packed and not plan.quantized:
            raise ValueError(f"{name}: the bench cannot draw a packed float parameter")
        if plan.quantized:
            quantization[plan.module] = dict(plan.fmt)
        for path, dtype, out_shape in plan.outputs():
            arrays[path] = (dtype, tuple(out_shape))
    return arrays, quantization


_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32, "U8": mx.uint8,
           "I32": mx.int32}


def published_model(args: ModelArgs, variant: str, seed=0, native=None, quant_sim=False):
    """A model of `args` with random weights in the published `variant` file's converted layout
    (`published_layout`; `native` experts by default where this machine computes them at speed), loaded
    as a converted folder is (`quant_sim`: ds4's roundings of cached rows, the loader's default). Each array
    is drawn and evaluated on its own, so building holds the weights and little more."""
    from ds4_mlx.loader import build_model as load_model
    from ds4_mlx.models.gguf_blocks import native_available

    if native is None:  # as the converter chooses, where the widths hold whole GGUF blocks (the tiny model's do not)
        native = native_available() and args.hidden_size % 256 == args.moe_intermediate_size % 256 == 0
    layout, quantization = published_layout(args, variant, native)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    weights = {}
    for path, (dtype, shape) in layout.items():
        module, _, leaf = path.rpartition(".")
        fmt = quantization.get(module)
        fmt = fmt if leaf in ("weight", "scales", "biases") else None
        weights[path] = _random_weight(path, shape, _DTYPES[dtype], fmt, args, rng)
        mx.eval(weights[path])
    return load_model(args, weights, quantization, quant_sim=quant_sim)


def _random_weight(path, shape, dtype, fmt, args, rng):
    """One array of `published_model`: quantized codes, scales and biases for a unit-variance-per-row
    product (`fmt` set), or float values as `random_model` draws them."""
    if fmt is not None:
        return quantized_part(path, shape, dtype, fmt)
    if path.endswith("tid2eid"):  # distinct experts per token
        rows = np.argsort(rng.random((shape[0], args.n_routed_experts)), axis=1)[:, : shape[1]]
        return mx.array(rows.astype(np.int32))
    if path.endswith("norm.weight"):
        return (1 + 0.1 * mx.random.normal(shape)).astype(dtype)
    if len(shape) >= 2:
        return (mx.random.normal(shape) / np.sqrt(shape[-1])).astype(dtype)
    return (0.5 * mx.random.normal(shape)).astype(dtype)


def quantized_part(path, shape, dtype, fmt):
    """Random codes (".weight") or the scales and biases that make uniform codes a zero-mean weight of
    standard deviation 1/sqrt(input width). The one place that knows the formats the converter keeps:
    a new one (native GGUF blocks) is drawn here."""
    if "gguf_type" in fmt:  # native GGUF blocks
        from ds4_mlx.models.gguf_blocks import random_blocks

        return random_blocks(fmt["gguf_type"], shape, seed=len(path))
    if fmt["mode"] != "affine":
        raise ValueError(f"{path}: the bench cannot draw {fmt['mode']} weights yet")
    if path.endswith(".weight"):
        return mx.view(mx.random.randint(-(2**31), 2**31 - 1, shape), mx.uint32)  # words of packed codes
    bits, width = fmt["bits"], shape[-1] * fmt["group_size"]  # the input width, from the scales' shape
    top = 2**bits - 1
    scale = 1 / (np.sqrt(width) * np.sqrt((top + 1) ** 2 - 1) / np.sqrt(12))  # codes' std: sqrt((n^2-1)/12)
    value = scale if path.endswith(".scales") else -scale * top / 2
    return mx.full(shape, value, dtype)


def like_option(q):
    q.add_argument("--like", choices=["q2", "q4"], default=None,
                   help="every weight in the type and layout converting that published file gives (the "
                        "attention projections, shared experts and head 8-bit, HC, compressor, indexer, router "
                        "and embedding float16, experts as the converter keeps IQ2_XXS/Q2_K or Q4_K); without "
                        "it, all but the experts in --dtype")
    q.add_argument("--quant-sim", action="store_true",
                   help="with --like, the roundings loading a file applies by default (ds4's FP8 kv rows and FP4 "
                        "indexer rows); off by default, as the earlier figures were measured")
