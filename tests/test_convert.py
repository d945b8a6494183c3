"""GGUF -> MLX: per-type exactness (float16 scales), requantization error on realistic codes, tiny models
against transformers, converted folder == direct load, split shards, the one-time conversion cache,
the published files' projected sizes, and bad input (one-line error, non-zero exit, nothing written)."""

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
from ds4_mlx.demo import random_gguf_tensors
from ds4_mlx.models import gguf_blocks
from ds4_mlx.models.gguf_names import mlx_name

EXACT = {T.Q8_0: "affine", T.Q4_0: "affine", T.Q4_1: "affine", T.Q5_0: "affine", T.Q5_1: "affine",
         T.Q4_K: "affine", T.Q5_K: "affine", T.MXFP4: "mxfp4"}
# mean KL(transformers holding the GGUF's values || MLX) over 64 tokens of the tiny model with every
# eligible matrix in that type (random codes): every type is held exactly now.
KL_BOUND = 1e-6

# offsets of each block's float16 d (and dmin or m); the second is `_DMIN_RATIO` times the first
_F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
               T.Q2_K: [80, 82], T.Q6_K: [208], T.IQ2_XXS: [0], T.IQ4_XS: [0]}
# centres the values around 0: d*sc*q - dmin*m (K-quants), d*q + m (Q4_1, Q5_1)
_DMIN_RATIO = {T.Q4_K: 7.5, T.Q5_K: 15.5, T.Q2_K: 1.5, T.Q4_1: -7.5, T.Q5_1: -15.5}


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
    """Values of stored arrays (mx.dequantize computes in the scales' dtype: float16 ones go up to float32
    first, as quantized_matmul does with float32 inputs)."""
    f32 = lambda a: mx.array(a).astype(mx.float32) if a.dtype == np.float16 else mx.array(a)
    args = [mx.array(q["weight"]), f32(q["scales"])] + ([f32(q["biases"])] if "biases" in q else [])
    return np.array(mx.dequantize(*args, group_size=fmt["group_size"], bits=fmt["bits"], mode=fmt["mode"],
                                  dtype=mx.float32))


def _as_stored(q):
    """The arrays as the converter writes them: affine scales and biases in float16."""
    return {k: G.to_scales(v, "F16", False) if k != "weight" and v.dtype == np.float32 else v for k, v in q.items()}


