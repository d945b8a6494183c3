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

import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ds4_mlx.cache.taps import TapLog
from ds4_mlx.generate import GREEDY_BELOW, DecodeStep, VerifyStep, filter_logits

# rows of the tap log beyond the drafter's window: a verify's rejected tail is trimmed within them
TAP_SLACK = 64
# the scheduler: how many of the latest rounds of a length estimate its cost (their median: a busy moment
# does not swing it) and how many of the latest drafts the acceptance; a guess of a verify's cost (one
# decoded step's, times 1 + this per extra row) until it is measured; how often a plain stretch drafts
# anyway, to see whether acceptance came back
COST_WINDOW = 9
# the sampling settings `transformed` applies as the plain sampler does (or that do not change the draw):
# a setting not in this list, left at a value other than its default, makes the generation decode plainly
EXACT_SETTINGS = {"temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "constraint", "logit_bias"}
ACCEPTANCE_WINDOW = 32
ROW_COST_GUESS = 0.25
PROBE_EVERY = 64


def _id(token):
    return int(token.item()) if isinstance(token, mx.array) else int(token)


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
    # every outcome's token is drawn before the acceptances are known, so that one evaluation gives both
    # (the host waits once a round): row i of `rows` is what follows i accepted drafts, the residual
    # max(p - q, 0) of the first rejected position (p itself where p == q up to rounding), or after all k
    # the target's own distribution; the draw of row a is independent of the draws that decided a
    p = mx.softmax(transformed(sampler, target_logits), axis=-1)
    sampler.key, accept_key = mx.random.split(sampler.key)
    sampler.key, token_key = mx.random.split(sampler.key)
    if k:
        q = mx.softmax(transformed(sampler, draft_logits), axis=-1)
        idx = mx.array(draft_tokens, dtype=mx.int32)
        ratio = p[mx.arange(k), idx] / q[mx.arange(k), idx]
        accepted = mx.random.uniform(shape=(k,), key=accept_key) < ratio
        residual = mx.maximum(p[:k] - q, 0.0)
        residual = mx.where(residual.sum(axis=-1, keepdims=True) <= 0, p[:k], residual)
        rows = mx.concatenate([residual, p[k:]])
    else:
        accepted, rows = mx.zeros((0,), mx.bool_), p
    tokens = mx.random.categorical(mx.log(rows), key=token_key)
    mx.eval(accepted, tokens)
    accepted, tokens = accepted.tolist(), tokens.tolist()
    a = 0
    while a < k and accepted[a]:
        a += 1
    return a, int(tokens[a])


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

    draft_tokens: the most drafts a round (at most the DSpark block). confidence: DSpark cuts a round's
    drafts at the first whose confidence is below it (0: never). schedule: choose each round's draft
    count from the measured acceptance and the measured cost of a verify of each length (the count that
    commits the most tokens a second; none, a plain step, when no count pays); off, always draft_tokens."""

    def __init__(self, drafter, *, draft_tokens=None, confidence=0.0, schedule=True):
        self.drafter = drafter
        default = getattr(getattr(drafter, "dspark", None), "block_size", 2)
        self.draft_tokens = default if draft_tokens is None else draft_tokens
        if self.draft_tokens < 0:
            raise ValueError(f"--draft-tokens must be >= 0, got {self.draft_tokens}")
        if draft_tokens is not None and draft_tokens > default and hasattr(drafter, "dspark"):
            raise ValueError(f"--draft-tokens {draft_tokens} is more than the DSpark drafter's block ({default})")
        self.confidence, self.schedule = confidence, schedule
        self.outcomes = []  # the latest drafts up to each round's first rejection: accepted or not
        self.costs = {}  # rows verified (1: a plain step) -> the seconds the latest rounds of that length took
        self.seen = set()
        self.plain_rounds = 0
        self.last_start = None  # (time, rows) of the round or plain step under way
        self.stats = SpeculationStats()
        self.pending = []  # [(token, logits after it)] committed by the last round, not yet handed out
        self.next_token = None
        self.snapshot = None
        self.mask_rows = None  # (rows, tokens fed) -> the rows as the plain draws mask them (control tokens)

    def attach(self, session):
        """Start a generation on `session`: it records the streams the drafter reads from its next feed on,
        and nothing of an earlier generation's round is left."""
        self.pending, self.next_token, self.snapshot, self.last_start = [], None, None, None
        if not self.fits(session):  # else every rejected draft would cost a replay
            raise ValueError(f"speculation trims up to {self.draft_tokens + 1} tokens a round in place: the session "
                             "needs rewind_slack and frontier_horizon of at least that (it has "
                             f"{min(session.rewind_slack, session.frontier_horizon)})")
        if not self.drafter.tap_keys:
            return
        log = session.tap_log
        if log is None or log.keys != tuple(self.drafter.tap_keys) or log.width != self.drafter.tap_width:
            window = session.model.args.sliding_window
            session.tap_log = TapLog(self.drafter.tap_keys, self.drafter.tap_rows, self.drafter.tap_width,
                                     window + TAP_SLACK)
            session.tap_log.restart(len(session.tokens))

    def fits(self, session):
        """Whether `session` trims a round's rejected drafts in place (its rings hold that many rows more)."""
        return min(session.rewind_slack, session.frontier_horizon) >= self.draft_tokens + 1

    @staticmethod
    def supports(params):
        """Whether the acceptance rule reproduces the plain sampler under `params` exactly."""
        defaults = type(params)()
        return all(getattr(params, f) == getattr(defaults, f) for f in params.__dataclass_fields__
                   if f not in EXACT_SETTINGS)

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
        is waiting and drafting pays, else a plain step (pipelined, as without speculation; tapped, so
        the drafter keeps its context, when the drafter reads the target's streams)."""
        work = self.steps(session, sampler, token)
        try:
            request = next(work)
            while True:
                if isinstance(request, DecodeStep):
                    request = work.send(session.step_async(request.token))
                else:
                    request = work.send(session.verify(request.ids))
        except StopIteration as done:
            return done.value

    def steps(self, session, sampler, token):
        """`step` as a generator that leaves the forward to its caller: it yields a `DecodeStep` (a plain
        step) or a `VerifyStep` (the rows to verify), takes their logits from `send`, and returns the
        next-token logits after `token`, so that a server runs several streams' forwards as one."""
        if not self.pending:
            count = self.draft_count()
            self._started(count + 1)
            if count == 0:
                if self.drafter.tap_keys:
                    return (yield VerifyStep(session, [_id(token)]))[0]
                return (yield DecodeStep(session, token if isinstance(token, mx.array) else mx.array(token)))
        token = _id(token)
        if self.pending:
            expected, logits = self.pending.pop(0)
            if expected != token:
                raise RuntimeError("speculation: the loop fed another token than the round committed")
            self.handed += 1
            session.restore(self.snapshot)
            session.trim(self.base + 1 + self.handed)
            session.logits = logits
            return logits
        return (yield from self.round(session, sampler, token, count))

    @property
    def acceptance(self):
        """The chance a draft is accepted after accepted ones, over the latest drafts (a uniform prior)."""
        return (sum(self.outcomes) + 1) / (len(self.outcomes) + 2)

    def draft_count(self):
        """How many tokens to draft this round: the count with the most expected committed tokens a
        second, costs as measured (from the start of a round to the next one's, so the loop's own time
        counts) or guessed; 0: a plain step."""
        if not self.schedule:
            return self.draft_tokens
        if 1 not in self.costs:  # plain steps until one is measured
            return 0
        one = self.cost(1)
        alpha, best, best_rate = self.acceptance, 0, 1 / one
        for k in range(1, self.draft_tokens + 1):
            cost = self.cost(k + 1) if k + 1 in self.costs else one * (1 + ROW_COST_GUESS * k)
            rate = sum(alpha ** i for i in range(k + 1)) / cost
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0:
            self.plain_rounds += 1
            if self.plain_rounds % PROBE_EVERY == 0:  # the cheapest round tells whether drafts are accepted again
                return min(1, self.draft_tokens)
        return best

    def _started(self, rows):
        """A round (or plain step) of `rows` rows starts now: the one before it ends."""
        now = time.perf_counter()
        if self.last_start is not None:
            then, before = self.last_start
            if before not in self.seen:  # the first of a length builds its graphs: not a measurement
                self.seen.add(before)
            else:
                took = self.costs.setdefault(before, [])
                took.append(now - then)
                del took[:-COST_WINDOW]
        self.last_start = (now, rows)

    def cost(self, rows):
        return statistics.median(self.costs[rows])

    def _judged(self, drafted, accepted):
        self.outcomes += [i < accepted for i in range(min(drafted, accepted + 1))]
        del self.outcomes[:-ACCEPTANCE_WINDOW]

    def round(self, session, sampler, anchor, count):
        """Draft up to `count` tokens, verify [anchor, drafts] (a generator: it yields the `VerifyStep`),
        accept; the session ends at the anchor, with the accepted drafts waiting in `pending` and the next
        token in `next_token`. -> the logits after the anchor."""
        n = len(session.tokens)
        greedy = sampler.params.temperature < GREEDY_BELOW
        tokens, draft_logits = [], None
        start = time.perf_counter()
        log = session.tap_log if self.drafter.tap_keys else None
        if count and (log is None or log.pos == n > log.ring.floor):
            first, context = log.window(n, session.model.args.sliding_window) if log else (n, None)

            def choose(row):
                row = transformed(sampler, row)
                if greedy:
                    return mx.argmax(row)
                sampler.key, key = mx.random.split(sampler.key)
                return mx.random.categorical(row, key=key)

            tokens, draft_logits, conf = self.drafter.draft(session.model, anchor, context, first, choose,
                                                            count, committed_tokens=session.tokens)
            if conf is not None and self.confidence > 0 and tokens:
                low = [i for i, c in enumerate(conf.tolist()) if c < self.confidence]
                if low:
                    tokens, draft_logits = tokens[: low[0]], draft_logits[: low[0]]
        self.stats.draft_seconds += time.perf_counter() - start
        self.last_start = (self.last_start[0], len(tokens) + 1)  # the rows this round verifies, after all
        start = time.perf_counter()
        logits = yield VerifyStep(session, [anchor] + tokens)
        if self.mask_rows is not None:
            logits = self.mask_rows(logits, [anchor] + tokens)
        self.stats.verify_seconds += time.perf_counter() - start
        a, self.next_token = accept(sampler, logits, tokens, draft_logits)
        self._judged(len(tokens), a)
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


# Command line ----------------------------------------------------------------------------------------


def add_arguments(parser):
    """`--mtp FILE [--dspark] [--draft-tokens N] [--dspark-confidence X]` (ds4's flags), for generate, chat
    and serve."""
    g = parser.add_argument_group("speculative decoding (the output stays exactly the same)")
    g.add_argument("--mtp", metavar="FILE", help="a drafter: ds4's DSpark support GGUF or MTP GGUF, or a folder "
                   "`ds4-mlx convert` made of one; drafts are verified several to a forward")
    g.add_argument("--dspark", action="store_true",
                   help="the --mtp file is a DSpark drafter (read from the file anyway: this checks it)")
    g.add_argument("--draft-tokens", "--spec-draft", type=int, default=None, metavar="N",
                   help="most drafts a round (default: the DSpark block, or 2 for MTP); the scheduler drafts fewer, "
                        "or none, when that commits more tokens a second")
    g.add_argument("--dspark-confidence", type=float, default=0.0, metavar="X",
                   help="cut a DSpark round's drafts at the first whose confidence is below X (default: never)")


def speculation_from_args(args):
    """None without --mtp; else make(model) -> a fresh `Speculation` for one generation, the drafter loaded
    at the first call (ValueError, one line, for a file that is not a drafter of this model)."""
    if not getattr(args, "mtp", None):
        if getattr(args, "dspark", False):
            raise ValueError("--dspark names the kind of the --mtp FILE drafter: give --mtp too")
        return None
    if args.draft_tokens is not None and args.draft_tokens < 0:
        raise ValueError(f"--draft-tokens must be >= 0, got {args.draft_tokens}")
    if not 0.0 <= args.dspark_confidence <= 1.0:
        raise ValueError(f"--dspark-confidence must be between 0 and 1, got {args.dspark_confidence}")
    loaded = {}

    def make(model):
        if loaded.get("model") is not model:
            from ds4_mlx.loader import load_drafter

            drafter = load_drafter(args.mtp, model)
            if args.dspark and drafter.kind != "dspark":
                raise ValueError(f"{args.mtp}: --dspark, but this is an MTP drafter (leave --dspark out)")
            loaded.update(model=model, drafter=drafter)
        return Speculation(loaded["drafter"], draft_tokens=args.draft_tokens, confidence=args.dspark_confidence)

    return make


def summary(stats: SpeculationStats) -> str:
    """One line for stderr or a log."""
    rate = stats.accepted / stats.drafted if stats.drafted else 0.0
    return (f"[speculation: {stats.rounds} verifies, {stats.drafted} drafted, {stats.accepted} accepted "
            f"({rate:.0%}), {stats.mean_accepted_length:.2f} tokens a verify]")


def server_generate(make, log=None):
    """The server's `stream_generate` with speculation: each stream has a fresh `Speculation`
    (`make(model)`), and decodes together with the other streams (`DecodeStep`, `VerifyStep`): plain
    steps in one forward, the verifies of the streams that drafted in another; each finished stream's
    figures go to `log`."""
    from ds4_mlx.generate import stream_generate

    def generate(session, *args, **kwargs):
        speculation = make(session.model)
        if not speculation.fits(session):  # --rewind-slack below a round: plain decoding
            yield from stream_generate(session, *args, yield_prefill=True, together=True, **kwargs)
            return
        try:
            yield from stream_generate(session, *args, yield_prefill=True, together=True, speculation=speculation,
                                       **kwargs)
        finally:  # the server closes a stream's generator once it has what it needs: log it then too
            if log is not None:
                log(summary(speculation.stats))

    return generate
