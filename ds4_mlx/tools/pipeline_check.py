"""One session's script, run in one process or under `mlx.launch` on several (`ds4_mlx.distributed`): the
logits at each point, to compare the two (tests/test_distributed.py).

    mlx.launch -n 2 --hosts 127.0.0.1 --backend ring -- python -m ds4_mlx.tools.pipeline_check MODEL OUT [--save F | --load F | --disk DIR | --mtp DRAFTER ... | --slow | --idle S] [--exact-rewinds] [--layers-per-turn N ...]

Rank 0 writes OUT/logits.npz; every rank writes OUT/rank{r}.pid first.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

# small rings and close checkpoints: the script's rewinds take every path (trim in place, a lane, a
# checkpoint, from empty) on a tiny model
SESSION_OPTIONS = dict(rewind_slack=12, checkpoint_every=32, max_chunk=24, frontier_horizon=4, recent_checkpoints=2)
# speculative decoding: a first chunk longer than a drafter's log keeps (the tiny model's window and the slack)
SPECULATION_OPTIONS = dict(SESSION_OPTIONS, max_chunk=96, checkpoint_every=96)
DRAFTS = 3


def prompt_ids(vocab, n=120, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def script(session, ids) -> dict:
    """Logits [vocab] by name, after each operation: a chunked prefill, decoded tokens, rewinds of every
    depth, a resend, a snapshot restored, a verify of drafted tokens (its rows) and a trim to the accepted
    one; and `NAME.replayed`, the tokens each sync replayed."""
    import mlx.core as mx

    n = len(ids)
    replayed = {}

    def sync(name, prompt):
        out[name] = session.sync(prompt)
        replayed[name] = session.last_sync["replayed"]

    out = {}
    sync("prefill", ids[: n - 20])
    for i, t in enumerate(ids[n - 20 : n - 10]):
        out[f"step{i}"] = session.step(t)
    sync("rewind_in_place", ids[: n - 12])
    sync("rewind_to_a_lane", ids[: n - 19])
    sync("rewind_to_a_checkpoint", ids[:70])
    sync("rewind_to_the_start", ids[:5])
    sync("resend", ids[: n - 10])
    sync("same_again", ids[: n - 10])
    snapshot = session.snapshot()
    session.step(ids[0])
    session.restore(snapshot)
    out["restored"] = session.step(ids[n - 10])
    session.trim(n - 12)
    out["trimmed_then_stepped"] = session.step(ids[n - 12])
    out["verified"] = session.verify(ids[n - 11 : n - 8])  # three drafted tokens, the first accepted
    session.trim(n - 10, logits=out["verified"][0])
    out["accepted_then_stepped"] = session.step(ids[n - 10])
    logits = {k: np.array(v.astype(mx.float32)) for k, v in out.items()}
    return {**logits, **{f"{k}.replayed": np.array(v) for k, v in replayed.items()}}


def batched(new, ids) -> dict:
    """Logits [2, vocab] of two sessions (`new()` makes one) decoding a few tokens together in one forward
    (`step_together`), from prompts of two lengths."""
    import mlx.core as mx

    from ds4_mlx.session import step_together

    sessions = [new(), new()]
    for session, n in zip(sessions, (30, 45)):
        session.sync(ids[:n])
    out = {}
    for i in range(4):
        logits = step_together(sessions, mx.array([ids[50 + i], ids[60 + i]], mx.int32))
        for session in sessions:
            session.settle()
        out[f"together{i}"] = np.array(logits.astype(mx.float32))
    return out


def in_pieces(new, ids, layers_per_turn) -> dict:
    """A prompt computed `layers_per_turn` layers at a time while another session decodes a token between
    each two pieces (as a server runs other streams beside a prompt): the logits of both."""
    import mlx.core as mx

    prompt, other = new(), new()
    other.sync(ids[:20])
    prompt.layers_per_turn = layers_per_turn
    out = {}
    for i, _ in enumerate(prompt.sync_steps(ids[:60])):
        out[f"beside{layers_per_turn}.{i}"] = other.step(ids[20 + i])
    out[f"pieces{layers_per_turn}"] = prompt.step(ids[60])
    return {k: np.array(v.astype(mx.float32)) for k, v in out.items()}


def saved_then_stepped(session, ids, path) -> dict:
    """Save after the prompt; the logits of the next step."""
    import mlx.core as mx

    session.sync(ids[:-1])
    session.save(path)
    return {"after_save": np.array(session.step(ids[-1]).astype(mx.float32))}


def loaded_then_stepped(session, ids, path) -> dict:
    import mlx.core as mx

    session.load(path)
    return {"after_load": np.array(session.step(ids[-1]).astype(mx.float32)), "tokens": np.array(session.tokens)}


def through_the_disk(session, ids, directory) -> dict:
    """The prompt from the disk store at `directory` (`--kv-disk-dir`) when it holds it, else computed and
    stored: the logits of the step after, and the prompt tokens the store gave."""
    import mlx.core as mx

    from ds4_mlx.cache import disk_store_from_args

    flags = argparse.Namespace(kv_disk_dir=str(directory), kv_disk_space_mb=64)
    store = disk_store_from_args(flags, min_tokens=16, index_every=16)
    restored = store.load_longer_prefix(session, ids[:-1], 0)
    session.sync(ids[:-1])
    store.save(session, "prefill")
    return {"after_disk": np.array(session.step(ids[-1]).astype(mx.float32)), "from_disk": np.array(restored)}


class Recorded:
    """A drafter whose every round's drafts, and the logits each was chosen from, are kept."""

    def __init__(self, drafter):
        self.drafter, self.drafts, self.logits = drafter, [], []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft(self, *args, **kwargs):
        tokens, logits, confidence = self.drafter.draft(*args, **kwargs)
        self.drafts += tokens
        if tokens:
            self.logits.append(logits)
        return tokens, logits, confidence


