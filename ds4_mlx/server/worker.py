"""The worker: one thread that owns the model and its live sessions.

Handlers (on the asyncio loop) submit `Job`s; the worker admits them in arrival order, places each on a
slot, and advances every running job by one step in turn: one prefill chunk or one token. So one model
forward runs at a time, and a running stream waits at most one chunk per other request between its
tokens, however long their prompts. A job whose client has gone is dropped before it starts, and
stops at its next token (or prefill chunk) when it goes while running; its session keeps what was
computed. A job whose forward fails gets an error; its session stays consistent (see `Session`). A job
whose start fails (a snapshot, the disk) gets an error and frees its slot; the lock that `submit()`
takes on the event loop is held only to change the queue, never over model or disk work. Should the
thread itself die, every open job gets an error, later ones are refused, `health()` says so and
`on_death` is called (the server exits non-zero). On shutdown every job gets an error and the thread
ends after the chunk it is computing.
Events reach the handler through an asyncio queue: ("prefill", (done, total)) during the prefill,
("started", {prompt_tokens, reused, replayed, computed}) once it is over, ("chunk", GenerationChunk) per token, ("error", message)
if generation failed, and last ("done", Outcome), or ("done", None) for a job dropped from the queue.
"""

import asyncio
import gc
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from ds4_mlx.generate import RATE_MIN_TOKENS, DecodeStep, GenerationStats, SamplingParams, VerifyStep
from ds4_mlx.server.slots import Placement, Slot, place
from ds4_mlx.session import common_prefix

log = logging.getLogger("ds4_mlx.server")

RECENT_REQUESTS = 200  # finished requests whose figures /v1/sessions reports


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: list[str] = field(default_factory=list)
    label: str = "chat"  # names the endpoint in the log
    namespace: str = ""  # the tenant: prefixes are shared only within one (see `slots`)


@dataclass
class Outcome:
    """What a finished job reports: usage for the client, figures for the log."""
    slot: int
    finish_reason: str  # stop, length, abort, error
    prompt_tokens: int
    completion_tokens: int
    live: int  # tokens the slot held before
    common: int  # of them, shared with the prompt
    reused: int
    replayed: int
    computed: int
    prefill_s: float
    decode_s: float
    miss: str | None
    source: int | None = None  # the slot a fork started from (slots.place)
    namespace: str = ""
    from_disk: int = 0  # prompt tokens loaded from the disk store before the prefill
    foreign: bool = False  # the slot held another tenant's tokens (`live`), dropped whole
    cut_off: bool = False  # ended by the shutdown while running; then the figures are what the slot holds

    @property
    def cached_tokens(self) -> int:
        return self.reused

    def log_line(self, label: str) -> str:
        """One line a user can act on: hit, partial hit or miss and why, then the work done (speeds only
        for at least `RATE_MIN_TOKENS` tokens)."""
        def took(seconds: float, tokens: int) -> str:
            rate = f" ({tokens / seconds:.1f} t/s)" if tokens >= RATE_MIN_TOKENS and seconds > 0 else ""
            return f"{seconds:.2f} s{rate}"

        slot = f"slot {self.slot}"
        if self.cut_off:
            return (f"{label} cut off by the shutdown after {self.reused + self.computed} of {self.prompt_tokens} "
                    f"prompt tokens and {self.completion_tokens} answer tokens; {slot} keeps them")
        dropped = (f"another tenant's {self.live} tokens were dropped" if self.foreign
                   else f"its own {self.live} were dropped")
        if self.from_disk:
            kind = (f"disk hit: {slot} starts from a stored session sharing {self.from_disk} tokens with the prompt"
                    + (f" ({dropped})" if self.live else ""))
        elif self.miss is None:
            kind = "hit: " + (f"{slot} already holds this prompt (a resend)" if self.prompt_tokens <= self.live
                              else f"{slot} continues its conversation")
        elif self.source is not None:
            kind = (f"partial hit: {slot} starts from a snapshot of slot {self.source}'s conversation "
                    f"({self.common} tokens in common" + (f"; {dropped})" if self.live else ")"))
        elif self.live == 0:
            kind = f"miss: new conversation in empty {slot}"
        elif self.foreign:
            kind = (f"miss: {slot} held another tenant's conversation ({self.live} tokens), dropped whole for "
                    "this one (--sessions keeps more)")
        elif self.miss.startswith("diverged"):
            kind = (f"partial hit: the prompt leaves {slot}'s conversation at token {self.common} of "
                    f"{self.live} (an edited or regenerated turn)")
        else:
            kind = (f"miss: the prompt continues no live session; {slot}'s other conversation ({self.live} "
                    f"tokens, {self.common} in common) was dropped for it (--sessions keeps more)")
        prompt = f"prompt {self.prompt_tokens} tokens: {self.reused} reused"
        if self.replayed:
            prompt += f", {self.replayed} replayed"
        prompt += f", {self.computed} computed in {took(self.prefill_s, self.replayed + self.computed)}"
        answer = f"answer {self.completion_tokens} tokens in {took(self.decode_s, self.completion_tokens)}"
        return f"{label} {kind}; {prompt}; {answer}, finish {self.finish_reason}"


