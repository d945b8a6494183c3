"""What every API turns its request into, and the request fields they share.

Each API module parses its body into a `Prepared` (the rendered prompt and the generation settings) and
answers through a responder with the same four methods, so the app drives all APIs with one loop:
`start(started)`, `deltas(events)`, `end(outcome, answer)`, `error(message)` return SSE events as
(event name or None, data) pairs; `body(outcome, answer)` is the non-streamed response.
"""

import json
import logging
from dataclasses import dataclass, field

from ds4_mlx.generate import AnswerStops, SamplingParams
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field as get, number_in, positive_int, string_list
from ds4_mlx.server.schema import EFFORTS

log = logging.getLogger("ds4_mlx.server")

THINK_MAX_MIN_CTX = 393216  # Think Max needs this much context (ds4's rule)
TEXT_ONLY = "this model reads text only"
MAX_DEPTH = 64  # nesting of arrays and objects in a body; real requests use a handful
MAX_INT_DIGITS = 40  # past every integer field's range, and short enough to convert at once


class OversizedInt(int):
    """An integer the body writes with more than `MAX_INT_DIGITS` digits, kept as a value past every
    field's range (Python would refuse to convert some at all): a field's range check names it."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) <= MAX_INT_DIGITS:
        return int(text)
    return OversizedInt(-10**MAX_INT_DIGITS if text.startswith("-") else 10**MAX_INT_DIGITS)


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object, or a 400: malformed JSON or UTF-8, nesting deeper than
    `MAX_DEPTH`, strings that are not Unicode (lone surrogates), integers of more than `MAX_INT_DIGITS`
    digits deeper than a field's own fields (a field that large fails its range check, which names it)."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise APIError(400, f"the body nests arrays or objects deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # also bad UTF-8 and integers too long to convert
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict):
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode()
                except UnicodeEncodeError:
                    raise APIError(400, "the body holds a string that is not valid Unicode (a lone surrogate)") from None
        elif isinstance(value, OversizedInt) and depth > 3:  # deeper than a field's own fields
            raise APIError(400, f"the body holds an integer of more than {MAX_INT_DIGITS} digits")
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise APIError(400, f"the body nests arrays or objects deeper than {MAX_DEPTH} levels")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


@dataclass
class Prepared:
    prompt_text: str
    thinking: bool  # the output starts in the reasoning (the prompt opened a <think> block)
    tools: bool  # DSML tool calls in the output become tool calls
    stream: bool
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    model: str = ""
    param: str = "messages"  # the field named by a context-length error
    tool_id_prefix: str = "call_"
    show_reasoning: bool = True  # Anthropic's `thinking.display: omitted` sends thinking blocks without text

    def __post_init__(self):
        # stop strings end the answer's content, never its reasoning or a tool call
        self.stop = AnswerStops(self.stop, thinking=self.thinking, tools=self.tools)


@dataclass
class ServerInfo:
    model_id: str
    ctx: int
    max_tokens: int | None = None  # caps every request's output (`serve --max-tokens`)
    chat_release: str = "legacy"  # whose chat template renders prompts (`chat.release_of`): set on load

    @property
    def model_names(self) -> list[str]:
        """The names the loaded model answers to, as /v1/models lists them: its id and the DeepSeek names
        (deepseek-chat answers without thinking, deepseek-reasoner thinks)."""
        return list(dict.fromkeys([self.model_id, "deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner"]))

    def model_name(self, body: dict, *, anthropic: bool = False) -> str:
        """The requested model, checked: one of `model_names`, or "default" (a placeholder some clients
        send); Anthropic clients also send Claude names for side calls, which it serves as well."""
        name = get(body, "model", str, self.model_id)
        if name in self.model_names or name == "default" or (anthropic and name.startswith("claude")):
            return name
        raise APIError(404, f"model '{name}' does not exist; this server serves '{self.model_id}'",
                       param="model", code="model_not_found")


def thinking_mode(body: dict, model: str, info: ServerInfo, *, effort: str | None = None) -> tuple[bool, str | None]:
    """(thinking, reasoning_effort for render) from `thinking` (bool or {type}), `think`, the effort,
    then the model alias (deepseek-chat answers directly); thinking is the default."""
    effort = effort if effort is not None else get(body, "reasoning_effort", str)
    if effort is not None and effort not in EFFORTS:
        raise APIError(422, f"reasoning_effort must be one of {', '.join(EFFORTS)}, not '{effort}'",
                       param="reasoning_effort")
    thinking = get(body, "thinking", (bool, dict))
    if isinstance(thinking, dict):
        kind = get(thinking, "type", str, "enabled")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise APIError(422, f"thinking.type must be enabled or disabled, not '{kind}'", param="thinking")
        thinking = kind != "disabled"
    if thinking is None:
        thinking = get(body, "think", bool)
    if thinking is None:
        thinking = effort != "none" and model != "deepseek-chat"
    if effort == "max" and info.ctx < THINK_MAX_MIN_CTX:
        effort = None  # Think Max needs a long context; normal thinking instead
    return thinking, effort


def sampling(body: dict) -> SamplingParams:
    defaults = SamplingParams()
    return SamplingParams(
        temperature=number_in(body, "temperature", 0.0, 2.0, defaults.temperature),
        top_p=number_in(body, "top_p", 0.0, 1.0, defaults.top_p),
        top_k=get(body, "top_k", int, defaults.top_k),
        min_p=number_in(body, "min_p", 0.0, 1.0, defaults.min_p),
        seed=get(body, "seed", int), logit_bias=logit_bias(body),
        presence_penalty=number_in(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=number_in(body, "frequency_penalty", -2.0, 2.0, 0.0))


def logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"token id": bias from -100 to 100}, as {id: bias}; the ids are checked
    against the vocabulary by `check_token_ids` once the tokenizer is known."""
    value = get(body, "logit_bias", dict)
    if not value:
        return None
    out = {}
    for key, bias in value.items():
        is_number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not (key.isascii() and key.isdigit()) or not is_number or not -100 <= bias <= 100:
            raise APIError(400, "'logit_bias' maps token ids to numbers from -100 to 100", param="logit_bias")
        out[int(key)] = float(bias)
    return out


