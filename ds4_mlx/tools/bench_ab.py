"""Fresh-process A/B of a `ds4-mlx bench` command, for one device job.

Each variant (a name and environment settings) runs the same bench in `--runs` fresh processes, taken
round robin so that drift over the job touches every variant alike (docs/PERFORMANCE.md: figures move
between processes). Prints one JSON line a process (its figures, or its error) and, last, one JSON line
with each variant's medians per context. With `--deadline-s`, no process starts that the longest one so
far says would not end in time, and a process still running at the deadline is stopped, so the medians
of what ran always come back.

    python -m ds4_mlx.tools.bench_ab --runs 3 --variant chosen --variant quantized:DS4_MLX_DENSE_PATH=quantized \\
        -- speed --full --like q2 --dtype bfloat16 --decode 48 --contexts 8192
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_variant(text):
    """"name" or "name:KEY=VALUE,KEY=VALUE" -> (name, {KEY: VALUE})."""
    name, _, settings = text.partition(":")
    env = {}
    for item in filter(None, settings.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE")
        env[key] = value
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r}: a variant needs a name")
    return name, env


def run_once(bench_args, env, timeout):
    """One fresh `ds4-mlx bench ... --json` process -> (figures or {"error": ...}, seconds)."""
    t = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "bench", *bench_args, "--json"],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the deadline after {time.perf_counter() - t:.0f} s"}, time.perf_counter() - t
    seconds = time.perf_counter() - t
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1]), seconds
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit status {done.returncode}: {tail}"}, seconds


def medians(figures_list, key="results"):
    """The median of every numeric figure over the processes' `key` rows, per context and labels (a row's
    text fields, such as a drafter's name: rows that differ there are different settings)."""
    groups = {}
    for figures in figures_list:
        for row in figures.get(key, []):
            labels = tuple((k, v) for k, v in row.items() if isinstance(v, str))
            groups.setdefault((row["context"], labels), []).append(row)
    out = []
    for (context, labels), rows in sorted(groups.items(), key=lambda item: item[0][0]):
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out.append(dict(labels) | {k: statistics.median(r[k] for r in rows if r.get(k) is not None) for k in keys
                                   if any(r.get(k) is not None for r in rows)}
                   | {"context": context, "processes": len(rows)})
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        print("usage: python -m ds4_mlx.tools.bench_ab [options] -- BENCH ARGS (e.g. speed --full ...)", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m ds4_mlx.tools.bench_ab", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="fresh processes a variant")
    p.add_argument("--variant", type=parse_variant, action="append", required=True,
                   help="NAME or NAME:KEY=VALUE,... (environment settings of its processes)")
    p.add_argument("--deadline-s", type=float, default=None, help="seconds the whole job may take")
    p.add_argument("--rows", action="append", default=[], metavar="KEY",
                   help="also the medians of the figures' KEY rows, beside `results` (e.g. verify_cost)")
    a = p.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    # a process starts only if the one before it would still end by the deadline: the first of a job is
    # much the slowest on the device (later ones find its compiled kernels), so it is not the measure
    start, last = time.perf_counter(), 0.0
    done = {name: [] for name, _ in a.variant}
    for run in range(a.runs):
        for name, env in a.variant:
            left = None if a.deadline_s is None else a.deadline_s - (time.perf_counter() - start)
            if left is not None and (left <= 0 or last > left):
                why = "the deadline has passed" if left <= 0 else \
                    f"{left:.0f} s to the deadline, the last process took {last:.0f} s"
                print(json.dumps({"variant": name, "run": run, "skipped": why}), flush=True)
                continue
            figures, seconds = run_once(bench_args, env, left)
            last = seconds
            print(json.dumps({"variant": name, "run": run, "env": env, "seconds": round(seconds, 1), **figures}),
                  flush=True)
            if "error" not in figures:
                done[name].append(figures)
    more = {f"medians_{key}": {name: medians(figs, key) for name, figs in done.items()} for key in a.rows}
    print(json.dumps({"medians": {name: medians(figs) for name, figs in done.items()}, **more, "bench": bench_args}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
