"""`ds4-mlx chat`: an interactive chat in the terminal.

The conversation is kept as the exact token transcript the model saw (its own sampled tokens, the
reasoning included, as ds4's CLI does), so every turn only computes the new user text and the
template tokens around it: the session always holds a prefix of the next prompt.
"""

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from ds4_mlx.cache import add_disk_arguments, disk_store_from_args
from ds4_mlx.chat import (ASSISTANT, BOS, DEFAULT_SYSTEM, EOS, THINK_END, THINK_MAX_PREFIX, THINK_START, USER,
                          ContentDelta, OutputParser, ReasoningDelta, render, render_next_user_turn)
from ds4_mlx.demo import DEMO_NOTE, load_for_cli
from ds4_mlx.generate import FINISH_ABORT, SamplingParams, stream_generate
from ds4_mlx.generate_cli import add_sampling_arguments, sampling_from_args
from ds4_mlx.speculative import add_arguments as add_speculation_arguments, speculation_from_args
from ds4_mlx.loader import cache_root
from ds4_mlx.distributed import new_session

HELP = """Commands:
  /help           this help
  /think          thinking mode: the model reasons (shown dimmed) before answering (default)
  /nothink        answer directly
  /system TEXT    set the system prompt and start a new conversation (/system alone: none)
  /reset          start a new conversation
  /read FILE      send the contents of FILE as your message
  /max N          answer with at most N tokens, reasoning included (/max alone: the current limit)
  /save FILE      write the conversation to FILE as JSON messages
  /load FILE      continue the conversation saved in FILE
  /stats          cache and speed figures
  /resume         continue the last conversation saved in --kv-disk-dir (no prompt recomputed)
  /quit           leave (also /exit or Ctrl+D)
Ctrl+C stops an answer; what was written so far stays in the conversation."""

PROGRESS_MIN_TOKENS = 512  # prompts this long show their prefill progress


