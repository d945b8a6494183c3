"""Speculative decoding never changes the output: greedy text token for token, sampled tokens in
distribution (the acceptance rule against the plain sampler's exact distribution)."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from ds4_mlx.generate import Sampler, SamplingParams, filter_logits, stream_generate
from ds4_mlx.session import Session
from ds4_mlx.speculative import Speculation, accept, transformed
from ds4_mlx.tools.drafters import OracleDrafter, RandomDrafter, random_dspark, random_mtp
from ds4_mlx.tools.random_model import random_model
from ds4_mlx.tools.testing import tiny_args


class Tokens:
    """Token i decodes to one letter: no stop strings by accident."""

    eos_id = 1

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


PROMPTS = [[5, 9, 33, 100, 7, 8, 200, 3, 4], [2], list(range(100, 190)), list(range(40, 70)), [300, 12, 5, 99, 64, 2]]


def generate(model, prompt, n, speculation=None, session=None, **sampling):
    session = session or Session(model)
    sampling = SamplingParams(**{"temperature": 0, **sampling})
    out = [c.token for c in stream_generate(session, Tokens(), prompt, max_tokens=n, sampling=sampling,
                                            stop_ids=[1], speculation=speculation) if c.token is not None]
    return out, session


@pytest.fixture(scope="module")
def target():
    args = tiny_args()
    return random_model(args, seed=1)


def drafters(model, continuation):
    args = model.args
    return {
        "dspark": Speculation(random_dspark(args, seed=2), draft_tokens=5),
        "mtp": Speculation(random_mtp(args, seed=3), draft_tokens=3),
        # accepts most drafts: the rounds that commit several tokens (the scheduler left out: their count
        # would depend on the machine's timings)
        "oracle": Speculation(OracleDrafter(continuation, 4.4, 5, seed=4), draft_tokens=5, schedule=False),
        "oracle_low": Speculation(OracleDrafter(continuation, 1.8, 5, seed=5), draft_tokens=5),
        "random": Speculation(RandomDrafter(4, seed=6), draft_tokens=4),
    }


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_the_plain_text(target, prompt):
    for n in (1, 6, 40):
        plain, plain_session = generate(target, prompt, n)
        for name, spec in drafters(target, prompt + plain).items():
            got, session = generate(target, prompt, n, spec)
            assert got == plain, (name, n)
            assert session.tokens == plain_session.tokens, (name, n)  # the cache contract too
            if name == "oracle" and n == 40:
                assert spec.stats.mean_accepted_length > 2  # the multi-token rounds did run


def test_greedy_follow_up_turns_reuse_the_session(target):
    """A second turn on the same session (a rewind into the answer, then new tokens) and a stop id."""
    prompt = PROMPTS[0]
    plain, _ = generate(target, prompt, 20)
    follow = prompt + plain[:12] + [42, 43]
    plain2, _ = generate(target, follow, 25)
    for name, spec in drafters(target, follow + plain2).items():
        session = Session(target)
        got, _ = generate(target, prompt, 20, spec, session=session)
        assert got == plain, name
        got2, _ = generate(target, follow, 25, spec, session=session)
        assert got2 == plain2, name


def test_greedy_with_logit_bias(target):
    prompt = PROMPTS[3]
    bias = {7: 3.0, 100: 5.0, 250: -2.0}
    plain, _ = generate(target, prompt, 30, logit_bias=bias)
    for name, spec in drafters(target, prompt + plain).items():
        assert generate(target, prompt, 30, spec, logit_bias=bias)[0] == plain, name


def test_verify_rows_are_the_decoded_rows(target):
    """`Session.verify` gives at each row the logits that feeding the tokens one by one gives."""
    prompt, more = PROMPTS[0], [4, 77, 300, 21]
    one = Session(target)
    one.sync(prompt)
    rows = [one.step(t) for t in more]
    chunk = Session(target)
    chunk.sync(prompt)
    verified = chunk.verify(more)
    assert np.allclose(np.array(verified), np.array(mx.stack(rows)), atol=1e-4)
    chunk.trim(len(prompt) + 2)
    assert np.allclose(np.array(chunk.step(300)), np.array(rows[2]), atol=1e-4)


def test_verify_together_is_each_sessions_verify(target):
    """Several sessions' rows in one forward (padded to the longest, the padding trimmed): each session ends
    as its own `verify` leaves it (tokens, checkpoints, the drafter's streams, the next step), also one
    whose padded rows would cross a checkpoint (it verifies alone) and one with exact rewinds."""
    from ds4_mlx.session import verify_together

    drafter = random_dspark(target.args, seed=2)
    cases = [(PROMPTS[0], [4, 77, 300], {}), (PROMPTS[2], [9], {}), (PROMPTS[3], [5, 6, 7, 8, 9], {}),
             (PROMPTS[4], [12, 13], {"checkpoint_every": 8}), (PROMPTS[1], [3, 3], {"exact_rewinds": True})]
    made = []
    for _ in range(2):
        sessions = []
        for prompt, _, options in cases:
            session = Session(target, **options)
            Speculation(drafter, draft_tokens=5).attach(session)
            session.sync(prompt)
            sessions.append(session)
        made.append(sessions)
    alone, together = made
    expected = [s.verify(ids) for s, (_, ids, _) in zip(alone, cases)]
    got = verify_together(together, [ids for _, ids, _ in cases])
    for a, b, e, g in zip(alone, together, expected, got):
        assert g.shape == e.shape and np.allclose(np.array(g), np.array(e), atol=1e-4)
        assert a.tokens == b.tokens and set(a.checkpoints) == set(b.checkpoints)
        n = len(a.tokens)
        assert b.tap_log.pos == n and np.allclose(np.array(b.tap_log.window(n, 8)[1]),
                                                   np.array(a.tap_log.window(n, 8)[1]), atol=1e-4)
        assert np.allclose(np.array(b.step(21)), np.array(a.step(21)), atol=1e-4)


# -- sampling: the acceptance rule against the exact distribution ---------------------------------------

VOCAB = 6


def _chi_square_p(observed, expected):
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the plain sampler never draws was drawn"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("temperature,top_p,min_p", [(1.0, 1.0, 0.0), (0.7, 1.0, 0.05), (0.5, 0.9, 0.05)])
def test_sampled_tokens_have_the_plain_distribution(temperature, top_p, min_p):
    """A Markov target (logits by the previous token) and a drafter that disagrees with it: the first two
    tokens after the anchor, over 20,000 rounds, against the plain sampler's exact joint distribution."""
    rng = np.random.default_rng(0)
    target_logits = mx.array(rng.normal(0, 1.5, (VOCAB, VOCAB)).astype(np.float32))
    draft_logits = mx.array(rng.normal(0, 1.5, (VOCAB, VOCAB)).astype(np.float32))
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, seed=11)
    sampler = Sampler(params)
    anchor, k, draws = 2, 2, 20000

    plain = np.array(mx.softmax(mx.stack([filter_logits(target_logits[i], params) for i in range(VOCAB)]), axis=-1))
    expected = (plain[anchor][:, None] * plain) * draws  # P(x) P(y | x)

    # the drafter's side is not under test: its draws come from numpy, from the distributions it proposes
    proposal = np.array(mx.softmax(transformed(sampler, draft_logits), axis=-1), dtype=np.float64)
    observed = np.zeros((VOCAB, VOCAB))
    for _ in range(draws):
        out, prev = [], anchor
        while len(out) < 2:  # rounds from the last emitted token until two are out
            drafts = []
            for _ in range(k):
                q = proposal[drafts[-1] if drafts else prev]
                drafts.append(int(rng.choice(VOCAB, p=q / q.sum())))
            a, nxt = accept(sampler, target_logits[mx.array([prev] + drafts)], drafts,
                            draft_logits[mx.array([prev] + drafts[:-1])])
            out += drafts[:a] + [nxt]
            prev = out[-1]
        observed[out[0], out[1]] += 1
    p = _chi_square_p(observed.ravel(), expected.ravel())
    assert p > 0.01, p


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.05), (3, 0.7, 0.0), (0, 0.9, 0.1), (5, 1.0, 0.0)])
def test_rows_are_filtered_as_the_plain_sampler_filters_one(top_k, top_p, min_p):
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = mx.array(np.random.default_rng(1).normal(0, 2, (5, 40)).astype(np.float32))
    sampler = Sampler(params)
    together = np.array(transformed(sampler, rows))
    for i in range(5):
        assert np.array_equal(together[i], np.array(filter_logits(rows[i], params)))


