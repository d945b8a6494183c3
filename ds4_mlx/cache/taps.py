"""The target's streams a drafter reads, one row per committed position, for the last few positions.

A speculative drafter (DSpark, MTP) conditions on the target's residual streams at the positions the
session holds. The session hands every chunk it feeds to a `TapLog` (`Session.tap_log`); the log keeps
one row per position in a ring, so trimming the session trims the log exactly (a rewind deeper than the
ring's history leaves it empty from there, as does a step fed without taps): the drafter then drafts
from fewer rows, which only changes how many drafts are accepted, never the output.
"""

import mlx.core as mx

from ds4_mlx.cache.layers import TokenRing


class TapLog:
    """Rows `to_rows(taps) -> [T, width]` of the streams named by `keys` (`Model.__call__`'s taps) for the
    last `capacity` positions up to `pos`; positions from `floor` on are held."""

    def __init__(self, keys, to_rows, width, capacity):
        self.keys, self.to_rows, self.width, self.capacity = tuple(keys), to_rows, width, capacity
        self.restart(0)

    def request(self):
        """The `taps` dict to pass to the model."""
        return {k: None for k in self.keys}

    def record(self, start, taps, chunk=None):
        """A chunk's streams, for positions start, start + 1, ... (a chunk not following the held rows
        starts the log again there). `chunk`: the chunk's length, when `taps` hold its last rows only (a
        pipeline over several machines brings no more than the log keeps: `ds4_mlx.distributed`)."""
        T = next(iter(taps.values())).shape[0]
        if chunk is not None:
            start += chunk - T
        if T > self.capacity:  # a long prefill chunk: only its last rows stay
            taps = {k: v[T - self.capacity :] for k, v in taps.items()}
            start, T = start + T - self.capacity, self.capacity
        if not self.ring.floor <= start <= self.pos:
            self.restart(start)
        self.ring.write(start, self.to_rows(taps))
        self.pos = start + T
        self.ring.passed(self.pos)
        mx.eval(self.ring.rows)  # now: a lazy ring would hold every chunk's streams until the next draft

    def trim(self, n):
        """Hold positions before n only."""
        if n < self.ring.floor:
            self.restart(n)
        self.pos = min(self.pos, n)

    def restart(self, pos):
        """Hold nothing, at position `pos`."""
        self.ring = TokenRing(self.capacity, self.width, mx.float32)
        self.ring.floor = self.pos = pos

    def window(self, stop, size):
        """(first position, rows [n, width]) of the held positions in [stop - size, stop)."""
        stop = min(stop, self.pos)
        first = max(stop - size, self.ring.floor)
        return first, self.ring.read(first, stop)

    def snapshot(self):
        return self.ring.rows, self.ring.floor, self.pos

    def restore(self, snap):
        rows, floor, pos = snap
        self.restart(pos)
        self.ring.rows, self.ring.floor = rows, floor