@pytest.mark.parametrize("qtype", list(EXACT), ids=lambda t: t.name)
def test_exact_types_repack(qtype):
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 are bit-exact with float16 scales; K-quants' scales d*sc
    and mins dmin*m are products of a float16 and a 6-bit integer, so float16 rounds them (the converter
    keeps them in float32): each value stays within 2^-11 of |scale*q| + |bias|."""
    raw, ref = random_blocks(qtype, (48, 512), np.random.default_rng(1))
    q32 = G.repack(raw, qtype, 512)
    q = _as_stored(q32)
    fmt = G._EXACT_FORMATS[qtype]
    assert fmt["mode"] == EXACT[qtype]
    got = mlx_dequantize(q, fmt)
    if qtype in (T.Q4_K, T.Q5_K):
        assert np.array_equal(mlx_dequantize(q32, fmt), ref)  # with the converter's float32 scales
        bias = np.repeat(np.abs(q32["biases"]), 32, axis=1)
        assert (np.abs(got - ref) <= 2.0**-11 * (np.abs(ref) + 2 * bias) + 1e-7 * np.abs(ref)).all()
        rel = np.sqrt(np.square(got - ref).sum() / np.square(ref).sum())
        assert 0 < rel < 5e-4  # measured 3.1e-4 on these random blocks
    else:
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


def test_scale_precision_choice():
    x = np.array([[1e-3, -2.5, 0.0, 3e-7]], np.float32)
    assert G.to_scales(x, "F16", False).dtype == np.float16
    with pytest.raises(G.WidenScales):  # overflows float16
        G.to_scales(np.array([[7e4]], np.float32), "F16", False)
    with pytest.raises(G.WidenScales):  # flushed to zero
        G.to_scales(np.array([[1e-9, 1.0]], np.float32), "F16", False)
    with pytest.raises(G.WidenScales):  # rounded, where the values must stay exact
        G.to_scales(np.array([[1.0 + 2.0**-12]], np.float32), "F16", True)
    b = np.array([[7e4, 1e-9, -3.0, 0.0]], np.float32)
    assert np.array_equal(G.to_scales(b, "F32", True), b)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.IQ2_XXS], ids=lambda t: t.name)
def test_mlx_dequantize_matches_gguf(qtype):
    """The MLX dequantizers give the gguf package's values bit for bit, on random bytes and on
    codes from the reference quantizer."""
    from ds4_mlx.convert import reference_quant as Q, requant

    rng = np.random.default_rng(3)
    raw, ref = random_blocks(qtype, (16, 1024), rng)
    assert np.array_equal(np.array(requant.dequantize(raw, qtype, 1024)), ref)
    raw = Q.quantize(Q.realistic_weights(16, 1024, rng), qtype)
    assert np.array_equal(np.array(requant.dequantize(raw, qtype, 1024)), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_mlx_layout(bits):
    from ds4_mlx.convert import requant

    codes = mx.array(np.random.default_rng(bits).integers(0, 2**bits, (4, 256)).astype(np.uint32))
    packed = requant.pack(codes, bits)
    ones, zeros = mx.ones((4, 256 // 32)), mx.zeros((4, 256 // 32))
    assert np.array_equal(np.array(mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)), np.array(codes))


# relative RMS error requantization adds, against the GGUF's own values, on codes of the reference
# quantizer from heavy-tailed weights (measured: Q2_K 0.322 (2-bit g64), 0.113 (3-bit g32);
# IQ2_XXS 0.290 (2-bit g64), 0.026 (3-bit g32))
REQUANT_BOUND = {(T.Q2_K, 2, 64): 0.34, (T.Q2_K, 3, 32): 0.125, (T.IQ2_XXS, 2, 64): 0.31, (T.IQ2_XXS, 3, 32): 0.035}


@pytest.mark.parametrize("qtype,bits,group", list(REQUANT_BOUND), ids=lambda v: getattr(v, "name", str(v)))
def test_requantized_error(qtype, bits, group):
    from ds4_mlx.convert import reference_quant as Q, requant

    rng = np.random.default_rng(4)
    raw = Q.quantize(Q.realistic_weights(64, 2048, rng), qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    q, e2, r2 = requant.convert_rows(raw, qtype, 2048, bits, group)
    got = mlx_dequantize(_as_stored(q), {"group_size": group, "bits": bits, "mode": "affine"})
    err = np.sqrt(np.square(got - ref).sum() / np.square(ref).sum())
    assert abs(err - np.sqrt(e2 / r2)) < 1e-3  # the logged figure is the one stored (fp16 aside)
    print(f"{qtype.name} {bits}-bit g{group}: relative RMS {err:.4f}")
    assert err <= REQUANT_BOUND[qtype, bits, group]
    # a least-squares fit is never worse than MLX's own min/max quantization
    plain = np.array(mx.dequantize(*mx.quantize(mx.array(ref), group_size=group, bits=bits), group_size=group, bits=bits))
    assert np.sqrt(e2 / r2) <= np.sqrt(np.square(plain - ref).sum() / np.square(ref).sum())


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
    from ds4_mlx.tools.testing import tiny_args

    # widths of 256 so K-quant rows (256 values a block) fit: experts, q_a, kv, shared experts, lm head
    return tiny_args(0, hidden_size=256, moe_intermediate_size=256, vocab_size=384) if quant else tiny_args(0)


def _hf_state_names(model):
    """transformers parameter -> ds4 GGUF name (experts' gate_up -> both halves)."""
    from ds4_mlx.tools import testing

    out = {}
    for name in model.state_dict():
        if name in testing._HF_TOP:
            out[name] = testing._HF_TOP[name]
        else:
            _, _, i, sub = name.split(".", 3)
            out[name] = f"blk.{i}.ffn_gate_exps.weight" if sub == "mlp.experts.gate_up_proj" \
                else f"blk.{i}.{testing._HF_LAYER[sub]}"
    return out


def _q2_mix(name):
    """The published q2 file's types: IQ2_XXS expert gate/up, Q2_K expert down, Q8_0 other matrices."""
    return T.IQ2_XXS if "_exps" in name and "down" not in name else T.Q2_K if "down_exps" in name else T.Q8_0


def _write_model(tmp_path, dtype=None, quant=None, llama_cpp=False, every_matrix=False, experts_only=False,
                 types=None):
    """A tiny GGUF with its matrices in `quant` (a type, or "q2" for the published q2 mix) or float
    `dtype`, and the transformers model holding exactly the values the file encodes. Exact types get
    random valid blocks, Q2_K / IQ2_XXS the codes the reference quantizer gives for the weights.
    `every_matrix`: as llama.cpp's converter writes `--outtype q8_0`, every float matrix (embedding,
    router, HC and compressor projections included) quantized from its weights by the `gguf` package.
    `experts_only`: only the routed experts quantized, from random valid blocks; the rest float32.
    `types`: {GGUF tensor name: type} of every tensor (a whole file's layout, the options above aside):
    Q8_0 quantized from the weights, other quantized types random valid blocks, F16 rounded."""
    import torch
    from ds4_mlx.tools import testing

    args = _tiny(quant or types)
    hf = testing.hf_tiny_model(args, seed=0)
    tensors = testing.hf_to_gguf_tensors(hf)
    rng = np.random.default_rng(5)
    values = {}
    mix = quant
    for name, a in tensors.items():
        path = mlx_name(name)
        quant = _q2_mix(name) if mix == "q2" else mix
        block = GGML_QUANT_SIZES[quant][0] if quant else 1
        if types is not None:
            t = types[name]
            if t == T.Q8_0:
                tensors[name] = (gguf.quants.quantize(a, t), t)
                values[name] = gguf.quants.dequantize(tensors[name][0], t)
            elif t == T.F16:
                tensors[name] = a.astype(np.float16)
                values[name] = tensors[name].astype(np.float32)
            elif t in (T.F32, T.I32):
                values[name] = a
            else:
                raw, values[name] = random_blocks(t, a.shape, rng, std=float(a.std()))
                tensors[name] = (raw, t)
        elif experts_only and "_exps" in name:
            raw, values[name] = random_blocks(quant, a.shape, rng, std=float(a.std()))
            tensors[name] = (raw, quant)
        elif experts_only:
            values[name] = a
        elif every_matrix and a.ndim >= 2 and a.dtype == np.float32 and a.shape[-1] % block == 0:
            if quant in G.REQUANT_TYPES:  # types the `gguf` package decodes only: random valid blocks
                raw, values[name] = random_blocks(quant, a.shape, rng, std=float(a.std()))
                tensors[name] = (raw, quant)
            else:
                tensors[name] = (gguf.quants.quantize(a, quant), quant)
                values[name] = gguf.quants.dequantize(tensors[name][0], quant)
        elif quant and G.keeps_quantized(path, a.ndim, quant) and a.shape[-1] % block == 0 and a.ndim >= 2:
            if quant in G.REQUANT_TYPES:  # codes as a quantizer gives them for these weights
                from ds4_mlx.convert import reference_quant

                raw = reference_quant.quantize(a.reshape(-1, a.shape[-1]), quant).reshape(*a.shape[:-1], -1)
                values[name] = gguf.quants.dequantize(raw, quant)
            else:
                raw, values[name] = random_blocks(quant, a.shape, rng, std=float(a.std()))
            tensors[name] = (raw, quant)
        elif dtype == np.float16 and a.dtype == np.float32:
            tensors[name] = a.astype(np.float16)
            values[name] = tensors[name].astype(np.float32)
        elif dtype == "BF16" and a.dtype == np.float32 and a.ndim >= 2:  # truncated: exactly representable
            bf = (a.view(np.uint32) >> 16).astype(np.uint16)
            tensors[name] = (bf.view(np.uint8).reshape(*a.shape[:-1], -1), T.BF16)
            values[name] = (bf.astype(np.uint32) << 16).view(np.float32)
        else:
            values[name] = a
    meta = testing.gguf_metadata(args)
    if llama_cpp:  # llama.cpp's deepseek4 keys
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


def _convert(gguf_path, out, shard_gb=0.0005, **options):
    """Convert; small shards by default, so a tiny model spans several files."""
    from ds4_mlx.convert.cli import convert

    logs = []
    convert(gguf_path, out, progress=False, shard_gb=shard_gb, log=logs.append, **options)
    return logs


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "BF16"], ids=["F32", "F16", "BF16"])
def test_tiny_model_float(tmp_path, dtype):
    pytest.importorskip("transformers")
    import ds4_mlx

    path, hf, args = _write_model(tmp_path, dtype=dtype)
    ids = np.random.default_rng(6).integers(0, args.vocab_size, 64)
    ref = _hf_logits(hf, ids)
    direct, _ = ds4_mlx.load(path, quant_sim=False)
    _convert(path, tmp_path / "out")
    folder, _ = ds4_mlx.load(tmp_path / "out", quant_sim=False)
    want = {np.float16: mx.float16, "BF16": mx.bfloat16}.get(dtype, mx.float32)  # F16 / BF16 stay as they are
    assert direct.embed.weight.dtype == folder.embed.weight.dtype == want
    a, b = _logits(direct, ids), _logits(folder, ids)
    assert np.array_equal(a, b)
    direct.set_dtype(mx.float32)  # the exact mode: the file's values, float32 math
    assert np.abs(_logits(direct, ids) - ref).max() <= 1e-3
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1


