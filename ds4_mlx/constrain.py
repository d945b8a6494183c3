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

from ds4_mlx.chat import (DSML, PARAMETER_END, THINK_END, THINK_START, TOOL_BLOCK_STARTS, TOOL_CALLS_START,
                          escape_attribute)

_ll_tokenizers = weakref.WeakKeyDictionary()  # tokenizer -> llguidance's view of it (seconds to build)
_control_ids = weakref.WeakKeyDictionary()  # tokenizer -> ids of its added tokens


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
    """`grammar`, or a ValueError saying why llguidance cannot use it, or that it admits no output at
    all (a schema whose `$ref`s only lead to each other: llguidance accepts it, then allows no token)."""
    import llguidance
    import llguidance.numpy

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    llguidance.numpy.fill_next_token_bitmask(matcher, llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size))
    if matcher.is_error():
        raise ValueError("no output can satisfy it (a $ref cycle, or constraints that exclude every value)")
    return grammar


_byte_tokenizers = []


def _byte_tokenizer():
    """An llguidance tokenizer of the 256 bytes and an end token: enough to ask whether a grammar admits
    any output before a request's tokenizer is at hand."""
    if not _byte_tokenizers:
        import llguidance
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(["<end>"])
        _byte_tokenizers.append(llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=len(alphabet) + 1,
                                                       eos_token=len(alphabet)))
    return _byte_tokenizers[0]


def _block_end_after_first_call(text: str) -> str | None:
    """When `text` (an answer) has closed the first invoke of a tool-call block: what must follow to close
    the block there; else None."""
    ends = []  # (where the first invoke ends, its tag prefix), of each spelling of a block start written
    for marker, prefix in TOOL_BLOCK_STARTS.items():
        start = text.find(marker)
        end = text.find(f"</{prefix}invoke>", start) if start >= 0 else -1
        if end >= 0:
            ends.append((end + len(f"</{prefix}invoke>"), prefix))
    if not ends:
        return None
    end, prefix = min(ends)
    written, closing = text[end:], f"\n</{prefix}tool_calls>"
    if closing.startswith(written):
        return closing[len(written):]
    return closing.lstrip("\n")


class OutputConstraint:
    """`grammar`: the answer follows it. `single_call` (without a grammar): the answer is free until it
    has written the first call of a tool-call block; then the block closes and the answer ends, so that
    it calls one tool at most (`parallel_tool_calls: false`)."""

    def __init__(self, tokenizer, *, thinking: bool, grammar: str | None = None, single_call: bool = False):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id
        self.think_end_id = tokenizer.id_of(THINK_END)
        self.phase = "thinking" if thinking else "answer"
        self.matcher = None
        self.single_call = single_call and grammar is None
        self.answer = ""  # the answer's text so far, while `single_call` watches for the first call's end
        self.held = []  # tokens of a character not complete yet
        if grammar is not None:
            self._follow(grammar)

    def _follow(self, grammar: str):
        import llguidance

        self.ll_tokenizer = _ll_tokenizer(self.tokenizer)
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
        elif self.single_call and token != self.eos_id:
            self.held.append(token)  # a character's bytes may span tokens: decoded once complete
            piece = self.tokenizer.decode(self.held)
            if piece.endswith("\ufffd") and len(self.held) < 4:
                return
            self.held = []
            self.answer += piece
            rest = _block_end_after_first_call(self.answer) if ">" in piece else None
            if rest is not None:
                self._follow(f"start: {_literal(rest)}" if rest else 'start: ""')


def _without(logits: mx.array, token: int) -> mx.array:
    drop = mx.arange(logits.shape[-1]) == token
    return mx.where(drop, -mx.inf, logits)



def _added_token_ids(tokenizer) -> dict:
    """{text: id} of the tokenizer's added tokens (none for a tokenizer without a tokenizer.json)."""
    if not hasattr(tokenizer, "to_json"):
        return {}
    if tokenizer not in _control_ids:
        added = json.loads(tokenizer.to_json()).get("added_tokens", [])
        _control_ids[tokenizer] = {t["content"]: t["id"] for t in added}
    return _control_ids[tokenizer]


class ControlTokenMask:
    """Keeps control tokens out of an answer: the template's markers, placeholders and the like (the
    tokenizer's added tokens) are markup, never text a client should read. EOS ends the answer and
    `DSML` spells tool calls, so both stay; `</think>` may end the reasoning, once, when the prompt
    opened it (its last token is `<think>`)."""

    def __init__(self, tokenizer, prompt_ids):
        ids = _added_token_ids(tokenizer)
        self.think_end_id = ids.get(THINK_END)
        kept = {getattr(tokenizer, "eos_id", None), ids.get(DSML), self.think_end_id}
        self.banned = [i for i in ids.values() if i not in kept]
        self.reasoning = bool(prompt_ids) and ids.get(THINK_START) is not None \
            and prompt_ids[-1] == ids[THINK_START]
        self._masks = None  # (in the reasoning, in the answer): [vocab] booleans, True where banned

    def mask(self, logits: mx.array) -> mx.array:
        return self._masked(logits, self.reasoning)

    def mask_rows(self, rows: mx.array, fed) -> mx.array:
        """`mask` for the logits after each token of `fed` (a verify's rows [n, vocab]): the reasoning
        closes where `fed` holds `</think>`."""
        reasoning, out = self.reasoning, []
        for row, token in zip(rows, fed):
            reasoning = reasoning and token != self.think_end_id
            out.append(self._masked(row, reasoning))
        return mx.stack(out)

    def _masked(self, logits, reasoning):
        if not self.banned and self.think_end_id is None:
            return logits
        if self._masks is None:
            vocab = logits.shape[-1]
            banned = np.zeros(vocab, dtype=bool)
            banned[[i for i in self.banned if i < vocab]] = True
            in_answer = banned.copy()
            if self.think_end_id is not None and self.think_end_id < vocab:
                in_answer[self.think_end_id] = True
            self._masks = mx.array(banned), mx.array(in_answer)
        return mx.where(self._masks[0 if reasoning else 1], -mx.inf, logits)

    def advance(self, token: int):
        if token == self.think_end_id:
            self.reasoning = False
