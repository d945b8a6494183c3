"""bfloat16 compute (`Model.cast`) against the exact float32 model, on the tiny configs.

Measured here (300 tokens, seeds 0, 2, 4): with top-k routing and the indexer selecting, relative RMS
0.05-0.14 and top-1 agreement 96-99 % where float32's top-2 gap exceeds 0.05; the misses come from
discrete choices that bf16 rounding flips (a routed expert or a kept compressed row), which move single
logits by up to ~3.5, so no logit gap guarantees the same token there. Without discrete choices (all
MoE layers hash-routed, indexer top-k above the row count): relative RMS 0.018-0.025, max |diff| <= 0.26.
"""

import numpy as np
import pytest

import mlx.core as mx

import ds4_mlx
from ds4_mlx.precision import keeps_float32
from ds4_mlx.demo import random_gguf_tensors
from ds4_mlx.tools.testing import gguf_metadata, tiny_args, write_gguf

N_TOKENS = 300


def logits(path, ids, dtype=None):
    model, _ = ds4_mlx.load(path, quant_sim=False)
    if dtype is not None:
        model.cast(dtype)
    return np.array(model(mx.array(ids[None], dtype=mx.int32))[0])


def compare(path, args, seed):
    ids = np.random.default_rng(1000 + seed).integers(0, args.vocab_size, N_TOKENS)
    exact, half = logits(path, ids), logits(path, ids, mx.bfloat16)
    assert half.dtype == np.float32 and np.isfinite(half).all()
    top2 = np.sort(exact, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    same = half.argmax(-1) == exact.argmax(-1)
    rel_rms = float(np.sqrt(np.mean((half - exact) ** 2)) / exact.std())
    return rel_rms, float(np.abs(half - exact).max()), gap, same


@pytest.mark.parametrize("seed", [0, 2, 4])
def test_bf16_without_discrete_choices_is_close(tmp_path, seed):
    args = tiny_args(seed, num_hash_layers=6, index_topk=512)
    path = write_gguf(tmp_path / "continuous.gguf", gguf_metadata(args), random_gguf_tensors(args, seed=seed))
    rel_rms, max_diff, gap, same = compare(path, args, seed)
    assert 0 < rel_rms < 0.04 and max_diff < 0.4
    # a token can only change where the gap is below twice the largest logit change
    assert same[gap > 2 * max_diff].all()
    assert same[gap > 0.05].mean() > 0.98


def test_bf16_routed_tiny_configs(tiny_gguf):
    path, _, args = tiny_gguf
    seed = int(path.stem.split("-")[-1])
    rel_rms, _, gap, same = compare(path, args, seed)
    assert 0 < rel_rms < 0.2
    assert same[gap > 0.05].mean() > 0.95


def test_cast_keeps_the_float32_parameters():
    from ds4_mlx.tools.random_model import random_model
    from mlx.utils import tree_flatten

    model = random_model(tiny_args(0)).cast(mx.bfloat16)
    dtypes = dict((k, v.dtype) for k, v in tree_flatten(model.parameters()))
    kept = {k for k in dtypes if keeps_float32(k)}
    assert any(".hc_attn.fn" in k for k in kept) and "hc_head.fn" in kept
    assert any(k.endswith("attn.sinks") for k in kept) and any(k.endswith("ffn.gate.weight") for k in kept)
    assert all(dtypes[k] == mx.float32 for k in kept)
    assert all(dtypes[k] == mx.bfloat16 for k in dtypes if k not in kept and dtypes[k] != mx.int32)
