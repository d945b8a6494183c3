"""OpenAI Chat Completions (`/v1/chat/completions`) and Completions (`/v1/completions`)."""

import time
import uuid

from ds4_mlx.chat import render, render_completion
from ds4_mlx.server import protocol
from ds4_mlx.server.assembly import ContentDelta, ReasoningDelta, ToolCall, ToolCallMemory
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field as get
from ds4_mlx.server.protocol import Prepared, ServerInfo
from ds4_mlx.server.sessions_api import request_figures

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# ---------------------------------------------------------------- requests


def chat_messages(messages: list) -> list[dict]:
    """The request's messages, checked: each an object with a known role, text content (a string, null
    or text parts) and, for the assistant, tool calls with a function name."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = get(message, "role", str, required=True)
        if role not in ROLES:
            raise APIError(422, f"messages[{i}].role '{role}' is not one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role")
        get(message, "content", (str, list))
        get(message, "reasoning_content", str)
        for j, call in enumerate(get(message, "tool_calls", list, [])):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise APIError(400, f"messages[{i}].tool_calls[{j}] needs a function with a name",
                               param=f"messages[{i}].tool_calls")
        out.append(message)
    return out


def parse_chat(body: dict, info: ServerInfo, tool_memory: ToolCallMemory) -> Prepared:
    model = info.model_name(body)
    messages = chat_messages(get(body, "messages", list, required=True))
    if not messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    if get(body, "n", int, 1) != 1:
        raise APIError(422, "only n=1 is supported", param="n")
    tools = protocol.resolve_tool_choice(get(body, "tool_choice", (str, dict)),
                                         protocol.function_tools(get(body, "tools", list)))
    thinking, effort = protocol.thinking_mode(body, model, info)
    text = render(tool_memory.attach(messages), tools=tools, thinking=thinking, reasoning_effort=effort)
    return Prepared(
        prompt_text=text, thinking=text.endswith("<think>"), tools=bool(tools),
        stream=get(body, "stream", bool, False),
        max_tokens=protocol.max_tokens(body, "max_completion_tokens", "max_tokens"),
        sampling=protocol.sampling(body), stop=protocol.stop_strings(body), model=model)


def parse_completion(body: dict, info: ServerInfo) -> Prepared:
    model = info.model_name(body)
    prompt = get(body, "prompt", (str, list), required=True)
    if isinstance(prompt, list):
        if not prompt or not isinstance(prompt[0], str):
            raise APIError(400, "'prompt' must be a string or an array of strings", param="prompt")
        prompt = prompt[0]
    thinking, effort = protocol.thinking_mode(body, model, info)
    text = render_completion(prompt, thinking=thinking, reasoning_effort=effort)
    return Prepared(
        prompt_text=text, thinking=False, tools=False, stream=get(body, "stream", bool, False),
        max_tokens=protocol.max_tokens(body, "max_tokens"), sampling=protocol.sampling(body),
        stop=protocol.stop_strings(body), model=model, param="prompt")


def include_usage(body: dict) -> bool:
    options = get(body, "stream_options", dict, {})
    return get(options, "include_usage", bool, False)


def usage(outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "ds4_mlx": request_figures(outcome)}  # an extension OpenAI clients ignore: what the prompt cost


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


# ---------------------------------------------------------------- responses


class ChatResponder:
    def __init__(self, prepared: Prepared, *, include_usage: bool):
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = prepared.model
        self.include_usage = include_usage
        self.tool_index = 0

    def _chunk(self, delta: dict, finish_reason=None) -> tuple:
        return None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                      "model": self.model,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    def start(self, started) -> list:
        return [self._chunk({"role": "assistant", "content": ""})]

    def deltas(self, events) -> list:
        out = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out.append(self._chunk({"reasoning_content": event.text}))
            elif isinstance(event, ContentDelta):
                out.append(self._chunk({"content": event.text}))
            elif isinstance(event, ToolCall):
                out.append(self._chunk({"tool_calls": [tool_call_json(event, self.tool_index)]}))
                self.tool_index += 1
        return out

    def end(self, outcome, answer) -> list:
        out = [self._chunk({}, answer.finish_reason(outcome.finish_reason))]
        if self.include_usage:
            out.append((None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.model, "choices": [], "usage": usage(outcome)}))
        return out + [(None, "[DONE]")]

    def error(self, message: str) -> list:
        return [(None, APIError(500, message).openai_body()), (None, "[DONE]")]

    def body(self, outcome, answer) -> dict:
        message = {"role": "assistant", "content": answer.content}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [tool_call_json(c) for c in answer.tool_calls]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": answer.finish_reason(outcome.finish_reason)}],
                "usage": usage(outcome)}


class CompletionResponder:
    """Legacy completions: the text as the model wrote it (the prepared request parses no reasoning)."""

    def __init__(self, prepared: Prepared, *, include_usage: bool):
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = prepared.model
        self.include_usage = include_usage

    def _chunk(self, text: str, finish_reason=None) -> tuple:
        return None, {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                      "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def start(self, started) -> list:
        return []

    def deltas(self, events) -> list:
        return [self._chunk(event.text) for event in events if isinstance(event, ContentDelta)]

    def end(self, outcome, answer) -> list:
        out = [self._chunk("", outcome.finish_reason)]
        if self.include_usage:
            out.append((None, {"id": self.id, "object": "text_completion", "created": self.created,
                               "model": self.model, "choices": [], "usage": usage(outcome)}))
        return out + [(None, "[DONE]")]

    def error(self, message: str) -> list:
        return [(None, APIError(500, message).openai_body()), (None, "[DONE]")]

    def body(self, outcome, answer) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": answer.content, "logprobs": None,
                             "finish_reason": outcome.finish_reason}],
                "usage": usage(outcome)}

