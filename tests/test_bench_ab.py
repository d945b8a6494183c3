"""`python -m ds4_mlx.tools.bench_ab`: fresh processes per variant, a JSON line each, medians last; a
failing process is reported, not fatal; nothing starts past the deadline."""

import json

from ds4_mlx.tools import bench_ab

BENCH = ["--", "speed", "--preset", "tiny", "--like", "q2", "--contexts", "64", "--decode", "2", "--chunk", "32", "--device", "cpu"]


def lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_each_variant_runs_in_its_own_process_with_its_settings(capsys):
    assert bench_ab.main(["--runs", "1", "--variant", "chosen", "--variant", "bad:DS4_MLX_DENSE_PATH=bogus",
                          "--variant", "forced:DS4_MLX_DENSE_PATH=dequantize", *BENCH]) == 0
    chosen, bad, forced, last = lines(capsys)
    assert (chosen["variant"], chosen["env"], chosen["results"][0]["context"]) == ("chosen", {}, 64)
    assert bad["error"].startswith("exit status 1: ds4-mlx bench: error: DS4_MLX_DENSE_PATH must be one of")
    assert forced["env"] == {"DS4_MLX_DENSE_PATH": "dequantize"} and "error" not in forced
    medians = last["medians"]
    assert medians["bad"] == [] and medians["chosen"][0]["processes"] == 1
    assert medians["chosen"][0]["prefill_tok_s"] == chosen["results"][0]["prefill_tok_s"]


def test_nothing_starts_past_the_deadline(capsys):
    assert bench_ab.main(["--runs", "2", "--deadline-s", "0", "--variant", "a", *BENCH]) == 0
    out = lines(capsys)
    assert [line.get("skipped") for line in out[:2]] == ["the deadline has passed"] * 2
    assert out[-1]["medians"] == {"a": []}


def test_medians_are_per_context_over_processes():
    runs = [{"results": [{"context": 8, "tok_s": v, "peak": None}]} for v in (3.0, 1.0, 2.0)]
    assert bench_ab.medians(runs) == [{"context": 8, "tok_s": 2.0, "processes": 3}]


def test_medians_keep_labelled_rows_apart():
    """Rows of one context with different text fields (a drafter's name) are different settings; `--rows`
    names other rows to take medians of."""
    runs = [{"results": [{"context": 8, "drafter": "oracle", "tok_s": v},
                         {"context": 8, "drafter": "random", "tok_s": -v}],
             "verify_cost": [{"context": 8, "verify": "2 rows", "rows": 2, "seconds": v}]} for v in (3.0, 1.0, 2.0)]
    assert bench_ab.medians(runs) == [{"drafter": "oracle", "tok_s": 2.0, "context": 8, "processes": 3},
                                      {"drafter": "random", "tok_s": -2.0, "context": 8, "processes": 3}]
    assert bench_ab.medians(runs, "verify_cost") == [{"verify": "2 rows", "rows": 2, "seconds": 2.0, "context": 8,
                                                      "processes": 3}]
