"""Sessions that rewind exactly: every logits vector after any history of syncs, steps, snapshots and
restores equals a cold prefill of the same tokens (a fresh Session with other chunking, or transformers)."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ds4_mlx.cache.layers import make_caches
from ds4_mlx.session import Session, SyncInterrupted
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import cold_logits, peak_memory_of, tiny_args

SEEDS = [0, 3, 5]
_models = {}


def model_for(seed, quant_sim=False):
    """A tiny random model; with `quant_sim` its KV and indexer rows are rounded, and stored, as float16."""
    if (seed, quant_sim) not in _models:
        _models[seed, quant_sim] = random_model(tiny_args(seed), seed=seed, quant_sim=quant_sim)
    return _models[seed, quant_sim]


class Float32Rows:
    """The same model with every cache row stored as float32 (the storage before float16 rows)."""

    def __init__(self, model):
        self.model, self.args, self.quant_sim = model, model.args, model.quant_sim

    def make_cache(self, **kwargs):
        return make_caches(self.args, row_dtype=mx.float32, **kwargs)

    def forward_steps(self, *args, **kwargs):
        return self.model.forward_steps(*args, **kwargs)


def assert_exact(session, logits):
    assert all(c.pos == len(session.tokens) for c in session.cache)
    diff = float(mx.abs(logits - cold_logits(session.model, session.tokens)).max())
    assert diff <= 1e-4, f"logits differ from a cold prefill by {diff}"


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_histories_equal_cold_prefill(data):
    seed = data.draw(st.sampled_from(SEEDS))
    model = model_for(seed, quant_sim=data.draw(st.booleans()))
    vocab = model.args.vocab_size
    session = Session(model, rewind_slack=data.draw(st.sampled_from([0, 3, 24, 40])),
                      frontier_horizon=data.draw(st.sampled_from([0, 5, 512])),
                      checkpoint_every=data.draw(st.sampled_from([8, 16, 32])),
                      max_chunk=data.draw(st.sampled_from([1, 5, 16, 64])),
                      recent_checkpoints=data.draw(st.sampled_from([1, 2, 10**6])))
    tokens = st.integers(0, vocab - 1)
    snapshots = []
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["sync", "sync", "step", "snapshot", "restore"]))
        if op == "sync" or not session.tokens:
            keep = data.draw(st.integers(0, len(session.tokens)))
            prompt = session.tokens[:keep] + data.draw(st.lists(tokens, min_size=0 if keep else 1, max_size=48))
            logits = session.sync(prompt)
            assert session.tokens == prompt
            s = session.last_sync
            assert s["reused"] + s["replayed"] + s["computed"] >= len(prompt) - 1
            if session.recent_checkpoints == 10**6:  # no thinning
                assert s["replayed"] <= session.checkpoint_every
        elif op == "step":
            logits = session.step(data.draw(tokens))
        elif op == "snapshot":
            snapshots.append(session.snapshot())
            continue
        else:
            if not snapshots:
                continue
            session.restore(data.draw(st.sampled_from(snapshots)))
            if not session.tokens:
                continue
            logits = session.sync(list(session.tokens))
        assert_exact(session, logits)


def test_history_matches_transformers(tiny_gguf):
    """A session's logits after trims and re-feeds equal transformers' full forward of its tokens."""
    import torch

    from ds4_mlx import load

    path, hf_model, args = tiny_gguf
    model, _ = load(path, quant_sim=False)
    rng = np.random.default_rng(1)
    session = Session(model, rewind_slack=16, checkpoint_every=32, max_chunk=16)
    prompt = rng.integers(0, args.vocab_size, 150).tolist()
    session.sync(prompt)
    for _ in range(5):
        session.step(int(rng.integers(args.vocab_size)))
    session.sync(prompt[:140] + rng.integers(0, args.vocab_size, 20).tolist())  # within the slack
    logits = session.sync(session.tokens[:70] + rng.integers(0, args.vocab_size, 30).tolist())  # deeper
    assert session.last_sync["replayed"] <= 32
    with torch.no_grad():
        ref = hf_model(torch.tensor([session.tokens]), use_cache=False).logits[0, -1].numpy()
    assert np.abs(np.array(logits) - ref).max() <= 1e-3


def test_resend_after_abort_replays_almost_nothing():
    """The report's case: a 2,000-token prompt, 37 streamed tokens, the same prompt again."""
    model = model_for(0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.args.vocab_size, 2000).tolist()
    session = Session(model)
    session.sync(prompt)
    token = int(mx.argmax(session.logits))
    for _ in range(37):
        token = int(mx.argmax(session.step(token)))
    logits = session.sync(prompt)
    assert session.last_sync["computed"] <= 128 and session.last_sync["replayed"] == 0
    assert_exact(session, logits)


