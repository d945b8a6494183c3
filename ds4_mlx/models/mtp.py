"""The one-block MTP drafter of the original DeepSeek V4 Flash release (the official `MTPBlock`; ds4's
`DeepSeek-V4-Flash-MTP-*.gguf`).

At position p it reads the target's final HC state at p (before the HC head) and the token at p + 1,
and predicts the token at p + 2: x = e_proj(enorm(embed(token))) + h_proj(hnorm(state)) on every HC
stream, then a window-only V4 block, its own HC head, `norm`, and the target's LM head. Drafts after the
first feed the block's own output streams back in. Its window holds the committed positions' rows,
made again each round from the session's tap log (`draft_block.DraftBlock`).
"""

import mlx.core as mx
import mlx.nn as nn

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.draft_block import DraftBlock, sanitized, window_mask
from ds4_mlx.models.hyper import HyperHead
from ds4_mlx.models.linear import Linear, held_transposed


class MTP(nn.Module):
    kind = "mtp"

    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.args = args
        self.enorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.e_proj = Linear(H, H)
        self.h_proj = Linear(H, H)
        self.block = DraftBlock(args)
        self.hc_head = HyperHead(args)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    tap_keys = ["final"]

    @property
    def tap_width(self):
        return self.args.hc_mult * self.args.hidden_size

    def tap_rows(self, taps):
        final = taps["final"]
        return final.reshape(final.shape[0], -1)

    def inputs(self, target, tokens, states):
        """Block input streams [T, hc, H] for tokens [T] following the target states [T, hc, H]."""
        dtype = self.block.attn_norm.weight.dtype  # the compute dtype
        e = self.e_proj(self.enorm(target.embed(mx.array(tokens, dtype=mx.int32)).astype(dtype)))
        h = self.h_proj(self.hnorm(states.astype(dtype)))
        return (e[:, None, :] + h).astype(mx.float32)

    def forward(self, target, tokens, states, start, context=None):
        """Positions start, ... (token at p + 1 after state at p), causal over `context` rows [S, hd] of
        positions context_start, ..., start - 1 and themselves, within the window. -> (logits [T, vocab],
        output streams [T, hc, H], the block's rows [T, hd])."""
        streams = self.inputs(target, tokens, states)
        T, W = streams.shape[0], self.args.sliding_window
        S = 0 if context is None else context.shape[0]
        keys = list(range(start - S, start)) + list(range(start, start + T))
        mask = window_mask(list(range(start, start + T)), keys, W)
        out, rows = self.block.run(streams, start, context, mask)
        x = self.norm(self.hc_head(out).astype(self.norm.weight.dtype))
        return target.lm_head(x).astype(mx.float32), out, rows

    def context_rows(self, target, tokens, states, start):
        """The window's key rows for committed positions start, ... (no attention, no MoE)."""
        x, _, _ = self.block.attn_input(self.inputs(target, tokens, states))
        return self.block.context_rows(x, start)

    def draft(self, target, anchor, context, context_start, choose, k, committed_tokens=()):
        """Up to k drafts after `anchor` (the token at the position after the session's last). `context`:
        tap rows of positions context_start, ..., the last one the session's last position's state;
        `committed_tokens` the session's tokens. -> (tokens, logits each was chosen from [n, vocab], None: no
        confidence head)."""
        S = context.shape[0]
        if S == 0 or k <= 0:
            return [], None, None
        states = context.reshape(S, self.args.hc_mult, self.args.hidden_size)
        last = context_start + S - 1  # the position whose state is followed by the anchor
        rows = None
        if S > 1:  # committed pairs (state at p, token at p + 1) before the anchor's
            rows = self.context_rows(target, committed_tokens[context_start + 1 : last + 1], states[:-1], context_start)
        state, token, pos, tokens, logits = states[-1:], int(anchor), last, [], []
        for _ in range(k):
            out_logits, state, row = self.forward(target, [token], state, pos, rows)
            token = int(choose(out_logits[0]))
            tokens.append(token)
            logits.append(out_logits[0])
            rows = row if rows is None else mx.concatenate([rows, row])
            if rows.shape[0] >= self.args.sliding_window:  # what the next position's window no longer reads
                rows = rows[1:]
            pos += 1
        return tokens, mx.stack(logits), None

    def sanitize(self, weights):
        return held_transposed(self, sanitized(weights, self.args, ["block"]))
