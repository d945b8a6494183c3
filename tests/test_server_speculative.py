"""The server with speculative decoding answers, greedy, exactly what it answers without, through what its
sessions do between requests: an abort mid-stream and the resend, rewinds (a shorter resend, an edited
last turn), a fork from another slot, streams decoded together, and a restart from the disk store.

The drafters: ds4's DSpark and MTP GGUFs written here (random weights: their drafts are all but always
rejected, so every round trims its tail), given as `--mtp FILE [--dspark]`; and one that drafts the
target's own continuation but spoils the last draft of each round (drafts accepted and rejected in one
round). Each request's prompt is fixed text, so each case's answer is compared on its own."""

import argparse
import threading
import time

import mlx.core as mx
import pytest
from test_drafter_gguf import dspark_metadata, dspark_tensors, mtp_tensors

import ds4_mlx.session
from ds4_mlx.cache.store import DiskStore
from ds4_mlx.speculative import Speculation, add_arguments, server_generate, speculation_from_args
from ds4_mlx.session import Session, common_prefix
from ds4_mlx.tools.drafters import OracleDrafter, random_dspark, random_mtp
from ds4_mlx.tools.testing import answer_text, served, write_gguf

MODEL = "deepseek-chat"
TOKENS = 8
DRAFTS = 3
# long enough (`slots.MIN_SHARE`) that a request sharing it continues a slot, trimmed, or forks from it
SYSTEM = {"role": "system", "content": "Rules: " + " ".join(f"rule{i}" for i in range(140))}
OTHER_SYSTEM = {"role": "system", "content": "Facts: " + " ".join(f"fact{i}" for i in range(140))}
FIRST = [SYSTEM, {"role": "user", "content": "Hello there, how are you?"}]
TURN = FIRST + [{"role": "assistant", "content": "Fine, thanks."}, {"role": "user", "content": "And then?"}]
EDITED = TURN[:-1] + [{"role": "user", "content": "And before that?"}]
LONG = [OTHER_SYSTEM, {"role": "user", "content": "Sort: " + " ".join(f"item{i}" for i in range(150))}]
SIDE = [OTHER_SYSTEM, {"role": "user", "content": "A side question."}]
TOGETHER = [[{"role": "user", "content": f"Stream {i}: count to ten."}] for i in range(3)]


class SpoiledLookahead(OracleDrafter):
    """Drafts the target's own greedy continuation (from sessions of its own, so each round computes only
    what is new) and spoils the last draft: a round accepts all its drafts but that one."""

    def __init__(self, k):
        self.k, self.sessions = k, []

    def draft(self, target, anchor, context, context_start, choose, k, committed_tokens=()):
        ids = list(committed_tokens) + [int(anchor)]
        session = max(self.sessions, key=lambda s: common_prefix(s.tokens, ids), default=None)
        if session is None or len(self.sessions) < 4 and common_prefix(session.tokens, ids) < len(ids) // 2:
            session = Session(target)
            self.sessions.append(session)
        logits, tokens = session.sync(ids), []
        for _ in range(min(k, self.k)):
            tokens.append(int(mx.argmax(logits)))
            logits = session.step(tokens[-1])
        tokens[-1] = (tokens[-1] + 1) % target.args.vocab_size
        return tokens, mx.zeros((len(tokens), target.args.vocab_size)), None


@pytest.fixture(scope="module")
def drafters(demo, tmp_path_factory):
    """{kind: make(model) -> a Speculation drafting up to `DRAFTS` tokens every round (no scheduler)}."""
    folder = tmp_path_factory.mktemp("drafters")
    args = demo[0].args
    dspark = random_dspark(args, seed=3)
    dspark_file = write_gguf(folder / "dspark.gguf", dspark_metadata(dspark.dspark), dspark_tensors(dspark),
                             arch="deepseek4-dspark")
    mtp_file = write_gguf(folder / "mtp.gguf", {}, mtp_tensors(random_mtp(args, seed=4)))

    def from_flags(*flags):  # as `ds4-mlx serve` reads them
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        make = speculation_from_args(parser.parse_args(list(flags)))
        return lambda model: _every_round(make(model))

    lookahead = SpoiledLookahead(DRAFTS)
    # DSpark's rounds cut by confidence: of different lengths, padded to one another's in a batched verify
    return {"dspark": from_flags("--mtp", str(dspark_file), "--dspark", "--draft-tokens", str(DRAFTS),
                                 "--dspark-confidence", "0.5"),
            "mtp": from_flags("--mtp", str(mtp_file), "--draft-tokens", str(DRAFTS)),
            "spoiled lookahead": lambda model: Speculation(lookahead, draft_tokens=DRAFTS, schedule=False)}


def _every_round(speculation):
    speculation.schedule = False  # the scheduler would decode plainly once it sees drafts rejected
    return speculation


def _ask(client, messages, **extra):
    return answer_text(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS,
                                                      temperature=0, **extra))


def _idle(bg):
    worker = bg.server.worker
    deadline = time.monotonic() + 30
    while worker.queued or any(s.busy for s in worker.slots):
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.02)


def _server(make, disk_dir):
    options = {"sessions": 3, "batch": 3, "disk": DiskStore(disk_dir, 64, min_tokens=16)}
    if make is not None:
        options["generate"] = server_generate(make)
    return served(**options)


def _answers(make, disk_dir):
    """The answer of every case, by name."""
    out = {}
    with _server(make, disk_dir) as (bg, client):
        worker = bg.server.worker
        stream = client.chat.completions.create(model=MODEL, messages=FIRST, max_tokens=400, temperature=0,
                                                stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the server stops decoding at its next token
        _idle(bg)
        assert worker.recent[-1][1].finish_reason == "abort"
        out["resent after an abort"] = _ask(client, FIRST)
        out["next turn"] = _ask(client, TURN)
        out["shorter resend"] = _ask(client, FIRST)  # back into the prompt
        out["edited last turn"] = _ask(client, EDITED)  # back into the decoded answer
        assert {o.slot for _, o in worker.recent} == {0}, "the conversation left its slot"
        out["long"] = _ask(client, LONG)
        out["fork"] = _ask(client, SIDE)
        assert worker.recent[-1][1].source is not None, "the side request did not fork"
        _idle(bg)
        together = [None] * len(TOGETHER)

        def ask(i):
            together[i] = _ask(client, TOGETHER[i])
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TOGETHER))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["streams decoded together"] = together
    with _server(make, disk_dir) as (bg, client):  # the sessions were saved at the shutdown
        out["after a restart"] = _ask(client, LONG)
        assert bg.server.worker.recent[-1][1].from_disk, "the restarted server did not start from disk"
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _answers(None, tmp_path_factory.mktemp("plain-disk"))


@pytest.mark.parametrize("kind", ["dspark", "mtp", "spoiled lookahead"])
def test_speculative_server_answers_as_the_plain_one(kind, drafters, plain, tmp_path, monkeypatch):
    forwards = []
    verify_together = ds4_mlx.session.verify_together

    def counted(sessions, id_lists):
        forwards.append(sorted(len(ids) for ids in id_lists))
        return verify_together(sessions, id_lists)
    monkeypatch.setattr(ds4_mlx.session, "verify_together", counted)
    assert _answers(drafters[kind], tmp_path) == plain
    assert max(map(len, forwards)) > 1, "no two streams' drafts were verified in one forward"
