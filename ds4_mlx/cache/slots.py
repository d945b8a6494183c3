"""The contract between a layer's cache and the model: where a step of T tokens reads and writes.

The cache computes a `Slots` on the host from `cache/geometry.py` and hands it to the model with its
arrays (`LayerCache.view`); the model returns the arrays it wrote, and the cache commits them
(`LayerCache.commit`). The model never changes a cache object.

Ints fix the shapes of a step's graph; arrays are its inputs, so a graph traced at one position runs at
every position with the same shapes (a decoded token's graph is traced once per kind of step).
"""

from functools import lru_cache
from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np

from ds4_mlx.cache.geometry import in_block, overlaps, ring_slot, rows_done, rows_visible, window_reach


class RingSlots(NamedTuple):
    """A token ring's part of a step: the slots of the positions before the step that it reads (in
    position order), and the slots its last rows go to (at most the ring's capacity of them)."""
    read: mx.array
    write: mx.array  # [k, 1]: a write's index as `numerics.write_rows` takes it
    # a compressor's ring: [blocks, span] the rows of each block the step completes (with overlap the block
    # before it first), a ring slot (>= 0) or -1 - the step's row (its tokens' own rows); None: none complete
    blocks: Optional[mx.array] = None


class Slots(NamedTuple):
    tokens: int  # T, the step's tokens, at positions start .. start + T - 1
    window: int  # the sliding window
    pooled: int  # compressed rows the step completes (0: it only logs compressor rows)
    selecting: bool  # the indexer picks the compressed rows (more are visible than index_topk)
    rows: int  # compressed rows the step reads: its count rounded up to a whole bucket, a function of the
    # position alone (what the buffers held before does not change the shapes, so nor the numbers)
    positions: mx.array  # [T] int32
    in_blocks: Optional[mx.array]  # [T] offsets in their compressed blocks (None without compression)
    visible: Optional[mx.array]  # [T] compressed rows visible to each token
    first_row: Optional[mx.array]  # the first compressed row the step completes (a scalar)
    raw: RingSlots
    frontier: Optional[RingSlots]  # the compressor's ring
    index_frontier: Optional[RingSlots]  # the indexer compressor's ring
    # [T] bool: the tokens whose indexer picks their rows, where only some do (a step that crosses
    # index_topk: its first tokens read all their rows); None: all of them, or none
    picks: Optional[mx.array] = None


def _ints(values):
    return mx.array(values, dtype=mx.int32)


def _write_index(values):
    """Rows to write, [k, 1] as `numerics.write_rows` takes them: made here as data, not in each step's
    graph (an expanded index is a node of it)."""
    return mx.array(np.asarray(values, np.int32).reshape(-1, 1))


def ring_slots(start, tokens, back, capacity):
    """`RingSlots` of a ring of `capacity` rows for T tokens from `start` reading `back` positions before."""
    first_written = start + tokens - min(tokens, capacity)
    return RingSlots(_ints([ring_slot(p, capacity) for p in range(start - back, start)]),
                     _write_index([ring_slot(p, capacity) for p in range(first_written, start + tokens)]))


def block_sources(start, first, last, ratio, capacity):
    """`RingSlots.blocks` of a compressor ring of `capacity` rows for the blocks first .. last - 1 that a step
    from position `start` completes. A position before 0 (the block before the first) reads position 0,
    whose scores the pooling then drops."""
    span = 2 * ratio if overlaps(ratio) else ratio
    positions = [[max(p, 0) for p in range((j + 1) * ratio - span, (j + 1) * ratio)] for j in range(first, last)]
    return _ints([[ring_slot(p, capacity) if p < start else start - 1 - p for p in row] for row in positions])


