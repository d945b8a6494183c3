"""DeepSeek V4 chat format: render conversations to prompt text, parse model output back.

Rendering follows ds4's server template: BOS, the optional reasoning-effort preamble (the original
release's or V4 Flash 0731's, `EFFORT_PREFIXES`), the system block (tools prompt first, then the
system and developer messages joined by a blank line), `<｜User｜>` turns, tool results as
`<tool_result>` blocks after one `<｜User｜>`, and assistant turns `<｜Assistant｜>` + reasoning marker +
content + DSML tool calls + EOS. The prompt ends with `<｜Assistant｜><think>` (thinking) or
`<｜Assistant｜></think>`.

Parsing (`OutputParser`) splits streamed model text into reasoning, content and tool calls. Pure
Python: no arrays here.
"""

import json
import re
import uuid
from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
PARAMETER_END = f"</{DSML}parameter>"
TOOL_RESULT_END = "</tool_result>"

DEFAULT_SYSTEM = "You are a helpful assistant"

# the maximum-effort preamble of the original release ("legacy"); V4 Flash 0731 keeps it for "high"
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")
# V4 Flash 0731's maximum-effort preamble
THINK_MAX_PREFIX_0731 = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n")
# each release's template: reasoning effort -> the preamble it puts after BOS in thinking mode
EFFORT_PREFIXES = {"legacy": {"max": THINK_MAX_PREFIX},
                   "0731": {"high": THINK_MAX_PREFIX, "max": THINK_MAX_PREFIX_0731}}


def release_of(chat_template=None, *names) -> str:
    """The release whose template a model file carries: "0731" when its chat template has 0731's
    preamble, or, for a file without one, when a name of it (file name, `general.name`) says 0731;
    else "legacy" (the original release's files)."""
    if chat_template:
        return "0731" if THINK_MAX_PREFIX_0731.split("\n", 1)[0] in chat_template else "legacy"
    return "0731" if any("0731" in str(name) for name in names if name) else "legacy"


TOOLS_PROMPT_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    f"You can invoke tools by writing a \"{TOOL_CALLS_START}\" block like the following:\n\n"
    f"{TOOL_CALLS_START}\n"
    f"<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE{PARAMETER_END}\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    "String parameters should be specified as raw text and set `string=\"true\"`. "
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters "
    "with XML or HTML entity escapes. "
    f"Only if a string value itself contains the exact closing parameter tag `{PARAMETER_END}`, "
    f"write that tag as `&lt;/{DSML}parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")

TOOLS_PROMPT_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls. Use the exact parameter names from the schemas.")


# ---------------------------------------------------------------- rendering


class Client(str):
    """Text that came from a client (message text, tool results and arguments, tool schemas, system
    prompts): in a rendered prompt it is plain text, even where it spells a control token."""


class Sampled(str):
    """An answer's text as the model sampled it after the generation prompt, with the token ids it
    sampled (`ids`) and what was parsed from it (`thinking`: it began in the reasoning; `reasoning`,
    `content`, `calls`: [(name, arguments dict)]). In a rendered prompt those very ids stand for an
    assistant message that says the same, so a follow-up matches the live session token for token."""

    def __new__(cls, text: str, ids, *, thinking: bool, reasoning: str, content: str, calls: list):
        sampled = super().__new__(cls, text)
        sampled.ids = tuple(ids)
        sampled.thinking, sampled.reasoning, sampled.content, sampled.calls = thinking, reasoning, content, calls
        return sampled


class Prompt(str):
    """Rendered prompt text that knows which spans the template wrote (`template_spans`): only there do
    control-token strings (`<｜User｜>`, `<think>`, ...) become control tokens when tokenized
    (`Tokenizer.encode`); client text is encoded as plain text; a `Sampled` answer is its ids
    (`sampled_spans`: (start, end, ids)). A prompt whose client text spells no control token, and that
    holds no sampled answer, tokenizes exactly as the plain string does. `replay_notes`: why `render`
    wrote a remembered answer from its text rather than its sampled ids."""

    template_spans: tuple = ()
    sampled_spans: tuple = ()
    replay_notes: tuple = ()

    @classmethod
    def join(cls, pieces) -> "Prompt":
        """The pieces concatenated; `Client` pieces are client text, `Sampled` ones sampled answers, any
        other piece template text."""
        spans, sampled, position = [], [], 0
        for piece in pieces:
            end = position + len(piece)
            if isinstance(piece, Sampled):
                sampled.append((position, end, piece.ids))
            elif piece and not isinstance(piece, Client):
                if spans and spans[-1][1] == position:
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((position, end))
            position = end
        prompt = cls("".join(pieces))
        prompt.template_spans, prompt.sampled_spans = tuple(spans), tuple(sampled)
        return prompt


