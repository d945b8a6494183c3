"""The cache geometry of DeepSeek V4, in one place: where a position's rows live, which compressed rows a
position makes and sees, and which earlier positions the state at a position is made of.

W is the sliding window (128 in V4 Flash) and m a layer's compression ratio: 0 (window only), 4 (blocks
that overlap: each pooled row also reads the block before its own) or 128. Block b holds positions
[b * m, (b + 1) * m) and becomes compressed row b when its last position is fed. Every function takes
Python ints or MLX int arrays alike (the prefill builds arrays of positions, a decoded token ints).
"""

import math

def overlaps(m):
    """Ratio-4 blocks pool the block before theirs too (V4's compressed sparse attention)."""
    return m == 4


def ring_slot(p, capacity):
    """The slot of a ring of `capacity` rows that holds position p."""
    return p % capacity


def block_of(p, m):
    """The compressed row position p's block becomes."""
    return p // m


def in_block(p, m):
    """Position p's offset in its block (the row of the compressor's score offsets it adds)."""
    return p % m


def rows_done(n, m):
    """Compressed rows complete once n tokens (positions 0 .. n - 1) are fed."""
    return n // m


def rows_visible(p, m):
    """Compressed rows a query at position p attends to: the blocks that end at or before p."""
    return (p + 1) // m


def window_reach(window):
    """Positions before a query that its raw window reads."""
    return window - 1


def compressor_reach(m):
    """Positions before a token that the pooling of its block reads: the rest of its block, and with
    overlap the block before."""
    return (2 * m if overlaps(m) else m) - 1


def frontier_start(p, m):
    """The first position whose compressor inputs the state at p still needs: the start of the open
    block, or of the block before it with overlap."""
    return max(0, (block_of(p, m) - overlaps(m)) * m)


def frontier_needs(p, m):
    """How many positions before p the compressor's inputs must be held for the state at p."""
    return p - frontier_start(p, m)


def lane_every(ratios):
    """Positions that are multiples of every compression ratio (128 in V4 Flash): there the compressor
    state is only the overlap lane of the ratio-4 layers, a few rows. None without compression."""
    ratios = [m for m in ratios if m]
    return math.lcm(*ratios) if ratios else None
