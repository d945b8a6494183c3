"""Hostile input: schemathesis against /openapi.json, hypothesis on request bodies and on the chat output
parser, and bodies that break JSON parsers. Every bad input gets a 4xx in the API's own error shape,
never a 500, a hang or a dead worker."""

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st
from schemathesis import GenerationMode

from ds4_mlx.chat import ContentDelta, MalformedBlock, OutputParser, ReasoningDelta, ToolCall
from ds4_mlx.generate import stream_generate
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.server.openapi import openapi_spec
from ds4_mlx.server.protocol import ServerInfo
from ds4_mlx.tools.testing import demo_server

MODEL = "deepseek-v4-flash"
CTX = 512


def fuzz(max_examples):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def short_generate(session, tokenizer, prompt_ids, *, max_tokens, **kwargs):
    """The real generation, at most 2 tokens: the fuzzing is about requests, not answers."""
    return stream_generate(session, tokenizer, prompt_ids, max_tokens=min(max_tokens, 2), yield_prefill=True,
                           **kwargs)


@pytest.fixture(scope="module")
def url():
    server = demo_server(ctx=CTX, generate=short_generate)
    with BackgroundServer(server) as bg:
        yield bg.url
        assert bg.server.worker._thread.is_alive()  # the worker survived all of it


def check_response(path: str, response):
    assert response.status_code < 500, (path, response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        else:
            assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body
    elif "text/event-stream" in response.headers.get("Content-Type", ""):
        assert '"server_error"' not in response.text and '"api_error"' not in response.text, response.text[:500]


def alive(url):
    r = requests.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 200


# ---------------------------------------------------------------- schemathesis

SCHEMA = schemathesis.openapi.from_dict(openapi_spec(ServerInfo(MODEL, CTX)))
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_schemathesis(url, operation):
    cases = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(GenerationMode.NEGATIVE)

    @fuzz(12 if operation.method.upper() == "POST" else 3)
    @given(case=cases)
    def run(case):
        check_response(operation.path, case.call(base_url=url, timeout=60))

    run()
    alive(url)


# ---------------------------------------------------------------- hypothesis on bodies

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
VALID = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 2, "tools": TOOLS, "tool_choice": "auto", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}], "stop": ["x"], "temperature": 0.5, "seed": 1},
    "/v1/completions": {"model": MODEL, "prompt": "p", "max_tokens": 2, "stream": True,
                        "stream_options": {"include_usage": True}},
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "s"}],
                     "tools": [{"name": "get", "input_schema": {"type": "object"}}], "messages": [
                         {"role": "user", "content": "q"},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                                           {"type": "tool_use", "id": "t1", "name": "get", "input": {}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}],
                     "thinking": {"type": "enabled", "budget_tokens": 10}, "stream": True},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "q"}]},
    "/v1/responses": {"model": MODEL, "max_output_tokens": 2, "instructions": "i", "tools": [
        {"type": "function", "name": "get", "parameters": {}}], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"}], "reasoning": {"effort": "low"}},
}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["", "none", "auto", "user", "assistant", "tool", "function", "text", "tool_use", MODEL]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


@st.composite
def mutated_bodies(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[path]))
    for _ in range(draw(st.integers(1, 3))):
        node = body
        while True:  # walk down to a random container, then replace or add one of its members
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            if not isinstance(node[key], (dict, list)) or draw(st.booleans()):
                node[key] = draw(JSON_VALUES)
                break
            node = node[key]
    return path, body


@fuzz(120)
@given(case=mutated_bodies())
def test_mutated_bodies_get_4xx_or_an_answer(url, case):
    path, body = case
    check_response(path, requests.post(url + path, json=body, timeout=60))


@pytest.mark.parametrize("path", sorted(VALID))
def test_bodies_that_break_parsers_are_400s(url, path):
    huge = b'{"model": "m", "max_tokens": 1' + b"0" * 5000 + b"}"
    for raw in [b"[" * 100_000, b'{"a":' + b"[" * 200 + b"]" * 200 + b"}", huge, b"\xff\xfe\xfa", b'{"a": "\xc3\x28"}',
                b'{"messages": "\\ud800"}', b"", b"[]", b"null", b'{"a": 1', b'{"a": NaN}' + b" " * 10]:
        response = requests.post(url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=60)
        check_response(path, response)
        assert response.status_code == 400 or raw.startswith(b'{"a": NaN'), (raw[:40], response.status_code)
    huge_numbers = {**VALID[path], "max_tokens": 10**4000, "seed": -(10**300), "temperature": 1e308}
    check_response(path, requests.post(url + path, json=huge_numbers, timeout=60))
    alive(url)


# ---------------------------------------------------------------- the chat output parser

MARKERS = st.sampled_from(["<think>", "</think>", "\n\n<｜DSML｜tool_calls>\n", "</｜DSML｜tool_calls>",
                           '<｜DSML｜invoke name="f">\n', "</｜DSML｜invoke>\n",
                           '<｜DSML｜parameter name="x" string="true">', "</｜DSML｜parameter>\n",
                           '<｜DSML｜parameter name="n" string="false">', "<", "｜", "DSML", " ", "\n", "&lt;"])
OUTPUT = st.lists(st.one_of(MARKERS, st.text(max_size=6)), max_size=14).map("".join)


def events_of(parser_args, pieces):
    parser = OutputParser(**parser_args, make_id=lambda: "id")
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    merged = []
    for e in events:  # neighbouring deltas of one kind are one delta, however the stream was cut
        if merged and isinstance(e, (ContentDelta, ReasoningDelta)) and type(merged[-1]) is type(e):
            merged[-1] = type(e)(merged[-1].text + e.text)
        else:
            merged.append(e)
    return merged


@fuzz(300)
@given(text=OUTPUT, cuts=st.lists(st.integers(0, 200), max_size=8), thinking=st.booleans(), tools=st.booleans())
def test_the_output_parser_does_not_depend_on_where_the_stream_is_cut(text, cuts, thinking, tools):
    args = {"thinking": thinking, "tools": tools}
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = events_of(args, [text])
    assert events_of(args, pieces) == whole
    shown = "".join(e.text if isinstance(e, (ContentDelta, ReasoningDelta, MalformedBlock)) else e.dsml for e in whole)
    assert len(shown) <= len(text) and all(isinstance(e, (ContentDelta, ReasoningDelta, ToolCall, MalformedBlock))
                                           for e in whole)
