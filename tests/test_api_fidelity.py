"""API fidelity, as a client author would try each endpoint: what real clients send is accepted, what the
server cannot honour is a clear 4xx, and every honoured field does what the API says. On the demo model
(real tokenizer, template and session; random weights)."""

import base64
import json
import logging

import openai
import pytest
import requests

from ds4_mlx.tools.testing import live_text

MODEL = "deepseek-v4-flash"
CAP = 24
SERVER_OPTIONS = {"sessions": 2, "max_tokens": CAP}  # the `bg` fixture's


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
                                         {"type": "text", "text": "list files",
                                          "cache_control": {"type": "ephemeral"}}]},
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


def test_a_claude_code_request_is_served_with_its_system_message_where_it_stands(bg, caplog):
    caplog.set_level(logging.DEBUG, logger="ds4_mlx.server")
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,effort-2025-11-24",
               "anthropic-version": "2023-06-01"}
    response = post_messages(bg, claude_code_body(), headers=headers)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == CAP  # serve cap
    text = live_text(bg)
    assert "x-anthropic" not in text and text.index("You are a coding agent.") < text.index("<｜User｜>")
    assert "list files\n\n# Environment\ncwd: /tmp/x<｜Assistant｜><think>" in text
    assert "ignored field(s) context_management, metadata, some_future_field" in caplog.text  # seen, not refused


def test_omitted_thinking_is_given_back_through_its_signature(bg):
    body = claude_code_body()
    first = post_messages(bg, body).json()
    [thinking] = [b for b in first["content"] if b["type"] == "thinking"]
    assert thinking["thinking"] == ""  # display: omitted
    reasoning = base64.b64decode(thinking["signature"].split(":", 1)[1]).decode()
    assert reasoning and reasoning in live_text(bg)
    follow_up = {**body, "messages": body["messages"] + [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": "go on"}]}
    assert post_messages(bg, follow_up).status_code == 200
    # the reasoning came back from the signature, so the prompt holds what the model wrote (the exact
    # reuse this gives is checked with Claude Code itself, in test_agent_clients)
    assert "<think>" + reasoning + "</think>" in live_text(bg)
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
    ({"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages[0].content[0] must be a content block"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"text": "x"}]}]},
     400, "messages[1].content[0] must be a content block with a type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "ok"}, {"type": 3}]}]}]}, 400, "messages[0].content[0].content[1] must be a"),
    ({"messages": [{"role": "critic", "content": "x"}]}, 422, "role"),
    ({"thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, 400, "thinking.display"),
    ({"output_config": {"effort": "extreme"}}, 400, "effort"),
    ({"output_config": "high"}, 400, "output_config"),
    ({"max_tokens": 0}, 400, "max_tokens"),
])
def test_malformed_used_fields_and_unreadable_content_are_clean_errors(bg, change, status, words):
    response = post_messages(bg, claude_code_body(**change))
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and words in error["error"]["message"]


def test_a_contentless_block_of_an_unknown_type_is_skipped_and_a_tool_reference_is_read(bg):
    messages = [{"role": "user", "content": [{"type": "future_marker", "cache_control": {"type": "ephemeral"}},
                                             {"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_9", "name": "ToolSearch", "input": {"query": "select:WebFetch"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": [
                    {"type": "tool_reference", "tool_name": "WebFetch"}]}]}]
    assert post_messages(bg, claude_code_body(messages=messages)).status_code == 200
    assert "<tool_result>WebFetch</tool_result>" in live_text(bg)


# ---------------------------------------------------------------- OpenAI completions and chat


def test_completions_complete_raw_text(bg, oai):
    done = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2, temperature=0)
    tokenizer = bg.server.worker.tokenizer
    assert done.usage.prompt_tokens == 1 + len(tokenizer.encode("Once upon a time"))  # BOS + the text
    text = live_text(bg)
    assert text.startswith("<｜begin▁of▁sentence｜>Once upon a time") and "<｜User｜>" not in text


def test_a_prompt_list_gives_one_choice_per_prompt_and_echo_repeats_each(oai):
    prompts = ["The sky is", "Two plus two"]
    done = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0, echo=True)
    assert [c.index for c in done.choices] == [0, 1]
    for prompt, choice in zip(prompts, done.choices):
        alone = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert choice.text == prompt + alone.choices[0].text
    assert done.usage.completion_tokens == 4
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=2, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == done.choices[0].text
    with pytest.raises(openai.UnprocessableEntityError):
        oai.completions.create(model=MODEL, prompt=prompts, max_tokens=2, stream=True)


def test_completions_logprobs(oai):
    done = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, logprobs=2)
    logprobs = done.choices[0].logprobs
    assert "".join(logprobs.tokens) == done.choices[0].text and len(logprobs.token_logprobs) == 3
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and len(top) <= 2
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the sampled token is the best
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]
    streamed = [c.choices[0].logprobs for c in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-4)


