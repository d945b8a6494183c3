"""DeepSeek V4 Flash in MLX.

One file for the whole family, in the order of one decoder layer (docs/ARCHITECTURE.md walks through
it): hyper-connections, attention with sinks over a sliding window plus compressed rows (ratio 4 with
overlap and an indexer, or a heavy ratio without), the MoE, and the HC head.
The model only does math: all per-layer state lives in `ds4_mlx.cache` objects passed in.
"""

import math
import os
import re
from dataclasses import asdict, dataclass, field
from functools import partial, wraps
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ds4_mlx.cache.geometry import overlaps, window_reach
from ds4_mlx.cache.slots import RingSlots, Slots
from ds4_mlx.models import gguf_blocks, kernels
from ds4_mlx.models.kernels import (attend, backend, clamped_swiglu, decode_attention, hc_mix, hc_project,
                                    routed_experts)
from ds4_mlx.precision import exact_float32, keeps_float32

# routed-expert products for big batches: "gather" (sorted gather_qmm) or "loop" (one product per
# expert); chosen per backend from measurements (docs/PERFORMANCE.md), DS4_MLX_EXPERT_PATH overrides
EXPERT_PATHS = {"cuda": "loop"}


# quantized dense products (attention projections, grouped output projection, shared experts, LM head)
# of at least this many rows dequantize the weight into the compute dtype once a call and run a dense
# product; fewer rows (a decoded token), and backends not listed, keep mx.quantized_matmul. Chosen per
# backend from measurements (docs/PERFORMANCE.md); DS4_MLX_DENSE_PATH=quantized or =dequantize forces
# one path for every product.
DEQUANTIZE_FROM_ROWS = {"cuda": 32}
DENSE_PATHS = ("quantized", "dequantize")


def dequantizes(rows):
    forced = os.environ.get("DS4_MLX_DENSE_PATH")
    if forced:
        if forced not in DENSE_PATHS:
            raise ValueError(f"DS4_MLX_DENSE_PATH must be one of {', '.join(DENSE_PATHS)}, got {forced!r}")
        return forced == "dequantize"
    threshold = DEQUANTIZE_FROM_ROWS.get(backend())
    return threshold is not None and rows >= threshold


def expert_path():
    return os.environ.get("DS4_MLX_EXPERT_PATH") or EXPERT_PATHS.get(backend(), "gather")


