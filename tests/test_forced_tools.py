"""Forced tool calls (`tool_choice` "required" or a named tool) are written under a grammar of the DSML call
with the tool's JSON schema, so even the demo model's random weights give a call that parses, through every
API, streamed or not; a DSML block that does not parse is never shown as content."""

import json
import logging

from ds4_mlx.tools.testing import DEMO_MODEL_ID as MODEL
# bounded parameters (an enum and a boolean), so that random weights finish the call within the cap
SET_UNIT = {"name": "set_unit", "description": "Choose the unit",
            "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "metric": {"type": "boolean"}},
                           "required": ["unit", "metric"]}}
TOOLS = [{"type": "function", "function": SET_UNIT}]
CAP = 120


SERVER_OPTIONS = {"max_tokens": CAP}


def check_arguments(arguments):
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert arguments["unit"] in ("C", "F") and isinstance(arguments["metric"], bool)


def test_a_forced_call_parses_in_chat_completions(oai):
    request = dict(model="deepseek-chat", messages=[{"role": "user", "content": "Units?"}], tools=TOOLS,
                   max_tokens=CAP, seed=3)
    done = oai.chat.completions.create(**request, tool_choice="required")
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and not message.content, message
    for call in message.tool_calls:
        assert call.function.name == "set_unit"
        check_arguments(call.function.arguments)
    named = {"type": "function", "function": {"name": "set_unit"}}
    chunks = list(oai.chat.completions.create(**request, tool_choice=named, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # no markup streamed as text
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    check_arguments(calls[0].function.arguments)


def test_a_forced_call_parses_in_messages_and_responses(oai, claude):
    message = claude.messages.create(model=MODEL, max_tokens=CAP, messages=[{"role": "user", "content": "Units?"}],
                                     tool_choice={"type": "tool", "name": "set_unit"},
                                     tools=[{"name": "set_unit", "input_schema": SET_UNIT["parameters"]}])
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    check_arguments(message.content[0].input)
    response = oai.responses.create(model=MODEL, input="Units?", tools=[{"type": "function", **SET_UNIT}],
                                    tool_choice="required", max_output_tokens=CAP,
                                    extra_body={"thinking": False, "seed": 3})
    assert [item.type for item in response.output] and {item.type for item in response.output} == {"function_call"}
    for item in response.output:
        check_arguments(item.arguments)


def test_a_forced_call_cut_by_the_token_limit_is_not_shown(oai, caplog):
    caplog.set_level(logging.WARNING, logger="ds4_mlx.server")
    done = oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "Units?"}],
                                       tools=TOOLS, tool_choice="required", max_tokens=10)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "length" and not message.content and not message.tool_calls
    assert "the output ended inside a tool call, which was left out" in caplog.text
