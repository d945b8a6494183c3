"""GGUF -> MLX: per-type exactness, tiny models against transformers, converted folder == direct load,
and bad input (one-line error, non-zero exit, nothing written)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mlx.core as mx
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ds4_mlx.convert import gguf as G

EXACT = {T.Q8_0: "affine", T.Q4_K: "affine", T.MXFP4: "mxfp4"}
# relative RMS error of the requantization on random blocks (measured 0.063 and 0.021)
REQUANT_BOUND = {T.Q2_K: 0.08, T.IQ2_XXS: 0.03}
# mean KL(transformers || MLX) over 64 tokens of the tiny model with every eligible matrix in that type,
# uniformly random codes (the worst case for requantization). Measured: exact types ~2e-12,
# Q2_K 0.109, IQ2_XXS 0.027 (2-bit random networks; the real files use Q2_K only on expert down weights).
KL_BOUND = {T.Q8_0: 1e-6, T.Q4_K: 1e-6, T.MXFP4: 1e-6, T.Q2_K: 0.2, T.IQ2_XXS: 0.06}

_F16_FIELDS = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q2_K: [80, 82], T.IQ2_XXS: [0]}
_DMIN_RATIO = {T.Q4_K: 7.5, T.Q2_K: 1.5}  # centres d*sc*q - dmin*m around 0


def random_blocks(qtype, shape, rng, std=1.0):
    """Valid random GGUF bytes of `qtype` for a numpy-order `shape` whose values have about `std`."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, (rows, shape[-1] // block, size), dtype=np.uint8)

    def set_scale(d):
        if qtype == T.MXFP4:
            raw[..., 0] = np.clip(127 + np.round(np.log2(d)), 1, 254).astype(np.uint8)
            return
        for i, off in enumerate(_F16_FIELDS[qtype]):
            v = d * (_DMIN_RATIO[qtype] if i else 1.0)
            raw[..., off:off + 2] = np.full(raw.shape[:2] + (1,), v, np.float16).view(np.uint8)

    set_scale(1.0)
    unit = gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std()
    set_scale(std / unit)
    raw = raw.reshape(*shape[:-1], -1)
    return raw, gguf.quants.dequantize(raw, qtype)


def mlx_dequantize(q, fmt):
    args = [mx.array(q["weight"]), mx.array(q["scales"])] + ([mx.array(q["biases"])] if "biases" in q else [])
    return np.array(mx.dequantize(*args, group_size=fmt["group_size"], bits=fmt["bits"], mode=fmt["mode"],
                                  dtype=mx.float32))


@pytest.mark.parametrize("qtype", list(EXACT), ids=lambda t: t.name)
def test_exact_types_repack_bit_for_bit(qtype):
    raw, ref = random_blocks(qtype, (48, 512), np.random.default_rng(1))
    q = G.repack(raw, qtype, 512)
    fmt = G._EXACT_FORMATS[qtype]
    assert fmt["mode"] == EXACT[qtype]
    got = mlx_dequantize(q, fmt)
    assert np.array_equal(got, ref)
    # same layout as mx.quantize gives
    w, *rest = mx.quantize(mx.array(ref), group_size=fmt["group_size"], bits=fmt["bits"], mode=fmt["mode"])
    assert q["weight"].shape == w.shape and q["weight"].dtype == np.uint32
    assert [a.shape for a in q.values()][1:] == [a.shape for a in rest]
    # and quantized matmul agrees with the float weights
    x = mx.array(np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32))
    args = [mx.array(q["weight"]), mx.array(q["scales"])] + ([mx.array(q["biases"])] if "biases" in q else [])
    y = mx.quantized_matmul(x, *args, transpose=True, group_size=32, bits=fmt["bits"], mode=fmt["mode"])
    np.testing.assert_allclose(np.array(y), np.array(x) @ ref.T, atol=1e-3 * np.abs(ref).max() * 30)


@pytest.mark.parametrize("qtype", list(REQUANT_BOUND), ids=lambda t: t.name)
def test_requantized_types_within_bound(qtype):
    raw, ref = random_blocks(qtype, (64, 1024), np.random.default_rng(3))
    errs = {}
    for bits, g in G.REQUANT_CANDIDATES:
        q = G.requantize(ref, bits, g)
        got = mlx_dequantize(q, {"group_size": g, "bits": bits, "mode": "affine"})
        errs[bits, g] = np.sqrt(np.square(got - ref).sum() / np.square(ref).sum())
        # a least-squares fit is never worse than MLX's own min/max quantization
        mq = mx.quantize(mx.array(ref), group_size=g, bits=bits)
        plain = np.array(mx.dequantize(*mq, group_size=g, bits=bits))
        assert errs[bits, g] <= np.sqrt(np.square(plain - ref).sum() / np.square(ref).sum()) + 1e-6
    assert errs[3, 32] == min(errs.values()) <= REQUANT_BOUND[qtype]