def test_chat_logprobs_plain_and_streamed(oai):
    request = dict(model="deepseek-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
                   logprobs=True, top_logprobs=3)
    done = oai.chat.completions.create(**request)
    content = done.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == done.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
               for t in content)
    chunks = list(oai.chat.completions.create(**request, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    plain = oai.chat.completions.create(**{**request, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(**{**request, "logprobs": False})


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OPENING = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\""


def answer_text(bg) -> str:
    text = live_text(bg)
    return text[text.rindex("<｜Assistant｜>") + len("<｜Assistant｜>"):]


def test_a_forced_tool_choice_opens_a_tool_call(bg, oai, claude):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    oai.chat.completions.create(model="deepseek-chat", messages=messages, tools=[WEATHER], tool_choice="required",
                                max_tokens=CAP)
    assert answer_text(bg).startswith("</think>" + OPENING + 'get_weather">\n')  # the only tool
    named = {"type": "function", "function": {"name": "get_weather"}}
    oai.chat.completions.create(model="deepseek-chat", messages=messages, tools=[WEATHER], tool_choice=named,
                                max_tokens=CAP)
    assert answer_text(bg).startswith("</think>" + OPENING + 'get_weather">\n')
    time_tool = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    oai.responses.create(model=MODEL, input="Weather?", tools=[{"type": "function", **WEATHER["function"]}, time_tool],
                         tool_choice="required", max_output_tokens=CAP, extra_body={"thinking": False})
    assert any(answer_text(bg).startswith("</think>" + OPENING + f'{name}">\n') for name in ("get_weather", "get_time"))
    claude.messages.create(model=MODEL, max_tokens=CAP, messages=messages, tool_choice={"type": "tool", "name": "Bash"},
                           tools=[{"name": "Bash", "input_schema": {"type": "object"}}])
    assert answer_text(bg).startswith("</think>" + OPENING + 'Bash">\n')


VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "grade": {"enum": ["A", "B"]}},
           "required": ["ok", "grade"], "additionalProperties": False}


def test_response_format_json_schema_is_enforced(oai):
    messages = [{"role": "user", "content": "Judge it."}]
    done = oai.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}})
    verdict = json.loads(done.choices[0].message.content)
    assert set(verdict) == {"ok", "grade"} and isinstance(verdict["ok"], bool) and verdict["grade"] in ("A", "B")
    assert done.choices[0].finish_reason == "stop"  # the object is complete: only EOS may follow
    response = oai.responses.create(model=MODEL, input="Judge it.", max_output_tokens=30,
                                    extra_body={"thinking": False},
                                    text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}})
    assert set(json.loads(response.output_text)) == {"ok", "grade"}
    loose = oai.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=8,
                                        response_format={"type": "json_object"})
    assert loose.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectish"}}})


# ---------------------------------------------------------------- inputs this server cannot honour are refused

IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                                       IMAGE_URL]}]}, "reads text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, "reads text only"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": "data:,"}]}]},
     "reads text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "missing required field 'content'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "has no tools"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "f"}}, "has no tools"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                      "tool_choice": {"type": "any"}}, "has no tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "bogus"},
     "'reasoning_effort' must be one of"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "bogus"}}, "'reasoning.effort' must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "store": True}, "'store'"),
    ("/v1/responses", {"input": "hi", "store": True}, "'store'"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "'best_of'"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "'suffix'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}},
     "'logit_bias'"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "'logit_bias'"),
])
def test_what_the_server_cannot_honour_is_a_400(bg, path, body, words):
    response = requests.post(bg.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert response.status_code in (400, 422), response.text
    assert words in response.text


def test_what_clients_send_by_default_stays_accepted(oai):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, store=False, tool_choice="auto",
                                reasoning_effort="low")
    oai.completions.create(model=MODEL, prompt="hi", max_tokens=1, best_of=1)


def test_logit_bias_steers_the_draw(bg, oai):
    tokenizer = bg.server.worker.tokenizer
    target = tokenizer.encode(" zebra")[0]
    done = oai.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0,
                                  logit_bias={str(target): 100})
    assert done.choices[0].text == tokenizer.decode([target] * 3)
    chat = oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logit_bias={str(target): 100})
    assert chat.choices[0].message.content == tokenizer.decode([target] * 2)


def test_tokenize_honours_add_special_and_parse_special(bg):
    tokenizer = bg.server.worker.tokenizer

    def tokenize(**body):
        response = requests.post(bg.url + "/tokenize", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    text = "<｜User｜>hi"
    as_is = tokenize(content=text)
    assert as_is == tokenizer.encode(text) and len(as_is) == 2  # the control token and "hi"
    plain = tokenize(content=text, parse_special=False)
    assert tokenizer.id_of("<｜User｜>") not in plain and tokenizer.decode(plain) == text
    assert tokenize(content=text, add_special=True) == [tokenizer.bos_id] + as_is


def test_a_stop_string_ends_the_content_never_the_reasoning(bg, oai):
    blank_line = bg.server.worker.tokenizer.encode("\n\n")
    assert len(blank_line) == 1
    request = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stop=["\n\n"],
                   logit_bias={str(blank_line[0]): 100})  # every token a blank line
    thought = oai.chat.completions.create(model=MODEL, **request)
    assert thought.choices[0].finish_reason == "length"
    assert thought.choices[0].message.model_extra["reasoning_content"] == "\n\n" * 4
    direct = oai.chat.completions.create(model="deepseek-chat", **request)
    assert direct.choices[0].finish_reason == "stop" and direct.choices[0].message.content == ""
    assert direct.usage.completion_tokens == 1