def check_token_ids(sampling: SamplingParams, vocab_size: int):
    """A 400 for a `logit_bias` id past the vocabulary: it names no token, so its bias could do nothing."""
    past = [i for i in sampling.logit_bias or () if i >= vocab_size]
    if past:
        raise APIError(400, f"'logit_bias' names token {past[0]}, past the vocabulary's {vocab_size} tokens",
                       param="logit_bias")


def refuse_unsupported(body: dict, names: tuple[str, ...]):
    """A 400 for each of `names` the request sets: fields of the API this server does not implement."""
    for name in names:
        value = body.get(name)
        if value not in (None, False) and not (name == "best_of" and value == 1):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)


def max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        value = positive_int(body, name)
        if value is not None:
            return value
    return None


def stop_strings(body: dict, name: str = "stop") -> list[str]:
    return string_list(body, name)


def function_tools(tools: list | None) -> list[dict] | None:
    """OpenAI chat tools checked: each {type: function, function: {name, parameters}}, the parameters
    (when given) a JSON Schema object."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}",
                           param=f"tools[{i}]")
        check_parameters(function.get("parameters"), f"tools[{i}].function.parameters")
    return tools


def check_parameters(parameters, where: str):
    """A tool's parameter schema: absent, or a JSON Schema object."""
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"'{where}' must be a JSON Schema object", param=where)


def tool_choice_name(choice) -> str | None:
    """The function a `tool_choice` object names (OpenAI {function: {name}}, Anthropic and Responses {name})."""
    if not isinstance(choice, dict):
        return None
    function = choice.get("function")
    return choice.get("name") or (function.get("name") if isinstance(function, dict) else None)


def resolve_tool_choice(choice, tools: list[dict] | None):
    """The tools to render under `tool_choice`: "none" hides them; "auto", "required" and a named
    function keep them all (a named function must exist; `constraints.forced_tool_grammar` makes the
    answer call one)."""
    if choice in (None, "auto"):
        return tools
    if choice == "none":
        return None
    name = None if choice in ("required", "any") else tool_choice_name(choice)
    if choice not in ("required", "any") and not isinstance(name, str):
        raise APIError(400, "tool_choice must be none, auto, required or a named function", param="tool_choice")
    if not tools:
        raise APIError(400, "tool_choice asks for a tool call, but the request has no tools", param="tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise APIError(422, f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    return tools


def log_replay_notes(prompt, where: str):
    """Log why an earlier answer is written from its text rather than the tokens it was sampled as: the
    session recomputes the prompt from there, and the log says why instead of guessing."""
    if prompt.replay_notes:
        log.info(f"{where}: {'; '.join(prompt.replay_notes)}; the session recomputes from there")
