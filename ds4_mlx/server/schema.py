"""The request fields each endpoint accepts, with their types and ranges: one list, read both by the
validation (`check`, a 400 naming the field) and by `/openapi.json` (`json_schema`), so that the two
cannot drift. Fields outside the list are ignored (logged at debug level), so that a newer client keeps
working; a listed field with a wrong type, a value out of range or not among its choices is a 400.

The API modules check the parts of a field this list does not spell out (a message's content blocks, a
tool's schema) and what depends on the model (a token id against the vocabulary).
"""

from dataclasses import dataclass

from ds4_mlx.server.errors import APIError

INT32_MAX = 2**31 - 1
INT64 = (-2**63, 2**63 - 1)
_JSON_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "array": "an array", "object": "an object"}


@dataclass(frozen=True)
class Field:
    """One request field: its JSON types, and for numbers a closed range, for strings the allowed values,
    for objects the fields inside that are checked too, for arrays the type of their items; or a field
    the server refuses, and why."""

    types: tuple
    doc: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    properties: dict | None = None
    items: "Field | None" = None
    required: bool = False
    refused: str | None = None  # why a request that sets it is a 400 (a field of the API not implemented)


def string(doc="", *, choices=None, required=False) -> Field:
    return Field(("string",), doc, choices=tuple(choices) if choices else None, required=required)


def integer(lo, hi, doc="", *, required=False) -> Field:
    return Field(("integer",), doc, minimum=lo, maximum=hi, required=required)


def number(lo, hi, doc="") -> Field:
    return Field(("number",), doc, minimum=lo, maximum=hi)


def boolean(doc="") -> Field:
    return Field(("boolean",), doc)


def array(doc="", *, items=None, required=False) -> Field:
    return Field(("array",), doc, items=items, required=required)


def obj(doc="", **properties) -> Field:
    return Field(("object",), doc, properties=properties or None)


def either(*types, doc="", required=False) -> Field:
    return Field(tuple(types), doc, required=required)


# ---------------------------------------------------------------- the fields, shared first

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's, and DeepSeek's max
ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")
MODEL = string("the model: the served id or deepseek-v4-flash, deepseek-chat (no thinking), deepseek-reasoner")
STREAM = boolean("answer with server-sent events")
STREAM_OPTIONS = obj("stream options", include_usage=boolean("a last chunk with the usage"))
OUTPUT_TOKENS = integer(1, INT32_MAX, "the most tokens to generate (the context caps it too)")
SAMPLING = {
    "temperature": number(0, 2, "sampling temperature; 0 is greedy"),
    "top_p": number(0, 1, "nucleus sampling mass"),
    "top_k": integer(-1, INT32_MAX, "keep the k most likely tokens; 0 or -1: off"),
    "min_p": number(0, 1, "drop tokens below this fraction of the most likely one's probability"),
    "seed": integer(*INT64, "a seed makes sampling reproducible"),
}
PENALTIES = {
    "presence_penalty": number(-2, 2, "subtracted from the logit of every token already generated"),
    "frequency_penalty": number(-2, 2, "subtracted from a token's logit once per time it was generated"),
}
LOGIT_BIAS = obj("token id (a string of digits, below the vocabulary size) -> bias from -100 to 100")
STOP = either("string", "array", doc="stop sequences: the content ends before the first")
THINKING = {
    "thinking": Field(("boolean", "object"), "think first: a boolean, or {type: enabled | disabled | adaptive}",
                      properties={"type": string(choices=("enabled", "disabled", "adaptive"))}),
    "think": boolean("think first (the same as thinking)"),
    "reasoning_effort": string("how hard to think; max is Think Max where the context allows it",
                               choices=EFFORTS),
}
STATELESS = "this server is stateless, replay the full input"
PARALLEL = boolean("false: the answer calls one tool at most")
TOOL_CHOICE = either("string", "object", doc="none, auto, required or a named function")
SALT = {"cache_salt": string("requests reuse each other's sessions only under the same API key and salt")}

