"""Every request field of every endpoint, walked from `ds4_mlx.server.schema` (the list `/openapi.json`
shows and the validation reads): a good value is answered (and, for the sampling fields, reaches the
sampler as given), a wrong type and a value out of range are a 400 naming the field. A field added to
the schema is walked too, so the list stays honest.

The generation is a stub here (one token, no model run): what is tested is what each field does to the
request, not the model's answer."""

import json
import logging

import pytest
import requests

from ds4_mlx.generate import GenerationChunk, GenerationStats
from ds4_mlx.server import schema
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.tools.testing import DEMO_MODEL_ID as MODEL, demo_server

HUGE = "__HUGE__"  # replaced in the body's JSON text by an integer of that many digits
WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = {"/v1/chat/completions": [{"type": "function", "function": WEATHER}],
         "/v1/responses": [{"type": "function", **WEATHER}],
         "/v1/messages": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]}
TOOLS["/v1/messages/count_tokens"] = TOOLS["/v1/messages"]
MINIMAL = {  # each endpoint's required fields
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1]},
}
# good values the type alone does not tell; a tuple: (value, other fields the value needs)
GOOD = {
    "model": "deepseek-chat",
    "messages": [{"role": "user", "content": "hi"}],
    "prompt": ["hi", "there"],
    "input": [{"type": "message", "role": "user", "content": "hi"}],
    "content": "hi",
    "tokens": [1, 2],
    "system": "Be brief.",
    "instructions": "Be brief.",
    "stop": ["\n\n"],
    "stop_sequences": ["END"],
    "logit_bias": {"5": 1.5},
    "cache_salt": "tenant-a",
    "store": False,
    "parallel_tool_calls": False,
    "top_logprobs": (3, {"logprobs": True}),
    "response_format": {"type": "json_object"},
    "response_format.type": ("json_schema", {}),  # the walk of each choice fills in the rest
    "text.format.type": ("json_object", {}),
    "reasoning.summary": "auto",
    "tool_choice.name": ("get_weather", {}),
}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls", "tool_choice.type", "tool_choice.name",
               "tool_choice.disable_parallel_tool_use"}
