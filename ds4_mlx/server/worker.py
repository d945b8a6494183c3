"""The worker: one thread that owns the model and its live sessions.

Handlers (on the asyncio loop) submit `Job`s; the worker admits them in arrival order, places each on a
slot, and advances every running job by one step in turn: one prefill chunk or one token. So one model
forward runs at a time, and a running stream waits at most one chunk per other request between its
tokens, however long their prompts. A job whose client has gone is dropped before it starts, and
stops at its next token (or prefill chunk) when it goes while running; its session keeps what was
computed. A job whose forward fails gets an error; its session stays consistent (see `Session`). On
shutdown every job gets an error and the thread ends after the chunk it is computing.
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

from ds4_mlx.generate import RATE_MIN_TOKENS, GenerationStats, SamplingParams
from ds4_mlx.server.slots import Placement, Slot, place

log = logging.getLogger("ds4_mlx.server")

RECENT_REQUESTS = 200  # finished requests whose figures /v1/sessions reports


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: list[str] = field(default_factory=list)
    label: str = "chat"  # names the endpoint in the log


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
        if self.miss is None:
            kind = "hit: " + (f"{slot} already holds this prompt (a resend)" if self.prompt_tokens <= self.live
                              else f"{slot} continues its conversation")
        elif self.source is not None:
            kind = (f"partial hit: {slot} starts from a snapshot of slot {self.source}'s conversation "
                    f"({self.common} tokens in common" + (f"; its own {self.live} were dropped)" if self.live else ")"))
        elif self.live == 0:
            kind = f"miss: new conversation in empty {slot}"
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


class Worker:
    def __init__(self, load, *, n_slots: int, budget_bytes: int, session_factory, generate, disk=None,
                 prefill_chunk: int = 2048, shared_prefill_chunk: int = 256):
        """`load()` returns (model, tokenizer) and runs on the worker thread, which owns the model from
        then on (MLX arrays belong to the thread that made them); `session_factory(model)` makes a
        Session; `generate` is `ds4_mlx.generate.stream_generate`; `disk` a `ds4_mlx.cache.store.DiskStore`
        (or None): sessions are saved there when evicted, at shutdown and during long prompts, and a
        request that no slot serves well looks there for its longest prefix. A prompt is computed
        `prefill_chunk` tokens a turn while it is the only job running (long chunks prefill faster),
        `shared_prefill_chunk` while other streams run (each waits about one chunk for its next token)."""
        self.disk = disk
        self.prefill_chunk, self.shared_prefill_chunk = prefill_chunk, shared_prefill_chunk
        self._load = load
        self.model = self.tokenizer = None
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
        self._cond = threading.Condition()
        self._stopping = False
        self.shutting_down = False
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
            self._pending.append(job)
            self._cond.notify()

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
            self.slots = [Slot(i, self._session_factory(self.model)) for i in range(self._n_slots)]
        except Exception as e:  # noqa: BLE001 - reported by start()
            self._load_error = e
            return
        finally:
            self._ready.set()
        while True:
            with self._cond:
                while not self._pending and not self._running and not self._stopping:
                    self._cond.wait()
                if self.shutting_down:
                    self._fail_all("the server is shutting down")
                if self._stopping:
                    for slot in self.slots if self.disk is not None else []:
                        self.disk.save(slot.session, "shutdown")
                    self._release()
                    return
                self._admit()
            for run in list(self._running):
                try:
                    self._advance(run)
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

    def _fail_all(self, message: str):
        while self._pending:
            job = self._pending.popleft()
            job.emit("error", message)
            job.emit("done", None)
        for run in list(self._running):
            run.job.emit("error", message)
            self._finish(run, None)

    def _admit(self):
        """Start queued jobs in arrival order while slots allow; drop those whose client left."""
        for job in [j for j in self._pending if j.should_abort()]:
            self._pending.remove(job)
            log.info(f"{job.request.label} dropped from the queue: client gone")
            job.emit("done", None)
        while self._pending:
            placement = place(self.slots, self._pending[0].request.prompt_ids)
            if placement is None:
                return  # the head waits for its slot; later jobs wait behind it
            job = self._pending.popleft()
            placement.slot.busy = True
            self._running.append(self._start(job, placement))

    def _start(self, job: Job, placement: Placement) -> _Running:
        request, session = job.request, placement.slot.session
        kept = placement.common if placement.source is None else 0  # a fork replaces the slot's tokens
        if self.disk is not None and len(session.tokens) - kept >= self.disk.min_tokens:
            self.disk.save(session, "evict")  # the request is about to discard these tokens
        if placement.source is not None:  # start from the snapshot of a slot sharing a long prefix
            session.restore(placement.source.session.snapshot())
        if self.disk is not None:
            self.disk.load_longer_prefix(session, request.prompt_ids, placement.common)

        def on_prefill(done, total):
            if self.disk is not None:
                self.disk.during_prefill(session)
            job.emit("prefill", (done, total))

        chunks = self._generate(
            session, self.tokenizer, request.prompt_ids,
            max_tokens=request.max_tokens, sampling=request.sampling, stop_strings=request.stop_strings,
            should_abort=job.should_abort, on_prefill=on_prefill)
        return _Running(job, placement, iter(chunks))

    def _advance(self, run: _Running):
        alone = len(self._running) == 1
        run.placement.slot.session.max_chunk = self.prefill_chunk if alone else self.shared_prefill_chunk
        try:
            chunk = next(run.chunks)
        except Exception as e:  # noqa: BLE001 - this job fails, the server goes on
            log.error(f"{run.job.request.label} failed:\n{traceback.format_exc()}")
            run.job.emit("error", f"generation failed: {type(e).__name__}: {e}")
            self._finish(run, None)
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

    def _finish(self, run: _Running, last_chunk):
        self._running.remove(run)
        slot = run.placement.slot
        slot.busy = False
        slot.last_used = time.monotonic()
        outcome = self._outcome(run, last_chunk)
        log.info(outcome.log_line(run.job.request.label), extra={"outcome": outcome})  # tests read the figures
        slot.last_outcome = outcome
        self.recent.append((time.time(), outcome))
        self._keep_within_budget(slot)
        for s in self.slots:
            s.nbytes = s.session.nbytes
        run.job.emit("done", outcome)

    @staticmethod
    def _outcome(run: _Running, last_chunk) -> Outcome:
        stats = last_chunk.stats if last_chunk is not None else GenerationStats()
        placement = run.placement
        return Outcome(
            slot=placement.slot.index, finish_reason=last_chunk.finish_reason if last_chunk else "error",
            prompt_tokens=len(run.job.request.prompt_ids), completion_tokens=stats.completion_tokens,
            live=placement.live, common=placement.common, reused=stats.reused_tokens,
            replayed=stats.replayed_tokens, computed=stats.computed_tokens, prefill_s=stats.prefill_seconds,
            decode_s=stats.decode_seconds, miss=placement.miss,
            source=placement.source.index if placement.source is not None else None)

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
                self.disk.save(slot.session, "evict")
            slot.session.reset()
            total -= freed
            log.info(f"slot={slot.index} emptied to stay within the session budget ({freed / 2**20:.1f} MiB freed)")
        if total > self.budget_bytes:
            log.warning(f"sessions hold {total / 2**20:.1f} MiB, over the {self.budget_bytes / 2**20:.1f} MiB budget")
