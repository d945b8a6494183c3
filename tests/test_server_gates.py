"""What users of other local servers expect: the API key, CORS, /metrics, /tokenize, and the server
answering while the model loads; then `ds4-mlx serve` itself: its startup lines, a busy port, --ctx."""

import queue
import re
import signal
import socket
import subprocess
import sys
import threading

import anthropic
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from ds4_mlx.demo import load_for_cli
from ds4_mlx.server.build import BackgroundServer, build_server
from ds4_mlx.server.middleware import Access
from ds4_mlx.tools.testing import demo_server, wait_healthy

KEY = "secret-key"
METRICS_KEY = "metrics-key"
ORIGIN = "http://localhost:5173"
HELLO = [{"role": "user", "content": "Hello"}]


# the `bg` fixture's
SERVER_OPTIONS = {"access": Access(api_keys=(KEY,), cors_origins=(ORIGIN,), metrics_key=METRICS_KEY)}


def test_api_key_bearer_and_x_api_key(bg):
    assert requests.get(bg.url + "/health").status_code == 200  # health checks carry no key
    # nor does the web page, which holds no data and asks for the key; no path through its files reaches the API
    assert requests.get(bg.url + "/").status_code == requests.get(bg.url + "/web/app.js").status_code == 200
    assert requests.get(bg.url + "/web/../v1/sessions").status_code in (401, 404)
    no_key = requests.get(bg.url + "/v1/models")
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=bg.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=bg.url, api_key="wrong", max_retries=0).messages.create(
            model="deepseek-chat", max_tokens=2, messages=HELLO)
    # the SDKs send the key as 'Authorization: Bearer' (OpenAI) and 'x-api-key' (Anthropic)
    oai = openai.OpenAI(base_url=bg.url + "/v1", api_key=KEY, max_retries=0)
    assert oai.chat.completions.create(model="deepseek-chat", messages=HELLO, max_tokens=2).usage.completion_tokens == 2
    claude = anthropic.Anthropic(base_url=bg.url, api_key=KEY, max_retries=0)
    assert claude.messages.create(model="deepseek-chat", max_tokens=2, messages=HELLO).usage.output_tokens == 2