def content_text(content) -> str:
    """A message's `content` as text: a string, None, or a list of parts (only text parts count)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
    return "".join(parts)


def _tools_prompt_pieces(tools) -> list:
    """The "## Tools" system text: instructions, then one compact JSON function object per line
    (the `function` member of each OpenAI tool, or the object itself when it has none)."""
    schemas = [json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":"))
               for t in tools]
    return [TOOLS_PROMPT_HEAD, Client("\n".join(schemas)), TOOLS_PROMPT_TAIL]


def escape_attribute(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def unescape_attribute(text: str) -> str:
    return (text.replace("&quot;", '"').replace("&gt;", ">").replace("&lt;", "<")
            .replace("&amp;", "&"))


def _dsml_parameter_pieces(name: str, value) -> list:
    """One `<｜DSML｜parameter>` line: strings raw (only the closing tag escaped), anything else
    as compact JSON (the `<` of a closing tag inside written as \\u003c)."""
    if isinstance(value, str):
        body, is_string = value.replace(PARAMETER_END, "&lt;" + PARAMETER_END[1:]), "true"
    else:
        body = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        body, is_string = body.replace(PARAMETER_END, "\\u003c" + PARAMETER_END[1:]), "false"
    return [f'<{DSML}parameter name="', Client(escape_attribute(name)), f'" string="{is_string}">',
            Client(body), f"{PARAMETER_END}\n"]


def tool_call_arguments(call) -> tuple:
    """(name, arguments) of an OpenAI tool call; arguments parsed to a dict when they are a JSON
    object, else kept as the raw string."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return function.get("name", ""), arguments


def render_tool_calls(tool_calls) -> str:
    """The DSML block for an assistant message's tool calls, exactly as the model writes it."""
    return "".join(_tool_calls_pieces(tool_calls))


def _tool_calls_pieces(tool_calls) -> list:
    if not tool_calls:
        return []
    out = [f"\n\n{TOOL_CALLS_START}\n"]
    for call in tool_calls:
        name, arguments = tool_call_arguments(call)
        out += [f'<{DSML}invoke name="', Client(escape_attribute(name)), '">\n']
        if isinstance(arguments, dict):
            for key, value in arguments.items():
                out += _dsml_parameter_pieces(key, value)
        else:
            out += _dsml_parameter_pieces("arguments", arguments)
        out.append(f"</{DSML}invoke>\n")
    out.append(f"</{DSML}tool_calls>")
    return out


