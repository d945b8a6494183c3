"""Sampling, stop conditions and streaming text on top of a `ds4_mlx.Session`.

The one entry point for callers (the server's worker thread, the REPL, `ds4-mlx generate`) is
`stream_generate`:

    sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=1)
    for chunk in stream_generate(session, tokenizer, prompt_ids, max_tokens=256, sampling=sampling,
                                 stop_strings=["\\n\\n"], should_abort=client_gone):
        send(chunk.text)
        if chunk.finish_reason:
            usage = chunk.stats

The cache contract, which makes a follow-up request reuse the cache: when the generator ends (any
finish reason, and also when the caller stops iterating), `session.tokens` is a prefix of
`prompt_ids + stats.output_ids`, and it is exactly that whenever generation got past the prefill.
`output_ids` are the answer's tokens: the stop token (EOS) is not part of them and is never fed to
the model, so the next prompt, which renders EOS after the answer, computes it along with the new
turn. A stop string drops the tokens from the one where the stop string begins, and the session is
trimmed to match. On "length" the last sampled token is fed (one extra decode step) so that the
cache holds the whole answer.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx

from ds4_mlx.chat import ContentDelta, OutputParser, ReasoningDelta, partial_marker_len
from ds4_mlx.constrain import ControlTokenMask
from ds4_mlx.session import SyncInterrupted

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"
RATE_MIN_TOKENS = 16  # below this, a speed measures overhead, not the model
GREEDY_BELOW = 1e-5  # a lower temperature divides the logits into inf and NaN: it is argmax


@dataclass
class SamplingParams:
    """Sampling knobs. Defaults are ds4's (temperature 1, top_p 1, min_p 0.05, no top_k).

    temperature below `GREEDY_BELOW` (0 included) means greedy (argmax). top_k <= 0, top_p >= 1 and
    min_p <= 0 switch that filter off. The filters apply to the temperature-scaled distribution in the
    order top_k, top_p, min_p. seed=None draws a random seed; a given seed makes a run reproducible.

    logprobs: None, or report each sampled token's log probability (under the model's distribution,
    before temperature and filters) with that many most likely alternatives. constraint: None, or a
    factory `constraint(tokenizer)` of an object with `mask(logits) -> logits` (disallowed tokens at
    -inf) and `advance(token)`, applied before each draw (`ds4_mlx.constrain`). logit_bias: None, or
    {token id: value} added to those tokens' logits before every draw (greedy too); an id outside the
    vocabulary names no token, so its bias changes nothing. presence_penalty and frequency_penalty as
    OpenAI defines them, over the tokens this generation drew: a token's logit loses
    count * frequency_penalty + (count > 0) * presence_penalty before every draw (greedy too)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.05
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    constraint: Optional[Callable] = None
    logit_bias: Optional[dict] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


