"""Sampling, stop conditions, streaming text, and the cache contract of stream_generate."""

import re

import mlx.core as mx

from ds4_mlx import SyncInterrupted
from ds4_mlx.generate import (AnswerStops, Sampler, SamplingParams, filter_logits,
                              stream_generate)

VOCAB = 16
EOS = 1


class ByteTokenizer:
    """Token i decodes to PIECES[i] (bytes), so a character can be split across tokens."""

    PIECES = {0: b"<s>", 1: b"</s>", 2: b"ab", 3: b"ST", 4: b"OP", 5: b"cd", 6: "é".encode()[:1],
              7: "é".encode()[1:], 8: b" ", 9: b"S", 10: b"x", 11: b"</think>", 12: b"\n\n",
              13: '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'.encode()}
    eos_id = EOS

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


class ScriptedSession:
    """A Session stand-in whose logits make the greedy choice follow `script`."""

    def __init__(self, script):
        self.script = list(script)
        self.tokens = []
        self.last_sync = {}
        self.fed = 0  # model positions computed

    def _logits(self):
        i = len(self.tokens) - self.prompt_len
        return mx.eye(VOCAB)[self.script[i] if i < len(self.script) else EOS] * 10

    def sync(self, prompt_ids, on_chunk=None):
        self.prompt_len = len(prompt_ids)
        for done in range(1, len(prompt_ids) + 1):
            self.tokens = list(prompt_ids[:done])
            if on_chunk and on_chunk(done, len(prompt_ids)) and done < len(prompt_ids):
                raise SyncInterrupted()
        self.last_sync = {"reused": 0, "replayed": 0, "computed": len(prompt_ids)}
        return self._logits()

    def step(self, token):
        self.tokens.append(token)
        return self._logits()

    def step_async(self, token):
        return self.step(token)

    def settle(self):
        if isinstance(self.tokens[-1], mx.array):
            self.tokens[-1] = int(self.tokens[-1].item())
        return self.tokens[-1]

    def trim(self, n):
        del self.tokens[n:]


GREEDY = SamplingParams(temperature=0)
PROMPT = [0, 10, 10]


def run(script, **kwargs):
    session = ScriptedSession(script)
    chunks = list(stream_generate(session, ByteTokenizer(), PROMPT, sampling=GREEDY,
                                  **{"max_tokens": 100, **kwargs}))
    return session, chunks


def check_contract(session, chunks):
    *body, last = chunks
    assert all(c.finish_reason is None and c.stats is None for c in body)
    assert last.finish_reason and last.stats
    assert session.tokens == PROMPT + last.stats.output_ids


# ---------------------------------------------------------------- sampling


def test_filters_mask_the_right_tokens():
    logits = mx.log(mx.array([0.5, 0.25, 0.15, 0.07, 0.03]))
    def kept(**knobs):
        params = SamplingParams(**{"min_p": 0.0, **knobs})
        return (filter_logits(logits, params) > -mx.inf).tolist()

    assert kept() == [True] * 5
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.5) == [True, False, False, False, False]
    assert kept(top_p=0.8) == [True, True, True, False, False]
    assert kept(min_p=0.2) == [True, True, True, False, False]  # >= 0.1
    assert kept(top_k=3, top_p=0.6) == [True, True, False, False, False]
    hot = filter_logits(logits, SamplingParams(temperature=0.5, min_p=0))
    assert mx.allclose(hot, logits * 2).item()


def test_greedy_and_seeded_sampling():
    logits = mx.random.normal((1000,), key=mx.random.key(0))
    assert Sampler(GREEDY)(logits) == int(mx.argmax(logits).item())

    def draw(seed):
        sampler = Sampler(SamplingParams(seed=seed, min_p=0))
        return [sampler(logits) for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    top2 = set(mx.argsort(logits)[-2:].tolist())
    sampler = Sampler(SamplingParams(seed=1, top_k=2))
    assert {sampler(logits) for _ in range(50)} <= top2


def test_a_tiny_temperature_is_greedy_and_a_logit_bias_steers_the_draw():
    logits = mx.random.normal((1000,), key=mx.random.key(0))
    best = int(mx.argmax(logits).item())
    for temperature in (1e-45, 1e-6):  # dividing by it gives inf and NaN: drawing from that is garbage
        sampler = Sampler(SamplingParams(temperature=temperature, seed=2))
        assert [sampler(logits) for _ in range(5)] == [best] * 5
    biased = Sampler(SamplingParams(temperature=0, logit_bias={7: 100.0, best: -100.0, 5000: 100.0}))
    assert biased(logits) == 7  # 5000 is past the vocabulary: no token, no effect
    assert Sampler(SamplingParams(seed=3, logit_bias={best: -100.0}))(logits) != best


# ---------------------------------------------------------------- stream_generate


def test_eos_stops_and_is_not_part_of_the_answer():
    session, chunks = run([2, 5, EOS, 2])
    assert "".join(c.text for c in chunks) == "abcd"
    assert [c.token for c in chunks] == [2, 5, EOS]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].stats.output_ids == [2, 5]
    assert chunks[-1].stats.completion_tokens == 3
    check_contract(session, chunks)