def render(messages, *, tools=None, thinking=True, add_generation_prompt=True,
           reasoning_effort=None, release="legacy") -> Prompt:
    """Render OpenAI-style messages to DeepSeek V4 prompt text, a `Prompt`: tokenized, the template's
    markers become control tokens and the messages' text stays plain text.

    messages: dicts with `role` (system, developer, user, assistant, tool or function), `content`
    (str, None or a list of text parts); assistant messages may carry `reasoning_content`,
    `tool_calls` ([{id, function: {name, arguments}}], arguments a JSON string or an object) and
    `sampled` (the server's memory of the answer, a `Sampled`: when the message says the same, with
    reasoning exactly where the template keeps it, its sampled ids are rendered, never its text
    re-tokenized; else the prompt's `replay_notes` say why not);
    a system or developer message with `in_place` set is rendered where it stands, after a blank line.
    tools: OpenAI tool definitions, or None. thinking: thinking mode. reasoning_effort: in thinking
    mode, the preamble `release`'s template gives it (`EFFORT_PREFIXES`: "max" the Think Max one, whose
    context the caller checks: ds4 asks for 393216; 0731 also gives "high" the original release's);
    "none" turns thinking off; other values change nothing. release: the model file's (`release_of`).

    Assistant turns keep their reasoning (`<think>…</think>`) in thinking mode when tools are in
    play (tools given, or a tool call or tool result in the history) or when they follow the last
    user turn; older ones get a bare `</think>`, as the official encoder does."""
    if reasoning_effort == "none":
        thinking = False
    has_tool_context = bool(tools) or any(
        m.get("role") in ("tool", "function") or (m.get("role") == "assistant" and m.get("tool_calls"))
        for m in messages)
    last_user = max((i for i, m in enumerate(messages) if m.get("role") in ("user", "tool", "function")),
                    default=-1)
    system_parts = [_tools_prompt_pieces(tools)] if tools else []
    system_parts += [[Client(content_text(m.get("content")))] for m in messages
                     if m.get("role") in ("system", "developer") and not m.get("in_place")]

    if release not in EFFORT_PREFIXES:
        raise ValueError(f"unknown chat template release {release!r}")
    out = [BOS, EFFORT_PREFIXES[release].get(reasoning_effort, "") if thinking else ""]
    for i, part in enumerate(system_parts):
        out += (["\n\n"] if i else []) + part
    awaiting_assistant = in_tool_results = False
    notes = []
    for i, message in enumerate(messages):
        role = message.get("role")
        text = content_text(message.get("content"))
        if role == "user":
            out += [USER, Client(text)]
            awaiting_assistant, in_tool_results = True, False
        elif role in ("tool", "function"):
            if not in_tool_results:
                out.append(USER)
            out += ["<tool_result>", Client(text.replace(TOOL_RESULT_END, "&lt;" + TOOL_RESULT_END[1:])),
                    TOOL_RESULT_END]
            awaiting_assistant, in_tool_results = True, True
        elif role in ("system", "developer") and message.get("in_place"):
            out += ["\n\n", Client(text)]
        elif role == "assistant":
            answer = [Client(text)] + _tool_calls_pieces(message.get("tool_calls") or [])
            if awaiting_assistant:
                keeps_reasoning = thinking and (has_tool_context or i > last_user)
                out += [ASSISTANT, THINK_START if keeps_reasoning else THINK_END]
                if keeps_reasoning:
                    answer = [Client(content_text(message.get("reasoning_content"))), THINK_END] + answer
            sampled = message.get("sampled")
            if sampled is not None:
                differs = _differs_from_sampled(message, sampled, awaiting_assistant and keeps_reasoning)
                if not awaiting_assistant:
                    differs = "it follows another assistant message"
                if differs:
                    notes.append(f"messages[{i}] is written from its text, not the tokens sampled: {differs}")
                else:
                    answer = [sampled]
            out += answer + [EOS]
            awaiting_assistant = in_tool_results = False
    if add_generation_prompt and awaiting_assistant:
        out += [ASSISTANT, THINK_START if thinking else THINK_END]
    prompt = Prompt.join(out)
    prompt.replay_notes = tuple(notes)
    return prompt


def _differs_from_sampled(message: dict, sampled: Sampled, keeps_reasoning: bool) -> str:
    """Why an assistant message cannot be rendered as the answer `sampled` ("" when it can)."""
    if sampled.thinking and not keeps_reasoning:
        return "the template drops an earlier turn's reasoning"
    if keeps_reasoning and not sampled.thinking:
        return "it was answered without thinking and is rendered with reasoning"
    calls = [tool_call_arguments(call) for call in message.get("tool_calls") or []]
    if content_text(message.get("content")) != sampled.content or calls != sampled.calls or (
            keeps_reasoning and content_text(message.get("reasoning_content")) != sampled.reasoning):
        return "it was edited"
    return ""


def render_next_user_turn(text: str, *, thinking=True) -> str:
    """What follows a finished assistant answer (whose tokens stop before EOS) to ask the next
    question: EOS, the user turn and the generation prompt. Tokenized on its own, it gives the same
    ids as inside a whole rendered conversation, since it starts with a special token."""
    return Prompt.join([EOS, USER, Client(text), ASSISTANT, THINK_START if thinking else THINK_END])


# ---------------------------------------------------------------- parsing


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class MalformedBlock:
    """A DSML tool-call block that does not parse, or the cut end of one the output ended inside (`cut`):
    left out of the answer."""
    text: str
    cut: bool = False


