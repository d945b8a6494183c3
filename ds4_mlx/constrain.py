"""Constrained decoding: masks on the next-token logits that make the answer take a required shape.

`OutputConstraint` acts on the answer, after the reasoning: while the model thinks it is free (except
that it may not stop before `</think>`); then it must write one of the `forced` texts (the opening of a
tool call naming one of the allowed tools, for a forced `tool_choice`), then, given a grammar, only what
the grammar allows (JSON for `response_format`, checked by llguidance over the real tokenizer's
vocabulary), then stop.

`stream_generate` takes it through `SamplingParams.constraint`, a factory called with the tokenizer, so
each generation gets a fresh state:

    sampling = SamplingParams(constraint=lambda tok: OutputConstraint(tok, thinking=True,
                                                                      grammar=json_grammar(schema)))
"""

import weakref

import mlx.core as mx
import numpy as np

from ds4_mlx.chat import THINK_END

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

    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema if schema is not None else {"type": "object"},
        defaults={"whitespace_flexible": False})
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


class OutputConstraint:
    def __init__(self, tokenizer, *, thinking: bool, forced: tuple[str, ...] = (), grammar: str | None = None):
        self.eos_id = tokenizer.eos_id
        self.think_end_id = tokenizer.id_of(THINK_END)
        self.forced = [tokenizer.encode(text) for text in forced]  # the alternatives still possible: what is left
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
        if self.forced:
            return _only(logits, sorted({ids[0] for ids in self.forced}))
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
        elif self.forced:
            self.forced = [ids[1:] for ids in self.forced if ids[0] == token]
            if any(not ids for ids in self.forced):
                self.forced = []
        elif self.matcher is not None and token != self.eos_id:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constrained decoding: {self.matcher.get_error()}")


def _only(logits: mx.array, ids: list[int]) -> mx.array:
    keep = mx.zeros(logits.shape, dtype=mx.bool_)
    keep[mx.array(ids)] = True
    return mx.where(keep, logits, -mx.inf)


def _without(logits: mx.array, token: int) -> mx.array:
    drop = mx.arange(logits.shape[-1]) == token
    return mx.where(drop, -mx.inf, logits)

