"""Per-layer caches of DeepSeek V4, built so that any earlier position can be restored exactly.

Two kinds of storage, and nothing else:
- `TokenRing`: one row per token (raw KV rows; the compressor's pre-pooling kv and score rows),
  kept for the last `capacity` positions. Position p lives in slot p % capacity, so rewinding is
  moving `pos` back: the rows of the earlier positions are still there as long as the ring holds them
  (from `floor` on).
- `RowBuffer`: append-only compressed rows (attention and indexer). Row i depends only on tokens
  before (i + 1) * ratio, so a rewind truncates the count.

Rows the model has already rounded to float16 (with `quant_sim`: the FP8/float16 raw and compressed
KV rows, the FP4/float16 indexer rows) are stored as float16, which is exact; the compressor inputs
are float32 in the reference and stay so. Without `quant_sim` every row stays float32.

Arrays are only ever replaced (the model's scatters return new arrays, which MLX writes in place only
when nothing else holds the old one), never written through a shared handle, so holding the old arrays is
a valid snapshot and writing after a snapshot copies on write.

State protocol: `state` is the named arrays position `pos` needs, in position
order; `meta_state` a dict of counters; `load_state(state, meta_state)` rebuilds the cache from them.
"""

import mlx.core as mx

from ds4_mlx.cache.geometry import (compressor_reach, frontier_needs, lane_every as lcm_lane, ring_slot, rows_done,
                                    window_reach)
from ds4_mlx.cache.slots import make_slots

RING_NAMES = ("raw", "frontier", "index_frontier")
BUFFER_NAMES = ("rows", "index_rows")


class Stored:
    """A rows array that lives in the object, or in its row of a pool of sessions decoded together
    (`cache/pool.py`, `home`). In the pool, reading it gives the session's slice; a step of the session
    alone, or any other write, takes the rows out (a copy of this session's rows alone: the pool is never
    written from here) and the pool keeps the row for them until the pool's next step brings them back
    (`Pool.views`)."""

    home = None  # the pool's row kept for these rows, while the session is one of the pool's
    inside = False  # the rows live in the pool's row (else in `_own`)
    _own = None

    @property
    def rows(self):
        return self.home.read() if self.inside else self._own

    @rows.setter
    def rows(self, value):
        self.inside, self._own = False, value

    def move_to(self, home):
        """Live in a pool from now on (it holds the rows already)."""
        self.home, self.inside, self._own = home, True, None

    def leave(self):
        """Hold a copy of its rows of the pool, the pool keeping their row (a step of this session alone)."""
        if self.inside:
            self.inside, self._own = False, self.home.copy()

    def move_out(self):
        """Leave the pool for good (it is going away)."""
        self.leave()
        self.home = None

    def enter(self):
        """The rows to write into the pool's row, which holds them from now on (`Pool.views`)."""
        rows, self.inside, self._own = self._own, True, None
        return rows

    def held(self):
        """The rows to keep past the next step (a snapshot): the array itself, or a copy of the pool's slice
        (holding the slice would hold the pool's array, which the next step could no longer write in place)."""
        return self.home.copy() if self.inside else self._own

    @property
    def nbytes(self):
        """The bytes of its rows, and of the pool's row kept for them while they are out of it."""
        kept = self.home.read().nbytes if self.home is not None and not self.inside else 0
        return kept + (0 if self.rows is None else self.rows.nbytes)


