"""Speculative decoding that never changes the output: a drafter proposes tokens, the target checks them
all in one forward (`Session.verify`), and the standard acceptance rule keeps the output exactly the
plain sampler's.

- Greedy (temperature below `GREEDY_BELOW`): the longest prefix of drafts equal to the target's argmax,
  then the target's own next token: token for token what plain greedy decoding gives.
- Sampling: draft i, drawn from q_i, is accepted with probability min(1, p_i / q_i); on the first
  rejection the token is drawn from normalize(max(p_i - q_i, 0)); when all are accepted the next one is
  drawn from p. p is the plain sampler's distribution (logit bias, temperature, top-k, top-p, min-p:
  `generate.filter_logits`) and q the same transforms of the drafter's logits, so each emitted token has
  exactly the distribution plain sampling gives it (Leviathan et al. 2023, Chen et al. 2023).

A round: draft k tokens after the anchor (the token sampled last, not yet fed), verify [anchor, drafts]
in one forward, keep the anchor and the accepted drafts (the session trims the rest: exact, in place),
and draw the next anchor. The drafter reads only the target's streams at committed positions
(`ds4_mlx.cache.taps.TapLog`, which the session trims with its tokens).

`Speculation` plugs into `generate.stream_generate` with two calls: `step` instead of the session's step,
and `next_draw` before drawing. It hands the committed tokens to the loop one at a time (restoring a
snapshot and trimming, no model work), so the loop's stop and trim logic sees one token a step.
"""

import time
from dataclasses import dataclass, field

import mlx.core as mx

from ds4_mlx.cache.taps import TapLog
from ds4_mlx.generate import GREEDY_BELOW, filter_logits

# rows of the tap log beyond the drafter's window: a verify's rejected tail is trimmed within them
TAP_SLACK = 64


def transformed(sampler, logits):
    """The logits the plain sampler draws from, for one row [vocab] or several [rows, vocab] (logit bias
    added; for sampling, also temperature and filters, as `generate.filter_logits` applies them to a row)."""
    params = sampler.params
    if params.logit_bias:
        vocab = logits.shape[-1]
        if sampler.bias is None:  # as `Sampler.draw` makes it
            ids = [i for i in params.logit_bias if 0 <= i < vocab]
            sampler.bias = mx.zeros((vocab,)).at[mx.array(ids, dtype=mx.int32)].add(
                mx.array([params.logit_bias[i] for i in ids])) if ids else mx.zeros((vocab,))
        logits = logits.astype(mx.float32) + sampler.bias
    if params.temperature < GREEDY_BELOW:
        return logits.astype(mx.float32)
    if logits.ndim == 1:
        return filter_logits(logits, params)
    return filter_rows(logits, params)


def filter_rows(logits, params):
    """`generate.filter_logits` on each row of [rows, vocab] at once (the same operations along the last
    axis; a test holds them equal)."""
    logits = logits.astype(mx.float32) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = mx.sort(logits, axis=-1)[:, -params.top_k][:, None]
        logits = mx.where(logits < kth_largest, -mx.inf, logits)
    if params.top_p < 1.0:
        probs = mx.softmax(logits, axis=-1)
        sorted_probs = mx.sort(probs, axis=-1)[:, ::-1]
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        kept = mass_before < params.top_p
        smallest_kept = mx.min(mx.where(kept, sorted_probs, mx.inf), axis=-1, keepdims=True)
        logits = mx.where(probs < smallest_kept, -mx.inf, logits)
    if params.min_p > 0.0:
        probs = mx.softmax(logits, axis=-1)
        logits = mx.where(probs < params.min_p * mx.max(probs, axis=-1, keepdims=True), -mx.inf, logits)
    return logits


def accept(sampler, target_logits, draft_tokens, draft_logits):
    """The acceptance rule. target_logits [k + 1, vocab]: the target's logits after the anchor and after
    each draft; draft_logits [k, vocab]: the drafter's, each draft chosen from its row (greedy: argmax;
    sampling: drawn from the `transformed` distribution). -> (accepted drafts a, the next token)."""
    k = len(draft_tokens)
    if sampler.params.temperature < GREEDY_BELOW:
        best = mx.argmax(transformed(sampler, target_logits), axis=-1).tolist()
        a = 0
        while a < k and draft_tokens[a] == best[a]:
            a += 1
        return a, best[a]
    p = mx.softmax(transformed(sampler, target_logits), axis=-1)
    if k:
        q = mx.softmax(transformed(sampler, draft_logits), axis=-1)
        idx = mx.array(draft_tokens, dtype=mx.int32)
        ratio = (p[mx.arange(k), idx] / q[mx.arange(k), idx])
        sampler.key, key = mx.random.split(sampler.key)
        u = mx.random.uniform(shape=(k,), key=key)
        accepted = (u < ratio).tolist()
    else:
        accepted = []
    a = 0
    while a < k and accepted[a]:
        a += 1
    sampler.key, key = mx.random.split(sampler.key)
    if a < k:  # the residual distribution of the first rejected position
        residual = mx.maximum(p[a] - q[a], 0.0)
        if residual.sum().item() <= 0:  # p == q up to rounding: then p is the residual
            residual = p[a]
        token = mx.random.categorical(mx.log(residual), key=key)
    else:
        token = mx.random.categorical(mx.log(p[a]), key=key)
    return a, int(token.item())


