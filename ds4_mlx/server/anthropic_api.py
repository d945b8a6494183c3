"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`).

Requests are turned into the OpenAI-style messages `ds4_mlx.chat.render` takes: thinking blocks become
`reasoning_content`, tool_use blocks `tool_calls`, tool_result blocks `tool` messages, and system
messages among the messages stay where they stand. Thinking happens only when `thinking` asks for it.
Fields the server has no use for are ignored (logged at debug level); text it cannot read (images,
documents, unknown blocks with content) is a 400 rather than dropped. Streams follow
Anthropic's event sequence: message_start, content_block_start / _delta / _stop per block (thinking,
text, tool_use), message_delta with the stop reason and usage, message_stop.
"""

import base64
import json
import uuid

from ds4_mlx.chat import render
from ds4_mlx.server import protocol, schema
from ds4_mlx.server.assembly import AnswerMemory, ContentDelta, ReasoningDelta, ToolCall
from ds4_mlx.server.constraints import constrained, forced_tool_grammar
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field as get, note_ignored, number_in, positive_int, string_list
from ds4_mlx.server.protocol import Prepared, ServerInfo
from ds4_mlx.server.sse import sse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---------------------------------------------------------------- requests

TEXT_ONLY = protocol.TEXT_ONLY
# Keys of a content block that hold no text for the model: a block of an unknown type with nothing
# else is skipped (a newer client's marker), one that carries more is refused rather than dropped.
META_KEYS = {"type", "cache_control", "citations", "id", "signature"}
EFFORTS = schema.ANTHROPIC_EFFORTS
SIGNATURE_PREFIX = "ds4r1:"  # a thinking block's signature: this prefix, then its reasoning in base64


def _other_block(block: dict, where: str):
    """A block the server does not render: media is a 400, an unknown type only when it has content."""
    kind = block["type"]
    if kind in ("image", "document", "file", "container_upload") or "source" in block:
        raise APIError(400, f"{where} is a {kind} block: {TEXT_ONLY}", param=where)
    if any(value not in (None, "", [], {}) for key, value in block.items() if key not in META_KEYS):
        raise APIError(400, f"{where}: content blocks of type '{kind}' are not supported", param=where)


def _typed_blocks(blocks: list, where: str, param: str):
    """(where each block is, block) for an array of content blocks, each checked to be a typed object."""
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise APIError(400, f"{at} must be a content block with a type", param=param)
        yield at, block


def _text_of(blocks, where: str) -> list:
    """Text parts of a string or an array of blocks."""
    if isinstance(blocks, str):
        return [blocks]
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or an array of content blocks", param=where)
    texts = []
    for at, block in _typed_blocks(blocks, where, where):
        if block["type"] == "text":
            texts.append(get(block, "text", str, ""))
        elif block["type"] == "tool_reference":  # a tool search's answer: the tool is in `tools` now
            texts.append(get(block, "tool_name", str, required=True))
        else:
            _other_block(block, at)
    return texts


def system_text(system) -> str:
    """The system prompt; Claude Code's per-request `x-anthropic-` header block is dropped, since it
    changes on every request and would break the shared prefix."""
    parts = [t for t in _text_of(system, "system") if not t.startswith("x-anthropic-")]
    return "\n\n".join(parts)


def chat_messages(system, messages: list) -> list[dict]:
    """Anthropic messages as chat messages. A `system` message among them (Claude Code sends its
    environment that way) is rendered where it stands; before any other message it joins the system block."""
    if not messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    out = [{"role": "system", "content": system_text(system)}] if system else []
    tool_use_ids = set()  # of the tool_use blocks so far: a tool_result answers one of them
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        role = get(message, "role", str, required=True)
        if role not in ("user", "assistant", "system"):
            raise APIError(422, f"{where}.role must be user, assistant or system, not '{role}'", param=f"{where}.role")
        content = get(message, "content", (str, list), required=True)
        if role == "system":
            leading = all(m["role"] == "system" for m in out)
            out.append({"role": "system", "content": system_text(content), "in_place": not leading})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "user":
            out += _user_blocks(content, where, tool_use_ids)
        else:
            out.append(_assistant_blocks(content, where))
            tool_use_ids.update(call["id"] for call in out[-1].get("tool_calls", ()))
    return out


def _user_blocks(blocks: list, where: str, tool_use_ids: set) -> list[dict]:
    out, texts = [], []
    for at, block in _typed_blocks(blocks, f"{where}.content", where):
        if block["type"] == "tool_result":
            tool_use_id = get(block, "tool_use_id", str, required=True)
            text = "".join(_text_of(block.get("content") or "", f"{at}.content"))
            if tool_use_id not in tool_use_ids:
                raise APIError(400, f"{at}.tool_use_id '{tool_use_id}' answers no earlier tool_use block",
                               param=f"{at}.tool_use_id")
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
        elif block["type"] == "text":
            texts.append(get(block, "text", str, ""))
        else:
            _other_block(block, at)
    if texts:
        out.append({"role": "user", "content": [{"type": "text", "text": t} for t in texts]})
    return out


def _assistant_blocks(blocks: list, where: str) -> dict:
    reasoning, texts, calls = [], [], []
    for at, block in _typed_blocks(blocks, f"{where}.content", where):
        kind = block["type"]
        if kind == "thinking":
            reasoning.append(get(block, "thinking", str, "") or reasoning_of(get(block, "signature", str, "")))
        elif kind == "text":
            texts.append({"type": "text", "text": get(block, "text", str, "")})
        elif kind == "tool_use":
            arguments = json.dumps(get(block, "input", dict, {}), ensure_ascii=False)
            calls.append({"id": get(block, "id", str, required=True), "type": "function",
                          "function": {"name": get(block, "name", str, required=True), "arguments": arguments}})
        else:
            _other_block(block, at)
    message = {"role": "assistant", "content": texts, "reasoning_content": "".join(reasoning)}
    if calls:
        message["tool_calls"] = calls
    return message


def signature(reasoning: str) -> str:
    """A thinking block's signature holds its reasoning, so that a client which was not shown the
    reasoning (`display: omitted`) still gives it back and the prompt matches the live session."""
    return SIGNATURE_PREFIX + base64.b64encode(reasoning.encode()).decode()


def reasoning_of(signature_: str) -> str:
    if not signature_.startswith(SIGNATURE_PREFIX):
        return ""  # another server's signature: the reasoning is lost, as with any client that drops it
    try:
        return base64.b64decode(signature_[len(SIGNATURE_PREFIX):], validate=True).decode()
    except ValueError:
        raise APIError(400, "a thinking block's signature is damaged", param="messages") from None


def chat_tools(tools: list | None) -> list[dict] | None:
    """Client tools as OpenAI function tools; server tools (web search and the like, which have no
    input_schema) are left out, since this server cannot run them."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}] must be an object with a name", param=f"tools[{i}]")
        if "input_schema" in tool:
            protocol.check_parameters(tool["input_schema"], f"tools[{i}].input_schema")
            out.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description", ""), "parameters": tool["input_schema"]}})
    return out or None