def test_greedy_acceptance_is_prefix_match():
    logits = mx.array(np.eye(VOCAB, dtype=np.float32)[[3, 1, 4, 0]])
    sampler = Sampler(SamplingParams(temperature=0))
    assert accept(sampler, logits, [3, 1, 5], mx.zeros((3, VOCAB))) == (2, 4)
    assert accept(sampler, logits, [3, 1, 4], mx.zeros((3, VOCAB))) == (3, 0)
    assert accept(sampler, logits[:1], [], None) == (0, 3)


def test_snapshot_and_trim_carry_the_drafter_streams(target):
    """The tap log follows the session: a trim drops the trimmed positions' rows, a snapshot restores them."""
    spec = Speculation(random_dspark(target.args, seed=2), draft_tokens=5)
    session = Session(target)
    spec.attach(session)
    session.sync(PROMPTS[3])
    n = len(PROMPTS[3])
    log = session.tap_log
    assert log.pos == n
    first, rows = log.window(n, 8)
    snap = session.snapshot()
    session.trim(n - 5)
    assert log.pos == n - 5
    session.restore(snap)
    assert session.tap_log.pos == n
    assert np.array_equal(np.array(session.tap_log.window(n, 8)[1]), np.array(rows))
    other = Session(target)
    other.restore(snap)  # a session without a drafter takes the snapshot too
    assert other.tokens == session.tokens



