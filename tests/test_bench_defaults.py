"""Every `ds4-mlx bench` sub-command runs with its defaults, as a new user types it: in a subprocess, on
this CPU. Left out: `rewind` (tens of seconds at its CPU defaults), `convert` (writes a 5 GB file) and
`memory` (tested with the cache)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ds4_mlx(*argv, prelude="pass", timeout=120):
    code = f"import sys; {prelude}; from ds4_mlx.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.mark.parametrize("bench", ["model", "speed", "batch"])
def test_a_model_bench_runs_with_its_defaults_on_a_cpu(bench):
    done = ds4_mlx("bench", bench, "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["preset"] == "tiny" and figures["device"].startswith("Device(cpu")


def test_bench_load_without_openai_says_what_to_install():
    done = ds4_mlx("bench", "load", prelude="sys.modules['openai'] = None")  # as if it were not installed
    assert done.returncode != 0 and "pip install openai" in done.stderr and "Traceback" not in done.stderr


def test_bench_convert_says_what_its_size_means():
    done = ds4_mlx("bench", "convert", "--help")
    assert done.returncode == 0 and "5.3" in done.stdout and "at least" in done.stdout


def test_bench_parity_without_transformers_says_what_to_install():
    done = ds4_mlx("bench", "parity", prelude="sys.modules['torch'] = None")  # as if it were not installed
    assert done.returncode != 0 and "pip install 'ds4-mlx[test]'" in done.stderr and "Traceback" not in done.stderr


def test_bench_parity_at_real_widths_needs_as_many_experts_as_a_token_takes():
    done = ds4_mlx("bench", "parity", "--widths", "real", "--experts", "2")
    assert done.returncode != 0 and "at least" in done.stderr and "Traceback" not in done.stderr
