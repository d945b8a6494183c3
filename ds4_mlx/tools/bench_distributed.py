"""`ds4-mlx bench distributed`: the pipeline over several processes (`ds4_mlx.distributed`) against one.

Measured on this machine: a prefill's tokens/s and a decoded token's time in one process and in `--ranks`
processes started by `mlx.launch` (the ring backend over loopback), and the largest logit difference
between them (the same tokens fed to both). Computed at real widths (V4 Flash and PRO): the bytes that
cross between ranks per token, and what they take over Thunderbolt 5 and 10 GbE.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# link speeds, bits per second: Thunderbolt 5 (80 Gb/s each way) and 10 Gigabit Ethernet
LINKS = {"thunderbolt5": 80e9, "10gbe": 10e9}
FLOAT32 = 4


def bytes_per_token(args, ranks) -> dict:
    """What crosses between the ranks of a pipeline for each token: the residual streams ([hc_mult,
    hidden] float32) at each of the ranks - 1 boundaries, and for a decoded token the logits (vocab
    float32) from the last rank back to rank 0 (a prefill sends those of its last token only)."""
    streams = args.hc_mult * args.hidden_size * FLOAT32
    boundaries = ranks - 1
    logits = args.vocab_size * FLOAT32 if ranks > 1 else 0
    return {"streams_bytes": streams, "boundaries": boundaries, "logits_bytes": logits,
            "decode_bytes": boundaries * streams + logits, "prefill_bytes": boundaries * streams}


def drafter_bytes_per_row(args) -> dict:
    """What speculative decoding (`--mtp`) adds per verified row, a decoded token included: the streams the
    drafter reads, from the last rank (whose layers make them, at real widths) to rank 0, where it runs.
    MTP reads the last layer's streams, DSpark those of its target layers ([hc_mult, hidden] float32 each).
    A prefill chunk sends those of its last `sliding_window + TAP_SLACK` rows only."""
    from ds4_mlx.models.dspark import DSparkArgs

    streams = args.hc_mult * args.hidden_size * FLOAT32
    return {"mtp": streams, "dspark": len(DSparkArgs().target_layer_ids) * streams}


def link_times(nbytes) -> dict:
    """Microseconds `nbytes` take on each link at its line rate (latency aside)."""
    return {name: nbytes * 8 / rate * 1e6 for name, rate in LINKS.items()}


def real_width_traffic(ranks_list=(2, 4)) -> list:
    from ds4_mlx.models.variants import flash_args, pro_args

    rows = []
    for name, args in (("flash", flash_args()), ("pro", pro_args())):
        for ranks in ranks_list:
            t, drafter = bytes_per_token(args, ranks), drafter_bytes_per_row(args)
            decode, prefill = link_times(t["decode_bytes"]), link_times(t["prefill_bytes"])
            rows.append({"model": name, "ranks": ranks, "decode_kib": t["decode_bytes"] / 1024,
                         "prefill_kib_per_token": t["prefill_bytes"] / 1024,
                         **{f"{kind}_drafter_kib_per_row": n / 1024 for kind, n in drafter.items()},
                         **{f"decode_us_{k}": v for k, v in decode.items()},
                         **{f"prefill_2048_ms_{k}": v * 2048 / 1000 for k, v in prefill.items()}})
    return rows


def measure(session, ids, decode):
    """(prefill tok/s, decode ms a token (median), logits of each decoded step): `ids[:-decode]` as the
    prompt, then the rest one token at a time (the same tokens on every run, so their logits compare)."""
    import mlx.core as mx

    prompt = ids[: len(ids) - decode]
    start = time.perf_counter()
    mx.eval(session.sync(prompt))
    prefill = len(prompt) / (time.perf_counter() - start)
    steps, logits = [], []
    for token in ids[len(ids) - decode :]:
        start = time.perf_counter()
        out = session.step(token)
        mx.eval(out)
        steps.append(time.perf_counter() - start)
        logits.append(np.array(out.astype(mx.float32)))
    return prefill, statistics.median(steps[1:] or steps) * 1000, np.stack(logits)


def prompt_for(vocab, prompt, decode):
    return [int(t) for t in np.random.default_rng(0).integers(3, vocab, prompt + decode)]


def bench_distributed(a):
    """The pipeline over several processes against one: prefill tok/s, decode ms a token, max logit diff;
    the bytes between ranks per token at real widths, over Thunderbolt 5 and 10 GbE."""
    from ds4_mlx.demo import demo_model_path
    from ds4_mlx.loader import load
    from ds4_mlx.session import Session
    from ds4_mlx.tools.testing import free_ports, run_launch

    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        raise ValueError("mlx.launch is not installed beside this Python (it comes with mlx)")
    path = str(a.model or demo_model_path())
    model, _ = load(path)
    ids = prompt_for(model.args.vocab_size, a.prompt, a.decode)
    measure(Session(model, rewind_slack=0), ids[:16], 4)  # warm-up: graphs traced
    one = measure(Session(model, rewind_slack=0), ids, a.decode)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ranks.npz"
        done = run_launch(lambda: [str(launcher), "-n", str(a.ranks), "--hosts", "127.0.0.1", "--backend", "ring",
                                   "--starting-port", str(free_ports(a.ranks)), "--", sys.executable, "-m",
                                   "ds4_mlx.tools.bench_distributed", path, str(out), "--prompt", str(a.prompt),
                                   "--decode", str(a.decode)], a.timeout)
        if not out.exists():
            raise RuntimeError(f"the {a.ranks} processes gave no figures: {(done.stdout + done.stderr).strip()[-2000:]}")
        many = np.load(out)
        prefill, decode_ms, logits = float(many["prefill"]), float(many["decode_ms"]), many["logits"]
    traffic = bytes_per_token(model.args, a.ranks)
    return {
        "model": Path(path).name, "ranks": a.ranks, "prompt": a.prompt, "decode": a.decode,
        "prefill_tok_s_1": one[0], f"prefill_tok_s_{a.ranks}": prefill,
        "decode_ms_1": one[1], f"decode_ms_{a.ranks}": decode_ms, "decode_overhead_ms": decode_ms - one[1],
        "max_logit_diff": float(np.abs(logits - one[2]).max()),
        "bytes_per_decoded_token": traffic["decode_bytes"], "bytes_per_prefill_token": traffic["prefill_bytes"],
        "real_widths": real_width_traffic(),
        "transport": "mlx.launch, ring backend over loopback TCP",
    }


def options(q):
    q.add_argument("-m", "--model", help="a .gguf file or converted MLX folder (default: the demo model)")
    q.add_argument("--ranks", type=int, default=2, help="processes of the pipeline")
    q.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    q.add_argument("--decode", type=int, default=16, help="decoded tokens (their median time is reported)")
    q.add_argument("--timeout", type=float, default=300, help="most seconds the launched run may take")


def _rank_command(a):
    """On each launched rank: rank 0 measures and writes the figures."""
    from ds4_mlx.distributed import new_session
    from ds4_mlx.loader import load

    model, _ = load(a.model)  # this rank's layers
    ids = prompt_for(model.args.vocab_size, a.prompt, a.decode)
    measure(new_session(model, rewind_slack=0), ids[:16], 4)
    prefill, decode_ms, logits = measure(new_session(model, rewind_slack=0), ids, a.decode)
    np.savez(a.out, prefill=prefill, decode_ms=decode_ms, logits=logits)
    return 0


def main(argv=None):
    import mlx.core as mx

    from ds4_mlx import distributed

    mx.set_default_device(mx.cpu)
    p = argparse.ArgumentParser(prog="python -m ds4_mlx.tools.bench_distributed")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--prompt", type=int, required=True)
    p.add_argument("--decode", type=int, required=True)
    a = p.parse_args(argv)
    try:
        return distributed.run(a, _rank_command)
    except Exception as e:  # noqa: BLE001
        print(f"bench distributed: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