class TokenRing(Stored):
    """One row per position for the last `capacity` positions: position p in slot `ring_slot(p, capacity)`.
    A step longer than the ring keeps only its last `capacity` rows (a step never runs past a lane's
    position, and the session copies a lane as soon as a step ends on it: no lane loses its rows)."""

    def __init__(self, capacity, width, dtype=mx.float32):
        self.capacity, self.width, self.dtype = capacity, width, dtype
        self.rows = None
        self.floor = 0  # the oldest position whose row is still held

    def write(self, start, rows):
        """Store rows for positions start, start + 1, ... (at most `capacity` of them)."""
        n = rows.shape[0]
        if n > self.capacity:
            raise ValueError(f"{n} rows for a ring of {self.capacity}")
        self.allocate()  # also for no rows: a step writes into the array (a state loaded at a multiple of 128
        # holds no rows of the ratio-128 compressor)
        if n == 0:
            return
        rows = rows.astype(self.dtype)
        slot = ring_slot(start, self.capacity)
        first = min(n, self.capacity - slot)
        self.rows = mx.slice_update(self.rows, rows[:first], mx.array([slot]), axes=(0,))
        if first < n:
            self.rows = mx.slice_update(self.rows, rows[first:], mx.array([0]), axes=(0,))

    def allocate(self):
        """The rows array, zeros until written (a step writes into it)."""
        if self.rows is None:
            self.rows = mx.zeros((self.capacity, self.width), self.dtype)
        return self.rows

    def gather(self, positions):
        """Rows at the given positions (an int array of any shape; negative positions give junk rows
        that the caller masks)."""
        slots = ring_slot(positions, self.capacity)
        return self.home.gather(slots) if self.inside else self.rows[slots]

    def read(self, start, stop):
        """Rows of positions [start, stop), in order (the caller checked they are held)."""
        if stop <= start or self.rows is None:
            return mx.zeros((0, self.width), self.dtype)
        return self.gather(mx.arange(start, stop))

    def copy(self, start, stop):
        """A copy of the rows of positions [start, stop), or None when the ring no longer holds them."""
        return self.read(start, stop) if start >= min(self.floor, stop) else None

    def passed(self, pos):
        """The ring has been written up to `pos`: rows older than one capacity are gone."""
        self.floor = max(self.floor, pos - self.capacity)


