"""Constrained decoding over the real tokenizer: the reasoning is free but cannot stop, then only what the
grammar (JSON, or a DSML tool call whose parameters follow the tools' schemas) allows, then EOS. Driven by
random logits, so that only the constraint can make the answer valid."""

import json

import mlx.core as mx
import pytest

from ds4_mlx.chat import THINK_END, TOOL_CALLS_START, parse_tool_block
from ds4_mlx.constrain import OutputConstraint, json_grammar, tool_call_grammar
from ds4_mlx.demo import load_for_cli

OPENING = f"\n\n{TOOL_CALLS_START}\n"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return load_for_cli(None)[1]


def run(constraint, tokenizer, steps=400, seed=0, bias=None):
    """Greedy over random logits (plus `bias`) through the constraint, until EOS; the decoded text."""
    key = mx.random.key(seed)
    out = []
    for _ in range(steps):
        key, draw = mx.random.split(key)
        logits = mx.random.normal((tokenizer.vocab_size,), key=draw)
        if bias is not None:
            logits = logits + bias
        token = int(mx.argmax(constraint.mask(logits)).item())
        constraint.advance(token)
        if token == tokenizer.eos_id:
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError("no EOS: " + tokenizer.decode(out))


def test_json_schema_after_the_reasoning(tokenizer):
    eos, think_end = tokenizer.eos_id, tokenizer.id_of(THINK_END)
    # the reasoning may end only through </think>: EOS is pushed up, yet never drawn before it
    bias = mx.zeros((tokenizer.vocab_size,))
    bias[eos] = 50.0
    constraint = OutputConstraint(tokenizer, thinking=True, grammar=json_grammar(SCHEMA))
    for _ in range(3):
        assert int(mx.argmax(constraint.mask(bias)).item()) != eos
        constraint.advance(5)
    constraint.advance(think_end)
    text = run(constraint, tokenizer, bias=bias)
    value = json.loads(text)
    assert set(value) == {"ok", "tag"} and isinstance(value["ok"], bool) and value["tag"] in ("x", "y")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"enum": [1, 2, 3]},
                                               "note": {"const": "a</｜DSML｜parameter>b"}},
              "required": ["unit"]}}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {
              "ok": {"type": "boolean"}}, "required": ["ok"]}}}]


def test_a_forced_tool_call_parses_and_follows_the_schemas(tokenizer):
    for seed in range(3):
        constraint = OutputConstraint(tokenizer, thinking=False, grammar=tool_call_grammar(TOOLS, repeat=True))
        text = run(constraint, tokenizer, seed=seed)
        assert text.startswith(OPENING)
        calls = parse_tool_block(text[len(OPENING):-len("</｜DSML｜tool_calls>")], "｜DSML｜")
        for name, arguments in calls:
            if name == "get_weather":
                assert arguments["unit"] in ("C", "F") and arguments.get("days", 1) in (1, 2, 3)
                assert arguments.get("note", "a</｜DSML｜parameter>b") == "a</｜DSML｜parameter>b"
            else:
                assert name == "ping" and isinstance(arguments["ok"], bool)
    one = OutputConstraint(tokenizer, thinking=False, grammar=tool_call_grammar(TOOLS[1:], repeat=False))
    assert run(one, tokenizer).count("invoke name=") == 1


def test_a_bad_schema_is_a_value_error():
    with pytest.raises(ValueError):
        json_grammar({"type": "objectish"})
