"""`ds4-mlx bench speculative`: decode tokens/s with speculative decoding against plain decoding.

The drafters need no trained weights: an oracle drafts the target's own greedy continuation (computed
by the plain run first) and spoils each draft with a chance set so that a round commits a chosen mean
number of tokens (`tools.drafters.OracleDrafter`); a random drafter accepts about nothing. So the
figures measure the machinery (a verify of several rows, trims, scheduling), not a drafter's quality.
Every run decodes greedily from the same prompt and must give the plain run's tokens."""

import statistics
import time

import mlx.core as mx
import numpy as np

from ds4_mlx.generate import SamplingParams, stream_generate
from ds4_mlx.session import Session
from ds4_mlx.speculative import Speculation
from ds4_mlx.tools.drafters import OracleDrafter, RandomDrafter

ACCEPTED_LENGTHS = (3.3, 4.4)  # the released DSpark drafter's range (tokens committed per verify)


class _Silent:
    eos_id = -1  # never stops early

    def decode(self, ids):
        return ""


def options(q):
    """This bench's own options (`ds4-mlx bench` adds the model's)."""
    q.add_argument("--context", type=int, default=None, help="prompt tokens (default: 512 tiny, 8192 real)")
    q.add_argument("--decode", type=int, default=None, help="tokens decoded a run (default: 96 tiny, 64 real)")
    q.add_argument("--block", type=int, default=5, help="drafts a round at most (the DSpark block)")
    q.add_argument("--repeats", type=int, default=3, help="runs of each setting (medians)")


def _decode(model, snapshot, prompt, n, speculation=None):
    session = Session(model, rewind_slack=256)
    session.restore(snapshot)
    start = time.perf_counter()
    tokens = [c.token for c in stream_generate(session, _Silent(), prompt, max_tokens=n,
                                               sampling=SamplingParams(temperature=0), speculation=speculation)
              if c.token is not None]
    return n / (time.perf_counter() - start), tokens


def _verify_costs(model, snapshot, rows=(2, 4, 6), repeats=15):
    """Seconds of a verify of T rows over those of one decoded token, on the same session state (the
    lengths taken in turn each repeat, so a busy machine slows them alike; the first repeat builds the
    graphs and is left out)."""
    session = Session(model, rewind_slack=256)
    session.restore(snapshot)
    n = len(session.tokens)
    took = {T: [] for T in (1,) + tuple(rows)}
    for _ in range(repeats + 1):
        for T in took:
            start = time.perf_counter()
            if T == 1:
                mx.eval(session.step(7))
            else:
                session.verify([7] * T)
            took[T].append(time.perf_counter() - start)
            session.trim(n)
    times = {T: statistics.median(t[1:]) for T, t in took.items()}
    return [{"verify": f"{T} rows", "rows": T, "seconds": times[T], "vs_one_token": times[T] / times[1]}
            for T in rows]


def bench_speculative(a):
    """Decode tok/s plain and with speculation (oracle drafters at fixed accepted lengths, a random drafter)."""
    from ds4_mlx.tools.random_model import model_from_flags

    tiny = a.preset == "tiny"
    context = a.context or (512 if tiny else 8192)
    n = a.decode or (96 if tiny else 64)
    model = model_from_flags(a)
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, context).tolist()
    base = Session(model, rewind_slack=256)
    base.sync(prompt)
    snapshot = base.snapshot()

    _decode(model, snapshot, prompt, min(n, 8))  # compile the decode graphs
    plain_tok_s, plain_tokens = _decode(model, snapshot, prompt, n)
    continuation = prompt + plain_tokens
    settings = [(f"oracle {length}", lambda seed, length=length: OracleDrafter(continuation, length, a.block, seed))
                for length in ACCEPTED_LENGTHS]
    settings.append(("random", lambda seed: RandomDrafter(a.block, seed)))

    # each repeat runs plain decoding and every setting in turn, so a busy machine slows them alike; the
    # first repeat (seed -1) is not timed: it builds the graphs of the verify shapes, as the plain run's
    # first tokens did for decoding (on CUDA each new shape compiles kernels)
    plain, runs, identical = [plain_tok_s], {name: [] for name, _ in settings}, True
    for seed in range(-1, a.repeats):
        if seed > 0:
            tok_s, tokens = _decode(model, snapshot, prompt, n)
            plain.append(tok_s)
            identical = identical and tokens == plain_tokens
        for name, make in settings:
            # the oracle at a fixed draft count (its accepted length is set for it); the random drafter
            # as the scheduler runs it (its job: decode plainly when drafting does not pay)
            spec = Speculation(make(seed), draft_tokens=a.block, schedule=name == "random")
            tok_s, tokens = _decode(model, snapshot, prompt, n, spec)
            identical = identical and tokens == plain_tokens
            if seed >= 0:
                runs[name].append((tok_s, spec.stats))
    plain_tok_s = statistics.median(plain)
    results = []
    for name, rows in runs.items():
        tok_s = statistics.median(r[0] for r in rows)
        lengths = [x for r in rows for x in r[1].accepted_lengths]
        drafted = sum(r[1].drafted for r in rows)
        results.append({"drafter": name, "context": context,
                        "accepted_length": sum(lengths) / len(lengths) if lengths else 1.0,
                        "acceptance": sum(r[1].accepted for r in rows) / drafted if drafted else 0.0,
                        "tok_s": tok_s, "plain_tok_s": plain_tok_s, "speedup": tok_s / plain_tok_s})
    return {"preset": a.preset, "layers": model.args.num_hidden_layers, "like": a.like, "quant_sim": a.quant_sim,
            "context": context, "decoded": n, "block": a.block, "greedy_identical": identical,
            "plain_tok_s": plain_tok_s, "results": results,
            "verify_cost": [row | {"context": context} for row in _verify_costs(model, snapshot)]}
