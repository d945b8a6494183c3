"""One conversation's tokens and cache, able to go back to any earlier position exactly.

Rewind policy (README, "How a session goes back"):
- within the last `frontier_horizon` tokens: every layer trims in place (the rings still hold the raw
  and compressor rows), nothing is recomputed;
- further back, the session restores the nearest checkpoint at or before the target and replays from
  there, in the chunks a cold run computes (chunks end on a grid of absolute positions, multiples of
  `max_chunk` and `checkpoint_every`, and every checkpoint sits on that grid), so a replayed token
  gets the numbers of a cold prefill of the same tokens. Full checkpoints are taken every
  `checkpoint_every` tokens (a few rows a layer); between them, within the last `rewind_slack` tokens
  (the raw ring still holds the window there), a lane: the few compressor rows a grid position needs
  (a multiple of every compression ratio too). The newest `recent_checkpoints` checkpoints are
  `checkpoint_every` apart; further back the spacing doubles each time the distance doubles, so a
  million-token session keeps a few dozen, and a rewind replays at most about as many tokens as it
  goes back;
- the next-token logits come from feeding the last prompt token again, or are kept when the prompt
  equals the live tokens;
- a chunk that fails (an exception, out of memory) leaves the session at the tokens computed before it
  when the chunk is no longer than the rewind slack (the rings still hold what it overwrote), else empty;
- `exact_rewinds`: every token's rows as a cold prefill computes them, bit for bit, whatever the
  session held before: no trim in place, no extension of a partial chunk or of decoded tokens; the
  session goes back to the last grid position before which every row came from whole grid chunks and
  replays from there (up to a chunk more to compute a request).
"""

import math

import mlx.core as mx

from ds4_mlx.cache.layers import LayerCache, lane_every
from ds4_mlx.cache.pool import Pool


class SyncInterrupted(Exception):
    """`on_chunk` asked to stop; the session keeps the prefix computed so far."""


