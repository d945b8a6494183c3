"""Sessions at the real model's cache geometry (window 128, compress ratios 0, 4 and 128, 2,048-token
prefill chunks) with tiny widths: a rewind restores exactly what a cold prefill computes, also when the
chunk that passed the restored position was longer than the compressor rings, and a replay computes
in the chunks of a cold prefill on the same grid, so its numbers are the same bit for bit."""

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.tools.random_model import random_model
from ds4_mlx.session import Session, step_together
from ds4_mlx.tools.testing import real_geometry_args

_models = {}


def real_geometry_model(seed=0):
    if seed not in _models:
        _models[seed] = random_model(real_geometry_args(), seed=seed)
    return _models[seed]


def cold(model, tokens):
    """Logits after a cold prefill of `tokens` (a fresh session, other chunking)."""
    return Session(model, rewind_slack=0, checkpoint_every=10**9, max_chunk=1000).sync(tokens)


def greedy(session, n):
    tokens = [int(mx.argmax(session.logits))]
    for _ in range(n - 1):
        tokens.append(int(mx.argmax(session.step(tokens[-1]))))
    return tokens


def issue_prompts(rng, vocab):
    """The report's shape: A long (1,205 tokens), B sharing its first 603 tokens (608 tokens)."""
    a = rng.integers(0, vocab, 1205).tolist()
    return a, a[:603] + rng.integers(0, vocab, 5).tolist()


@pytest.mark.parametrize("chunk, restored", [(2048, 0), (256, 512)])
def test_rewind_past_a_long_chunk_equals_cold_prefill(chunk, restored):
    """A's chunks overwrote the ratio-4 compressor rings (519 rows); B rewinds to 603, past the trim
    horizon, restores the grid position at or before it (the start, or the lane at 512 on a 256-token
    grid) and replays in a cold prefill's chunks: the same logits bit for bit."""
    model = real_geometry_model()
    a, b = issue_prompts(np.random.default_rng(0), model.args.vocab_size)
    session = Session(model, max_chunk=chunk)
    session.sync(a)
    logits = session.sync(b)
    assert session.last_sync == {"reused": restored, "replayed": 603 - restored, "computed": 5}
    assert float(mx.abs(logits - Session(model, max_chunk=chunk).sync(b)).max()) == 0.0
    reference = cold(model, b)
    assert float(mx.abs(logits - reference).max()) <= 1e-4
    fresh = Session(model)
    fresh.sync(b)
    assert greedy(session, 8) == greedy(fresh, 8)


def test_rewind_after_save_and_load_equals_cold_prefill(tmp_path):
    """The same through a file: A saved and loaded, then B; and B's state saved and loaded."""
    model = real_geometry_model()
    a, b = issue_prompts(np.random.default_rng(1), model.args.vocab_size)
    session = Session(model)
    session.sync(a)
    session.save(tmp_path / "a.safetensors", history=1024)
    loaded = Session(model)
    loaded.load(tmp_path / "a.safetensors")
    logits = loaded.sync(b)
    assert float(mx.abs(logits - cold(model, b)).max()) <= 1e-4
    session.sync(b)
    session.save(tmp_path / "b.safetensors")
    again = Session(model)
    again.load(tmp_path / "b.safetensors")
    assert float(mx.abs(again.step(7) - cold(model, b + [7])).max()) <= 1e-4


def test_a_checkpoint_missing_a_row_is_passed_over_for_an_older_one():
    model = real_geometry_model()
    a, b = issue_prompts(np.random.default_rng(2), model.args.vocab_size)
    session = Session(model, max_chunk=128)  # a lane at every multiple of 128
    session.sync(a)
    lane = session.checkpoints[512][1]  # the ratio-4 layer's lane: 4 compressor rows a ring
    lane["rows"] = [rows if rows is None else rows[1:] for rows in lane["rows"]]
    logits = session.sync(b)
    assert session.last_sync == {"reused": 384, "replayed": 219, "computed": 5}
    assert float(mx.abs(logits - cold(model, b)).max()) <= 1e-4


@pytest.mark.parametrize("n", [1024, 1152])
def test_a_session_loaded_at_a_multiple_of_128_decodes(tmp_path, n):
    """At a multiple of 128 the ratio-128 compressor needs none of its logged rows: the file holds none for
    that ring, and the loaded ring must still have rows for the decode step to write into."""
    model = real_geometry_model()
    tokens = np.random.default_rng(3).integers(0, model.args.vocab_size, n).tolist()
    session = Session(model)
    session.sync(tokens)
    session.save(tmp_path / "s.safetensors", history=300)
    loaded = Session(model)
    loaded.load(tmp_path / "s.safetensors")
    assert float(mx.abs(loaded.step(5) - cold(model, tokens + [5])).max()) <= 1e-4
    loaded.load(tmp_path / "s.safetensors")
    other = Session(model)
    other.sync(tokens[:300])
    logits = step_together([loaded, other], mx.array([6, 7], dtype=mx.int32))
    loaded.settle(), other.settle()
    assert float(mx.abs(logits[0] - cold(model, tokens + [6])).max()) <= 1e-4
    assert float(mx.abs(logits[1] - cold(model, tokens[:300] + [7])).max()) <= 1e-4
