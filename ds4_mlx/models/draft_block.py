"""A V4 decoder block as speculative drafters use it: window attention only, over key rows the caller
gives (the drafter's context) plus the block's own.

The drafters (`dspark.py`, `mtp.py`) keep no cache of their own: their context rows are made from the
target's streams at committed positions (`ds4_mlx.cache.taps.TapLog`), so trimming the session is all
the rollback they need.
"""

from dataclasses import replace

import mlx.core as mx

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.deepseek_v4 import DecoderLayer
from ds4_mlx.models.hyper import HyperConnection
from ds4_mlx.models.kernels import attend


def block_args(args: ModelArgs) -> ModelArgs:
    """The target's shape for a single window-only block with learned (not hashed) routing."""
    return replace(args, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0)


def sanitized(weights: dict, args: ModelArgs, blocks) -> dict:
    """A drafter's weights as its blocks hold them: the grouped output projections reshaped to [groups,
    rank, in] (as `Model.sanitize` does), each block's optional router bias defaulted to zeros (`blocks`:
    the blocks' parameter prefixes)."""
    out = dict(weights)
    for name, w in weights.items():
        if ".attn.o_a." in name and w.ndim == 2:
            out[name] = w.reshape(args.o_groups, -1, w.shape[-1])
    for prefix in blocks:
        out.setdefault(f"{prefix}.ffn.bias", mx.zeros((args.n_routed_experts,)))
    return out


class DraftBlock(DecoderLayer):
    """`DecoderLayer`'s parameters (same names), computed over explicit context rows."""

    def __init__(self, args: ModelArgs):
        super().__init__(block_args(args), 0)

    def context_rows(self, x, start):
        """Key rows [T, head_dim] of attention inputs x [T, H] (after the attention norm) at positions
        start, start + 1, ...: the rows the block's window reads (keys equal values)."""
        attn = self.attn
        return attn.rope(attn.kv_norm(attn.kv(x)), start)

    def attn_input(self, streams):
        """streams [T, hc, H] -> (the normed attention input [T, H], post, comb)."""
        return self.hc_attn.pre(streams, self.attn_norm)

    def run(self, streams, start, context, mask=None):
        """The block on streams [T, hc, H] at positions start, ...; queries read `context` rows [S, hd]
        and the block's own T rows, where `mask` [T, S + T] (None: all of them). -> (streams, own rows)."""
        x, post, comb = self.attn_input(streams)
        attn = self.attn
        _, q, kv = attn._project(x, start, False)
        keys = mx.concatenate([context.astype(kv.dtype), kv]) if context is not None else kv
        T = x.shape[0]
        f32 = mx.float32
        keys = mx.broadcast_to(keys.astype(f32)[None], (T,) + keys.shape)
        out = attend(q.astype(f32), keys, mask, attn.sinks.astype(f32), attn.head_dim ** -0.5)
        streams = HyperConnection.post(attn._project_out(out, start), streams, post, comb)
        x, post, comb = self.hc_ffn.pre(streams, self.ffn_norm)
        out = self.ffn(x, None)
        return HyperConnection.post(out, streams, post, comb), kv


def window_mask(query_positions, key_positions, window):
    """Causal sliding-window visibility [T, K]: a query sees keys within `window` positions up to itself."""
    q, k = mx.array(query_positions)[:, None], mx.array(key_positions)[None, :]
    return (k <= q) & (k > q - window)
