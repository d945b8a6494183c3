"""API fidelity, as a client author would try each endpoint: what real clients send is accepted, what the
server cannot honour is a clear 4xx, and every honoured field does what the API says. On the demo model
(real tokenizer, template and session; random weights)."""

import base64

import anthropic
import pytest
import requests

from ds4_mlx.generate import load_for_cli
from ds4_mlx.server.build import BackgroundServer, build_server

MODEL = "deepseek-v4-flash"
CAP = 5


@pytest.fixture(scope="module")
def bg():
    server = build_server(lambda: load_for_cli(None)[:2], model_id=MODEL, ctx=4096, sessions=2, budget_bytes=2**32,
                          max_tokens=CAP)
    with BackgroundServer(server) as bg:
        yield bg


@pytest.fixture(scope="module")
def claude(bg):
    return anthropic.Anthropic(base_url=bg.url, api_key="-", max_retries=0)


def live_text(bg) -> str:
    slot = max(bg.server.worker.slots, key=lambda s: s.last_used)
    return bg.server.worker.tokenizer.decode(slot.tokens)


def post_messages(bg, body: dict, **kwargs):
    return requests.post(bg.url + "/v1/messages?beta=true", json=body, timeout=60, **kwargs)


# ---------------------------------------------------------------- Anthropic: what Claude Code sends


def claude_code_body(**changes) -> dict:
    """A request shaped as Claude Code 2.1 sends it (trimmed)."""
    body = {
        "model": "claude-opus-5-5", "max_tokens": 32000, "stream": False, "temperature": 0,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328;"},
                   {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>be careful</system-reminder>"},
                                         {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp/x"}],
             "output_config": {"effort": "medium"}},
        ],
        "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {
                       "type": "object", "properties": {"command": {"type": "string"}}}},
                  {"name": "Placeholder", "description": "never call", "defer_loading": True,
                   "input_schema": {"type": "object", "properties": {}}, "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}, "some_future_field": {"x": 1},
    }
    return {**body, **changes}


def test_a_claude_code_request_is_served_with_its_system_message_where_it_stands(bg):
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,effort-2025-11-24",
               "anthropic-version": "2023-06-01"}
    response = post_messages(bg, claude_code_body(), headers=headers)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == CAP  # serve cap
    text = live_text(bg)
    assert "x-anthropic" not in text and text.index("You are a coding agent.") < text.index("<｜User｜>")
    assert "list files\n\n# Environment\ncwd: /tmp/x<｜Assistant｜><think>" in text


def test_omitted_thinking_is_given_back_through_its_signature_and_the_session_is_reused(bg):
    body = claude_code_body()
    first = post_messages(bg, body).json()
    [thinking] = [b for b in first["content"] if b["type"] == "thinking"]
    assert thinking["thinking"] == ""  # display: omitted
    reasoning = base64.b64decode(thinking["signature"].split(":", 1)[1]).decode()
    assert reasoning and reasoning in live_text(bg)
    follow_up = {**body, "messages": body["messages"] + [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": "go on"}]}
    second = post_messages(bg, follow_up).json()
    # all the first prompt and its answer are reused: the reasoning came back from the signature
    prompt = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    assert second["usage"]["cache_read_input_tokens"] >= prompt + CAP - 1
    broken = {"type": "thinking", "thinking": "", "signature": "ds4r1:***"}
    damaged = {**body, "messages": body["messages"] + [{"role": "assistant", "content": [broken]},
                                                       {"role": "user", "content": "go on"}]}
    assert post_messages(bg, damaged).status_code == 400


def test_anthropic_thinks_only_when_asked(claude):
    plain = claude.messages.create(model="claude-haiku-4-5", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in plain.content] == ["text"]
    asked = claude.messages.create(model="claude-haiku-4-5", max_tokens=3, messages=[{"role": "user", "content": "Hi"}],
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert asked.content[0].type == "thinking" and asked.content[0].thinking


@pytest.mark.parametrize("change, status, words", [
    ({"messages": []}, 400, "must not be empty"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "reads text only"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     400, "reads text only"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]},
     400, "reads text only"),
    ({"messages": [{"role": "user", "content": [{"type": "future_block", "text": "read me"}]}]},
     400, "'future_block' are not supported"),
    ({"messages": [{"role": "critic", "content": "x"}]}, 422, "role"),
    ({"thinking": {"type": "sometimes"}}, 422, "thinking.type"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, 422, "thinking.display"),
    ({"output_config": {"effort": "extreme"}}, 422, "effort"),
    ({"output_config": "high"}, 400, "output_config"),
    ({"max_tokens": 0}, 422, "max_tokens"),
])
def test_malformed_used_fields_and_unreadable_content_are_clean_errors(bg, change, status, words):
    response = post_messages(bg, claude_code_body(**change))
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and words in error["error"]["message"]


def test_a_contentless_block_of_an_unknown_type_is_skipped(bg):
    messages = [{"role": "user", "content": [{"type": "future_marker", "cache_control": {"type": "ephemeral"}},
                                             {"type": "text", "text": "Hi"}]}]
    assert post_messages(bg, claude_code_body(messages=messages)).status_code == 200