def common_prefix(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Session:
    def __init__(self, model, *, rewind_slack=4096, checkpoint_every=2048, max_chunk=2048,
                 frontier_horizon=512, recent_checkpoints=4, exact_rewinds=False):
        if checkpoint_every <= 0 or max_chunk <= 0 or recent_checkpoints <= 0:
            raise ValueError("checkpoint_every, max_chunk and recent_checkpoints must be positive")
        if rewind_slack < 0 or frontier_horizon < 0:
            raise ValueError("rewind_slack and frontier_horizon must be >= 0")
        self.model = model
        self.rewind_slack, self.checkpoint_every, self.max_chunk = rewind_slack, checkpoint_every, max_chunk
        # set by a server while other streams run: a chunk's layers are evaluated this many at a time, each
        # piece a yield of `sync_steps`, so the others' tokens run between them (same chunks, same numbers)
        self.layers_per_turn = None
        self.frontier_horizon, self.recent_checkpoints = frontier_horizon, recent_checkpoints
        self.exact_rewinds = exact_rewinds
        # a drafter's record of the target's streams (`ds4_mlx.cache.taps.TapLog`), or None: speculative
        # decoding sets it, and every feed then hands it the streams it asks for
        self.tap_log = None
        self.reset()

    def reset(self):
        old = getattr(self, "cache", None)
        self.cache: list[LayerCache] = self.model.make_cache(
            history=self.rewind_slack, frontier_history=self.frontier_horizon)
        pool = old[0].pool() if old else None
        if pool is not None:  # else the pool would keep the old caches' rows, which no session counts
            pool.drop(old)
        ratios = lane_every(self.cache)  # a position whose compressor state is a lane
        self.lane_every = math.lcm(ratios, self.max_chunk) if ratios else None  # and on the chunk grid
        self.tokens: list[int] = []
        self.clean = 0  # the tokens before it were computed in whole grid chunks, as a cold prefill does
        # position -> per-layer checkpoint, on the live history: full ones at multiples of
        # checkpoint_every, lanes (no raw rows) at the other multiples of lane_every
        self.checkpoints: dict[int, list] = {}
        self.logits = None  # next-token logits after self.tokens, when known
        self.last_sync = {"reused": 0, "replayed": 0, "computed": 0}
        if self.tap_log is not None:
            self.tap_log.restart(0)

    # Public API ---------------------------------------------------------------------------------
    def sync(self, prompt_ids, *, on_chunk=None):
        """Make the session hold exactly `prompt_ids`; return the next-token logits [vocab].

        `on_chunk(done, total)` runs after each prefill chunk; a truthy return stops the prefill and
        raises SyncInterrupted, the session keeping the tokens computed so far."""
        for done, total in self.sync_steps(prompt_ids):
            if on_chunk is not None and on_chunk(done, total) and done < total:
                raise SyncInterrupted(f"stopped after {done} of {total} prompt tokens")
        return self.logits

    def sync_steps(self, prompt_ids):
        """`sync` one model chunk at a time: yields (done, total) tokens run through the model after
        each chunk, the tokens a rewind replays first, then the new ones. Between chunks the session
        holds a prefix of the prompt and `last_sync` counts the work so far."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        common = common_prefix(self.tokens, prompt)
        if common == len(prompt) == len(self.tokens) and self.logits is not None:
            self.last_sync = {"reused": common, "replayed": 0, "computed": 0}
            return
        target = min(common, len(prompt) - 1)
        replay = len(self._rewind(target))
        work = prompt[len(self.tokens) :]  # the replayed tokens are the prompt's up to the target
        self.last_sync = {"reused": len(self.tokens), "replayed": 0, "computed": 0}
        for done in self._feed_steps(work):
            self.last_sync.update(replayed=min(done, replay), computed=max(0, done - replay))
            yield done, len(work)

    def step(self, token_id):
        """Append one token; return the next-token logits."""
        return self._feed([int(token_id)])

    def step_async(self, token):
        """`step` for a token id the device is still computing (an int32 array holding one id, e.g. a
        sampler's lazy draw): the logits come back with their evaluation started, so the caller builds
        this step while the device finishes the last one. Call `settle()` before using the session again."""
        return step_together([self], token.reshape(1))[0]

    def took(self, token, logits):
        """The bookkeeping of a token a batched step gave the layers (`DecodeBatch`): the token, the
        next-token logits after it, checkpoints."""
        pos = len(self.tokens)
        self.tokens.append(token)
        self.logits = logits
        self._take_checkpoints(pos, pos + 1)  # the same lanes and full checkpoints as `step`

    def settle(self):
        """Wait for the id of the last `step_async` token and record it; return it."""
        if isinstance(self.tokens[-1], mx.array):
            self.tokens[-1] = int(self.tokens[-1].item())
        return self.tokens[-1]

    def trim(self, n, *, logits=None):
        """Keep the first n tokens; `logits`: the next-token logits after them, when the caller has them
        (a verify's row), else they are computed when needed."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot trim {len(self.tokens)} tokens to {n}")
        if n < len(self.tokens):
            self._feed(self._rewind(n))
            if logits is not None:
                self.logits = logits

    def verify(self, ids):
        """Append drafted tokens in one forward that keeps the logits of every row: -> logits [T, vocab],
        row i the next-token logits after ids[: i + 1]. Keep the accepted ones with `trim` (exact: rows
        are only trimmed, nothing is recomputed)."""
        rows = []
        for _ in self._feed_steps([int(t) for t in ids], rows=rows):
            pass
        return mx.concatenate(rows) if len(rows) > 1 else rows[0]

    def snapshot(self):
        """A handle on the current state: O(1), arrays are shared until either side writes."""
        taps = self.tap_log.snapshot() if self.tap_log is not None else None
        return (list(self.tokens), self.logits, dict(self.checkpoints), [c.snapshot() for c in self.cache],
                self.clean, taps)

    def restore(self, snapshot):
        tokens, self.logits, checkpoints, layers, self.clean, *taps = snapshot
        self.tokens, self.checkpoints = list(tokens), dict(checkpoints)
        for c, s in zip(self.cache, layers):
            c.restore(s)
        if self.tap_log is not None:  # another session's snapshot may hold no streams: start them here
            self.tap_log.restore(taps[0]) if taps and taps[0] is not None else self.tap_log.restart(len(tokens))

    def save(self, path, *, history=256):
        """Write the session to one safetensors file (`ds4_mlx.cache.state`), with what a rewind of up
        to `history` tokens needs after loading; returns the file size."""
        from ds4_mlx.cache.state import export_session, write_state_file

        return write_state_file(path, *export_session(self, history))

    def load(self, path):
        """Hold the state saved in `path`. Raises `StateFileError` (the session unchanged) for a file
        that is corrupt, truncated, or written by another model or setting."""
        from ds4_mlx.cache.state import import_session, read_state_file

        import_session(self, *read_state_file(path))
        if self.tap_log is not None:  # the file holds no drafter streams: they start again here
            self.tap_log.restart(len(self.tokens))

    @property
    def nbytes(self):
        layers = sum(c.nbytes for c in self.cache)
        checkpoints = sum(r.nbytes for cp in self.checkpoints.values() for layer in cp
                          for r in layer["rows"] if r is not None)
        return layers + checkpoints

    # Internals ----------------------------------------------------------------------------------
    def _rewind(self, target):
        """Go back to `target` tokens: trim in place, or restore the newest checkpoint at or before it (or
        start over). Returns the tokens to replay from there to reach the target (the caller feeds them)."""
        if target == len(self.tokens) and (not self.exact_rewinds or target == self.clean):
            return []
        self.logits = None
        self.checkpoints = {p: cp for p, cp in self.checkpoints.items() if p <= target}
        if self.tap_log is not None:
            self.tap_log.trim(target)
        if not self.exact_rewinds and self._everywhere(all(c.can_trim(target) for c in self.cache)):
            for c in self.cache:
                c.trim(target)
            del self.tokens[target:]
            self.clean = min(self.clean, target)
            return []
        limit = min(target, self.clean) if self.exact_rewinds else target
        start = max((q for q, cp in sorted(self.checkpoints.items()) if q <= limit
                     and self._everywhere(all(c.can_restore(layer) for c, layer in zip(self.cache, cp)))), default=0)
        self.clean = min(self.clean, start)
        replay = self.tokens[start:target]
        if start:
            for c, cp in zip(self.cache, self.checkpoints[start]):
                c.restore_checkpoint(cp)
            del self.tokens[start:]
        else:
            self.reset()
        return replay

    def undo_chunk(self, n):
        """A chunk of n tokens failed (an exception or out of memory mid-graph). A step commits every layer
        or none (`_feed_steps`, `DecodeBatch.step`): if it committed, its arrays may not evaluate, so go back to
        `self.tokens` and evaluate what is left; when that cannot be done, start over empty. Either way the
        layers agree with `self.tokens`. (Holding the arrays of before the chunk instead would cost a copy
        of every ring per chunk: MLX could no longer update them in place.)"""
        start = len(self.tokens)
        try:
            if any(c.pos != start for c in self.cache):
                if not all(c.can_trim(start) for c in self.cache):
                    raise RuntimeError("the rings no longer hold the state")
                for c in self.cache:
                    c.trim(start)
            mx.eval([c.arrays() for c in self.cache])
        except Exception:  # noqa: BLE001 - nothing of the arrays can be trusted
            self.reset()

    def _feed(self, ids):
        """Run ids through the model; return the next-token logits."""
        for _ in self._feed_steps(ids):
            pass
        return self.logits

    def _feed_steps(self, ids, rows=None):
        """Run ids through the model in chunks that end on checkpoint positions; yield the count done
        after each. `rows`: a list that takes the logits of every row of each chunk."""
        done = 0
        while done < len(ids):
            # chunks end on a grid of absolute positions, whatever came before: the same prompt is computed
            # in the same chunks alone, beside other streams, or replayed from a checkpoint
            n = min(len(ids) - done, self._room())
            chunk = ids[done : done + n]
            taps = self.tap_log.request() if self.tap_log is not None else None
            # a prompt's chunk beside other streams runs in pieces of layers; a verify or a token runs whole
            # (each piece waits for the device: the host could no longer build ahead of it)
            pieces = self.layers_per_turn if rows is None and n > 1 else None
            # a token of a session whose rows are in a pool: the pool's step of this session (`cache/pool.py`)
            pool = Pool.of([self.cache]) if n == 1 and getattr(self.model, "takes_pools", False) else None
            try:
                # the views go with the forward, no name here holds them: a ring only the graph holds is
                # written in place (MLX copies an array something else holds, every ring every token)
                run = self.model.forward_steps(mx.array([chunk], dtype=mx.int32),
                                               [[c.view(n) for c in self.cache]] if pool is None else
                                               pool.views([self.cache]),
                                               last_only=rows is None, layers_per_step=pieces, taps=taps)
                while True:
                    try:
                        next(run)
                    except StopIteration as finished:
                        logits, written = finished.value
                        break
                    yield done  # a piece of the chunk: other work may run before the next
                if pool is not None:
                    pool.commit(written, [self.cache])
                else:
                    for c, arrays in zip(self.cache, written[0]):  # every layer or none
                        c.commit(arrays, n)
                logits = logits[0]
                evaluate_step(logits, [c.arrays() for c in self.cache] if pool is None else pool.arrays)
                if rows is not None:
                    rows.append(logits)
                logits = logits[-1]
            except BaseException:
                self.undo_chunk(n)
                raise
            self._fed(chunk, logits, taps)
            done += n
            yield done

    def _fed(self, chunk, logits, taps):
        """The bookkeeping of a chunk the layers took: its tokens, their streams for the drafter, the
        next-token logits after it, checkpoints."""
        pos = len(self.tokens)
        if pos == self.clean and self._on_grid(pos + len(chunk)):
            self.clean = pos + len(chunk)
        if taps is not None:
            self.tap_log.record(pos, taps, len(chunk))
        self.tokens.extend(chunk)
        self.logits = logits
        self._take_checkpoints(pos, len(self.tokens))

    def _room(self):
        """How many tokens the next chunk may hold: up to the next grid position."""
        pos = len(self.tokens)
        return min(self.max_chunk - pos % self.max_chunk, self.checkpoint_every - pos % self.checkpoint_every)

    def _on_grid(self, p):
        return p % self.max_chunk == 0 or p % self.checkpoint_every == 0

    def _take_checkpoints(self, start, end):
        """After feeding (start, end]: a lane at each multiple of `lane_every` in it, a full checkpoint
        at `end` when it is a multiple of `checkpoint_every` (chunks end there); then thinning."""
        every = self.lane_every
        lanes = [q for q in range(start - start % every + every, end + 1, every)
                 if q % self.checkpoint_every] if every else []
        taken = [(q, [c.checkpoint(q, raw=False) for c in self.cache]) for q in lanes]
        if end % self.checkpoint_every == 0:
            taken.append((end, [c.checkpoint(end) for c in self.cache]))
        for q, layers in taken:
            if self._everywhere(None not in layers):  # else a ring lost a row the position needs: none there
                self.checkpoints[q] = layers
        if taken:
            self._thin(end)

    def _everywhere(self, holds):
        """Whether `holds` holds for every layer: here, where the session holds them all; across the ranks
        of a pipeline (`ds4_mlx.distributed`), whose sessions must take the same branch."""
        return holds

    def checkpoint_spacing(self, distance):
        """How far apart the full checkpoints are kept `distance` tokens behind the live position."""
        return self.checkpoint_every << (distance // (self.checkpoint_every * self.recent_checkpoints)).bit_length()

    def _thin(self, end):
        """Drop the lanes whose window the raw ring no longer holds, and the full checkpoints off the
        geometric grid (a set that only ever thins: a kept one was on every earlier grid too)."""
        for q, cp in list(self.checkpoints.items()):
            if q % self.checkpoint_every:
                if not self._everywhere(all(c.can_restore(layer) for c, layer in zip(self.cache, cp))):
                    del self.checkpoints[q]
            elif q % self.checkpoint_spacing(end - q):
                del self.checkpoints[q]


def evaluate_step(logits, arrays, wait=True):
    """Evaluate a forward's logits and the cache arrays it wrote (`wait=False`: start it), the logits
    first. Every read of an array from before the step lies on the logits' path, and MLX writes an array
    in place only where nothing else still needs it: in one call, its order may write a ring before the
    ring's last read, which then costs a copy of the whole ring."""
    mx.async_eval(logits)
    (mx.eval if wait else mx.async_eval)(logits, arrays)


def _forward_together(sessions, ids, wait=False, **forward_args):
    """`Model.forward` of ids int32 [B, T], T tokens for each of B sessions of one model, and the commit of
    every layer of every session, or of none: on an error (mid-graph, or in the evaluation `wait` runs), as
    in `_feed_steps`, every session goes back to its tokens. -> logits"""
    T = ids.shape[1]
    try:
        views = [[c.view(T) for c in s.cache] for s in sessions]  # let go before the evaluation (`_feed_steps`)
        logits, written = sessions[0].model.forward(ids, views, **forward_args)
        del views
        for s, steps in zip(sessions, written):
            for c, arrays in zip(s.cache, steps):
                c.commit(arrays, T)
        if wait:
            evaluate_step(logits, [c.arrays() for s in sessions for c in s.cache])
    except BaseException:
        for s in sessions:
            s.undo_chunk(T)
        raise
    return logits


class DecodeBatch:
    """Sessions of one model decoded together, one token each a step, in one forward (`Model.forward` over B
    sessions) whose cache part reads and writes a pool of their caches (`cache/pool.py`). The pool lasts
    while the same sessions are decoded together, so a batch may be made for each step."""

    def __init__(self, sessions):
        if len({id(s) for s in sessions}) < len(sessions) or any(s.model is not sessions[0].model for s in sessions):
            raise ValueError("step_together takes distinct sessions of one model")
        self.sessions, self.model = list(sessions), sessions[0].model

    def step(self, tokens):
        """`Session.step_async` for every session: `tokens` int32 [B], one per session (lazy draws are fine).
        -> logits [B, vocab], their evaluation started; call each session's `settle()` before using it again."""
        caches, ids = [s.cache for s in self.sessions], tokens.astype(mx.int32).reshape(-1, 1)
        # the pool they decode from (`Pool.of`); None for a session alone, caches that cannot be stacked, or a
        # model whose forward takes no pool (a stage of a pipeline over several machines)
        pool = Pool.of(caches) if getattr(self.model, "takes_pools", False) else None
        if pool is None:
            logits = _forward_together(self.sessions, ids, last_only=True)
        else:
            logits = self._pooled_forward(ids, caches, pool)
        logits = logits[:, 0]
        # started before the checkpoints `took` takes: one evaluated first would write a ring (the whole pool's)
        # before its reads on the logits' path, so a copy
        evaluate_step(logits, pool.arrays if pool is not None else [c.arrays() for cache in caches for c in cache],
                      wait=False)
        for b, s in enumerate(self.sessions):
            s.took(tokens[b], logits[b])
        return logits

    def _pooled_forward(self, ids, caches, pool):
        """`_forward_together` on the pool's rows: the forward, and the commit of every session's or of none.
        -> logits [B, 1, vocab] (the arrays before the step go with the views: the step alone holds them, each
        freed once written)."""
        try:
            logits, written = self.model.forward(ids, pool.views(caches), last_only=True)
            pool.commit(written, caches)
        except BaseException:  # as in `_feed_steps`: every layer of every session back at its last token
            for s in self.sessions:
                s.undo_chunk(1)
            raise
        return logits


def step_together(sessions, tokens):
    """`DecodeBatch(sessions).step(tokens)`, or the sessions' own (in lockstep over several machines)."""
    own = getattr(type(sessions[0]), "step_together", None)
    if own is not None:
        return own(sessions, tokens)
    return DecodeBatch(sessions).step(tokens)


def verify_together(sessions, id_lists):
    """`Session.verify` for several sessions of one model in one forward (`Model.forward` over [B, T]): each
    session's ids padded to the longest with copies of its last, the padding's rows trimmed off again in
    place. -> each session's logits [len(ids), vocab]. A session that cannot take the padded rows as one
    chunk or trim them in place (`exact_rewinds`, a short rewind slack), or that runs over several machines,
    verifies alone."""
    T = max(len(ids) for ids in id_lists)

    def joins(s, n):
        return (getattr(type(s), "step_together", None) is None and s.model is sessions[0].model and s._room() >= T
                and (n == T or not s.exact_rewinds and min(s.rewind_slack, s.frontier_horizon) >= T))

    together = [i for i, (s, ids) in enumerate(zip(sessions, id_lists)) if joins(s, len(ids))]
    if len({id(s) for s in sessions}) < len(sessions):
        raise ValueError("verify_together takes distinct sessions")
    if len(together) < 2:
        together = []
    out = [None if i in together else s.verify(ids) for i, (s, ids) in enumerate(zip(sessions, id_lists))]
    if not together:
        return out
    group = [sessions[i] for i in together]
    padded = [[int(t) for t in id_lists[i]] + [int(id_lists[i][-1])] * (T - len(id_lists[i])) for i in together]
    keys = {k: None for s in group if s.tap_log is not None for k in s.tap_log.keys}
    taps = dict(keys) if keys else None
    logits = _forward_together(group, mx.array(padded, dtype=mx.int32), wait=True, taps=taps)
    for b, (i, s) in enumerate(zip(together, group)):
        mine = None if s.tap_log is None else {k: taps[k][b * T : (b + 1) * T] for k in s.tap_log.keys}
        pos, n = len(s.tokens), len(id_lists[i])
        s._fed(padded[b], logits[b, -1], mine)
        if n < T:
            s.trim(pos + n, logits=logits[b, n - 1])
        out[i] = logits[b, :n]
    return out
