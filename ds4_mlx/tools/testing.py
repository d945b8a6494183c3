"""Test support: tiny DeepSeek V4 models, the transformers oracle, and the demo model served.

- `write_gguf` writes a `deepseek4` GGUF (ds4 tensor names, numpy-order arrays).
- `tiny_args`: a small config keeping every layer type (random weights: `ds4_mlx.demo.random_gguf_tensors`).
- `hf_tiny_model` / `hf_to_gguf_tensors`: the transformers DeepseekV4 oracle (fp32) and its weights in ds4
  names, so a GGUF written from it must give the same logits in MLX.

- `demo_server`, `served`, `serve_process`, `wait_healthy`: the demo model served in the test process or
  as `ds4-mlx serve`; `request_lines`, `cold_answer`, `cold_logits`: what the tests compare.

Importing this module needs neither torch nor transformers nor an API client: they are imported lazily.
"""

import contextlib
import json
from pathlib import Path

import numpy as np

from ds4_mlx.demo import distinct_experts, random_like
from ds4_mlx.models.args import CSA, HCA, ModelArgs
from ds4_mlx.models.gguf_names import GGUF_KEYS

ARCH = "deepseek4"


# ---------------------------------------------------------------------------------------------------------
# GGUF writing


def gguf_metadata(args: ModelArgs) -> dict:
    """The `deepseek4.*` metadata keys describing `args` (ds4's key set)."""
    d = args.to_dict()
    types = ModelArgs.__annotations__
    p = ARCH + "."
    # cast by field type, so e.g. rope_theta=10000 is still written as a float32
    meta = {p + key: (float(d[f]) if types[f] is float else int(d[f]) if types[f] is int else d[f])
            for key, f in GGUF_KEYS.items()}
    meta[p + "attention.compress_ratios"] = [int(r) for r in args.compress_ratios]
    meta[p + "attention.head_count_kv"] = 1
    meta[p + "attention.value_length"] = int(args.head_dim)
    meta[p + "expert_weights_norm"] = True
    meta[p + "swiglu_clamp_exp"] = [float(args.swiglu_limit)] * args.num_hidden_layers
    yarn = args.rope_scaling
    if yarn:
        meta[p + "rope.scaling.type"] = "yarn"
        meta[p + "rope.scaling.factor"] = float(yarn["factor"])
        meta[p + "rope.scaling.original_context_length"] = int(yarn["original_max_position_embeddings"])
        meta[p + "rope.scaling.yarn_beta_fast"] = float(yarn.get("beta_fast", 32.0))
        meta[p + "rope.scaling.yarn_beta_slow"] = float(yarn.get("beta_slow", 1.0))
    return meta


def _add_metadata(writer, key, value):
    from gguf import GGUFValueType as V

    if isinstance(value, bool):
        writer.add_key_value(key, value, V.BOOL)
    elif isinstance(value, (int, np.integer)):
        writer.add_key_value(key, int(value), V.UINT32)
    elif isinstance(value, (float, np.floating)):
        writer.add_key_value(key, float(value), V.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, V.STRING)
    elif isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        if all(isinstance(x, str) for x in items):
            sub = V.STRING
        elif all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in items):
            sub, items = V.INT32, [int(x) for x in items]
        else:
            sub, items = V.FLOAT32, [float(x) for x in items]
        writer.add_key_value(key, items, V.ARRAY, sub_type=sub)
    else:
        raise TypeError(f"metadata {key}: unsupported value type {type(value).__name__}")


def _tokenizer_metadata(tokenizer_json) -> dict:
    """ds4's tokenizer keys from a HF tokenizer.json (byte-level BPE, as the V4 tokenizer)."""
    tok = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    n = max(max(vocab.values()), max(added, default=-1)) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]  # ids missing from both tables (none in the V4 tokenizer)
    types = [5] * n  # 5 = unused
    for text, i in vocab.items():
        tokens[i], types[i] = text, 1  # 1 = normal
    for i, a in added.items():
        tokens[i], types[i] = a["content"], 3 if a.get("special") else 4  # 3 = control, 4 = user defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "joyai-llm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": False,
    }


