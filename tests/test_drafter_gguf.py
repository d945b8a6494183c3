"""Drafter GGUFs with ds4's tensor names and metadata, written here, load directly and converted."""

import gguf
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.convert.cli import convert
from ds4_mlx.loader import load_drafter
from ds4_mlx.models.linear import file_weights
from ds4_mlx.speculative import Speculation
from ds4_mlx.tools.drafters import random_dspark, random_mtp
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import tiny_args, write_gguf

# ds4's names of one block's tensors (the support file's list) -> our block parameters
BLOCK = {
    "hc_attn_fn.weight": "hc_attn.fn", "hc_attn_scale.weight": "hc_attn.scale", "hc_attn_base.weight": "hc_attn.base",
    "attn_norm.weight": "attn_norm.weight", "attn_q_a.weight": "attn.q_a.weight",
    "attn_q_a_norm.weight": "attn.q_a_norm.weight", "attn_q_b.weight": "attn.q_b.weight",
    "attn_kv.weight": "attn.kv.weight", "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_sinks.weight": "attn.sinks", "attn_output_a.weight": "attn.o_a.weight",
    "attn_output_b.weight": "attn.o_b.weight", "hc_ffn_fn.weight": "hc_ffn.fn", "hc_ffn_scale.weight": "hc_ffn.scale",
    "hc_ffn_base.weight": "hc_ffn.base", "ffn_norm.weight": "ffn_norm.weight", "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.bias", "ffn_gate_exps.weight": "ffn.experts.gate.weight",
    "ffn_up_exps.weight": "ffn.experts.up.weight", "ffn_down_exps.weight": "ffn.experts.down.weight",
    "ffn_gate_shexp.weight": "ffn.shared.gate.weight", "ffn_up_shexp.weight": "ffn.shared.up.weight",
    "ffn_down_shexp.weight": "ffn.shared.down.weight",
}
DSPARK_FIRST = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight"}
DSPARK_LAST = {"norm.weight": "norm.weight", "hc_head_fn.weight": "hc_head.fn", "hc_head_base.weight": "hc_head.base",
               "hc_head_scale.weight": "hc_head.scale"}
DSPARK_TOP = {"markov_head.markov_w1.weight": "markov_head.markov_w1.weight",
              "markov_head.markov_w2.weight": "markov_head.markov_w2.weight",
              "confidence_head.proj.weight": "confidence_head.proj.weight"}  # no bias in the list: zero
MTP = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
       "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight", "hc_head_fn.weight": "hc_head.fn",
       "hc_head_base.weight": "hc_head.base", "hc_head_scale.weight": "hc_head.scale"}


def _array(params, path):
    a = np.array(params[path].astype(mx.float32))
    return a.reshape(-1, a.shape[-1]) if path.endswith("attn.o_a.weight") else a  # the file's 2-D layout


def dspark_tensors(drafter, prefix="mtp"):
    params = file_weights(drafter)
    n = drafter.dspark.stage_count
    out = {}
    for s in range(n):
        names = dict(BLOCK)
        names.update(DSPARK_FIRST if s == 0 else {})
        names.update(DSPARK_LAST if s == n - 1 else {})
        for gguf_name, path in names.items():
            out[f"{prefix}.{s}.{gguf_name}"] = _array(params, f"stages.{s}.{path}")
    for gguf_name, path in DSPARK_TOP.items():
        out[f"{prefix}.{n - 1}.{gguf_name}"] = _array(params, path)
    return out


def mtp_tensors(drafter):
    params = file_weights(drafter)
    out = {f"mtp.0.{k}": _array(params, f"block.{v}") for k, v in BLOCK.items()}
    out.update({f"mtp.0.{k}": _array(params, v) for k, v in MTP.items()})
    return out


def dspark_metadata(d, prefix="dspark."):
    return {prefix + "block_size": d.block_size, prefix + "markov_rank": d.markov_rank,
            prefix + "noise_token_id": d.noise_token_id, prefix + "target_layer_ids": list(d.target_layer_ids),
            prefix + "stage_count": d.stage_count}


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_args(), seed=1)


def _same_drafts(a, b, target):
    """Both drafters draft the same tokens from the same logits after a prompt."""
    from ds4_mlx.session import Session

    prompt = [5, 9, 33, 100, 7, 8, 200, 3, 4]
    rows = []
    for drafter in (a, b):
        session = Session(target)
        spec = Speculation(drafter, draft_tokens=3)
        spec.attach(session)
        session.sync(prompt)
        first, context = session.tap_log.window(len(prompt), target.args.sliding_window)
        tokens, logits, conf = drafter.draft(target, 42, context, first, mx.argmax, 3, committed_tokens=session.tokens)
        rows.append((tokens, np.array(logits), None if conf is None else np.array(conf)))
    assert rows[0][0] == rows[1][0]
    assert np.max(np.abs(rows[0][1] - rows[1][1])) < 1e-4
    if rows[0][2] is not None:
        assert np.max(np.abs(rows[0][2] - rows[1][2])) < 1e-5


