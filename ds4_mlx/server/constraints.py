"""Request fields that shape the output, enforced while sampling (`ds4_mlx.constrain`):
a forced tool choice (OpenAI `tool_choice: "required"` or a named function, Anthropic `any` or `tool`)
makes the answer a whole DSML tool-call block calling that function (or any of the tools), its arguments
following the tool's schema, so the call always parses; `response_format` `json_object` / `json_schema`
lets only JSON (matching the schema) be written; `parallel_tool_calls: false` (Anthropic's
`disable_parallel_tool_use`) lets the answer call one tool at most."""

import dataclasses

from ds4_mlx.constrain import OutputConstraint, check_grammar, json_grammar, tool_call_grammar
from ds4_mlx.generate import SamplingParams
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field as get
from ds4_mlx.server.protocol import tool_choice_name


def forced_tool_grammar(choice, tools, *, parallel: bool = True) -> str | None:
    """The grammar of the answer a forced tool choice asks for (None when nothing is forced): one call of
    the named function, or one (or, when `parallel`, more) calls of any of the tools. `choice` and `tools`
    as `protocol.resolve_tool_choice` checked and returned them."""
    if not tools or choice in (None, "auto"):
        return None
    name = None if choice in ("required", "any") else tool_choice_name(choice)
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    try:
        return check_grammar(tool_call_grammar(chosen, repeat=name is None and parallel))
    except ValueError as e:
        raise APIError(400, f"tool_choice: the tools' parameter schemas cannot be used: {e}",
                       param="tool_choice") from None


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


def constrained(sampling: SamplingParams, *, thinking: bool, grammar: str | None, single_call: bool = False):
    """`sampling` with the constraint that the answer, after the reasoning, follows `grammar`, or (with
    `single_call` and no grammar) ends once it has called one tool."""
    if grammar is None and not single_call:
        return sampling
    return dataclasses.replace(sampling, constraint=lambda tokenizer: OutputConstraint(
        tokenizer, thinking=thinking, grammar=grammar, single_call=single_call))
