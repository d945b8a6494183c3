"""Fields that must do what they say, on the demo model through the SDKs: one tool call at most when
parallel calls are off, complete tool calls kept when a later one is cut, reasoning tokens counted,
presence and frequency penalties as OpenAI defines them, control tokens never shown as text; and the
requests that cannot be honoured refused with a 400 naming what is wrong.

A model that writes tool calls on demand is a script: `FollowScript` samples the script's next token
whenever the constraints allow it (else the allowed token that goes on with the script's text, else the
most likely allowed one), through the real `stream_generate`, so the constraints act as on a model."""

import json

import mlx.core as mx
import numpy as np
import pytest
import requests

from ds4_mlx.chat import (DSML, TAG_PREFIXES, THINK_END, THINK_START, MalformedBlock, OutputParser, ToolCall,
                          render_tool_calls)
from ds4_mlx.constrain import OutputConstraint
from ds4_mlx.generate import Sampler, SamplingParams, stream_generate
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.tools.testing import DEMO_MODEL_ID as MODEL, demo_server

WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
TWO_CALLS = render_tool_calls([{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                               {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}])
REASONING = "The user greets me, so I greet back."


class FollowScript:
    """A generate whose model writes `script` (the reasoning part only when the prompt asks for thinking)
    as far as the constraints let it."""

    def __init__(self):
        self.script, self.reasoning = TWO_CALLS, REASONING

    def __call__(self, session, tokenizer, prompt_ids, **options):
        thinking = tokenizer.decode(prompt_ids[-1:]) == THINK_START
        script = (self.reasoning + THINK_END if thinking else "") + self.script
        written = []

        def sampler(logits):
            text = tokenizer.decode(written)
            rest = script[len(text):] if script.startswith(text) else ""
            row = np.array(logits.astype(mx.float32))
            token = tokenizer.encode(rest)[0] if rest else tokenizer.eos_id
            if row[token] == -np.inf:  # not allowed
                allowed = np.flatnonzero(row > -np.inf)
                pieces = {t: tokenizer.decode([t]) for t in allowed.tolist()}
                going_on = [t for t, piece in pieces.items() if piece and rest.startswith(piece)]
                token = max(going_on, key=lambda t: len(pieces[t])) if going_on else \
                    int(allowed[np.argmax(row[allowed])])
            written.append(token)
            return token

        return stream_generate(session, tokenizer, prompt_ids, sampler=sampler, **options)


@pytest.fixture(scope="module")
def scripted():
    generate = FollowScript()
    with BackgroundServer(demo_server(generate=generate)) as bg:
        yield bg, generate


@pytest.fixture()
def clients(scripted):
    import anthropic
    import openai

    bg, generate = scripted
    generate.script, generate.reasoning = TWO_CALLS, REASONING
    return (bg, generate, openai.OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0),
            anthropic.Anthropic(base_url=bg.url, api_key="-", max_retries=0))


def ask(**changes):
    return {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
            "tools": CHAT_TOOLS, "max_tokens": 200, **changes}


# ---------------------------------------------------------------- one tool call at most


def test_parallel_tool_calls_false_gives_one_call_in_every_api(clients):
    bg, _, oai, claude = clients
    assert len(oai.chat.completions.create(**ask()).choices[0].message.tool_calls) == 2  # the script's two
    for choice in ("auto", "required"):
        done = oai.chat.completions.create(**ask(tool_choice=choice, parallel_tool_calls=False))
        calls = done.choices[0].message.tool_calls
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}], choice
        assert done.choices[0].finish_reason == "tool_calls"
    response = oai.responses.create(model=MODEL, input="Weather?", tools=[{"type": "function", **WEATHER}],
                                    parallel_tool_calls=False, max_output_tokens=200, extra_body={"thinking": False})
    assert [item.type for item in response.output] == ["function_call"] and response.parallel_tool_calls is False
    for choice in ({"type": "auto"}, {"type": "any"}):
        message = claude.messages.create(model=MODEL, max_tokens=200, tools=[{
            "name": "get_weather", "input_schema": WEATHER["parameters"]}], tool_choice={
            **choice, "disable_parallel_tool_use": True}, messages=[{"role": "user", "content": "Weather?"}])
        assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Paris"})], choice