def tool_choice(choice: dict | None):
    if choice is None:
        return None
    kind = get(choice, "type", str, required=True)
    if kind == "tool":
        return {"name": get(choice, "name", str, required=True)}
    if kind not in ("auto", "any", "none"):
        raise APIError(422, f"tool_choice.type must be auto, any, tool or none, not '{kind}'", param="tool_choice")
    return kind


def thinking_mode(body: dict, model: str, info: ServerInfo) -> tuple[bool, str | None, bool]:
    """(thinking, reasoning effort, reasoning shown) as Anthropic's API has it: thinking only when
    `thinking` asks for it (enabled or adaptive; `display: omitted` hides the text), or for the
    deepseek-reasoner alias; `output_config.effort` max is Think Max where the context allows it."""
    thinking = get(body, "thinking", dict)
    effort = get(get(body, "output_config", dict, {}), "effort", str)
    if effort is not None and effort not in EFFORTS:
        raise APIError(422, f"output_config.effort must be one of {', '.join(EFFORTS)}, not '{effort}'",
                       param="output_config.effort")
    if effort == "max" and info.ctx < protocol.THINK_MAX_MIN_CTX:
        effort = None  # Think Max needs a long context; normal thinking instead
    if thinking is None:
        return model == "deepseek-reasoner", effort, True
    kind = get(thinking, "type", str, required=True)
    if kind not in ("enabled", "disabled", "adaptive"):
        raise APIError(422, f"thinking.type must be enabled, adaptive or disabled, not '{kind}'", param="thinking")
    display = get(thinking, "display", str, "summarized")
    if display not in ("summarized", "omitted"):
        raise APIError(422, f"thinking.display must be summarized or omitted, not '{display}'", param="thinking")
    return kind != "disabled", effort, display != "omitted"