def test_speculative_bench_reports_the_issue_figures(capsys):
    import json

    from ds4_mlx import cli

    assert cli.main(["bench", "speculative", "--json", "--context", "40", "--decode", "24", "--repeats", "1"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["greedy_identical"] is True
    assert [r["drafter"] for r in figures["results"]] == ["oracle 3.3", "oracle 4.4", "random"]
    for row in figures["results"]:
        assert row["tok_s"] > 0 and row["plain_tok_s"] == figures["plain_tok_s"] and row["accepted_length"] >= 1
    assert [r["rows"] for r in figures["verify_cost"]] == [2, 4, 6]


def test_sampled_generation_keeps_the_cache_contract(target):
    """Sampling with speculation: the session holds the prompt and the answer, and a seed repeats a run."""
    prompt = PROMPTS[3]
    runs = []
    for _ in range(2):
        spec = Speculation(OracleDrafter(prompt + [0] * 64, 4.4, 5, seed=1), draft_tokens=5, schedule=False)
        out, session = generate(target, prompt, 30, spec, temperature=0.9, top_p=0.95, seed=5)
        answer = out[:-1] if out[-1] == Tokens.eos_id else out  # a stop token is not kept; on "length" all are
        assert session.tokens == prompt + answer
        runs.append(out)
    assert runs[0] == runs[1]


def test_settings_it_cannot_reproduce_decode_plainly():
    import dataclasses

    @dataclasses.dataclass
    class WithPenalty(SamplingParams):
        repetition_penalty: float = 1.0

    assert Speculation.supports(WithPenalty(temperature=0.7, top_p=0.9, logit_bias={3: 1.0}))
    assert not Speculation.supports(WithPenalty(repetition_penalty=1.1))


def test_verify_takes_the_checkpoints_a_rewind_restores(target):
    """Verifies crossing multiples of checkpoint_every leave checkpoints there, so a rewind past what the
    rings hold restores one and replays (and lands on the logits a cold session computes)."""
    prompt = PROMPTS[3]
    session = Session(target, rewind_slack=8, checkpoint_every=8, frontier_horizon=8)
    session.sync(prompt[:5])
    for i in range(5, len(prompt), 5):
        session.verify(prompt[i : i + 5])
    assert session.tokens == prompt
    assert {8, 16, 24} <= set(session.checkpoints)
    other = prompt[:9] + [3, 4]
    logits = session.sync(other)
    assert session.last_sync["replayed"] > 0  # restored from a checkpoint, then replayed
    cold = Session(target).sync(other)
    assert np.allclose(np.array(logits), np.array(cold), atol=1e-4)


def test_rounds_trim_in_place(target):
    """A round's rejected drafts go by trimming the rings, never by a replay."""
    prompt = PROMPTS[0]
    plain, _ = generate(target, prompt, 30)
    session = Session(target, rewind_slack=6, frontier_horizon=6)
    replays = []
    rewind = session._rewind
    session._rewind = lambda n: replays.append(rewind(n)) or replays[-1]
    spec = Speculation(OracleDrafter(prompt + plain, 3.0, 5, seed=2), draft_tokens=5, schedule=False)
    assert generate(target, prompt, 30, spec, session=session)[0] == plain
    assert replays and not any(replays)
    with pytest.raises(ValueError, match="trims up to 6 tokens a round in place"):
        spec.attach(Session(target, rewind_slack=0))


def test_dspark_confidence_cuts_the_drafts(target):
    """--dspark-confidence: a round's drafts stop at the first whose confidence is below the threshold."""
    prompt = PROMPTS[0]
    plain, _ = generate(target, prompt, 12)
    drafter = random_dspark(target.args, seed=2)
    counts = {}
    for threshold in (0.0, 1.0):
        spec = Speculation(drafter, draft_tokens=5, confidence=threshold, schedule=False)
        assert generate(target, prompt, 12, spec)[0] == plain
        counts[threshold] = spec.stats.drafted
    assert counts[0.0] > 0 and counts[1.0] == 0  # a sigmoid is below 1: every draft is cut


def test_the_server_logs_a_stream_it_closes_early(target, monkeypatch):
    """The server closes a stream's generator once it has its tokens: the stream's figures are logged then,
    as when it runs to its end."""
    import ds4_mlx.generate
    from ds4_mlx.speculative import server_generate

    monkeypatch.setattr(ds4_mlx.generate, "stream_generate", lambda *args, **kwargs: iter(range(3)))
    lines = []
    generate_ = server_generate(lambda model: Speculation(RandomDrafter(3, seed=1), draft_tokens=3), lines.append)
    assert list(generate_(Session(target))) == [0, 1, 2] and len(lines) == 1
    stream = generate_(Session(target))
    assert next(stream) == 0
    stream.close()
    assert len(lines) == 2


def test_a_verify_runs_whole_beside_other_streams(target, monkeypatch):
    """A server sets `layers_per_turn` on its sessions while several streams run: a prompt's chunk then
    runs in pieces of layers, each waiting for the device; a verify's few rows (and a token) run whole."""
    session = Session(target)
    session.sync([5, 9, 33, 100])
    session.layers_per_turn = 1
    asked = []
    forward_steps = target.forward_steps

    def recorded(ids, views, **kwargs):
        asked.append((ids.shape[1], kwargs["layers_per_step"]))
        return forward_steps(ids, views, **kwargs)

    monkeypatch.setattr(target, "forward_steps", recorded)
    session.verify([7, 8, 9])
    session.step(4)
    session.sync(session.tokens + [10, 11, 12])
    assert asked == [(3, None), (1, None), (3, 1)]