def test_stop_string_across_tokens_is_withheld_and_trimmed():
    # "ST" may begin "STOP": it waits until "x" rules that out
    session, chunks = run([2, 3, 10, 4, 5, EOS], stop_strings=["STOP"])
    assert [c.text for c in chunks] == ["ab", "", "STx", "OP", "cd", ""]
    session, chunks = run([2, 3, 4, 5], stop_strings=["STOP", "zz"])
    assert [c.text for c in chunks] == ["ab", "", ""]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].stats.output_ids == [2]
    check_contract(session, chunks)  # the session was trimmed back to before "ST"


def test_stop_string_inside_one_token_keeps_earlier_tokens():
    session, chunks = run([2, 9, 10, 5], stop_strings=["Sx"])
    assert "".join(c.text for c in chunks) == "ab"
    assert chunks[-1].stats.output_ids == [2]
    check_contract(session, chunks)


def test_answer_stop_strings_skip_the_reasoning_and_tool_calls():
    # "\n\n" in the reasoning, and the blank line that opens a tool-call block, are not the answer's content
    stops = AnswerStops(["\n\n"], thinking=True, tools=True)
    session, chunks = run([2, 12, 5, 11, 2, 12, 13, 5, 12, 2, EOS], stop_strings=stops)
    assert "".join(c.text for c in chunks) == "ab\n\ncd</think>ab\n\n" + ByteTokenizer.PIECES[13].decode() + "cd"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stats.output_ids == [2, 12, 5, 11, 2, 12, 13, 5]
    check_contract(session, chunks)
    # a stop string the parser held back (whitespace that might open a tool call) is found at the end
    session, chunks = run([11, 5, 12, EOS], stop_strings=stops)
    assert "".join(c.text for c in chunks) == "</think>cd" and chunks[-1].stats.output_ids == [11, 5]
    check_contract(session, chunks)
    session, chunks = run([2, 12, 5, 11, 2, EOS], stop_strings=["\n\n"])  # plain: the whole text
    assert "".join(c.text for c in chunks) == "ab" and chunks[-1].stats.output_ids == [2]


def test_split_character_never_emits_broken_utf8():
    session, chunks = run([2, 6, 7, 8, 6, 7, EOS])
    assert [c.text for c in chunks] == ["ab", "", "é", " ", "", "é", ""]
    check_contract(session, chunks)


def test_length_feeds_the_last_token():
    session, chunks = run([2, 5, 2, 5], max_tokens=3)
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].stats.output_ids == [2, 5, 2]
    check_contract(session, chunks)
    session, chunks = run([2], max_tokens=0)
    assert [(c.token, c.finish_reason) for c in chunks] == [(None, "length")]


def test_abort_between_tokens_and_during_prefill():
    session, stop = ScriptedSession([2, 5, 2, 5, 2, 5]), []
    stream = stream_generate(session, ByteTokenizer(), PROMPT, max_tokens=100, sampling=GREEDY,
                             should_abort=lambda: bool(stop))
    chunks = [next(stream), next(stream)]
    stop.append(True)
    chunks += list(stream)
    assert [(c.text, c.token, c.finish_reason) for c in chunks] == [
        ("ab", 2, None), ("cd", 5, None), ("", None, "abort")]
    check_contract(session, chunks)
    # asked while a token is computed (Ctrl+C in the REPL): that token is neither shown nor kept
    session = ScriptedSession([2, 5, 2, 5])
    stream = stream_generate(session, ByteTokenizer(), PROMPT, max_tokens=100, sampling=GREEDY,
                             should_abort=lambda: len(session.tokens) > len(PROMPT) + 1)  # once "cd" is fed
    chunks = list(stream)
    assert [(c.text, c.token, c.finish_reason) for c in chunks] == [("ab", 2, None), ("", None, "abort")]
    check_contract(session, chunks)
    seen = []
    session, chunks = run([2], on_prefill=lambda done, total: seen.append(done) or done == 2)
    assert seen == [1, 2] and session.tokens == PROMPT[:2]
    assert [(c.token, c.finish_reason) for c in chunks] == [(None, "abort")]


