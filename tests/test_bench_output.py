"""`ds4-mlx bench`: a table without --json, one JSON object alone on stdout with it (progress on stderr),
defaults in --help, and the tiny preset by default on a CPU."""

import argparse
import json

import pytest

from ds4_mlx import cli


def bench(capsys, *argv):
    assert cli.main(["bench", *argv]) == 0
    return capsys.readouterr()


def test_model_bench_prints_a_table_or_json(capsys):
    out = bench(capsys, "model", "--prompt", "64", "--decode", "4").out.splitlines()
    assert out[0].split() == ["figure", "value"] and set(out[1]) == {"-", " "}
    rows = dict(line.split(None, 1) for line in out[2:])
    assert rows["preset"] == "tiny"  # the default on a CPU
    assert float(rows["prefill_tok_s"].replace(",", "")) > 0 and rows["prompt"] == "64"
    last = bench(capsys, "model", "--prompt", "64", "--decode", "4", "--json").out.splitlines()[-1]
    figures = json.loads(last)
    assert figures["preset"] == "tiny" and set(figures) == set(rows)


def test_rewind_bench_table_has_a_row_per_context(capsys):
    captured = bench(capsys, "rewind", "--contexts", "64,128", "--repeats", "1")
    lines = captured.out.splitlines()
    header = lines.index("results:") + 1
    assert lines[header].split() == ["context", "cold_s", "resend_s", "ratio", "computed", "max_logit_diff",
                                     "session_mb", "peak_gib"]
    assert [line.split()[0] for line in lines[header + 2:]] == ["64", "128"]
    assert captured.err.count("ctx ") == 2  # progress goes to stderr


def test_convert_bench_prints_a_table(capsys, monkeypatch):
    from ds4_mlx.tools import bench_convert as convert_bench

    monkeypatch.setattr(convert_bench, "bench_convert", lambda size_gb: {"gguf_gb": size_gb, "mb_per_s": 812.5,
                                                                          "within_bound": True})
    out = bench(capsys, "convert", "--size-gb", "0.5", "--rows", "32").out  # few rows: the projection in a second
    figures, files, paths, types = out.rstrip("\n").split("\n\n")
    lines = figures.splitlines()
    assert lines[0].split() == ["figure", "value"] and set(lines[1]) == {"-", " "}
    rows = dict(line.split(None, 1) for line in lines[2:])
    assert (rows["gguf_gb"], rows["mb_per_s"], rows["within_bound"]) == ("0.5", "812.50", "True")
    assert rows["q2_gguf_gib"] == "80.76" and rows["q2_ratio_target"] == "1.02"
    files = files.splitlines()
    assert files[0] == "files_0731:" and files[1].split()[:3] == ["file", "gguf_gib", "native_gib"]
    assert [line.split()[0] for line in files[3:]] == ["ds4f-q2-0731", "ds4f-q2-q4-0731", "ds4f-q4-0731",
                                                       "ds4f-mxfp4-0731"]
    paths = paths.splitlines()
    assert paths[0] == "experts_0731:" and paths[1].split() == ["file", "backend", "experts"]
    assert [line.split()[:2] for line in paths[3:6]] == [["ds4f-q2-0731", "metal"], ["ds4f-q2-0731", "cuda"],
                                                         ["ds4f-q2-0731", "cpu"]]
    types = types.splitlines()
    assert types[0] == "types:"
    assert types[1].split() == ["type", "format", "bytes_per_weight", "rel_rms", "weights_per_s"]
    assert [line.split()[0] for line in types[3:]] == ["IQ2_XXS", "Q2_K", "Q4_K", "Q8_0"]


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "rewind", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 2048,8192 on a CPU, 2048,8192,32768 on a GPU)" in text and "(default: 37)" in text
    assert "(default: tiny on a CPU, real on a GPU)" in text


