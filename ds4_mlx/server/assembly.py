"""One answer put together from streamed model text: reasoning, content and tool calls.

`Answer.feed(text)` returns the `ReasoningDelta` / `ContentDelta` / `ToolCall` events that text completes
(from `ds4_mlx.chat.OutputParser`) and keeps the totals a non-streamed response needs; `feed_chunk` takes
a generation chunk and adds its token's `TokenLogprob`, when asked for, as one more event. The server
remembers the tokens each answer was sampled as (`AnswerMemory`), so when a client sends the answer back
(found by its tool call ids, or its text), the prompt holds those very tokens, never the text
re-tokenized, and the live session still matches.
"""

import json
import logging
import uuid
from collections import OrderedDict

from ds4_mlx.chat import (THINK_END, ContentDelta, MalformedBlock, OutputParser, ReasoningDelta, Sampled,
                          ToolCall, content_text)
from ds4_mlx.generate import TokenLogprob

__all__ = ["Answer", "AnswerMemory", "NamespaceAnswers", "ContentDelta", "ReasoningDelta", "ToolCall", "TokenLogprob"]

log = logging.getLogger("ds4_mlx.server")


class Answer:
    def __init__(self, *, thinking: bool, tools: bool, memory: "NamespaceAnswers | None" = None,
                 tool_id_prefix: str = "call_"):
        self._parser = OutputParser(thinking=thinking, tools=tools,
                                    make_id=lambda: tool_id_prefix + uuid.uuid4().hex)
        self._thinking = thinking
        self._memory = memory
        self._stats = None  # the generation's figures, from its last chunk
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []
        self.reasoning_tokens = 0  # sampled tokens of the reasoning (its closing `</think>` not counted)

    def feed(self, text: str) -> list:
        return self._collect(self._parser.feed(text)) if text else []

    def feed_chunk(self, chunk) -> list:
        self._stats = chunk.stats or self._stats
        events = self.feed(chunk.text)
        stop_token = chunk.finish_reason == "stop" and not chunk.text
        if chunk.token is not None and self._parser.state == "reasoning" and not stop_token:
            self.reasoning_tokens += 1  # fed and still reasoning: the token that ends it switches the state
        if chunk.logprob is not None:
            self.logprobs.append(chunk.logprob)
            events.append(chunk.logprob)
        return events

    def finish(self) -> list:
        events = self._collect(self._parser.finish())
        sampled = self.sampled() if self._memory is not None else None
        if sampled is not None:
            self._memory.remember(sampled, [call.id for call in self.tool_calls])
        return events

    def sampled(self) -> Sampled | None:
        """The answer with its sampled tokens, when its parts rendered in the template's order (reasoning,
        content, tool calls) are exactly the text sampled; else None (cut inside the reasoning or by a stop
        string, content after a tool call, markup left out): then it is replayed from its text."""
        if self._stats is None or self._stats.output_text is None:
            return None
        blocks = list(dict.fromkeys(call.dsml for call in self.tool_calls))  # each block once, in order
        parts = (self.reasoning + THINK_END if self._thinking else "") + self.content + "".join(blocks)
        if parts != self._stats.output_text:
            return None
        return Sampled(parts, self._stats.output_ids, thinking=self._thinking, reasoning=self.reasoning,
                       content=self.content, calls=[(c.name, json.loads(c.arguments)) for c in self.tool_calls])

    def finish_reason(self, generation_finish: str) -> str:
        """OpenAI's finish reason: tool_calls when the answer ended on tool calls."""
        if generation_finish == "stop" and self.tool_calls:
            return "tool_calls"
        return generation_finish

    def _collect(self, events: list) -> list:
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.reasoning += event.text
            elif isinstance(event, ContentDelta):
                self.content += event.text
            elif isinstance(event, ToolCall):
                self.tool_calls.append(event)
            elif isinstance(event, MalformedBlock) and event.cut:
                log.warning("the output ended inside a tool call, which was left out of the answer (%d characters): "
                            "%.200r", len(event.text), event.text)
            elif isinstance(event, MalformedBlock):
                log.warning("a tool-call block that does not parse was left out of the answer (%d characters): "
                            "%.200r", len(event.text), event.text)
        return events


class AnswerMemory:
    """The latest answers as `Sampled` (their tokens), found by tool call id or by content, bounded (the
    oldest forgotten first): a client sends back what it was given, so what matters is the recent past.
    Each namespace (tenant) finds only the answers it was given: `of(namespace)` is its view. Another
    tenant's answer would change how a prompt is tokenized, so its `prompt_tokens` and its output would
    tell whether some tenant was given that text."""

    def __init__(self, capacity: int = 1024):
        self._answers: OrderedDict[int, Sampled] = OrderedDict()
        self._keys: dict = {}  # (namespace, "call", id) or (namespace, "content", text) -> answer key
        self._capacity = capacity
        self._next = 0

    def of(self, namespace: str) -> "NamespaceAnswers":
        return NamespaceAnswers(self, namespace)

    def remember(self, sampled: Sampled, call_ids=(), namespace: str = ""):
        key, self._next = self._next, self._next + 1
        self._answers[key] = sampled
        for call_id in call_ids:
            self._keys[(namespace, "call", call_id)] = key
        if sampled.content and not call_ids:
            self._keys[(namespace, "content", sampled.content)] = key
        while len(self._answers) > self._capacity:
            self._answers.popitem(last=False)
        if len(self._keys) > 4 * self._capacity:
            self._keys = {k: v for k, v in self._keys.items() if v in self._answers}

    def attach(self, messages: list[dict], namespace: str = "") -> list[dict]:
        """Give each assistant message this server answered in `namespace` its `sampled` answer
        (`chat.render` decides whether the message still says the same); a client cannot supply one."""
        out = []
        for message in messages:
            message = {k: v for k, v in message.items() if k != "sampled"}
            if message.get("role") == "assistant":
                calls = message.get("tool_calls") or []
                ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
                keys = [(namespace, "call", i) if isinstance(i, str) else None for i in ids] or \
                    [(namespace, "content", content_text(message.get("content")))]
                found = {self._keys.get(k) if k else None for k in keys}
                if len(found) == 1 and (key := found.pop()) in self._answers:
                    message["sampled"] = self._answers[key]
            out.append(message)
        return out


class NamespaceAnswers:
    """One namespace's view of an `AnswerMemory`: what the API parsers and `Answer` are given."""

    def __init__(self, memory: AnswerMemory, namespace: str):
        self._memory, self.namespace = memory, namespace

    def remember(self, sampled: Sampled, call_ids=()):
        self._memory.remember(sampled, call_ids, self.namespace)

    def attach(self, messages: list[dict]) -> list[dict]:
        return self._memory.attach(messages, self.namespace)
