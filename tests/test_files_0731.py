"""V4 Flash 0731's files (ds4f-q2, ds4f-q2-q4, ds4f-q4, ds4f-mxfp4), as tiny GGUFs with each file's
tensor types (`bench_convert.file_types`: per-layer expert types in ds4f-q2-q4, MXFP4 experts, Q8_0
attention, shared experts and head, F16 HC, compressor and indexer): converted and loaded directly,
within 1e-3 of transformers holding the `gguf` package's values, experts byte for byte, the folder at
most 1.07x the file; and the mixed file through affine experts too."""

import json
import os

import numpy as np
import pytest

import mlx.core as mx
from gguf import GGUFReader, GGMLQuantizationType as T

from ds4_mlx.convert import gguf as G
from ds4_mlx.models import gguf_blocks
from ds4_mlx.models.gguf_names import mlx_name
from ds4_mlx.models.linear import GGUFSwitchLinear, QuantizedSwitchLinear
from ds4_mlx.tools import bench_convert
from test_convert import _assert_holds_the_gguf_values, _convert, _hf_logits, _kl, _logits, _tiny, _write_model

FILES = list(bench_convert.FILES_0731)
ATOL = 1e-3
SIZE_BOUND = 1.07  # converted folder / GGUF


def _tiny_layout(file):
    """{GGUF name: type} of `file` for the tiny model; ds4f-q2-q4's Q4_K layers are the last two of six
    here (`_Q4_LAYERS` scaled down), so both kinds of layer are in it."""
    args = _tiny(True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(bench_convert, "_Q4_LAYERS", 2)
        return {name: t for name, (_, t) in bench_convert.file_types(file, args).items()}


@pytest.fixture(scope="module", params=FILES)
def written(request, tmp_path_factory):
    """(file name, GGUF path, transformers' logits, token ids, layout) of a tiny 0731 file."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp(request.param)
    layout = _tiny_layout(request.param)
    path, hf, args = _write_model(tmp, types=layout)
    ids = np.random.default_rng(13).integers(0, args.vocab_size, 40)
    return request.param, path, _hf_logits(hf, ids), ids, layout


def _expert_types(layout):
    return {name: t for name, t in layout.items() if "_exps." in name}


def test_the_layouts_are_the_files(written):
    """The tiny files hold what the brief names: q2's experts IQ2_XXS gate/up and Q2_K down, Q4_K layers
    in the mixed file only at its end, MXFP4 experts, Q8_0 attention, shared experts and head, F16 HC,
    compressor and indexer matrices."""
    file, path, _, _, layout = written
    held = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    assert held == layout
    layers = sorted({int(n.split(".")[1]) for n in _expert_types(layout)})
    by_layer = [{t for n, t in _expert_types(layout).items() if n.startswith(f"blk.{i}.")} for i in layers]
    want = {"ds4f-q2": [{T.IQ2_XXS, T.Q2_K}] * 6, "ds4f-q2-q4": [{T.IQ2_XXS, T.Q2_K}] * 4 + [{T.Q4_K}] * 2,
            "ds4f-q4": [{T.Q4_K}] * 6, "ds4f-mxfp4": [{T.MXFP4}] * 6}[file]
    assert by_layer == want
    assert held["blk.0.attn_q_a.weight"] == held["blk.0.ffn_down_shexp.weight"] == held["output.weight"] == T.Q8_0
    assert held["blk.0.hc_attn_fn.weight"] == held["blk.2.attn_compressor_kv.weight"] == T.F16
    assert held["blk.2.indexer.proj.weight"] == held["blk.2.indexer.attn_q_b.weight"] == T.F16


def _mlx_arrays(folder):
    arrays = {}
    for f in folder.glob("*.safetensors"):
        arrays.update(mx.load(str(f)))
    return arrays


def _mxfp4_blocks(weight, scales):
    """The ggml MXFP4 blocks of MLX mxfp4 arrays, built from the formats' definitions: an MLX row packs
    its codes low nibble first; a ggml block is the E8M0 scale byte, then 16 bytes whose low nibbles are
    elements 0-15 and high nibbles elements 16-31."""
    packed = np.array(weight).view(np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([np.array(scales)[..., None], qs], axis=-1).reshape(*packed.shape[:-1], -1)


@pytest.fixture(scope="module")
def converted(written, tmp_path_factory):
    file, path = written[:2]
    out = tmp_path_factory.mktemp(file + "-out") / "out"
    _convert(path, out, shard_gb=5.0, experts="native")
    return out


def test_folder_is_the_files_size_and_holds_its_experts_byte_for_byte(written, converted):
    file, path, _, _, layout = written
    size = sum(f.stat().st_size for f in converted.iterdir())
    assert size <= SIZE_BOUND * os.path.getsize(path), (size, os.path.getsize(path))
    quantization = json.loads((converted / "config.json").read_text())["quantization"]
    arrays = _mlx_arrays(converted)
    for t in GGUFReader(str(path)).tensors:
        if "_exps." not in t.name:
            continue
        module = mlx_name(t.name).removesuffix(".weight")
        raw = np.asarray(t.data).reshape(*np.asarray(t.data).shape[:-1], -1)
        if t.tensor_type == T.MXFP4:  # MLX's own mxfp4, each byte the file's
            assert quantization[module] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
            assert arrays[module + ".scales"].dtype == mx.uint8
            got = _mxfp4_blocks(arrays[module + ".weight"], arrays[module + ".scales"])
        else:  # the file's blocks, per layer in its own type
            assert quantization[module] == {"gguf_type": gguf_blocks.CODECS[t.tensor_type]}
            got = np.array(arrays[module + ".weight"])
        assert got.dtype == np.uint8 and np.array_equal(got.reshape(raw.shape), raw), t.name
    # every other tensor holds the file's values
    _assert_holds_the_gguf_values(path, converted, but={n for n in layout if "_exps." in n})


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_converted_and_direct_loads_match_transformers(written, converted, monkeypatch, source):
    import ds4_mlx

    _, path, ref, ids, layout = written
    monkeypatch.setenv("DS4_MLX_KQUANT", "0")  # the plain reference path for native blocks
    monkeypatch.setattr(gguf_blocks, "native_available", lambda: True)  # a direct load keeps the blocks too
    model, _ = ds4_mlx.load(converted if source == "folder" else path, quant_sim=False)
    for i in range(model.args.num_hidden_layers):  # each layer's experts in their file type
        kept = model.layers[i].ffn.experts["down"]
        t = layout[f"blk.{i}.ffn_down_exps.weight"]
        if t == T.MXFP4:
            assert isinstance(kept, QuantizedSwitchLinear) and kept.mode == "mxfp4"
        else:
            assert isinstance(kept, GGUFSwitchLinear) and kept.gguf_type == gguf_blocks.CODECS[t]
    model.set_dtype(mx.float32)  # the exact mode: F16 tensors computed in float32, as transformers does
    got = _logits(model, ids)
    assert np.abs(got - ref).max() <= ATOL, np.abs(got - ref).max()


def test_the_mixed_file_through_affine_experts(written, tmp_path, monkeypatch):
    """ds4f-q2-q4 with affine experts (the CPU's default): each layer's experts in its own MLX format,
    Q4_K ones repacked exactly and q2 ones requantized; converted and direct loads agree."""
    import ds4_mlx
    from ds4_mlx.convert.requant import affine_format

    file, path, ref, ids, layout = written
    if file != "ds4f-q2-q4":
        pytest.skip("the mixed file's test")
    out = tmp_path / "out"
    logs = _convert(path, out, shard_gb=5.0, experts="affine")
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    requantized = set()
    for name, t in _expert_types(layout).items():
        fmt = quantization[mlx_name(name).removesuffix(".weight")]
        if t == T.Q4_K:
            assert fmt == G._EXACT_FORMATS[T.Q4_K]
        else:
            bits, group = affine_format(t)
            assert fmt == {"group_size": group, "bits": bits, "mode": "affine"}
            requantized.add(name)
    assert sum("relative RMS error" in line for line in logs) == len(requantized) == 12
    _assert_holds_the_gguf_values(path, out, but=requantized)  # Q4_K experts exactly, and the rest
    folder = ds4_mlx.load(out, quant_sim=False)[0]
    monkeypatch.setattr(gguf_blocks, "native_available", lambda: False)  # a machine without a native path
    direct = ds4_mlx.load(path, quant_sim=False)[0]  # converted once into the cache, with affine experts
    assert np.array_equal(_logits(folder, ids), _logits(direct, ids))
    folder.set_dtype(mx.float32)
    kl = _kl(ref, _logits(folder, ids))
    print(f"{file} with affine experts: KL {kl:.3g}")
    assert kl <= 0.4  # the q2 mix's requantization bound (test_convert.Q2_MIX_KL)


def test_the_projection_of_each_file():
    """`bench convert`'s projection at real widths: the files' sizes as published (the issue's: ds4f-q2
    ~81 GiB, ds4f-q2-q4 ~98 GB, ds4f-q4 ~153 GiB, ds4f-mxfp4 ~156 GB), folders within 1.07x with native
    experts, and the path the experts take on each backend."""
    figures = bench_convert.run(size_gb=0, rows=32)
    rows = {row["file"]: row for row in figures["files_0731"]}
    paths = {(row["file"], row["backend"]): row["experts"] for row in figures["experts_0731"]}
    assert list(rows) == [f + "-0731" for f in FILES]
    published = {"ds4f-q2-0731": 81 * 2**30, "ds4f-q2-q4-0731": 98e9, "ds4f-q4-0731": 153 * 2**30,
                 "ds4f-mxfp4-0731": 156e9}
    for name, size in published.items():
        assert abs(rows[name]["gguf_gib"] * 2**30 / size - 1) < 0.01, (name, rows[name]["gguf_gib"])
        assert rows[name]["native_ratio"] <= SIZE_BOUND
    assert rows["ds4f-mxfp4-0731"]["affine_ratio"] <= SIZE_BOUND  # no native type: the same everywhere
    mixed = "ds4f-q2-q4-0731"
    assert paths[mixed, "cuda"] == "IQ2_XXS, Q2_K, Q4_K: file's blocks (exact)"
    assert paths[mixed, "cpu"] == "IQ2_XXS, Q2_K: MLX affine 2-bit g64 (requantized); Q4_K: MLX affine 4-bit (exact)"
    assert paths[mixed, "metal"] == ("IQ2_XXS, Q2_K: file's blocks (exact) with the kquant extra, else MLX affine "
                                     "2-bit g64 (requantized); Q4_K: file's blocks (exact) with the kquant extra, "
                                     "else MLX affine 4-bit (exact)")
    assert {paths["ds4f-mxfp4-0731", b] for b in ("metal", "cuda", "cpu")} == {"MXFP4: MLX mxfp4 4-bit (exact)"}