INDEXER_TILE_BYTES = 1 << 28

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass
class ModelArgs:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # one entry a layer: 0 = sliding window only, 4 = CSA (overlap + indexer), 128 = HCA (`__post_init__`)
    compress_ratios: list = field(default_factory=lambda: [0, 0] + [4, 128] * 20 + [4])
    num_hash_layers: int = 3
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN on compressed layers: {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow"} or None
    rope_scaling: Optional[dict] = field(
        default_factory=lambda: {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                                 "beta_fast": 32.0, "beta_slow": 1.0})
    max_position_embeddings: int = 1048576
    model_type: str = "deepseek_v4"

    def __post_init__(self):
        ratios = list(self.compress_ratios)
        if len(ratios) != self.num_hidden_layers:
            raise ValueError(f"compress_ratios has {len(ratios)} entries for {self.num_hidden_layers} layers")
        heavy = sorted({r for r in ratios if r not in (0, 4)})
        if any(not isinstance(r, int) or r <= 4 or r % 4 for r in heavy) or len(heavy) > 1:
            raise ValueError(f"compress ratios {heavy} are not DeepSeek V4's: each layer's is 0 (window only), 4 "
                             "(compressed sparse attention) or 128 (heavily compressed; tiny test models shrink it "
                             "to another multiple of 4, one for all layers)")

    def layer_type(self, i):
        r = self.compress_ratios[i]
        return SLIDING if r == 0 else CSA if r == 4 else HCA

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """From our own config.json or a HF DeepSeek V4 config.json."""
        d = dict(d.get("text_config", d))
        if "layer_types" in d and "compress_ratios" not in d:
            rates = {SLIDING: 0, CSA: 4, HCA: 128, **d.get("compress_rates", {})}
            d["compress_ratios"] = [rates[t] for t in d["layer_types"]]
        if "compress_ratios" in d:
            d["compress_ratios"] = list(d["compress_ratios"])[: d.get("num_hidden_layers", 43)]
        if "rope_scaling" not in d and isinstance(d.get("rope_parameters"), dict):
            rp = d["rope_parameters"].get("compress", d["rope_parameters"])
            if rp.get("rope_type", rp.get("type")) == "yarn":
                d["rope_scaling"] = rp
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


# GGUF metadata key (under "deepseek4.") -> ModelArgs field
_GGUF_KEYS = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size", "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings", "attention.head_count": "num_attention_heads",
    "attention.key_length": "head_dim", "rope.dimension_count": "qk_rope_head_dim",
    "attention.q_lora_rank": "q_lora_rank", "attention.output_lora_rank": "o_lora_rank",
    "attention.output_group_count": "o_groups", "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_count": "n_shared_experts", "hash_layer_count": "num_hash_layers",
    "attention.sliding_window": "sliding_window", "attention.indexer.head_count": "index_n_heads",
    "attention.indexer.key_length": "index_head_dim", "attention.indexer.top_k": "index_topk",
    "hyper_connection.count": "hc_mult", "hyper_connection.sinkhorn_iterations": "hc_sinkhorn_iters",
    "hyper_connection.epsilon": "hc_eps", "attention.compress_ratios": "compress_ratios",
    "rope.freq_base": "rope_theta", "attention.compress_rope_freq_base": "compress_rope_theta",
    "expert_weights_scale": "routed_scaling_factor", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
GGUF_REQUIRED = ["block_count", "embedding_length", "attention.head_count", "attention.key_length",
                 "rope.dimension_count", "attention.q_lora_rank", "attention.output_lora_rank",
                 "attention.output_group_count", "expert_count", "expert_used_count",
                 "expert_feed_forward_length", "attention.sliding_window", "attention.compress_ratios"]


def args_from_gguf(meta: dict, vocab_size: int) -> ModelArgs:
    """ModelArgs from `deepseek4.*` GGUF metadata (ds4's or llama.cpp's keys).

    `vocab_size` comes from the caller (token_embd rows), since llama.cpp omits the key.
    """
    p = "deepseek4."
    missing = [p + k for k in GGUF_REQUIRED if p + k not in meta]
    if missing:
        raise ValueError(f"GGUF is missing metadata key {missing[0]}")
    d = {f: meta[p + k] for k, f in _GGUF_KEYS.items() if p + k in meta}
    d["vocab_size"] = vocab_size
    d["compress_ratios"] = [int(r) for r in d["compress_ratios"]][: d["num_hidden_layers"]]
    clamp = meta.get(p + "swiglu_clamp_exp")
    if clamp is not None:
        d["swiglu_limit"] = float(clamp[0] if isinstance(clamp, (list, tuple)) else clamp)
    if p + "rope.scaling.factor" in meta and meta.get(p + "rope.scaling.type", "yarn") == "yarn":
        d["rope_scaling"] = {
            "type": "yarn", "factor": float(meta[p + "rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta.get(p + "rope.scaling.original_context_length", 65536)),
            "beta_fast": float(meta.get(p + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get(p + "rope.scaling.yarn_beta_slow", 1.0)),
        }
    else:
        d["rope_scaling"] = None
    return ModelArgs.from_dict(d)


_TOP_NAMES = {
    "token_embd": "embed.weight", "output_norm": "norm.weight", "output": "lm_head.weight",
    "output_hc_fn": "hc_head.fn", "output_hc_base": "hc_head.base", "output_hc_scale": "hc_head.scale",
}
_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn.fn", "hc_attn_base": "hc_attn.base", "hc_attn_scale": "hc_attn.scale",
    "hc_ffn_fn": "hc_ffn.fn", "hc_ffn_base": "hc_ffn.base", "hc_ffn_scale": "hc_ffn.scale",
    "attn_q_a": "attn.q_a.weight", "attn_q_a_norm": "attn.q_a_norm.weight", "attn_q_b": "attn.q_b.weight",
    "attn_kv": "attn.kv.weight", "attn_kv_a_norm": "attn.kv_norm.weight", "attn_sinks": "attn.sinks",
    "attn_output_a": "attn.o_a.weight", "attn_output_b": "attn.o_b.weight",
    "attn_compressor_kv": "attn.compressor.kv.weight", "attn_compressor_gate": "attn.compressor.gate.weight",
    "attn_compressor_ape": "attn.compressor.ape", "attn_compressor_norm": "attn.compressor.norm.weight",
    "indexer.attn_q_b": "attn.indexer.q_b.weight", "indexer.proj": "attn.indexer.proj.weight",
    "indexer_compressor_kv": "attn.indexer.compressor.kv.weight",
    "indexer_compressor_gate": "attn.indexer.compressor.gate.weight",
    "indexer_compressor_ape": "attn.indexer.compressor.ape",
    "indexer_compressor_norm": "attn.indexer.compressor.norm.weight",
    "ffn_gate_inp": "ffn.gate.weight", "exp_probs_b": "ffn.bias", "ffn_gate_tid2eid": "ffn.tid2eid",
    "ffn_gate_exps": "ffn.experts.gate.weight", "ffn_up_exps": "ffn.experts.up.weight",
    "ffn_down_exps": "ffn.experts.down.weight",
    "ffn_gate_shexp": "ffn.shared.gate.weight", "ffn_up_shexp": "ffn.shared.up.weight",
    "ffn_down_shexp": "ffn.shared.down.weight",
}


def held_name(name: str, layers: range, n_layers: int) -> Optional[str]:
    """The name of parameter `name` (`layers.{i}...`, or the embedding's and the head's) in a `Model` of
    `n_layers` layers holding only `layers`, or None when it holds no such parameter."""
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        i = int(m.group(1))
        return f"layers.{i - layers.start}.{name[m.end():]}" if i in layers else None
    first = name.split(".")[0] == "embed"
    return name if (layers.start == 0 if first else layers.stop == n_layers) else None


def mlx_name(gguf_name: str) -> Optional[str]:
    """The model parameter path for a GGUF tensor name (ds4 and llama.cpp spellings), or None if unknown.

    Arrays keep the GGUF numpy order, which is already MLX's [out, in] (experts [E, out, in])."""
    base = re.sub(r"\.(weight|bias)$", "", gguf_name)
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", base)
    if m:
        sub = _LAYER_NAMES.get(m.group(2))
        return f"layers.{m.group(1)}.{sub}" if sub else None
    return _TOP_NAMES.get(base)


def expected_gguf_names(args: ModelArgs) -> list:
    """GGUF base names (no .weight/.bias suffix) a complete model file must hold."""
    names = ["token_embd", "output_norm", "output", "output_hc_fn", "output_hc_base", "output_hc_scale"]
    for i in range(args.num_hidden_layers):
        t = args.layer_type(i)
        for k in _LAYER_NAMES:
            if k.startswith("attn_compressor") and t == SLIDING:
                continue
            if k.startswith("indexer") and t != CSA:
                continue
            if k == "exp_probs_b":  # optional: a zero bias when absent
                continue
            if k == "ffn_gate_tid2eid" and i >= args.num_hash_layers:
                continue
            names.append(f"blk.{i}.{k}")
    return names


# ---------------------------------------------------------------------------------------------
# Numerics shared by the layers


def rms_norm(x, weight, eps):
    return mx.fast.rms_norm(x, weight, eps)


def yarn_inv_freq(dim, base, scaling):
    """Inverse frequencies of the rotary pairs; YaRN blends interpolated and original frequencies
    (magnitude scaling is cancelled, as in the official model)."""
    inv = 1.0 / (base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
    if not scaling:
        return inv
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.get("beta_fast", 32.0))), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow", 1.0))), dim - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dim // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: original frequency, 0: interpolated by `factor`
    return inv / factor * (1 - keep) + inv * keep


class Rope:
    """Interleaved-pair rotary embedding on the last `dim` features of each head."""

    def __init__(self, dim, base, scaling=None):
        self.dim = dim
        self.periods = 1.0 / yarn_inv_freq(dim, base, scaling)  # mx.fast.rope takes 1 / frequency
        self._full = {}
        mx.eval(self.periods)  # a lazy array would tie the model to the building thread's stream

    def full_periods(self, width):
        """Periods for all `width` features: infinite for the leading pairs, whose angle is then 0 and
        which come out unchanged (exactly), so a whole head rotates in one op with no split."""
        if width not in self._full:
            full = mx.concatenate([mx.full(((width - self.dim) // 2,), mx.inf), self.periods])
            mx.eval(full)
            self._full[width] = full
        return self._full[width]

    def __call__(self, x, start, step=1, inverse=False):
        """x [T, ..., D] holds positions start, start + step, ... along its first axis; or, with `start`
        an int array [T], row t is at position start[t] (tokens of several sessions decoded together)."""
        D = x.shape[-1]
        if isinstance(start, mx.array) and start.ndim == 1:
            t = x.reshape(x.shape[0], -1, 1, D)  # one position per row: mx.fast.rope's per-batch offsets
            t = mx.fast.rope(t, D, traditional=True, base=None, scale=-1.0 if inverse else 1.0, offset=start,
                             freqs=self.full_periods(D))
            return t.reshape(x.shape)
        t = x.reshape(x.shape[0], -1, D).swapaxes(0, 1)  # mx.fast.rope wants [.., T, D]
        t = mx.fast.rope(t, D, traditional=True, base=None, scale=-step if inverse else step,
                         offset=start if step == 1 else start // step, freqs=self.full_periods(D))
        return t.swapaxes(0, 1).reshape(x.shape)


def fp8_e4m3_sim(x, block=64):
    """Round trip through FP8 E4M3 with a power-of-two scale per `block` values (ds4's KV rows)."""
    shape = x.shape
    block = min(block, shape[-1])  # tiny test models have narrower heads
    x = x.reshape(shape[:-1] + (shape[-1] // block, block)).astype(mx.float32)
    amax = mx.maximum(mx.max(mx.abs(x), axis=-1, keepdims=True), 1e-4)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 448.0)))
    v = mx.clip(x / scale, -448.0, 448.0)
    v = mx.from_fp8(mx.to_fp8(v), dtype=mx.float32)
    return (v * scale).reshape(shape)


_FP4_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_e2m1_round(v):
    """Nearest E2M1 value to v (|v| <= 6), ties to the even grid index."""
    a = mx.abs(v)
    index = sum(((a >= t) if inclusive else (a > t)).astype(mx.int32) for t, inclusive in _FP4_STEPS)
    return mx.sign(v) * mx.array(_FP4_GRID)[index]


def fp4_e2m1_sim(x, block=32):
    shape = x.shape
    block = min(block, shape[-1])
    x = x.reshape(shape[:-1] + (shape[-1] // block, block)).astype(mx.float32)
    amax = mx.maximum(mx.max(mx.abs(x), axis=-1, keepdims=True), 7.052966e-38)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 6.0)))
    v = fp4_e2m1_round(mx.clip(x / scale, -6.0, 6.0))
    return (v * scale).reshape(shape)


def f16_round(x):
    return x.astype(mx.float16).astype(x.dtype)


def hadamard_fp4_sim(x):
    x = mx.hadamard_transform(x.astype(mx.float32), scale=1.0 / math.sqrt(x.shape[-1]))
    return f16_round(fp4_e2m1_sim(x))


def index_rounding(quant_sim):
    """What indexer rows go through before they are stored: FP4 after a Hadamard transform (ds4)."""
    return hadamard_fp4_sim if quant_sim else (lambda r: r)


def _routing_weights(scores, chosen, scaling):
    weights = mx.take_along_axis(scores, chosen, axis=-1)
    return weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * scaling


@mx.compile
def route_top_k(logits, bias, k, scaling):
    """sqrt(softplus) scores; top-k on the biased scores, weights from the unbiased ones, normalised and
    scaled. -> (experts [T, k], weights [T, k])."""
    scores = mx.sqrt(mx.logaddexp(logits.astype(mx.float32), 0.0))
    chosen = mx.argpartition(-(scores + bias), k - 1, axis=-1)[:, :k]
    return chosen, _routing_weights(scores, chosen, scaling)


@mx.compile
def route_hashed(logits, chosen, scaling):
    """The same weights for experts fixed by the token id (hash layers)."""
    return _routing_weights(mx.sqrt(mx.logaddexp(logits.astype(mx.float32), 0.0)), chosen, scaling)


# ---------------------------------------------------------------------------------------------
# Modules


def _row(a, i):
    """a[i] as a view (integer indexing would gather a copy)."""
    return a[i : i + 1].squeeze(0)


def compiled(method):
    """A module method through `mx.compile`, traced per module instance and reading the module's current
    parameters at every call (so loading, quantizing or casting later is seen): fewer graph nodes and no
    Python per op. Traced anew when custom kernels are switched on or off; the plain method when
    DS4_MLX_COMPILE=0. Arguments that are not arrays are constants of a trace (a new value, a new trace)."""
    name = method.__name__

    @wraps(method)
    def call(module, *args):
        if os.environ.get("DS4_MLX_COMPILE", "1") == "0":
            return method(module, *args)
        traces = module.__dict__.setdefault("_compiled", {})
        if traces.get("kernels") != kernels.generation():
            traces.clear()
            traces["kernels"] = kernels.generation()
        if name not in traces:
            traces[name] = _traced_safely(partial(method, module), module.state, lambda: traces.pop(name, None))
        return traces[name](*args)

    return call


def _traced_safely(fn, state, forget):
    """`mx.compile(fn, inputs=state)` that raises what `fn` raises while it is traced. MLX puts the
    module's parameters back after a trace only when it returns: one that raised would leave them as
    tracers, breaking the model for the rest of the process. So the trace returns nothing then, the
    error is raised again outside, and `forget` drops the empty trace."""
    failed = []

    def traced(*args):
        try:
            return fn(*args)
        except BaseException as e:
            failed.append(e)
            return ()

    run = mx.compile(traced, inputs=state)

    def call(*args):
        out = run(*args)
        if failed:
            forget()
            raise failed.pop()
        return out

    return call


def dequantize_into(dtype, weight, scales, biases, *, group_size, bits, mode):
    """`mx.dequantize` into `dtype` values, each rounded once: it computes in the scales' dtype, so float
    scales of another dtype (float16 ones for float32 values) are widened to float32 first."""
    if mx.issubdtype(scales.dtype, mx.floating) and scales.dtype != dtype:
        scales, biases = scales.astype(mx.float32), None if biases is None else biases.astype(mx.float32)
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=dtype)


def dequantized(m, dtype):
    """The weight of quantized layer `m` as `dtype` values (`dequantize_into`)."""
    return dequantize_into(dtype, m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits,
                           mode=m.mode)


class Linear(nn.Linear):
    """A dense layer without bias; quantized, a `QuantizedLinear`."""

    def __init__(self, input_dims, output_dims):
        super().__init__(input_dims, output_dims, bias=False)

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_):
        return QuantizedLinear(self.weight.shape[1], self.weight.shape[0], False, group_size, bits, mode)


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear`; many rows at once (a prefill chunk) go through the weight dequantized into
    their dtype and a dense product where the backend's quantized product is slower (`dequantizes`)."""

    def __call__(self, x):
        if dequantizes(x.size // x.shape[-1]):
            return x @ dequantized(self, x.dtype).T
        return super().__call__(x)


def grouped_product(x, w):
    """x [T, groups, in] with w [groups, out, in] -> [T, groups, out], row j of every token through map j."""
    return (x.swapaxes(0, 1) @ w.swapaxes(-1, -2)).swapaxes(0, 1)


class GroupedLinear(nn.Module):
    """Linear maps [groups, out, in], each token's row j through map j (the grouped output projection)."""

    def __init__(self, groups, input_dims, output_dims):
        super().__init__()
        self.weight = mx.zeros((groups, output_dims, input_dims))

    def __call__(self, x):
        return grouped_product(x, self.weight)

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_):
        return QuantizedGroupedLinear(*self.weight.shape, group_size, bits, mode)


def hold_quantized_stack(module, n, output_dims, input_dims, group_size, bits, mode):
    """Give `module` the arrays of a quantized stack of n [output_dims, input_dims] matrices (zeros until
    its weights load)."""
    module.group_size, module.bits, module.mode = group_size, bits, mode
    w, scales, *biases = mx.quantize(mx.zeros((n, output_dims, input_dims)), group_size, bits, mode=mode)
    module.weight, module.scales = w, scales
    if biases:
        module.biases = biases[0]


class QuantizedGroupedLinear(nn.Module):
    def __init__(self, groups, output_dims, input_dims, group_size, bits, mode="affine"):
        super().__init__()
        hold_quantized_stack(self, groups, output_dims, input_dims, group_size, bits, mode)
        # the map of each row, made once: a compiled graph reads them rather than running a kernel a call
        # (evaluated now, so they do not belong to the stream of the thread that first uses them)
        self._maps = mx.arange(groups)
        mx.eval(self._maps)
        self.freeze()

    def __call__(self, x):
        if dequantizes(x.shape[0]):
            return grouped_product(x, dequantized(self, x.dtype))
        y = mx.gather_qmm(x[:, :, None, :], self.weight, self.scales, self.get("biases"), rhs_indices=self._maps,
                          transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode)
        return y[:, :, 0, :]


class Embedding(nn.Embedding):
    """The token embedding. Its quantized form gives rows in float32: a Q8_0 row (int8 codes times a
    float16 scale, up to 19 significant bits) keeps its exact values, which float16 would round."""

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_):
        return QuantizedEmbedding(*self.weight.shape, group_size, bits, mode)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    def __call__(self, x):
        biases = self.get("biases")
        return dequantize_into(mx.float32, self["weight"][x], self["scales"][x], None if biases is None else biases[x],
                               group_size=self.group_size, bits=self.bits, mode=self.mode)


class SwitchLinear(nn.Module):
    """A stack of linear maps [n, out, in]; each token row picks its own (the routed experts)."""

    def __init__(self, n, input_dims, output_dims):
        super().__init__()
        self.weight = mx.zeros((n, output_dims, input_dims))

    def __call__(self, x, indices, sorted_indices=False):
        w = self.weight
        if x.dtype != mx.float32 and mx.default_device() == mx.cpu:  # MLX's CPU gather_mm is float32 only
            x, w = x.astype(mx.float32), w.astype(mx.float32)
        y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return y.astype(self.weight.dtype)

    def one(self, x, i):
        """x [n, in] through map i alone."""
        return x @ _row(self.weight, i).T

    def to_quantized(self, group_size=None, bits=None, mode="affine", gguf_type=None, **_):
        n, out, inp = self.weight.shape
        if gguf_type is not None:
            return GGUFSwitchLinear(n, inp, out, gguf_type)
        return QuantizedSwitchLinear(n, inp, out, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    def __init__(self, n, input_dims, output_dims, group_size, bits, mode="affine"):
        super().__init__()
        hold_quantized_stack(self, n, output_dims, input_dims, group_size, bits, mode)
        self.freeze()

    # x is not cast to the scales' dtype: the compute dtype is x's. Converted scales are float16 (or
    # uint8 for MXFP4) whatever the compute dtype, and MLX promotes them, as nn.QuantizedLinear relies on.
    def __call__(self, x, indices, sorted_indices=False):
        return mx.gather_qmm(x, self.weight, self.scales, self.get("biases"),
                             rhs_indices=indices, transpose=True, group_size=self.group_size, bits=self.bits,
                             mode=self.mode, sorted_indices=sorted_indices)

    def one(self, x, i):
        w, scales, biases = self._maps()[i]
        return mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)

    def packed(self):
        """(weight, scales, biases, group size, bits) for the fused expert kernels, None unless affine."""
        if self.mode != "affine":
            return None
        return self.weight, self.scales, self.biases, self.group_size, self.bits

    def _maps(self):
        """Per-map (weight, scales, biases) views, made once per set of parameter arrays: a prefill
        chunk calls `one` for every expert of every layer, and views are graph nodes too."""
        arrays = (self.weight, self.scales, self.get("biases"))
        cached = self.__dict__.get("_views")
        if cached is None or any(a is not b for a, b in zip(cached[0], arrays)):
            views = [tuple(None if a is None else _row(a, i) for a in arrays) for i in range(self.weight.shape[0])]
            mx.eval([v for triple in views for v in triple if v is not None])
            self.__dict__["_views"] = cached = (arrays, views)
        return cached[1]


def gguf_dequantized(w, codec, dtype):
    """uint8 blocks [..., rows, row bytes] -> dtype [..., rows, cols], on the current path."""
    if gguf_blocks.path() == "kquant":
        scales = gguf_blocks.placeholder_scales()
        return gguf_blocks.kquant().dequantize(w, scales, codec, mx.float32).astype(dtype)
    values = kernels.gguf_dequantize(w, codec)  # one launch on CUDA
    return (gguf_blocks.dequantize(w, codec) if values is None else values).astype(dtype)


def gguf_gather_product(x, w, indices, codec, sorted_indices):
    """`mx.gather_qmm`'s contract (transposed) on GGUF blocks w [n, out, row bytes]: x [..., M, in] times
    map indices[...] -> [..., M, out]. On CUDA, a kernel for one row a pair (`kernels.gguf_rows`); the
    reference dequantizes each index's whole matrix: for few rows."""
    if gguf_blocks.path() == "kquant" and x.dtype != mx.float32:
        return gguf_blocks.kquant().gather_qmm(x, w, gguf_blocks.placeholder_scales(), codec,
                                               rhs_indices=indices.astype(mx.uint32), transpose=True,
                                               sorted_indices=sorted_indices)
    if x.shape[-2] == 1:
        lead = tuple(indices.shape)
        rows = mx.broadcast_to(x, lead + x.shape[-2:]).reshape(-1, x.shape[-1])
        y = kernels.gguf_rows(rows, w, indices.reshape(-1), codec)
        if y is not None:
            return y.astype(x.dtype).reshape(*lead, 1, -1)
    return x @ gguf_dequantized(w[indices], codec, x.dtype).swapaxes(-1, -2)


class GGUFSwitchLinear(nn.Module):
    """Routed experts kept in the GGUF's own blocks (uint8 [n, out, row bytes] of a `gguf_blocks.CODECS`
    type), computed as `gguf_blocks.path()` says: no requantization, the file's exact values."""

    def __init__(self, n, input_dims, output_dims, gguf_type):
        super().__init__()
        self.gguf_type = gguf_type
        self.weight = mx.zeros((n, output_dims, gguf_blocks.row_bytes(gguf_type, input_dims)), mx.uint8)
        self.freeze()

    def __call__(self, x, indices, sorted_indices=False):
        return gguf_gather_product(x, self.weight, indices, self.gguf_type, sorted_indices)

    def one(self, x, i):
        return x @ gguf_dequantized(self.weight[i], self.gguf_type, x.dtype).T

    def gathers(self, dtype):
        """Whether a big sorted batch should go through `__call__` (mlx-kquant's gather) rather than one
        dequantize-then-product per expert (`MoE._expert_loop`)."""
        return gguf_blocks.path() == "kquant" and dtype != mx.float32


class HyperConnection(nn.Module):
    """Mixes the `hc` residual streams into one sub-layer input, and back (pre / post / comb)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros(((2 + hc) * hc, hc * args.hidden_size))
        self.base = mx.zeros(((2 + hc) * hc,))
        self.scale = mx.ones((3,))
        self.hc, self.iters, self.eps, self.norm_eps = hc, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps

    def pre(self, streams):
        """streams [T, hc, H] -> (sub-layer input [T, H], post [T, hc], comb [T, hc, hc]), all float32."""
        T, hc, H = streams.shape
        mix = hc_project(streams.reshape(T, hc * H), self.fn, self.norm_eps)
        return hc_mix(mix, self.scale, self.base, streams, self.iters, self.eps)

    @staticmethod
    @mx.compile
    def post(out, streams, post, comb):
        # the 4 x 4 stream mix as element-wise terms: one fused kernel, exact in float32 (a matrix product
        # here would run on TF32 tensor cores on CUDA); the terms read slices that keep their axes, which
        # takes fewer view nodes than indexing and expanding (each is host time on every decoded layer)
        into = comb.swapaxes(1, 2)  # [T, to, from]
        mixed = sum(into[:, :, j : j + 1] * streams[:, j : j + 1] for j in range(streams.shape[1]))
        return post[:, :, None] * out[:, None, :].astype(mx.float32) + mixed


class HyperHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros((hc, hc * args.hidden_size))
        self.base = mx.zeros((hc,))
        self.scale = mx.ones((1,))
        self.eps, self.norm_eps = args.hc_eps, args.rms_norm_eps

    def __call__(self, streams):
        T, hc, H = streams.shape
        mix = hc_project(streams.reshape(T, hc * H), self.fn, self.norm_eps)
        w = mx.sigmoid(mix * self.scale[0] + self.base) + self.eps
        return (w[:, :, None] * streams).sum(axis=1)


def write_rows(rows, at, values):
    """`rows` [n, width] with `values` [k, width] at rows `at` [k] (int32: ring slots, buffer rows). A
    scatter, which MLX runs in place when nothing else holds `rows` (one launch; a slice update at a
    computed index is two on CUDA, and a kernel writing a copy is slower: the rings hold the rewind
    history)."""
    return mx.put_along_axis(rows, mx.broadcast_to(at[:, None], values.shape), values.astype(rows.dtype), axis=0)


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one row: a per-channel softmax over token scores. The ratio-4
    kind overlaps: each row pools the first half of the previous block's channels and the second half
    of its own block's."""

    def __init__(self, args: ModelArgs, ratio, head_dim):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlaps(ratio)
        width = head_dim * (2 if self.overlap else 1)
        # the file's kv and gate matrices stacked, and its score offsets (ape) beside zeros for the kv half
        # (`Model.sanitize`): a logged row is one product plus one row
        self.kv_gate = nn.Linear(args.hidden_size, 2 * width, bias=False)
        self.ape = mx.zeros((ratio, 2 * width))
        self.norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.width = width

    def project(self, xn, in_blocks):
        """The rows to log for tokens at offsets `in_blocks` in their blocks: kv | score, float32 (pooling is
        a softmax)."""
        return self.kv_gate(xn).astype(mx.float32) + self.ape[in_blocks]

    def step(self, fresh, ring, at: RingSlots, slots: Slots):
        """Log a step's rows `fresh` [T, 2 * width] (`project`'s) in the ring's rows array, and pool the blocks
        the step completes. -> (the ring's rows written, pooled rows [slots.pooled, head_dim] before norm and
        RoPE, or None)."""
        m = self.ratio
        fresh = fresh.astype(ring.dtype)
        source = mx.concatenate([ring[at.read], fresh]) if slots.pooled else None  # read before the write
        ring = write_rows(ring, at.write, fresh[fresh.shape[0] - at.write.shape[0] :])
        if not slots.pooled:
            return ring, None
        blocks = mx.arange(slots.pooled)
        tokens = slots.pool_offset + blocks[:, None] * m + mx.arange(m)[None, :]  # [rows, m] in `source`
        if not self.overlap:
            return ring, self.pool(source[tokens])
        prev_valid = (slots.first_row + blocks >= 1)[:, None, None]  # the very first block has none before it
        return ring, self.pool(source[tokens], source[mx.maximum(tokens - m, 0)], prev_valid)

    def pool(self, logged, prev=None, prev_valid=None):
        """Logged rows of whole blocks [n, ratio, 2 * width] -> pooled rows [n, head_dim]. With overlap,
        `prev` holds the blocks before them (their scores count only where `prev_valid`)."""
        W, d = self.width, self.head_dim
        kv, score = logged[..., :W], logged[..., W:]
        if self.overlap:
            prev_score = prev[..., W : W + d]
            if prev_valid is not None:
                prev_score = mx.where(prev_valid, prev_score, -mx.inf)
            kv = mx.concatenate([prev[..., :d], kv[..., d:]], axis=1)
            score = mx.concatenate([prev_score, score[..., d:]], axis=1)
        weights = mx.softmax(score.astype(mx.float32), axis=1)
        return (weights * kv).sum(axis=1)


class Indexer(nn.Module):
    """Scores compressed rows for each query (ReLU per head, weighted over heads)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.q_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(args, 4, self.head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.args = args
        self.kind = args.layer_type(layer_id)
        self.ratio = args.compress_ratios[layer_id]
        H, nh, hd = args.hidden_size, args.num_attention_heads, args.head_dim
        self.n_heads, self.head_dim = nh, hd
        self.q_a = Linear(H, args.q_lora_rank)
        self.q_a_norm = nn.RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.q_b = Linear(args.q_lora_rank, nh * hd)
        self.kv = Linear(H, hd)
        self.kv_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.sinks = mx.zeros((nh,))
        self.o_a = GroupedLinear(args.o_groups, nh * hd // args.o_groups, args.o_lora_rank)
        self.o_b = Linear(args.o_groups * args.o_lora_rank, H)
        if self.kind == SLIDING:
            self.rope = Rope(args.qk_rope_head_dim, args.rope_theta)
        else:
            self.rope = Rope(args.qk_rope_head_dim, args.compress_rope_theta, args.rope_scaling)
            self.compressor = Compressor(args, self.ratio, hd)
        if self.kind == CSA:
            self.indexer = Indexer(args)

    def project(self, x, positions, in_blocks, selecting, quant_sim):
        """What the step's tokens compute from themselves alone, reading no cache (so the tokens of several
        sessions run it together): x [N, H] at `positions` [N], `in_blocks` [N] their offsets in their
        compressed blocks; `selecting`: some session's indexer picks its rows. -> rows by name, [N, ...] each."""
        qr, q, kv = self._project(x, positions)
        rows = {"q": q, "kv": self._store_kv(kv, quant_sim)}
        if self.kind != SLIDING:
            rows["frontier"] = self.compressor.project(x, in_blocks)
            if self.kind == CSA:
                rows["index_frontier"] = self.indexer.compressor.project(x, in_blocks)
                if selecting:
                    rows["index_q"], rows["index_w"] = self._index_query(qr, x, positions, quant_sim)
        return rows

    def attend(self, rows, steps, quant_sim, attend_one):
        """Each session's cache part of the step (`attend_one`: `_attend_one` or its compiled graph) on its
        own rows of `rows` (`project`'s). -> (outputs [N, nh, hd] with RoPE still on, each session's arrays
        written)."""
        T = steps[0][0].tokens
        outs, written = [], []
        for b, (slots, arrays) in enumerate(steps):
            mine = {name: r[b * T : (b + 1) * T] for name, r in rows.items()} if len(steps) > 1 else rows
            out, arrays = attend_one(mine, slots, arrays, quant_sim)
            outs.append(out)
            written.append(arrays)
        return mx.concatenate(outs) if len(outs) > 1 else outs[0], written

    def _attend_one(self, rows, slots: Slots, arrays, quant_sim):
        """One session's part of a step: write its rows into its cache arrays and attend over its window and
        compressed rows. -> (attention output [T, nh, hd] with RoPE still on, the arrays written)."""
        arrays = dict(arrays)
        ring = arrays["raw"]  # read before the write: a decoded token's window reads it in place
        kv = rows["kv"].astype(ring.dtype)
        arrays["raw"] = write_rows(ring, slots.raw.write, kv[kv.shape[0] - slots.raw.write.shape[0] :])
        compressed = selected = None
        if self.kind != SLIDING:
            compressed = self._compress(self.compressor, rows["frontier"], slots, slots.frontier, arrays, "frontier",
                                        "rows", lambda r: self._store_kv(r, quant_sim))
            if self.kind == CSA:
                index_rows = self._compress(self.indexer.compressor, rows["index_frontier"], slots,
                                            slots.index_frontier, arrays, "index_frontier", "index_rows",
                                            index_rounding(quant_sim))
                if slots.selecting:
                    selected = self._top_rows(rows["index_q"], rows["index_w"], index_rows, slots.visible[:, None])
        if slots.steady:  # one decoded token: the fused kernel reads its window from the ring in place
            out = decode_attention(rows["q"][0], ring, kv, compressed, None if selected is None else selected[0],
                                   slots.positions[0], self.sinks, slots.window, self.ratio, slots.raw.read[0],
                                   slots.visible)
            return out[None], arrays
        window = mx.concatenate([ring[slots.raw.read], kv])  # the raw rows from start - (W - 1) on
        return self._attend_rows(rows["q"], window, compressed, selected, slots), arrays

    _compiled_attend_one = compiled(_attend_one)

    def _attend_rows(self, q, window, compressed, selected, slots: Slots):
        """Each token's heads q [T, nh, hd] over its window (from `window`: the raw rows of positions
        start - (W - 1) on) and its compressed rows (`selected` ones, else all visible). -> [T, nh, hd]"""
        T, W = slots.tokens, slots.window
        reach = mx.arange(T)[:, None] + mx.arange(W)[None, :]  # [T, W] into `window`
        keys = [window[reach] if T > 1 else window[None]]
        masks = [(slots.positions[:, None] - window_reach(W) + mx.arange(W)[None, :]) >= 0]
        visible = None if compressed is None else slots.visible[:, None]
        if selected is not None:
            keys.append(compressed[selected])
            masks.append(selected < visible)
        elif compressed is not None:
            keys.append(mx.broadcast_to(compressed[None], (T,) + compressed.shape))
            masks.append(mx.arange(compressed.shape[0])[None, :] < visible)
        f32 = mx.float32  # scores and softmax in float32 (head_dim 512 loses too much in half precision)
        keys = mx.concatenate(keys, axis=1) if len(keys) > 1 else keys[0]
        return attend(q.astype(f32), keys.astype(f32), mx.concatenate(masks, axis=1) if len(masks) > 1 else masks[0],
                      self.sinks.astype(f32), self.head_dim ** -0.5)

    def _compress(self, compressor, fresh, slots: Slots, at: RingSlots, arrays, ring, buffer, rounding):
        """A compressor's part of a step on the named arrays: log its rows, pool the blocks the step
        completes into finished rows of `buffer`. -> the buffer's first `slots.rows` rows (rows from a
        token's visible count on are not valid for it)."""
        arrays[ring], pooled = compressor.step(fresh, arrays[ring], at, slots)
        if pooled is not None:
            m = compressor.ratio
            finished = rms_norm(pooled, compressor.norm.weight.astype(pooled.dtype), compressor.norm.eps)
            finished = rounding(self.rope(finished, slots.first_row * m, m))
            arrays[buffer] = write_rows(arrays[buffer], slots.first_row + mx.arange(slots.pooled), finished)
        return arrays[buffer][: slots.rows]

    def _store_kv(self, kv, quant_sim):
        if not quant_sim:
            return kv
        nope = self.head_dim - self.args.qk_rope_head_dim
        return f16_round(mx.concatenate([fp8_e4m3_sim(kv[:, :nope]), kv[:, nope:]], axis=-1))

    @compiled
    def _project(self, x, positions):
        """-> (q_a output [T, q_lora_rank], queries [T, nh, hd], kv rows [T, hd]) at `positions` [T]."""
        T = x.shape[0]
        qr = self.q_a_norm(self.q_a(x))
        q = rms_norm(self.q_b(qr).reshape(T, self.n_heads, self.head_dim), None, self.args.rms_norm_eps)
        return qr, self.rope(q, positions), self.rope(self.kv_norm(self.kv(x)), positions)

    @compiled
    def _project_out(self, out, positions):
        """Attention output [T, nh, hd] (RoPE still on) -> [T, H], in the compute dtype."""
        T, G = out.shape[0], self.args.o_groups
        out = self.rope(out, positions, inverse=True).astype(self.q_a_norm.weight.dtype)
        low = self.o_a(out.reshape(T, G, -1))  # each head group has its own projection
        return self.o_b(low.reshape(T, -1))

    def _index_query(self, qr, x, positions, quant_sim):
        """The indexer's queries [T, heads, dim] and head weights [T, heads] of tokens at `positions`."""
        idx = self.indexer
        T = qr.shape[0]
        qi = self.rope(idx.q_b(qr).reshape(T, idx.n_heads, idx.head_dim), positions).astype(mx.float32)
        if quant_sim:
            qi = hadamard_fp4_sim(qi)
        return qi, idx.proj(x).astype(mx.float32) * (idx.head_dim * idx.n_heads) ** -0.5

    def _top_rows(self, qi, w, index_rows, visible):
        """The index_topk rows of `index_rows` with the highest scores for each query (`_index_query`),
        rows at or past `visible` [T, 1] excluded."""
        idx, args = self.indexer, self.args
        T = qi.shape[0]
        C = index_rows.shape[0]
        # ReLU per head, weighted over heads; in tiles of rows so [T, heads, rows] stays ~256 MB
        tile = max(1, INDEXER_TILE_BYTES // (4 * T * idx.n_heads))
        scores = mx.concatenate([(w[:, None, :] @ mx.maximum(qi @ index_rows[i : i + tile].T, 0))[:, 0]
                                 for i in range(0, C, tile)], axis=1)  # [T, C]
        scores = mx.where(mx.arange(C)[None, :] < visible, scores, -mx.inf)
        k = args.index_topk
        return mx.argpartition(-scores, k - 1, axis=-1)[:, :k]


# token-expert pairs below which a MoE call is decode-sized: one compiled graph, the fused expert
# kernels, per-token expert products (no sort)
FEW_PAIRS = 64


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        E, H, I = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        self.args = args
        self.hashed = layer_id < args.num_hash_layers
        self.gate = nn.Linear(H, E, bias=False)
        if self.hashed:
            self.tid2eid = mx.zeros((args.vocab_size, args.num_experts_per_tok), mx.int32)
        else:
            self.bias = mx.zeros((E,))
        self.experts = {"gate": SwitchLinear(E, H, I), "up": SwitchLinear(E, H, I), "down": SwitchLinear(E, I, H)}
        shared = I * args.n_shared_experts
        self.shared = {"gate": Linear(H, shared), "up": Linear(H, shared), "down": Linear(shared, H)}

    def __call__(self, x, ids):
        if x.shape[0] * self.args.num_experts_per_tok < FEW_PAIRS:  # one compiled graph, no sync inside
            return self._compiled_forward(x, ids)
        return self._forward(x, ids)

    def _forward(self, x, ids):
        args = self.args
        if self.hashed:
            chosen = self.tid2eid[ids]
            weights = route_hashed(self.gate(x.astype(mx.float32)), chosen, args.routed_scaling_factor)
        else:
            chosen, weights = route_top_k(self.gate(x.astype(mx.float32)), self.bias, args.num_experts_per_tok,
                                          args.routed_scaling_factor)
        y = self._fused_experts(x, chosen, weights)
        if y is None:
            routed = self._experts(x, chosen)
            y = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)
        s = self.shared
        return y + s["down"](clamped_swiglu(s["gate"](x), s["up"](x), args.swiglu_limit))

    _compiled_forward = compiled(_forward)

    def _fused_experts(self, x, chosen, weights):
        """The routed experts' weighted sum in two kernels for a few tokens (CUDA, affine experts)."""
        e = self.experts
        if chosen.size >= FEW_PAIRS or not isinstance(e["gate"], QuantizedSwitchLinear):
            return None
        matrices = [e[name].packed() for name in ("gate", "up", "down")]
        if None in matrices:
            return None
        y = routed_experts(x, chosen, weights, *matrices, self.args.swiglu_limit)
        return None if y is None else y.astype(x.dtype)

    def _experts(self, x, chosen):
        """[T, H] with chosen experts [T, k] -> [T, k, H]; rows sorted by expert for big batches."""
        T, k = chosen.shape
        if T * k < FEW_PAIRS:
            return self._glu(x[:, None, None, :], chosen, False)[:, :, 0, :]
        flat = chosen.flatten()
        order = mx.argsort(flat)
        xs, idx = x[order // k], flat[order]
        gathers = getattr(self.experts["gate"], "gathers", lambda dtype: True)(xs.dtype)
        if expert_path() == "loop" or not gathers:
            y = self._expert_loop(xs, idx)
        else:
            y = self._glu(xs[:, None, :], idx, True)[:, 0, :]
        return y[mx.argsort(order)].reshape(T, k, -1)

    def _glu(self, xs, idx, sorted_):
        e, limit = self.experts, self.args.swiglu_limit
        h = clamped_swiglu(e["gate"](xs, idx, sorted_), e["up"](xs, idx, sorted_), limit)
        return e["down"](h, idx, sorted_)

    def _expert_loop(self, xs, idx):
        """One product per expert over its contiguous rows (a sync to read the row counts): on CUDA this
        beats `gather_qmm`, which does not batch the rows of an expert."""
        e, limit = self.experts, self.args.swiglu_limit
        counts = mx.zeros((self.args.n_routed_experts,), mx.int32).at[idx].add(1).tolist()
        # half-precision products get a kernel built per row count: round the rows up to a few sizes
        # (the extra rows are the next expert's, or zeros at the end, and their outputs are dropped)
        step = 16 if xs.dtype in (mx.bfloat16, mx.float16) else 1
        if step > 1:
            xs = mx.concatenate([xs, mx.zeros((step, xs.shape[-1]), xs.dtype)])
        outs, start = [], 0
        for i, n in enumerate(counts):
            if n:
                rows = xs[start : start + -(-n // step) * step]
                y = e["down"].one(clamped_swiglu(e["gate"].one(rows, i), e["up"].one(rows, i), limit), i)
                outs.append(y[:n] if step > 1 else y)
                start += n
        return mx.concatenate(outs)


# tokens a session's step may have to run as a compiled graph: a decoded token, or a verify of a few drafts
COMPILED_TOKENS = 8


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_attn = HyperConnection(args)
        self.hc_ffn = HyperConnection(args)
        self.attn = Attention(args, layer_id)
        self.ffn = MoE(args, layer_id)
        self.few_rows = max(1, FEW_PAIRS // args.num_experts_per_tok)

    def __call__(self, streams, ids, positions, steps, quant_sim):
        """streams [B * T, hc, H] (float32) of T tokens of each of B sessions, their ids and `positions`
        [B * T]; `steps`: each session's (`Slots`, arrays) of this layer (`LayerCache.view`). -> (streams,
        each session's arrays written). A few rows of a few tokens each (decoded tokens, a verify of drafts)
        run as compiled graphs: one for one session; for several, one for what reads no cache and one for
        each session's cache part (a graph over all of them would be traced anew for every mix of their
        steps). Longer steps run as plain MLX: a graph is traced for every length, and prompts end anywhere."""
        if steps[0][0].tokens > COMPILED_TOKENS or streams.shape[0] >= self.few_rows:
            return self._step(streams, ids, positions, steps, quant_sim)
        if len(steps) == 1:
            return self._compiled_step(streams, ids, positions, steps, quant_sim)
        post, comb, rows = self._compiled_enter(streams, positions, _in_blocks(steps),
                                                any(s.selecting for s, _ in steps), quant_sim)
        out, written = self.attn.attend(rows, steps, quant_sim, self.attn._compiled_attend_one)
        return self._compiled_leave(out, positions, streams, post, comb, ids), written

    def _step(self, streams, ids, positions, steps, quant_sim):
        post, comb, rows = self._enter(streams, positions, _in_blocks(steps), any(s.selecting for s, _ in steps),
                                       quant_sim)
        out, written = self.attn.attend(rows, steps, quant_sim, self.attn._attend_one)
        return self._leave(out, positions, streams, post, comb, ids), written

    def _enter(self, streams, positions, in_blocks, selecting, quant_sim):
        """Up to the cache: HC pre, the norm, `Attention.project`."""
        x, post, comb = self.hc_attn.pre(streams)
        x = self.attn_norm(x.astype(self.attn_norm.weight.dtype))
        return post, comb, self.attn.project(x, positions, in_blocks, selecting, quant_sim)

    def _leave(self, out, positions, streams, post, comb, ids):
        """From the attention outputs on: the output projection, HC post, the MoE, HC post."""
        streams = HyperConnection.post(self.attn._project_out(out, positions), streams, post, comb)
        x, post, comb = self.hc_ffn.pre(streams)
        out = self.ffn(self.ffn_norm(x.astype(self.ffn_norm.weight.dtype)), ids)
        return HyperConnection.post(out, streams, post, comb)

    _compiled_step = compiled(_step)
    _compiled_enter = compiled(_enter)
    _compiled_leave = compiled(_leave)


def _in_blocks(steps):
    """The sessions' tokens' offsets in their compressed blocks, in row order (None without compression)."""
    if steps[0][0].in_blocks is None or len(steps) == 1:
        return steps[0][0].in_blocks
    return mx.concatenate([s.in_blocks for s, _ in steps])


class Model(nn.Module):
    def __init__(self, args: ModelArgs, quant_sim: bool = True, layers: Optional[range] = None):
        """`layers`: hold only this contiguous range of the decoder layers (one stage of a pipeline over
        several machines, `ds4_mlx.distributed`), as `layers.0` on; the embedding comes with the first
        layer, the head with the last. By default, all of them."""
        super().__init__()
        self.args, self.quant_sim = args, quant_sim
        self.layer_range = range(args.num_hidden_layers) if layers is None else layers
        if self.layer_range.start == 0:
            self.embed = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in self.layer_range]
        if self.layer_range.stop == args.num_hidden_layers:
            self.hc_head = HyperHead(args)
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            self.lm_head = Linear(args.hidden_size, args.vocab_size)

    def make_cache(self, *, history=0, frontier_history=None):
        """Per-layer caches; `history` extra positions kept so rewinds of that many tokens are free
        (`frontier_history` of them for the compressor inputs). Rows rounded to float16 by `quant_sim`
        are stored as float16."""
        from ds4_mlx.cache.layers import make_caches

        held = self.layer_range
        return make_caches(self.args, history=history, frontier_history=frontier_history,
                           row_dtype=mx.float16 if self.quant_sim else mx.float32)[held.start : held.stop]

    def forward(self, ids, views, *, last_only=False, taps=None):
        """The one forward: ids int32 [B, T], T tokens of each of B sessions; `views`: each session's
        per-layer (`Slots`, arrays) (`LayerCache.view(T)`). Prefill chunks (B = 1), decoded tokens (T = 1),
        a verify of drafted tokens and batched streams are all this. Changes no cache: -> (logits
        [B, T, vocab] float32 (or [B, 1, vocab] with `last_only`), each session's per-layer arrays written,
        for `LayerCache.commit`).

        `taps`: None, or a dict whose keys name residual streams a drafter reads (speculative decoding):
        a layer index i (the streams leaving layer i) or "final" (leaving the last layer, before the HC
        head); the forward sets each key to those streams, [B * T, hc, H] float32, for every row."""
        run = self.forward_steps(ids, views, last_only=last_only, taps=taps)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def forward_steps(self, ids, views, *, last_only=False, layers_per_step=None, taps=None):
        """`forward` as a generator: with `layers_per_step`, it evaluates the layers so far and yields after
        every that many layers (a server runs other streams' tokens in between; the arithmetic is the same
        as in one piece). Its return value is `forward`'s."""
        B, T = ids.shape
        flat = ids.reshape(-1)
        positions = mx.concatenate([v[0][0].positions for v in views]) if B > 1 else views[0][0][0].positions
        streams = self._streams(flat)
        written = [[] for _ in views]
        for i, layer in enumerate(self.layers):
            streams, steps = layer(streams, flat, positions, [v[i] for v in views], self.quant_sim)
            for mine, step in zip(written, steps):
                mine.append(step)
            if taps is not None and i in taps:
                taps[i] = streams
            if layers_per_step and (i + 1) % layers_per_step == 0 and i + 1 < len(self.layers):
                mx.eval(streams, written)
                yield
        if taps is not None and "final" in taps:
            taps["final"] = streams
        if last_only:
            streams = streams.reshape(B, T, *streams.shape[1:])[:, -1]
        return self._logits(streams).reshape(B, -1, self.args.vocab_size), written

    def __call__(self, inputs, cache=None, *, last_only=False, taps=None):
        """inputs int32 [1, T] after the tokens `cache` holds (a fresh cache when None); returns logits
        [1, T, vocab] (or [1, 1, vocab] with last_only). `forward` with the cache's view and commit."""
        if cache is None:
            cache = self.make_cache()
        logits, written = self.forward(inputs, [[c.view(inputs.shape[1]) for c in cache]], last_only=last_only,
                                       taps=taps)
        for c, arrays in zip(cache, written[0]):
            c.commit(arrays, inputs.shape[1])
        return logits

    def _streams(self, ids):

        """Token ids [T] -> the residual streams [T, hc, H], float32 (the exact mode first switches off
        TF32 for its float32 products: `ds4_mlx.precision`)."""
        if not self.quant_sim and self.layers[0].attn_norm.weight.dtype == mx.float32:
            exact_float32()
        embedded = self.embed(ids).astype(mx.float32)
        return mx.broadcast_to(embedded[:, None, :], (ids.shape[0], self.args.hc_mult, self.args.hidden_size))

    def _logits(self, streams):
        """Residual streams [T, hc, H] -> logits [T, vocab], float32."""
        x = self.norm(self.hc_head(streams).astype(self.norm.weight.dtype))
        return self.lm_head(x).astype(mx.float32)

    def cast(self, dtype):
        """Compute in `dtype` (bfloat16 or float16), but for the parameters `keeps_float32` names."""
        self.update(tree_unflatten([(k, v.astype(mx.float32 if keeps_float32(k) else dtype))
                                    for k, v in tree_flatten(self.parameters())
                                    if mx.issubdtype(v.dtype, mx.floating)]))
        return self

    # Weights -------------------------------------------------------------------------------
    def apply_quantization(self, quantization: dict):
        """Swap the modules named in `quantization` ({path: {group_size, bits, mode}}) for quantized ones."""
        if quantization:
            nn.quantize(self, class_predicate=lambda path, m: quantization.get(path, False))

    def sanitize(self, weights: dict) -> dict:
        """Reshape the grouped output projection to [groups, rank, in]; stack each compressor's kv and gate
        matrices and put zeros before its score offsets (see `Compressor`); default the optional router bias."""
        a = self.args
        out = dict(weights)
        for name, w in weights.items():
            if ".attn.o_a." in name and w.ndim == 2:
                out[name] = w.reshape(a.o_groups, -1, w.shape[-1])
            prefix = name[: -len("kv.weight")]
            if name.endswith("compressor.kv.weight") and prefix + "gate.weight" in out:
                out[prefix + "kv_gate.weight"] = mx.concatenate([out.pop(name), out.pop(prefix + "gate.weight")])
                if prefix + "ape" in out:
                    ape = out[prefix + "ape"]
                    out[prefix + "ape"] = mx.concatenate([mx.zeros_like(ape), ape], axis=-1)
        for held, i in enumerate(self.layer_range):
            if i >= a.num_hash_layers:
                out.setdefault(f"layers.{held}.ffn.bias", mx.zeros((a.n_routed_experts,)))
        for name in list(out):
            if name.endswith("tid2eid"):
                out[name] = out[name].astype(mx.int32)
        return out