def test_deep_rewind_replays_from_the_nearest_checkpoint():
    model = model_for(3)
    rng = np.random.default_rng(2)
    session = Session(model, rewind_slack=8, checkpoint_every=64, max_chunk=32, recent_checkpoints=10**6)
    prompt = rng.integers(0, model.args.vocab_size, 400).tolist()
    session.sync(prompt)
    full = lambda: sorted(q for q in session.checkpoints if q % 64 == 0)  # noqa: E731
    assert full() == [64, 128, 192, 256, 320, 384]
    logits = session.sync(prompt[:200] + [1, 2, 3])
    assert session.last_sync == {"reused": 192, "replayed": 8, "computed": 3}
    assert_exact(session, logits)
    assert full() == [64, 128, 192]


def test_old_checkpoints_thin_out_geometrically():
    """Spacing 16 for the 2 newest, then doubling with the distance; a deep rewind is still exact."""
    model = model_for(0)  # lanes every lcm(4, 16) = 16 tokens
    rng = np.random.default_rng(7)
    session = Session(model, rewind_slack=0, checkpoint_every=16, max_chunk=16, recent_checkpoints=2)
    prompt = rng.integers(0, model.args.vocab_size, 300).tolist()
    session.sync(prompt)
    # distance behind 288 below 32: every 16; below 64: every 32; below 128: every 64; below 256: every 128
    assert sorted(session.checkpoints) == [128, 192, 256, 272, 288]
    logits = session.sync(prompt[:150] + [5, 6])
    assert session.last_sync == {"reused": 128, "replayed": 22, "computed": 2}
    assert_exact(session, logits)


def test_rewind_inside_the_slack_replays_less_than_a_lane():
    """Beyond the compressor horizon but inside the slack: restore the lane at or before the target."""
    model = model_for(0)
    rng = np.random.default_rng(8)
    session = Session(model, rewind_slack=200, frontier_horizon=10, checkpoint_every=10**6, max_chunk=16)
    assert session.lane_every == 16
    prompt = rng.integers(0, model.args.vocab_size, 300).tolist()
    session.sync(prompt)
    for target in (250, 170):
        logits = session.sync(prompt[:target] + [9])
        assert session.last_sync == {"reused": target // 16 * 16, "replayed": target % 16, "computed": 1}
        assert_exact(session, logits)
        session.sync(prompt)


def test_async_steps_keep_the_checkpoints_of_steps():
    """The generation loop's pipelined steps take the same lanes and full checkpoints as `step`, so a
    rewind into generated text replays less than a lane."""
    model = model_for(0)  # lanes every 16 tokens
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, model.args.vocab_size, 40).tolist()
    answer = rng.integers(0, model.args.vocab_size, 150).tolist()
    stepped, pipelined = (Session(model, rewind_slack=200, frontier_horizon=10, checkpoint_every=32, max_chunk=16)
                          for _ in range(2))
    for session in (stepped, pipelined):
        session.sync(prompt)
    for token in answer:
        stepped.step(token)
        pipelined.step_async(mx.array(token, dtype=mx.int32))
        pipelined.settle()
    assert pipelined.tokens == stepped.tokens and sorted(pipelined.checkpoints) == sorted(stepped.checkpoints)
    logits = pipelined.sync(pipelined.tokens[:100] + [9])
    assert pipelined.last_sync == {"reused": 96, "replayed": 4, "computed": 1}
    assert_exact(pipelined, logits)


