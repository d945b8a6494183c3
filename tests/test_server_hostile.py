"""The server facing clients that do not play along: bodies too large for the context, work that would
hold up the event loop, browsers it did not invite, tenants sharing its caches, and its own faults."""

import asyncio
import json
import logging
import re
import socket
import threading
import time

import pytest
import requests

from ds4_mlx.server import openai_api
from ds4_mlx.demo import load_for_cli
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.server.middleware import Access
from ds4_mlx.server.slots import Slot, place
from ds4_mlx.server.worker import GenerationRequest, Job
from ds4_mlx.tools.testing import demo_server

MODEL = "deepseek-v4-flash"
CTX = 4096
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def bg():
    server = demo_server(ctx=CTX, sessions=2)
    with BackgroundServer(server) as bg:
        yield bg


def chat(bg, body=None, **kwargs):
    return requests.post(bg.url + "/v1/chat/completions", timeout=60,
                         **({"json": body} if body is not None else {}), **kwargs)


# ---------------------------------------------------------------- bounded work before admission


def test_a_body_over_the_limit_is_refused_before_it_is_read(bg):
    limit = bg.server.max_body_bytes
    assert limit == 4 * 2**20  # the default for a small context
    r = chat(bg, data=b"{" + b" " * limit + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    anthropic = requests.post(bg.url + "/v1/messages", data=b" " * (limit + 1), timeout=60,
                              headers={"Content-Type": "application/json"})
    assert anthropic.status_code == 413 and anthropic.json()["error"]["type"] == "request_too_large"


def test_a_prompt_surely_over_the_context_is_refused_before_tokenizing(bg, monkeypatch):
    calls = []
    tokenizer = bg.server.worker.tokenizer
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(len(text)) or [])
    too_long = "x" * ((CTX + 1) * bg.server.worker.longest_token_bytes)
    r = chat(bg, {"model": MODEL, "messages": [{"role": "user", "content": too_long}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "at least" in r.json()["error"]["message"] and calls == []


def test_parsing_runs_off_the_event_loop(bg, monkeypatch):
    """While one request's body is parsed and rendered, /health answers: the parse waits for it."""
    health_answered = threading.Event()
    parse_chat = openai_api.parse_chat

    def slow_parse(*args, **kwargs):
        # on the loop, /health could not answer before this wait gives up
        result["health first"] = health_answered.wait(10)
        return parse_chat(*args, **kwargs)

    result = {}
    monkeypatch.setattr(openai_api, "parse_chat", slow_parse)
    request = threading.Thread(target=lambda: result.update(r=chat(bg, {"model": MODEL, "messages": HELLO,
                                                                        "max_tokens": 1})))
    request.start()
    assert requests.get(bg.url + "/health", timeout=60).status_code == 200
    health_answered.set()
    request.join()
    assert result["r"].status_code == 200 and result["health first"]


def small_server(**limits) -> BackgroundServer:
    return BackgroundServer(demo_server(ctx=CTX, sessions=1,
                                         budget_bytes=2**32, **limits))


def test_a_connection_that_sends_no_request_head_is_closed():
    with small_server(idle_timeout_s=0.5) as bg, socket.create_connection(("127.0.0.1", bg.port)) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        slow.settimeout(60)  # a hang guard
        assert slow.recv(1024) == b""  # closed by the server
        assert requests.get(bg.url + "/health", timeout=60).status_code == 200


def test_connections_beyond_the_cap_get_a_503_and_one_log_line(caplog):
    def open_connection():
        sock = socket.create_connection(("127.0.0.1", bg.port))
        sock.settimeout(60)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return sock, sock.recv(65536)

    with small_server(max_connections=3) as bg:
        held = [open_connection() for _ in range(3)]  # answered, and kept open
        assert all(answer.startswith(b"HTTP/1.1 200") for _, answer in held)
        refused = [open_connection() for _ in range(20)]
        assert all(answer.startswith(b"HTTP/1.1 503") for _, answer in refused)
        for sock, _ in held + refused:
            sock.close()
        for _ in range(1000):  # the server notices the closed connections soon; nothing is timed here
            try:
                if requests.get(bg.url + "/health", timeout=60).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
        else:
            raise AssertionError("connections are still refused after all were closed")
    lines = [r.getMessage() for r in caplog.records if "connections" in r.getMessage()]
    assert len(lines) == 2 and "refusing new ones" in lines[0], lines
    assert int(re.search(r"(\d+) refused", lines[1])[1]) >= 20, lines  # and the retries before the server noticed


# ---------------------------------------------------------------- browsers and hosts


@pytest.mark.parametrize("host, origin, status", [
    ("127.0.0.1:8000", None, 200),
    ("localhost:8000", "http://localhost:8000", 200),  # the server's own page
    ("[::1]:8000", None, 200),
    ("192.168.1.20:8000", None, 200),  # an address: nothing to rebind
    ("app.localhost", None, 200),
    ("evil.example:8000", None, 403),  # DNS rebinding: the attacker's name, this machine's address
    ("evil.example", "http://evil.example", 403),
    ("127.0.0.1:8000", "https://evil.example", 403),  # another page posting with no preflight
    ("127.0.0.1:8000", "http://127.0.0.1:9999", 403),  # another port is another origin
    ("127.0.0.1:8000", "null", 403),
    ("models.lan", None, 200),  # --allowed-host
])
def test_origin_and_host_matrix(bg_hosts, host, origin, status):
    headers = {"Host": host, **({"Origin": origin} if origin else {})}
    r = requests.post(bg_hosts.url + "/v1/chat/completions", timeout=60, headers=headers,
                      json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["code"] in ("host_not_allowed", "origin_not_allowed")


@pytest.fixture(scope="module")
def bg_hosts():
    server = demo_server(ctx=CTX, sessions=1,
                          access=Access(allowed_hosts=("models.lan",)))
    with BackgroundServer(server) as bg:
        yield bg


def test_json_apis_refuse_bodies_a_browser_sends_without_a_preflight(bg):
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 1})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = chat(bg, data=body, headers={"Content-Type": content_type})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    anthropic = requests.post(bg.url + "/v1/messages", data=body, headers={"Content-Type": "text/plain"}, timeout=60)
    assert anthropic.status_code == 415 and anthropic.json()["type"] == "error"
    assert chat(bg, data=body, headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200
    assert chat(bg, data=body.encode()).status_code == 200  # no Content-Type at all: not a browser


def test_a_key_that_is_not_utf8_is_a_401():
    server = demo_server(ctx=CTX, sessions=1,
                          access=Access(api_keys=("secret",)))
    with BackgroundServer(server) as bg, socket.create_connection(("127.0.0.1", bg.port)) as sock:
        for path, shape in [("/v1/models", "error"), ("/v1/messages", "type")]:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: ".encode() + b"\xff\xfe\xc3\r\n\r\n")
            head, _, rest = sock.recv(65536).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 401"), head
            assert shape in json.loads(rest[:int(re.search(rb"Content-Length: (\d+)", head)[1])])


# ---------------------------------------------------------------- the worker survives its faults


class FailingDisk:
    """A disk store whose every method raises, as a buggy or full store would; `load_longer_prefix` may instead
    wait for `release` (a slow disk)."""
    min_tokens = 0

    def __init__(self):
        self.entered, self.release, self.fail = threading.Event(), threading.Event(), True

    def load_longer_prefix(self, session, prompt, shared, namespace):
        self.entered.set()
        if self.fail:
            raise OSError(28, "No space left on device")
        self.release.wait(30)  # a hang guard
        return shared

    def save(self, session, reason, namespace):
        if self.fail:
            raise OSError(28, "No space left on device")

    def during_prefill(self, session, namespace):
        if self.fail:
            raise OSError(28, "No space left on device")


def test_a_failing_disk_fails_that_request_alone_in_the_api_shape():
    disk = FailingDisk()
    server = demo_server(ctx=CTX, sessions=1,
                          disk=disk)
    with BackgroundServer(server) as bg:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
        failed = chat(bg, body)
        assert failed.status_code == 500 and "No space left" in failed.json()["error"]["message"], failed.text
        claude = requests.post(bg.url + "/v1/messages", json=body, timeout=60)
        assert claude.status_code == 500 and claude.json()["error"]["type"] == "api_error"
        assert not any(slot.busy for slot in bg.server.worker.slots)  # the slot is free again
        assert requests.get(bg.url + "/health", timeout=60).json()["status"] == "ok"
        disk.fail = disk.release.set() or False  # the disk recovers: the next request is served
        assert chat(bg, body).status_code == 200


def test_disk_work_is_not_done_under_the_lock_submit_takes(caplog):
    disk = FailingDisk()
    disk.fail = False
    server = demo_server(ctx=CTX, sessions=1,
                          disk=disk)
    with BackgroundServer(server) as bg:
        slow = threading.Thread(target=chat, args=(bg, {"model": MODEL, "messages": HELLO, "max_tokens": 1}))
        slow.start()
        assert disk.entered.wait(60)  # the first request's load_longer_prefix is running (and waits)
        probe = Job(GenerationRequest([1], 1), bg._loop)
        probe.cancel()  # dropped from the queue at once, once admitted
        submitting = threading.Thread(target=bg.server.worker.submit, args=(probe,))
        submitting.start()
        submitting.join(10)  # a hang guard: under the lock, submit() would wait for the restore
        submitted = not submitting.is_alive()
        disk.release.set()
        slow.join()
        assert submitted


def dying_server(monkeypatch):
    server = demo_server(ctx=CTX, sessions=1)
    monkeypatch.setattr(server.worker, "_admissible", lambda: 1 / 0)  # a bug in the worker's own loop
    return server


def test_a_dead_worker_fails_requests_and_health_says_so(monkeypatch):
    with BackgroundServer(dying_server(monkeypatch)) as bg:
        assert requests.get(bg.url + "/health", timeout=60).json()["status"] == "ok"
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
        for _ in range(2):  # the request that met the fault, then one refused at once
            r = chat(bg, body)
            assert r.status_code == 500 and "worker failed" in r.json()["error"]["message"], r.text
        health = requests.get(bg.url + "/health", timeout=60)
        assert health.status_code == 503 and health.json()["error"] == "the worker thread died"


def test_a_stuck_worker_is_a_503_on_health(bg, monkeypatch):
    worker = bg.server.worker  # idle: nothing resets the mark of its running turn while the test holds it
    monkeypatch.setattr(worker, "turn_started", time.monotonic() - worker.stuck_after_s - 1)
    health = requests.get(bg.url + "/health", timeout=60)
    assert health.status_code == 503 and "one turn of the worker has run for over" in health.json()["error"]
    monkeypatch.undo()
    assert requests.get(bg.url + "/health", timeout=60).status_code == 200


def test_a_dead_worker_ends_serve_with_status_1(monkeypatch):
    from ds4_mlx.server.cli import listen, serve

    server = dying_server(monkeypatch)
    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    seen = {}

    def client():
        for _ in range(600):  # until the model is loaded; nothing is timed
            try:
                if requests.get(url + "/health", timeout=60).status_code == 200:
                    break
            except (requests.ConnectionError, requests.ReadTimeout):
                threading.Event().wait(0.1)
        try:  # answered, or cut off as the server exits
            seen["request"] = requests.post(url + "/v1/chat/completions", timeout=60,
                                            json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
        except requests.ConnectionError:
            pass

    thread = threading.Thread(target=client)
    thread.start()
    code = asyncio.run(serve(server, sock, logging.getLogger("test")))
    thread.join()
    assert code == 1
    if "request" in seen:
        assert seen["request"].status_code == 500 and "worker failed" in seen["request"].json()["error"]["message"]


# ---------------------------------------------------------------- tenants


def tenant_slots(*specs, busy=()):
    """Slots from (tokens, namespace) pairs, the later ones used more recently."""
    class Held:
        def __init__(self, tokens):
            self.tokens = list(tokens)
    return [Slot(i, Held(t), busy=i in busy, last_used=i, namespace=ns) for i, (t, ns) in enumerate(specs)]


def test_policy_shares_nothing_with_another_namespace_and_takes_its_slot_last():
    prompt = list(range(1000))
    theirs = (prompt[:900], "victim")
    # the other tenant's slot holds 900 tokens of this prompt: no reuse, no fork, an empty slot instead
    placed = place(tenant_slots(theirs, ([], "")), prompt, "attacker")
    assert (placed.slot.index, placed.common, placed.source) == (1, 0, None)
    # no empty slot: the attacker's own older conversation goes before the victim's newer one...
    placed = place(tenant_slots(([-1] * 10, "attacker"), theirs), prompt, "attacker")
    assert placed.slot.index == 0 and placed.common == 0
    # ... and the victim's own request reuses its slot
    assert place(tenant_slots(([-1] * 10, "attacker"), theirs), prompt, "victim").common == 900
    # the victim's slot is taken (whole, never trimmed to a shared prefix) only when it is the only one left
    placed = place(tenant_slots(theirs), prompt, "attacker")
    assert placed.slot.index == 0 and placed.common == 0 and placed.source is None


SYSTEM = "You are the bank's assistant. " + " ".join(f"rule{i}" for i in range(300))


def conversation(pin: str) -> list:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"My PIN is {pin}. Check it."}]


def usage_of(bg, messages, headers, **extra):
    r = chat(bg, {"model": "deepseek-chat", "messages": messages, "max_tokens": 1, "temperature": 0, **extra},
             headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.mark.parametrize("by", ["cache_salt", "api_key"])
def test_a_tenant_reuses_and_learns_about_only_its_own_prefixes(by):
    tenants = ("victim", "attacker", "other")
    access = Access(api_keys=tuple(f"key-{t}" for t in tenants)) if by == "api_key" else Access()
    server = demo_server(ctx=CTX, sessions=3,
                          access=access)

    def headers(tenant):
        return {"Authorization": f"Bearer key-{tenant}"} if by == "api_key" else {}

    def salt(tenant):
        return {} if by == "api_key" else {"cache_salt": tenant}

    with BackgroundServer(server) as bg:
        victim = usage_of(bg, conversation("4081"), headers=headers("victim"), **salt("victim"))
        # the attacker shares the system prompt and guesses the PIN right: nothing is reused, nothing learned
        probe = usage_of(bg, conversation("4081"), headers=headers("attacker"), **salt("attacker"))
        assert probe["prompt_tokens"] == victim["prompt_tokens"]
        assert probe["prompt_tokens_details"]["cached_tokens"] == 0
        # nor through Anthropic's usage
        body = {"model": "deepseek-chat", "max_tokens": 1, "system": SYSTEM,
                "messages": [{"role": "user", "content": "My PIN is 4081. Check it."}], **salt("other")}
        claude = requests.post(bg.url + "/v1/messages", json=body, headers=headers("other"), timeout=60)
        assert claude.json()["usage"]["cache_read_input_tokens"] == 0, claude.text
        # the victim's slot was neither taken over nor trimmed: its resend is a whole hit
        again = usage_of(bg, conversation("4081"), headers=headers("victim"), **salt("victim"))
        assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1  # all but the last
        # /v1/sessions shows each tenant its own requests and slots only; /health shows counts only
        seen = requests.get(bg.url + "/v1/sessions", params=salt("attacker"), headers=headers("attacker"),
                            timeout=60).json()
        assert [r["prompt_tokens"] for r in seen["requests"]] == [probe["prompt_tokens"]]
        assert sum(s["tokens"] is None and s["last_request"] is None for s in seen["slots"]) == 2
        assert all(set(s) == {"slot", "busy"} for s in requests.get(bg.url + "/health", timeout=60).json()["slots"])


def test_the_disk_store_finds_only_the_namespace_s_own_prefixes(tmp_path):
    from ds4_mlx.cache.store import DiskStore
    from ds4_mlx.session import Session

    model, tokenizer = load_for_cli(None)[:2]
    tokens = tokenizer.encode(SYSTEM)[:300]
    session = Session(model, rewind_slack=64, checkpoint_every=64, max_chunk=64)
    session.sync(tokens)
    store = DiskStore(tmp_path, 64, min_tokens=64)
    assert store.save(session, "evict", "victim") is not None
    assert store.find(model, tokens + [1], "attacker") is None and store.find(model, tokens + [1]) is None
    assert store.find(model, tokens + [1], "victim")[1] == 300
    reopened = DiskStore(tmp_path, 64, min_tokens=64)  # the namespace survives an index rebuilt from the files
    (tmp_path / "index.json").unlink()
    rebuilt = DiskStore(tmp_path, 64, min_tokens=64)
    for store in (reopened, rebuilt):
        assert store.find(model, tokens + [1], "attacker") is None and store.find(model, tokens + [1], "victim")