def test_cors_preflight_and_headers(bg):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = requests.options(bg.url + "/v1/chat/completions", headers=preflight)  # no key: browsers send none here
    assert r.status_code == 204
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    other = requests.options(bg.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert other.status_code == 403 and "Access-Control-Allow-Origin" not in other.headers
    # the real requests, a stream and an error included, say the origin may read them
    headers = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    body = {"model": "deepseek-chat", "messages": HELLO, "max_tokens": 2, "stream": True}
    stream = requests.post(bg.url + "/v1/chat/completions", json=body, headers=headers)
    assert stream.status_code == 200 and stream.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert stream.text.rstrip().endswith("data: [DONE]")
    denied = requests.get(bg.url + "/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["Access-Control-Allow-Origin"] == ORIGIN


def _metrics(bg) -> dict:
    text = requests.get(bg.url + "/metrics", headers={"x-api-key": METRICS_KEY}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_a_request(bg):
    before = _metrics(bg)
    oai = openai.OpenAI(base_url=bg.url + "/v1", api_key=KEY, max_retries=0)
    # greedy: the demo model never ends a greedy answer early, so this one finishes by length
    usage = oai.chat.completions.create(model="deepseek-chat", messages=HELLO, max_tokens=3, temperature=0).usage
    after = _metrics(bg)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("ds4_mlx_requests_total", endpoint="chat", finish_reason="length") == 1
    assert grew("ds4_mlx_completion_tokens_total") == usage.completion_tokens == 3
    prompt = sum(grew("ds4_mlx_prompt_tokens_total", kind=k) for k in ("reused", "replayed", "computed"))
    assert prompt == usage.prompt_tokens
    assert grew("ds4_mlx_prompt_tokens_total", kind="reused") == usage.prompt_tokens_details.cached_tokens
    assert grew("ds4_mlx_http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert after[("ds4_mlx_decode_tokens_per_second", ())] > 0
    assert after[("ds4_mlx_ready", ())] == 1 and after[("ds4_mlx_queued_requests", ())] == 0
    assert after[("ds4_mlx_session_tokens", ())] >= usage.prompt_tokens
    assert after[("ds4_mlx_session_bytes", ())] > 0


def test_tokenize_round_trip(bg):
    tokenizer = bg.server.worker.tokenizer
    headers = {"x-api-key": KEY}
    text = "<｜begin▁of▁sentence｜>Héllo, 世界! <think>"
    tokens = requests.post(bg.url + "/tokenize", json={"content": text}, headers=headers).json()["tokens"]
    assert tokens == tokenizer.encode(text) and tokens[0] == tokenizer.bos_id
    back = requests.post(bg.url + "/detokenize", json={"tokens": tokens}, headers=headers).json()
    assert back == {"content": text}
    pieces = requests.post(bg.url + "/tokenize", json={"content": text, "with_pieces": True}, headers=headers).json()
    assert [p["id"] for p in pieces["tokens"]] == tokens and pieces["tokens"][0]["piece"] == "<｜begin▁of▁sentence｜>"
    for bad in ({"tokens": [1, -1]}, {"tokens": ["a"]}, {"tokens": [10**9]}, {}):
        r = requests.post(bg.url + "/detokenize", json=bad, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"]


def test_served_while_loading():
    release = threading.Event()

    def slow_load():
        release.wait(60)
        return load_for_cli(None)[:2]

    server = build_server(slow_load, model_id="deepseek-v4-flash", ctx=4096, sessions=1, budget_bytes=2**32)
    with BackgroundServer(server, wait_ready=False) as bg:
        health = requests.get(bg.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        chat = requests.post(bg.url + "/v1/chat/completions", json={"messages": HELLO})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "model_loading"
        message = requests.post(bg.url + "/v1/messages", json={"messages": HELLO, "max_tokens": 2})
        assert message.status_code == 503 and message.json()["type"] == "error"
        assert 'ds4_mlx_ready 0.0' in requests.get(bg.url + "/metrics").text
        release.set()
        wait_healthy(bg.url)
        assert requests.post(bg.url + "/v1/chat/completions",
                             json={"messages": HELLO, "max_tokens": 1}).status_code == 200


def test_leaving_during_the_load_does_not_wait_for_it():
    release = threading.Event()
    server = build_server(lambda: release.wait(60) and load_for_cli(None)[:2], model_id="deepseek-v4-flash",
                          ctx=4096, sessions=1, budget_bytes=2**32)
    with BackgroundServer(server, wait_ready=False):
        pass  # the cleanup would wait for the load (and time out) if it stopped the worker
    assert not server.loaded.done() and not server.ready
    release.set()


# ---------------------------------------------------------------- the `serve` command


def _serve(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "ds4_mlx.cli", "serve", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, **popen)


def test_serve_startup_lines_and_ctx_clamped():
    server = _serve("--port", "0", "--ctx", "1000000")
    received = queue.Queue()
    threading.Thread(target=lambda: [received.put(line.rstrip("\n")) for line in server.stderr], daemon=True).start()
    lines = []
    try:
        while not lines or "ready: " not in lines[-1]:
            lines.append(received.get(timeout=120))  # the demo model may be built first
        url = re.search(r"ready: (http://127\.0\.0\.1:\d+) \(OpenAI: /v1, Anthropic: /v1/messages\)$", lines[-1])[1]
        log = "\n".join(lines)
        assert log.index(f"listening on {url}") < log.index("gibberish")  # bound before the load
        assert "--ctx 1000000 is more than this model's context of 32768 tokens: serving 32768" in log
        assert "thinking is on by default for the OpenAI APIs" in log and "/v1/messages thinks only when" in log
        models = requests.get(url + "/v1/models").json()["data"]
        assert models and all(model["context_length"] == 32768 for model in models)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0


def test_busy_port_fails_before_loading(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model path does not exist: binding first reports the port, not the model
        server = _serve("--port", str(port), "-m", str(tmp_path / "no-model"))
        _, err = server.communicate(timeout=60)
    assert server.returncode == 1
    assert err.strip().splitlines() == [f"ds4-mlx serve: error: cannot listen on 127.0.0.1:{port}: Address "
                                        "already in use (another server is running there? pick another with --port)"]


def test_log_line_says_hit_partial_hit_or_miss_in_words():
    from ds4_mlx.server.worker import Outcome

    def line(live, common, reused, computed, miss, prompt=25, prefill_s=0.05):
        return Outcome(slot=0, finish_reason="length", prompt_tokens=prompt, completion_tokens=8, live=live,
                       common=common, reused=reused, replayed=0, computed=computed, prefill_s=prefill_s,
                       decode_s=0.2, miss=miss).log_line("chat")

    resend = line(33, 25, 24, 1, None)
    assert resend == ("chat hit: slot 0 already holds this prompt (a resend); prompt 25 tokens: 24 reused, "
                      "1 computed in 0.05 s; answer 8 tokens in 0.20 s, finish length")  # no rate for 1 token
    assert line(20, 20, 20, 5, None).startswith("chat hit: slot 0 continues its conversation;")
    assert line(0, 0, 0, 25, "empty-slot").startswith("chat miss: new conversation in empty slot 0;")
    partial = line(40, 12, 12, 13, "diverged(at=12, live-token=5, prompt-token=6)")
    assert partial.startswith("chat partial hit: the prompt leaves slot 0's conversation at token 12 of 40")
    other = line(25, 5, 5, 300, "other-conversation(share=5,live=25)", prompt=305, prefill_s=3.0)
    assert other.startswith("chat miss: the prompt continues no live session; slot 0's other conversation "
                            "(25 tokens, 5 in common) was dropped for it")
    assert "300 computed in 3.00 s (100.0 t/s)" in other
    fork = Outcome(slot=1, finish_reason="length", prompt_tokens=300, completion_tokens=8, live=0, common=280,
                   reused=280, replayed=0, computed=20, prefill_s=0.1, decode_s=0.2,
                   miss="fork(from=0,share=280,live=0)", source=0).log_line("chat")
    assert fork.startswith("chat partial hit: slot 1 starts from a snapshot of slot 0's conversation "
                           "(280 tokens in common); prompt 300 tokens: 280 reused, 20 computed")


def test_max_tokens_caps_every_request():
    """`serve --max-tokens 2`: a request asking for more (or for nothing) stops at 2, as length."""
    with BackgroundServer(demo_server(max_tokens=2)) as bg:
        oai = openai.OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
        for asked in ({"max_tokens": 10}, {}):
            done = oai.chat.completions.create(model="deepseek-chat", messages=HELLO, temperature=0, **asked)
            assert done.usage.completion_tokens == 2 and done.choices[0].finish_reason == "length"