def test_float_types_exact():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    bf = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exactly representable
    assert np.array_equal(G.to_float(w.view(np.uint8), T.F32, 64), w)
    assert np.array_equal(G.to_float(w.astype(np.float16).view(np.uint8), T.F16, 64), w.astype(np.float16).astype(np.float32))
    assert np.array_equal(G.to_float(bf.view(np.uint8), T.BF16, 64), (bf.astype(np.uint32) << 16).view(np.float32))
    i = rng.integers(-5, 5, (8, 64)).astype(np.int32)
    assert np.array_equal(G.to_float(i.view(np.uint8), T.I32, 64), i)


# ---------------------------------------------------------------------------------------------------------
# tiny models


def _tiny(quant):
    from ds4_mlx.testing import tiny_args

    # widths of 256 so K-quant rows (256 values a block) fit: experts, q_a, kv, shared experts, lm head
    return tiny_args(0, hidden_size=256, moe_intermediate_size=256, vocab_size=384) if quant else tiny_args(0)


def _hf_state_names(model):
    """transformers parameter -> ds4 GGUF name (experts' gate_up -> both halves)."""
    from ds4_mlx import testing

    out = {}
    for name in model.state_dict():
        if name in testing._HF_TOP:
            out[name] = testing._HF_TOP[name]
        else:
            _, _, i, sub = name.split(".", 3)
            out[name] = f"blk.{i}.ffn_gate_exps.weight" if sub == "mlp.experts.gate_up_proj" \
                else f"blk.{i}.{testing._HF_LAYER[sub]}"
    return out


def _write_model(tmp_path, dtype=None, quant=None, llama_cpp=False):
    """A tiny GGUF with its matrices in `quant` (random valid blocks) or float `dtype`, and the
    transformers model holding exactly the values the file encodes."""
    import torch
    from ds4_mlx import testing

    args = _tiny(quant)
    hf = testing.hf_tiny_model(args, seed=0)
    tensors = testing.hf_to_gguf_tensors(hf)
    rng = np.random.default_rng(5)
    values = {}
    for name, a in tensors.items():
        path = G.dsv4.mlx_name(name)
        block = GGML_QUANT_SIZES[quant][0] if quant else 1
        if quant and G.keeps_quantized(path, a.ndim) and a.shape[-1] % block == 0 and a.ndim >= 2:
            raw, values[name] = random_blocks(quant, a.shape, rng, std=float(a.std()))
            tensors[name] = (raw, quant)
        elif dtype == np.float16 and a.dtype == np.float32:
            tensors[name] = a.astype(np.float16)
            values[name] = tensors[name].astype(np.float32)
        else:
            values[name] = a
    meta = testing.gguf_metadata(args)
    if llama_cpp:  # llama.cpp's deepseek4 keys (architecture notes, section 8)
        del meta["deepseek4.vocab_size"]
        meta.update({"deepseek4.expert_gating_func": 4, "deepseek4.embedding_length_out": 4 * args.hidden_size,
                     "deepseek4.swiglu_clamp_shexp": [float(args.swiglu_limit)] * args.num_hidden_layers,
                     "deepseek4.rope.scaling.type": "yarn", "tokenizer.chat_template": "{{ x }}"})
        meta["deepseek4.attention.compress_ratios"] = list(args.compress_ratios) + [0]
    path = testing.write_gguf(tmp_path / "m.gguf", meta, tensors)
    names = _hf_state_names(hf)
    with torch.no_grad():
        for hname, t in hf.state_dict().items():
            g = names[hname]
            if hname.endswith("gate_up_proj"):
                v = np.concatenate([values[g], values[g.replace("gate_exps", "up_exps")]], axis=1)
            else:
                v = values[g]
            t.copy_(torch.from_numpy(np.asarray(v).astype(np.float32 if t.is_floating_point() else np.int64)))
    return path, hf, args


def _logits(model, ids):
    return np.array(model(mx.array(ids[None], dtype=mx.int32))[0])


def _hf_logits(hf, ids):
    import torch

    with torch.no_grad():
        return hf(torch.tensor(ids[None], dtype=torch.long), use_cache=False).logits[0].numpy()


def _kl(ref, got):
    def logp(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p = logp(ref.astype(np.float64))
    return float((np.exp(p) * (p - logp(got.astype(np.float64)))).sum(-1).mean())


def _convert(gguf_path, out):
    from ds4_mlx.convert.cli import convert

    logs = []
    convert(gguf_path, out, progress=False, shard_gb=0.0005, log=logs.append)  # small shards: several files
    return logs


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["F32", "F16"])
def test_tiny_model_float(tmp_path, dtype):
    pytest.importorskip("transformers")
    import ds4_mlx

    path, hf, args = _write_model(tmp_path, dtype=dtype)
    ids = np.random.default_rng(6).integers(0, args.vocab_size, 64)
    ref = _hf_logits(hf, ids)
    direct, _ = ds4_mlx.load(path, quant_sim=False)
    _convert(path, tmp_path / "out")
    folder, _ = ds4_mlx.load(tmp_path / "out", quant_sim=False)
    a, b = _logits(direct, ids), _logits(folder, ids)
    assert np.abs(a - ref).max() <= 1e-3
    assert np.array_equal(a, b)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4, T.Q2_K, T.IQ2_XXS], ids=lambda t: t.name)
