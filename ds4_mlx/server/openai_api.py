"""OpenAI Chat Completions (`/v1/chat/completions`) and Completions (`/v1/completions`)."""

import dataclasses
import time
import uuid

from ds4_mlx.chat import BOS, render
from ds4_mlx.server import protocol, schema
from ds4_mlx.server.assembly import AnswerMemory, ContentDelta, ReasoningDelta, TokenLogprob, ToolCall
from ds4_mlx.server.constraints import constrained, forced_tool_grammar, response_format_grammar
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field as get, note_ignored
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
        content = get(message, "content", (str, list), required=role in ("user", "tool", "function"))
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(part, str) and (kind != "text" or not isinstance(part.get("text"), str)):
                raise APIError(400, f"messages[{i}].content[{j}] is a {kind or 'non-text'} part: {protocol.TEXT_ONLY}",
                               param=f"messages[{i}].content")
        get(message, "reasoning_content", str)
        for j, call in enumerate(get(message, "tool_calls", list, [])):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise APIError(400, f"messages[{i}].tool_calls[{j}] needs a function with a name",
                               param=f"messages[{i}].tool_calls")
        out.append(message)
    return out


MAX_TOP_LOGPROBS = schema.CHAT["top_logprobs"].maximum


def chat_logprobs(body: dict) -> int | None:
    """`logprobs` (bool) with `top_logprobs` (0-20) as the number of alternatives, or None."""
    top = get(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(422, f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if not get(body, "logprobs", bool, False):
        if top is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def parse_chat(body: dict, info: ServerInfo, memory: AnswerMemory) -> Prepared:
    schema.check(body, schema.CHAT)
    note_ignored(body, schema.CHAT, "chat")
    protocol.refuse_unsupported(body, ("store",))
    model = info.model_name(body)
    messages = chat_messages(get(body, "messages", list, required=True))
    if not messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    choice = get(body, "tool_choice", (str, dict))
    tools = protocol.resolve_tool_choice(choice, protocol.function_tools(get(body, "tools", list)))
    thinking, effort = protocol.thinking_mode(body, model, info)
    text = render(memory.attach(messages), tools=tools, thinking=thinking, reasoning_effort=effort,
                  release=info.chat_release)
    protocol.log_replay_notes(text, "chat")
    sampling = dataclasses.replace(protocol.sampling(body), logprobs=chat_logprobs(body))
    parallel = get(body, "parallel_tool_calls", bool, True)
    grammar = forced_tool_grammar(choice, tools, parallel=parallel) or response_format_grammar(body)
    sampling = constrained(sampling, thinking=text.endswith("<think>"), grammar=grammar,
                           single_call=bool(tools) and not parallel)
    return Prepared(
        prompt_text=text, thinking=text.endswith("<think>"), tools=bool(tools),
        stream=get(body, "stream", bool, False),
        max_tokens=protocol.max_tokens(body, "max_completion_tokens", "max_tokens"),
        sampling=sampling, stop=protocol.stop_strings(body), model=model)


def parse_completions(body: dict, info: ServerInfo) -> list[tuple[str, Prepared]]:
    """(echo, prepared) per prompt: the raw text after BOS, no chat template (a prompt that starts with
    BOS is taken as it is); echo is the prompt when `echo` asks for it, else ""."""
    schema.check(body, schema.COMPLETIONS)
    note_ignored(body, schema.COMPLETIONS, "completions")
    protocol.refuse_unsupported(body, ("best_of", "suffix"))
    model = info.model_name(body)
    prompt = get(body, "prompt", (str, list), required=True)
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise APIError(400, "'prompt' must be a string or a non-empty array of strings", param="prompt")
    stream = get(body, "stream", bool, False)
    if stream and len(prompts) > 1:
        raise APIError(422, "streaming takes one prompt per request", param="prompt")
    top = get(body, "logprobs", int)
    if top is not None and not 0 <= top <= 5:
        raise APIError(422, "'logprobs' must be between 0 and 5", param="logprobs")
    echo = get(body, "echo", bool, False)
    if top is not None and echo:
        raise APIError(422, "'echo' with 'logprobs' is not supported: the prompt's log probabilities are not "
                            "computed", param="echo")
    sampling = dataclasses.replace(protocol.sampling(body), logprobs=top)
    return [(p if echo else "", Prepared(
        prompt_text=p if p.startswith(BOS) else BOS + p, thinking=False, tools=False, stream=stream,
        max_tokens=protocol.max_tokens(body, "max_tokens"), sampling=sampling, stop=protocol.stop_strings(body),
        model=model, param="prompt")) for p in prompts]


def include_usage(body: dict) -> bool:
    options = get(body, "stream_options", dict, {})
    return get(options, "include_usage", bool, False)


def usage(outcome, answer=None) -> dict:
    """OpenAI's usage; with the answer, the completion tokens that were reasoning."""
    out = {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
           "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}
    if answer is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": answer.reasoning_tokens}
    out["ds4_mlx"] = request_figures(outcome)  # an extension OpenAI clients ignore: what the prompt cost
    return out


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def chat_logprobs_json(entries: list[TokenLogprob]) -> dict:
    def one(text, logprob):
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**one(e.text, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs_json(entries: list[TokenLogprob], offset: int = 0) -> dict:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


def merge_completions(bodies: list[dict]) -> dict:
    """The bodies of one completion per prompt as one response with a choice per prompt."""
    merged = {**bodies[0], "choices": [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]}
    merged["usage"] = {k: sum(b["usage"][k] for b in bodies) for k in ("prompt_tokens", "completion_tokens",
                                                                        "total_tokens")}
    merged["usage"]["prompt_tokens_details"] = {
        "cached_tokens": sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)}
    return merged


# ---------------------------------------------------------------- responses


def stream_end(responder, last: tuple, outcome, answer=None) -> list:
    """The end of a stream: its `last` chunk (with the finish reason), the usage chunk when the client
    asked for it, then [DONE]."""
    usage_chunk = [(None, {**last[1], "choices": [], "usage": usage(outcome, answer)})] \
        if responder.include_usage else []
    return [last, *usage_chunk, (None, "[DONE]")]


def stream_error(message: str) -> list:
    return [(None, APIError(500, message).openai_body()), (None, "[DONE]")]


class ChatResponder:
    def __init__(self, prepared: Prepared, *, include_usage: bool):
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = prepared.model
        self.include_usage = include_usage
        self.tool_index = 0
        self.logprobs = prepared.sampling.logprobs is not None

    def _chunk(self, delta: dict, finish_reason=None, logprobs=None) -> tuple:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if logprobs:
            choice["logprobs"] = chat_logprobs_json(logprobs)
        return None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                      "model": self.model, "choices": [choice]}

    def start(self, started) -> list:
        return [self._chunk({"role": "assistant", "content": ""})]

    def deltas(self, events) -> list:
        out = []
        logprobs = [e for e in events if isinstance(e, TokenLogprob)]
        for event in events:
            if isinstance(event, ReasoningDelta):
                out.append(self._chunk({"reasoning_content": event.text}))
            elif isinstance(event, ContentDelta):
                out.append(self._chunk({"content": event.text}))
            elif isinstance(event, ToolCall):
                out.append(self._chunk({"tool_calls": [tool_call_json(event, self.tool_index)]}))
                self.tool_index += 1
        if logprobs:  # with the text they belong to, or alone while the parser holds that text back
            if out:
                out[-1] = self._chunk(out[-1][1]["choices"][0]["delta"], logprobs=logprobs)
            else:
                out.append(self._chunk({}, logprobs=logprobs))
        return out

    def end(self, outcome, answer) -> list:
        return stream_end(self, self._chunk({}, answer.finish_reason(outcome.finish_reason)), outcome, answer)

    error = staticmethod(stream_error)

    def body(self, outcome, answer) -> dict:
        message = {"role": "assistant", "content": answer.content}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [tool_call_json(c) for c in answer.tool_calls]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message,
                             "logprobs": chat_logprobs_json(answer.logprobs) if self.logprobs else None,
                             "finish_reason": answer.finish_reason(outcome.finish_reason)}],
                "usage": usage(outcome, answer)}