@pytest.mark.parametrize("prefix", TAG_PREFIXES)
def test_the_one_call_constraint_closes_the_block_after_its_first_call(demo, prefix):
    """Whichever tag spelling the parser reads as a tool-call block, the answer cannot go on to a second call."""
    tokenizer = demo[1]
    two = "Let me look.\n\n" + TWO_CALLS.strip().replace(DSML, prefix)
    first_end = two.index(f"</{prefix}invoke>") + len(f"</{prefix}invoke>")
    constraint = OutputConstraint(tokenizer, thinking=False, single_call=True)
    logits = mx.zeros((tokenizer.vocab_size,))
    written = []
    for token in tokenizer.encode(two):
        if np.array(constraint.mask(logits))[token] == -np.inf:
            break
        constraint.advance(token)
        written.append(token)
    while True:  # only one way on: the block's end, then EOS
        [token] = np.flatnonzero(np.array(constraint.mask(logits)) > -np.inf)
        if token == tokenizer.eos_id:
            break
        constraint.advance(int(token))
        written.append(int(token))
    text = tokenizer.decode(written)
    assert text == two[:first_end] + f"\n</{prefix}tool_calls>"
    parser = OutputParser(thinking=False, tools=True)
    assert len([e for e in parser.feed(text) + parser.finish() if isinstance(e, ToolCall)]) == 1


# ---------------------------------------------------------------- a cut call, and the ones before it


def test_the_parser_keeps_the_complete_calls_of_a_cut_block():
    cut = TWO_CALLS[:TWO_CALLS.rindex("Rome")]
    parser = OutputParser(thinking=False, tools=True)
    events = parser.feed(cut) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert [e.cut for e in events if isinstance(e, MalformedBlock)] == [True]


def test_a_complete_forced_call_is_kept_when_the_next_is_cut(clients):
    bg, _, oai, _ = clients
    tokenizer = bg.server.worker.tokenizer
    limit = len(tokenizer.encode(TWO_CALLS[:TWO_CALLS.rindex("Rome")]))  # inside the second call
    for choice in ("auto", "required"):
        done = oai.chat.completions.create(**ask(tool_choice=choice, max_tokens=limit))
        calls = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "length", choice
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}], choice
    response = oai.responses.create(model=MODEL, input="Weather?", tools=[{"type": "function", **WEATHER}],
                                    tool_choice="required", max_output_tokens=limit, extra_body={"thinking": False})
    assert response.status == "incomplete" and [i.type for i in response.output] == ["function_call"]


# ---------------------------------------------------------------- reasoning tokens


def test_usage_counts_the_reasoning_tokens(clients):
    bg, generate, oai, _ = clients
    generate.script = "Hello!"
    reasoning_tokens = len(bg.server.worker.tokenizer.encode(REASONING))
    done = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=100)
    assert done.choices[0].message.content == "Hello!"
    assert done.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    plain = oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=100)
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    response = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=100)
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    streamed = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=100, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens


# ---------------------------------------------------------------- penalties


def penalized_greedy(logits: np.ndarray, steps: int, presence: float, frequency: float) -> list[int]:
    """OpenAI's definition, written out: logit -= count * frequency + (count > 0) * presence."""
    counts, out = np.zeros_like(logits), []
    for _ in range(steps):
        token = int(np.argmax(logits - counts * frequency - (counts > 0) * presence))
        counts[token] += 1
        out.append(token)
    return out


