"""Live sessions behind the server, end to end on the demo model (real Session and generate): the abort
and resend scenario, slots for alternating clients, miss reasons, an abort during the prefill."""

import contextlib
import logging
import threading
import time

import requests

from ds4_mlx.chat import render
from ds4_mlx.server.slots import MIN_SHARE, Slot, place
from ds4_mlx.tools.testing import long_conversation, request_lines, served

MODEL = "deepseek-v4-flash"


def streamed_text(stream) -> str:
    text = ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            text += (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
    return text


def test_abort_then_resend_computes_almost_nothing_and_matches_a_cold_server(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    messages = long_conversation()
    request = dict(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    with served(ctx=8192, sessions=2) as (bg, client):
        prompt_ids = bg.server.worker.tokenizer.encode(render(messages))
        assert len(prompt_ids) >= 2000
        stream = client.chat.completions.create(**{**request, "max_tokens": 200}, stream=True)
        received = 0
        for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or getattr(chunk.choices[0].delta, "reasoning_content", None)):
                received += 1
                if received == 37:
                    break
        stream.close()  # the client aborts
        deadline = time.time() + 30
        while len(request_lines(caplog)) < 1 and time.time() < deadline:
            time.sleep(0.05)
        aborted = request_lines(caplog)[0]
        assert aborted["finish"] == "abort" and int(aborted["gen"]) < 45  # decode stopped at once

        resend = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
        chunks = list(resend)
        warm_text = streamed_text(chunks)
        usage = chunks[-1].usage
        line = request_lines(caplog)[-1]
    assert int(line["prompt"]) == len(prompt_ids) and int(line["live"]) > len(prompt_ids)
    assert int(line["computed"]) + int(line["replayed"]) <= 128
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.prompt_tokens_details.cached_tokens >= len(prompt_ids) - 128
    assert line["miss"] == "-"

    with served(ctx=8192, sessions=2) as (_, cold_client):
        cold_text = streamed_text(cold_client.chat.completions.create(**request, stream=True))
    assert warm_text == cold_text and warm_text


def test_two_alternating_clients_keep_their_slots(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    conversations = {name: [{"role": "system", "content": f"You are assistant {name}. " + " ".join(
        f"{name}{i}" for i in range(150))}] for name in ("alpha", "beta")}
    previous_prompt, slot_of = {}, {}
    with served(ctx=8192, sessions=2) as (bg, client):
        tokenizer = bg.server.worker.tokenizer
        for turn in range(10):
            for name, messages in conversations.items():
                messages.append({"role": "user", "content": f"{name} question {turn}"})
                prompt_len = len(tokenizer.encode(render(messages, thinking=False)))
                answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                        temperature=0, extra_body={"thinking": False})
                messages.append({"role": "assistant", "content": answer.choices[0].message.content})
                line = request_lines(caplog)[-1]
                if turn == 0:
                    slot_of[name] = line["slot"]
                else:  # nothing of the previous turn's prompt is computed again
                    assert int(line["reused"]) >= previous_prompt[name], line
                    assert line["slot"] == slot_of[name]
                previous_prompt[name] = prompt_len
    assert slot_of["alpha"] != slot_of["beta"]


def test_one_slot_logs_why_each_miss_happened(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    with served(ctx=8192) as (_, client):
        for turn in range(2):
            for name in ("alpha", "beta"):
                client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
                    {"role": "system", "content": f"Assistant {name}."}, {"role": "user", "content": f"q{turn}"}])
    misses = [line["miss"] for line in request_lines(caplog)]
    assert misses[0] == "empty-slot"
    assert all(m.startswith("other-conversation(share=") for m in misses[1:]), misses


def test_abort_during_prefill_keeps_a_prefix_and_the_resend_computes_the_rest(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    messages = long_conversation()
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 2, "stream": True}
    # chunks of 256 tokens: the client leaves while the prefill has many chunks to go
    with served(ctx=8192, sessions=2, keepalive_s=0.05, prefill_chunk=256) as (bg, client):
        prompt_ids = bg.server.worker.tokenizer.encode(render(messages))
        with requests.post(bg.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
            assert next(response.iter_content(chunk_size=None)).startswith(b": keepalive")
            # a keepalive comes while the job is queued too: leave once it runs (its prefill has started)
            deadline = time.time() + 60
            while not any(s["busy"] for s in requests.get(bg.url + "/v1/sessions", timeout=30).json()["slots"]):
                assert time.time() < deadline
                time.sleep(0.01)
        deadline = time.time() + 30
        while not request_lines(caplog) and time.time() < deadline:
            time.sleep(0.05)
        slot = next(s for s in bg.server.worker.slots if s.tokens)
        kept = list(slot.tokens)
        assert request_lines(caplog)[0]["finish"] == "abort"
        assert 0 < len(kept) < len(prompt_ids) and kept == prompt_ids[:len(kept)]

        client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"})
        line = request_lines(caplog)[-1]
    assert int(line["reused"]) == len(kept)
    assert int(line["computed"]) == len(prompt_ids) - len(kept) and line["replayed"] == "0"


def test_a_queued_request_whose_client_left_is_dropped(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    with served(ctx=8192) as (bg, client):
        running = threading.Thread(target=lambda: client.chat.completions.create(
            model=MODEL, messages=long_conversation(300), max_tokens=30, temperature=0))
        running.start()
        while not any(s.busy for s in bg.server.worker.slots):
            time.sleep(0.01)
        with contextlib.suppress(requests.exceptions.ReadTimeout):  # this client gives up while queued
            requests.post(bg.url + "/v1/chat/completions", timeout=0.5, json={
                "model": MODEL, "messages": [{"role": "user", "content": "queued"}], "max_tokens": 2})
        running.join()
    messages = [r.getMessage() for r in caplog.records if r.name == "ds4_mlx.server"]
    assert any("dropped from the queue" in m for m in messages)
    assert len(request_lines(caplog)) == 1


def test_sessions_beyond_the_byte_budget_are_emptied_least_recently_used_first(caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    with served(ctx=8192, sessions=2, budget_bytes=1) as (bg, client):
        for name in ("alpha", "beta"):
            client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": name}])
        assert [len(s.tokens) > 0 for s in bg.server.worker.slots] == [False, True]
    assert any("slot=0 emptied to stay within the session budget" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the slot policy alone


class FakeSession:
    def __init__(self, tokens):
        self.tokens = list(tokens)


def slots(*token_lists, busy=()):
    return [Slot(i, FakeSession(t), busy=i in busy, last_used=i) for i, t in enumerate(token_lists)]


def test_policy_prefers_the_longest_share_then_an_empty_slot_over_a_short_share():
    prompt = list(range(1000))
    assert place(slots(prompt[:10], prompt[:600], []), prompt).slot.index == 1
    short_share = place(slots(prompt[:10] + [-1] * 50, []), prompt)
    assert short_share.slot.index == 1 and short_share.miss == "empty-slot"
    extends = place(slots(prompt[:10], []), prompt)  # nothing to lose: the prompt extends the slot
    assert extends.slot.index == 0 and extends.miss is None
    resend = place(slots(prompt + [7] * 37), prompt)
    assert resend.common == 1000 and resend.miss is None


def test_policy_forks_from_a_busy_slot_and_replaces_the_least_recently_used():
    prompt = list(range(1000))
    fork = place(slots(prompt[:800], [], busy={0}), prompt)
    assert (fork.slot.index, fork.source.index, fork.common) == (1, 0, 800)
    full = place(slots([-1] * 500, [-2] * 500), prompt)
    assert full.slot.index == 0 and full.miss == "other-conversation(share=0,live=500)"
    assert place(slots([-1] * 500, busy={0}), prompt) is None
    diverged = place(slots(prompt[:700] + [-1] * 10), prompt)
    assert diverged.miss.startswith("diverged(at=700")


def test_policy_keeps_a_long_conversation_from_a_request_sharing_only_its_system_prompt():
    prompt = list(range(1000))
    conversation = prompt[:MIN_SHARE + 50] + [-1] * 5000
    side = place(slots(conversation, []), prompt)  # starts from a snapshot of the conversation
    assert (side.slot.index, side.source.index, side.common) == (1, 0, MIN_SHARE + 50)
    assert side.miss == f"fork(from=0,share={MIN_SHARE + 50},live=0)"
    small_other = place(slots(conversation, [-2] * 400), prompt)  # no empty slot: lose the least
    assert (small_other.slot.index, small_other.source.index) == (1, 0)