def filter_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature-scaled float32 logits with the tokens removed by top_k/top_p/min_p set to -inf."""
    logits = logits.astype(mx.float32) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = mx.sort(logits)[-params.top_k]
        logits = mx.where(logits < kth_largest, -mx.inf, logits)
    if params.top_p < 1.0:
        probs = mx.softmax(logits)
        sorted_probs = mx.sort(probs)[::-1]
        mass_before = mx.cumsum(sorted_probs) - sorted_probs
        kept = mass_before < params.top_p  # the smallest set whose mass reaches top_p
        smallest_kept = mx.min(mx.where(kept, sorted_probs, mx.inf))
        logits = mx.where(probs < smallest_kept, -mx.inf, logits)
    if params.min_p > 0.0:
        probs = mx.softmax(logits)
        logits = mx.where(probs < params.min_p * mx.max(probs), -mx.inf, logits)
    return logits


class Sampler:
    """Draws token ids from next-token logits ([vocab]) with one `SamplingParams`; keeps its own
    random key, so two samplers with the same seed draw the same sequence."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed % 2**64)  # any integer: MLX takes 64 bits
        self.bias = None  # the logit bias as a [vocab] array, made at the first draw
        self.counts = None  # how often each token was drawn, [vocab], while a penalty asks for it

    def __call__(self, logits: mx.array) -> int:
        return int(self.draw(logits).item())

    def draw(self, logits: mx.array) -> mx.array:
        """The sampled id as an unevaluated array (no sync)."""
        if self.params.logit_bias:
            if self.bias is None:
                vocab = logits.shape[-1]
                ids = [i for i in self.params.logit_bias if 0 <= i < vocab]
                self.bias = mx.zeros((vocab,)).at[mx.array(ids, dtype=mx.int32)].add(
                    mx.array([self.params.logit_bias[i] for i in ids])) if ids else mx.zeros((vocab,))
            logits = logits.astype(mx.float32) + self.bias
        penalized = self.params.presence_penalty or self.params.frequency_penalty
        if penalized:
            if self.counts is None:
                self.counts = mx.zeros((logits.shape[-1],), dtype=mx.float32)
            logits = (logits.astype(mx.float32) - self.counts * self.params.frequency_penalty
                      - (self.counts > 0) * self.params.presence_penalty)
        if self.params.temperature < GREEDY_BELOW:
            drawn = mx.argmax(logits)
        else:
            self.key, draw_key = mx.random.split(self.key)
            drawn = mx.random.categorical(filter_logits(logits, self.params), key=draw_key)
        if penalized:  # counted in the graph: no sync to read the id
            self.counts = self.counts.at[drawn].add(1.0)
        return drawn


class Detokenizer:
    """Turns token ids into text incrementally without ever emitting broken UTF-8: tokens whose
    bytes end inside a character are held until the character completes.

    `add(token) -> str` returns the text released by this token (often "", sometimes the text of
    several held tokens). `text` is all the text released; `token_ends[i]` its length once token i's
    text was released (None while held)."""

    REPLACEMENT = "\ufffd"
    MAX_HELD = 8  # a character is at most 4 bytes: past this, the bytes really are invalid

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.held = []
        self.text = ""
        self.token_ends = []

    def add(self, token: int) -> str:
        self.held.append(token)
        self.token_ends.append(None)
        text = self.tokenizer.decode(self.held)
        if text.endswith(self.REPLACEMENT) and len(self.held) < self.MAX_HELD:
            return ""
        return self._release(text)

    def flush(self) -> str:
        return self._release(self.tokenizer.decode(self.held)) if self.held else ""

    def _release(self, text: str) -> str:
        self.text += text
        for i in range(len(self.token_ends) - len(self.held), len(self.token_ends)):
            self.token_ends[i] = len(self.text)
        self.held = []
        return text


class AnswerStops(tuple):
    """Stop strings that apply to the answer's content only, as OpenAI's `stop` does: not inside the
    reasoning (`thinking`: the output starts there) nor inside DSML tool-call blocks (`tools`)."""

    def __new__(cls, strings=(), *, thinking: bool, tools: bool):
        stops = super().__new__(cls, strings)
        stops.thinking, stops.tools = thinking, tools
        return stops