class RowBuffer(Stored):
    """Append-only rows with a live count. Capacity grows by a sixteenth (in steps of `step` rows), so
    appends cost amortised O(rows) and at most ~6% of the bytes are spare."""

    step = 256

    def __init__(self, width, dtype=mx.float32):
        self.width, self.dtype = width, dtype
        self.rows = None
        self.count = 0

    def reserve(self, need):
        """Room for `need` rows. Rows past `count` may be stale (a trim only lowers the count)."""
        if self.rows is None or need > self.rows.shape[0]:
            size = -(-max(need, self.count + self.count // 16) // self.step) * self.step
            grown = mx.zeros((size, self.width), self.dtype)
            if self.count:
                grown = mx.slice_update(grown, self.rows[: self.count], mx.array([0]), axes=(0,))
            self.rows = grown

    def view(self):
        return self.rows[: self.count] if self.count else mx.zeros((0, self.width), self.dtype)

    def set(self, rows):
        self.rows, self.count = (rows.astype(self.dtype), rows.shape[0]) if rows.shape[0] else (None, 0)


class LayerCache:
    """The state of one V4 layer after `pos` tokens.

    `ratio` 0: sliding window only. Otherwise a compressor with `frontier` rows of width 2 * W
    (kv | score, W = comp_width), the compressed `rows`, and for the overlapping ratio-4 layers an
    indexer with its own `index_frontier` and `index_rows`.
    The raw ring keeps `history` positions beyond what one chunk needs, the compressor rings
    `frontier_history`, so any rewind that deep restores the state with no recomputation.
    """

    def __init__(self, *, window, head_dim, ratio=0, comp_width=0, index_dim=0, index_width=0, index_topk=0,
                 history=0, frontier_history=None, row_dtype=mx.float32):
        self.window, self.ratio, self.index_topk, self.pos = window, ratio, index_topk, 0
        frontier_history = history if frontier_history is None else min(frontier_history, history)
        # a step reads the rows before it from the rings and its own rows from itself, so the rings hold the
        # reach and the rewind history, whatever the step's length
        self.raw = TokenRing(window_reach(window) + history, head_dim, row_dtype)
        frontier_capacity = compressor_reach(ratio) + frontier_history if ratio else 0
        self.frontier = TokenRing(frontier_capacity, 2 * comp_width) if ratio else None
        self.rows = RowBuffer(head_dim, row_dtype) if ratio else None
        self.index_frontier = TokenRing(frontier_capacity, 2 * index_width) if index_dim else None
        self.index_rows = RowBuffer(index_dim, row_dtype) if index_dim else None
        # the rings and buffers this layer kind has, by name, listed once (a decoded token asks often)
        self._named_rings = tuple((n, r) for n, r in zip(RING_NAMES, (self.raw, self.frontier, self.index_frontier))
                                  if r is not None)
        self._named_buffers = tuple((n, b) for n, b in zip(BUFFER_NAMES, (self.rows, self.index_rows)) if b is not None)
        self._rings = tuple(r for _, r in self._named_rings)
        self._buffers = tuple(b for _, b in self._named_buffers)
        self._named_stored = self._named_rings + self._named_buffers
        self._stored = self._rings + self._buffers

    def rings(self):
        return self._rings

    def buffers(self):
        return self._buffers

    def arrays(self):
        """The arrays a step writes (its rings' and buffers' rows): what to
        evaluate with the logits (set-aside rows evaluated later would hold the whole chunk until then)."""
        return [x.rows for x in self.stored()]

    def view(self, tokens):
        """What a step of `tokens` tokens from `pos` needs: (`Slots`, the arrays it reads and writes by name:
        the rings' rows, and the buffers' with room for the rows the step reads). The model returns the
        arrays written, for `commit`. A step of this session alone: rows in a pool leave it (`leave_pool`)."""
        self.leave_pool()
        slots = make_slots(self.pos, tokens, window=self.window, ratio=self.ratio, raw_capacity=self.raw.capacity,
                           frontier_capacity=self.frontier.capacity if self.ratio else 0,
                           index_capacity=self.index_frontier.capacity if self.index_frontier else 0,
                           index_topk=self.index_topk, row_bucket=RowBuffer.step)
        for b in self.buffers():
            b.reserve(slots.rows)
        return slots, {name: x.allocate() if x in self._rings else x.rows
                       for name, x in self.named_stored()}

    def commit(self, written, tokens):
        """Take the arrays a step of `tokens` tokens wrote (by name, `view`'s), and move on that many
        positions."""
        for name, stored in self.named_stored():
            stored.rows = written[name]
        self.moved(tokens)

    def moved(self, tokens):
        """A step of `tokens` tokens wrote this layer's arrays where they live (`commit`, or a pool's step):
        move on that many positions."""
        for buf in self.buffers():
            buf.count = rows_done(self.pos + tokens, self.ratio)
        self.advance(tokens)

    def storage(self, name):
        """The ring or buffer of that name."""
        return dict(self.named_stored())[name]

    def pool(self):
        """The pool of sessions decoded together that keeps a row for this layer's rows (`cache/pool.py`), or
        None."""
        return next((x.home.pool for x in self.stored() if x.home is not None), None)

    def in_pool(self):
        """Whether every array of the layer lives in its pool's row."""
        return all(x.inside for x in self.stored())

    def leave_pool(self):
        """Hold copies of this layer's rows of its pool (a step of this session alone, `view`); the pool keeps
        their row."""
        for x in self.stored():
            x.leave()

    def advance(self, n):
        self.pos += n
        for ring in self.rings():
            ring.passed(self.pos)

    def ring_needs(self, p):
        """For each ring, how many positions before p it must hold for the state at p: the window
        for raw rows; for compressor rows the open block (and the previous one, with overlap)."""
        needs = [min(window_reach(self.window), p)]
        if self.ratio:
            needs += [frontier_needs(p, self.ratio)] * (len(self.rings()) - 1)
        return needs

    def can_trim(self, p):
        return 0 <= p <= self.pos and all(p - n >= ring.floor for ring, n in zip(self.rings(), self.ring_needs(p)))

    def trim(self, p):
        """Go back to position p exactly (caller checked `can_trim`)."""
        self.pos = p
        for b in self.buffers():
            b.count = rows_done(p, self.ratio)

    # Checkpoints and snapshots ---------------------------------------------------------------
    def checkpoint(self, p=None, *, raw=True):
        """Copy what position p (default `pos`) needs from the rings: a few rows; without `raw`, only
        the compressor rows (a lane: the raw ring must still hold p's window when it is restored).
        Compressed rows are not copied: they stay valid while the live history passes through p.
        None when a ring no longer holds a row p needs."""
        p = self.pos if p is None else p
        rows = [ring.copy(p - n, p) if raw or ring is not self.raw else None
                for ring, n in zip(self.rings(), self.ring_needs(p))]
        if any(r is None for ring, r in zip(self.rings(), rows) if raw or ring is not self.raw):
            return None
        mx.eval([r for r in rows if r is not None])
        return {"pos": p, "rows": rows}

    def can_restore(self, cp):
        """Every row the state at the checkpoint's position needs is in it, or (raw rows of a lane)
        still held by the ring."""
        p = cp["pos"]
        return p <= self.pos and all(
            p - n >= ring.floor if rows is None else rows.shape == (n, ring.width)
            for ring, rows, n in zip(self.rings(), cp["rows"], self.ring_needs(p)))

    def restore_checkpoint(self, cp):
        p = cp["pos"]
        for ring, rows, n in zip(self.rings(), cp["rows"], self.ring_needs(p)):
            if rows is not None:
                ring.write(p - n, rows)
                ring.floor = p - n
        self.trim(p)

    def snapshot(self):
        """Hold the current arrays: O(1), the live cache copies a buffer on its next write; in a pool, a copy
        of the session's rows."""
        rings, buffers = [(r.held(), r.floor) for r in self.rings()], [(b.held(), b.count) for b in self.buffers()]
        if self.pool() is not None:  # the copies now: a lazy one would hold the pool's array
            mx.eval([rows for rows, _ in rings + buffers if rows is not None])
        return self.pos, rings, buffers

    def restore(self, snap):
        self.pos, rings, buffers = snap
        for ring, (rows, floor) in zip(self.rings(), rings):
            ring.rows, ring.floor = rows, floor
        for buf, (rows, count) in zip(self.buffers(), buffers):
            buf.rows, buf.count = rows, count

    # State protocol --------------------------------------------------------------------------
    def named_rings(self):
        return self._named_rings

    def named_buffers(self):
        return self._named_buffers

    def named_stored(self):
        """Its rings' and buffers' (name, `Stored`) pairs, rings first."""
        return self._named_stored

    def stored(self):
        return self._stored

    def export_state(self, back_to=None):
        """`state`, with every ring's rows back to what the state at `back_to` needs (as far as the rings
        hold them), so that the loaded cache trims back that far in place."""
        p = self.pos
        out = {}
        back = self.ring_needs(p) if back_to is None else [back_to - n for n in self.ring_needs(back_to)]
        for (name, ring), n, first in zip(self.named_rings(), self.ring_needs(p), back):
            start = p - n if back_to is None else max(min(first, p - n), ring.floor)
            out[name] = ring.read(start, p)
        for name, buf in self.named_buffers():
            out[name] = buf.view()
        return out

    @property
    def state(self):
        return self.export_state()

    @property
    def meta_state(self):
        return {"pos": self.pos, "ratio": self.ratio, "window": self.window}

    def load_state(self, state, meta_state):
        """Rebuild from `state` / `meta_state` (raises ValueError when they do not fit this layer)."""
        p = int(meta_state["pos"])
        if meta_state.get("ratio") != self.ratio or meta_state.get("window") != self.window:
            raise ValueError("state of another layer kind")
        names = {n for n, _ in self.named_rings()} | {n for n, _ in self.named_buffers()}
        if set(state) != names:
            raise ValueError(f"state arrays {sorted(state)}, expected {sorted(names)}")
        for (name, ring), n in zip(self.named_rings(), self.ring_needs(p)):
            rows = state[name]
            if rows.ndim != 2 or rows.shape[1] != ring.width or not n <= rows.shape[0]:
                raise ValueError(f"{name}: rows of shape {rows.shape} for position {p}")
            rows = rows[-ring.capacity:]
            ring.rows, ring.floor = None, p - rows.shape[0]
            ring.write(p - rows.shape[0], rows)
        for name, buf in self.named_buffers():
            rows = state[name]
            if rows.ndim != 2 or rows.shape[1] != buf.width or rows.shape[0] != rows_done(p, self.ratio):
                raise ValueError(f"{name}: rows of shape {rows.shape} for position {p}")
            buf.set(rows)
        self.pos = p

    @property
    def nbytes(self):
        return sum(r.nbytes for r in self.rings()) + sum(b.nbytes for b in self.buffers())


def make_caches(args, *, history=0, frontier_history=None, row_dtype=mx.float32):
    """The per-layer caches of a V4 model (`ModelArgs`)."""
    ratios = args.compress_ratios[: args.num_hidden_layers]
    caches = []
    for ratio in ratios:
        csa = ratio == 4
        caches.append(LayerCache(
            window=args.sliding_window, head_dim=args.head_dim, ratio=ratio,
            comp_width=args.head_dim * (2 if csa else 1) if ratio else 0,
            index_dim=args.index_head_dim if csa else 0, index_width=2 * args.index_head_dim if csa else 0,
            index_topk=args.index_topk,
            history=history, frontier_history=frontier_history, row_dtype=row_dtype))
    return caches


def lane_every(caches):
    """The lane spacing of a model's caches (`geometry.lane_every`)."""
    return lcm_lane([c.ratio for c in caches])
