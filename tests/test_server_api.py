"""The server's APIs through the official OpenAI and Anthropic SDKs, on the demo model (real tokenizer,
Session and generate; random weights, so the text is gibberish but every path is real)."""

import json

import anthropic
import openai
import pytest
import requests

from ds4_mlx.chat import render
from ds4_mlx.tools.testing import live_text, serve_process

MODEL = "deepseek-v4-flash"
CTX = 4096
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SERVER_OPTIONS = {"ctx": CTX, "sessions": 2}  # the `bg` fixture's


def sse_events(response) -> list[tuple]:
    """(event name, data) pairs of a raw SSE response."""
    events, name = [], None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


# ---------------------------------------------------------------- plain endpoints


def test_models_health_and_openapi(bg, oai):
    models = oai.models.list().data  # every name the server answers to
    assert [m.id for m in models] == [MODEL, "deepseek-chat", "deepseek-reasoner"]
    assert all(m.context_length == CTX for m in models)
    assert oai.models.retrieve("deepseek-chat").id == "deepseek-chat"
    health = requests.get(bg.url + "/health").json()
    assert health["status"] == "ok" and len(health["slots"]) == 2
    spec = requests.get(bg.url + "/openapi.json").json()
    generating = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"]
    assert set(generating) <= set(spec["paths"])
    for path in generating:  # the tenant salt every API reads
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "cache_salt" in body["properties"], path


# ---------------------------------------------------------------- OpenAI chat and completions


def test_chat_thinking_on_and_off(oai):
    messages = [{"role": "user", "content": "Hello there"}]
    thinking = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    choice = thinking.choices[0]
    assert choice.finish_reason == "length" and choice.message.reasoning_content and not choice.message.content
    assert thinking.usage.prompt_tokens > 0 and thinking.usage.completion_tokens == 4
    direct = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"thinking": False})
    assert direct.choices[0].message.content and not getattr(direct.choices[0].message, "reasoning_content", None)
    alias = oai.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=4, temperature=0)
    assert alias.choices[0].message.content == direct.choices[0].message.content


def test_chat_streaming_with_usage(oai):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Stream please"}], max_tokens=5, temperature=0,
                   stream=True, stream_options={"include_usage": True})
    chunks = list(oai.chat.completions.create(**request))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    resent = list(oai.chat.completions.create(**request))[-1].usage
    assert resent.prompt_tokens_details.cached_tokens == resent.prompt_tokens - 1  # the last one is fed again


def test_completions(oai):
    done = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert done.choices[0].text and done.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text


def test_chat_tool_round_trip_is_rendered_as_dsml_and_tool_results(bg, oai):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    answer = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                         max_tokens=3, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    text = live_text(bg)
    assert text.startswith(render(messages, tools=[WEATHER_TOOL]))
    assert '<｜DSML｜invoke name="get_weather">' in text and "<tool_result>{\"temp\": 21}</tool_result>" in text
    assert "<think>I should call the tool.</think>" in text  # tool turns keep their reasoning
    none = oai.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER_TOOL],
                                       tool_choice="none", max_tokens=1, temperature=0)
    assert none.choices and "## Tools" not in live_text(bg)


# ---------------------------------------------------------------- Anthropic messages


def test_messages_thinking_and_usage(claude):
    message = claude.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, system="Be brief.",
                                     thinking={"type": "enabled", "budget_tokens": 1024},
                                     messages=[{"role": "user", "content": "Hi"}])
    assert message.content[0].type == "thinking" and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 4 and message.usage.cache_read_input_tokens is not None
    direct = claude.messages.create(model="claude-haiku-4-5", max_tokens=4, extra_body={"temperature": 0},
                                    thinking={"type": "disabled"}, messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in direct.content] == ["text"] and direct.content[0].text


def test_messages_stream_event_sequence(bg, claude):
    request = dict(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, thinking={"type": "adaptive"},
                   messages=[{"role": "user", "content": "Hi there"}])
    claude.messages.create(**request)  # so the stream below sends this prompt again, whatever ran before
    with claude.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[-1].type == "text"
    assert final.usage.output_tokens == 4 and final.usage.cache_read_input_tokens > 0  # the same prompt again
    raw_body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": request["messages"], "stream": True,
                "thinking": {"type": "adaptive"}}
    with requests.post(bg.url + "/v1/messages", json=raw_body, stream=True) as raw:
        names = [name for name, _ in sse_events(raw) if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:4] == ["content_block_start", "content_block_delta", "content_block_delta"] or \
        names[1:3] == ["content_block_start", "content_block_delta"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2  # thinking + empty text


def test_messages_tool_round_trip_and_count_tokens(bg, claude):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]},
    ]
    tools = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    message = claude.messages.create(model=MODEL, max_tokens=2, extra_body={"temperature": 0}, messages=messages, tools=tools,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert message.stop_reason == "max_tokens"
    text = live_text(bg)
    assert '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>' in text
    assert "<tool_result>21 C</tool_result><｜Assistant｜><think>" in text
    count = claude.messages.count_tokens(model=MODEL, messages=messages, tools=tools,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


# ---------------------------------------------------------------- Responses


def test_responses_plain_streamed_and_with_function_calls(bg, oai):
    plain = oai.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=4,
                                 temperature=0)
    assert plain.status == "incomplete" and plain.output[0].type == "reasoning"
    assert plain.usage.input_tokens > 0
    events = list(oai.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=4,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    usage = events[-1].response.usage  # the same input again: all of it but the last token comes from the cache
    assert usage.input_tokens == plain.usage.input_tokens
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1
    assert "response.reasoning_summary_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))

    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city":"Paris"}'},
               {"type": "function_call_output", "call_id": "call_9", "output": "21 C"}]
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    oai.responses.create(model=MODEL, input=history, tools=tools, max_output_tokens=2, temperature=0)
    text = live_text(bg)
    assert '<｜DSML｜invoke name="get_weather">' in text and "<tool_result>21 C</tool_result>" in text


# ---------------------------------------------------------------- errors


def test_errors_have_each_api_shape_and_status(bg, oai, claude):
    bad_json = requests.post(bg.url + "/v1/chat/completions", data=b"{not json",
                             headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages="hello")
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="'temperature' must be between 0 and 2"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=7)
    too_long = requests.post(bg.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(CTX))}]})
    error = too_long.json()["error"]
    assert too_long.status_code == 413 and error["code"] == "context_length_exceeded" and error["n_ctx"] == CTX
    missing = requests.post(bg.url + "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": 5}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="gpt-9", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    unknown = requests.get(bg.url + "/v1/nothing")
    assert unknown.status_code == 404 and "error" in unknown.json()
    refused = requests.post(bg.url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert refused.status_code == 400 and "stateless" in refused.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    odd_choice = requests.post(bg.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
        "tool_choice": {"type": "function", "function": "f"}})
    assert odd_choice.status_code == 400
    odd_call_id = requests.post(bg.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": ["x"], "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})
    assert odd_call_id.status_code in (200, 400)  # accepted as an unknown call or refused, never a 500


def test_the_serve_command_starts_a_server():
    process, url = serve_process("--ctx", "2048", "--sessions", "1")
    try:
        health = requests.get(url + "/health", timeout=30).json()
        assert health["context_length"] == 2048 and len(health["slots"]) == 1
    finally:
        process.terminate()
        process.wait(timeout=30)
