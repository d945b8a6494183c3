"""One answer put together from streamed model text: reasoning, content and tool calls.

`Answer.feed(text)` returns the `ReasoningDelta` / `ContentDelta` / `ToolCall` events that text completes
(from `ds4_mlx.chat.OutputParser`) and keeps the totals a non-streamed response needs; `feed_chunk` takes
a generation chunk and adds its token's `TokenLogprob`, when asked for, as one more event. The server
remembers the exact DSML block behind each tool call id (`ToolCallMemory`), so when a client sends the
call back, the prompt holds the very tokens the model sampled and the live session still matches.
"""

import logging
import uuid
from collections import OrderedDict

from ds4_mlx.chat import ContentDelta, MalformedBlock, OutputParser, ReasoningDelta, ToolCall
from ds4_mlx.generate import TokenLogprob

__all__ = ["Answer", "ToolCallMemory", "ContentDelta", "ReasoningDelta", "ToolCall", "TokenLogprob"]

log = logging.getLogger("ds4_mlx.server")


class Answer:
    def __init__(self, *, thinking: bool, tools: bool, tool_memory: "ToolCallMemory | None" = None,
                 tool_id_prefix: str = "call_"):
        self._parser = OutputParser(thinking=thinking, tools=tools,
                                    make_id=lambda: tool_id_prefix + uuid.uuid4().hex)
        self._tool_memory = tool_memory
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []

    def feed(self, text: str) -> list:
        return self._collect(self._parser.feed(text)) if text else []

    def feed_chunk(self, chunk) -> list:
        events = self.feed(chunk.text)
        if chunk.logprob is not None:
            self.logprobs.append(chunk.logprob)
            events.append(chunk.logprob)
        return events

    def finish(self) -> list:
        return self._collect(self._parser.finish())

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
                if self._tool_memory is not None:
                    self._tool_memory.remember(event)
            elif isinstance(event, MalformedBlock):
                log.warning("a tool-call block that does not parse was left out of the answer (%d characters): "
                            "%.200r", len(event.text), event.text)
        return events


class ToolCallMemory:
    """Tool call id -> the DSML block it was sampled in, bounded (oldest forgotten first)."""

    def __init__(self, capacity: int = 10000):
        self._blocks: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity

    def remember(self, call: ToolCall):
        self._blocks[call.id] = call.dsml
        self._blocks.move_to_end(call.id)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    def attach(self, messages: list[dict]) -> list[dict]:
        """Give each assistant message whose tool calls all came from one remembered block its `dsml`."""
        out = []
        for message in messages:
            if "dsml" in message:  # verbatim model text comes from this memory only, never from a client
                message = {k: v for k, v in message.items() if k != "dsml"}
            calls = message.get("tool_calls") or []
            ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
            blocks = {self._blocks.get(i) if isinstance(i, str) else None for i in ids}
            if message.get("role") == "assistant" and calls and len(blocks) == 1 and None not in blocks:
                block = blocks.pop()
                if block.count("invoke name=") == len(calls):  # the client kept every call of the block
                    message = {**message, "dsml": block}
            out.append(message)
        return out