class Conversation:
    """A chat over one `Session`: the token transcript plus the settings of the next turn.

    `transcript` holds the ids of everything so far, ending right after the last answer (its EOS
    is rendered at the start of the next turn). After each turn the session holds exactly the
    transcript, so the next turn reuses all of it."""

    def __init__(self, session, tokenizer, *, system=DEFAULT_SYSTEM, thinking=True,
                 sampling=SamplingParams(), max_tokens=1024, disk=None, speculation=None):
        self.session, self.tokenizer = session, tokenizer
        self.speculation = speculation  # make(model) -> a `ds4_mlx.speculative.Speculation` for a turn, or None
        self.disk, self.saved = disk, None  # a DiskStore; the entry of this conversation's last turn
        self.system, self.thinking = system, thinking
        self.sampling, self.max_tokens = sampling, max_tokens
        self.transcript = []
        self.messages = []  # the same conversation as OpenAI-style messages, for /save
        self.turns = 0
        self.last_stats = None

    def reset(self, system=None):
        if system is not None:
            self.system = system
        self.transcript = []
        self.messages = []
        self.turns = 0
        self.saved = None

    def saved_messages(self) -> list:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def load_messages(self, messages: list):
        """Continue a saved conversation: a system message (optional), then user and assistant turns,
        the last one an answer. Raises ValueError, changing nothing, on anything else."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("expected a JSON array of messages")
        has_system = bool(messages) and messages[0].get("role") == "system"
        system = messages[0].get("content") if has_system else ""
        if not isinstance(system, str):
            raise ValueError("message 0: expected a system message with text content")
        turns = messages[1:] if has_system else messages
        for i, m in enumerate(turns):
            role = "user" if i % 2 == 0 else "assistant"
            if m.get("role") != role or not isinstance(m.get("content"), str) \
                    or not isinstance(m.get("reasoning_content", ""), str):
                raise ValueError(f"message {i + has_system}: expected a {role} message with text content")
        if not turns or len(turns) % 2:
            raise ValueError("expected user and assistant turns, the last one an answer")
        text = render(messages, thinking=self.thinking, add_generation_prompt=False)
        self.reset(system=system)
        # as after an answer: the EOS (one id, last) comes with the next turn. Encoded whole: a slice of the
        # rendered Prompt would be a plain str, and client text spelling a control token would become one
        self.transcript = self.tokenizer.encode(text)[:-1]
        self.messages = [dict(m) for m in turns]
        self.turns = len(turns) // 2

    def prompt_ids(self, user_text: str) -> list:
        if not self.transcript:
            system = [{"role": "system", "content": self.system}] if self.system else []
            text = render(system + [{"role": "user", "content": user_text}], thinking=self.thinking)
            return self.tokenizer.encode(text)
        return self.transcript + self.tokenizer.encode(
            render_next_user_turn(user_text, thinking=self.thinking))

    def ask(self, user_text: str, *, should_abort=None, on_prefill=None):
        """Stream the answer to `user_text` as `GenerationChunk`s. An answer stopped by
        `should_abort` keeps what was written; a turn stopped during the prompt is dropped."""
        prompt = self.prompt_ids(user_text)
        for chunk in stream_generate(self.session, self.tokenizer, prompt, max_tokens=self.max_tokens,
                                     sampling=self.sampling, should_abort=should_abort,
                                     on_prefill=on_prefill,
                                     speculation=self.speculation(self.session.model) if self.speculation else None):
            if chunk.finish_reason:
                self.last_stats = chunk.stats
                if len(self.session.tokens) >= len(prompt):  # else the prompt itself was cut short
                    self.transcript = prompt + chunk.stats.output_ids
                    self.turns += 1
                    self.messages += [{"role": "user", "content": user_text}, self._answer(chunk.stats.output_ids)]
                    self.save_turn()
            yield chunk

    def save_turn(self):
        """Keep the conversation on disk at each turn's end, replacing its previous turn."""
        if self.disk is None or self.session.tokens != self.transcript:
            return
        entry = self.disk.save(self.session, "chat")
        if self.saved is not None and entry is not None and self.saved.name != entry.name \
                and self.saved.name in self.disk.entries:
            self.disk.remove(self.saved)
        self.saved = entry or self.saved

    def resume(self) -> bool:
        """Continue the last conversation saved on disk; False when there is none (or it is unusable)."""
        entry = self.disk.latest("chat") if self.disk is not None else None
        if entry is None or not self.disk.load(self.session, entry):
            return False
        self.transcript, self.saved = list(self.session.tokens), entry
        self.system, self.messages = self._conversation_of(self.transcript)
        self.turns = len(self.messages) // 2
        return True

    def _conversation_of(self, ids) -> tuple:
        """(system, messages) of a transcript, split at the template's control ids (client text in it is
        plain text, so only the template wrote those): BOS system, then <｜User｜> question
        <｜Assistant｜> answer, each answer but the last ended by EOS."""
        markers = {self.tokenizer.id_of(t): t for t in (BOS, USER, ASSISTANT, EOS)}
        segments, role, start = [], None, 0
        for i, token in enumerate(list(ids) + [None]):
            if token is None or token in markers:
                segments.append((role, ids[start:i]))
                role, start = markers.get(token), i + 1
        system, messages = "", []
        for marker, part in segments:
            if marker == BOS:
                system = self.tokenizer.decode(part).removeprefix(THINK_MAX_PREFIX)
            elif marker == USER:
                messages.append({"role": "user", "content": self.tokenizer.decode(part)})
            elif marker == ASSISTANT:
                text = self.tokenizer.decode(part)
                thinking = text.startswith(THINK_START)
                messages.append(self._answer_of(text.removeprefix(THINK_START if thinking else THINK_END), thinking))
        return system, messages


    def _answer(self, output_ids) -> dict:
        return self._answer_of(self.tokenizer.decode(output_ids), self.thinking)

    @staticmethod
    def _answer_of(text: str, thinking: bool) -> dict:
        parser = OutputParser(thinking=thinking)
        events = parser.feed(text) + parser.finish()
        answer = {"role": "assistant", "content": "".join(e.text for e in events if isinstance(e, ContentDelta))}
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        if reasoning:
            answer["reasoning_content"] = reasoning
        return answer


