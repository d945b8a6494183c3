"""A scripted model for tests: the server runs as usual, but the next outputs are given by the test.

Only the choice of tokens is scripted. The prompt goes through the real chat template, tokenizer and
session (the demo model's, so cache reuse and its figures are real), and the scripted text is
tokenized with the real tokenizer and fed back token by token, through the session, the detokenizer,
the stop conditions and the output parser, exactly as sampled tokens would be. So an agent client's
whole tool loop runs deterministically against the real server.

Which output answers a request is a function of its prompt: a request without tools (a client's side
call: a title, a quota check) gets `side`; one with tools gets `turns[k]`, where k is the number of
tool results in the prompt (the last turn repeats). A turn is reasoning, text and tool calls; the
reasoning is written only when the prompt asks for thinking.

    model = ScriptedModel([Turn(calls=[("Bash", {"command": "ls"})]), Turn(text="Done.")])
    server = build_server(demo_loader, ..., generate=model.generate)

`python -m ds4_mlx.tools.scripted SCRIPT.json` serves the demo model with a script (a JSON object with
`turns`: [{reasoning, text, calls: [[name, arguments]]}] and optionally `side`).
"""

import argparse
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ds4_mlx.chat import THINK_END, THINK_START, TOOLS_PROMPT_HEAD, render_tool_calls
from ds4_mlx.generate import stream_generate


@dataclass
class Turn:
    text: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)  # [(name, arguments dict)]

    def output(self, thinking: bool) -> str:
        """The model's text for this turn, as it would sample it."""
        out = self.reasoning + THINK_END if thinking else ""
        out += self.text
        if self.calls:
            out += render_tool_calls([{"function": {"name": n, "arguments": a}} for n, a in self.calls])
        return out


@dataclass
class Served:
    """One request as the scripted model served it: the session's figures and the sizes."""
    prompt_tokens: int
    reused: int
    replayed: int
    computed: int
    output_tokens: int
    tools: bool
    prompt_text: str


class ScriptedModel:
    def __init__(self, turns: list[Turn], side: str = "OK"):
        self.turns = turns
        self.side = Turn(text=side)
        self.served: list[Served] = []
        self._lock = threading.Lock()

    def turn_for(self, prompt_text: str) -> Turn:
        if TOOLS_PROMPT_HEAD not in prompt_text:
            return self.side
        done = prompt_text.count("<tool_result>")
        return self.turns[min(done, len(self.turns) - 1)]

    def generate(self, session, tokenizer, prompt_ids, **options):
        """`stream_generate` with the scripted tokens as the sampler (then EOS)."""
        prompt_text = tokenizer.decode(prompt_ids)
        output = self.turn_for(prompt_text).output(thinking=prompt_text.endswith(THINK_START))
        tokens = iter(tokenizer.encode(output) + [tokenizer.eos_id])
        chunks = stream_generate(session, tokenizer, prompt_ids, sampler=lambda logits: next(tokens), **options)
        for chunk in chunks:
            if chunk.finish_reason:
                s = chunk.stats
                with self._lock:
                    self.served.append(Served(len(prompt_ids), s.reused_tokens, s.replayed_tokens,
                                              s.computed_tokens, len(s.output_ids),
                                              TOOLS_PROMPT_HEAD in prompt_text, prompt_text))
            yield chunk


def load_script(path) -> ScriptedModel:
    spec = json.loads(Path(path).read_text())
    turns = [Turn(text=t.get("text", ""), reasoning=t.get("reasoning", ""),
                  calls=[(name, arguments) for name, arguments in t.get("calls", [])]) for t in spec["turns"]]
    return ScriptedModel(turns, side=spec.get("side", "OK"))


def main(argv=None):
    from aiohttp import web

    from ds4_mlx.tools.testing import demo_server

    p = argparse.ArgumentParser(prog="python -m ds4_mlx.tools.scripted", description=__doc__.split("\n\n")[0])
    p.add_argument("script", help="a JSON file: {turns: [{reasoning, text, calls}], side}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--sessions", type=int, default=2)
    args = p.parse_args(argv)
    model = load_script(args.script)
    server = demo_server(ctx=args.ctx, sessions=args.sessions, budget_bytes=2**33, generate=model.generate)
    web.run_app(server.app(), host=args.host, port=args.port, access_log=None)


if __name__ == "__main__":
    main()
