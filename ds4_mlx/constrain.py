"""Constrained decoding: masks on the next-token logits that make the answer take a required shape.

`OutputConstraint` acts on the answer, after the reasoning: while the model thinks it is free (except
that it may not stop before `</think>`); then, given a grammar, it writes only what the grammar allows
(checked by llguidance over the real tokenizer's vocabulary), then stops. The grammars: JSON for
`response_format` (`json_grammar`), and a whole DSML tool-call block whose parameters follow each tool's
JSON schema, for a forced `tool_choice` (`tool_call_grammar`): such a call always parses.

`stream_generate` takes it through `SamplingParams.constraint`, a factory called with the tokenizer, so
each generation gets a fresh state:

    sampling = SamplingParams(constraint=lambda tok: OutputConstraint(tok, thinking=True,
                                                                      grammar=json_grammar(schema)))
"""

import json
import weakref

import mlx.core as mx
import numpy as np

from ds4_mlx.chat import DSML, PARAMETER_END, THINK_END, TOOL_CALLS_START, escape_attribute

_ll_tokenizers = weakref.WeakKeyDictionary()  # tokenizer -> llguidance's view of it (seconds to build)


def _ll_tokenizer(tokenizer):
    import llguidance

    if tokenizer not in _ll_tokenizers:
        _ll_tokenizers[tokenizer] = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
                                                           eos_token=tokenizer.eos_id)
    return _ll_tokenizers[tokenizer]


def json_grammar(schema: dict | None) -> str:
    """The llguidance grammar for JSON matching `schema` (None: any JSON object). A ValueError names
    what is wrong with the schema."""
    import llguidance

    return check_grammar(llguidance.LLMatcher.grammar_from_json_schema(
        schema if schema is not None else {"type": "object"}, defaults={"whitespace_flexible": False}))


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal is a JSON string


def _string_schema(schema) -> bool:
    """Whether a parameter's value is written raw (`string="true"`): a string type, or only string values."""
    if not isinstance(schema, dict):
        return False
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values:
        return all(isinstance(v, str) for v in values)
    return schema.get("type") == "string"


def _parameter_value(schema, root: dict) -> tuple[str, str]:
    """(string attribute, Lark expression through the closing parameter tag) of one parameter's value."""
    end = _literal(PARAMETER_END)
    if _string_schema(schema):
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if values:
            escaped = (v.replace(PARAMETER_END, "&lt;" + PARAMETER_END[1:]) for v in values)
            return "true", "(" + " | ".join(_literal(v) for v in escaped) + ") " + end
        return "true", "raw_text"
    schema = schema if isinstance(schema, dict) else {}
    shared = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in schema}
    return "false", f"%json {json.dumps({**schema, **shared}, ensure_ascii=False)} {end}"


def tool_call_grammar(tools: list[dict], *, repeat: bool) -> str:
    """The llguidance grammar of a DSML tool-call block, as `chat.OutputParser` reads it: calls of
    `tools` (OpenAI function tools), one or (`repeat`) more, each writing its schema's properties in
    schema order (the required ones always, the others optionally), strings raw and other values as
    JSON matching their schema. A tool whose schema lists no properties takes any parameters."""
    newline, end = _literal("\n"), _literal(PARAMETER_END)
    raw, as_json = _literal(' string="true">'), _literal(' string="false">')
    rules = [f"raw_text[suffix={end}]: /(.|\\n)*/",
             f'any_parameter: {_literal(f"<{DSML}parameter name=")} /"[A-Za-z0-9_.-]+"/ '
             f"({raw} raw_text | {as_json} %json {{}} {end}) {newline}"]
    invokes = []
    for t, tool in enumerate(tools):
        function = tool.get("function", tool)
        schema = function.get("parameters") or {}
        properties = schema.get("properties") if isinstance(schema, dict) else None
        parameters = []
        if isinstance(properties, dict) and properties:
            required = set(schema.get("required") or ())
            for p, (name, sub) in enumerate(properties.items()):
                is_string, value = _parameter_value(sub, schema)
                opening = f'<{DSML}parameter name="{escape_attribute(name)}" string="{is_string}">'
                rules.append(f"p{t}_{p}: {_literal(opening)} {value} {newline}")
                parameters.append(f"p{t}_{p}" + ("" if name in required else "?"))
        else:
            parameters.append("any_parameter*")
        opening = f'<{DSML}invoke name="{escape_attribute(function["name"])}">\n'
        closing = _literal(f"</{DSML}invoke>\n")
        rules.append(f"invoke{t}: {_literal(opening)} {' '.join(parameters)} {closing}")
        invokes.append(f"invoke{t}")
    calls = "(" + " | ".join(invokes) + ")" + ("+" if repeat else "")
    block_start, block_end = _literal(f"\n\n{TOOL_CALLS_START}\n"), _literal(f"</{DSML}tool_calls>")
    start = f"start: {block_start} {calls} {block_end}"
    return "\n".join([start] + rules)


def check_grammar(grammar: str) -> str:
    """`grammar`, or a ValueError saying why llguidance cannot use it."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


class OutputConstraint:
    def __init__(self, tokenizer, *, thinking: bool, grammar: str | None = None):
        self.eos_id = tokenizer.eos_id
        self.think_end_id = tokenizer.id_of(THINK_END)
        self.phase = "thinking" if thinking else "answer"
        self.matcher = None
        if grammar is not None:
            import llguidance

            self.ll_tokenizer = _ll_tokenizer(tokenizer)
            self.matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar)

    def mask(self, logits: mx.array) -> mx.array:
        """`logits` ([vocab]) with the tokens not allowed next set to -inf."""
        if self.phase == "thinking":
            return _without(logits, self.eos_id)
        if self.matcher is not None:
            import llguidance.numpy

            bitmask = llguidance.numpy.allocate_token_bitmask(1, self.ll_tokenizer.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask)
            allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:logits.shape[-1]]
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.shape[0]))
            return mx.where(mx.array(allowed.astype(bool)), logits, -mx.inf)
        return logits

    def advance(self, token: int):
        """Take the sampled token."""
        if self.phase == "thinking":
            if token == self.think_end_id:
                self.phase = "answer"
        elif self.matcher is not None and token != self.eos_id:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constrained decoding: {self.matcher.get_error()}")


def _without(logits: mx.array, token: int) -> mx.array:
    drop = mx.arange(logits.shape[-1]) == token
    return mx.where(drop, -mx.inf, logits)