def test_float16_rows_are_exact_under_quant_sim():
    """quant_sim rounds KV and indexer rows to float16 values: storing them as float16 changes nothing."""
    model = model_for(0, quant_sim=True)
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, model.args.vocab_size, 120).tolist()
    half, full = Session(model, max_chunk=16), Session(Float32Rows(model), max_chunk=16)
    layer = half.cache[2]  # a ratio-4 layer: raw, compressed and indexer rows, two compressor rings
    assert layer.ratio == 4 and layer.index_rows is not None
    for s in (half, full):
        s.sync(prompt)
        s.sync(prompt[:90] + [3, 4, 5])
    assert [layer.raw.dtype, layer.rows.dtype, layer.index_rows.dtype] == [mx.float16] * 3
    assert [layer.frontier.dtype, layer.index_frontier.dtype] == [mx.float32] * 2
    assert full.cache[2].raw.dtype == mx.float32
    assert mx.array_equal(half.logits, full.logits)
    assert mx.array_equal(half.cache[2].rows.view(), full.cache[2].rows.view())
    assert model_for(0).make_cache()[2].raw.dtype == mx.float32  # no quant_sim: float32 as the reference


def test_rewind_within_the_slack_replays_nothing():
    model = model_for(5)
    rng = np.random.default_rng(3)
    session = Session(model, rewind_slack=100, checkpoint_every=10**6, max_chunk=16)
    prompt = rng.integers(0, model.args.vocab_size, 300).tolist()
    session.sync(prompt)
    logits = session.sync(prompt[:205])
    assert session.last_sync == {"reused": 204, "replayed": 0, "computed": 1}
    assert_exact(session, logits)


def test_interrupted_sync_keeps_a_prefix_and_resumes():
    model = model_for(0)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, model.args.vocab_size, 100).tolist()
    session = Session(model, max_chunk=16)
    with pytest.raises(SyncInterrupted):
        session.sync(prompt, on_chunk=lambda done, total: done >= 32)
    assert session.tokens == prompt[:32]
    logits = session.sync(prompt)
    assert session.last_sync["reused"] == 32 and session.last_sync["computed"] == 68
    assert_exact(session, logits)


def test_snapshot_is_not_written_through():
    model = model_for(0)
    rng = np.random.default_rng(5)
    session = Session(model, rewind_slack=4, checkpoint_every=16, max_chunk=8)
    a = rng.integers(0, model.args.vocab_size, 60).tolist()
    session.sync(a)
    snap = session.snapshot()
    session.sync(a[:10] + rng.integers(0, model.args.vocab_size, 80).tolist())  # overwrite rows and rings
    session.restore(snap)
    assert session.tokens == a
    assert_exact(session, session.step(7))


def test_nbytes_counts_slack_and_checkpoints():
    model = model_for(0)
    rng = np.random.default_rng(6)
    small = Session(model, rewind_slack=0, checkpoint_every=10**6)
    large = Session(model, rewind_slack=512, checkpoint_every=64, recent_checkpoints=10**6)
    prompt = rng.integers(0, model.args.vocab_size, 300).tolist()
    small.sync(prompt)
    large.sync(prompt)
    assert sorted(q for q in large.checkpoints if q % 64 == 0) == [64, 128, 192, 256]
    assert large.nbytes > small.nbytes > 0


@pytest.mark.parametrize("quant_sim", [False, True])
@pytest.mark.parametrize("compile_decode", ["1", "0"])
def test_decode_steps_equal_cold_prefill(monkeypatch, quant_sim, compile_decode):
    """Decoded tokens go through a layer's compiled step (or its plain MLX with DS4_MLX_COMPILE=0): across
    compressor blocks, the indexer starting to select, and compressed-row buffers that grow."""
    from ds4_mlx.cache.layers import RowBuffer
    from ds4_mlx.models.deepseek_v4 import DecoderLayer

    monkeypatch.setattr(RowBuffer, "step", 4)  # the buffers grow while decoding
    monkeypatch.setenv("DS4_MLX_COMPILE", compile_decode)
    original, decoded = DecoderLayer._compiled_step, []

    def counted(self, *args):
        decoded.append(1)
        return original(self, *args)

    monkeypatch.setattr(DecoderLayer, "_compiled_step", counted)
    model = random_model(tiny_args(0), seed=0, quant_sim=quant_sim)  # fresh: no compiled methods cached
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, model.args.vocab_size, 100)]
    session = Session(model, max_chunk=61)
    session.sync(tokens[:12])
    for t in tokens[12:]:
        logits = session.step(t)
    assert decoded, "no step went through the compiled step"
    assert_exact(session, logits)