@pytest.mark.parametrize("presence, frequency", [(0.7, 0.0), (0.0, 0.4), (0.3, 0.5), (-0.5, 0.0), (0.0, -2.0)])
def test_penalties_follow_openais_definition(presence, frequency):
    logits = np.random.default_rng(1).normal(size=64).astype(np.float32)
    logits[:4] += 2.0  # a few close leaders, so that the penalties reorder them
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=frequency))
    drawn = [sampler(mx.array(logits)) for _ in range(12)]
    assert drawn == penalized_greedy(logits, 12, presence, frequency)
    assert penalized_greedy(logits, 12, 0, 0) == [int(np.argmax(logits))] * 12  # without them: one token


def test_a_penalty_changes_what_the_server_samples(bg):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 8, "temperature": 0}
    plain = requests.post(bg.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    penalized = requests.post(bg.url + "/v1/completions", json={**body, "frequency_penalty": 2.0},
                              timeout=60).json()["choices"][0]["text"]
    assert penalized != plain


# ---------------------------------------------------------------- refused with a 400


@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", {"presence_penalty": "x"}, "'presence_penalty' must be a number"),
    ("/v1/chat/completions", {"frequency_penalty": 2.5}, "'frequency_penalty' must be between -2 and 2"),
    ("/v1/chat/completions", {"logit_bias": {"999999999": 1}}, "'logit_bias' names token 999999999, past"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]},
     "'tools[0].function.parameters' must be a JSON Schema object"),
    ("/v1/responses", {"input": [{"type": "bogus"}]}, "input[0] is an item of type 'bogus'"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "nope"}]},
     "'tools[0].parameters' must be a JSON Schema object"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_none", "content": "x"}]}]},
     "tool_use_id 'toolu_none' answers no earlier tool_use block"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "f", "input_schema": "nope"}]}, "'tools[0].input_schema' must be a JSON Schema object"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, "no output can satisfy it"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "loop", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, "no output can satisfy it"),
])
def test_what_cannot_be_honoured_is_a_400(bg, path, body, words):
    defaults = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    response = requests.post(bg.url + path, json={**defaults, **body}, timeout=60)
    assert response.status_code == 400 and words in response.text, response.text


@pytest.mark.parametrize("digits", [4000, 5000])
def test_a_huge_integer_is_a_400_with_its_range(bg, digits):
    text = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}' % (MODEL, "9" * digits)
    response = requests.post(bg.url + "/v1/chat/completions", data=text,
                             headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == "'max_tokens' must be an integer from 1 to 2147483647"


# ---------------------------------------------------------------- control tokens


def test_control_tokens_never_reach_the_content(bg, oai):
    tokenizer = bg.server.worker.tokenizer
    controls = {tokenizer.id_of(t): t for t in ("<｜place▁holder▁no▁1｜>", THINK_END, "<｜User｜>", THINK_START)}
    bias = {str(i): 100 for i in controls}  # all but forced: only a mask can keep them out
    done = oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, logit_bias=bias)
    thinking = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=6, logit_bias=bias)
    for text in (done.choices[0].message.content, thinking.choices[0].message.content or "",
                 getattr(thinking.choices[0].message, "reasoning_content", None) or ""):
        assert not any(t in text for t in controls.values()), text


# ---------------------------------------------------------------- names and streams


def test_the_responses_stream_helper_reads_a_cut_answer(oai):
    # greedy: a sampled answer of the demo model may end before its third token
    with oai.responses.stream(model=MODEL, input="Hello", max_output_tokens=3, temperature=0,
                              extra_body={"thinking": False}) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type == "response.incomplete"  # what OpenAI's API sends when max_output_tokens is hit
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert [i.status for i in last.response.output] == ["incomplete"] and last.response.usage.output_tokens == 3


def test_the_responses_stream_helper_reads_reasoning_and_calls(clients):
    _, _, oai, _ = clients
    tools = [{"type": "function", **WEATHER}]
    with oai.responses.stream(model=MODEL, input="Weather?", tools=tools, max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["reasoning", "function_call", "function_call"]
    with oai.responses.stream(model=MODEL, input="Weather?", tools=tools, max_output_tokens=3) as stream:
        events = list(stream)  # cut inside the reasoning
    assert events[-1].type == "response.incomplete" and [i.type for i in events[-1].response.output] == ["reasoning"]