CHAT = {
    "model": MODEL,
    "messages": array("the conversation", items=Field(("object",)), required=True),
    "n": integer(1, 1, "choices per request: one"),
    "tools": array("function tools", items=Field(("object",))),
    "tool_choice": TOOL_CHOICE,
    "parallel_tool_calls": PARALLEL,
    **THINKING,
    "stream": STREAM,
    "stream_options": STREAM_OPTIONS,
    "max_completion_tokens": OUTPUT_TOKENS,
    "max_tokens": OUTPUT_TOKENS,
    **SAMPLING,
    **PENALTIES,
    "stop": STOP,
    "logprobs": boolean("each token's log probability"),
    "top_logprobs": integer(0, 20, "alternatives per token, with logprobs"),
    "response_format": obj("text, json_object or json_schema",
                           type=string(choices=("text", "json_object", "json_schema"), required=True)),
    "logit_bias": LOGIT_BIAS,
    "store": boolean("only false: nothing is stored"),
    **SALT,
}

COMPLETIONS = {
    "model": MODEL,
    "prompt": either("string", "array", doc="a text, or an array of texts (a choice each)", required=True),
    "n": integer(1, 1, "choices per prompt: one"),
    "best_of": integer(1, 1, "candidates per prompt: one"),
    "echo": boolean("the prompt before the completion"),
    "logprobs": integer(0, 5, "each token's log probability with this many alternatives"),
    "stream": STREAM,
    "stream_options": STREAM_OPTIONS,
    "max_tokens": OUTPUT_TOKENS,
    **SAMPLING,
    **PENALTIES,
    "stop": STOP,
    "logit_bias": LOGIT_BIAS,
    **SALT,
}

ANTHROPIC_TOOL_CHOICE = obj("auto, any, tool (with a name) or none",
                            type=string(choices=("auto", "any", "tool", "none"), required=True),
                            name=string("the tool, with type tool"),
                            disable_parallel_tool_use=boolean("true: the answer calls one tool at most"))
ANTHROPIC_THINKING = obj("{type: enabled | adaptive | disabled, display: summarized | omitted}",
                         type=string(choices=("enabled", "disabled", "adaptive"), required=True),
                         budget_tokens=integer(0, INT32_MAX, "accepted; thinking ends when the model ends it"),
                         display=string(choices=("summarized", "omitted")))
MESSAGES_REQUEST = {
    "model": MODEL,
    "system": either("string", "array", doc="the system prompt, text or text blocks"),
    "messages": array("the conversation", items=Field(("object",)), required=True),
    "tools": array("client tools (server tools are left out)", items=Field(("object",))),
    "tool_choice": ANTHROPIC_TOOL_CHOICE,
    "thinking": ANTHROPIC_THINKING,
    "output_config": obj("{effort}: max is Think Max where the context allows it",
                         effort=string(choices=ANTHROPIC_EFFORTS)),
    **SALT,
}
MESSAGES = {
    **MESSAGES_REQUEST,
    "max_tokens": integer(1, INT32_MAX, "the most tokens to generate", required=True),
    "stream": STREAM,
    "stop_sequences": array("stop sequences", items=string()),
    "temperature": number(0, 1, "sampling temperature; 0 is greedy"),
    "top_p": number(0, 1, "nucleus sampling mass"),
    "top_k": integer(-1, INT32_MAX, "keep the k most likely tokens; 0 or -1: off"),
}
COUNT_TOKENS = MESSAGES_REQUEST

