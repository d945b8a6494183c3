"""The published DeepSeek V4 geometries: Flash (`ModelArgs`' defaults) and PRO.

A model file carries its own geometry (`args_from_gguf`, config.json); these are for what has no file at
hand: projections of file sizes, memory and traffic between machines (`bench convert`, `bench
distributed`), and the tests' real-width checks.
"""

from ds4_mlx.models.args import ModelArgs


def flash_args(**overrides) -> ModelArgs:
    """V4 Flash: 43 layers (two window-only, then ratio 4 and 128 alternating), hidden 4096, 64 heads,
    256 routed experts."""
    return ModelArgs(**overrides)


def pro_layer_ratios(layers=61, heavy=128):
    """V4 PRO's schedule: heavy compression from layer 0 (no window-only layers), layers 0 and 1 heavy, then
    heavy and ratio 4 alternating (transformers' `DeepseekV4Config` default, which names it so)."""
    return [heavy] * min(layers, 2) + [4 if i % 2 else heavy for i in range(max(layers - 2, 0))]


def pro_args(**overrides) -> ModelArgs:
    """V4 PRO (0813): 61 layers, hidden 7168, 128 heads in 16 output groups, 384 routed experts of 3072,
    the indexer keeping 1024 rows. The query rank (1536) is the one consistent with the published parameter
    count; a GGUF's own metadata overrides all of it when loaded."""
    d = dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
             o_lora_rank=1024, compress_ratios=pro_layer_ratios(), n_routed_experts=384,
             moe_intermediate_size=3072, index_topk=1024)
    d.update(overrides)
    return ModelArgs(**d)