def test_real_widths_on_a_cpu_say_how_long_first(capsys, monkeypatch):
    from ds4_mlx.tools import random_model
    from ds4_mlx.tools.testing import tiny_args

    # the tiny shape stands in for real widths, which take minutes to build here: what is checked is
    # that the work is counted and announced before it starts
    monkeypatch.setattr(random_model, "real_args", lambda layers, **overrides: tiny_args())
    captured = bench(capsys, "rewind", "--preset", "real", "--contexts", "64,128", "--repeats", "2",
                     "--generated", "3")
    first, second = captured.err.splitlines()[:2]
    assert first.startswith("real V4 Flash widths on a CPU: building the model and timing a few tokens")
    assert second.startswith("this run prefills 196 tokens and decodes 12: at the ")  # 64+128 + 2 resends each
    assert " s per prefill token and " in second and "at least " in second
    assert captured.err.index("this run") < captured.err.index("ctx 64:")


def test_speed_bench_profiles_a_decode_step(capsys):
    """`--profile` times the parts of a prefill chunk and of a decoded token (which decodes as one
    compiled graph otherwise)."""
    last = bench(capsys, "speed", "--preset", "tiny", "--contexts", "256", "--decode", "4", "--chunk", "64",
                 "--profile", "--profile-context", "256", "--json").out.splitlines()[-1]
    profile = json.loads(last)["profile"]
    for part in ("prefill_chunk", "decode_step"):
        assert all(profile[part][k] > 0 for k in ("hc_pre", "attention", "moe", "total", "graph_build"))


# every bench that runs in seconds on a CPU, with small settings (`load` starts servers for minutes,
# `distributed` processes under mlx.launch: tests/test_distributed.py runs it; `kernels` and `gguf-rows`
# need a CUDA GPU)
QUICK = {
    "model": ["--prompt", "16", "--decode", "2"],
    "rewind": ["--contexts", "64", "--repeats", "1", "--generated", "2"],
    "convert": ["--size-gb", "0", "--rows", "32"],
    "speed": ["--preset", "tiny", "--contexts", "64", "--decode", "2", "--chunk", "32"],
    "dense": ["--preset", "tiny", "--rows", "1,8", "--repeats", "1"],
    "memory": ["--contexts", "256"],
    "parity": ["--tokens", "16", "--decode", "2", "--modes", "exact"],
    "batch": ["--streams", "1", "--context", "32", "--decode", "1"],
    "speculative": ["--context", "32", "--decode", "4", "--repeats", "1"],
    "graph": ["--context", "32", "--shapes", "decode,decode:2,verify:3,experts:128"],
}


def test_graph_counts_a_fused_op_or_kernel_as_one_node():
    """`bench graph`'s count: on the CUDA path a fused op of MLX's (here an RMS norm, which the CPU would
    build from several ops) is one node, its placeholders not counted; views and element-wise ops are
    their own nodes."""
    import mlx.core as mx

    from ds4_mlx.tools.bench_graph import STAND_IN, count_nodes, cuda_path

    x, w = mx.ones((2, 8)), mx.ones((8,))
    mx.eval(x, w)
    with cuda_path():
        y = mx.fast.rms_norm(x.reshape(4, 4).reshape(2, 8), w, 1e-6) * 2
    assert count_nodes([y]) == {STAND_IN: 1, "Reshape": 2, "Multiply": 1, "Broadcast": 1}
    plain = count_nodes([mx.fast.rms_norm(x, w, 1e-6)])
    assert STAND_IN not in plain and sum(plain.values()) > 1  # outside, the CPU's own ops


def test_graph_stand_ins_do_not_outlive_the_count():
    """Compiled graphs traced on `bench graph`'s CUDA path hold its stand-ins: once the count is done, a
    model decodes as one that never took that path."""
    import mlx.core as mx

    from ds4_mlx.tools.bench_graph import cuda_path
    from ds4_mlx.tools.random_model import random_model
    from ds4_mlx.tools.testing import tiny_args

    ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5]], dtype=mx.int32)

    def decode(model):
        cache = model.make_cache()
        model(ids[:, :8], cache=cache)
        return model(ids[:, 8:], cache=cache)  # a decoded token: a compiled graph

    counted = random_model(tiny_args(0))
    with cuda_path():
        decode(counted)  # its graphs traced with the stand-ins
    assert mx.array_equal(decode(counted), decode(random_model(tiny_args(0)))).item()


