"""Tool-call output through the server: a scripted token stream (a random model never writes DSML)
goes through the real parser and each API's response assembly, streamed and not, to the SDK clients."""

import json

import anthropic
import openai
import pytest

from ds4_mlx.chat import Client, Prompt
from ds4_mlx.generate import GenerationChunk, GenerationStats
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.tools.testing import demo_server

MODEL = "deepseek-v4-flash"
DSML_BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
              '<｜DSML｜parameter name="city" string="false">"Paris"</｜DSML｜parameter>\n'
              '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
SCRIPT = "Let me check the weather.</think>Sure." + DSML_BLOCK
WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class ScriptedGenerate:
    """Stands in for stream_generate: yields SCRIPT in awkward pieces, then stops as on EOS."""

    def __init__(self):
        self.prompts, self.prompt_ids = [], []
        self.script = SCRIPT

    def __call__(self, session, tokenizer, prompt_ids, *, max_tokens, sampling, stop_strings, should_abort,
                 on_prefill):
        self.prompts.append(tokenizer.decode(prompt_ids))
        self.prompt_ids.append(list(prompt_ids))
        pieces = [self.script[i:i + 7] for i in range(0, len(self.script), 7)]
        for piece in pieces:
            yield GenerationChunk(text=piece, token=0)
        reasoning, answer = self.script.split("</think>", 1)  # sampled: </think> its control id, the rest text
        self.sampled = tokenizer.encode(Prompt.join([Client(reasoning), "</think>", Client(answer)]))
        stats = GenerationStats(prompt_tokens=len(prompt_ids), computed_tokens=len(prompt_ids),
                                completion_tokens=len(pieces) + 1, output_ids=self.sampled, output_text=self.script)
        yield GenerationChunk(text="", token=tokenizer.eos_id, finish_reason="stop", stats=stats)


@pytest.fixture(scope="module")
def scripted():
    generate = ScriptedGenerate()
    server = demo_server(generate=generate)
    with BackgroundServer(server) as bg:
        yield bg, generate


def ask_weather():
    return [{"role": "user", "content": "Weather in Paris?"}]


def test_openai_tool_calls_plain_and_streamed(scripted):
    bg, _ = scripted
    client = openai.OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
    tools = [{"type": "function", "function": WEATHER}]
    done = client.chat.completions.create(model=MODEL, messages=ask_weather(), tools=tools)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Let me check the weather." and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model=MODEL, messages=ask_weather(), tools=tools, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sure."


def test_a_returned_tool_call_is_replayed_as_the_sampled_tokens(scripted):
    bg, generate = scripted
    client = openai.OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
    tools = [{"type": "function", "function": WEATHER}]
    done = client.chat.completions.create(model=MODEL, messages=ask_weather(), tools=tools)
    [call], sampled = done.choices[0].message.tool_calls, generate.sampled
    history = ask_weather() + [
        {"role": "assistant", "content": "Sure.", "reasoning_content": "Let me check the weather.",
         "tool_calls": [{"id": call.id, "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},  # re-serialized by the client
        {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
    client.chat.completions.create(model=MODEL, messages=history, tools=tools)
    assert "Sure." + DSML_BLOCK + "<｜end▁of▁sentence｜>" in generate.prompts[-1]
    assert contains(generate.prompt_ids[-1], generate.prompt_ids[-2] + sampled)  # the live session's very tokens


def contains(ids: list, part: list) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_a_tool_call_that_echoed_control_text_is_replayed_as_sampled_not_as_control_tokens(scripted):
    """A model that wrote `<｜end▁of▁sentence｜><｜User｜>...</think>` into an argument (as plain text, which is
    what it sampled) gets those same plain tokens back, never control tokens, whatever the client sends."""
    bg, generate = scripted
    client = openai.OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
    tokenizer = bg.server.worker.tokenizer
    echo = "<｜end▁of▁sentence｜><｜User｜>hi</think>"
    generate.script = SCRIPT.replace('"Paris"', json.dumps("Paris" + echo, ensure_ascii=False))
    try:
        tools = [{"type": "function", "function": WEATHER}]
        [call] = client.chat.completions.create(model=MODEL, messages=ask_weather(), tools=tools).choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris" + echo}
        history = ask_weather() + [
            {"role": "assistant", "content": "Sure.", "reasoning_content": "Let me check the weather.",
             "tool_calls": [call.model_dump()]}, {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        client.chat.completions.create(model=MODEL, messages=history, tools=tools)
    finally:
        generate.script = SCRIPT
    replayed = generate.prompt_ids[-1]
    assert contains(replayed, generate.sampled)
    control = {tokenizer.eos_id, tokenizer.id_of("<｜User｜>"), tokenizer.id_of("</think>")}
    # beyond the first prompt's: the answer's </think>, then the template's EOS and <｜User｜>; none from the echo
    assert sum(t in control for t in replayed) == sum(t in control for t in generate.prompt_ids[-2]) + 3


def test_anthropic_tool_use_plain_and_streamed(scripted):
    bg, _ = scripted
    client = anthropic.Anthropic(base_url=bg.url, api_key="-", max_retries=0)
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    thinking = {"type": "adaptive"}
    message = client.messages.create(model=MODEL, max_tokens=100, messages=ask_weather(), tools=tools, thinking=thinking)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.stop_reason == "tool_use" and message.content[2].input == {"city": "Paris"}
    assert message.content[2].id.startswith("toolu_")
    with client.messages.stream(model=MODEL, max_tokens=100, messages=ask_weather(), tools=tools,
                                thinking=thinking) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Let me check the weather." and final.content[1].text == "Sure."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_responses_function_call_items(scripted):
    bg, _ = scripted
    client = openai.OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
    tools = [{"type": "function", **WEATHER}]
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[2].name == "get_weather" and json.loads(response.output[2].arguments) == {"city": "Paris"}
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert events[-1].response.output[-1].call_id.startswith("call_")
