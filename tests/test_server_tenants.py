"""Tenants of one server learn nothing of each other: a slot taken over from another tenant starts empty
(the PIN probe), answers are remembered for their own tenant only, and /metrics, which sums over every
tenant, is the operator's. And two edges that must stay quiet: a client gone before the response
headers, and a disk store folder the server cannot write."""

import logging
import os
import signal
import socket
import struct
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from ds4_mlx.server import openai_api
from ds4_mlx.server.assembly import AnswerMemory
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.server.middleware import Access
from ds4_mlx.server.slots import Slot, place
from ds4_mlx.tools.testing import demo_server, request_lines, serve_process

CTX = 4096
SECRET = "4081"
RULES = "You are the bank's assistant. " + " ".join(f"rule{i}" for i in range(300))


class Tenant:
    """A client of the server: its API key and its `cache_salt`, if any."""

    def __init__(self, key: str, salt: str | None = None):
        self.headers = {"Authorization": f"Bearer {key}"}
        self.salt = {"cache_salt": salt} if salt else {}

    def chat(self, bg, messages, **extra) -> dict:
        body = {"model": "deepseek-chat", "messages": messages, "max_tokens": 1, "temperature": 0,
                **self.salt, **extra}
        r = requests.post(bg.url + "/v1/chat/completions", json=body, headers=self.headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def sessions(self, bg) -> dict:
        return requests.get(bg.url + "/v1/sessions", params=self.salt, headers=self.headers, timeout=60).json()


def conversation(pin: str) -> list:
    return [{"role": "system", "content": f"{RULES} My PIN is {pin}."}, {"role": "user", "content": "Check it."}]


TENANT_PAIRS = {  # (server keys, victim, prober)
    "two keys": (("key-A", "key-B"), Tenant("key-A"), Tenant("key-B")),
    "one key, two salts": (("key",), Tenant("key", "victim"), Tenant("key", "prober")),
}


# ---------------------------------------------------------------- a slot taken over from another tenant


@pytest.mark.parametrize("pair", TENANT_PAIRS)
def test_a_probe_learns_nothing_of_another_tenant_s_prompt(pair, caplog):
    """One slot, the victim's prompt in it before every probe: whatever the prober guesses, every figure it
    is shown (cached tokens, and reused, replayed, computed and live tokens in /v1/sessions) is the same."""
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    keys, victim, prober = TENANT_PAIRS[pair]
    with BackgroundServer(demo_server(ctx=CTX, sessions=1, access=Access(api_keys=keys))) as bg:
        seen = {True: set(), False: set()}
        guesses = ["4082", SECRET, "1234", SECRET]
        for guess in guesses:
            victim.chat(bg, conversation(SECRET))
            usage = prober.chat(bg, conversation(guess))["usage"]
            last = prober.sessions(bg)["requests"][-1]
            seen[guess == SECRET].add((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                                       *(last[k] for k in ("reused_tokens", "replayed_tokens", "computed_tokens",
                                                           "live_tokens", "miss"))))
        assert seen[True] == seen[False] and len(seen[True]) == 1, seen
        prompt_tokens, cached, reused, replayed, computed, live, miss = seen[True].pop()
        assert (cached, reused, replayed, computed, live) == (0, 0, 0, prompt_tokens, 0)
    # the log says what happened: the other tenant's tokens were dropped whole, nothing reused
    takeovers = [line for line in request_lines(caplog) if "another tenant's conversation" in line["line"]]
    assert len(takeovers) == 2 * len(guesses) - 1  # each probe, and each of the victim's resends after the first
    assert all(line["reused"] == "0" and ": 0 reused" in line["line"] for line in takeovers)


def test_sessions_show_nothing_of_the_slot_s_previous_tenant():
    """Once the prober's request has started in the slot the victim used, /v1/sessions shows the prober none
    of the victim's figures, whether that request still runs or has ended (its first event can come while
    the worker finishes it: the check holds in both states)."""
    victim, prober = Tenant("key-A"), Tenant("key-B")
    with BackgroundServer(demo_server(ctx=CTX, sessions=1, access=Access(api_keys=("key-A", "key-B")))) as bg:
        victim_tokens = victim.chat(bg, conversation(SECRET))["usage"]["prompt_tokens"]
        # one ordinary token pushed far above the rest: the answer runs its max_tokens, never stopping early
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000,
                "temperature": 0, "stream": True, "logit_bias": {"1000": 100}}
        with requests.post(bg.url + "/v1/chat/completions", json=body, headers=prober.headers, stream=True,
                           timeout=120) as stream:
            assert stream.status_code == 200, stream.text
            next(line for line in stream.iter_lines() if line.startswith(b"data:"))  # the request has started
            slot = prober.sessions(bg)["slots"][0]
    # running or ended, the slot shows the prober its own request alone: no count of the victim's
    assert slot["tokens"] < victim_tokens, slot
    assert slot["last_request"] is None or slot["last_request"]["prompt_tokens"] < victim_tokens, slot


def test_the_policy_marks_a_takeover_of_another_tenant_s_slot():
    class Held:
        def __init__(self, tokens):
            self.tokens = list(tokens)

    prompt = list(range(1000))
    mine, theirs = Slot(0, Held(prompt[:600]), busy=True, namespace="me"), Slot(1, Held(prompt[:900]), namespace="them")
    fork = place([mine, theirs], prompt, "me")  # a fork from my busy slot into theirs: nothing of theirs kept
    assert (fork.slot, fork.source, fork.common, fork.foreign) == (theirs, mine, 600, True)
    mine.busy = False
    mine.session.tokens = [-1] * 10
    assert place([mine, theirs], prompt, "me").foreign is False  # my own slot goes first
    alone = place([theirs], prompt, "me")
    assert (alone.common, alone.foreign, alone.miss) == (0, True, "other-tenant(live=900)")


