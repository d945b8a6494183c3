"""The caches of sessions decoded together, stacked: for each layer, every ring's and buffer's rows as one
array [S * rows, width] (row r of the pool, rows r * rows on: one session's), so that one decoded token of
each session writes its rows and attends in launches that do not grow with the sessions
(`Attention.attend_batch`). Flat, as a step writes and reads them: a step makes no view of them.

A `Pool` lasts while the same sessions are decoded together: a step hands the model each layer's
`BatchSlots` and arrays and commits the arrays written, which MLX writes in place (nothing else holds
them). The pool's arrays are copied only when the pool is built or a buffer grows:
- a session's decoded token alone, while its rows are in the pool, is the pool's step of one session;
- any other step of a session alone (a verify, a prefill chunk, a replay, a token while its rows are out)
  and any other write (a restored snapshot or checkpoint, a loaded file) takes the session's rows out of the
  pool: a copy of its rows alone (`LayerCache.leave_pool`). The pool keeps their row, and its next step
  with the session writes them back there, in place; trims, checkpoints and snapshots only read the row;
- another set of sessions gets a new pool; the sessions of the old one take copies of their rows first.
"""

import mlx.core as mx

from ds4_mlx.cache.geometry import rows_done
from ds4_mlx.cache.layers import RowBuffer
from ds4_mlx.cache.slots import make_batch_slots


PADDING_ROWS = 8 * RowBuffer.step  # compressed rows a session's may be padded by in a pool, beyond as many
# as the sessions hold


class Home:
    """Where a session's rows of one array live: row `b` of the pool's array `name` of layer `layer`. A
    ring's rows must keep their shape; a buffer's may be fewer than the pool's (rows past a buffer's count
    are never read)."""

    def __init__(self, pool, layer, name, b, ring):
        self.pool, self.layer, self.name, self.b, self.ring = pool, layer, name, b, ring

    def _pooled(self):
        """-> (the pool's array, a session's rows of it)."""
        pooled = self.pool.arrays[self.layer][self.name]
        return pooled, pooled.shape[0] // self.pool.size

    def read(self):
        pooled, n = self._pooled()
        return pooled[self.b * n : (self.b + 1) * n]

    def gather(self, index):
        """Its rows at `index` (an int array), gathered from the pool's array: a gather from the row's slice
        (`read`) would copy the whole slice first."""
        pooled, n = self._pooled()
        return pooled[self.b * n + index]

    def copy(self):
        return self.gather(mx.arange(self._pooled()[1]))  # its own buffer

    def fits(self, rows):
        """Whether rows taken out of the pool (`Stored.leave`) can come back into this row."""
        pooled, n = self._pooled()
        return rows is None or (rows.ndim == 2 and rows.dtype == pooled.dtype and rows.shape[1] == pooled.shape[1]
                                and (rows.shape[0] == n or not self.ring))