# ---------------------------------------------------------------- with the real Session


def test_follow_up_reuses_the_whole_cache(demo):
    from ds4_mlx import Session
    from ds4_mlx.chat import render, render_next_user_turn

    model, tokenizer = demo
    session = Session(model)
    follow_up = tokenizer.encode(render_next_user_turn("And then?"))
    prompt = tokenizer.encode(render([{"role": "user", "content": "Tell me a story."}]))
    for turn in range(2):
        chunks = list(stream_generate(session, tokenizer, prompt, max_tokens=8, sampling=SamplingParams(seed=3)))
        stats = chunks[-1].stats
        assert session.tokens == prompt + stats.output_ids
        assert "".join(c.text for c in chunks) == tokenizer.decode(stats.output_ids)
        if turn:
            assert (stats.computed_tokens, stats.replayed_tokens) == (len(follow_up), 0)
        prompt = session.tokens + follow_up


def _generate_cli(*args):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "generate", "-p", "Hi", "--temp", "0", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def _expected(demo, n, thinking):
    """(reasoning, answer) of the same greedy run, streamed in-process."""
    from ds4_mlx import Session
    from ds4_mlx.chat import DEFAULT_SYSTEM, ContentDelta, OutputParser, ReasoningDelta, render

    model, tokenizer = demo
    prompt = render([{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": "Hi"}], thinking=thinking)
    parser = OutputParser(thinking=thinking)
    text = "".join(c.text for c in stream_generate(Session(model), tokenizer, tokenizer.encode(prompt), max_tokens=n,
                                                    sampling=SamplingParams(temperature=0)))
    events = parser.feed(text) + parser.finish()
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, ContentDelta)))


def test_generate_command_answer_on_stdout_figures_on_their_own_line(demo):
    _, answer = _expected(demo, 4, thinking=False)
    out, err = _generate_cli("-n", "4", "--nothink")
    assert out == answer.lstrip() + "\n" and answer.strip()
    lines = err.splitlines()
    assert "gibberish" in lines[0]
    assert re.fullmatch(r"\[length: prompt 10 tokens, \d+\.\d\d s; generated 4 tokens, \d+\.\d\d s\]", lines[-1])


def test_generate_command_shows_reasoning_only_when_asked(demo):
    reasoning, answer = _expected(demo, 24, thinking=True)
    assert reasoning.strip() and not answer  # the demo model never ends its reasoning this soon
    out, err = _generate_cli("-n", "24")
    assert out == "" and reasoning not in err
    assert "no answer yet: all 24 tokens went to reasoning" in err
    assert re.fullmatch(r"\[length: prompt 10 tokens, .*; generated 24 tokens, .* t/s\]", err.splitlines()[-1])
    out, err = _generate_cli("-n", "24", "--show-reasoning")
    assert out == "" and reasoning in err
    assert err.splitlines()[-1].startswith("[length: prompt 10 tokens")  # not glued to the reasoning


def test_answer_stops_on_random_marker_soup():
    """What is let through never holds a stop string in its content; a stop is reported exactly where one
    begins in the content; text cut anywhere gives the same result."""
    import random

    from ds4_mlx.chat import ContentDelta, OutputParser
    from ds4_mlx.generate import StopStringWatcher

    def content(text, thinking, tools):
        parser = OutputParser(thinking=thinking, tools=tools)
        return "".join(e.text for e in parser.feed(text) + parser.finish() if isinstance(e, ContentDelta))

    rng = random.Random(4)
    pieces = ["<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", '<｜DSML｜invoke name="f">', "</｜DSML｜invoke>",
              "</think>", "\n\n", "\n", " ", "ab", "x", "S", "TOP"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 25)))
        thinking, tools = rng.random() < 0.5, rng.random() < 0.5
        stops = AnswerStops(rng.choice([["\n\n"], ["STOP"], ["x\n", "b "]]), thinking=thinking, tools=tools)
        results = set()
        for _ in range(3):
            watcher, released, start = StopStringWatcher(stops), "", 0
            for cut in sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1))) + [len(text)]:
                released += watcher.add(text[start:cut])
                start = cut
                if watcher.stop_at is not None:
                    break
            released += watcher.flush()
            results.add((released, watcher.stop_at))
            assert text.startswith(released)
            assert not any(s in content(released, thinking, tools) for s in stops)
            if watcher.stop_at is None:
                assert released == text
            else:
                assert released == text[:watcher.stop_at] and any(text.startswith(s, watcher.stop_at) for s in stops)
        assert len(results) == 1, (text, results)