def test_an_error_while_a_step_is_traced_leaves_the_model_whole(monkeypatch):
    """A decoded token that raises while its compiled graph is traced raises for that step alone: the
    model's parameters stay arrays (MLX would leave them as tracers), and the next steps are exact."""
    from ds4_mlx.models.attention import Attention

    model = random_model(tiny_args(0), seed=0)  # fresh: nothing traced yet
    tokens = [int(t) for t in np.random.default_rng(8).integers(0, model.args.vocab_size, 40)]
    session = Session(model)
    session.sync(tokens[:30])

    def broken(*args):
        raise RuntimeError("broken while traced")

    with monkeypatch.context() as m:
        m.setattr(Attention, "_attend_one", broken)
        with pytest.raises(RuntimeError, match="broken while traced"):
            session.step(tokens[30])
    assert len(session.tokens) == 30
    for t in tokens[30:]:
        logits = session.step(t)
    assert_exact(session, logits)


class CountingModel:
    """The model, recording how many tokens each call runs."""

    def __init__(self, model):
        self.model, self.args, self.quant_sim, self.calls = model, model.args, model.quant_sim, []

    def make_cache(self, **kwargs):
        return self.model.make_cache(**kwargs)

    def forward_steps(self, ids, *args, **kwargs):
        self.calls.append(ids.shape[-1])
        return self.model.forward_steps(ids, *args, **kwargs)


def test_a_deep_rewind_replays_in_chunks_between_yields():
    """A replay runs through the same chunked loop as the new tokens: at most `max_chunk` tokens before
    each yield (where the server checks for aborts and lets other requests run), and a stop keeps a
    prefix of the prompt."""
    model = CountingModel(model_for(0))
    rng = np.random.default_rng(10)
    prompt = rng.integers(0, model.args.vocab_size, 300).tolist()
    session = Session(model, rewind_slack=0, frontier_horizon=0, checkpoint_every=10**6, max_chunk=16)
    session.sync(prompt)
    second = prompt[:279] + [1, 2]
    model.calls.clear()
    steps = session.sync_steps(second)
    done, total = next(steps)
    assert model.calls == [16] and (done, total) == (16, 281)
    assert session.last_sync == {"reused": 0, "replayed": 16, "computed": 0}
    steps.close()  # stopped between chunks: the session holds a prefix of the prompt
    assert session.tokens == second[:16]
    logits = session.sync(second)
    assert max(model.calls) <= 16 and session.last_sync == {"reused": 16, "replayed": 0, "computed": 265}
    assert_exact(session, logits)
    session.sync(prompt)
    model.calls.clear()
    for done, total in session.sync_steps(second):
        assert sum(model.calls) == done
    assert session.last_sync == {"reused": 0, "replayed": 279, "computed": 2}


def test_decoded_tokens_write_the_rings_in_place():
    """A decoded token, alone or beside another session, writes one row into each ring: no copy of the
    rings (with a long rewind history, hundreds of MB a layer at real widths on every token)."""
    from ds4_mlx.session import step_together

    model = model_for(0)
    sessions = [Session(model, rewind_slack=100_000) for _ in range(2)]
    sessions[0].sync(list(range(1, 30)))
    sessions[1].sync(list(range(2, 35)))
    ring = sessions[0].cache[0].raw.rows.nbytes

    def together():
        step_together(sessions, mx.array([3, 4], mx.int32))
        for s in sessions:
            s.settle()

    assert peak_memory_of(lambda: sessions[0].step(5), sessions) < ring / 4
    together()  # the sessions' pool (`cache/pool.py`) is built: their rows are copied once
    for _ in range(2):
        assert peak_memory_of(together, sessions) < ring / 4
        assert peak_memory_of(lambda: sessions[0].step(5), sessions) < ring / 4  # the pool's step of one of its sessions
