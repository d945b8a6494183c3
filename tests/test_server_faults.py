"""Failures inside a forward pass: the session stays consistent (every layer at the last fully computed
token) and the next request on the slot is exact; the server answers the failed request with a 500 in the
API's own error shape and goes on."""

import contextlib

import mlx.core as mx
import numpy as np
import pytest
import requests
from openai import OpenAI

from ds4_mlx.demo import load_for_cli
from ds4_mlx.server.build import BackgroundServer, build_server
from ds4_mlx.session import Session
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import answer_text, cold_answer, cold_logits, tiny_args

MODEL = "deepseek-v4-flash"


class FailingLayer:
    """Stands in for one decoder layer; once armed, its `countdown`-th call raises: after the whole
    layer ran ("after") or after its attention wrote its rows into the step's arrays ("inside"). Either
    way no layer has committed (a forward commits every layer or none)."""

    def __init__(self, layer, mode="after"):
        self.layer, self.mode = layer, mode
        self.countdown = 0  # 0: disarmed

    def arm(self, calls: int):
        self.countdown = calls

    def __call__(self, streams, ids, positions, steps, quant_sim):
        if self.countdown:
            self.countdown -= 1
            if self.countdown == 0:
                if self.mode == "inside":
                    self.layer._step(streams, ids, positions, steps, quant_sim)
                else:
                    self.layer(streams, ids, positions, steps, quant_sim)
                raise RuntimeError("injected failure")
        return self.layer(streams, ids, positions, steps, quant_sim)


def assert_consistent_and_exact(session, logits_after=None):
    assert all(c.pos == len(session.tokens) for c in session.cache)
    logits = logits_after if logits_after is not None else session.sync(session.tokens + [7])
    tokens = session.tokens
    assert float(mx.abs(logits - cold_logits(session.model, tokens, max_chunk=37)).max()) <= 1e-4


@pytest.mark.parametrize("mode", ["after", "inside"])
@pytest.mark.parametrize("seed", [0, 3])
def test_a_failed_prefill_chunk_leaves_the_session_at_its_last_computed_token(mode, seed):
    model = random_model(tiny_args(seed), seed=seed)
    failing = FailingLayer(model.layers[len(model.layers) // 2], mode)
    model.layers[len(model.layers) // 2] = failing
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.args.vocab_size, 150).tolist()
    # the rings hold the rewind slack, not a chunk: a failed chunk is undone in place when it fits the slack
    session = Session(model, rewind_slack=32, checkpoint_every=64, max_chunk=32)
    failing.arm(3)  # the third chunk fails: two chunks (64 tokens, a checkpoint) are computed
    with pytest.raises(RuntimeError, match="injected"):
        session.sync(prompt)
    assert session.tokens == prompt[:64]
    assert_consistent_and_exact(session)
    # the same prompt again: it resumes from what was computed and ends exact
    logits = session.sync(prompt)
    assert session.last_sync["reused"] >= 64
    assert_consistent_and_exact(session, logits)
    # a failed decode step, then a rewind into the history, are exact too
    failing.arm(1)
    with pytest.raises(RuntimeError):
        session.step(5)
    assert session.tokens == prompt
    failing.arm(1)  # the pipelined step the generation loop uses
    with pytest.raises(RuntimeError):
        session.step_async(mx.array(5, dtype=mx.int32))
    assert session.tokens == prompt and all(c.pos == len(prompt) for c in session.cache)
    assert_consistent_and_exact(session, session.sync(prompt[:120] + [1, 2, 3]))


def test_an_unusable_cache_starts_over_empty(monkeypatch):
    """A chunk whose arrays fail to evaluate (out of memory) after every layer took them, where a layer's
    rings no longer hold what going back needs: the session starts over, empty and exact."""
    model = random_model(tiny_args(0), seed=0)
    session = Session(model, rewind_slack=0, checkpoint_every=64, max_chunk=16)
    session.sync(list(range(40)))

    def broken(*args, **kwargs):
        raise MemoryError("out of memory")

    session.cache[3].can_trim = lambda p: False  # and its rows could not be kept
    with monkeypatch.context() as m:
        m.setattr(mx, "eval", broken)
        with pytest.raises(MemoryError):
            session.sync(list(range(60)))
    assert session.tokens == [] and all(c.pos == 0 for c in session.cache)
    assert_consistent_and_exact(session, session.sync(list(range(60))))


# ---------------------------------------------------------------- through the server


@contextlib.contextmanager
def served_with_failing_layer(mode="after"):
    holder = {}

    def load():
        model, tokenizer = load_for_cli(None)[:2]
        holder["failing"] = model.layers[3] = FailingLayer(model.layers[3], mode)
        return model, tokenizer

    server = build_server(load, model_id=MODEL, ctx=4096, sessions=1, budget_bytes=2**32)
    with BackgroundServer(server) as bg:
        yield bg, holder["failing"]


def long_messages():
    return [{"role": "user", "content": "Count: " + " ".join(f"n{i}" for i in range(300))}]


def test_the_server_answers_500_in_the_api_shape_and_the_next_request_is_exact():
    messages = long_messages()
    with served_with_failing_layer() as (bg, failing):
        failing.arm(2)  # the prompt's second chunk fails
        r = requests.post(bg.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": messages, "max_tokens": 8}, timeout=60)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and "injected failure" in error["message"]
        failing.arm(2)
        r = requests.post(bg.url + "/v1/messages", timeout=60,
                          json={"model": MODEL, "max_tokens": 8, "messages": messages})
        assert r.status_code == 500
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
        slot = bg.server.worker.slots[0]
        assert all(c.pos == len(slot.tokens) for c in slot.session.cache) and slot.tokens

        failing.arm(5)  # a streamed answer fails part way: an error event, then the end of the stream
        client = OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
        stream = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=30, stream=True)
        body = stream.http_response.read().decode()
        assert '"server_error"' in body and body.rstrip().endswith("data: [DONE]")
        assert all(c.pos == len(slot.tokens) for c in slot.session.cache)

        done = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
        assert done.usage.prompt_tokens_details.cached_tokens > 0  # the computed prefix was kept
    assert answer_text(done) == cold_answer(model=MODEL, messages=messages, temperature=0, max_tokens=12)


def test_a_worker_that_dies_while_starting_a_request_answers_it_with_an_error():
    """A failure that stops the worker (another rank lost, a bug in the loop) while it starts an admitted
    request: that request gets the error too, not a dropped connection."""
    from ds4_mlx.tools.testing import served

    class Lost(BaseException):
        pass

    def start(job, placement):
        raise Lost("the other ranks are gone")

    with served() as (bg, _):
        bg.server.worker._start = start
        r = requests.post(bg.url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert r.status_code == 500 and "worker failed" in r.json()["error"]["message"]