class CompletionResponder:
    """Legacy completions: the text as the model wrote it (the prepared request parses no reasoning),
    after the prompt with `echo`."""

    def __init__(self, prepared: Prepared, *, include_usage: bool, echo: str = ""):
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = prepared.model
        self.include_usage = include_usage
        self.echo = echo
        self.logprobs = prepared.sampling.logprobs is not None
        self.offset = 0  # characters of text sent, for the logprobs' text offsets

    def _chunk(self, text: str, finish_reason=None, logprobs=None) -> tuple:
        return None, {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                      "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def start(self, started) -> list:
        return [self._chunk(self.echo)] if self.echo else []

    def deltas(self, events) -> list:
        text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        entries = [e for e in events if isinstance(e, TokenLogprob)]
        if not text and not entries:
            return []
        logprobs = completion_logprobs_json(entries, self.offset) if self.logprobs else None
        self.offset += sum(len(e.text) for e in entries)
        return [self._chunk(text, logprobs=logprobs)]

    def end(self, outcome, answer) -> list:
        return stream_end(self, self._chunk("", outcome.finish_reason), outcome)

    error = staticmethod(stream_error)

    def body(self, outcome, answer) -> dict:
        logprobs = completion_logprobs_json(answer.logprobs) if self.logprobs else None
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": self.echo + answer.content, "logprobs": logprobs,
                             "finish_reason": outcome.finish_reason}],
                "usage": usage(outcome)}
