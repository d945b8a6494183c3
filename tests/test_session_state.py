"""Session state on disk: a saved and loaded session continues exactly as a cold prefill of its tokens;
a damaged or foreign file is refused and leaves the session as it was."""

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.cache.layers import make_caches
from ds4_mlx.cache.state import StateFileError
from ds4_mlx.session import Session
from test_session import assert_exact, model_for


def saved_session(tmp_path, seed=0, n=150, quant_sim=False):
    model = model_for(seed, quant_sim)
    rng = np.random.default_rng(seed)
    session = Session(model, rewind_slack=100, frontier_horizon=8, checkpoint_every=64, max_chunk=16)
    session.sync(rng.integers(0, model.args.vocab_size, n).tolist())
    path = tmp_path / "s.safetensors"
    session.save(path, history=60)
    return session, path


@pytest.mark.parametrize("quant_sim", [False, True])
def test_loaded_session_continues_exactly(tmp_path, quant_sim):
    session, path = saved_session(tmp_path, quant_sim=quant_sim)
    loaded = Session(session.model, rewind_slack=100, frontier_horizon=8, checkpoint_every=64, max_chunk=16)
    loaded.load(path)
    assert loaded.tokens == session.tokens
    assert mx.array_equal(loaded.logits, session.logits)
    assert loaded.sync(list(session.tokens)) is loaded.logits and loaded.last_sync["computed"] == 0
    assert_exact(loaded, loaded.step(11))
    # a rewind inside the saved history restores a lane (every 16 tokens here) and replays < 16 tokens
    logits = loaded.sync(session.tokens[:100] + [1, 2])
    assert loaded.last_sync == {"reused": 96, "replayed": 4, "computed": 2}
    assert_exact(loaded, logits)


def test_layer_state_protocol_rebuilds_a_layer():
    model = model_for(3)
    session = Session(model, max_chunk=8)
    session.sync(list(range(1, 90)))
    for c, fresh in zip(session.cache, model.make_cache(history=4096)):
        fresh.load_state(c.state, c.meta_state)
        assert fresh.pos == c.pos and sorted(fresh.state) == sorted(c.state)
        assert all(mx.array_equal(fresh.state[k], v) for k, v in c.state.items())
    with pytest.raises(ValueError):
        fresh.load_state(session.cache[0].state, session.cache[0].meta_state)  # another layer kind


def corrupt_copies(path):
    data = path.read_bytes()
    flipped = bytearray(data)
    for i in (len(data) // 2, len(data) - 5, 40):
        flipped[i] ^= 0x5A
    return {"flipped": bytes(flipped), "truncated": data[: len(data) * 2 // 3], "empty": b"", "text": b"hello"}


def test_damaged_files_are_refused_and_change_nothing(tmp_path):
    session, path = saved_session(tmp_path)
    tokens, logits = list(session.tokens), session.logits
    for name, data in corrupt_copies(path).items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(StateFileError):
            session.load(bad)
        assert session.tokens == tokens and session.logits is logits, name


def test_foreign_files_are_refused(tmp_path):
    session, path = saved_session(tmp_path, seed=0)
    for other in (Session(model_for(5)), Session(model_for(0, quant_sim=True))):
        with pytest.raises(StateFileError, match="another"):
            other.load(path)
        assert other.tokens == []


def test_row_dtype_is_part_of_the_identity(tmp_path):
    session, path = saved_session(tmp_path, quant_sim=True)

    class Float32Rows:
        args, quant_sim, embed = session.model.args, True, session.model.embed

        def make_cache(self, **kwargs):
            return make_caches(self.args, row_dtype=mx.float32, **kwargs)

    with pytest.raises(StateFileError, match="row dtype"):
        Session(Float32Rows()).load(path)
