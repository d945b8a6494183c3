"""Nothing around a request changes its numbers: the same logits and logprobs, bit for bit, whether it runs
alone or beside other streams, and after a rewind or a disk restore that replays (chunks end on a grid of
absolute positions; a replay starts on that grid); with `exact_rewinds`, after any history at all."""

import threading

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.demo import demo_model_path
from ds4_mlx.loader import load
from ds4_mlx.session import Session, step_together
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import DEMO_MODEL_ID, real_geometry_args

_models = {}


def model_for(quant_sim):
    if quant_sim not in _models:
        _models[quant_sim] = random_model(real_geometry_args(), seed=0, quant_sim=quant_sim)
    return _models[quant_sim]


def same(a, b):
    return float(mx.abs(a - b).max()) == 0.0


@pytest.mark.parametrize("quant_sim", [True, False])
def test_a_prompt_prefilled_beside_other_streams_gets_the_same_bits(quant_sim):
    """A chunk run a layer at a time with other sessions' tokens between its pieces (a server's shared
    turns) computes what it computes alone; so do decoded tokens stepped together with 1 to 3 others."""
    model = model_for(quant_sim)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.args.vocab_size, 2300).tolist()
    alone = Session(model)
    want = alone.sync(prompt)
    others = [Session(model) for _ in range(3)]
    for s in others:
        s.sync(rng.integers(0, model.args.vocab_size, 300).tolist())
    shared = Session(model)
    shared.layers_per_turn = 1
    pieces = 0
    for _ in shared.sync_steps(prompt):
        pieces += 1
        step_together(others, mx.array(rng.integers(0, model.args.vocab_size, 3), dtype=mx.int32))
        for s in others:
            s.settle()
    assert pieces > model.args.num_hidden_layers  # the others ran between the layers of each chunk
    assert same(shared.logits, want)
    for n in (1, 2, 3):
        token = int(rng.integers(0, model.args.vocab_size))
        solo = Session(model)
        solo.restore(alone.snapshot())
        mine = Session(model)
        mine.restore(alone.snapshot())
        together = step_together([mine] + others[:n], mx.array([token] + [1] * n, dtype=mx.int32))[0]
        for s in [mine] + others[:n]:
            s.settle()
        assert same(together, solo.step(token))


@pytest.mark.parametrize("quant_sim", [True, False])
@pytest.mark.parametrize("shared", [3, 4, 5, 127, 128, 129, 2047, 2048, 2049])
def test_a_replay_computes_the_cold_chunks(quant_sim, shared, tmp_path):
    """B shares `shared` tokens with a 3,000-token A, so B's rewind goes past the trim horizon and replays
    from a grid position: B's logits equal a cold prefill's bit for bit; so after A is saved and loaded."""
    model = model_for(quant_sim)
    rng = np.random.default_rng(shared)
    a = rng.integers(0, model.args.vocab_size, 3000).tolist()
    b = a[:shared] + rng.integers(0, model.args.vocab_size, 40).tolist()
    want = Session(model).sync(b)
    session = Session(model)
    session.sync(a)
    session.save(tmp_path / "a.safetensors")
    assert same(session.sync(b), want)
    assert session.last_sync["reused"] < shared + 1  # it replayed (nothing was kept in place past the grid)
    loaded = Session(model)
    loaded.load(tmp_path / "a.safetensors")
    assert same(loaded.sync(b), want)


@pytest.mark.parametrize("quant_sim", [True, False])
def test_exact_rewinds_give_a_cold_prefills_bits_after_any_history(quant_sim):
    """A trim in place keeps rows computed in other chunks than a cold prefill's (their numbers differ in
    the last bits); with `exact_rewinds` the session replays from the grid instead: resends, answers sent
    back, and extensions of a partial chunk all give a cold prefill's bits."""
    model = model_for(quant_sim)
    rng = np.random.default_rng(1)
    vocab = model.args.vocab_size
    prompt = rng.integers(0, vocab, 700).tolist()
    session = Session(model, exact_rewinds=True)
    session.sync(prompt)
    answer = [int(mx.argmax(session.logits))]
    for _ in range(20):
        answer.append(int(mx.argmax(session.step(answer[-1]))))
    for nxt in (prompt, prompt + answer + rng.integers(0, vocab, 30).tolist(), prompt[:690] + [1, 2, 3]):
        assert same(session.sync(nxt), Session(model).sync(nxt))


def logprobs_of(client, prompt, salt):
    """A greedy completion's logprobs and text; each `salt` a namespace of its own (nothing reused across)."""
    done = client.completions.create(model=DEMO_MODEL_ID, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                     extra_body={"cache_salt": salt})
    return done.choices[0].logprobs.token_logprobs, done.choices[0].text


@pytest.mark.parametrize("quant_sim,batch", [(True, 1), (False, 4)])  # each setting once: suite time
def test_a_requests_logprobs_are_the_same_beside_other_streams(quant_sim, batch):
    """Through the server: the same greedy request alone, then beside 1 to 3 other streams (prefilling
    and decoding while it prefills and decodes): its logprobs bit for bit."""
    from openai import OpenAI

    from ds4_mlx.server.build import BackgroundServer, build_server

    words = " ".join(f"w{i}" for i in range(350))  # two chunks of a 512-token grid
    mine = f"The list: {words}. Go on:"
    others = [f"Other {k}: " + " ".join(f"x{k}{i}" for i in range(120 * k)) for k in (1, 2, 3)]
    server = build_server(lambda: load(demo_model_path(), quant_sim=quant_sim, progress=False),
                          model_id=DEMO_MODEL_ID, ctx=8192, sessions=4, budget_bytes=2**32, batch=batch,
                          prefill_chunk=512)
    with BackgroundServer(server) as bg:
        client = OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
        want = logprobs_of(client, mine, "alone")
        for n in (1, 2, 3):
            threads = [threading.Thread(target=logprobs_of, args=(client, p, f"other{n}.{k}"))
                       for k, p in enumerate(others[:n])]
            for t in threads:
                t.start()
            got = logprobs_of(client, mine, f"beside{n}")  # computed from the start while the others run
            for t in threads:
                t.join()
            assert got == want, f"beside {n} other streams"
