"""OpenAI Responses (`/v1/responses`), stateless, as Codex uses it: the client replays its whole input
(messages, reasoning, function calls and their outputs) on every request; `previous_response_id` is refused.

Reasoning is returned as a `reasoning` item (summary and content hold the text), so a client that
replays it gives the model back its own reasoning and the live session's prefix still matches.
"""

import copy
import json
import time
import uuid

from ds4_mlx.chat import render
from ds4_mlx.server import protocol, schema
from ds4_mlx.server.assembly import AnswerMemory, ContentDelta, ReasoningDelta, ToolCall
from ds4_mlx.server.constraints import constrained, forced_tool_grammar, response_format_grammar
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field as get, note_ignored
from ds4_mlx.server.protocol import Prepared, ServerInfo

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
INPUT_ITEMS = ("message", "reasoning", "function_call", "function_call_output", "custom_tool_call",
               "custom_tool_call_output")


# ---------------------------------------------------------------- requests


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or an array of content parts", param=where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text") \
                or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}] is a {kind or 'non-text'} part: {protocol.TEXT_ONLY}", param=where)
    return "".join(p["text"] for p in content)


def chat_messages(instructions: str | None, items) -> list[dict]:
    """Input items as chat messages: function calls join the assistant turn they belong to, reasoning
    items give the next assistant turn its reasoning_content."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    reasoning = ""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = get(item, "type", str, "message")
        if kind == "message":
            role = get(item, "role", str, required=True)
            if role not in MESSAGE_ROLES:
                raise APIError(422, f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}", param=where)
            message = {"role": role, "content": _text(item.get("content", ""), f"{where}.content")}
            if role == "assistant":
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += _text(parts, f"{where}.summary")
        elif kind in ("function_call", "custom_tool_call"):
            arguments = get(item, "arguments", str) if kind == "function_call" else \
                json.dumps({"input": get(item, "input", str, "")}, ensure_ascii=False)
            call = {"id": get(item, "call_id", str, required=True), "type": "function",
                    "function": {"name": get(item, "name", str, required=True), "arguments": arguments or "{}"}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
                reasoning = ""
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": get(item, "call_id", str, required=True),
                        "content": _text(item.get("output", ""), f"{where}.output")})
        else:
            raise APIError(400, f"{where} is an item of type '{kind}'; this server reads {', '.join(INPUT_ITEMS)}",
                           param=where)
    return out


def chat_tools(tools: list | None) -> list[dict] | None:
    """Function tools (flat, as the Responses API spells them) as chat tools; built-in tools are left out."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise APIError(400, f"tools[{i}] must be an object", param=f"tools[{i}]")
        if tool.get("type") == "function":
            if not isinstance(tool.get("name"), str):
                raise APIError(400, f"tools[{i}] needs a name", param=f"tools[{i}]")
            protocol.check_parameters(tool.get("parameters"), f"tools[{i}].parameters")
            out.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description", ""),
                "parameters": tool.get("parameters", {})}})
    return out or None


def parse_responses(body: dict, info: ServerInfo, memory: AnswerMemory) -> Prepared:
    schema.check(body, schema.RESPONSES)
    note_ignored(body, schema.RESPONSES, "responses")
    protocol.refuse_unsupported(body, ("store",))
    model = info.model_name(body)
    messages = chat_messages(get(body, "instructions", str), get(body, "input", (str, list), required=True))
    choice = get(body, "tool_choice", (str, dict))
    tools = protocol.resolve_tool_choice(choice, chat_tools(get(body, "tools", list)))
    effort = get(get(body, "reasoning", dict, {}), "effort", str)
    thinking, effort = protocol.thinking_mode(body, model, info, effort=effort)
    text = render(memory.attach(messages), tools=tools, thinking=thinking, reasoning_effort=effort,
                  release=info.chat_release)
    protocol.log_replay_notes(text, "responses")
    parallel = get(body, "parallel_tool_calls", bool, True)
    grammar = forced_tool_grammar(choice, tools, parallel=parallel) or \
        response_format_grammar(get(body, "text", dict, {}), "format")
    sampling = constrained(protocol.sampling(body), thinking=text.endswith("<think>"), grammar=grammar,
                           single_call=bool(tools) and not parallel)
    return Prepared(prompt_text=text, thinking=text.endswith("<think>"), tools=bool(tools),
                    stream=get(body, "stream", bool, False),
                    max_tokens=protocol.max_tokens(body, "max_output_tokens", "max_tokens"),
                    sampling=sampling, model=model, param="input")


# ---------------------------------------------------------------- responses