def parse_messages(body: dict, info: ServerInfo, memory: AnswerMemory, *, counting=False) -> Prepared:
    schema.check(body, schema.COUNT_TOKENS if counting else schema.MESSAGES)
    note_ignored(body, schema.COUNT_TOKENS if counting else schema.MESSAGES, "messages")
    model = info.model_name(body, anthropic=True)
    max_tokens = positive_int(body, "max_tokens")
    if max_tokens is None and not counting:
        raise APIError(400, "missing required field 'max_tokens'", param="max_tokens")
    messages = chat_messages(get(body, "system", (str, list)), get(body, "messages", list, required=True))
    choice = tool_choice(get(body, "tool_choice", dict))
    tools = protocol.resolve_tool_choice(choice, chat_tools(get(body, "tools", list)))
    thinking, effort, shown = thinking_mode(body, model, info)
    text = render(memory.attach(messages), tools=tools, thinking=thinking, reasoning_effort=effort,
                  release=info.chat_release)
    protocol.log_replay_notes(text, "messages")
    defaults = protocol.SamplingParams()
    sampling = protocol.SamplingParams(
        temperature=number_in(body, "temperature", 0.0, 1.0, defaults.temperature),
        top_p=number_in(body, "top_p", 0.0, 1.0, defaults.top_p), top_k=get(body, "top_k", int, defaults.top_k),
        min_p=defaults.min_p)
    parallel = not get(get(body, "tool_choice", dict, {}), "disable_parallel_tool_use", bool, False)
    sampling = constrained(sampling, thinking=text.endswith("<think>"),
                           grammar=forced_tool_grammar(choice, tools, parallel=parallel),
                           single_call=bool(tools) and not parallel)
    return Prepared(prompt_text=text, thinking=text.endswith("<think>"), tools=bool(tools),
                    stream=get(body, "stream", bool, False), max_tokens=max_tokens, sampling=sampling,
                    stop=string_list(body, "stop_sequences"), model=model, tool_id_prefix="toolu_",
                    show_reasoning=shown)


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessagesResponder:
    keepalive = sse("ping", {"type": "ping"})

    def __init__(self, prepared: Prepared):
        self.id = "msg_" + uuid.uuid4().hex
        self.model = prepared.model
        self.block = None  # type of the open content block
        self.index = -1
        self.answered = False  # a text or tool_use block was sent
        self.show_reasoning = prepared.show_reasoning
        self.reasoning = ""  # of the open thinking block, for its signature

    def _message(self, content, stop_reason, usage_: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": None, "usage": usage_}

    def start(self, started: dict) -> list:
        return [("message_start", {"type": "message_start", "message": self._message(
            [], None, usage(started["prompt_tokens"], started["reused"], 0))})]

    def _open(self, kind: str, block: dict) -> list:
        out = self._close()
        self.index += 1
        self.block = kind
        self.answered |= kind != "thinking"
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def _close(self) -> list:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": signature(self.reasoning)}))
            self.reasoning = ""
        self.block = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> tuple:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def deltas(self, events) -> list:
        out = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                if self.block != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.reasoning += event.text
                if self.show_reasoning:
                    out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, ContentDelta):
                if self.block != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolCall):
                out += self._open("tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
                out.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
                out += self._close()
        return out

    def end(self, outcome, answer) -> list:
        out = self._close()
        if not self.answered:
            out += self._open("text", {"type": "text", "text": ""}) + self._close()
        stop_reason = STOP_REASONS.get(answer.finish_reason(outcome.finish_reason), "end_turn")
        return out + [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                               "usage": usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens)}),
            ("message_stop", {"type": "message_stop"})]

    def error(self, message: str) -> list:
        return [("error", APIError(500, message).anthropic_body())]

    def body(self, outcome, answer) -> dict:
        content = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning if self.show_reasoning else "",
                            "signature": signature(answer.reasoning)})
        if answer.content or not answer.tool_calls:
            content.append({"type": "text", "text": answer.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                    for c in answer.tool_calls]
        stop_reason = STOP_REASONS.get(answer.finish_reason(outcome.finish_reason), "end_turn")
        return self._message(content, stop_reason,
                             usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens))