class Pool:
    """Each layer's arrays of B sessions stacked (`arrays`: per layer, by name), and the sessions' caches."""

    def __init__(self, caches):
        """`caches`: each session's list of `LayerCache`s (they must `fit` together); their rows are stacked
        (one copy) and live here from now on."""
        self.members = list(caches)
        self.size = len(self.members)  # rows of the pool, whoever holds them
        self.rows = {id(session): b for b, session in enumerate(self.members)}  # a session's row of the pool
        self.arrays = []
        for i, layer in enumerate(zip(*self.members)):
            named = {}
            for name, _ in layer[0].named_rings():
                named[name] = mx.concatenate([c.storage(name).allocate() for c in layer])
            buffers = [[c.storage(name) for c in layer] for name, _ in layer[0].named_buffers()]
            # one size for a layer's buffers: room for each session's open row (rows past a count are not read)
            capacity = max([_bucket(rows_done(c.pos, c.ratio) + 1) for c in layer if c.ratio], default=0)
            for (name, _), held in zip(layer[0].named_buffers(), buffers):
                named[name] = mx.concatenate([_padded(b, capacity) for b in held])
            self.arrays.append(named)
        for b, session in enumerate(self.members):
            for i, c in enumerate(session):
                for name, stored in c.named_rings():
                    stored.move_to(Home(self, i, name, b, True))
                for name, stored in c.named_buffers():
                    stored.move_to(Home(self, i, name, b, False))

    @staticmethod
    def fit(caches):
        """Whether these sessions' caches can share a pool: the same layers, ring sizes and row types, and
        compressed rows of lengths close enough: padding each session's to the longest adds no more rows than
        the sessions hold, or than `PADDING_ROWS` a session (a long session beside short ones decodes alone)."""
        def shape(c):
            return tuple((name, x.width, x.dtype, getattr(x, "capacity", None))
                         for name, x in c.named_stored())

        def close(layer):
            need = [_bucket(rows_done(c.pos, c.ratio) + 1) for c in layer]
            return len(need) * max(need) - sum(need) <= max(sum(need), len(need) * PADDING_ROWS)

        return (all(len(s) == len(caches[0]) and all(shape(a) == shape(b) for a, b in zip(s, caches[0]))
                    for s in caches)
                and all(close(layer) for layer in zip(*caches) if layer[0].ratio))

    @classmethod
    def of(cls, caches):
        """The pool to decode these sessions' caches from: the one they all are in (`serves`), else a new one of
        exactly them (their old pools let them go, each session taking a copy of its rows). None for one
        session whose rows are not in a pool (it steps on its own rows and its pool keeps its row), or sessions
        whose caches cannot share one."""
        current = caches[0][0].pool()
        if current is not None and current.serves(caches):
            return current
        if len(caches) == 1:
            return None
        for session in caches:
            for c in session:
                old = c.pool()
                if old is not None:
                    old.release()
        return cls(caches) if cls.fit(caches) else None

    def serves(self, caches):
        """Whether the pool decodes these sessions: its rows are theirs; one session alone only while its rows
        are in the pool (else it steps on its own rows, with no copy back), several while they are at least
        half of its sessions (a pool keeps the rows of sessions no longer decoded together until it is built
        again; a session or a few may verify drafts in a turn while the others decode) and the rows they took
        out can come back. A step that grows the pool's buffers grows every session's row of them: only while
        the sessions' lengths stay close (`fit`; one may have prefilled a long prompt on its own rows, or
        decoded on long beside idle ones)."""
        if not self.members or not all(self.members[self.rows.get(id(s), 0)] is s for s in caches):
            return False
        if self._grows(caches) and not self.fit(self.members):
            return False
        if len(caches) == 1:
            return all(c.in_pool() for c in caches[0])
        return 2 * len(caches) >= len(self.members) and all(
            x.inside or x.home.fits(x.rows) for s in caches for c in s for x in c.stored())

    def _grows(self, caches):
        """Whether a step of these sessions needs more rows than the pool's buffers have (`_view`)."""
        return any(_bucket(rows_done(c.pos, c.ratio) + 1) > named["rows"].shape[0] // self.size
                   for session in caches for c, named in zip(session, self.arrays) if c.ratio)

    def release(self):
        """Every session of the pool takes a copy of its rows (the pool is going away)."""
        for session in self.members:
            for c in session:
                for stored in c.stored():
                    if stored.home is not None and stored.home.pool is self:
                        stored.move_out()
        self.members, self.rows, self.arrays = [], {}, []

    def drop(self, caches):
        """A session lets these caches go (`Session.reset`): the pool goes away, so that their rows are freed
        now rather than when the others next decode apart; the others take copies of their rows."""
        self.members = [s for s in self.members if s is not caches]  # their rows are copied for no one
        others = [c for s in self.members for c in s]
        self.release()
        # started now: the lazy copies would hold the pool's arrays until the others' next step
        mx.async_eval([x.rows for c in others for x in c.stored() if x.rows is not None])

    def views(self, caches):
        """Each layer's (`BatchSlots`, arrays by name) for one decoded token of each of these sessions; rows a
        session took out come back into its row of the pool first."""
        rows = tuple(self.rows[id(s)] for s in caches)
        # evaluated before they come back: a lazy copy of the pool's slice would hold the array written in place
        mx.eval([x.rows for s in caches for c in s if not c.in_pool()
                 for x in c.stored() if not x.inside and x.rows is not None])
        return [self._view(i, layer, rows) for i, layer in enumerate(zip(*caches))]

    def _view(self, i, layer, rows):
        c, named, S = layer[0], self.arrays[i], self.size
        if c.ratio:  # room for each token's open row
            need = _bucket(max(rows_done(x.pos, c.ratio) + 1 for x in layer))
            for name, _ in c.named_buffers():
                had, width = named[name].shape[0] // S, named[name].shape[1]
                if had < need:  # each session's rows, then zeros
                    named[name] = mx.pad(named[name].reshape(S, had, width), [(0, 0), (0, need - had), (0, 0)]
                                         ).reshape(S * need, width)
        for session, b in zip(layer, rows):
            if not session.in_pool():
                _come_back(named, session, b, S)
        slots = make_batch_slots(tuple(x.pos for x in layer), rows, ratio=c.ratio,
                                 raw_capacity=c.raw.capacity,
                                 frontier_capacity=c.frontier.capacity if c.ratio else 0,
                                 index_capacity=c.index_frontier.capacity if c.index_frontier else 0,
                                 index_topk=c.index_topk, buffer_rows=named["rows"].shape[0] // S if c.ratio else 0)
        return slots, dict(named)

    def commit(self, written, caches):
        """Take the arrays a step of one token of each of these sessions wrote (each layer's, by name); the
        sessions move on one position."""
        self.arrays = [dict(w) for w in written]
        for session in caches:
            for c in session:
                c.moved(1)


def _come_back(named, layer, b, size):
    """A layer's rows that a session took out of the pool back into its row `b` of the pooled arrays `named`
    of `size` rows (in place: nothing else holds them once the step is built)."""
    for name, x in layer.named_stored():
        if not x.inside:
            rows = x.enter()
            if rows is not None:
                n = named[name].shape[0] // size
                named[name] = mx.slice_update(named[name], rows[:n], mx.array([b * n]), axes=(0,))


def _bucket(n):
    return -(-n // RowBuffer.step) * RowBuffer.step


def _padded(buffer, capacity):
    """A buffer's rows array with `capacity` rows: its first rows (at least its count), then zeros."""
    zeros = mx.zeros((capacity, buffer.width), buffer.dtype)
    if buffer.rows is None:
        return zeros
    return mx.slice_update(zeros, buffer.rows[:capacity], mx.array([0]), axes=(0,))
