"""Several sessions decoded in one forward (`step_together`) give each session the logits of its own step."""

import mlx.core as mx
import numpy as np

from ds4_mlx.tools.random_model import random_model
from ds4_mlx.models.deepseek_v4 import DecoderLayer
from ds4_mlx.session import Session, step_together
from ds4_mlx.tools.testing import tiny_args


def test_batched_steps_equal_steps_alone(monkeypatch):
    rows = []
    layer_step = DecoderLayer.__call__
    monkeypatch.setattr(DecoderLayer, "__call__", lambda self, streams, *a: rows.append(streams.shape[0])
                        or layer_step(self, streams, *a))
    model = random_model(tiny_args(0), seed=0, quant_sim=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 40, 57, 90)]  # one still in its first window
    together = [Session(model, max_chunk=32) for _ in prompts]
    alone = [Session(model, max_chunk=32) for _ in prompts]
    for a, b, prompt in zip(together, alone, prompts):
        a.sync(prompt)
        b.sync(prompt)
    for step in range(24):
        drawn = rng.integers(0, 512, len(prompts))
        if step == 9:  # one session goes back mid-run, as a rewinding request does
            together[2].trim(50)
            alone[2].trim(50)
        logits = step_together(together, mx.array(drawn, dtype=mx.int32))
        for s in together:
            s.settle()
        for b, (s, token) in enumerate(zip(alone, drawn)):
            diff = float(mx.abs(logits[b] - s.step(int(token))).max())
            assert diff == 0.0, f"step {step}, session {b}: {diff}"  # bit for bit, first window included
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    assert rows.count(len(prompts)) == 24 * model.args.num_hidden_layers  # every step one batched forward
