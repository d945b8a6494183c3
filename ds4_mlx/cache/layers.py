"""Per-layer caches of DeepSeek V4, built so that any earlier position can be restored exactly.

Two kinds of storage, and nothing else:
- `TokenRing`: one row per token (raw KV rows; the compressor's pre-pooling kv and score rows),
  kept for the last `capacity` positions. Position p lives in slot p % capacity, so rewinding is
  moving `pos` back: the rows of the earlier positions are still there as long as the ring holds them.
- `RowBuffer`: append-only compressed rows (attention and indexer). Row i depends only on tokens
  before (i + 1) * ratio, so a rewind truncates the count.

Arrays are only ever replaced (`mx.slice_update` and rebinding), never written through a shared
handle, so holding the old arrays is a valid snapshot and writing after a snapshot copies on write.
"""

import mlx.core as mx


class TokenRing:
    def __init__(self, capacity, width, dtype=mx.float32):
        self.capacity, self.width, self.dtype = capacity, width, dtype
        self.rows = None

    def write(self, start, rows):
        """Store rows for positions start, start + 1, ... (at most `capacity` of them)."""
        n = rows.shape[0]
        assert n <= self.capacity, "chunk larger than the ring"
        if self.rows is None:
            self.rows = mx.zeros((self.capacity, self.width), self.dtype)
        rows = rows.astype(self.dtype)
        slot = start % self.capacity
        first = min(n, self.capacity - slot)
        self.rows = mx.slice_update(self.rows, rows[:first], mx.array([slot]), axes=(0,))
        if first < n:
            self.rows = mx.slice_update(self.rows, rows[first:], mx.array([0]), axes=(0,))

    def gather(self, positions):
        """Rows at the given positions (an int array of any shape; negative positions give junk rows
        that the caller masks)."""
        return self.rows[positions % self.capacity]

    @property
    def nbytes(self):
        return 0 if self.rows is None else self.rows.nbytes


class RowBuffer:
    """Append-only rows with a live count; capacity grows in steps so appends are amortised O(rows)."""

    step = 256

    def __init__(self, width, dtype=mx.float32):
        self.width, self.dtype = width, dtype
        self.rows = None
        self.count = 0

    def append(self, rows):
        n = rows.shape[0]
        if n == 0:
            return
        need = self.count + n
        if self.rows is None or need > self.rows.shape[0]:
            size = (need + self.step - 1) // self.step * self.step
            grown = mx.zeros((size, self.width), self.dtype)
            if self.count:
                grown = mx.slice_update(grown, self.rows[: self.count], mx.array([0]), axes=(0,))
            self.rows = grown
        self.rows = mx.slice_update(self.rows, rows.astype(self.dtype), mx.array([self.count]), axes=(0,))
        self.count = need

    def view(self):
        return self.rows[: self.count] if self.count else mx.zeros((0, self.width), self.dtype)

    @property
    def nbytes(self):
        return 0 if self.rows is None else self.rows.nbytes


class LayerCache:
    """The state of one V4 layer after `pos` tokens.

    `ratio` 0: sliding window only. Otherwise a compressor with `frontier` rows of width 2 * W
    (kv | score, W = comp_width), the compressed `rows`, and for the overlapping ratio-4 layers an
    indexer with its own `index_frontier` and `index_rows`.
    `history` extra positions are kept in every ring beyond what one chunk needs, so any rewind of up
    to `history` tokens restores the state with no recomputation.
    """

    def __init__(self, *, window, head_dim, ratio=0, comp_width=0, index_dim=0, index_width=0,
                 max_chunk=512, history=0, dtype=mx.float32):
        self.window, self.ratio, self.pos = window, ratio, 0
        self.overlap = ratio == 4
        self.max_chunk = max_chunk
        # a chunk of T tokens reads positions back to p0 - reach
        self.reach = max(window - 1, (2 * ratio if self.overlap else ratio) - 1, 0)
        capacity = self.reach + max_chunk + history
        self.raw = TokenRing(capacity, head_dim, dtype)
        self.frontier = TokenRing(capacity, 2 * comp_width, dtype) if ratio else None
        self.rows = RowBuffer(head_dim, dtype) if ratio else None
        self.index_frontier = TokenRing(capacity, 2 * index_width, dtype) if index_dim else None
        self.index_rows = RowBuffer(index_dim, dtype) if index_dim else None
        self.floor = 0  # the oldest position whose ring rows are still valid

    def rings(self):
        return [r for r in (self.raw, self.frontier, self.index_frontier) if r is not None]

    def buffers(self):
        return [b for b in (self.rows, self.index_rows) if b is not None]

    def advance(self, n):
        self.pos += n
        self.floor = max(self.floor, self.pos - self.raw.capacity)

    def ring_needs(self, p):
        """For each ring, how many positions before p it must hold for the state at p: the window
        for raw rows; for compressor rows the open block (and the previous one, with overlap)."""
        needs = [min(self.window - 1, p)]
        if self.ratio:
            frontier = min(p % self.ratio + (self.ratio if self.overlap else 0), p)
            needs += [frontier] * (len(self.rings()) - 1)
        return needs

    def needed(self, p):
        return max(self.ring_needs(p))

    def can_trim(self, p):
        return 0 <= p <= self.pos and p - self.needed(p) >= self.floor

    def trim(self, p):
        """Go back to position p exactly (caller checked `can_trim`)."""
        self.pos = p
        for b in self.buffers():
            b.count = p // self.ratio

    # Checkpoints and snapshots ---------------------------------------------------------------
    def checkpoint(self):
        """Copy what position `pos` needs from the rings (a few rows); compressed rows are not copied:
        they stay valid while the live history passes through `pos`."""
        p = self.pos
        rows = [ring.gather(mx.arange(p - n, p)) if n and ring.rows is not None else None
                for ring, n in zip(self.rings(), self.ring_needs(p))]
        mx.eval([r for r in rows if r is not None])
        return {"pos": p, "rows": rows}

    def restore_checkpoint(self, cp):
        p = cp["pos"]
        for ring, rows, n in zip(self.rings(), cp["rows"], self.ring_needs(p)):
            if rows is not None:
                ring.write(p - n, rows)
        self.trim(p)
        self.floor = p - self.needed(p)

    def snapshot(self):
        """Hold the current arrays: O(1); the live cache copies a buffer on its next write."""
        return (self.pos, self.floor, [r.rows for r in self.rings()], [(b.rows, b.count) for b in self.buffers()])

    def restore(self, snap):
        self.pos, self.floor, ring_rows, buffers = snap
        for ring, rows in zip(self.rings(), ring_rows):
            ring.rows = rows
        for buf, (rows, count) in zip(self.buffers(), buffers):
            buf.rows, buf.count = rows, count

    @property
    def nbytes(self):
        return sum(r.nbytes for r in self.rings()) + sum(b.nbytes for b in self.buffers())