# ---------------------------------------------------------------- the answer memory


def test_an_answer_is_remembered_for_its_own_tenant_only():
    """A tenant that sends back an answer the server gave to another tenant gets it tokenized as text, as
    a fresh server would: its prompt and its output do not depend on the other's history."""
    owner, other = Tenant("key-A"), Tenant("key-B")
    question = [{"role": "user", "content": "Name three colours."}]
    with BackgroundServer(demo_server(ctx=CTX, sessions=2, access=Access(api_keys=("key-A", "key-B")))) as bg:
        answer = owner.chat(bg, question, max_tokens=12)["choices"][0]["message"]["content"]
        follow_up = question + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        body = {"model": "deepseek-chat", "messages": follow_up}
        as_text = len(bg.server.worker.tokenizer.encode(
            openai_api.parse_chat(body, bg.server.info, AnswerMemory()).prompt_text))
        owns = owner.chat(bg, follow_up)["usage"]["prompt_tokens"]
        assert owns != as_text  # the answer's sampled tokens are not its text re-tokenized: the memory shows
        assert other.chat(bg, follow_up)["usage"]["prompt_tokens"] == as_text
        counted = requests.post(bg.url + "/v1/messages/count_tokens", headers=other.headers, timeout=60,
                                json={"model": "deepseek-chat", "messages": follow_up}).json()
        assert counted["input_tokens"] == as_text
        salted = Tenant("key-A", "another-namespace")  # the same key under another cache_salt is another tenant
        assert salted.chat(bg, follow_up)["usage"]["prompt_tokens"] == as_text


# ---------------------------------------------------------------- /metrics


def test_metrics_answer_the_metrics_key_only_once_tenants_have_keys():
    def metrics(bg, key=None):
        return requests.get(bg.url + "/metrics", headers={"x-api-key": key} if key else {}, timeout=60)

    with BackgroundServer(demo_server(ctx=CTX, access=Access(api_keys=("key-A", "key-B")))) as bg:
        for key in ("key-A", "key-B", None):  # without --metrics-key, /metrics is off
            refused = metrics(bg, key)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "metrics_key_required"
    access = Access(api_keys=("key-A",), metrics_key="key-M")
    with BackgroundServer(demo_server(ctx=CTX, access=access)) as bg:
        assert metrics(bg, "key-A").status_code == 403
        assert metrics(bg, None).status_code == 401
        scraped = metrics(bg, "key-M")
        assert scraped.status_code == 200 and "ds4_mlx_ready" in scraped.text
        # the metrics key is no tenant key
        assert requests.get(bg.url + "/v1/models", headers={"x-api-key": "key-M"}, timeout=60).status_code == 401
        assert requests.get(bg.url + "/v1/models", headers={"x-api-key": "key-A"}, timeout=60).status_code == 200


# ---------------------------------------------------------------- a client gone before the headers


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_stream_whose_client_left_before_the_headers_is_quiet_and_counted_as_dropped(caplog):
    caplog.set_level(logging.INFO)
    server = demo_server(ctx=CTX)
    tokenize = server._tokenize

    async def slow_tokenize(text):  # the client's reset arrives meanwhile
        import asyncio

        await asyncio.sleep(0.5)
        return await tokenize(text)

    server._tokenize = slow_tokenize
    body = (b'{"model": "deepseek-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, '
            b'"stream": true}')
    with BackgroundServer(server) as bg:
        with socket.create_connection(("127.0.0.1", bg.port)) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                           b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            counted = _samples(requests.get(bg.url + "/metrics", timeout=60).text)
            if any(name == "ds4_mlx_requests_total" for name, _ in counted):
                break
            time.sleep(0.1)
    requests_seen = {labels: v for (name, labels), v in counted.items() if name == "ds4_mlx_requests_total"}
    assert requests_seen == {(("endpoint", "chat"), ("finish_reason", "dropped")): 1.0}
    statuses = {dict(labels)["status"]: v for (name, labels), v in counted.items()
                if name == "ds4_mlx_http_requests_total" and dict(labels)["route"] == "/v1/chat/completions"}
    assert statuses == {"499": 1.0}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# ---------------------------------------------------------------- a disk store folder the server cannot write


def unwritable_folder(tmp_path):
    """A folder whose lock file cannot be opened for writing, as on a read-only file system: here `.lock` is
    a folder, which no user, root included, can open as a file."""
    folder = tmp_path / "kv"
    (folder / ".lock").mkdir(parents=True)
    return folder


def test_an_unwritable_disk_store_folder_leaves_the_server_serving_without_it(tmp_path):
    process, url = serve_process("--ctx", "2048", "--sessions", "1", "--kv-disk-dir", str(unwritable_folder(tmp_path)))
    try:
        r = requests.post(url + "/v1/chat/completions", timeout=120,
                          json={"model": "deepseek-chat", "messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output
    warnings = [line for line in output.splitlines() if "kv disk" in line]
    assert len(warnings) == 1 and "cannot use" in warnings[0] and "without the disk store" in warnings[0], output


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_disk_store_folder_is_skipped_with_one_warning(tmp_path, caplog):
    import argparse

    from ds4_mlx.cache import add_disk_arguments, disk_store_from_args

    folder = tmp_path / "kv"
    folder.mkdir()
    folder.chmod(0o500)
    parser = argparse.ArgumentParser()
    add_disk_arguments(parser)
    try:
        assert disk_store_from_args(parser.parse_args(["--kv-disk-dir", str(folder)])) is None
    finally:
        folder.chmod(0o700)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("kv disk: cannot use"), warnings
