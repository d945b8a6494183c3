"""The disk KV store: a restarted server resumes a long conversation from disk, damaged and foreign files
are refused (deleted, logged, the request served cold), the folder stays within its budget while the
most-hit shared prefix survives, and `chat` resumes its last conversation."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from openai import OpenAI

from ds4_mlx.cache import state as state_module
from ds4_mlx.cache.store import INDEX, DiskStore, FolderInUse
from ds4_mlx.chat import render
from ds4_mlx.demo import load_for_cli
from ds4_mlx.generate import SamplingParams
from ds4_mlx.repl import Conversation
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.session import Session
from ds4_mlx.tools.testing import demo_server, long_conversation, request_lines
from test_session import assert_exact, model_for

MODEL = "deepseek-v4-flash"


def folder_bytes(path):
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def filled(model, tokens, **options):
    session = Session(model, rewind_slack=256, checkpoint_every=64, max_chunk=32, **options)
    session.sync(tokens)
    return session


def random_tokens(model, n, seed):
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, n).tolist()


# -- the server, stopped and started again ---------------------------------------------------------


def serve(disk_dir=None):
    disk = DiskStore(disk_dir, 64) if disk_dir else None
    server = demo_server(ctx=8192, disk=disk)
    return BackgroundServer(server)


def ask(bg, messages):
    client = OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)


def test_restarted_server_resumes_from_disk_and_answers_as_a_cold_run(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    messages = long_conversation()
    with serve(tmp_path) as bg:  # a cold run; the session is saved at shutdown
        prompt_ids = bg.server.worker.tokenizer.encode(render(messages))
        assert len(prompt_ids) >= 2000
        cold = ask(bg, messages).choices[0].message
    assert [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    with serve(tmp_path) as bg:
        warm = ask(bg, messages).choices[0].message
    line = request_lines(caplog)[-1]
    assert int(line["prompt"]) == len(prompt_ids)
    assert int(line["computed"]) + int(line["replayed"]) <= 128, line
    assert (warm.content, warm.reasoning_content) == (cold.content, cold.reasoning_content)
    assert any("kv disk: hit" in r.getMessage() for r in caplog.records)
    request_line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat ")][-1]
    assert request_line.startswith("chat disk hit: slot 0 starts from a stored session sharing"), request_line


def test_a_slot_a_fork_takes_over_is_saved_first(tmp_path):
    """A side request forked from a long conversation into the slot of another one: that other
    conversation is what gets saved, not the snapshot that replaces it."""
    disk = DiskStore(tmp_path, 64, min_tokens=64)
    server = demo_server(ctx=8192, sessions=2, disk=disk)
    system = {"role": "system", "content": "Rules: " + " ".join(f"rule{i}" for i in range(130))}
    long_turn = [system, {"role": "user", "content": " ".join(f"fact{i}" for i in range(220))}]
    other = [{"role": "user", "content": " ".join(f"other{i}" for i in range(40))}]
    with BackgroundServer(server) as bg:
        worker = bg.server.worker
        ask(bg, long_turn)
        ask(bg, other)
        other_tokens = list(worker.slots[1].tokens)
        ask(bg, [system, {"role": "user", "content": "a side question"}])
        assert worker.slots[1].last_outcome.source == 0  # forked into the other conversation's slot
        assert disk.find(worker.model, other_tokens)[1] == len(other_tokens)
        assert disk.find(worker.model, list(worker.slots[0].tokens)) is None  # the long one is still live


def test_damaged_file_is_deleted_and_the_request_served_cold(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    messages = long_conversation(words=300)
    with serve(tmp_path) as bg:
        cold = ask(bg, messages).choices[0].message.content
    (stored,) = [p for p in tmp_path.iterdir() if p.name.endswith(".safetensors")]
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    with serve(tmp_path) as bg:
        again = ask(bg, messages)
        line = request_lines(caplog)[-1]
        assert int(line["computed"]) == again.usage.prompt_tokens  # cold
        assert again.choices[0].message.content == cold
        assert not stored.exists()
    assert any(r.levelno == logging.WARNING and "unusable" in r.getMessage() and "checksum" in r.getMessage()
               for r in caplog.records)


def test_a_conversation_taken_over_in_the_only_slot_comes_back_from_disk(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    first, other = long_conversation(words=150), long_conversation(words=160)
    other[1]["content"] = "Count: " + other[1]["content"]
    with serve(tmp_path) as bg:
        for messages in (first, other, first):
            ask(bg, messages)
    lines = request_lines(caplog)
    assert lines[1]["miss"].startswith("other-conversation") and lines[2]["miss"].startswith("other-conversation")
    assert int(lines[2]["computed"]) + int(lines[2]["replayed"]) <= 128, lines[2]  # the first, from disk
    assert any("reason=evict" in r.getMessage() for r in caplog.records)


# -- the store on its own ---------------------------------------------------------------------------


def test_long_prompts_are_saved_along_the_way(tmp_path):
    model = model_for(0)
    store = DiskStore(tmp_path, 16, min_tokens=64, prefill_every=128, history=64)
    session = Session(model, checkpoint_every=64, max_chunk=32)
    tokens = random_tokens(model, 300, 6)
    session.sync(tokens, on_chunk=lambda done, total: store.during_prefill(session))
    assert sorted(e.tokens for e in store.entries.values()) == [128, 256]


def test_truncated_file_is_deleted_and_never_used(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    model = model_for(0)
    tokens = random_tokens(model, 300, 1)
    store = DiskStore(tmp_path, 16, min_tokens=64)
    entry = store.save(filled(model, tokens), "evict")
    path = tmp_path / entry.name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    session = Session(model)
    assert store.load_longer_prefix(session, tokens + [1], 0) == 0
    assert session.tokens == [] and not path.exists() and entry.name not in store.entries
    assert any(r.levelno == logging.WARNING and entry.name in r.getMessage() for r in caplog.records)
    assert_exact(session, session.sync(tokens + [1]))  # the request goes on, cold


def test_a_file_of_another_model_config_is_never_loaded(tmp_path):
    tokens = random_tokens(model_for(0), 300, 2)
    store = DiskStore(tmp_path, 16, min_tokens=64)
    for other in (model_for(0, quant_sim=True), model_for(3)):
        entry = store.save(filled(model_for(0), tokens), "evict")
        session = Session(other)
        assert store.find(other, tokens) is None
        assert store.load_longer_prefix(session, tokens, 0) == 0 and session.tokens == []
        assert not (tmp_path / entry.name).exists()  # deleted as foreign
    # and a foreign file put in the folder by hand is refused at load time too
    entry = DiskStore(tmp_path / "a", 16, min_tokens=64).save(filled(model_for(3), tokens[:200]), "evict")
    other = DiskStore(tmp_path / "b", 16, min_tokens=64)
    other.save(filled(model_for(0), tokens[:200]), "evict")
    (tmp_path / "b" / other.latest().name).write_bytes((tmp_path / "a" / entry.name).read_bytes())
    session = Session(model_for(0))
    assert not other.load(session, other.latest()) and session.tokens == []


def test_hit_extends_and_rewinds_exactly_and_survives_a_reopen(tmp_path):
    model = model_for(5)
    tokens = random_tokens(model, 400, 3)
    DiskStore(tmp_path, 16, min_tokens=64).save(filled(model, tokens), "shutdown")
    store = DiskStore(tmp_path, 16, min_tokens=64)  # reopened: the index lists the file
    assert len(store.entries) == 1
    for prompt in (tokens + [4, 5, 6], tokens[:300] + [7, 8]):
        found = store.find(model, prompt)
        assert found is not None and found[1] == (400 if len(prompt) > 400 else 256)
        session = Session(model, checkpoint_every=64, max_chunk=32)
        assert store.load_longer_prefix(session, prompt, 0) == found[1]
        logits = session.sync(prompt)
        assert session.last_sync["replayed"] + session.last_sync["computed"] <= 128 + 3
        assert_exact(session, logits)
    (tmp_path / INDEX).write_text("{broken")
    assert len(DiskStore(tmp_path, 16, min_tokens=64).entries) == 1  # rebuilt from the file headers


def test_budget_holds_at_every_moment_and_the_shared_prefix_survives(tmp_path, monkeypatch):
    model = model_for(0)
    budget_mb = 2.0  # room for the shared prefix and one conversation (files hold the rows of a 256-token trim)
    peaks = []
    replace = os.replace

    def measured_replace(src, dst):  # the fullest moment: the new file written, not yet renamed
        peaks.append(folder_bytes(tmp_path))
        replace(src, dst)

    monkeypatch.setattr(state_module.os, "replace", measured_replace)
    clock = [1000.0]
    store = DiskStore(tmp_path, budget_mb, min_tokens=64, clock=lambda: clock[0])
    system = random_tokens(model, 130, 4)
    shared = store.save(filled(model, system), "prefill")
    for i in range(12):  # requests that start with the shared prefix
        clock[0] += 60
        prompt = system + random_tokens(model, 50, 50 + i)
        assert store.load_longer_prefix(Session(model, checkpoint_every=64, max_chunk=32), prompt, 0) == len(system)
    written = 0
    for i in range(12):  # then long one-off conversations, all more recent than the prefix's last use
        clock[0] += 60
        entry = store.save(filled(model, random_tokens(model, 330, 100 + i)), "evict")
        written += entry.size
        peaks.append(folder_bytes(tmp_path))
    assert written > 4 * budget_mb * 2**20
    assert max(peaks) <= budget_mb * 2**20
    assert shared.name in store.entries and store.entries[shared.name].hits == 12  # least recent, kept


def test_chat_resumes_the_last_conversation_without_recomputing_it(tmp_path):
    model, tokenizer, _ = load_for_cli(None)
    options = dict(sampling=SamplingParams(temperature=0), max_tokens=5, thinking=False)
    first = Conversation(Session(model), tokenizer, disk=DiskStore(tmp_path, 64, min_tokens=1), **options)
    for _ in first.ask("hello there, how are you?"):
        pass
    resumed = Conversation(Session(model), tokenizer, disk=DiskStore(tmp_path, 64, min_tokens=1), **options)
    assert resumed.resume() and resumed.transcript == first.transcript
    turn = [list(c.token for c in conv.ask("and tomorrow?") if c.token is not None) for conv in (first, resumed)]
    assert turn[0] == turn[1] and resumed.transcript == first.transcript
    assert resumed.last_stats.computed_tokens == first.last_stats.computed_tokens  # only the new turn
    assert resumed.last_stats.reused_tokens == first.last_stats.reused_tokens > 0
    assert len([e for e in resumed.disk.entries.values() if e.reason == "chat"]) == 1


def test_bad_budget_is_a_clear_error(tmp_path):
    import argparse

    from ds4_mlx.cache import add_disk_arguments, disk_store_from_args

    parser = argparse.ArgumentParser()
    add_disk_arguments(parser)
    with pytest.raises(ValueError, match="kv-disk-space-mb"):
        disk_store_from_args(parser.parse_args([f"--kv-disk-dir={tmp_path}", "--kv-disk-space-mb=0"]))


def test_a_full_disk_never_raises_to_its_caller(tmp_path, monkeypatch, caplog):
    model = model_for(0)
    store = DiskStore(tmp_path, 64, min_tokens=64)
    session = filled(model, random_tokens(model, 200, 5))
    assert store.save(session, "evict") is not None

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ds4_mlx.cache.store.write_state_file", full)
    monkeypatch.setattr("ds4_mlx.cache.store.read_state_file", full)
    monkeypatch.setattr("pathlib.Path.write_text", full)
    longer = filled(model, session.tokens + random_tokens(model, 100, 6))
    assert store.save(longer, "evict") is None  # not stored, not raised
    other = Session(model, rewind_slack=256, checkpoint_every=64, max_chunk=32)
    assert store.load_longer_prefix(other, session.tokens + [1], 0) == 0 and other.tokens == []  # the read failed
    store.during_prefill(longer)
    assert any("No space left" in r.getMessage() for r in caplog.records)


def test_a_folder_in_use_by_another_process_is_refused_and_left_alone(tmp_path):
    leftover = tmp_path / ".index.json.123.tmp"  # the other process's write in progress
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom ds4_mlx.cache.store import DiskStore\n"
                               f"store = DiskStore({str(tmp_path)!r}, 16)\nprint('held', flush=True)\n"
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        leftover.write_text("{}")
        with pytest.raises(FolderInUse, match=f"pid {holder.pid}.*its own --kv-disk-dir"):
            DiskStore(tmp_path, 16)
        serve = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "serve", "--port", "0", "--kv-disk-dir",
                                str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert serve.returncode == 1 and "in use by another ds4-mlx process" in serve.stderr, serve.stderr
        assert "Traceback" not in serve.stderr and leftover.exists()
    finally:
        holder.communicate("")
    DiskStore(tmp_path, 16)  # free again once that process ended