RESPONSES = {
    "model": MODEL,
    "input": either("string", "array", doc="a text, or input items: messages, reasoning, function calls and "
                    "their outputs", required=True),
    "instructions": string("the system prompt"),
    "tools": array("function tools (built-in tools are left out)", items=Field(("object",))),
    "tool_choice": TOOL_CHOICE,
    "parallel_tool_calls": PARALLEL,
    "reasoning": obj("{effort}", effort=string(choices=EFFORTS), summary=string()),
    **THINKING,
    "stream": STREAM,
    "max_output_tokens": OUTPUT_TOKENS,
    "max_tokens": OUTPUT_TOKENS,
    **SAMPLING,
    "text": obj("{format: {type: text | json_object | json_schema, schema}}",
                format=obj(type=string(choices=("text", "json_object", "json_schema"), required=True))),
    "metadata": obj("echoed in the response"),
    "store": boolean("only false: nothing is stored"),
    "previous_response_id": Field(("string",), refused=STATELESS),
    "conversation": Field(("string", "object"), refused=STATELESS),
    **SALT,
}

TOKENIZE = {
    "content": string("the text", required=True),
    "with_pieces": boolean("each id with its text"),
    "add_special": boolean("BOS first"),
    "parse_special": boolean("special-token strings become their ids (default true)"),
}
DETOKENIZE = {"tokens": array("token ids", items=integer(0, INT32_MAX), required=True)}

ENDPOINTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT_TOKENS,
    "/v1/responses": RESPONSES,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}


# ---------------------------------------------------------------- validation


def json_type(value) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value))


def matches_type(value, types) -> bool:
    kind = json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def check(body: dict, fields: dict, where: str = ""):
    """A 400 for the first field of `fields` in `body` that is missing though required, of a wrong type,
    out of its range or not among its choices; null counts as absent."""
    for name, spec in fields.items():
        path = f"{where}{name}"
        value = body.get(name)
        if value is None:
            if spec.required:
                raise APIError(400, f"missing required field '{path}'", param=path)
            continue
        if spec.refused:
            raise APIError(400, f"'{path}' is not supported: {spec.refused}", param=path)
        check_value(value, spec, path)


def check_value(value, spec: Field, path: str):
    if not matches_type(value, spec.types):
        expected = " or ".join(_JSON_TYPES[t] for t in spec.types)
        raise APIError(400, f"'{path}' must be {expected}", param=path)
    if spec.minimum is not None and json_type(value) in ("integer", "number"):
        if not spec.minimum <= value <= spec.maximum:  # NaN fails too
            raise APIError(400, f"'{path}' must be {_range(spec)}", param=path)
    if spec.choices is not None and value not in spec.choices:
        raise APIError(400, f"'{path}' must be one of {', '.join(spec.choices)}, not '{value}'", param=path)
    if spec.properties and isinstance(value, dict):
        check(value, spec.properties, path + ".")
    if spec.items is not None and isinstance(value, list):
        for i, item in enumerate(value):
            check_value(item, spec.items, f"{path}[{i}]")


def _range(spec: Field) -> str:
    if spec.minimum == spec.maximum:
        return f"{spec.minimum:g}"
    if "integer" in spec.types:
        return f"an integer from {spec.minimum} to {spec.maximum}"
    return f"between {spec.minimum:g} and {spec.maximum:g}"


# ---------------------------------------------------------------- OpenAPI


def json_schema(spec: Field) -> dict:
    """The JSON Schema of one field, as /openapi.json lists it."""
    types = list(spec.types)
    out = {"type": types[0] if len(types) == 1 else types}
    if spec.doc or spec.refused:
        out["description"] = spec.doc or f"refused (a 400): {spec.refused}"
    if spec.minimum is not None:
        out["minimum"], out["maximum"] = spec.minimum, spec.maximum
    if spec.choices is not None:
        out["enum"] = list(spec.choices)
    if spec.properties:
        out["properties"] = {k: json_schema(v) for k, v in spec.properties.items()}
        required = [k for k, v in spec.properties.items() if v.required]
        if required:
            out["required"] = required
    if spec.items is not None:
        out["items"] = json_schema(spec.items)
    return out


def body_schema(fields: dict) -> dict:
    return {"type": "object", "required": [k for k, v in fields.items() if v.required],
            "properties": {k: json_schema(v) for k, v in fields.items()}}
