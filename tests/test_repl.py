"""The chat REPL: a 5-turn conversation that never re-prefills, and the real terminal program."""

import os
import re
import sys

import pytest

from ds4_mlx.chat import render_next_user_turn
from ds4_mlx.generate import SamplingParams
from ds4_mlx.repl import Conversation


def test_five_turns_compute_only_the_new_turn(demo):
    from ds4_mlx import Session

    model, tokenizer = demo
    conversation = Conversation(Session(model), tokenizer, sampling=SamplingParams(seed=5), max_tokens=6)
    questions = ["Hello!", "What is 2+2?", "Tell me more, please.", "Why?", "Thanks, bye."]
    for turn, question in enumerate(questions):
        conversation.thinking = turn % 2 == 0
        before = list(conversation.transcript)
        chunks_seen = []
        stop_early = turn == 2  # like Ctrl+C: the partial answer stays
        for chunk in conversation.ask(question, should_abort=lambda: stop_early and len(chunks_seen) >= 2):
            chunks_seen.append(chunk)
        stats = chunks_seen[-1].stats
        assert chunks_seen[-1].finish_reason == ("abort" if stop_early else "length")
        if turn == 0:
            assert stats.computed_tokens == stats.prompt_tokens
        else:
            new_turn = tokenizer.encode(render_next_user_turn(question, thinking=conversation.thinking))
            assert (stats.reused_tokens, stats.replayed_tokens, stats.computed_tokens) == \
                (len(before), 0, len(new_turn))
        assert conversation.session.tokens == conversation.transcript
        assert conversation.transcript[:len(before)] == before


def test_terminal_program(tmp_path, demo):
    pexpect = pytest.importorskip("pexpect")

    env = {**os.environ, "DS4_MLX_HOME": str(tmp_path), "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "ds4_mlx.cli", "chat", "--max-tokens", "100000",
                                           "--seed", "1", "--nothink"],
                          env=env, encoding="utf-8", timeout=60, dimensions=(40, 200))
    try:
        child.expect("gibberish")
        child.expect("ds4>")
        for question in ("Hello there", "Ask again"):
            child.sendline(question)
            child.expect(re.escape("\x1b[?2004l"))  # prompt_toolkit hands the terminal back
            child.expect(r"[^\x00-\x1f]{6}")  # streamed answer text
            child.sendintr()
            child.expect(r"\[stopped\]")
            child.expect(r"prompt (\d+) tokens, (\d+) new.*cached (\d+) tokens\]")
            new_tokens = int(child.match.group(2))
            child.expect("ds4>")
        tokenizer = demo[1]
        assert new_tokens == len(tokenizer.encode(render_next_user_turn("Ask again", thinking=False)))
        child.sendline("/stats")
        child.expect(r"cached tokens: (\d+)")
        assert int(child.match.group(1)) > 0
        child.expect("ds4>")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_a_resumed_conversation_counts_and_saves_all_its_turns(tmp_path, demo):
    from ds4_mlx import Session
    from ds4_mlx.cache.store import DiskStore

    model, tokenizer = demo
    first = Conversation(Session(model), tokenizer, sampling=SamplingParams(seed=2), max_tokens=5,
                         system="Be brief.", disk=DiskStore(tmp_path, 64, min_tokens=16))
    for turn, question in enumerate(["Hello!", "Say <｜User｜> plainly.", "Thanks.", "Bye."]):
        first.thinking = turn == 3  # the last answer keeps its reasoning
        list(first.ask(question))
    resumed = Conversation(Session(model), tokenizer, disk=DiskStore(tmp_path, 64, min_tokens=16))
    assert resumed.resume()
    assert resumed.turns == 4 and resumed.transcript == first.transcript
    assert resumed.saved_messages() == first.saved_messages()
