"""Sessions decoded together from a pool of their caches (`ds4_mlx.cache.pool`): each row equals the
session's own step bit for bit, at the real model's cache geometry (window 128, ratios 0, 4 and 128) and
through what the sessions do beside the batched steps (trims and replays, snapshots, files, another set
of sessions decoded together)."""

import gc

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.cache import pool as pool_module
from ds4_mlx.cache.layers import RowBuffer
from ds4_mlx.cache.pool import Pool
from ds4_mlx.models.attention import Attention
from ds4_mlx.session import Session, step_together
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import peak_memory_of, real_geometry_args, tiny_args


def same(a, b):
    return float(mx.abs(a - b).max()) == 0.0


def twins(model, prompts, **options):
    """For each prompt, a session to decode together and one to step alone, both synced to it."""
    together, alone = [Session(model, **options) for _ in prompts], [Session(model, **options) for _ in prompts]
    for a, b, prompt in zip(together, alone, prompts):
        a.sync(prompt)
        b.sync(prompt)
    return together, alone


def step_both(together, alone, tokens):
    """One batched step of `together`, checked row by row against each twin's own step."""
    logits = step_together(together, mx.array(tokens, dtype=mx.int32))
    for s in together:
        s.settle()
    for b, (s, token) in enumerate(zip(alone, tokens)):
        assert same(logits[b], s.step(int(token))), f"session {b} at {len(s.tokens)}"


@pytest.mark.parametrize("quant_sim", [True, False])
def test_pooled_rows_equal_steps_alone_at_real_geometry(quant_sim, monkeypatch):
    """Sessions at positions where the step changes kind: one leaving its first window (and closing the
    first ratio-128 block), one whose indexer starts to pick rows, one closing a later ratio-128 block, one
    whose ratio-4 rows outgrow the pool's buffer; one trims back and replays into its rows of the pool, and
    one sits a step out (rows of the pool in another order than the step's)."""
    model = random_model(real_geometry_args(), seed=0, quant_sim=quant_sim)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.args.vocab_size, n).tolist() for n in (120, 250, 378, 1020)]
    together, alone = twins(model, prompts)
    calls = []
    for name in ("_compiled_attend_batch", "_compiled_attend_one"):
        method = getattr(Attention, name)
        monkeypatch.setattr(Attention, name, lambda self, *a, name=name, method=method: calls.append(name)
                            or method(self, *a))
    pools = set()
    for step in range(12):
        if step == 6:
            together[3].trim(1003)
            alone[3].trim(1003)
        group = [3, 1, 2] if step == 8 else range(len(prompts))
        calls.clear()
        step_both([together[b] for b in group], [alone[b] for b in group],
                  rng.integers(0, model.args.vocab_size, len(group)))
        layers = model.args.num_hidden_layers  # one graph a layer for the cache part of all of them
        assert calls[:layers] == ["_compiled_attend_batch"] * layers and "_compiled_attend_batch" not in calls[layers:]
        pools.add(id(together[0].cache[0].pool()))
    assert len(pools) == 1 and None not in [s.cache[-1].pool() for s in together]  # one pool throughout


def test_a_pools_sessions_keep_their_snapshots_files_and_steps_alone(tmp_path):
    model = random_model(tiny_args(0), seed=0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 40, 57)]
    together, alone = twins(model, prompts, max_chunk=32)
    draw = lambda n: rng.integers(0, 512, n)  # noqa: E731
    for _ in range(3):
        step_both(together, alone, draw(3))
    pool = together[0].cache[0].pool()
    snap = together[1].snapshot()  # a copy of its rows: the pool goes on being written in place
    together[1].save(tmp_path / "b.safetensors")
    step_both(together, alone, draw(3))
    assert together[0].cache[0].pool() is pool
    forked = Session(model, max_chunk=32)
    forked.restore(snap)
    loaded = Session(model, max_chunk=32)
    loaded.load(tmp_path / "b.safetensors")
    assert same(forked.step(9), loaded.step(9))
    step_both(together[1:], alone[1:], draw(2))  # two of them (the first verifies, say): from the same pool
    assert together[0].cache[0].pool() is pool
    assert same(together[0].step(4), alone[0].step(4))  # a step alone, on its rows of the pool
    assert same(together[0].verify([5, 6])[-1], alone[0].verify([5, 6])[-1])
    together[0].load(tmp_path / "b.safetensors")  # a file into a pooled session: new caches, out of the pool
    alone[0].load(tmp_path / "b.safetensors")
    step_both(together, alone, draw(3))  # a pool of them is built again
    assert together[0].cache[0].pool() is not pool
    pool = together[0].cache[0].pool()
    more = draw(20).tolist()
    assert same(together[1].sync(together[1].tokens + more), alone[1].sync(alone[1].tokens + more))  # a prefill
    assert not together[1].cache[0].in_pool()  # on its own rows
    step_both(together, alone, draw(3))
    step_both(together[:1], alone[:1], draw(1))  # one of three: the pool's step of one session
    assert [s.cache[0].pool() for s in together] == [pool] * 3 and all(s.cache[-1].in_pool() for s in together)
    step_both(together[1:], alone[1:], draw(2))


