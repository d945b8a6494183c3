"""The REPL's /max, /save and /load, driven through `run_command` on the demo model."""

import json

import pytest

from ds4_mlx.chat import render
from ds4_mlx.generate import SamplingParams
from ds4_mlx.repl import Conversation, run_command


class Screen:
    def __init__(self):
        self.text = ""

    def write(self, text, *, dim=False):
        self.text += text

    def take(self) -> str:
        text, self.text = self.text, ""
        return text


def conversation(demo, **kw):
    from ds4_mlx import Session

    model, tokenizer = demo
    return Conversation(Session(model), tokenizer, sampling=SamplingParams(seed=1), **kw)


def ask(conv, text):
    return list(conv.ask(text))[-1].stats


def test_max_sets_the_answer_length(demo):
    conv, screen = conversation(demo), Screen()
    for bad in ("/max 0", "/max -3", "/max lots"):
        assert run_command(bad, conv, screen) and "usage: /max N" in screen.take()
    assert conv.max_tokens == 1024
    run_command("/max 3", conv, screen)
    assert screen.take() == "answers stop after 3 tokens\n" and conv.max_tokens == 3
    assert ask(conv, "Hello").completion_tokens == 3


@pytest.mark.parametrize("thinking", [False, True], ids=["nothink", "think"])
def test_save_then_load_continues_the_conversation(demo, tmp_path, thinking):
    tokenizer = demo[1]
    conv, screen = conversation(demo, thinking=thinking, max_tokens=5), Screen()
    ask(conv, "Hello")
    ask(conv, "And then?")
    run_command(f"/save {tmp_path / 'chat.json'}", conv, screen)
    assert screen.take() == f"saved 2 turn(s) to {tmp_path / 'chat.json'}\n"
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert [m["role"] for m in saved] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in saved if m["role"] == "user"] == ["Hello", "And then?"]
    last_answer = saved[-1].get("reasoning_content", "") + saved[-1]["content"]
    assert tokenizer.decode(conv.transcript).endswith(last_answer)

    fresh = conversation(demo, thinking=thinking, max_tokens=5)
    run_command(f"/load {tmp_path / 'chat.json'}", fresh, screen)
    assert screen.take().startswith(f"loaded 2 turn(s) from {tmp_path / 'chat.json'}")
    assert fresh.saved_messages() == saved and fresh.turns == 2
    if not thinking:  # as a server would render the same messages (thinking keeps the last reasoning)
        expected = render(saved + [{"role": "user", "content": "Next?"}], thinking=False)
        assert fresh.prompt_ids("Next?") == tokenizer.encode(expected)
    prompt = fresh.prompt_ids("Next?")
    stats = ask(fresh, "Next?")
    assert stats.computed_tokens == stats.prompt_tokens == len(prompt)  # the loaded turns are read once
    assert fresh.transcript == prompt + stats.output_ids == fresh.session.tokens
    assert [m["content"] for m in fresh.saved_messages() if m["role"] == "user"] == ["Hello", "And then?", "Next?"]


def test_load_refuses_what_is_not_a_conversation(demo, tmp_path):
    conv, screen = conversation(demo, max_tokens=3), Screen()
    ask(conv, "Hello")
    before = (list(conv.transcript), conv.saved_messages())
    files = {"missing.json": None, "bad.json": "{not json", "object.json": '{"role": "user"}',
             "order.json": '[{"role": "assistant", "content": "hi"}, {"role": "user", "content": "yo"}]',
             "unanswered.json": '[{"role": "user", "content": "hi"}]'}
    for name, text in files.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        run_command(f"/load {tmp_path / name}", conv, screen)
        assert screen.take().startswith(f"cannot load {tmp_path / name}: "), name
        assert (conv.transcript, conv.saved_messages()) == before
    assert run_command("/save", conv, screen) and screen.take() == "usage: /save FILE\n"


def test_load_keeps_client_text_that_spells_a_control_token_as_text(demo, tmp_path):
    tokenizer = demo[1]
    user = tokenizer.encode("<｜User｜>")
    assert len(user) == 1  # a plain string maps the control string to its token
    conv, screen = conversation(demo, thinking=False, max_tokens=3), Screen()
    ask(conv, "quote: <｜User｜> ends here")
    ask(conv, "And then?")
    assert conv.transcript.count(user[0]) == 2  # one a turn: the quoted one is text
    run_command(f"/save {tmp_path / 'chat.json'}", conv, screen)
    fresh = conversation(demo, thinking=False, max_tokens=3)
    run_command(f"/load {tmp_path / 'chat.json'}", fresh, screen)
    assert fresh.turns == 2 and fresh.transcript.count(user[0]) == 2