@pytest.mark.parametrize("variant", ["mtp names, dspark keys", "dspark names, deepseek4.dspark keys"])
def test_dspark_gguf_loads_direct_and_converted(target, tmp_path, variant):
    ours = random_dspark(target.args, seed=7)
    ours.confidence_head.proj.bias = mx.zeros((1,))
    names, keys = ("mtp", "dspark.") if variant.startswith("mtp") else ("dspark", "deepseek4.dspark.")
    tensors = dspark_tensors(ours, names)
    assert len(tensors) == 24 * 3 + 2 + 7  # ds4's support file holds 81
    # the HC functions as F16 and main_proj as Q8_0, as in ds4's file
    for k in list(tensors):
        if "hc_attn_fn" in k or "hc_ffn_fn" in k:
            tensors[k] = tensors[k].astype(np.float16)
    main = tensors[f"{names}.0.main_proj.weight"]
    q8 = gguf.quants.quantize(main, gguf.GGMLQuantizationType.Q8_0)
    tensors[f"{names}.0.main_proj.weight"] = (q8, gguf.GGMLQuantizationType.Q8_0)
    path = write_gguf(tmp_path / "DeepSeek-V4-Flash-DSpark-support.gguf", dspark_metadata(ours.dspark, keys), tensors,
                      arch="deepseek4-dspark")
    # the reference holds what the file holds: F16-rounded HC functions, Q8_0 main_proj values
    ours.stages[0].main_proj.weight = mx.array(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
    for stage in ours.stages:
        for hc in (stage.hc_attn, stage.hc_ffn):
            hc.fn = hc.fn.astype(mx.float16).astype(mx.float32)

    direct = load_drafter(path, target)
    assert direct.dspark == ours.dspark
    _same_drafts(ours, direct, target)
    folder = convert(path, tmp_path / "dspark-mlx", progress=False, log=lambda m: None)
    _same_drafts(ours, load_drafter(folder, target), target)


def test_mtp_gguf_loads_direct_and_converted(target, tmp_path):
    ours = random_mtp(target.args, seed=8)
    path = write_gguf(tmp_path / "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf", {}, mtp_tensors(ours))
    direct = load_drafter(path, target)
    assert isinstance(direct, type(ours))
    _same_drafts(ours, direct, target)
    folder = convert(path, tmp_path / "mtp-mlx", progress=False, log=lambda m: None)
    _same_drafts(ours, load_drafter(folder, target), target)


def test_bad_drafter_files_get_one_line_errors(target, tmp_path):
    ours = random_dspark(target.args, seed=7)
    tensors = dspark_tensors(ours)
    path = write_gguf(tmp_path / "no-keys.gguf", {}, tensors, arch="deepseek4-dspark")
    with pytest.raises(ValueError, match="missing metadata key dspark.target_layer_ids"):
        load_drafter(path, target)
    tensors["mtp.0.mystery.weight"] = np.zeros((2, 2), np.float32)
    path = write_gguf(tmp_path / "extra.gguf", dspark_metadata(ours.dspark), tensors, arch="deepseek4-dspark")
    with pytest.raises(ValueError, match="unknown tensor mtp.0.mystery.weight"):
        load_drafter(path, target)
    wide = random_dspark(tiny_args(hidden_size=96), seed=7)
    path = write_gguf(tmp_path / "wide.gguf", dspark_metadata(wide.dspark), dspark_tensors(wide),
                      arch="deepseek4-dspark")
    with pytest.raises(ValueError, match="does not fit this model"):
        load_drafter(path, target)
    with pytest.raises(ValueError, match="not a converted drafter folder"):
        load_drafter(tmp_path, target)


def test_generate_with_mtp_flags_prints_the_plain_answer(demo, tmp_path, capsys):
    """`ds4-mlx generate --mtp FILE --dspark` (and an MTP file) on the demo model: the same answer."""
    from ds4_mlx import cli

    model = demo[0]
    dspark = random_dspark(model.args, seed=3)
    dspark_file = write_gguf(tmp_path / "dspark.gguf", dspark_metadata(dspark.dspark), dspark_tensors(dspark),
                             arch="deepseek4-dspark")
    mtp_file = write_gguf(tmp_path / "mtp.gguf", {}, mtp_tensors(random_mtp(model.args, seed=4)))
    argv = ["generate", "-p", "Hello there", "--temp", "0", "-n", "16", "--nothink"]
    outputs = []
    for extra in ([], ["--mtp", str(dspark_file), "--dspark", "--draft-tokens", "3"], ["--mtp", str(mtp_file)]):
        assert cli.main(argv + extra) == 0
        out, err = capsys.readouterr()
        outputs.append(out)
        assert ("[speculation:" in err) == bool(extra)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert cli.main(argv + ["--mtp", str(mtp_file), "--dspark"]) == 1
    assert "this is an MTP drafter" in capsys.readouterr().err
