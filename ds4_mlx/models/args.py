"""The model's configuration: `ModelArgs`, from our config.json or a Hugging Face one, and the three kinds
of attention layer."""

from dataclasses import asdict, dataclass, field
from typing import Optional


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
