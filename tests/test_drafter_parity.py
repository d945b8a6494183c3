"""Our DSpark and MTP drafters against mlx-vlm 0.7.10's independent implementations: the same random
weights, the same target streams, draft logits equal within 1e-4 in float32.

mlx-vlm is installed without its dependencies (`pip install --no-deps mlx-vlm==0.7.10`, plus Pillow,
which its model base module imports); only its drafter modules are imported. It declares mlx >= 0.32.4;
these modules run on 0.32.3."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from ds4_mlx.models.linear import file_weights
from ds4_mlx.tools.drafters import random_dspark, random_mtp
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import tiny_args

try:
    from mlx_vlm.models.deepseek_v4.config import ModelConfig as VlmTextConfig
    from mlx_vlm.speculative.drafters.deepseek_v4_dspark import DeepseekV4DsparkDraftModel, ModelConfig as VlmDspark
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp import DeepseekV4MTPDraftModel, ModelConfig as VlmMtp
except ImportError as e:  # pragma: no cover - the test extra installs it
    pytest.skip(f"mlx-vlm 0.7.10 cannot be imported ({e}): pip install --no-deps mlx-vlm==0.7.10 pillow",
                allow_module_level=True)

TOL = 1e-4

# our block's parameter names -> mlx-vlm's (DeepseekV4Block / DSparkStage)
_BLOCK = {
    "attn.q_a.weight": "attn.wq_a.weight", "attn.q_a_norm.weight": "attn.q_norm.weight",
    "attn.q_b.weight": "attn.wq_b.weight", "attn.kv.weight": "attn.wkv.weight",
    "attn.kv_norm.weight": "attn.kv_norm.weight", "attn.o_a.weight": "attn.wo_a.weight",
    "attn.o_b.weight": "attn.wo_b.weight", "attn.sinks": "attn.attn_sink",
    "ffn.gate.weight": "ffn.gate.weight", "ffn.bias": "ffn.gate.e_score_correction_bias",
    "ffn.experts.gate.weight": "ffn.switch_mlp.gate_proj.weight",
    "ffn.experts.up.weight": "ffn.switch_mlp.up_proj.weight",
    "ffn.experts.down.weight": "ffn.switch_mlp.down_proj.weight",
    "ffn.shared.gate.weight": "ffn.shared_experts.gate_proj.weight",
    "ffn.shared.up.weight": "ffn.shared_experts.up_proj.weight",
    "ffn.shared.down.weight": "ffn.shared_experts.down_proj.weight",
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn.fn": "attn_hc.fn", "hc_attn.base": "attn_hc.base", "hc_attn.scale": "attn_hc.scale",
    "hc_ffn.fn": "ffn_hc.fn", "hc_ffn.base": "ffn_hc.base", "hc_ffn.scale": "ffn_hc.scale",
}


def _vlm_name(ours, block_prefix, vlm_block_prefix):
    if ours.startswith(block_prefix):
        rest = ours[len(block_prefix):]
        return vlm_block_prefix + _BLOCK.get(rest, rest)
    return ours


def _text_config(args):
    d = {k: v for k, v in args.to_dict().items() if k in VlmTextConfig.__dataclass_fields__}
    d["compress_ratios"] = [0] * args.num_hidden_layers  # the drafters' blocks are window-only anyway
    return VlmTextConfig(**d)


def _copy_weights(ours, theirs, rename):
    weights = [(rename(k), v) for k, v in file_weights(ours).items()]
    names = {k for k, _ in tree_flatten(theirs.parameters())}
    weights = [(k, v) for k, v in weights if k in names]  # mlx-vlm's DeepSeek V4 DSpark has no confidence head
    assert {k for k, _ in weights} == names, sorted(names - {k for k, _ in weights})
    theirs.update(tree_unflatten(weights))
    mx.eval(theirs.parameters())


def _target(args):
    model = random_model(args, seed=3)
    return model, SimpleNamespace(embed_tokens=model.embed, lm_head=model.lm_head)


def _close(a, b):
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) < TOL, np.max(np.abs(a - b))


@pytest.mark.parametrize("context_len", [1, 5, 8])
def test_dspark_draft_logits_match_mlx_vlm(context_len):
    args = tiny_args()
    model, stub = _target(args)
    ours = random_dspark(args, seed=4)
    d = ours.dspark
    config = VlmDspark(text_config=_text_config(args), n_mtp_layers=d.stage_count,
                       target_layer_ids=list(d.target_layer_ids), mask_token_id=d.noise_token_id,
                       markov_rank=d.markov_rank, block_size=d.block_size + 1)
    theirs = DeepseekV4DsparkDraftModel(config)
    _copy_weights(ours, theirs, lambda k: k if k.startswith("markov") else
                  _vlm_name(k, k[: k.index(".", len("stages.")) + 1], k[: k.index(".", len("stages.")) + 1]))
    theirs.bind(stub)

    ids = mx.array([[7, 100, 3, 250, 9, 41, 77, 8][:context_len]], dtype=mx.int32)
    taps = {i: None for i in ours.tap_keys}
    model(ids, model.make_cache(), taps=taps)
    context = ours.tap_rows(taps)  # [S, layers * H]: each tapped stream averaged over its HC copies
    anchor = 123

    hidden = ours.block_hidden(model, anchor, context, 0)
    base = ours.base_logits(model, hidden)
    inputs = mx.array([[anchor] + [d.noise_token_id] * (d.block_size - 1)], dtype=mx.int32)
    their_base = theirs._logits(theirs._hidden(inputs, context[None], theirs.make_cache()))[0]
    _close(base, their_base)

    tokens, rows, conf = ours.draft(model, anchor, context, 0, mx.argmax, d.block_size)
    their_tokens = theirs.draft_block(anchor, context[None], theirs.make_cache(), d.block_size + 1,
                                      lambda x: mx.argmax(x, axis=-1))
    assert tokens == their_tokens[0].tolist()
    previous = mx.array([anchor] + tokens[:-1], dtype=mx.int32)
    their_rows = mx.stack([theirs.markov_head.apply_step_logits(their_base[i:i + 1], previous[i:i + 1])[0]
                           for i in range(d.block_size)])
    _close(rows, their_rows)
    assert conf.shape == (d.block_size,) and bool(mx.all((conf > 0) & (conf < 1)))


def _mtp_pair(ours, theirs, model, tokens, states):
    """mlx-vlm's MTP over (state at p, token at p + 1) pairs from position 0, no cache: its logits and
    output streams."""
    embed = model.embed(mx.array([tokens], dtype=mx.int32))
    hidden, out = theirs._forward_hidden(embed, states[None], mx.array([tokens]), None)
    return model.lm_head(hidden)[0], out[0]


@pytest.mark.parametrize("n", [3, 12])
def test_mtp_logits_match_mlx_vlm(n):
    args = tiny_args()  # window 8: n = 12 also checks the sliding window
    model, stub = _target(args)
    ours = random_mtp(args, seed=5)
    theirs = DeepseekV4MTPDraftModel(VlmMtp(text_config=_text_config(args)))
    _copy_weights(ours, theirs, lambda k: _vlm_name(k, "block.", "decoder."))
    theirs.bind(stub)

    prompt = [7, 100, 3, 250, 9, 41, 77, 8, 19, 301, 4, 66, 90][: n + 1]
    taps = {"final": None}
    model(mx.array([prompt], dtype=mx.int32), model.make_cache(), taps=taps)
    states = taps["final"]  # [n + 1, hc, H]

    # every position at once: the window mask and the causal order
    logits, _, _ = ours.forward(model, prompt[1:], states[:-1], 0)
    their_logits, their_out = _mtp_pair(ours, theirs, model, prompt[1:], states[:-1])
    _close(logits, their_logits)

    # drafting after the committed prompt: the first draft reads the last state and the anchor, the
    # second the block's own output streams
    anchor = 5
    tokens, rows, _ = ours.draft(model, anchor, ours.tap_rows(taps), 0, mx.argmax, 2, committed_tokens=prompt)
    first, first_out = _mtp_pair(ours, theirs, model, prompt[1:] + [anchor], states)
    _close(rows[0], first[-1])
    assert tokens[0] == int(mx.argmax(first[-1]))
    second, _ = _mtp_pair(ours, theirs, model, prompt[1:] + [anchor, tokens[0]],
                          mx.concatenate([states, first_out[-1:]]))
    _close(rows[1], second[-1])
