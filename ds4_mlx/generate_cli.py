"""`ds4-mlx generate`: one prompt's answer on stdout; and the sampling flags it shares with `chat`."""

import sys

from ds4_mlx.chat import BOS, DEFAULT_SYSTEM, THINK_START, ContentDelta, OutputParser, ReasoningDelta, render
from ds4_mlx.demo import DEMO_NOTE, load_for_cli
from ds4_mlx.generate import (FINISH_LENGTH, RATE_MIN_TOKENS, GenerationStats, SamplingParams,
                              stream_generate)
from ds4_mlx.distributed import new_session
from ds4_mlx.speculative import add_arguments as add_speculation_arguments, speculation_from_args
from ds4_mlx.speculative import summary as speculation_summary


def add_sampling_arguments(parser):
    """The sampling flags shared by `generate` and `chat`."""
    defaults = SamplingParams()
    parser.add_argument("-m", "--model", help="a .gguf file or converted MLX folder "
                        "(default: the built-in demo model, random weights: gibberish text)")
    parser.add_argument("-n", "--max-tokens", type=int, default=1024,
                        help="most tokens to generate, reasoning included (default %(default)s)")
    parser.add_argument("--temp", type=float, default=defaults.temperature,
                        help="temperature, 0 = greedy (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.add_argument("--min-p", type=float, default=defaults.min_p)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--system", default=DEFAULT_SYSTEM,
                        help="system prompt (an empty string for none)")
    think = parser.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_true", default=True,
                       help="thinking mode (the default)")
    think.add_argument("--nothink", dest="think", action="store_false", help="answer directly")


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, seed=args.seed)


GENERATE_MAX_TOKENS = 512  # a few screens of text; the REPL, which can be interrupted, allows more


def run_generate(args):
    """The answer on stdout (nothing else goes there); on stderr, the reasoning when asked for, a
    progress line while hidden reasoning runs on a terminal, and the figures on a line of their own."""
    model, tokenizer, is_demo = load_for_cli(args.model)
    if is_demo:
        print(DEMO_NOTE, file=sys.stderr)
    make_speculation = speculation_from_args(args)
    speculation = make_speculation(model) if make_speculation else None
    if args.prompt.startswith(BOS):
        prompt_text = args.prompt  # already rendered
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt_text = render(messages + [{"role": "user", "content": args.prompt}], thinking=args.think)
    thinking = prompt_text.endswith(THINK_START)
    parser = OutputParser(thinking=thinking)
    err = _Stderr()
    answered = False
    reasoning_tokens = 0
    # it never rewinds but to drop a round's rejected drafts: slack rows only for those
    session = new_session(model, rewind_slack=0 if speculation is None else 64, frontier_horizon=64)
    for chunk in stream_generate(session, tokenizer, tokenizer.encode(prompt_text),
                                 max_tokens=args.max_tokens, sampling=sampling_from_args(args),
                                 speculation=speculation):
        events = parser.feed(chunk.text) + (parser.finish() if chunk.finish_reason else [])
        for event in events:
            if isinstance(event, ReasoningDelta) and args.show_reasoning:
                err.write(event.text, dim=True)
            elif isinstance(event, ContentDelta) and (answered or event.text.strip()):
                err.end_line()
                sys.stdout.write(event.text if answered else event.text.lstrip())
                sys.stdout.flush()
                answered = True
        if thinking and not answered and not args.show_reasoning and chunk.token is not None:
            reasoning_tokens += 1
            err.progress(f"[thinking: {reasoning_tokens} tokens]")
        if chunk.finish_reason:
            if answered:
                print(file=sys.stdout)
            err.end_line()
            if thinking and not answered and chunk.finish_reason == FINISH_LENGTH:
                err.write(f"[no answer yet: all {args.max_tokens} tokens went to reasoning; raise --max-tokens, "
                          f"or --nothink to answer directly{'' if args.show_reasoning else ', or --show-reasoning'}]\n")
            err.write(stats_line(chunk.finish_reason, chunk.stats) + "\n", dim=True)
            if speculation is not None:
                err.write(speculation_summary(speculation.stats) + "\n", dim=True)
    return 0


def stats_line(finish_reason: str, s: GenerationStats) -> str:
    def took(tokens: int, seconds: float) -> str:
        rate = f", {tokens / seconds:.1f} t/s" if tokens >= RATE_MIN_TOKENS and seconds > 0 else ""
        return f"{seconds:.2f} s{rate}"

    return (f"[{finish_reason}: prompt {s.prompt_tokens} tokens, "
            f"{took(s.computed_tokens + s.replayed_tokens, s.prefill_seconds)}; "
            f"generated {s.completion_tokens} tokens, {took(s.completion_tokens, s.decode_seconds)}]")


class _Stderr:
    """stderr that knows whether its last line is finished, and dims or redraws text on a terminal only."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.at_line_start = True
        self.progress_shown = False

    def write(self, text: str, *, dim=False):
        if not text:
            return
        self._clear_progress()
        if dim and self.tty:
            body = text.rstrip("\n")  # the line ends after the colour does
            text = f"\x1b[2m{body}\x1b[0m{text[len(body):]}"
        sys.stderr.write(text)
        sys.stderr.flush()
        self.at_line_start = text.endswith("\n")

    def end_line(self):
        self._clear_progress()
        if not self.at_line_start:
            self.write("\n")

    def progress(self, text: str):
        if self.tty:
            sys.stderr.write(f"\r\x1b[2m{text}\x1b[0m")
            sys.stderr.flush()
            self.progress_shown = True

    def _clear_progress(self):
        if self.progress_shown:
            sys.stderr.write("\r\x1b[K")
            self.progress_shown = False


def register(subparsers):
    p = subparsers.add_parser("generate", help="print a completion for one prompt",
                              description="Render PROMPT as a one-turn chat (or use it as is when it "
                                          "starts with BOS) and print the answer on stdout; figures, and "
                                          "the reasoning with --show-reasoning, go to stderr.")
    p.add_argument("-p", "--prompt", required=True)
    add_sampling_arguments(p)
    p.add_argument("--show-reasoning", action="store_true",
                   help="print the reasoning to stderr (dimmed on a terminal) before the answer")
    add_speculation_arguments(p)
    p.set_defaults(max_tokens=GENERATE_MAX_TOKENS)
    p.set_defaults(func=run_generate)