def test_tiny_model_quantized(tmp_path, qtype):
    """Quantized matrices stay quantized; logits against transformers holding the file's exact values."""
    pytest.importorskip("transformers")
    import ds4_mlx

    path, hf, args = _write_model(tmp_path, quant=qtype, llama_cpp=qtype == T.MXFP4)
    ids = np.random.default_rng(7).integers(0, args.vocab_size, 64)
    ref = _hf_logits(hf, ids)
    logs = _convert(path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    q = config["quantization"]
    assert {"layers.0.ffn.experts.gate", "layers.0.ffn.experts.down", "lm_head", "layers.3.attn.q_a"} <= set(q)
    assert not any(k.endswith(("ffn.gate", "indexer.proj", "compressor.kv")) for k in q)
    if qtype in EXACT:
        assert q["lm_head"] == G._EXACT_FORMATS[qtype]
    else:  # the requantization error is logged for every tensor
        assert q["lm_head"]["bits"] in (2, 3) and any("lm_head" in line and "error" in line for line in logs)
    direct, _ = ds4_mlx.load(path, quant_sim=False)
    folder, _ = ds4_mlx.load(tmp_path / "out", quant_sim=False)
    a, b = _logits(direct, ids), _logits(folder, ids)
    assert np.array_equal(a, b)
    kl = _kl(ref, a)
    print(f"{qtype.name}: KL {kl:.3g}, max |dlogit| {np.abs(a - ref).max():.3g}")
    assert kl <= KL_BOUND[qtype]
    if qtype in EXACT:
        assert np.abs(a - ref).max() <= 1e-2


# ---------------------------------------------------------------------------------------------------------
# bad input


def _small_valid(tmp_path):
    from ds4_mlx import testing

    args = testing.tiny_args(0)
    return testing.write_gguf(tmp_path / "ok.gguf", testing.gguf_metadata(args),
                              testing.random_gguf_tensors(args)), args


def _bad_files(tmp_path):
    from gguf import GGUFWriter
    from ds4_mlx import testing

    ok, args = _small_valid(tmp_path)
    data = ok.read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    (tmp_path / "corrupt.gguf").write_bytes(data[:4] + bytes(range(256)) * 8 + data[2052:])
    w = GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    tensors = testing.random_gguf_tensors(args)
    del tensors["blk.1.attn_q_a.weight"]
    testing.write_gguf(tmp_path / "missing.gguf", testing.gguf_metadata(args), tensors)
    tensors = testing.random_gguf_tensors(args)
    tensors["blk.0.attn_mystery.weight"] = np.zeros(4, np.float32)
    testing.write_gguf(tmp_path / "unknown.gguf", testing.gguf_metadata(args), tensors)
    return {"truncated": "truncated", "corrupt": "corrupt", "llama": "architecture is 'llama'",
            "missing": "missing tensor blk.1.attn_q_a", "unknown": "unknown tensor blk.0.attn_mystery"}


def test_bad_input_one_line_nothing_written(tmp_path, capsys, monkeypatch):
    from ds4_mlx import cli

    monkeypatch.setattr(cli, "SUBCOMMANDS", {"convert": "ds4_mlx.convert.cli"})
    for name, message in _bad_files(tmp_path).items():
        before = set(os.listdir(tmp_path))
        rc = cli.main(["convert", str(tmp_path / f"{name}.gguf"), str(tmp_path / f"out-{name}"), "--quiet"])
        err = capsys.readouterr().err
        assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, (name, err)
        assert "Traceback" not in err
        assert set(os.listdir(tmp_path)) == before  # no output folder, no partial folder
    rc = cli.main(["convert", str(tmp_path / "nope.gguf"), str(tmp_path / "o"), "--quiet"])
    assert rc != 0 and "no such file" in capsys.readouterr().err


def test_exit_code_subprocess_and_interrupt_cleanup(tmp_path, monkeypatch):
    _bad_files(tmp_path)
    p = subprocess.run([sys.executable, "-m", "ds4_mlx.convert.cli", str(tmp_path / "missing.gguf"),
                        str(tmp_path / "out"), "--quiet"], capture_output=True, text=True)
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0 and "missing tensor" in p.stderr
    assert not (tmp_path / "out").exists()
    # an interruption mid-way (Ctrl+C) leaves nothing behind either
    from ds4_mlx.convert import cli as ccli

    real = G.convert_chunks

    def interrupted(f, plan, log=None):
        if plan.path.startswith("layers.2"):
            raise KeyboardInterrupt
        yield from real(f, plan, log)

    monkeypatch.setattr(G, "convert_chunks", interrupted)
    before = set(os.listdir(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        ccli.convert(tmp_path / "ok.gguf", tmp_path / "out2", progress=False)
    assert set(os.listdir(tmp_path)) == before