# folder / GGUF: Q5_K's affine scales and biases are float32 (d * sc needs 17 bits), 2 bits a weight
SIZE_BOUND = {T.Q5_K: 1.30}


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4, T.Q4_0, T.Q5_1, T.Q5_K], ids=lambda t: t.name)
def test_tiny_model_quantized(tmp_path, qtype, monkeypatch):
    """Quantized matrices stay quantized (Q4_K experts in their own blocks); logits against transformers
    holding the file's exact values."""
    pytest.importorskip("transformers")
    import ds4_mlx

    monkeypatch.setattr(gguf_blocks, "native_available", lambda: True)
    path, hf, args = _write_model(tmp_path, quant=qtype, llama_cpp=qtype == T.MXFP4)
    ids = np.random.default_rng(7).integers(0, args.vocab_size, 64)
    ref = _hf_logits(hf, ids)
    _convert(path, tmp_path / "out", shard_gb=5.0)  # one shard: the size is the data's
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    q = config["quantization"]
    assert {"layers.0.ffn.experts.gate", "layers.0.ffn.experts.down", "lm_head", "layers.3.attn.q_a"} <= set(q)
    assert not any(k.endswith(("ffn.gate", "indexer.proj", "compressor.kv")) for k in q)
    assert q["lm_head"] == G._EXACT_FORMATS[qtype]
    gguf_bytes = os.path.getsize(path)
    out_bytes = sum(f.stat().st_size for f in (tmp_path / "out").iterdir())
    assert out_bytes <= SIZE_BOUND.get(qtype, 1.15) * gguf_bytes, (out_bytes, gguf_bytes)
    direct, _ = ds4_mlx.load(path, quant_sim=False)
    folder, _ = ds4_mlx.load(tmp_path / "out", quant_sim=False)
    a, b = _logits(direct, ids), _logits(folder, ids)
    assert np.array_equal(a, b)
    kl = _kl(ref, a)
    print(f"{qtype.name}: KL {kl:.3g}, max |dlogit| {np.abs(a - ref).max():.3g}")
    assert kl <= KL_BOUND
    assert np.abs(a - ref).max() <= 1e-3