# what being honoured means, seen in what the generation was given: {field: (call, value) -> bool}
HONOURED = {
    **{name: (lambda name: lambda call, value: getattr(call["sampling"], name) == value)(name)
       for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty")},
    **{name: lambda call, value: call["max_tokens"] == value
       for name in ("max_tokens", "max_completion_tokens", "max_output_tokens")},
    "logit_bias": lambda call, value: call["sampling"].logit_bias == {int(k): v for k, v in value.items()},
    "stop": lambda call, value: list(call["stop_strings"]) == value,
    "stop_sequences": lambda call, value: list(call["stop_strings"]) == value,
    "top_logprobs": lambda call, value: call["sampling"].logprobs == value,
    "logprobs": lambda call, value: call["sampling"].logprobs == (0 if value is True else value),
    "response_format": lambda call, value: call["constraint"].matcher is not None,
    "text": lambda call, value: value.get("format", {}).get("type") in (None, "text") or call["constraint"].matcher,
    "parallel_tool_calls": lambda call, value: call["constraint"].single_call is (value is False),
}


class OneTokenGenerate:
    """Stands in for `stream_generate`: records its arguments and answers one token at once."""

    def __init__(self):
        self.calls = []

    def __call__(self, session, tokenizer, prompt_ids, **options):
        constraint = options["sampling"].constraint
        # built here as the real generation builds it: a grammar that cannot be built fails the request
        self.calls.append({**options, "constraint": constraint(tokenizer) if constraint else None})
        stats = GenerationStats(prompt_tokens=len(prompt_ids), computed_tokens=len(prompt_ids), completion_tokens=1,
                                output_ids=[], output_text="")
        yield GenerationChunk(text="", token=tokenizer.eos_id, finish_reason="stop", stats=stats)


@pytest.fixture(scope="module")
def served():
    generate = OneTokenGenerate()
    with BackgroundServer(demo_server(generate=generate)) as bg:
        yield bg, generate


def _good(path: str, field: str, spec: schema.Field):
    """[(value, other fields)] of good values: each choice of a field with choices, else one value."""
    if field == "tools":
        return [(TOOLS[path], {})]
    if field == "tool_choice" and "string" in spec.types:
        return [("required", {}), ({"type": "function", "name": "get_weather"} if path == "/v1/responses" else
                                   {"type": "function", "function": {"name": "get_weather"}}, {})]
    if field in GOOD:
        value = GOOD[field]
        return [value if isinstance(value, tuple) else (value, {})]
    if spec.choices:
        return [(choice, {}) for choice in spec.choices]
    kind = spec.types[0]
    if kind == "boolean":
        return [(True, {})]
    if kind == "integer":
        return [(spec.minimum, {})]
    if kind == "number":
        return [(spec.maximum, {})]
    if kind == "object":
        return [({name: _good(path, f"{field}.{name}", sub)[0][0] for name, sub in (spec.properties or {}).items()
                  if sub.required}, {})]
    raise AssertionError(f"{path} {field}: no good value known; add one to GOOD")


def _wrong_type(spec: schema.Field):
    return next(v for v in ("x", 1.5, True, [], {}) if not schema.matches_type(v, spec.types))


def _out_of_range(spec: schema.Field) -> list:
    if spec.choices:
        return ["bogus"]
    if spec.minimum is None:
        return []
    step = 1 if "integer" in spec.types else 0.5
    out = [spec.minimum - step, spec.maximum + step]
    return out + ([HUGE + "4000", HUGE + "5000"] if "integer" in spec.types else [])


def _fields(fields: dict, prefix=""):
    """(dotted name, spec) of every field, nested ones too."""
    for name, spec in fields.items():
        yield prefix + name, spec
        if spec.properties:
            yield from _fields(spec.properties, prefix + name + ".")


def _body(path: str, field: str, value, others: dict) -> dict:
    body = {**MINIMAL[path], "model": MODEL} if path.startswith("/v1/") else dict(MINIMAL[path])
    if field in TOOL_FIELDS or field.startswith("tool_choice"):
        body["tools"] = TOOLS[path]
    body.update(others)
    names = field.split(".")
    holder = body
    spec_fields = schema.ENDPOINTS[path]
    for name in names[:-1]:  # a nested field sits in its parent with the parent's required fields
        parent = spec_fields[name]
        holder = holder.setdefault(name, {})
        for sibling, sub in (parent.properties or {}).items():
            if sub.required and sibling not in holder:
                holder[sibling] = _good(path, f"{name}.{sibling}", sub)[0][0]
        spec_fields = parent.properties
    holder[names[-1]] = value
    _complete(path, field, value, body)
    return body


def _complete(path: str, field: str, value, body: dict):
    """What a good value needs beside it: a schema for json_schema, a name for a named tool."""
    if field == "response_format.type" and value == "json_schema":
        body["response_format"]["json_schema"] = {"name": "x", "schema": {"type": "object"}}
    if field == "text.format.type" and value == "json_schema":
        body["text"]["format"]["schema"] = {"type": "object"}
    if field == "tool_choice.type" and value == "tool":
        body["tool_choice"]["name"] = "get_weather"
    if field == "tool_choice.name":
        body["tool_choice"]["type"] = "tool"


def _post(bg, path: str, body: dict):
    text = json.dumps(body)
    if HUGE in text:
        start = text.index('"' + HUGE)
        end = text.index('"', start + 1)
        text = text[:start] + "9" * int(text[start + 1 + len(HUGE):end]) + text[end + 1:]
    return requests.post(bg.url + path, data=text, headers={"Content-Type": "application/json"}, timeout=60)


CASES = []
for _path, _fields_of in schema.ENDPOINTS.items():
    for _field, _spec in _fields(_fields_of):
        if _spec.refused:
            CASES.append((_path, _field, "refused", "x", {}))
            continue
        for _value, _others in _good(_path, _field, _spec):
            CASES.append((_path, _field, "good", _value, _others))
        CASES.append((_path, _field, "wrong type", _wrong_type(_spec), {}))
        CASES += [(_path, _field, "out of range", v, {}) for v in _out_of_range(_spec)]


@pytest.mark.parametrize("path, field, kind, value, others", CASES,
                         ids=[f"{p} {f} {k} {str(v)[:12]}" for p, f, k, v, _ in CASES])
def test_every_field_is_honoured_or_refused(served, path, field, kind, value, others):
    bg, generate = served
    response = _post(bg, path, _body(path, field, value, others))
    if kind == "good":
        assert response.status_code == 200, (field, value, response.text)
        if field in HONOURED and path.startswith("/v1/") and "count_tokens" not in path:
            assert HONOURED[field](generate.calls[-1], value), (field, value)
        return
    assert response.status_code == 400, (field, str(value)[:40], response.text)
    message = response.text
    assert f"'{field}'" in message or (field == "cache_salt" and "'cache_salt'" in message), message
    assert "set_int_max_str_digits" not in message


def test_the_openapi_document_lists_every_field_with_its_range(served):
    bg, _ = served
    paths = requests.get(bg.url + "/openapi.json", timeout=10).json()["paths"]
    for path, fields in schema.ENDPOINTS.items():
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(body["properties"]) == set(fields), path
        for name, spec in fields.items():
            listed = body["properties"][name]
            if spec.minimum is not None:
                assert (listed["minimum"], listed["maximum"]) == (spec.minimum, spec.maximum), (path, name)
            if spec.choices:
                assert listed["enum"] == list(spec.choices), (path, name)
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["presence_penalty"]["minimum"] == -2 and chat["properties"]["max_tokens"]["minimum"] == 1


def test_a_refused_request_leaves_one_log_line(served, caplog):
    bg, _ = served
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    response = _post(bg, "/v1/chat/completions", {**MINIMAL["/v1/chat/completions"], "presence_penalty": "x"})
    assert response.status_code == 400
    lines = [r.getMessage() for r in caplog.records if r.name == "ds4_mlx.server"]
    assert lines == ["POST /v1/chat/completions 400: 'presence_penalty' must be a number"], lines