@dataclass
class ToolCall:
    """A complete tool call. `arguments` is a JSON object as a string, keys in call order. `dsml`
    is the exact text of the whole tool-call block it came from (the same for every call of one
    block)."""

    id: str
    name: str
    arguments: str
    dsml: str = ""


# The model's tool-call block, and two variants ds4 also accepts: a missing first bar, no DSML at all.
TAG_PREFIXES = (DSML, "DSML｜", "")
TOOL_BLOCK_STARTS = {f"<{prefix}tool_calls>": prefix for prefix in TAG_PREFIXES}
ATTRIBUTE = re.compile(r'([A-Za-z_]+)\s*=\s*"([^"]*)"')


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex


def partial_marker_len(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def parse_tool_block(body: str, prefix: str):
    """The calls in the text between `<…tool_calls>` and `</…tool_calls>` as [(name, arguments
    dict)], or None when it is not well-formed DSML."""
    invoke = re.compile(rf"<{re.escape(prefix)}invoke\s+([^>]*)>(.*?)</{re.escape(prefix)}invoke>",
                        re.S)
    parameter = re.compile(
        rf"<{re.escape(prefix)}parameter\s+([^>]*)>(.*?)</{re.escape(prefix)}parameter>", re.S)
    calls, position = [], 0
    for match in invoke.finditer(body):
        if body[position:match.start()].strip():
            return None
        position = match.end()
        name = dict(ATTRIBUTE.findall(match.group(1))).get("name")
        if not name:
            return None
        arguments, inner_position = {}, 0
        for p in parameter.finditer(match.group(2)):
            if match.group(2)[inner_position:p.start()].strip():
                return None
            inner_position = p.end()
            attributes = dict(ATTRIBUTE.findall(p.group(1)))
            if "name" not in attributes:
                return None
            arguments[unescape_attribute(attributes["name"])] = parameter_value(
                p.group(2), attributes.get("string", "true") == "true", prefix)
        if match.group(2)[inner_position:].strip():
            return None
        calls.append((unescape_attribute(name), arguments))
    if body[position:].strip() or not calls:
        return None
    return calls


def parameter_value(body: str, is_string: bool, prefix: str):
    end_tag = f"</{prefix}parameter>"
    if is_string:
        return body.replace("&lt;" + end_tag[1:], end_tag)
    try:
        return json.loads(body)
    except ValueError:
        return body  # not JSON after all: keep the text


class OutputParser:
    """Incremental parser of model output into `ReasoningDelta`, `ContentDelta` and `ToolCall`
    events. `feed(text)` takes any piece of the stream (chunk boundaries may fall anywhere, even
    inside a marker) and returns the events it completes; `finish()` flushes the rest.

    thinking=True: the output starts inside the reasoning (the prompt ended with `<think>`) and the
    first `</think>` switches to content. tools=True: DSML tool-call blocks in the content become
    `ToolCall`s; a DSML block that is not well-formed is markup no client can use: it becomes a
    `MalformedBlock` (left out of the content, for a log line); of a block the output ended inside, the
    complete calls are kept and the cut one becomes a `MalformedBlock`; a bare `<tool_calls>` that is
    not a call stays text. Only text that may be the start
    of a marker is held back, plus whitespace before a possible tool-call block (the block starts with
    a blank line that belongs to it, not to the content)."""

    def __init__(self, *, thinking=True, tools=False, make_id=new_tool_call_id):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.make_id = make_id
        self.pending = ""  # text not yet turned into events
        self.at_start = True  # a leading <think> in the reasoning is dropped
        self.block_prefix = None  # inside a tool-call block: its tag prefix
        self.block_text = ""  # the block's opening (leading whitespace and start tag)
        self.block_scanned = 0  # how much of `pending` holds no end tag

    def feed(self, text: str) -> list:
        self.pending += text
        events = []
        while True:
            progressed = {"reasoning": self._reasoning, "content": self._content,
                          "tool_block": self._tool_block}[self.state](events)
            if not progressed:
                return merge_deltas(events)

    def finish(self) -> list:
        events = []
        if self.state == "tool_block":
            self._cut_block(events)
            self.pending = self.block_text = ""
        if self.state == "reasoning":
            events.append(ReasoningDelta(self.pending))
        else:
            events.append(ContentDelta(self.pending))
        self.pending = ""
        self.state = "content"
        return merge_deltas(events)

    def _reasoning(self, events) -> bool:
        if self.at_start:
            if len(self.pending) < len(THINK_START) and THINK_START.startswith(self.pending):
                return False
            self.at_start = False
            if self.pending.startswith(THINK_START):
                self.pending = self.pending[len(THINK_START):]
        end = self.pending.find(THINK_END)
        if end >= 0:
            events.append(ReasoningDelta(self.pending[:end]))
            self.pending = self.pending[end + len(THINK_END):]
            self.state = "content"
            return True
        safe = len(self.pending) - partial_marker_len(self.pending, [THINK_END])
        events.append(ReasoningDelta(self.pending[:safe]))
        self.pending = self.pending[safe:]
        return False

    def _content(self, events) -> bool:
        if not self.tools:
            events.append(ContentDelta(self.pending))
            self.pending = ""
            return False
        starts = [(i, marker) for marker in TOOL_BLOCK_STARTS if (i := self.pending.find(marker)) >= 0]
        if starts:
            index, marker = min(starts)
            before = self.pending[:index]
            content = before.rstrip()
            events.append(ContentDelta(content))
            self.block_text = before[len(content):] + marker  # the block keeps its leading blank line
            self.block_prefix = TOOL_BLOCK_STARTS[marker]
            self.block_scanned = 0
            self.pending = self.pending[index + len(marker):]
            self.state = "tool_block"
            return True
        held = partial_marker_len(self.pending, TOOL_BLOCK_STARTS)
        text = self.pending[:len(self.pending) - held]
        safe = len(text.rstrip())
        events.append(ContentDelta(self.pending[:safe]))
        self.pending = self.pending[safe:]
        return False

    def _tool_block(self, events) -> bool:
        end_marker = f"</{self.block_prefix}tool_calls>"
        end = self.pending.find(end_marker, self.block_scanned)
        if end < 0:
            self.block_scanned = max(0, len(self.pending) - len(end_marker) + 1)
            return False
        body = self.pending[:end]
        block = self.block_text + body + end_marker
        self.pending = self.pending[end + len(end_marker):]
        self.state = "content"
        calls = parse_tool_block(body, self.block_prefix)
        if calls is None:
            self._malformed(block, events)
        else:
            events.extend(ToolCall(self.make_id(), name, json.dumps(arguments, ensure_ascii=False), block)
                          for name, arguments in calls)
        return True

    @property
    def held(self) -> int:
        """How many characters of the text fed so far are not in the events returned yet."""
        return len(self.pending) + (len(self.block_text) if self.state == "tool_block" else 0)

    def _cut_block(self, events):
        """A block the output ended inside (cut by the token limit): its complete calls are kept, the cut
        call after them is left out."""
        end_tag = f"</{self.block_prefix}invoke>"
        complete = self.pending.rfind(end_tag) + len(end_tag)
        calls = parse_tool_block(self.pending[:complete], self.block_prefix) if complete >= len(end_tag) else None
        if calls is None:
            self._malformed(self.block_text + self.pending, events, cut=True)
            return
        block = self.block_text + self.pending
        events.extend(ToolCall(self.make_id(), name, json.dumps(arguments, ensure_ascii=False), block)
                      for name, arguments in calls)
        if self.pending[complete:].strip():
            events.append(MalformedBlock(self.pending[complete:], cut=True))

    def _malformed(self, block: str, events, cut: bool = False):
        """A block that is not a tool call: DSML markup is left out; a bare `<tool_calls>` is prose."""
        if self.block_prefix:
            events.append(MalformedBlock(block, cut))
        else:
            events.append(ContentDelta(block))


def merge_deltas(events) -> list:
    """Drop empty deltas and join neighbouring deltas of the same kind."""
    merged = []
    for event in events:
        if isinstance(event, (ContentDelta, ReasoningDelta)):
            if not event.text:
                continue
            if merged and type(merged[-1]) is type(event):
                merged[-1] = type(event)(merged[-1].text + event.text)
                continue
        merged.append(event)
    return merged
