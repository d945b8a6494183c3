"""DeepSeek V4 Flash in MLX.

One file for the whole family, in the order of one decoder layer (reference: the architecture notes,
sections 1.3 to 1.11): hyper-connections, attention with sinks over a sliding window plus compressed
rows (ratio 4 with overlap and an indexer, or a heavy ratio without), the MoE, and the HC head.
The model only does math: all per-layer state lives in `ds4_mlx.cache` objects passed in.
"""

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

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
    # one entry a layer: 0 = sliding window only, 4 = CSA (overlap + indexer), any other = HCA
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
            if k == "exp_probs_b" and i < args.num_hash_layers:
                continue
            if k == "ffn_gate_tid2eid" and i >= args.num_hash_layers:
                continue
            names.append(f"blk.{i}.{k}")
    return names
