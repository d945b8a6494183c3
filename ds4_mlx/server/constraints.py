"""Request fields that shape the output, enforced while sampling (`ds4_mlx.constrain`):
a forced tool choice (OpenAI `tool_choice: "required"` or a named function, Anthropic `any` or `tool`)
makes the answer open a tool call naming the function, or one of the tools; `response_format`
`json_object` / `json_schema` lets only JSON (matching the schema) be written."""

import dataclasses

from ds4_mlx.chat import DSML, TOOL_CALLS_START, escape_attribute
from ds4_mlx.constrain import OutputConstraint, json_grammar
from ds4_mlx.generate import SamplingParams
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field as get
from ds4_mlx.server.protocol import tool_choice_name


def forced_tool_call(choice, tools) -> tuple[str, ...]:
    """The texts a forced tool choice lets the answer start with, one per allowed tool (none when
    nothing is forced). `choice` and `tools` as `protocol.resolve_tool_choice` checked and returned them."""
    if not tools or choice in (None, "auto"):
        return ()
    if choice in ("required", "any"):
        names = [t["function"]["name"] for t in tools]
    else:
        names = [tool_choice_name(choice)]
    return tuple(f"\n\n{TOOL_CALLS_START}\n<{DSML}invoke name=\"{escape_attribute(name)}\">\n" for name in names)


def response_format_grammar(body: dict, name: str = "response_format") -> str | None:
    """The grammar of OpenAI's `response_format` (None for text). For the Responses API pass
    `text.format`'s owner: the schema sits beside `type` there rather than under `json_schema`."""
    spec = get(body, name, dict)
    if spec is None:
        return None
    kind = get(spec, "type", str, required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(None)
    if kind != "json_schema":
        raise APIError(422, f"{name}.type must be text, json_object or json_schema, not '{kind}'", param=name)
    holder = get(spec, "json_schema", dict) or spec
    schema = get(holder, "schema", dict, {})
    try:
        return json_grammar(schema)
    except ValueError as e:
        raise APIError(400, f"{name}: the JSON schema cannot be used: {e}", param=name) from None


def constrained(sampling: SamplingParams, *, thinking: bool, forced: tuple[str, ...] = (), grammar: str | None = None):
    """`sampling` with the constraint that writes one of `forced`, then follows `grammar`, after the reasoning."""
    if not forced and grammar is None:
        return sampling
    return dataclasses.replace(sampling, constraint=lambda tokenizer: OutputConstraint(
        tokenizer, thinking=thinking, forced=forced, grammar=grammar))