class Terminal:
    """Terminal input (prompt_toolkit with history on a tty, plain input() otherwise) and output."""

    def __init__(self):
        self.interactive = sys.stdin.isatty() and sys.stdout.isatty()
        self.dim, self.plain = ("\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else ("", "")
        self.prompt_session = None
        if self.interactive:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import FileHistory, InMemoryHistory

            history_file = history_path()
            try:
                history_file.parent.mkdir(parents=True, exist_ok=True)
                history = FileHistory(str(history_file))
            except OSError:
                history = InMemoryHistory()
            self.prompt_session = PromptSession(history=history)

    def read_line(self, prompt: str) -> str:
        """A line from the user; EOFError at the end of input, KeyboardInterrupt on Ctrl+C."""
        if self.prompt_session is not None:
            return self.prompt_session.prompt(prompt)
        if self.interactive:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def write(self, text: str, *, dim=False):
        sys.stdout.write(f"{self.dim}{text}{self.plain}" if dim and text else text)
        sys.stdout.flush()


def history_path() -> Path:
    return cache_root() / "chat_history"


class StopOnCtrlC:
    """While active, Ctrl+C sets a flag (read by `should_abort`) instead of raising."""

    def __init__(self):
        self.pressed = threading.Event()

    def __enter__(self):
        self.pressed.clear()
        self.previous = signal.signal(signal.SIGINT, lambda signum, frame: self.pressed.set())
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def stream_answer(conversation, terminal, user_text):
    """Ask, print the answer as it comes (reasoning dimmed), then a status line. An error ends
    the conversation with one line, never a traceback."""
    try:
        print_answer(conversation, terminal, user_text)
    except Exception as e:  # the session may be half-updated: start clean
        terminal.write(f"\nerror: {e}; starting a new conversation\n")
        conversation.reset()
        conversation.session.reset()


def print_answer(conversation, terminal, user_text):
    parser = OutputParser(thinking=conversation.thinking)
    in_reasoning = False
    progress_shown = False

    def show_prefill(done, total):
        nonlocal progress_shown
        if terminal.interactive and total >= PROGRESS_MIN_TOKENS:
            terminal.write(f"\r[prompt {done}/{total} tokens]", dim=True)
            progress_shown = True

    with StopOnCtrlC() as ctrl_c:
        for chunk in conversation.ask(user_text, should_abort=ctrl_c.pressed.is_set, on_prefill=show_prefill):
            if progress_shown:
                terminal.write("\r\x1b[K")
                progress_shown = False
            events = parser.feed(chunk.text) + (parser.finish() if chunk.finish_reason else [])
            for event in events:
                if isinstance(event, ReasoningDelta):
                    in_reasoning = True
                    terminal.write(event.text, dim=True)
                elif isinstance(event, ContentDelta):
                    if in_reasoning:
                        terminal.write("\n")
                        in_reasoning = False
                    terminal.write(event.text)
            if chunk.finish_reason:
                if chunk.finish_reason == FINISH_ABORT:
                    terminal.write("\n[stopped]")
                terminal.write("\n" + status_line(conversation, chunk.stats) + "\n", dim=True)


def status_line(conversation, stats) -> str:
    return (f"[prompt {stats.prompt_tokens} tokens, {stats.computed_tokens} new, "
            f"{stats.prefill_tokens_per_second:.1f} t/s | answer {stats.completion_tokens} tokens, "
            f"{stats.decode_tokens_per_second:.1f} t/s | cached {len(conversation.session.tokens)} tokens]")


def stats_report(conversation) -> str:
    session = conversation.session
    lines = [f"cached tokens: {len(session.tokens)}",
             f"cache memory: {session.nbytes / 2**20:.1f} MiB",
             f"turns: {conversation.turns}, transcript {len(conversation.transcript)} tokens",
             f"mode: {'thinking' if conversation.thinking else 'no thinking'}"]
    s = conversation.last_stats
    if s is not None:
        lines.append(f"last turn: prompt {s.prompt_tokens} tokens (reused {s.reused_tokens}, "
                     f"replayed {s.replayed_tokens}, computed {s.computed_tokens}) at "
                     f"{s.prefill_tokens_per_second:.1f} t/s; answer {s.completion_tokens} tokens "
                     f"at {s.decode_tokens_per_second:.1f} t/s")
    return "\n".join(lines)


def run_command(line, conversation, terminal) -> bool:
    """Handle a /command; False means quit."""
    name, _, argument = line.partition(" ")
    argument = argument.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        terminal.write(HELP + "\n")
    elif name in ("/think", "/nothink"):
        conversation.thinking = name == "/think"
        terminal.write(f"thinking {'on' if conversation.thinking else 'off'}\n")
    elif name == "/system":
        conversation.reset(system=argument)
        terminal.write("system prompt set; new conversation\n" if argument
                       else "no system prompt; new conversation\n")
    elif name == "/reset":
        conversation.reset()
        terminal.write("new conversation\n")
    elif name == "/read":
        if not argument:
            terminal.write("usage: /read FILE\n")
            return True
        try:
            text = Path(argument).expanduser().read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            terminal.write(f"cannot read {argument}: {e.strerror or e}\n")
            return True
        terminal.write(f"[sending {argument}: {len(text)} characters]\n", dim=True)
        stream_answer(conversation, terminal, text)
    elif name == "/max":
        if not argument:
            terminal.write(f"answers stop after {conversation.max_tokens} tokens\n")
        elif argument.isdigit() and int(argument) > 0:
            conversation.max_tokens = int(argument)
            terminal.write(f"answers stop after {conversation.max_tokens} tokens\n")
        else:
            terminal.write("usage: /max N, a number of tokens above 0\n")
    elif name in ("/save", "/load"):
        if not argument:
            terminal.write(f"usage: {name} FILE\n")
            return True
        path = Path(argument).expanduser()
        try:
            if name == "/save":
                path.write_text(json.dumps(conversation.saved_messages(), ensure_ascii=False, indent=2) + "\n",
                                encoding="utf-8")
                terminal.write(f"saved {conversation.turns} turn(s) to {argument}\n")
            else:
                conversation.load_messages(json.loads(path.read_text(encoding="utf-8")))
                terminal.write(f"loaded {conversation.turns} turn(s) from {argument}; "
                               f"{len(conversation.transcript)} tokens to read with the next message\n")
        except OSError as e:
            terminal.write(f"cannot {name[1:]} {argument}: {e.strerror or e}\n")
        except ValueError as e:  # a JSON error is a ValueError too
            terminal.write(f"cannot load {argument}: {e}\n")
    elif name == "/stats":
        terminal.write(stats_report(conversation) + "\n")
    elif name == "/resume":
        write_resumed(conversation, terminal)
    else:
        terminal.write(f"unknown command {name}; /help lists them\n")
    return True


def write_resumed(conversation, terminal):
    if conversation.disk is None:
        terminal.write("/resume needs --kv-disk-dir\n")
    elif conversation.resume():
        terminal.write(f"resumed the last conversation ({len(conversation.transcript)} tokens)\n")
    else:
        terminal.write("no saved conversation to resume\n")


def run_chat(args):
    terminal = Terminal()
    terminal.write("loading the model...\n", dim=True)
    model, tokenizer, is_demo = load_for_cli(args.model)
    if is_demo:
        terminal.write(DEMO_NOTE + "\n")
    speculation = speculation_from_args(args)
    if speculation:
        speculation(model)  # load the drafter now: a bad file is said before the first turn
    conversation = Conversation(new_session(model), tokenizer, system=args.system, thinking=args.think,
                                sampling=sampling_from_args(args), max_tokens=args.max_tokens,
                                disk=disk_store_from_args(args, min_tokens=1), speculation=speculation)
    terminal.write("ds4-mlx chat: type a message, /help for commands, /quit to leave.\n")
    if args.resume:
        write_resumed(conversation, terminal)
    while True:
        try:
            line = terminal.read_line("ds4> ")
        except KeyboardInterrupt:  # Ctrl+C at the prompt clears the line
            continue
        except EOFError:
            terminal.write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not run_command(line, conversation, terminal):
                return 0
        else:
            stream_answer(conversation, terminal, line)


def register(subparsers):
    p = subparsers.add_parser("chat", help="chat with the model in the terminal",
                              description="An interactive chat with streamed answers.", epilog=HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_arguments(p)
    add_disk_arguments(p)
    add_speculation_arguments(p)
    p.add_argument("--resume", action="store_true", help="continue the last conversation (with --kv-disk-dir)")
    p.set_defaults(func=run_chat)
