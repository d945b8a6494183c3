"""GGUF metadata and tensor names: `ModelArgs` from a GGUF's `deepseek4.*` keys, each tensor's parameter
path in `Model`, and the tensors a complete file holds."""

import re
from typing import Optional

from ds4_mlx.models.args import CSA, SLIDING, ModelArgs


# GGUF metadata key (under "deepseek4.") -> ModelArgs field
GGUF_KEYS = {
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
    d = {f: meta[p + k] for k, f in GGUF_KEYS.items() if p + k in meta}
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
LAYER_NAMES = {
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
        sub = LAYER_NAMES.get(m.group(2))
        return f"layers.{m.group(1)}.{sub}" if sub else None
    return _TOP_NAMES.get(base)


def expected_gguf_names(args: ModelArgs) -> list:
    """GGUF base names (no .weight/.bias suffix) a complete model file must hold."""
    names = ["token_embd", "output_norm", "output", "output_hc_fn", "output_hc_base", "output_hc_scale"]
    for i in range(args.num_hidden_layers):
        t = args.layer_type(i)
        for k in LAYER_NAMES:
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