def test_caches_of_other_sizes_are_not_pooled():
    model = random_model(tiny_args(0), seed=0)
    a, b = Session(model), Session(model, rewind_slack=64)
    a.sync([1, 2, 3])
    b.sync([4, 5, 6])
    assert Pool.of([a.cache, b.cache]) is None
    step_together([a, b], mx.array([7, 8], dtype=mx.int32))
    a.settle(), b.settle()
    assert a.cache[0].pool() is None and len(a.tokens) == 4


def test_a_long_session_beside_short_ones_is_not_pooled(monkeypatch):
    """Each pooled buffer has the longest session's rows: a long session would multiply the short ones'."""
    monkeypatch.setattr(pool_module, "PADDING_ROWS", 256)
    short, rng = _synced((10, 10, 10), 2)
    long = Session(short[0].model)
    long.sync(rng.integers(0, 512, 4000).tolist())  # 1,000 compressed rows of the ratio-4 layers
    assert Pool.of([s.cache for s in short]) is not None
    assert Pool.of([s.cache for s in short + [long]]) is None


def test_a_pool_is_copied_only_when_built():
    """Once built, the pool's arrays are written in place: by a batched step, a decoded token of one of its
    sessions alone, a trim, and a step that brings a session's rows back. A verify copies the verifying
    session's rows alone (they leave the pool), never the others'. With a long rewind slack the raw rings
    dominate, so a copy of any pooled array shows in the peak memory."""
    sessions, rng = _synced((30, 41, 52, 63), 3, rewind_slack=20_000)

    def together(group=sessions):
        step_together(group, mx.array(rng.integers(0, 512, len(group)), mx.int32))
        for s in group:
            s.settle()

    together()  # built: the one copy
    pool = sessions[0].cache[0].pool()
    ring = max(a.nbytes for layer in pool.arrays for a in layer.values())  # a layer's raw rings, pooled
    mine = sum(a.nbytes for layer in pool.arrays for a in layer.values()) // len(sessions)  # a session's rows
    steps = {"batched": together, "alone": lambda: sessions[0].step(7), "alone, async": lambda: together(sessions[:1]),
             "trimmed": lambda: sessions[2].trim(len(sessions[2].tokens) - 1),
             "verify": lambda: sessions[1].verify([5, 6, 7]),
             "trimmed after a verify": lambda: sessions[1].trim(len(sessions[1].tokens) - 2),
             "alone after a verify": lambda: sessions[1].step(8),
             "the others meanwhile": lambda: together(sessions[:1] + sessions[2:]), "back": together,
             "three of four": lambda: together(sessions[1:])}
    for _ in range(2):
        for name, step in steps.items():
            allowed = mine + ring / 8 if name == "verify" else ring / 4  # a verify: a copy of its rows alone
            assert peak_memory_of(step, sessions) < allowed, name
    assert all(s.cache[0].pool() is pool for s in sessions)


def _synced(lengths, seed, **options):
    """(sessions of the tiny model, one a length, each synced on that many random tokens; the generator that
    drew them, for what a test draws next)."""
    model = random_model(tiny_args(0), seed=0)
    rng = np.random.default_rng(seed)
    sessions = [Session(model, **options) for _ in lengths]
    for s, n in zip(sessions, lengths):
        s.sync(rng.integers(0, 512, n).tolist())
    return sessions, rng


