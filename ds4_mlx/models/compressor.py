"""The compressor, which pools blocks of tokens into compressed rows, and the indexer, which picks the
compressed rows each query reads (ratio-4 layers)."""

import mlx.core as mx
import mlx.nn as nn

from ds4_mlx.cache.geometry import overlaps
from ds4_mlx.cache.slots import RingSlots
from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.kernels import completed_rows, pooled_rows
from ds4_mlx.models.linear import Linear, TransposedLinear
from ds4_mlx.models.numerics import write_rows


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one row: a per-channel softmax over token scores. The ratio-4
    kind overlaps: each row pools the first half of the previous block's channels and the second half
    of its own block's."""

    def __init__(self, args: ModelArgs, ratio, head_dim):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlaps(ratio)
        width = head_dim * (2 if self.overlap else 1)
        # the file's kv and gate matrices stacked, and its score offsets (ape) beside zeros for the kv half
        # (`Model.sanitize`): a logged row is one product plus one row
        self.kv_gate = Linear(args.hidden_size, 2 * width)
        self.ape = mx.zeros((ratio, 2 * width))
        self.norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)

    def project(self, xn, in_blocks):
        """The rows to log for tokens at offsets `in_blocks` in their blocks: kv | score, float32 (pooling is
        a softmax)."""
        return self.kv_gate(xn).astype(mx.float32) + self.ape[in_blocks]

    def step(self, fresh, ring, at: RingSlots, rows, rope):
        """Log a step's rows `fresh` [T, 2 * width] (`project`'s) in the ring's rows array, and pool the blocks
        the step completes (`at.blocks`; their rows `rows` [n] of the buffer, or None), norm them and rotate
        them (`rope`) to their first positions. -> (the ring's rows written, those rows [n, head_dim] or None).
        One launch on CUDA (`kernels.completed_rows`)."""
        finished = None
        if rows is not None:  # read before the write (a ring of just the reach may take a row a block reads)
            finished = completed_rows(fresh, ring, at.blocks, rows, self.norm.weight, rope, self.ratio, self.overlap,
                                      self.norm.eps)
        return write_rows(ring, at.write, fresh[fresh.shape[0] - at.write.shape[0] :]), finished

    def step_each(self, fresh, ring, write, block, in_blocks, open_row, rope):
        """`step` for one token of each of B sessions whose rings are a pool's, flat [S * capacity, 2 * width]:
        log row b of `fresh` [B, 2 * width] at row `write`[b] of `ring`, and pool each token's block, whose
        positions are the rows `block` [B, m] of `ring` (with overlap [B, 2m], the block before first), then
        norm it and rotate it (`rope`) to the block's first position. -> (the rings written, those rows [B,
        head_dim]: junk where a block is not complete yet). One launch on CUDA (`kernels.pooled_rows`)."""
        # read before the write (a ring of just the reach may take a row the block reads)
        finished = pooled_rows(fresh, ring, block, in_blocks, open_row, self.norm.weight, rope, self.ratio,
                               self.overlap, self.norm.eps)
        return write_rows(ring, write, fresh), finished


class Indexer(nn.Module):
    """Scores compressed rows for each query (ReLU per head, weighted over heads)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.q_b = TransposedLinear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.proj = Linear(args.hidden_size, self.n_heads)
        self.compressor = Compressor(args, 4, self.head_dim)
