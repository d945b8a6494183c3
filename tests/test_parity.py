"""The MLX model against transformers' DeepseekV4 (fp32, every ds4 simulation off).

A random transformers tiny model is written to GGUF in ds4 names (`ds4_mlx.tools.testing`), loaded with
`ds4_mlx.load(..., quant_sim=False)`, and both must give the same logits over 300 tokens: enough for
the sliding window ring to wrap many times, several HCA rows, and more CSA rows than the indexer keeps.
"""

import numpy as np
import pytest

import mlx.core as mx

pytest.importorskip("transformers")
import torch  # noqa: E402

import ds4_mlx  # noqa: E402
from ds4_mlx.models.args import CSA, HCA, SLIDING  # noqa: E402

N_TOKENS = 300
ATOL = 1e-3
# smallest allowed gap between the k-th and (k+1)-th indexer score: below it, float rounding in MLX vs
# torch could swap which row is kept, and the comparison would test tie-breaking, not the model
MIN_TOPK_GAP = 1e-5


def token_ids(args, seed):
    return np.random.default_rng(1000 + seed).integers(0, args.vocab_size, N_TOKENS)


def oracle(torch_model, ids, args):
    """transformers logits [T, vocab] without a cache, and the smallest indexer top-k score gap."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    gaps = []
    positions = np.arange(len(ids))
    visible = (positions + 1) // 4  # CSA rows a query may see

    def record_gap(module, inputs, scores):
        s = scores[0].detach().numpy()  # [T, rows]
        k = args.index_topk
        for t in np.nonzero(visible > k)[0]:
            top = np.sort(s[t, : visible[t]])[::-1]
            gaps.append(top[k - 1] - top[k])

    hooks = [m.register_forward_hook(record_gap) for m in torch_model.modules()
             if isinstance(m, DeepseekV4IndexerScorer)]
    try:
        with torch.no_grad():
            out = torch_model(torch.tensor(ids[None], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].numpy(), (min(gaps) if gaps else None)


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    path, torch_model, args = tiny_gguf
    seed = int(path.stem.split("-")[-1])
    ids = token_ids(args, seed)
    logits, gap = oracle(torch_model, ids, args)
    return ids, logits, gap


def load(path, quant_sim):
    model, _ = ds4_mlx.load(path, quant_sim=quant_sim)
    return model


def test_configs_exercise_every_path(tiny_gguf, reference):
    _, _, args = tiny_gguf
    _, logits, gap = reference
    kinds = [args.layer_type(i) for i in range(args.num_hidden_layers)]
    assert {SLIDING, CSA, HCA} <= set(kinds)
    assert 0 < args.num_hash_layers < args.num_hidden_layers  # hash and top-k routed MoE layers
    assert args.sliding_window <= 16  # the raw ring wraps many times in 300 tokens
    hca_ratio = max(r for r in args.compress_ratios if r != 4)
    assert N_TOKENS // hca_ratio >= 2
    assert N_TOKENS // 4 > args.index_topk  # the indexer really selects
    assert args.rope_scaling and args.rope_scaling["original_max_position_embeddings"] < N_TOKENS
    # the oracle's indexer has no near-ties at the cut, and its logits are not flat
    assert gap is not None and gap > MIN_TOPK_GAP, f"indexer top-k near-tie ({gap}); pick another seed"
    assert logits.std(axis=-1).min() > 0.3


def assert_close_to_oracle(got, expected):
    diff = np.abs(got - expected)
    assert diff.max() <= ATOL, f"max |diff| {diff.max():.2e} first at token {int(np.argmax(diff.max(-1) > ATOL))}"


def test_logits_match_transformers(tiny_gguf, reference):
    path, _, _ = tiny_gguf
    ids, expected, _ = reference
    model = load(path, quant_sim=False)
    got = np.array(model(mx.array(ids[None], dtype=mx.int32))[0])
    assert got.shape == expected.shape
    assert_close_to_oracle(got, expected)


def logits_in_chunks(model, cache, ids, sizes):
    """The logits of `ids` fed through `cache` in chunks of `sizes` tokens (the last one cut to fit)."""
    outs, start = [], 0
    for n in sizes:
        if start >= len(ids):
            break
        outs.append(np.array(model(mx.array(ids[None, start : start + n], dtype=mx.int32), cache=cache)[0]))
        start += n
    return np.concatenate(outs)


def test_chunked_cache_matches_transformers(tiny_gguf, reference):
    path, _, args = tiny_gguf
    ids, expected, _ = reference
    model = load(path, quant_sim=False)
    sizes = np.random.default_rng(len(ids) + args.hidden_size).integers(1, 65, len(ids))
    assert_close_to_oracle(logits_in_chunks(model, model.make_cache(), ids, sizes), expected)


def test_chunk_longer_than_the_rings_matches_transformers(tiny_gguf, reference):
    """A chunk reads its own rows directly, so rings sized for 16-token chunks take 150-token ones."""
    path, _, _ = tiny_gguf
    ids, expected, _ = reference
    model = load(path, quant_sim=False)
    cache = model.make_cache()
    assert max(r.capacity for c in cache for r in c.rings()) < 150
    assert_close_to_oracle(logits_in_chunks(model, cache, ids, [150] * len(ids)), expected)


def relative_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / b.std())


def test_quant_sim_changes_logits_a_little(tmp_path):
    """FP8 KV + F16 rows (quant_sim=True) against plain float, on a config without discrete choices
    (all MoE layers hash-routed, indexer top-k above the row count), so the effect stays continuous.
    Measured on seeds 0-5: relative RMS 0.029-0.046 (the ~3 % rounding noise of E4M3), max |diff| <= 0.55."""
    from ds4_mlx.demo import random_gguf_tensors
    from ds4_mlx.tools.testing import gguf_metadata, tiny_args, write_gguf

    args = tiny_args(0, num_hash_layers=6, index_topk=512)
    path = write_gguf(tmp_path / "continuous.gguf", gguf_metadata(args), random_gguf_tensors(args, seed=0))
    x = mx.array(token_ids(args, 0)[None], dtype=mx.int32)
    exact = np.array(load(path, quant_sim=False)(x)[0])
    simulated = np.array(load(path, quant_sim=True)(x)[0])
    assert 0.005 < relative_rms(simulated, exact) < 0.1
    assert np.abs(simulated - exact).max() < 1.0


def test_quant_sim_bounded_with_routing_and_indexer(tiny_gguf, reference):
    """With top-k routing and the indexer selecting, the rounding flips some discrete choices (even F16
    rounding alone does), so single logits can move by several units; the bulk stays bounded.
    Measured on seeds 0-7: relative RMS 0.11-0.40 (0.15, 0.19, 0.30 on the three test configs)."""
    path, _, _ = tiny_gguf
    ids, _, _ = reference
    x = mx.array(ids[None], dtype=mx.int32)
    exact = np.array(load(path, quant_sim=False)(x)[0])
    simulated = np.array(load(path, quant_sim=True)(x)[0])
    assert np.isfinite(simulated).all()
    assert 0.02 < relative_rms(simulated, exact) < 0.5