def _pooled(n, seed, **options):
    """n sessions of the tiny model with long raw rings (a copy of a session's rows shows in the memory),
    synced and decoded together twice: their rows live in a pool."""
    sessions, rng = _synced((30,) * n, seed, rewind_slack=20_000, **options)
    for _ in range(2):
        _together(sessions, rng)
    assert all(s.cache[0].pool() is sessions[0].cache[0].pool() is not None for s in sessions)
    return sessions, rng


def _together(group, rng):
    step_together(group, mx.array(rng.integers(0, 512, len(group)), mx.int32))
    for s in group:
        s.settle()


def _active(sessions):
    gc.collect()
    mx.eval([s.logits for s in sessions])
    return mx.get_active_memory()


def test_a_reset_session_frees_its_rows_of_the_pool():
    """A server empties an idle session to stay within its memory budget (`Session.reset`, a load, a rewind
    to the start) while the others go on decoding: its rows are freed, not kept in the pool."""
    sessions, rng = _pooled(3, 4)
    held, before = sessions[2].nbytes, _active(sessions)
    sessions[2].reset()
    _together(sessions[:2], rng)
    assert before - _active(sessions) > 0.9 * held


def test_a_sessions_bytes_count_the_row_the_pool_keeps_while_its_rows_are_out():
    """A verify takes a session's rows out of the pool (a copy) and the pool keeps their row: the server's
    memory budget sums `Session.nbytes`, which must count both."""
    sessions, rng = _pooled(3, 5)
    counted, before = sum(s.nbytes for s in sessions), _active(sessions)
    sessions[1].verify([5, 6, 7])
    assert not sessions[1].cache[0].in_pool()
    assert sum(s.nbytes for s in sessions) - counted > 0.9 * (_active(sessions) - before)


def test_a_pooled_session_grown_long_does_not_pad_the_others(monkeypatch):
    """A session of a pool that prefills a long prompt on its own rows, then decodes beside the short ones,
    would grow every session's row of the pool's buffers to its length: it decodes alone (`Pool.fit`)."""
    monkeypatch.setattr(pool_module, "PADDING_ROWS", 256)
    sessions, rng = _synced((10, 10, 10, 10), 6)
    _together(sessions, rng)

    def rows():
        return [c.rows.rows.shape[0] for c in sessions[0].cache if c.ratio]

    short = rows()
    sessions[3].sync(sessions[3].tokens + rng.integers(0, 512, 4000).tolist())  # 1,000 rows of the ratio-4 layers
    _together(sessions, rng)
    assert rows() == short


def test_a_session_decoding_on_beside_idle_ones_does_not_pad_theirs(monkeypatch):
    """The others of its pool finished their turns: one session decoding on alone, from its row of the pool,
    would grow every session's row of the pool's buffers to its length."""
    monkeypatch.setattr(RowBuffer, "step", 16)  # compressed rows in buckets of 16: a short run outgrows them
    monkeypatch.setattr(pool_module, "PADDING_ROWS", 0)
    sessions, rng = _synced((1, 1, 200), 8)
    _together(sessions, rng)
    short = [c.rows.rows.shape[0] for c in sessions[0].cache if c.ratio]
    for _ in range(64):  # one bucket more of the ratio-4 layers' rows
        _together(sessions[2:], rng)
    assert [c.rows.rows.shape[0] for c in sessions[0].cache if c.ratio] == short

def test_a_batched_step_that_takes_a_checkpoint_copies_no_pooled_array():
    """A session of the batch reaching a checkpoint position copies a few rows of its rings: taken before
    the step's evaluation was started, the copy would write the pool's rings before their reads, a copy
    of each; gathered from the session's slice of the pool, a copy of its rings."""
    sessions, rng = _pooled(4, 7, max_chunk=16, checkpoint_every=16)
    pool = sessions[0].cache[0].pool()
    ring = max(a.nbytes for layer in pool.arrays for a in layer.values())
    for _ in range(16):  # a checkpoint of each session on the way
        mx.eval([s.logits for s in sessions])
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        _together(sessions, rng)
        mx.eval([s.logits for s in sessions])
        assert mx.get_peak_memory() - base < ring / 8  # not even a copy of one session's ring
    assert all(s.cache[0].pool() is pool and len(s.checkpoints) for s in sessions)