def write_gguf(path, metadata: dict, tensors: dict, tokenizer_json=None, arch=ARCH):
    """Write a GGUF v3 file of architecture `arch` (`deepseek4`).

    `metadata`: full key -> value (ints are written as uint32, floats as float32, int lists as int32 arrays,
    float lists as float32 arrays). `tensors`: ds4 name -> numpy array in numpy order (the reverse of GGUF's
    ne order), or (uint8 byte rows, GGMLQuantizationType) for pre-quantized data."""
    from gguf import GGUFWriter

    meta = dict(metadata)
    if tokenizer_json is not None:
        meta.update(_tokenizer_metadata(tokenizer_json))
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if key != "general.architecture":
            _add_metadata(writer, key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            data, qtype = t
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.uint8), raw_dtype=qtype)
            continue
        arr = np.asarray(t)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        writer.add_tensor(name, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


# ---------------------------------------------------------------------------------------------------------
# Tiny configs and random weights


def tiny_args(seed=0, **overrides) -> ModelArgs:
    """A tiny config with every layer kind: sliding, CSA (ratio 4, indexer) and HCA (ratio 16), hash and
    top-k routed MoE, YaRN that matters (original context 64) and a SwiGLU clamp that acts (2.0).

    seed 0 is the fixed shape below; other seeds draw another small shape (layer order, heads, window, HCA
    ratio, ...) that still keeps every layer kind, window <= 16 and enough indexer heads to avoid score ties."""
    d = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, compress_ratios=[0, 0, 4, 16, 4, 16],
        num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        sliding_window=8, num_hash_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, swiglu_limit=2.0, index_n_heads=32, index_head_dim=16, index_topk=6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32.0, "beta_slow": 1.0},
        max_position_embeddings=4096,
    )
    if seed:
        rng = np.random.default_rng(seed)
        pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
        hca = pick([8, 16, 32])
        n_layers = pick([4, 5, 6])
        kinds = [0, 4, hca] + [pick([0, 4, hca]) for _ in range(n_layers - 3)]
        rng.shuffle(kinds)
        heads = pick([2, 4, 8])
        head_dim = pick([16, 32])
        d.update(
            hidden_size=pick([48, 64, 96]), num_hidden_layers=n_layers, compress_ratios=[int(k) for k in kinds],
            num_attention_heads=heads, head_dim=head_dim, qk_rope_head_dim=pick([8, head_dim // 2]),
            q_lora_rank=pick([16, 32, 48]), o_groups=pick([g for g in (1, 2, 4) if heads % g == 0]),
            o_lora_rank=pick([8, 16]), sliding_window=pick([8, 12, 16]), num_hash_layers=pick([1, 2, 3]),
            n_routed_experts=pick([8, 16]), num_experts_per_tok=pick([2, 3]),
            moe_intermediate_size=pick([16, 32]), swiglu_limit=pick([1.5, 2.0, 3.0]),
            index_head_dim=pick([16, 32]), index_topk=pick([4, 6, 8]),
            rope_scaling={"type": "yarn", "factor": pick([2.0, 4.0]),
                          "original_max_position_embeddings": pick([32, 64]), "beta_fast": 32.0, "beta_slow": 1.0},
        )
    d.update(overrides)
    return ModelArgs(**d)


def real_geometry_args(**overrides) -> ModelArgs:
    """V4 Flash's cache geometry (window 128, one layer of each kind: ratios 0, 4 and 128, the first
    hash-routed) at tiny widths: rewinds and rings at the real sizes in seconds on a CPU."""
    d = dict(vocab_size=256, hidden_size=32, num_hidden_layers=3, compress_ratios=[0, 4, 128],
             num_attention_heads=2, head_dim=32, qk_rope_head_dim=16, q_lora_rank=16, o_groups=1, o_lora_rank=8,
             sliding_window=128, num_hash_layers=1, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16, index_n_heads=4, index_head_dim=16, index_topk=64)
    d.update(overrides)
    return ModelArgs(**d)


def tiny_pro_args(**overrides) -> ModelArgs:
    """V4 PRO's shape at tiny widths: its layer schedule (heavy compression from layer 0, no window-only
    layer; the heavy ratio shrunk to 16), more heads in more output groups than `tiny_args`, half as many
    experts again (384 against Flash's 256) and a larger indexer choice."""
    from ds4_mlx.models.variants import pro_layer_ratios

    n = overrides.pop("num_hidden_layers", 7)
    d = dict(num_hidden_layers=n, compress_ratios=pro_layer_ratios(n, heavy=16), hidden_size=96,
             num_attention_heads=8, o_groups=4, n_routed_experts=12, index_topk=10)
    d.update(overrides)
    return tiny_args(0, **d)


def _hca_ratio(args: ModelArgs):
    ratios = {r for r in args.compress_ratios if r not in (0, 4)}
    if len(ratios) > 1:
        raise ValueError(f"transformers has one HCA ratio for all layers, got {sorted(ratios)}")
    return ratios.pop() if ratios else 128


# ---------------------------------------------------------------------------------------------------------
# transformers oracle


def hf_config(args: ModelArgs):
    """transformers `DeepseekV4Config` (fp32) equal to `args`."""
    import torch
    from transformers import DeepseekV4Config
    from transformers.utils import logging as hf_logging

    if args.n_shared_experts != 1:
        raise ValueError("transformers builds exactly one shared expert")
    layer_types = [args.layer_type(i) for i in range(args.num_hidden_layers)]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the yarn factor vs max_position_embeddings warning is expected
    try:
        cfg = DeepseekV4Config(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads, num_key_value_heads=1, head_dim=args.head_dim,
            partial_rotary_factor=args.qk_rope_head_dim / args.head_dim, q_lora_rank=args.q_lora_rank,
            o_groups=args.o_groups, o_lora_rank=args.o_lora_rank, sliding_window=args.sliding_window,
            layer_types=layer_types, compress_rates={CSA: 4, HCA: _hca_ratio(args)},
            mlp_layer_types=["hash_moe" if i < args.num_hash_layers else "moe"
                             for i in range(args.num_hidden_layers)],
            n_routed_experts=args.n_routed_experts, num_experts_per_tok=args.num_experts_per_tok,
            n_shared_experts=1, moe_intermediate_size=args.moe_intermediate_size,
            routed_scaling_factor=args.routed_scaling_factor, swiglu_limit=args.swiglu_limit,
            index_n_heads=args.index_n_heads, index_head_dim=args.index_head_dim, index_topk=args.index_topk,
            hc_mult=args.hc_mult, hc_sinkhorn_iters=args.hc_sinkhorn_iters, hc_eps=args.hc_eps,
            rms_norm_eps=args.rms_norm_eps, rope_theta=args.rope_theta, compress_rope_theta=args.compress_rope_theta,
            rope_scaling=dict(args.rope_scaling) if args.rope_scaling else None,
            max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=False,
            torch_dtype=torch.float32,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    compress = cfg.rope_parameters["compress"]
    if args.rope_scaling and compress.get("attention_factor") != 1.0:  # else cos/sin get scaled by 1+0.1 ln f
        raise AssertionError(f"compress rope would be magnitude-scaled: {compress}")
    return cfg


def _hf_kind(name):
    last = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return "norm"
    if last == "sinks":
        return "sink"
    if last == "position_bias":
        return "ape"
    if last in ("base", "hc_base"):
        return "hc_base"
    if last in ("scale", "hc_scale"):
        return "hc_scale"
    if last == "e_score_correction_bias":
        return "router_bias"
    if name.endswith("embed_tokens.weight"):
        return "embed"
    if last == "gate_up_proj" or name.endswith(("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
        return "swiglu_in"
    return "matrix"


def hf_tiny_model(args: ModelArgs, seed=0):
    """`DeepseekV4ForCausalLM` (fp32, eval) for `args`, every parameter and buffer random.

    `_init_weights` zeroes sinks, position biases, HC bases, router biases and tid2eid and gives weights of
    std 0.02 (flat logits); all of that is redrawn here so every path of the model matters."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    cfg = hf_config(args)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    rotary = model.model.rotary_emb
    if args.rope_scaling and getattr(rotary, "compress_attention_scaling", None) != 1.0:
        raise AssertionError("compress rope attention scaling is not 1.0")
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                v = distinct_experts(rng, args.vocab_size, args.n_routed_experts, args.num_experts_per_tok)
                t.copy_(torch.from_numpy(v.astype(np.int64)))
            elif t.is_floating_point():
                t.copy_(torch.from_numpy(random_like(_hf_kind(name), tuple(t.shape), rng)))
    return model


_HF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight", "model.hc_head.hc_fn": "output_hc_fn.weight",
           "model.hc_head.hc_base": "output_hc_base.weight", "model.hc_head.hc_scale": "output_hc_scale.weight"}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn.weight", "attn_hc.base": "hc_attn_base.weight", "attn_hc.scale": "hc_attn_scale.weight",
    "ffn_hc.fn": "hc_ffn_fn.weight", "ffn_hc.base": "hc_ffn_base.weight", "ffn_hc.scale": "hc_ffn_scale.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_norm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_proj.weight": "attn_kv.weight",
    "self_attn.kv_norm.weight": "attn_kv_a_norm.weight", "self_attn.sinks": "attn_sinks.weight",
    # o_a_proj [groups*rank, heads*head_dim/groups]: group g uses rows g*rank.., as ds4's attn_output_a
    "self_attn.o_a_proj.weight": "attn_output_a.weight", "self_attn.o_b_proj.weight": "attn_output_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn_compressor_kv.weight",
    "self_attn.compressor.gate_proj.weight": "attn_compressor_gate.weight",
    "self_attn.compressor.position_bias": "attn_compressor_ape.weight",
    "self_attn.compressor.kv_norm.weight": "attn_compressor_norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer_compressor_kv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer_compressor_gate.weight",
    "self_attn.compressor.indexer.position_bias": "indexer_compressor_ape.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer_compressor_norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate.tid2eid": "ffn_gate_tid2eid.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def hf_to_gguf_tensors(model) -> dict:
    """The transformers state dict in ds4 GGUF names (numpy order = transformers' [out, in]).

    Raises on any parameter it does not know, so nothing is silently dropped."""
    out = {}
    for name, t in model.state_dict().items():
        a = t.detach().cpu().numpy()
        if name in _HF_TOP:
            out[_HF_TOP[name]] = a.astype(np.float32)
            continue
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"]:
            raise KeyError(f"unmapped transformers parameter {name}")
        blk, sub = f"blk.{parts[2]}.", parts[3]
        if sub == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows first, then up
            inter = a.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"] = np.ascontiguousarray(a[:, :inter], dtype=np.float32)
            out[blk + "ffn_up_exps.weight"] = np.ascontiguousarray(a[:, inter:], dtype=np.float32)
        elif sub == "mlp.gate.tid2eid":
            out[blk + _HF_LAYER[sub]] = a.astype(np.int32)
        elif sub in _HF_LAYER:
            out[blk + _HF_LAYER[sub]] = a.astype(np.float32)
        else:
            raise KeyError(f"unmapped transformers parameter {name}")
    return out


def write_tiny_gguf(path, args: ModelArgs, seed=0):
    """Write the GGUF of a random transformers tiny model; return (path, torch model)."""
    model = hf_tiny_model(args, seed)
    write_gguf(path, gguf_metadata(args), hf_to_gguf_tensors(model))
    return Path(path), model


# ---------------------------------------------------------------------------------------------------------
# Servers and sessions of the tests


DEMO_MODEL_ID = "deepseek-v4-flash"


_demo_tokenizers = []  # the first demo server's tokenizer, which the later ones of this process share


def _demo_model():
    """(model, tokenizer): the demo model loaded afresh, and one tokenizer for every demo server of the
    process, so that what the server builds once per tokenizer (llguidance's view of it, the ids of its
    added tokens) is built once, not once a test."""
    from ds4_mlx.demo import load_for_cli

    model, tokenizer = load_for_cli(None)[:2]
    if not _demo_tokenizers:
        _demo_tokenizers.append(tokenizer)
    return model, _demo_tokenizers[0]


def demo_server(**options):
    """`build_server` on the demo model (loaded afresh by the server, its tokenizer shared); `options`
    override the model id, a 4,096-token context, one session and a 4 GiB cache budget."""
    from ds4_mlx.server.build import build_server

    settings = {"model_id": DEMO_MODEL_ID, "ctx": 4096, "sessions": 1, "budget_bytes": 2**32, **options}
    return build_server(_demo_model, **settings)


@contextlib.contextmanager
def served(**options):
    """The demo model served in the background (`demo_server(**options)`): (server, OpenAI client)."""
    from openai import OpenAI

    from ds4_mlx.server.build import BackgroundServer

    with BackgroundServer(demo_server(**options)) as bg:
        yield bg, OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)


def answer_text(done) -> str:
    """A chat completion's reasoning and content, as one text."""
    message = done.choices[0].message
    return (getattr(message, "reasoning_content", None) or "") + (message.content or "")


def cold_answer(ctx=8192, **request) -> str:
    """The answer to a chat completion `request` from a fresh server: what a warm one must answer too."""
    with served(ctx=ctx) as (_, client):
        return answer_text(client.chat.completions.create(**request))


def long_conversation(words=1020) -> list[dict]:
    """A system and a user message of over 2,000 tokens: a prefill of more than one 2,048-token chunk."""
    return [{"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "Summarize: " + " ".join(f"item{i}" for i in range(words))}]


def request_lines(caplog) -> list[dict]:
    """The figures of the server's per-request log lines, as strings (the `Outcome` each record carries;
    the line itself, in words, is `line`)."""
    records = [r for r in caplog.records if r.name == "ds4_mlx.server" and hasattr(r, "outcome")]
    return [{"slot": str(o.slot), "live": str(o.live), "prompt": str(o.prompt_tokens), "common": str(o.common),
             "reused": str(o.reused), "replayed": str(o.replayed), "computed": str(o.computed),
             "gen": str(o.completion_tokens), "finish": o.finish_reason, "miss": o.miss or "-", "line": r.getMessage()}
            for r, o in ((r, r.outcome) for r in records)]


def free_ports(span=1):
    """The first of `span` consecutive ports of 127.0.0.1 that are all free now (for a server, or the ranks of
    `mlx.launch`, which take one each from the first on)."""
    import socket

    def free(port):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + span <= 65536 and all(free(first + i) for i in range(1, span)):
            return first
    raise RuntimeError(f"no {span} consecutive free ports")


def run_launch(command_for, timeout):
    """The run of `command_for()`, an mlx.launch command line whose ports it picks, as a CompletedProcess
    with its output; again with a new command where a rank could not bind its port (one found free may be
    taken before). Stopped with every rank it started past `timeout` seconds (mlx.launch passes no signal
    on to them)."""
    import os
    import signal
    import subprocess

    for _ in range(3):
        process = subprocess.Popen(command_for(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            out, err = process.communicate(timeout=timeout)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
        if "Couldn't bind socket" not in out + err:
            break
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def serve_process(*args, command=("-m", "ds4_mlx.cli", "serve"), **popen):
    """Start `ds4-mlx serve ARGS` (or another `command`) on a free port; return (process, url) once /health
    says ok. `popen` goes to subprocess.Popen (by default the output is collected on stdout)."""
    import subprocess
    import sys

    port = free_ports()
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    process = subprocess.Popen([sys.executable, *command, *args, "--port", str(port)], **popen)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process)
    return process, url


def wait_healthy(url, process=None, timeout_s=180):
    """Wait until the server at `url` answers /health with "ok". A busy machine may refuse the connection
    (not listening yet), answer "loading", or not answer in time: all of that is waiting. Raises, with the
    process's output, when `process` exits or the time is up."""
    import time

    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            break
        try:
            if requests.get(url + "/health", timeout=5).json().get("status") == "ok":
                return
        except (requests.ConnectionError, requests.Timeout, ValueError):
            pass
        time.sleep(0.2)
    output = ""
    if process is not None:
        process.kill()
        output = process.communicate()[0] or ""
    raise AssertionError(f"the server at {url} did not become healthy: {output}")


def peak_memory_of(step, sessions):
    """Bytes above what was held before that `step()` held at its peak, the sessions' logits evaluated
    before and after (so that a copy of a cache array shows)."""
    import mlx.core as mx

    mx.eval([s.logits for s in sessions])
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    step()
    mx.eval([s.logits for s in sessions])
    return mx.get_peak_memory() - base


def cold_logits(model, tokens, max_chunk=61):
    """The logits of `tokens` prefilled into an empty session: what every rewind must give again."""
    from ds4_mlx.session import Session

    return Session(model, rewind_slack=0, checkpoint_every=10**9, max_chunk=max_chunk).sync(tokens)


def live_text(background_server) -> str:
    """The text of a running test server's most recently used session."""
    worker = background_server.server.worker
    slot = max(worker.slots, key=lambda s: s.last_used)
    return worker.tokenizer.decode(slot.tokens)
