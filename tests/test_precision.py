"""The precision policy: the exact mode turns MLX's TF32 products off before anything computes, the
default and half precision leave MLX's setting alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4_mlx.precision import keeps_float32

PROBE = """
import os
import mlx.core as mx
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import tiny_args
model = random_model(tiny_args(0), quant_sim={quant_sim})
if {half}:
    model.cast(mx.bfloat16)
model(mx.array([[1, 2, 3]]))
print(os.environ.get("MLX_ENABLE_TF32"))
"""


def forward_sets(quant_sim, half=False, **env):
    """MLX_ENABLE_TF32 in a fresh process after a model's first forward pass (and stderr)."""
    environ = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    root = str(Path(__file__).parents[1])  # before the paths already set (a GPU machine's MLX)
    environ.update(PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), **env)
    out = subprocess.run([sys.executable, "-c", PROBE.format(quant_sim=quant_sim, half=half)], env=environ,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1], out.stderr


def test_the_exact_mode_turns_tf32_off():
    assert forward_sets(False)[0] == "0"


def test_the_default_and_bfloat16_leave_tf32_alone():
    assert forward_sets(True)[0] == "None"
    assert forward_sets(False, half=True)[0] == "None"


def test_a_chosen_tf32_setting_is_kept_and_warned_about():
    value, stderr = forward_sets(False, MLX_ENABLE_TF32="1")
    assert value == "1" and "not exact" in stderr


@pytest.mark.parametrize("path,kept", [
    ("layers.3.hc_attn.fn", True), ("hc_head.base", True), ("layers.0.attn.sinks", True),
    ("layers.5.ffn.gate.weight", True), ("layers.5.ffn.bias", True), ("layers.2.attn.compressor.ape", True),
    ("layers.2.attn.q_a.weight", False), ("layers.5.ffn.experts.gate.weight", False), ("embed.weight", False),
    ("layers.5.ffn.shared.gate.weight", False),
])
def test_which_parameters_stay_float32(path, kept):
    assert keeps_float32(path) is kept


def test_bench_parity_exact_mode_matches_transformers():
    """`ds4-mlx bench parity` at the real cache geometry, tiny widths: the exact mode's prefill and decode
    logits equal transformers' float32 ones."""
    pytest.importorskip("transformers")
    root = str(Path(__file__).parents[1])  # before the paths already set (a GPU machine's MLX)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "bench", "parity", "--device", "cpu", "--tokens",
                          "300", "--decode", "4", "--modes", "exact", "--json"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (exact,) = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert exact["mode"] == "exact" and exact["tf32"] is False
    assert exact["prefill_max_abs"] <= 1e-4 and exact["decode_max_abs"] <= 1e-4
    assert exact["prefill_top1"] == exact["decode_top1"] == 1.0
