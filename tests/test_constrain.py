"""Constrained decoding over the real tokenizer: the reasoning is free but cannot stop, a forced opening is
written token by token, then only what the JSON grammar allows, then EOS. Driven by random logits, so
that only the constraint can make the answer valid."""

import json

import mlx.core as mx
import pytest

from ds4_mlx.chat import THINK_END
from ds4_mlx.constrain import OutputConstraint, json_grammar
from ds4_mlx.demo import load_for_cli

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


def test_a_forced_opening_names_one_of_the_tools_then_is_free(tokenizer):
    openings = [f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n'
                for name in ("get_weather", "get_time")]
    for seed in range(3):
        constraint = OutputConstraint(tokenizer, thinking=False, forced=tuple(openings))
        key, ids = mx.random.key(seed), []
        while constraint.forced:
            key, draw = mx.random.split(key)
            token = int(mx.argmax(constraint.mask(mx.random.normal((tokenizer.vocab_size,), key=draw))).item())
            constraint.advance(token)
            ids.append(token)
        assert tokenizer.decode(ids) in openings
    logits = mx.random.normal((tokenizer.vocab_size,))
    assert mx.array_equal(constraint.mask(logits), logits)  # free again


def test_a_bad_schema_is_a_value_error():
    with pytest.raises(ValueError):
        json_grammar({"type": "objectish"})
