"""Random session histories at the real cache geometry (window 128, compress ratios 0, 4 and 128, the
session's defaults: 2,048-token chunks, a checkpoint every 2,048 tokens, 4,096 tokens of slack, 512 of
compressor horizon), tiny widths: contexts past 6,000 tokens, rewinds of every depth (trims in place,
lanes, checkpoints, starting over), decoded tokens, forks from snapshots and sessions saved and loaded.
After every step the logits equal a cold prefill of the session's tokens."""

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.tools.random_model import random_model
from ds4_mlx.session import Session
from ds4_mlx.tools.testing import real_geometry_args

LONGEST = 7000


def cold(model, tokens):
    return Session(model, rewind_slack=0, checkpoint_every=10**9, max_chunk=1500).sync(tokens)


@pytest.mark.parametrize("seed,quant_sim", [(0, False), (1, True)])
def test_random_histories_at_real_geometry_equal_cold_prefills(tmp_path, seed, quant_sim):
    model = random_model(real_geometry_args(), seed=seed, quant_sim=quant_sim)
    rng = np.random.default_rng(seed)
    vocab = model.args.vocab_size
    session = Session(model)
    session.sync(rng.integers(0, vocab, LONGEST).tolist())
    snapshots, paths, seen = [session.snapshot()], [], set()
    # how far back each rewind goes: past the slack (restore a full checkpoint; then back to LONGEST tokens),
    # within the compressor horizon (a trim in place), past it (a lane)
    for op in ["deep", "shallow", "lane", "step", "fork", "save", "load", "lane"]:
        n = len(session.tokens)
        if op in ("deep", "lane", "shallow"):
            keep = {"deep": lambda: int(rng.integers(2049, n - 4700)), "lane": lambda: n - int(rng.integers(600, 3900)),
                    "shallow": lambda: n - int(rng.integers(1, 500))}[op]()
            grow = LONGEST - keep if op == "deep" else 1
            prompt = session.tokens[:keep] + rng.integers(0, vocab, grow + int(rng.integers(0, 300))).tolist()
            logits = session.sync(prompt)
            s = session.last_sync
            seen.add("trim" if s["reused"] == keep else "replay" if s["reused"] else "start over")
        elif op == "step":
            for t in rng.integers(0, vocab, 5):
                logits = session.step(int(t))
            snapshots.append(session.snapshot())
        elif op == "fork":  # another branch from an older state
            session.restore(snapshots[int(rng.integers(0, len(snapshots)))])
            prompt = session.tokens[: len(session.tokens) - int(rng.integers(0, 300))] + [1, 2, 3]
            logits = session.sync(prompt)
        elif op == "save":
            paths.append(tmp_path / f"{len(paths)}.safetensors")
            session.save(paths[-1], history=int(rng.integers(0, 1024)))
            logits = session.step(int(rng.integers(0, vocab)))
        else:  # a fresh session from the saved file, then back into the saved history
            session = Session(model)
            session.load(paths[-1])
            logits = session.sync(session.tokens[: len(session.tokens) - int(rng.integers(0, 700))] + [4])
        assert all(c.pos == len(session.tokens) for c in session.cache)
        diff = float(mx.abs(logits - cold(model, session.tokens)).max())
        assert diff <= 1e-4, f"after {op}: logits differ from a cold prefill by {diff}"
    assert {"trim", "replay"} <= seen  # the restores under test happened