def _folder_bytes(folder):
    return sum(f.stat().st_size for f in folder.iterdir())


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    """A llama.cpp-style Q8_0 file (every matrix Q8_0) converted, and transformers' logits for it."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("q8")
    path, hf, args = _write_model(tmp, quant=T.Q8_0, every_matrix=True)
    _convert(path, tmp / "out", shard_gb=5.0)
    ids = np.random.default_rng(7).integers(0, args.vocab_size, 64)
    return path, tmp / "out", ids, _hf_logits(hf, ids)


def test_llama_cpp_q8_0_file(q8_model):
    """Every matrix Q8_0 (embedding, router, HC and compressor projections too): converted and direct
    loads within 1e-3 of transformers on the dequantized weights, and the folder at most 1.10x the file."""
    import ds4_mlx

    path, out, ids, ref = q8_model
    assert _folder_bytes(out) <= 1.10 * os.path.getsize(path), (_folder_bytes(out), os.path.getsize(path))
    for source in (path, out):
        model, _ = ds4_mlx.load(source, quant_sim=False)
        assert model.embed.weight.dtype == mx.uint32  # the embedding stays quantized
        got = _logits(model, ids)
        assert np.abs(got - ref).max() <= 1e-3, (source, np.abs(got - ref).max())


def test_every_converted_tensor_holds_the_gguf_values(q8_model):
    path, out, _, _ = q8_model
    assert json.loads((out / "config.json").read_text())["packed_floats"]  # router, HC, compressors as codes
    _assert_holds_the_gguf_values(path, out)


def _assert_holds_the_gguf_values(path, out, but=()):
    """Each array of the converted folder, dequantized in float32, equals the `gguf` package's values of
    its GGUF tensor (quantized ones within float32 rounding of scale * code + bias: exact here), but the
    tensors named in `but`."""
    from gguf import GGUFReader

    arrays = {}
    for f in out.glob("*.safetensors"):
        arrays.update(mx.load(str(f)))
    config = json.loads((out / "config.json").read_text())
    quantization, packed = config["quantization"], config["packed_floats"]
    for t in GGUFReader(str(path)).tensors:
        if t.name in but:
            continue
        want = t.data if t.tensor_type == T.I32 else gguf.quants.dequantize(t.data, t.tensor_type)
        want = want.reshape(tuple(reversed(t.shape.tolist())))
        name = mlx_name(t.name)
        stem = name.removesuffix(".weight") if name.removesuffix(".weight") in quantization else name
        fmt = quantization.get(stem) or packed.get(stem)
        if fmt:
            f32 = lambda a: a.astype(mx.float32)
            got = mx.dequantize(arrays[name], f32(arrays[stem + ".scales"]), f32(arrays[stem + ".biases"]),
                                group_size=fmt["group_size"], bits=fmt["bits"], dtype=mx.float32)
        else:
            got = arrays[name]  # float types as they are in the file, the rest float32
            kept = {T.I32: mx.int32, T.F16: mx.float16, T.BF16: mx.bfloat16}.get(t.tensor_type, mx.float32)
            assert got.dtype == kept, (name, got.dtype)
            got = got if kept == mx.int32 else got.astype(mx.float32)
        assert np.array_equal(np.array(got).reshape(want.shape), want.astype(np.array(got).dtype)), name


@pytest.mark.parametrize("qtype", [T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
def test_types_without_an_mlx_layout(tmp_path, qtype):
    """Every matrix in a type MLX cannot hold as it is (16-wide sub-blocks, a codebook): the routed
    experts are requantized to affine, every other matrix keeps its exact values in float32, and the
    converter says both; converted and direct loads agree, within the requantization's error of
    transformers."""
    pytest.importorskip("transformers")
    import ds4_mlx
    from ds4_mlx.convert.requant import affine_format

    path, hf, args = _write_model(tmp_path, quant=qtype, every_matrix=True)
    out = tmp_path / "out"
    logs = _convert(path, out, shard_gb=5.0)
    said = " ".join(logs)
    assert f"{qtype.name} experts have no native path" in said and "kept as float32" in said, logs
    assert sum("relative RMS error" in line for line in logs) == 3 * args.num_hidden_layers
    q = json.loads((out / "config.json").read_text())["quantization"]
    bits, group = affine_format(qtype)
    assert set(q) == {f"layers.{i}.ffn.experts.{p}" for i in range(args.num_hidden_layers) for p in ("gate", "up", "down")}
    assert all(f == {"group_size": group, "bits": bits, "mode": "affine"} for f in q.values())
    _assert_holds_the_gguf_values(path, out, but={f"blk.{i}.ffn_{p}_exps.weight" for i in range(args.num_hidden_layers)
                                                  for p in ("gate", "up", "down")})
    ids = np.random.default_rng(7).integers(0, args.vocab_size, 64)
    direct, folder = (ds4_mlx.load(source, quant_sim=False)[0] for source in (path, out))
    assert direct.embed.weight.dtype == mx.float32
    got = _logits(folder, ids)
    assert np.array_equal(_logits(direct, ids), got)
    kl = _kl(_hf_logits(hf, ids), got)
    print(f"{qtype.name}: experts requantized to {bits}-bit g{group}, KL {kl:.3g}")
    assert kl <= 0.05


# KL(transformers holding the GGUF's values || MLX) of the tiny model in the published q2 mix, per
# requantization choice. Measured: 2-bit g64 (default) 0.266, 3-bit g32 0.041.
Q2_MIX_KL = {(2, 64): 0.4, (3, 32): 0.08}


@pytest.fixture(scope="module")
def q2_model(tmp_path_factory):
    """The tiny model in the q2 mix (written once: quantizing IQ2_XXS takes a while), and transformers'
    logits for it."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("q2")
    path, hf, args = _write_model(tmp, quant="q2")
    ids = np.random.default_rng(7).integers(0, args.vocab_size, 64)
    return path, args, ids, _hf_logits(hf, ids)