class Job:
    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, client_gone=lambda: False):
        self.request = request
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._client_gone = client_gone
        self._cancelled = False

    def cancel(self):
        """Called by the handler when it can no longer deliver output (for example a failed write)."""
        self._cancelled = True

    def should_abort(self) -> bool:
        return self._cancelled or self._client_gone()

    def emit(self, kind: str, payload=None):
        self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


@dataclass
class _Running:
    job: Job
    placement: Placement
    chunks: object  # the iterator from stream_generate
    started: bool = False  # the prefill is over and the first chunk came
    step: DecodeStep | VerifyStep | None = None  # its next token(s), waiting for the turn's batched forward
    from_disk: int = 0  # prompt tokens the disk store restored


class Worker:
    def __init__(self, load, *, n_slots: int, budget_bytes: int, session_factory, generate, disk=None,
                 shared_prefill_layers: int = 1, stuck_after_s: float = 600.0,
                 batch: int = 1):
        """`load()` returns (model, tokenizer) and runs on the worker thread, which owns the model from
        then on (MLX arrays belong to the thread that made them); `session_factory(model)` makes a
        Session; `generate` is `ds4_mlx.generate.stream_generate`; `disk` a `ds4_mlx.cache.store.DiskStore`
        (or None): sessions are saved there when evicted, at shutdown and during long prompts, and a
        request that no slot serves well looks there for its longest prefix. A prompt is computed a chunk a
        turn while it is the only job running, and `shared_prefill_layers` layers of a chunk a turn while
        other streams run (each waits about that long for its next token): the same chunks either way, so
        the same numbers.
        A turn (one chunk or token of each running job) longer than `stuck_after_s` is reported by `health()`.
        Streams decoding in the same turn take their tokens in one forward, `batch` at most (`DecodeStep`)."""
        if batch < 1:
            raise ValueError("batch must be at least 1")
        self.batch = batch
        self.disk = disk
        self.shared_prefill_layers = shared_prefill_layers
        self._load = load
        self.model = self.tokenizer = None
        self.longest_token_bytes = 1  # of the tokenizer's tokens: a prompt has at least len / this tokens
        self.budget_bytes = budget_bytes
        self.slots: list[Slot] = []
        self._n_slots = n_slots
        self._session_factory = session_factory
        self._ready = threading.Event()
        self._load_error = None
        self._generate = generate
        self._pending: deque[Job] = deque()
        self.recent: deque[tuple[float, Outcome]] = deque(maxlen=RECENT_REQUESTS)  # (unix time, outcome)
        self._running: list[_Running] = []
        self._starting: list[Job] = []  # a turn's admitted jobs until each starts: a death fails them too
        self._cond = threading.Condition()
        self._stopping = False
        self.shutting_down = False
        self.died: BaseException | None = None
        self.on_death = None  # called on the worker thread if it dies
        self.turn_started: float | None = None  # monotonic time the running turn began
        self.stuck_after_s = stuck_after_s
        self._thread = threading.Thread(target=self._run, name="ds4-worker", daemon=True)

    def start(self):
        """Start the thread and wait until the model is loaded and the slots made."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def shutdown(self):
        """Fail every queued and running job at the next step (their handlers answer and close)."""
        with self._cond:
            self.shutting_down = True
            self._cond.notify()

    def stop(self):
        self.shutdown()
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def submit(self, job: Job):
        with self._cond:
            if self.died is not None:
                job.emit("error", "the server's worker failed; see the server's log")
                job.emit("done", None)
                return
            self._pending.append(job)
            self._cond.notify()

    def health(self) -> str | None:
        """None when the worker serves; else why not: it died, or one turn has run for `stuck_after_s`."""
        if self.died is not None:
            return "the worker thread died"
        started = self.turn_started
        if started is not None and time.monotonic() - started > self.stuck_after_s:
            return f"one turn of the worker has run for over {self.stuck_after_s:g} s"
        return None

    @property
    def queued(self) -> int:
        return len(self._pending)

    # -- worker thread --------------------------------------------------------------------------------

    def _run(self):
        import mlx.core as mx

        # MLX arrays belong to the thread whose stream made them: the worker gets its own stream and
        # makes the model and the sessions' caches there.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        try:
            self.model, self.tokenizer = self._load()
            self.longest_token_bytes = max(len(self.tokenizer.decode([i]).encode())
                                           for i in range(self.tokenizer.vocab_size))
            self.slots = [Slot(i, self._session_factory(self.model)) for i in range(self._n_slots)]
        except Exception as e:  # noqa: BLE001 - reported by start()
            self._load_error = e
            return
        finally:
            self._ready.set()
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: said loudly, never a silent hang
            from ds4_mlx.distributed import RankLost

            if isinstance(e, RankLost):  # the machines holding the model's other layers are gone: no bug here
                log.critical(f"the worker thread stopped: {e}")
            else:
                log.critical(f"the worker thread died:\n{traceback.format_exc()}")
            with self._cond:
                self.died = e  # submit() refuses from now on
                jobs = [*self._pending, *self._starting, *(run.job for run in self._running)]
                self._pending.clear()
            for job in jobs:
                job.emit("error", "the server's worker failed; see the server's log")
                job.emit("done", None)
            if self.on_death is not None:
                self.on_death()

    def _serve(self):
        while True:
            with self._cond:  # held only to read and change the queue: submit() waits for nothing else
                while not self._pending and not self._running and not self._stopping:
                    self._cond.wait()
                refused = self._take_pending() if self.shutting_down else []
                stopping = self._stopping
                admitted = [] if stopping else self._admissible()
            if self.shutting_down:
                self._fail_all(refused, "the server is shutting down")
            if stopping:
                for slot in self.slots if self.disk is not None else []:
                    self.disk.save(slot.session, "shutdown", slot.namespace)
                self._release()
                return
            self.turn_started = time.monotonic()
            self._starting = [job for job, _ in admitted]  # out of the queue, not running yet
            for job, placement in admitted:
                self._start_guarded(job, placement)
                self._starting.remove(job)
            for run in list(self._running):
                self._guarded(run, self._advance, run)
            self._decode_together()
            self.turn_started = None

    def _guarded(self, run: _Running, work, *args):
        try:
            work(*args)
        except Exception:  # noqa: BLE001 - one job's bookkeeping failed; the worker must live on
            log.error(f"{run.job.request.label} failed:\n{traceback.format_exc()}")
            if run in self._running:
                self._running.remove(run)
                run.placement.slot.busy = False
            run.job.emit("done", None)

    def _release(self):
        """Free the model and the sessions on this thread, which made them: arrays freed by another
        thread while the process exits can crash it ("terminate called without an active exception")."""
        self._running.clear()
        self.slots = []
        self.model = None
        gc.collect()

    def _take_pending(self) -> list[Job]:
        jobs = list(self._pending)
        self._pending.clear()
        return jobs

    def _fail_all(self, queued: list[Job], message: str):
        for job in queued:
            job.emit("error", message)
            job.emit("done", None)
        for run in list(self._running):
            run.job.emit("error", message)
            self._finish(run, None, cut_off=True)

    def _admissible(self) -> list[tuple[Job, Placement]]:
        """Take queued jobs in arrival order while slots allow, each with its slot (marked busy); drop
        those whose client left. Placing is cheap: the work of starting is done after the lock."""
        for job in [j for j in self._pending if j.should_abort()]:
            self._pending.remove(job)
            log.info(f"{job.request.label} dropped from the queue: client gone")
            job.emit("done", None)
        admitted = []
        while self._pending:
            request = self._pending[0].request
            placement = place(self.slots, request.prompt_ids, request.namespace)
            if placement is None:
                break  # the head waits for its slot; later jobs wait behind it
            placement.slot.busy = True
            admitted.append((self._pending.popleft(), placement))
        return admitted

    def _start_guarded(self, job: Job, placement: Placement):
        """Start `job`; a failure (a snapshot, the disk, a bug) fails this job alone and frees its slot,
        emptied so that whatever state the failure left is never reused."""
        try:
            self._running.append(self._start(job, placement))
        except Exception as e:  # noqa: BLE001 - this job fails, the server goes on
            log.error(f"{job.request.label} failed to start:\n{traceback.format_exc()}")
            placement.slot.session.reset()
            placement.slot.busy = False
            job.emit("error", f"the request could not start: {type(e).__name__}: {e}")
            job.emit("done", None)

    def _start(self, job: Job, placement: Placement) -> _Running:
        request, slot = job.request, placement.slot
        session = slot.session
        kept = placement.common if placement.source is None else 0  # a fork replaces the slot's tokens
        if self.disk is not None and len(session.tokens) - kept >= self.disk.min_tokens:
            self.disk.save(session, "evict", slot.namespace)  # the request will discard these tokens
        if placement.foreign:
            session.reset()  # else `Session.sync` would reuse the other tenant's prefix, and its time tell it
        if slot.namespace != request.namespace:  # nothing of the previous tenant's shows in /v1/sessions
            slot.namespace, slot.last_outcome, slot.last_used = request.namespace, None, time.monotonic()
            slot.nbytes = session.nbytes
        if placement.source is not None:  # start from the snapshot of a slot sharing a long prefix
            session.restore(placement.source.session.snapshot())
        shared = placement.common
        if self.disk is not None:
            shared = self.disk.load_longer_prefix(session, request.prompt_ids, placement.common, request.namespace)

        def on_prefill(done, total):
            if self.disk is not None:
                self.disk.during_prefill(session, request.namespace)
            job.emit("prefill", (done, total))

        chunks = self._generate(
            session, self.tokenizer, request.prompt_ids,
            max_tokens=request.max_tokens, sampling=request.sampling, stop_strings=request.stop_strings,
            should_abort=job.should_abort, on_prefill=on_prefill)
        return _Running(job, placement, iter(chunks), from_disk=shared if shared > placement.common else 0)

    def _advance(self, run: _Running):
        """The job's turn: one prefill chunk (a few of its layers while other streams run), or the draw of its
        next token (then it waits in `run.step` for `_decode_together`)."""
        alone = len(self._running) == 1
        run.placement.slot.session.layers_per_turn = None if alone else self.shared_prefill_layers
        self._take(run, next, run.chunks)

    def _decode_together(self):
        """The turn's decoded tokens: the streams waiting in `run.step` step together, `batch` at a time:
        plain steps in one forward (`step_together`), speculating streams' verifies in another
        (`verify_together`); each stream takes its logits."""
        import mlx.core as mx

        import ds4_mlx.session as together  # looked up at each turn: a test counts the forwards

        def step(steps):
            tokens = mx.concatenate([s.token.reshape(1) for s in steps])
            return together.step_together([s.session for s in steps], tokens)

        def verify(steps):
            return together.verify_together([s.session for s in steps], [s.ids for s in steps])

        waiting = [run for run in self._running if run.step is not None]
        for forward, kind in ((step, DecodeStep), (verify, VerifyStep)):
            runs = [run for run in waiting if isinstance(run.step, kind)]
            for i in range(0, len(runs), self.batch):
                group = runs[i : i + self.batch]
                steps = [run.step for run in group]
                for run in group:
                    run.step = None
                try:
                    logits = forward(steps)
                except Exception as e:  # noqa: BLE001 - these jobs fail (their sessions are back at their tokens)
                    for run in group:
                        self._guarded(run, self._fail, run, e)  # still in the except block: its traceback
                    continue
                for b, run in enumerate(group):
                    self._guarded(run, self._take, run, run.chunks.send, logits[b])

    def _fail(self, run: _Running, error: Exception):
        log.error(f"{run.job.request.label} failed:\n{traceback.format_exc()}")
        run.job.emit("error", f"generation failed: {type(error).__name__}: {error}")
        self._finish(run, None)

    def _take(self, run: _Running, pull, arg):
        """Take the job's next item, `pull(arg)`: a prefill chunk, a `DecodeStep` to wait with, or a token's
        chunk for the client."""
        try:
            chunk = pull(arg)
        except Exception as e:  # noqa: BLE001 - this job fails, the server goes on
            self._fail(run, e)
            return
        if isinstance(chunk, (DecodeStep, VerifyStep)):
            run.step = chunk
            return
        if chunk.prefill is not None:
            return  # one prefill chunk done: the next job's turn
        if not run.started:
            run.started = True
            sync = run.placement.slot.session.last_sync
            run.job.emit("started", {"prompt_tokens": len(run.job.request.prompt_ids), **sync})
        run.job.emit("chunk", chunk)
        if chunk.finish_reason:
            self._finish(run, chunk)

    def _finish(self, run: _Running, last_chunk, *, cut_off: bool = False):
        self._running.remove(run)
        slot = run.placement.slot
        slot.busy = False
        slot.last_used = time.monotonic()
        outcome = self._outcome(run, last_chunk, cut_off)
        log.info(outcome.log_line(run.job.request.label), extra={"outcome": outcome})  # tests read the figures
        slot.last_outcome = outcome
        self.recent.append((time.time(), outcome))
        self._keep_within_budget(slot)
        for s in self.slots:
            s.nbytes = s.session.nbytes
        run.job.emit("done", outcome)

    @staticmethod
    def _outcome(run: _Running, last_chunk, cut_off: bool = False) -> Outcome:
        stats = last_chunk.stats if last_chunk is not None else GenerationStats()
        placement = run.placement
        if cut_off:  # the generator's figures never came: what the slot holds now says how far it got
            prompt, tokens = run.job.request.prompt_ids, placement.slot.tokens
            done = common_prefix(tokens, prompt)  # of the prompt, in the slot
            reused = min(done, max(placement.common, run.from_disk))
            stats = GenerationStats(reused_tokens=reused, computed_tokens=done - reused,
                                    completion_tokens=len(tokens) - done if done == len(prompt) else 0)
        return Outcome(
            slot=placement.slot.index, finish_reason=last_chunk.finish_reason if last_chunk else "error",
            prompt_tokens=len(run.job.request.prompt_ids), completion_tokens=stats.completion_tokens,
            live=placement.live, common=placement.common, reused=stats.reused_tokens,
            replayed=stats.replayed_tokens, computed=stats.computed_tokens, prefill_s=stats.prefill_seconds,
            decode_s=stats.decode_seconds, miss=placement.miss,
            source=placement.source.index if placement.source is not None else None,
            namespace=run.job.request.namespace, from_disk=run.from_disk, foreign=placement.foreign,
            cut_off=cut_off)

    def _keep_within_budget(self, just_used: Slot):
        """Empty idle slots, least recently used first, until the sessions fit the byte budget."""
        total = sum(s.session.nbytes for s in self.slots)
        for slot in sorted(self.slots, key=lambda s: s.last_used):
            if total <= self.budget_bytes:
                return
            if slot is just_used or slot.busy or not slot.tokens:
                continue
            freed = slot.session.nbytes
            if self.disk is not None:
                self.disk.save(slot.session, "evict", slot.namespace)
            slot.session.reset()
            total -= freed
            log.info(f"slot={slot.index} emptied to stay within the session budget ({freed / 2**20:.1f} MiB freed)")
        if total > self.budget_bytes:
            log.warning(f"sessions hold {total / 2**20:.1f} MiB, over the {self.budget_bytes / 2**20:.1f} MiB budget")