@lru_cache(maxsize=64)  # the layers of one kind share a step's slots: made once a step, not once a layer
def make_slots(start, tokens, *, window, ratio, raw_capacity, frontier_capacity=0, index_capacity=0,
               index_topk=0, row_bucket=1):
    """The `Slots` of a layer of compression `ratio` for T tokens from position `start`."""
    end = start + tokens
    positions = _ints(list(range(start, end)))
    # the whole window's rows are read even where it starts before position 0 (the attention masks those):
    # one shape for every step of T tokens
    raw = ring_slots(start, tokens, window_reach(window), raw_capacity)
    if not ratio:
        return Slots(tokens, window, 0, False, 0, positions, None, None, None, raw, None, None)
    first, last = rows_done(start, ratio), rows_done(end, ratio)
    # a compressor's ring is read only through the blocks the step completes
    frontier = ring_slots(start, tokens, 0, frontier_capacity)
    index = ring_slots(start, tokens, 0, index_capacity) if index_capacity else None
    if last > first:
        frontier = frontier._replace(blocks=block_sources(start, first, last, ratio, frontier_capacity))
        if index is not None:
            index = index._replace(blocks=block_sources(start, first, last, ratio, index_capacity))
    visible = [rows_visible(p, ratio) for p in range(start, end)]
    picks = np.array(visible) > index_topk if index_capacity else np.zeros(tokens, bool)
    rows = -(-last // row_bucket) * row_bucket
    return Slots(tokens, window, last - first, bool(picks[-1]), rows, positions,
                 _ints([in_block(p, ratio) for p in range(start, end)]), _ints(visible), mx.array(first, mx.int32),
                 raw, frontier, index, mx.array(picks) if picks[-1] and not picks.all() else None)


class BatchSlots(NamedTuple):
    """B sessions' decoded tokens (one each, any positions) against a layer's pooled arrays, flat ([S * rows,
    width], S >= B: row r of the pool is one session's rings or compressed rows, `cache/pool.py`). Every field
    but the first three is an array, so one graph per B and pool serves every mix of positions: each step
    pools every session's open block and writes the row where it belongs (a block's own row, read only once
    the block is complete)."""
    selecting: bool  # some session's indexer picks its rows
    raw_capacity: int  # a session's rows of the raw ring
    buffer_rows: int  # a session's rows of a compressed buffer (0 without compression)
    positions: mx.array  # [B] int32
    pool_rows: mx.array  # [B] the pool's row of each token's session
    raw_write: mx.array  # [B, 1] the raw ring's row each token's row goes to
    in_blocks: Optional[mx.array]  # [B] offsets in their compressed blocks (None without compression)
    visible: Optional[mx.array]  # [B] compressed rows visible to each token
    open_row: Optional[mx.array]  # [B] the compressed row each token's block becomes
    row_write: Optional[mx.array]  # [B, 1] where that row goes in the buffer
    own_rows: Optional[mx.array]  # [B, buffer_rows] each token's session's rows of a buffer (with an indexer)
    frontier_write: Optional[mx.array]  # [B, 1] the compressor ring's row each token's row goes to
    frontier_block: Optional[mx.array]  # [B, m] its rows of each token's block, with overlap [B, 2m] (the
    # block before it first; positions before 0 read position 0, which weighs nothing)
    index_write: Optional[mx.array]  # [B, 1] the same for the indexer compressor's ring
    index_block: Optional[mx.array]  # [B, 2m]
    picks: Optional[mx.array]  # [B] bool: whose indexer picks its rows (None: all of them, or none)


def _block_rows(positions, pool_rows, ratio, capacity):
    """The pooled ring's rows of each position's block, with overlap the block before it first (clamped
    at position 0)."""
    back = ratio if overlaps(ratio) else 0
    first = positions - positions % ratio
    slots = np.maximum(first[:, None] + np.arange(-back, ratio)[None, :], 0) % capacity
    return _ints(pool_rows[:, None] * capacity + slots)


@lru_cache(maxsize=16)
def make_batch_slots(positions, pool_rows, *, ratio, raw_capacity, frontier_capacity=0, index_capacity=0,
                     index_topk=0, buffer_rows=0):
    """The `BatchSlots` of a layer of compression `ratio` for one token of each session at `positions`, whose
    arrays are rows `pool_rows` of the pool (tuples); `buffer_rows`: the rows of a pooled buffer's row."""
    p, r = np.array(positions), np.array(pool_rows)
    raw = (_ints(p), _ints(r), _write_index(r * raw_capacity + ring_slot(p, raw_capacity)))
    if not ratio:
        return BatchSlots(False, raw_capacity, 0, *raw, *([None] * 10))
    visible = rows_visible(p, ratio)
    picks = visible > index_topk if index_capacity else np.zeros(len(p), bool)
    index = ((_write_index(r * index_capacity + ring_slot(p, index_capacity)), _block_rows(p, r, ratio, index_capacity))
             if index_capacity else (None, None))
    return BatchSlots(bool(picks.any()), raw_capacity, buffer_rows, *raw, _ints(in_block(p, ratio)), _ints(visible),
                      _ints(rows_done(p, ratio)), _write_index(r * buffer_rows + rows_done(p, ratio)),
                      _ints(r[:, None] * buffer_rows + np.arange(buffer_rows)[None, :]) if index_capacity else None,
                      _write_index(r * frontier_capacity + ring_slot(p, frontier_capacity)),
                      _block_rows(p, r, ratio, frontier_capacity), *index,
                      mx.array(picks) if picks.any() and not picks.all() else None)