@pytest.mark.parametrize("bits,group", list(Q2_MIX_KL), ids=lambda v: str(v))
def test_tiny_model_q2_mix(tmp_path, q2_model, bits, group):
    import ds4_mlx

    path, args, ids, ref = q2_model
    options = {"experts": "affine"} if (bits, group) == (2, 64) else {"expert_bits": bits, "group_size": group}
    logs = _convert(path, tmp_path / "out", shard_gb=5.0, **options)
    assert sum("relative RMS error" in line for line in logs) == 3 * args.num_hidden_layers  # one a requantized tensor
    if "experts" in options:  # more bits cost more than the GGUF, by the user's choice
        assert sum(f.stat().st_size for f in (tmp_path / "out").iterdir()) <= 1.15 * os.path.getsize(path)
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert q["layers.0.ffn.experts.down"] == q["layers.1.ffn.experts.gate"] == {"group_size": group, "bits": bits, "mode": "affine"}
    assert q["layers.0.attn.q_a"] == G._EXACT_FORMATS[T.Q8_0]
    model, _ = ds4_mlx.load(tmp_path / "out", quant_sim=False)
    kl = _kl(ref, _logits(model, ids))
    print(f"q2 mix, {bits}-bit g{group}: KL {kl:.3g}")
    assert kl <= Q2_MIX_KL[bits, group]