def speculated(session, ids, drafter_path) -> dict:
    """Greedy decoding with the drafter at `drafter_path` (`--mtp`), `DRAFTS` drafts every round: after a
    prompt, then again after a rewind into it. -> the tokens, every round's drafts and the logits they were
    chosen from, the tokens each verify committed; named after the drafter's file."""
    import mlx.core as mx

    from ds4_mlx.generate import Sampler, SamplingParams
    from ds4_mlx.loader import load_drafter
    from ds4_mlx.speculative import Speculation

    drafter = Recorded(load_drafter(drafter_path, session.model))
    speculation = Speculation(drafter, draft_tokens=DRAFTS, schedule=False)
    sampler = Sampler(SamplingParams(temperature=0))
    out = []
    for prompt, n in ((ids[:100], 12), (ids[:90], 8)):
        speculation.attach(session)
        logits = session.sync(prompt)
        for _ in range(n):
            forced = speculation.next_draw()
            token = int((forced if forced is not None else mx.argmax(logits)).item())
            out.append(token)
            logits = speculation.step(session, sampler, token)
    name = Path(drafter_path).stem
    return {f"{name}.tokens": np.array(out), f"{name}.drafts": np.array(drafter.drafts),
            f"{name}.draft_logits": np.array(mx.concatenate(drafter.logits).astype(mx.float32)),
            f"{name}.accepted_lengths": np.array(speculation.stats.accepted_lengths)}


def slow(session, ids, out):
    """Decode for a long while (a rank killed meanwhile must stop rank 0 with an error)."""
    session.sync(ids[:10])
    (out / "started").write_text("1")
    for _ in range(100000):
        session.step(ids[0])


def command(a):
    from ds4_mlx.distributed import new_session
    from ds4_mlx.loader import load

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("MLX_RANK", 0))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    model, _ = load(a.model)  # this rank's layers when launched on several
    options = dict(SPECULATION_OPTIONS if a.mtp else SESSION_OPTIONS, exact_rewinds=a.exact_rewinds)
    session = new_session(model, **options)
    ids = prompt_ids(model.args.vocab_size)
    if a.slow:
        slow(session, ids, out)
    elif a.save:
        logits = saved_then_stepped(session, ids, a.save)
    elif a.load:
        logits = loaded_then_stepped(session, ids, a.load)
    elif a.disk:
        logits = through_the_disk(session, ids, a.disk)
    elif a.mtp:
        logits = {}
        for drafter in a.mtp:
            logits.update(speculated(new_session(model, **options), ids, drafter))
    else:
        time.sleep(a.idle)  # the other ranks wait for the next order meanwhile
        logits = {**script(session, ids), **batched(lambda: new_session(model, **options), ids)}
        for layers in a.layers_per_turn:
            logits.update(in_pieces(lambda: new_session(model, **options), ids, layers))
    np.savez(out / "logits.npz", **logits)
    return 0


def main(argv=None):
    import mlx.core as mx

    from ds4_mlx import distributed

    mx.set_default_device(mx.cpu)
    p = argparse.ArgumentParser(prog="python -m ds4_mlx.tools.pipeline_check")
    p.add_argument("model")  # (`distributed.run` reads args.model)
    p.add_argument("out")
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--disk", help="a folder for the disk store")
    p.add_argument("--mtp", nargs="+", metavar="DRAFTER",
                   help="drafters: decode speculatively with each (`distributed.run` reads args.mtp)")
    p.add_argument("--slow", action="store_true")
    p.add_argument("--idle", type=float, default=0, help="seconds rank 0 waits before the script")
    p.add_argument("--exact-rewinds", action="store_true", help="sessions with Session.exact_rewinds")
    p.add_argument("--layers-per-turn", type=int, nargs="*", default=[],
                   help="also compute a prompt in pieces of each that many layers beside another session")
    a = p.parse_args(argv)
    try:
        return distributed.run(a, command)
    except Exception as e:  # noqa: BLE001 - one line, as the CLI says it
        print(f"pipeline_check: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