def usage(outcome, answer) -> dict:
    return {"input_tokens": outcome.prompt_tokens, "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "output_tokens": outcome.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


# an output item of text: (its parts' key, an empty part, the part's added and delta events, their index key)
TEXT_ITEMS = {
    "reasoning": ("summary", {"type": "summary_text", "text": ""}, "response.reasoning_summary_part.added",
                  "response.reasoning_summary_text.delta", "summary_index"),
    "message": ("content", {"type": "output_text", "text": "", "annotations": []}, "response.content_part.added",
                "response.output_text.delta", "content_index"),
}


class ResponsesResponder:
    def __init__(self, prepared: Prepared, body: dict):
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.prepared = prepared
        self.echo = {k: body.get(k) for k in ("instructions", "tools", "tool_choice", "temperature", "top_p",
                                              "max_output_tokens", "reasoning", "metadata", "text")}
        self.parallel_tool_calls = body.get("parallel_tool_calls") is not False
        self.sequence = 0
        self.items: list[dict] = []  # output items, the last one possibly still open
        self.open = None  # the kind of the open item: reasoning, message

    def _response(self, status: str, outcome=None, answer=None, error=None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.prepared.model, "output": self.items, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": usage(outcome, answer) if outcome else None, "parallel_tool_calls": self.parallel_tool_calls,
                "previous_response_id": None, "truncation": "disabled",
                **self.echo, "text": self.echo["text"] or {"format": {"type": "text"}},
                "tools": self.echo["tools"] or [],
                "tool_choice": self.echo["tool_choice"] or "auto"}

    def _event(self, kind: str, **data) -> tuple:
        self.sequence += 1  # a copy: items still change after the event is made
        return kind, {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(data)}

    def start(self, started) -> list:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def _add(self, item: dict) -> list:
        out = self._close()
        self.items.append(item)
        return out + [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _close(self, status: str = "completed") -> list:
        """Close the open item: `completed`, or `incomplete` when the answer was cut in it."""
        if self.open is None:
            return []
        item, index = self.items[-1], len(self.items) - 1
        if self.open == "reasoning":
            text = item["summary"][0]["text"]
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out = [self._event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                               summary_index=0, text=text),
                   self._event("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                               summary_index=0, part=item["summary"][0])]
        else:
            part = item["content"][0]
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)]
        item["status"] = status
        self.open = None
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def _text(self, kind: str, text: str) -> list:
        """Events for `text` of an item of `kind` (reasoning or message): the item and its one part opened
        first unless open, then the delta."""
        parts, part, added, delta, at = TEXT_ITEMS[kind]
        out, index = [], len(self.items) - 1
        if self.open != kind:
            item = {"reasoning": {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": []},
                    "message": {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant",
                                "content": []}}[kind]
            out += self._add({**item, "status": "in_progress"})
            self.open, index = kind, len(self.items) - 1
            self.items[-1][parts].append(dict(part))
            out.append(self._event(added, item_id=self.items[-1]["id"], output_index=index, **{at: 0},
                                   part=dict(part)))
        self.items[-1][parts][0]["text"] += text
        return out + [self._event(delta, item_id=self.items[-1]["id"], output_index=index, **{at: 0}, delta=text)]

    def deltas(self, events) -> list:
        out = []
        for event in events:
            if isinstance(event, (ReasoningDelta, ContentDelta)):
                out += self._text("reasoning" if isinstance(event, ReasoningDelta) else "message", event.text)
            elif isinstance(event, ToolCall):
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": event.id,
                        "name": event.name, "arguments": "", "status": "in_progress"}
                out += self._add(item)
                index = len(self.items) - 1
                item["arguments"] = event.arguments
                item["status"] = "completed"
                out += [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=event.arguments),
                        self._event("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=index, arguments=event.arguments),
                        self._event("response.output_item.done", output_index=index, item=item)]
        return out

    def _status(self, outcome) -> str:
        return "incomplete" if outcome.finish_reason == "length" else "completed"

    def end(self, outcome, answer) -> list:
        status = self._status(outcome)
        out = self._close(status)
        return out + [self._event(f"response.{status}", response=self._response(status, outcome, answer))]

    def error(self, message: str) -> list:
        self._close()
        return [self._event("response.failed", response=self._response(
            "failed", error={"code": "server_error", "message": message}))]

    def body(self, outcome, answer) -> dict:
        self.deltas(answer_events(answer))
        self._close(self._status(outcome))
        return self._response(self._status(outcome), outcome, answer)


def answer_events(answer) -> list:
    """A finished answer as the events a stream would have had."""
    events = [ReasoningDelta(answer.reasoning)] if answer.reasoning else []
    events += [ContentDelta(answer.content)] if answer.content else []
    return events + list(answer.tool_calls)