# ---------------------------------------------------------------------------------------------------------
# bad input


def _small_valid(tmp_path):
    from ds4_mlx.tools import testing

    args = testing.tiny_args(0)
    return testing.write_gguf(tmp_path / "ok.gguf", testing.gguf_metadata(args),
                              random_gguf_tensors(args)), args


def _bad_files(tmp_path):
    from gguf import GGUFWriter
    from ds4_mlx.tools import testing

    ok, args = _small_valid(tmp_path)
    data = ok.read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    (tmp_path / "corrupt.gguf").write_bytes(data[:4] + bytes(range(256)) * 8 + data[2052:])
    w = GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    tensors = random_gguf_tensors(args)
    del tensors["blk.1.attn_q_a.weight"]
    testing.write_gguf(tmp_path / "missing.gguf", testing.gguf_metadata(args), tensors)
    tensors = random_gguf_tensors(args)
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
    p = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "convert", str(tmp_path / "missing.gguf"),
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


# ---------------------------------------------------------------------------------------------------------
# llama.cpp split shards, and load() of a file that needs requantizing


def _split(tmp_path, args, tensors, parts=3):
    """The tiny model written as llama.cpp-style shards NAME-0000i-of-0000N.gguf (gguf's own splitter)."""
    from gguf import GGUFWriter
    from ds4_mlx.tools import testing

    folder = tmp_path / "shards"
    folder.mkdir()
    w = GGUFWriter(str(folder / "m.gguf"), "deepseek4", split_max_tensors=len(tensors) // parts + 1)
    for k, v in testing.gguf_metadata(args).items():
        testing._add_metadata(w, k, v)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    files = sorted(folder.glob("*.gguf"))
    assert [f.name for f in files] == [f"m-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)]
    return folder, files


def test_split_shards_load_and_convert(tmp_path, capsys):
    import ds4_mlx
    from ds4_mlx import cli
    from ds4_mlx.tools import testing

    args = testing.tiny_args(0)
    tensors = random_gguf_tensors(args)
    single = testing.write_gguf(tmp_path / "one.gguf", testing.gguf_metadata(args), tensors)
    folder, files = _split(tmp_path, args, tensors)
    ids = np.random.default_rng(8).integers(0, args.vocab_size, 16)
    want = _logits(ds4_mlx.load(single, quant_sim=False)[0], ids)
    for source in (folder, files[1]):  # the folder, or any one shard
        assert np.array_equal(_logits(ds4_mlx.load(source, quant_sim=False)[0], ids), want)
    _convert(folder, tmp_path / "out")
    assert np.array_equal(_logits(ds4_mlx.load(tmp_path / "out", quant_sim=False)[0], ids), want)
    files[2].unlink()
    rc = cli.main(["convert", str(folder), str(tmp_path / "out2"), "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "missing shard m-00003-of-00003.gguf" in err and len(err.strip().splitlines()) == 1


def test_load_requantizes_once_into_cache(tmp_path, monkeypatch, capsys):
    """A GGUF with Q2_K / IQ2_XXS tensors is converted on the first load only, into a folder under
    $DS4_MLX_HOME named by the file; a changed file gets a new folder. Exact types load directly."""
    import ds4_mlx
    from ds4_mlx.tools import testing
    from ds4_mlx.convert import cli as ccli, reference_quant

    monkeypatch.setenv("DS4_MLX_HOME", str(tmp_path / "home"))
    args = _tiny(True)
    tensors = random_gguf_tensors(args)
    for name in [n for n in tensors if n.endswith("ffn_down_exps.weight")]:
        a = tensors[name]
        tensors[name] = (reference_quant.quantize(a.reshape(-1, a.shape[-1]), T.Q2_K).reshape(*a.shape[:-1], -1), T.Q2_K)
    path = testing.write_gguf(tmp_path / "q2.gguf", testing.gguf_metadata(args), tensors)
    calls = []
    real = ccli.convert
    monkeypatch.setattr(ccli, "convert", lambda *a, **k: calls.append(a) or real(*a, **k))
    ids = np.random.default_rng(9).integers(0, args.vocab_size, 16)
    monkeypatch.setattr(gguf_blocks, "native_available", lambda: False)  # a machine without mlx-kquant or CUDA
    first = _logits(ds4_mlx.load(path, quant_sim=False)[0], ids)
    err = capsys.readouterr().err
    assert "converting once into" in err and "pip install 'ds4-mlx[kquant]'" in err
    cached = list((tmp_path / "home" / "converted").iterdir())
    assert len(calls) == 1 and len(cached) == 1 and cached[0].name.startswith("q2-")
    again = _logits(ds4_mlx.load(path, quant_sim=False)[0], ids)
    assert len(calls) == 1 and np.array_equal(first, again)
    assert np.array_equal(first, _logits(ds4_mlx.load(cached[0], quant_sim=False)[0], ids))
    os.utime(path, ns=(1, 1))  # a changed file: converted anew
    ds4_mlx.load(path, quant_sim=False)
    assert len(calls) == 2 and len(list((tmp_path / "home" / "converted").iterdir())) == 2
    exact = testing.write_gguf(tmp_path / "f.gguf", testing.gguf_metadata(args), random_gguf_tensors(args))
    ds4_mlx.load(exact, quant_sim=False)
    assert len(calls) == 2


def test_widened_scales_convert_to_float32(tmp_path):
    """A Q8_0 tensor whose biases (-128 d) overflow float16 gets float32 scales and biases: exact still."""
    import ds4_mlx
    from ds4_mlx.tools import testing

    args = testing.tiny_args(0)
    tensors = random_gguf_tensors(args)
    a = tensors["output.weight"].copy()
    a[0, :32] = 1e5  # d = 787: -128 d overflows float16
    tensors["output.weight"] = (gguf.quants.quantize(a, T.Q8_0), T.Q8_0)
    path = testing.write_gguf(tmp_path / "m.gguf", testing.gguf_metadata(args), tensors)
    _convert(path, tmp_path / "out", shard_gb=5.0)
    header = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        raw = f.read_bytes()
        header.update(json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")]))
    assert header["lm_head.scales"]["dtype"] == header["lm_head.biases"]["dtype"] == "F32"
    want = gguf.quants.dequantize(tensors["output.weight"][0], T.Q8_0)
    for source in (tmp_path / "out", path):  # converted, and loaded from the GGUF directly
        head = ds4_mlx.load(source, quant_sim=False)[0].lm_head
        assert head.scales.dtype == head.biases.dtype == mx.float32
        got = np.array(mx.dequantize(head.weight, head.scales, head.biases, group_size=32, bits=8))
        assert np.array_equal(got, want)


def test_published_files_projection():
    """The published files' sizes (80.76 and 153.32 GiB) come back from the tensor table, and their
    conversions, projected from bytes a weight measured on converted real-width rows, meet the targets
    (native experts), with the affine alternative beside them."""
    from ds4_mlx.tools import bench_convert as bench

    figures = bench.bench_published(rows=32)
    assert figures["q2_gguf_gib"] == 80.76 and figures["q4_gguf_gib"] == 153.32
    assert figures["q2_ratio"] <= 1.02 and figures["q4_ratio"] <= 1.02  # native experts: the file's blocks
    assert figures["q2_affine_ratio"] <= 1.15  # the explicit affine alternative
    types = figures["types"]
    assert types["Q8_0"]["rel_rms"] == 0 and types["Q4_K"]["rel_rms"] == 0
    assert types["IQ2_XXS"]["bytes_per_weight"] == types["Q2_K"]["bytes_per_weight"] == 2.5 / 8
