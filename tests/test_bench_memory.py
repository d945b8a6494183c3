"""`ds4-mlx bench memory` with its defaults: the stand-in model writes chunks as the model does."""

import json
import os
import subprocess
import sys
from pathlib import Path

from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.bench_memory import RowWriter
from ds4_mlx.session import Session
from ds4_mlx.tools.testing import tiny_args


def test_bench_memory_runs_with_its_defaults():
    root = str(Path(__file__).parents[1])  # before the paths already set (a GPU machine's MLX)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "bench", "memory", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    rows = figures["results"]
    assert figures["layers"] == 43 and [r["context"] for r in rows] == [4096, 8192]
    assert all(r["rings"] > 0 and r["rows"] > 0 and r["checkpoints_kept"] > 0 for r in rows)
    assert rows[1]["rows"] > rows[0]["rows"]  # compressed rows grow with the context, rings do not


def test_bench_memory_stand_in_holds_what_the_model_holds():
    """Same bytes and checkpoints as the model, with chunks longer than the compressor rings."""
    model = random_model(tiny_args(0), seed=0, quant_sim=True)
    kwargs = dict(rewind_slack=40, frontier_horizon=8, checkpoint_every=64, max_chunk=64)
    real, stand_in = Session(model, **kwargs), Session(RowWriter(model.args, quant_sim=True), **kwargs)
    for s in (real, stand_in):
        s.sync(list(range(1, 300)))
    assert real.nbytes == stand_in.nbytes > 0
    assert sorted(real.checkpoints) == sorted(stand_in.checkpoints)
