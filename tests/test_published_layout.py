"""`--like q2` / `--like q4`: the bench's random model holds every weight in the type the published
files have once converted (issue 30's list), and the benches run on it."""

import json
import re

import mlx.core as mx
import pytest

from ds4_mlx import cli
from ds4_mlx.tools.testing import tiny_args

# the published files' types (ds4's q2 and q4), written out from the files' tensor list rather than
# from the converter's plan, which is what `published_model` follows
EIGHT_BIT = re.compile(r"(\.attn\.(q_a|q_b|kv|o_a|o_b)|\.ffn\.shared\.(gate|up|down)|^lm_head)$")
FLOAT16 = re.compile(r"(hc_(attn|ffn|head)\.fn|\.compressor\.(kv_gate\.weight|ape)|\.indexer\.(q_b|proj)\.weight"
                     r"|\.ffn\.gate\.weight|^embed\.weight)$")
FLOAT32 = re.compile(r"(norm\.weight|\.sinks|\.ffn\.bias|hc_(attn|ffn|head)\.(base|scale))$")


@pytest.mark.parametrize("variant, expert_bits", [("q2", 2), ("q4", 4)])
def test_every_weight_has_the_published_files_type(variant, expert_bits):
    from mlx.utils import tree_flatten

    from ds4_mlx.tools.random_model import published_model

    model = published_model(tiny_args(moe_intermediate_size=64), variant, native=False)
    quantized = {path: (m.bits, m.group_size, m.mode) for path, m in model.named_modules() if hasattr(m, "bits")}
    experts = {p for p in quantized if ".ffn.experts." in p}
    assert {quantized[p] for p in experts} == {(expert_bits, 64 if variant == "q2" else 32, "affine")}
    assert len(experts) == 3 * model.args.num_hidden_layers
    dense = set(quantized) - experts
    assert all(EIGHT_BIT.search(p) for p in dense) and len(dense) == 8 * model.args.num_hidden_layers + 1
    assert {quantized[p] for p in dense} == {(8, 32, "affine")}
    for name, value in tree_flatten(model.parameters()):
        module = name.rpartition(".")[0]
        if module in quantized:
            # Q4_K's scales (d * sc) need more bits than float16 holds: float32 (the converter's plan)
            scales = mx.float32 if variant == "q4" and ".ffn.experts." in name else mx.float16
            assert value.dtype == (mx.uint32 if name.endswith(".weight") else scales), name
        elif FLOAT16.search(name):
            assert value.dtype == mx.float16, name
        elif name.endswith("tid2eid"):
            assert value.dtype == mx.int32
        else:
            assert FLOAT32.search(name) and value.dtype == mx.float32, name


def test_speed_and_rewind_benches_run_like_q2(capsys):
    assert cli.main(["bench", "speed", "--preset", "tiny", "--like", "q2", "--contexts", "96", "--decode", "3",
                     "--chunk", "32", "--profile", "--profile-context", "96", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert figures["like"] == "q2" and figures["expert_bits"] is None
    assert figures["results"][0]["prefill_tok_s"] > 0 and figures["results"][0]["decode_tok_s"] > 0
    # the profile times the quantized dense products of a chunk and of a decoded token
    assert figures["profile"]["prefill_chunk"]["dense.quantized"] > 0
    assert figures["profile"]["decode_step"]["dense.quantized"] > 0
    assert cli.main(["bench", "rewind", "--like", "q4", "--contexts", "48", "--repeats", "1", "--generated", "2",
                     "--json"]) == 0
    rewind = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert rewind["like"] == "q4" and rewind["results"][0]["computed"] == 1


def test_like_and_expert_bits_together_are_refused(capsys):
    assert cli.main(["bench", "speed", "--preset", "tiny", "--like", "q2", "--expert-bits", "2"]) == 1
    assert "--expert-bits and --like both set the experts' format" in capsys.readouterr().err


def test_the_native_q2_layout_keeps_the_files_expert_blocks():
    """Where the converter keeps the experts' GGUF blocks, so does the bench: IQ2_XXS gate/up, Q2_K down."""
    from ds4_mlx.tools.random_model import published_model

    args = tiny_args(hidden_size=256, moe_intermediate_size=256)
    model = published_model(args, "q2", native=True)
    types = {path.rsplit(".", 1)[-1]: m.gguf_type for path, m in model.named_modules() if hasattr(m, "gguf_type")}
    assert types == {"gate": "iq2_xxs", "up": "iq2_xxs", "down": "q2_k"}
    assert mx.isfinite(model(mx.array([[1, 2, 3]]))).all()