def test_every_bench_is_listed():
    from ds4_mlx.tools.bench import BENCHES

    assert set(QUICK) | {"load", "distributed", "kernels", "gguf-rows", "few-rows"} == {name for name, _, _ in BENCHES}


@pytest.mark.parametrize("name", ["kernels", "gguf-rows", "few-rows"])
def test_cuda_benches_say_what_they_need_on_a_cpu(name):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "bench", name, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stdout == ""
    assert "needs MLX's CUDA build" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("flag,value,says", [("--pairs", "4", "multiple of 6"), ("--pairs", "66", "at most"),
                                             ("--pairs", "6,x", "multiple of 6"), ("--launches", "0", "positive"),
                                             ("--repeats", "0", "positive")])
def test_gguf_rows_bench_refuses_what_it_cannot_time(capsys, flag, value, says):
    """A token's six pairs share a row of x, and past GGUF_ROWS_MAX_PAIRS the kernel does not apply: the
    options say so before anything runs, on any machine."""
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "gguf-rows", flag, value])
    assert done.value.code == 2 and says in capsys.readouterr().err


def test_gguf_rows_bench_says_when_the_kernel_is_off(monkeypatch):
    """With kernels off the launches would be None, and an evaluation of nothing would pass for a fast
    kernel: the bench stops instead."""
    from ds4_mlx.models import kernels
    from ds4_mlx.tools import bench_kernels

    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "_enabled", False)
    a = argparse.Namespace(pairs=[6], dtype="bfloat16", launches=1, repeats=1)
    with pytest.raises(SystemExit, match="kernel is off"):
        bench_kernels.bench_gguf_rows(a)


@pytest.mark.parametrize("rows", ["0", "17", "1,x"])
def test_few_rows_bench_refuses_row_counts_the_kernel_does_not_take(capsys, rows):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "few-rows", "--rows", rows])
    assert done.value.code == 2 and "from 1 to 16" in capsys.readouterr().err


def test_few_rows_bench_says_when_the_kernel_is_off(monkeypatch):
    """With kernels off the launches would not be the kernel's: the bench stops instead."""
    from ds4_mlx.models import kernels
    from ds4_mlx.tools import bench_kernels

    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "_enabled", False)
    a = argparse.Namespace(rows=[1], dtype="bfloat16", launches=1, repeats=1)
    with pytest.raises(SystemExit, match="kernel is off"):
        bench_kernels.bench_few_rows(a)


def test_kernel_names_keep_their_template_arguments_and_lose_their_parameters():
    """MLX's kernels of one name differ by their template arguments (two gathers of a verify): the profile
    keeps them apart."""
    from ds4_mlx.tools.bench_kernels import _short

    gather = "void mlx::core::cu::gather<float, unsigned int, 2, 1, int>(float const*, float*, int)"
    assert _short(gather) == "void mlx::core::cu::gather<float, unsigned int, 2, 1, int>"
    anonymous = "void (anonymous namespace)::softmax<float,\n 256>(float const*, float*)"
    assert _short(anonymous) == "void (anonymous namespace)::softmax<float, 256>"
    assert _short("k" * 150) == "k" * 99 + "~"


def test_kernels_bench_refuses_a_negative_count_to_list(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "kernels", "--top", "-1"])
    assert done.value.code == 2 and "0 or more" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(QUICK))
def test_stdout_holds_the_figures_alone(capsys, name):
    """With --json, stdout is one line, a JSON object; without, the table alone: a "figure value" table,
    then a titled table per list of rows. Progress goes to stderr either way."""
    if name == "parity":
        pytest.importorskip("transformers")
    out = bench(capsys, name, *QUICK[name], "--json").out
    assert len(out.splitlines()) == 1, out
    assert isinstance(json.loads(out), dict)
    sections = bench(capsys, name, *QUICK[name]).out.rstrip("\n").split("\n\n")
    assert sections[0].splitlines()[0].split() == ["figure", "value"], sections[0]
    for section in sections:
        lines = section.splitlines()
        if section is not sections[0]:
            assert lines[0].endswith(":") and " " not in lines[0], section
            lines = lines[1:]
        assert len(lines) >= 3 and set(lines[1]) == {"-", " "}, section