class StopStringWatcher:
    """Finds stop strings in streamed text, also across token boundaries, and withholds the text that
    could still become part of one. Plain stop strings are looked for in all the text; `AnswerStops`
    only in the content, which an `OutputParser` splits from the reasoning and the tool calls (a stop
    string never spans a tool call). `stop_at` is where the first stop string begins in the text."""

    def __init__(self, stop_strings: Sequence[str]):
        self.stops = [s for s in stop_strings if s]
        self.parser = (OutputParser(thinking=stop_strings.thinking, tools=stop_strings.tools)
                       if isinstance(stop_strings, AnswerStops) and self.stops else None)
        self.text = ""  # everything added
        self.released = 0  # characters of it let through
        self.content_tail = ""  # the content that ends where parsing has got to and may begin a stop string
        self.stop_at = None

    def add(self, text: str) -> str:
        """Append text; return the part that is now safe to show."""
        self.text += text
        if self.parser is None:
            return self._scan([ContentDelta(text)], len(self.text))
        events = self.parser.feed(text)
        return self._scan(events, len(self.text) - self.parser.held)

    def flush(self) -> str:
        """The rest of the text (up to a stop string that only the end of the text revealed)."""
        out = ""
        if self.stop_at is None and self.parser is not None:
            out = self._scan(self.parser.finish(), len(self.text))
        return out + self._release(self.stop_at if self.stop_at is not None else len(self.text))

    def _scan(self, events, parsed_to: int) -> str:
        """Look for a stop string in the content of `events`, which ends at `parsed_to` in the text."""
        for event in events:
            if isinstance(event, ContentDelta):
                self.content_tail += event.text
            elif not isinstance(event, ReasoningDelta):  # a tool call or left-out markup
                self.content_tail = ""
        tail_start = parsed_to - len(self.content_tail)
        hits = [i for i in (self.content_tail.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stop_at = tail_start + min(hits)
            return self._release(self.stop_at)
        self.content_tail = self.content_tail[len(self.content_tail) - partial_marker_len(self.content_tail,
                                                                                          self.stops):]
        return self._release(parsed_to - len(self.content_tail))

    def _release(self, end: int) -> str:
        out = self.text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return out


@dataclass
class GenerationStats:
    """Counts and speeds of one `stream_generate` call.

    prompt_tokens: len(prompt_ids). reused/replayed/computed: from `session.last_sync` (cache hit,
    tokens re-run to rebuild state after a trim, new prompt tokens). completion_tokens: tokens
    sampled, a stop token included. output_ids: the answer's tokens (see the module docstring);
    output_text: their text (None when a stop string began inside a token: then no text is theirs)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    replayed_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    output_ids: list = field(default_factory=list)
    output_text: Optional[str] = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        work = self.computed_tokens + self.replayed_tokens
        return work / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.completion_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class TokenLogprob:
    """A sampled token (its text alone) with its log probability, and the most likely tokens at its
    place [(text, logprob)]."""

    text: str
    logprob: float
    top: list


def token_logprob(tokenizer, logits: mx.array, token: int, top: int) -> TokenLogprob:
    logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
    best = mx.argsort(-logprobs)[:top].tolist() if top > 0 else []
    values = logprobs[mx.array([token] + best)].tolist()
    return TokenLogprob(tokenizer.decode([token]), values[0],
                        [(tokenizer.decode([t]), v) for t, v in zip(best, values[1:])])


@dataclass
class GenerationChunk:
    """One step of the stream. `token`: the id sampled at this step (None when the step sampled
    nothing: an abort, or max_tokens=0). `text`: newly released text (may be ""); the texts of all
    chunks concatenate to the answer, stop strings excluded. The last chunk, and only it, has
    `finish_reason` ("stop", "length" or "abort") and `stats`. `logprob`: the token's, when asked for
    (never for a stop token)."""

    text: str
    token: Optional[int] = None
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None
    logprob: Optional[TokenLogprob] = None
    prefill: Optional[tuple] = None  # (done, total) prompt tokens, on the chunks of `yield_prefill`


@dataclass
class DecodeStep:
    """Yielded instead of stepping the session by a `stream_generate(..., together=True)`: the caller
    steps `session` with `token` (a lazy draw), together with other streams' steps (`step_together`), and
    sends back the logits."""

    session: object
    token: mx.array


@dataclass
class VerifyStep:
    """Yielded by a speculating `stream_generate(..., together=True)`: the caller feeds `ids` (the last
    token and the drafts after it) to `session` in one forward, with other streams' (`verify_together`),
    and sends back their logits [len(ids), vocab]."""

    session: object
    ids: list


def stream_generate(session, tokenizer, prompt_ids: Sequence[int], *, max_tokens: int,
                    sampling: SamplingParams = SamplingParams(), stop_strings: Sequence[str] = (),
                    stop_ids: Optional[Sequence[int]] = None,
                    should_abort: Optional[Callable[[], bool]] = None,
                    on_prefill: Optional[Callable[[int, int], object]] = None,
                    yield_prefill: bool = False,
                    sampler: Optional[Callable[[mx.array], int]] = None,
                    together: bool = False, speculation=None) -> Iterator[GenerationChunk]:
    """Generate from `prompt_ids` with `session`, yielding a `GenerationChunk` per sampled token.

    The session is synced to `prompt_ids` (reusing its longest common prefix), then tokens are
    sampled until a stop id (default: the tokenizer's EOS), a stop string, `max_tokens`, or
    `should_abort()` returning True (checked before each token and after each prefill chunk). Control
    tokens are never drawn (`constrain.ControlTokenMask`): no answer holds template markup as text.
    `on_prefill(done, total)` is called after each prefill chunk; returning True aborts too.
    `yield_prefill`: also yield a chunk with `prefill=(done, total)` (no token, no text) after each
    prefill chunk, so that a caller serving several requests can interleave them chunk by chunk.
    `sampler(logits) -> token id` replaces the draw from `sampling` (a scripted model's tokens).
    `together`: yield a `DecodeStep` before each decoded token and take the step's logits from `send`, so
    that a caller serving several streams decodes them in one forward (a speculating stream yields a
    `VerifyStep` for its rows that verify drafts).
    `speculation`: a `ds4_mlx.speculative.Speculation` (a drafter), which decodes several tokens a forward
    and gives the same output (not with a constraint, a `sampler` or sampling settings it does not
    reproduce, `Speculation.supports`: those decode plainly).
    Runs on the calling thread; nothing here is shared, so one generator per session at a time.
    See the module docstring for what `session.tokens` holds afterwards."""
    stop_ids = set(stop_ids if stop_ids is not None else [tokenizer.eos_id])
    should_abort = should_abort or (lambda: False)
    if mx.metal.is_available():  # keep the weights wired, as mlx-lm does: no paging stalls mid-answer
        mx.set_wired_limit(mx.device_info()["max_recommended_working_set_size"])
    sample = Sampler(sampling)
    detok = Detokenizer(tokenizer)
    watcher = StopStringWatcher(stop_strings)
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    prompt_ids = list(prompt_ids)
    sampled = []

    constraint = sampling.constraint(tokenizer) if sampling.constraint else None
    controls = ControlTokenMask(tokenizer, prompt_ids)  # no control token is drawn as answer text
    if speculation is not None and (constraint or sampler or not speculation.supports(sampling)):
        speculation = None
    if speculation is not None:
        speculation.attach(session)  # the prefill records the streams the drafter reads
        speculation.mask_rows = controls.mask_rows  # a verify's rows are masked as the plain draws are

    def finish(reason, token=None, text="", logprob=None):
        if watcher.stop_at is None:  # the end of the text may still reveal a stop string in the content
            text += watcher.add(detok.flush()) + watcher.flush()
        if watcher.stop_at is not None:
            reason = FINISH_STOP if reason != FINISH_ABORT else reason
            kept = sum(1 for end in detok.token_ends if end is not None and end <= watcher.stop_at)
            stats.output_ids = sampled[:kept]
            kept_text = detok.text[:detok.token_ends[kept - 1]] if kept else ""
            stats.output_text = kept_text if len(kept_text) == watcher.stop_at else None
            if len(session.tokens) > len(prompt_ids) + kept:
                session.trim(len(prompt_ids) + kept)
        else:
            stats.output_ids = [t for t in sampled if t not in stop_ids]
            stats.output_text = detok.text
        stats.completion_tokens = len(sampled)
        stats.decode_seconds = time.perf_counter() - decode_start
        return GenerationChunk(text=text, token=token, finish_reason=reason, stats=stats, logprob=logprob)

    def prefill_callback(done, total):
        stop = on_prefill(done, total) if on_prefill else False
        return bool(stop) or should_abort()

    prefill_seconds = 0.0  # the prefill's own time, not other requests' turns between its chunks
    if yield_prefill:
        logits, chunks = None, session.sync_steps(prompt_ids)
        while True:
            start = time.perf_counter()
            step = next(chunks, None)
            prefill_seconds += time.perf_counter() - start
            if step is None:
                logits = session.logits
                break
            if prefill_callback(*step) and step[0] < step[1]:
                break  # aborted: the session keeps the prefix computed so far
            yield GenerationChunk(text="", prefill=step)
    else:
        start = time.perf_counter()
        try:
            logits = session.sync(prompt_ids, on_chunk=prefill_callback)
            mx.eval(logits)
        except SyncInterrupted:
            logits = None
        prefill_seconds = time.perf_counter() - start
    sync_info = session.last_sync or {}
    stats.reused_tokens = sync_info.get("reused", 0)
    stats.replayed_tokens = sync_info.get("replayed", 0)
    stats.computed_tokens = sync_info.get("computed", 0)
    stats.prefill_seconds = prefill_seconds
    decode_start = time.perf_counter()
    if logits is None:
        yield finish(FINISH_ABORT)
        return
    if max_tokens <= 0:
        yield finish(FINISH_LENGTH)
        return
    # Decode from an empty buffer cache. Left there, the prefill's large temporaries crowd MLX's memory
    # limit, and on CUDA every allocation past it frees cached buffers with a device sync: at full depth
    # that stalls each decoded token (measured: 43-50 ms a token at 8k against 27 ms at 2k).
    mx.clear_cache()

    def draw(logits):
        """Start drawing the next token without waiting for it (a constraint's mask and a scripted
        sampler need the id at once, so they sync)."""
        forced = speculation.next_draw() if speculation is not None else None
        if forced is not None:  # a round of speculation decided it
            return forced
        logits = controls.mask(logits)
        if constraint:
            logits = constraint.mask(logits)
        drawn = sample.draw(logits) if sampler is None else mx.array(sampler(logits))
        mx.async_eval(drawn)
        return drawn

    # Pipelined: the step that feeds token n is built and started before token n is read, so the graph
    # building overlaps the device's work. A stop token fed this way is trimmed off again.
    drawn_from, drawn = logits, draw(logits)
    while True:
        if should_abort():
            yield finish(FINISH_ABORT)
            return
        if speculation is not None and together:
            logits = yield from speculation.steps(session, sample, drawn)
        elif speculation is not None:
            logits = speculation.step(session, sample, drawn)
        else:
            logits = (yield DecodeStep(session, drawn)) if together else session.step_async(drawn)
        token = session.settle()
        if should_abort():  # asked while this token was computed: it is neither shown nor kept
            session.trim(len(session.tokens) - 1)
            yield finish(FINISH_ABORT)
            return
        sampled.append(token)
        controls.advance(token)
        if constraint:
            constraint.advance(token)
        if token in stop_ids:
            session.trim(len(session.tokens) - 1)
            yield finish(FINISH_STOP, token)
            return
        logprob = (token_logprob(tokenizer, drawn_from, token, sampling.logprobs)
                   if sampling.logprobs is not None else None)
        text = watcher.add(detok.add(token))
        if watcher.stop_at is not None:
            yield finish(FINISH_STOP, token, text, logprob)
            return
        if len(sampled) >= max_tokens:
            yield finish(FINISH_LENGTH, token, text, logprob)
            return
        yield GenerationChunk(text=text, token=token, logprob=logprob)
        if len(sampled) % 256 == 0:
            mx.clear_cache()  # return the freed step buffers now and then
        drawn_from, drawn = logits, draw(logits)