@dataclass
class SpeculationStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_lengths: list = field(default_factory=list)  # tokens committed per verify, the target's own included

    @property
    def mean_accepted_length(self):
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0


class Speculation:
    """Speculative decoding of one `stream_generate` call with `drafter` (`models.dspark.DSpark`,
    `models.mtp.MTP`, or any object with their `tap_keys`, `tap_rows`, `tap_width` and `draft`).

    draft_tokens: drafts a round (at most the DSpark block). confidence: DSpark cuts a round's drafts at
    the first whose confidence is below it (0: never)."""

    def __init__(self, drafter, *, draft_tokens=None, confidence=0.0):
        self.drafter = drafter
        default = getattr(getattr(drafter, "dspark", None), "block_size", 2)
        self.draft_tokens = default if draft_tokens is None else draft_tokens
        if self.draft_tokens < 0:
            raise ValueError(f"--draft-tokens must be >= 0, got {self.draft_tokens}")
        self.confidence = confidence
        self.stats = SpeculationStats()
        self.pending = []  # [(token, logits after it)] committed by the last round, not yet handed out
        self.next_token = None
        self.snapshot = None

    def attach(self, session):
        """Start a generation on `session`: it records the streams the drafter reads from its next feed on,
        and nothing of an earlier generation's round is left."""
        self.pending, self.next_token, self.snapshot = [], None, None
        if not self.drafter.tap_keys:
            return
        log = session.tap_log
        if log is None or log.keys != tuple(self.drafter.tap_keys) or log.width != self.drafter.tap_width:
            window = session.model.args.sliding_window
            session.tap_log = TapLog(self.drafter.tap_keys, self.drafter.tap_rows, self.drafter.tap_width,
                                     window + TAP_SLACK)
            session.tap_log.restart(len(session.tokens))

    # the two calls of `stream_generate`
    def next_draw(self):
        """The token the loop must feed next when a round decided it (an accepted draft, or the token
        drawn by the acceptance rule), else None."""
        if self.pending:
            return mx.array(self.pending[0][0])
        if self.next_token is not None:
            token, self.next_token = self.next_token, None
            return mx.array(token)
        return None

    def step(self, session, sampler, token):
        """`session.step(token)`: the next-token logits after it. Runs a round when no committed token
        is waiting."""
        token = int(token.item()) if isinstance(token, mx.array) else int(token)
        if self.pending:
            expected, logits = self.pending.pop(0)
            if expected != token:
                raise RuntimeError("speculation: the loop fed another token than the round committed")
            self.handed += 1
            session.restore(self.snapshot)
            session.trim(self.base + 1 + self.handed)
            session.logits = logits
            return logits
        return self.round(session, sampler, token)

    def round(self, session, sampler, anchor):
        """Draft, verify [anchor, drafts], accept; the session ends at the anchor, with the accepted
        drafts waiting in `pending` and the next token in `next_token`. -> the logits after the anchor."""
        self.attach(session)
        n = len(session.tokens)
        greedy = sampler.params.temperature < GREEDY_BELOW
        tokens, draft_logits = [], None
        start = time.perf_counter()
        log = session.tap_log if self.drafter.tap_keys else None
        if self.draft_tokens and (log is None or log.pos == n > log.ring.floor):
            first, context = log.window(n, session.model.args.sliding_window) if log else (n, None)

            def choose(row):
                row = transformed(sampler, row)
                if greedy:
                    return mx.argmax(row)
                sampler.key, key = mx.random.split(sampler.key)
                return mx.random.categorical(row, key=key)

            tokens, draft_logits, conf = self.drafter.draft(session.model, anchor, context, first, choose,
                                                            self.draft_tokens, committed_tokens=session.tokens)
            if conf is not None and self.confidence > 0 and tokens:
                low = [i for i, c in enumerate(conf.tolist()) if c < self.confidence]
                if low:
                    tokens, draft_logits = tokens[: low[0]], draft_logits[: low[0]]
        self.stats.draft_seconds += time.perf_counter() - start
        start = time.perf_counter()
        logits = session.verify([anchor] + tokens)
        self.stats.verify_seconds += time.perf_counter() - start
        a, self.next_token = accept(sampler, logits, tokens, draft_logits)
        if a < len(tokens):
            session.trim(n + 1 + a)
            session.logits = logits[a]
        self.stats.rounds += 1
        self.stats.drafted += len(tokens)
        self.stats.accepted += a
        self.stats.accepted_lengths.append(a + 1)
        self.pending = [(tokens[i], logits[i + 1]) for i in range(a)]
        self.base, self.handed = n, 0
        if self.pending:  # hand the drafts out one at a time: the session at the anchor for now
            self.snapshot = session.snapshot()
            session.trim(n + 1)
            session.logits = logits[0]
        return logits[0]
