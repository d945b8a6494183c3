"""DeepSeek V4 PRO's geometry: heavy compression from layer 0, 384 experts, 128 heads in 16 output groups,
61 layers. The tiny PRO-shaped model against transformers' DeepseekV4 (fp32, every ds4 simulation off),
and the real-width config through the GGUF metadata, the tensor list and the caches."""

import numpy as np
import pytest

import mlx.core as mx

import ds4_mlx
from ds4_mlx.cache.layers import make_caches
from ds4_mlx.models.args import CSA, HCA, SLIDING
from ds4_mlx.models.gguf_names import args_from_gguf, expected_gguf_names
from ds4_mlx.models.variants import pro_args
from ds4_mlx.session import Session
from ds4_mlx.tools.testing import gguf_metadata, tiny_pro_args

N_TOKENS = 200
ATOL = 1e-3


def test_pro_schedule_is_transformers_v4_pro_default():
    """transformers' DeepseekV4Config, given no layer types, builds the V4-Pro schedule: ours must be it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config(num_hidden_layers=61)
    args = pro_args()
    assert [args.layer_type(i) for i in range(61)] == cfg.layer_types
    assert args.layer_type(0) == args.layer_type(1) == HCA and SLIDING not in cfg.layer_types


def test_pro_metadata_round_trips_and_names_every_tensor():
    args = pro_args()
    back = args_from_gguf(gguf_metadata(args), args.vocab_size)
    assert back == args
    names = set(expected_gguf_names(args))
    # layers 0 and 1 are compressed (their compressor's tensors are required), the ratio-4 layers have an
    # indexer, the heavy ones none
    assert {"blk.0.attn_compressor_kv", "blk.1.attn_compressor_ape", "blk.60.attn_compressor_norm"} <= names
    assert "blk.3.indexer.proj" in names and "blk.2.indexer.proj" not in names
    assert "blk.2.ffn_gate_tid2eid" in names and "blk.3.ffn_gate_tid2eid" not in names


def test_pro_caches_compress_from_the_first_layer():
    args = pro_args()
    caches = make_caches(args, history=0)
    assert len(caches) == 61 and [c.ratio for c in caches[:4]] == [128, 128, 128, 4]
    assert all(c.frontier is not None for c in caches)  # every layer pools
    assert {c.ratio for c in caches if c.index_rows is not None} == {4}


@pytest.fixture(scope="module")
def pro_model(tmp_path_factory):
    pytest.importorskip("transformers")
    import torch

    from ds4_mlx.tools.testing import write_tiny_gguf

    args = tiny_pro_args()
    path, torch_model = write_tiny_gguf(tmp_path_factory.mktemp("pro") / "tiny-pro.gguf", args)
    ids = np.random.default_rng(7).integers(0, args.vocab_size, N_TOKENS)
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids[None]), use_cache=False).logits[0].numpy()
    model, _ = ds4_mlx.load(path, quant_sim=False)
    return model, args, ids, expected


def test_tiny_pro_config_is_pro_shaped(pro_model):
    _, args, _, expected = pro_model
    kinds = [args.layer_type(i) for i in range(args.num_hidden_layers)]
    assert kinds[:2] == [HCA, HCA] and CSA in kinds and SLIDING not in kinds
    assert args.num_attention_heads // args.o_groups == 2 and args.o_groups > tiny_default_groups()
    assert N_TOKENS // 4 > args.index_topk  # the indexer really selects
    assert expected.std(axis=-1).min() > 0.3  # not flat logits


def tiny_default_groups():
    from ds4_mlx.tools.testing import tiny_args

    return tiny_args().o_groups


def test_tiny_pro_logits_match_transformers(pro_model):
    model, _, ids, expected = pro_model
    got = np.array(model(mx.array(ids[None], dtype=mx.int32))[0])
    assert np.abs(got - expected).max() <= ATOL


def test_tiny_pro_session_chunks_and_rewinds_match_transformers(pro_model):
    """Chunked through a session, back to a position inside layer 0's heavy block, and forward again."""
    model, _, ids, expected = pro_model
    session = Session(model, rewind_slack=64, checkpoint_every=32, max_chunk=24)
    for n in (N_TOKENS, 101, N_TOKENS - 3, 150):
        logits = np.array(session.sync(ids[:n]))
        assert np.abs(logits - expected[n - 1]).max() <= ATOL, n


def gguf_gib(variant):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from ds4_mlx.tools.bench_convert import published_weights

    return sum(n * GGML_QUANT_SIZES[T[t]][1] / GGML_QUANT_SIZES[T[t]][0]
               for t, n in published_weights(variant).items()) / 2**30


def test_pro_geometry_gives_the_published_file_sizes():
    """The PRO tensor table at the published files' types gives their sizes: the q4's two split shards
    (426 and 412 GiB) and the q2 (about 430 GiB): a wrong width or layer count would be off by gigabytes."""
    assert abs(gguf_gib("pro_q4") - (426 + 412)) < 1
    assert abs(gguf_gib("pro_q2") - 430) < 5
