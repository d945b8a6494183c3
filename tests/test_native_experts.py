"""Routed experts kept in the GGUF's own blocks (IQ2_XXS gate/up, Q2_K down, as in the published q2 file):
the converted folder is the file's size, and the model computes the file's exact values, converted and
loaded directly, whole, chunked and decoded, against transformers holding the `gguf` package's values;
through the plain reference path everywhere and through mlx-kquant where it is installed."""

import json
import os

import numpy as np
import pytest

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from ds4_mlx.models import gguf_blocks
from ds4_mlx.models.gguf_names import mlx_name
from ds4_mlx.models.linear import GGUFSwitchLinear, gguf_gather_product
from test_convert import _convert, _hf_logits, _write_model, random_blocks

ATOL = 1e-3


@pytest.fixture(scope="module")
def q2_native(tmp_path_factory):
    """The tiny model with IQ2_XXS / Q2_K experts from random valid blocks (the rest F32), converted with
    native experts, and transformers' logits for 40 tokens."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("q2native")
    path, hf, args = _write_model(tmp, quant="q2", experts_only=True)
    _convert(path, tmp / "out", shard_gb=5.0, experts="native")
    ids = np.random.default_rng(11).integers(0, args.vocab_size, 40)
    return path, tmp / "out", ids, _hf_logits(hf, ids)


def _load(source, monkeypatch):
    import ds4_mlx

    monkeypatch.setattr(gguf_blocks, "native_available", lambda: True)  # a direct load keeps the blocks too
    return ds4_mlx.load(source, quant_sim=False)[0]


def _run(model, ids, pieces):
    """Logits of `ids` fed in pieces of the given sizes (the rest one token at a time, decoded)."""
    cache, outs, start = model.make_cache(), [], 0
    for n in pieces + [1] * (len(ids) - sum(pieces)):
        outs.append(np.array(model(mx.array(ids[None, start:start + n], dtype=mx.int32), cache=cache)[0]))
        start += n
    return np.concatenate(outs)


def test_folder_keeps_the_blocks(q2_native):
    path, out, _, _ = q2_native
    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]
    assert q["layers.0.ffn.experts.gate"] == q["layers.1.ffn.experts.up"] == {"gguf_type": "iq2_xxs"}
    assert q["layers.0.ffn.experts.down"] == {"gguf_type": "q2_k"}
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size <= 1.02 * os.path.getsize(path), (size, os.path.getsize(path))
    from gguf import GGUFReader

    arrays = {}
    for f in out.glob("*.safetensors"):
        arrays.update(mx.load(str(f)))
    experts = [t for t in GGUFReader(str(path)).tensors if "_exps" in t.name]
    assert len(experts) == 3 * len(config["compress_ratios"])
    for t in experts:  # the file's bytes, as they are
        stored = arrays[mlx_name(t.name)]
        assert stored.dtype == mx.uint8 and np.array_equal(np.array(stored).reshape(-1), np.asarray(t.data).reshape(-1))


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_native_experts_match_transformers(q2_native, monkeypatch, source):
    path, out, ids, ref = q2_native
    monkeypatch.setenv("DS4_MLX_KQUANT", "0")  # the plain reference path
    model = _load(out if source == "folder" else path, monkeypatch)
    experts = model.layers[0].ffn.experts
    assert isinstance(experts["gate"], GGUFSwitchLinear) and experts["gate"].weight.dtype == mx.uint8
    for pieces in ([40], [7, 13], [3, 5, 9]):  # whole, chunked then decoded
        got = _run(model, ids, pieces)
        assert got.dtype == np.float32
        assert np.abs(got - ref).max() <= ATOL, (pieces, np.abs(got - ref).max())


def test_kquant_path(q2_native, monkeypatch):
    """mlx-kquant forced on the CPU: float32 stays float32 and exact; bfloat16 runs its gather_qmm."""
    if gguf_blocks.kquant() is None:
        pytest.skip("mlx-kquant is not installed")
    path, out, ids, ref = q2_native
    monkeypatch.setenv("DS4_MLX_KQUANT", "1")
    assert gguf_blocks.path() == "kquant"
    model = _load(out, monkeypatch)
    for pieces in ([40], [7, 13]):
        got = _run(model, ids, pieces)
        assert got.dtype == np.float32 and np.abs(got - ref).max() <= ATOL
    rng = np.random.default_rng(2)
    raw, values = random_blocks(T.Q2_K, (4, 64, 256), rng)
    w = mx.array(raw)
    x = mx.array(rng.standard_normal((6, 1, 256)).astype(np.float32))
    idx = mx.array([0, 3, 1, 1, 2, 0], mx.uint32)
    want = np.einsum("tk,tok->to", np.array(x)[:, 0], values[np.array(idx)])
    y = gguf_gather_product(x, w, idx, "q2_k", False)
    assert y.dtype == mx.float32 and np.abs(np.array(y)[:, 0] - want).max() <= 1e-4 * np.abs(want).max()
    y = gguf_gather_product(x.astype(mx.bfloat16), w, idx, "q2_k", False)  # mlx-kquant's own product
    assert y.dtype == mx.bfloat16 and np.abs(np.array(y.astype(mx.float32))[:, 0] - want).max() <= 0.05 * np.abs(want).max()


def test_expert_loop_matches_transformers(q2_native, monkeypatch):
    """A prompt's routed experts one product per expert (CUDA's choice) give transformers' logits too; the
    test above takes spans of experts dequantized at once (the stack is one span at these widths)."""
    _, out, ids, ref = q2_native
    monkeypatch.setenv("DS4_MLX_KQUANT", "0")
    monkeypatch.setenv("DS4_MLX_EXPERT_PATH", "loop")
    got = _run(_load(out, monkeypatch), ids, [40])
    assert np.abs(got - ref).max() <= ATOL, np.abs(got - ref).max()


@pytest.mark.parametrize("span", [1, 3, 8])
def test_expert_spans_match_the_gguf_values(monkeypatch, span):
    """Sorted rows through IQ2_XXS / Q2_K experts in spans of `span` experts dequantized at once, against the
    `gguf` package's values; the tokens choose 3 of the 8 experts, so some spans have no rows."""
    from ds4_mlx.models import moe
    from ds4_mlx.models.args import ModelArgs

    H = I = 256
    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=2,
                     num_hash_layers=0, swiglu_limit=3.0)
    layer = moe.MoE(args, 0)
    rng = np.random.default_rng(5)
    values = {}
    for name, qtype, out, inp in (("gate", T.IQ2_XXS, I, H), ("up", T.IQ2_XXS, I, H), ("down", T.Q2_K, H, I)):
        raw, values[name] = random_blocks(qtype, (8, out, inp), rng, std=inp**-0.5)
        layer.experts[name] = GGUFSwitchLinear(8, inp, out, gguf_blocks.CODECS[qtype])
        layer.experts[name].weight = mx.array(raw)
    x = rng.standard_normal((40, H)).astype(np.float32)
    chosen = rng.choice([1, 2, 6], (40, 2))
    monkeypatch.setenv("DS4_MLX_KQUANT", "0")
    monkeypatch.setenv("DS4_MLX_EXPERT_PATH", "gather")
    monkeypatch.setenv("DS4_MLX_SPAN_BYTES", str(span * I * H * 4))
    got = np.array(layer._experts(mx.array(x), mx.array(chosen, mx.int32)))
    gate = np.einsum("th,tkih->tki", x, values["gate"][chosen])
    up = np.einsum("th,tkih->tki", x, values["up"][chosen])
    gate = np.minimum(gate, 3.0)
    h = gate / (1 + np.exp(-gate)) * np.clip(up, -3.0, 3.0)
    want = np.einsum("tki,tkhi->tkh", h, values["down"][chosen])
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("qtype", [T.Q2_K, T.IQ2_XXS, T.Q4_K], ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype):
    """The plain definition gives the `gguf` package's values bit for bit, on any leading shape."""
    import gguf.quants

    raw, values = random_blocks(qtype, (3, 5, 512), np.random.default_rng(4))
    assert np.array_equal(np.array(gguf_blocks.dequantize(raw, gguf_blocks.CODECS[qtype])), values)
    if gguf_blocks.kquant() is not None:
        got = gguf_blocks.kquant().dequantize(mx.array(raw), mx.zeros((1,)), gguf_blocks.CODECS[qtype], mx.float32)
        assert np.array_equal(np.array(got), gguf.quants.dequantize(raw, qtype))


def test_bench_builds_native_q2_experts(monkeypatch):
    """`bench speed --expert-format q2`'s model: random valid IQ2_XXS / Q2_K blocks of sane magnitude
    (values about 1/sqrt(width)), run natively."""
    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    monkeypatch.setenv("DS4_MLX_KQUANT", "0")
    model = random_model(tiny_args(0, hidden_size=256, moe_intermediate_size=256, vocab_size=384), expert_format="q2")
    experts = model.layers[1].ffn.experts
    assert experts["gate"].gguf_type == "iq2_xxs" and experts["down"].gguf_type == "q2_k"
    for name in ("gate", "down"):
        values = gguf_blocks.dequantize(experts[name].weight, experts[name].gguf_type)
        assert 0.3 < float(mx.sqrt(mx.mean(values * values))) * 16 < 3  # width 256: 1/16
    logits = model(mx.array([[1, 2, 3, 4, 5]], dtype=mx.int32))
    assert bool(mx.isfinite(logits).all())
