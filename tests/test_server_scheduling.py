"""Fair scheduling and slot choice on the demo model: a running stream keeps getting tokens while another
request prefills (counted in the worker's own order of steps, not timed); a short prompt the slot already
holds is a hit; a prompt sharing a long prefix with another conversation starts from a snapshot of it."""

import logging
import threading

from openai import OpenAI

from ds4_mlx.chat import render
from ds4_mlx.generate import stream_generate
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.server.slots import MIN_SHARE
from ds4_mlx.tools.testing import answer_text, cold_answer, demo_server, request_lines, served

MODEL = "deepseek-v4-flash"


def test_a_stream_gets_tokens_between_the_chunks_of_another_prefill():
    steps = []  # (prompt length, "prefill" or "token"), in the worker's order

    def recording(session, tokenizer, prompt_ids, **kwargs):
        for chunk in stream_generate(session, tokenizer, prompt_ids, yield_prefill=True, **kwargs):
            steps.append((len(prompt_ids), "prefill" if chunk.prefill else "token"))
            yield chunk

    long_prompt = [{"role": "user", "content": " ".join(f"w{i}" for i in range(600))}]
    with served(ctx=8192, sessions=2, generate=recording) as (bg, client):
        tokenizer = bg.server.worker.tokenizer
        long_len = len(tokenizer.encode(render(long_prompt)))
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                temperature=0, max_tokens=400, stream=True)
        chunks = iter(stream)
        next(chunks)
        next(chunks)  # the stream is running
        other = threading.Thread(target=lambda: client.chat.completions.create(
            model=MODEL, messages=long_prompt, temperature=0, max_tokens=1))
        other.start()
        other.join()
        stream.close()
    short_len = next(n for n, _ in steps if n != long_len)
    first = steps.index((long_len, "prefill"))
    last = len(steps) - 1 - steps[::-1].index((long_len, "prefill"))
    during = steps[first:last + 1]
    prefill_chunks = during.count((long_len, "prefill"))
    assert prefill_chunks >= long_len // 256  # the long prompt was computed chunk by chunk
    # between any two of its chunks the stream got a token: its gap is one chunk, not the prefill
    assert during.count((short_len, "token")) >= prefill_chunks - 1
    assert all(during[i] != during[i + 1] for i in range(len(during) - 1) if during[i][1] == "prefill")


def test_a_short_prompt_the_slot_holds_is_a_hit(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    request = dict(model=MODEL, messages=[{"role": "user", "content": "short question"}], temperature=0)
    with served(ctx=8192, sessions=2) as (bg, client):
        first_answer = answer_text(client.chat.completions.create(**request, max_tokens=40))
        again = answer_text(client.chat.completions.create(**request, max_tokens=5))
        first, second = request_lines(caplog)
    assert int(second["prompt"]) < MIN_SHARE and int(second["live"]) > int(second["prompt"])
    assert second["slot"] == first["slot"] and second["miss"] == "-"
    assert int(second["reused"]) == int(second["prompt"]) - 1 and second["computed"] == "1"
    assert first_answer.startswith(again)  # greedy: the same answer, cut shorter


def test_a_long_shared_prefix_is_forked_into_a_free_slot_and_is_exact(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    system = {"role": "system", "content": "Rules: " + " ".join(f"rule{i}" for i in range(150))}
    long_turn = [system, {"role": "user", "content": " ".join(f"fact{i}" for i in range(250))}]
    side = [system, {"role": "user", "content": "a side question"}]
    with served(ctx=8192, sessions=2) as (bg, client):
        tokenizer = bg.server.worker.tokenizer
        client.chat.completions.create(model=MODEL, messages=long_turn, temperature=0, max_tokens=4)
        conversation = list(bg.server.worker.slots[0].tokens)
        side_answer = answer_text(client.chat.completions.create(model=MODEL, messages=side, temperature=0,
                                                                 max_tokens=8))
        assert bg.server.worker.slots[0].tokens == conversation  # the long conversation is kept
        client.chat.completions.create(model=MODEL, messages=long_turn, temperature=0, max_tokens=4)
        first, forked, back = request_lines(caplog)
        lane_every = bg.server.worker.slots[1].session.lane_every
    side_ids = tokenizer.encode(render(side))
    shared = next(i for i, (a, b) in enumerate(zip(conversation, side_ids)) if a != b)
    assert shared >= MIN_SHARE and len(conversation) - shared > shared  # continuing slot 0 would lose more
    assert forked["slot"] == "1" and forked["miss"] == f"fork(from=0,share={shared},live=0)"
    assert "partial hit: slot 1 starts from a snapshot of slot 0's conversation" in forked["line"]
    # the snapshot holds the whole conversation; going back that far restores the compressor lane at or
    # before `shared` and replays the rest of the share (the session's rewind policy), computing only the tail
    assert int(forked["reused"]) + int(forked["replayed"]) == shared
    assert int(forked["computed"]) == len(side_ids) - shared
    assert int(forked["replayed"]) < lane_every
    assert back["slot"] == "0" and back["miss"] == "-"
    assert side_answer == cold_answer(model=MODEL, messages=side, temperature=0, max_tokens=8)


def test_a_prompt_alone_is_computed_in_long_chunks():
    steps = []

    def recording(session, tokenizer, prompt_ids, **kwargs):
        for chunk in stream_generate(session, tokenizer, prompt_ids, yield_prefill=True, **kwargs):
            steps.append(len(session.tokens) if chunk.prefill else None)
            yield chunk

    long_prompt = [{"role": "user", "content": " ".join(f"w{i}" for i in range(600))}]
    server = demo_server(ctx=8192, generate=recording, prefill_chunk=512)
    with BackgroundServer(server) as bg:
        client = OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=long_prompt, temperature=0, max_tokens=1)
        long_len = len(bg.server.worker.tokenizer.encode(render(long_prompt)))
    computed = [n for n in steps if n is not None]
    assert long_len > 1024 and computed == list(range(512, long_len, 512)) + [long_len]
