"""The DSpark drafter of DeepSeek V4 Flash (DeepSeek's "Confidence-Scheduled Speculative Decoding with
Semi-Autoregressive Generation"; the drafter of V4 Flash 0731).

Three stages, each a full V4 block (`DraftBlock`). The context is the target's residual streams at
`target_layer_ids` (each averaged over its HC copies, concatenated), through stage 0's `main_proj` and
`main_norm`; every stage turns it into its own window of key rows (wkv, kv norm, RoPE at the context's
positions). A draft block [anchor, noise x (block_size - 1)] at the positions after the context reads
the window and itself, bidirectionally; the last stage's `hc_head`, `norm` and the target's LM head give
`block_size` base logits. A Markov head adds `markov_w2(markov_w1[previous token])` left to right, and a
confidence head scores each position.

The streams are tapped where mlx-vlm 0.7.10 taps them (the streams leaving each target layer), whose
implementation the tests compare against.
"""

from dataclasses import asdict, dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.draft_block import DraftBlock, sanitized
from ds4_mlx.models.hyper import HyperHead
from ds4_mlx.models.linear import Linear, held_transposed


@dataclass
class DSparkArgs:
    block_size: int = 5
    markov_rank: int = 256
    noise_token_id: int = 128799
    target_layer_ids: list = field(default_factory=lambda: [40, 41, 42])
    stage_count: int = 3

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class DSparkStage(DraftBlock):
    def __init__(self, args: ModelArgs, dspark: DSparkArgs, first: bool, last: bool):
        super().__init__(args)
        H = args.hidden_size
        if first:
            self.main_proj = Linear(H * len(dspark.target_layer_ids), H)
            self.main_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if last:
            self.hc_head = HyperHead(args)
            self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)


class MarkovHead(nn.Module):
    def __init__(self, vocab, rank):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, vocab)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden, rank):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=True)


class DSpark(nn.Module):
    kind = "dspark"

    def __init__(self, args: ModelArgs, dspark: DSparkArgs):
        super().__init__()
        if dspark.stage_count < 1 or dspark.block_size < 1 or not dspark.target_layer_ids:
            raise ValueError(f"DSpark needs stages, a block and target layers, got {dspark}")
        bad = [i for i in dspark.target_layer_ids if not 0 <= i < args.num_hidden_layers]
        if bad:
            raise ValueError(f"DSpark reads target layer {bad[0]}, but the target has {args.num_hidden_layers} layers")
        self.args, self.dspark = args, dspark
        n = dspark.stage_count
        self.stages = [DSparkStage(args, dspark, s == 0, s == n - 1) for s in range(n)]
        self.markov_head = MarkovHead(args.vocab_size, dspark.markov_rank)
        self.confidence_head = ConfidenceHead(args.hidden_size, dspark.markov_rank)

    # what the session records for it (`TapLog`)
    @property
    def tap_keys(self):
        return list(self.dspark.target_layer_ids)

    @property
    def tap_width(self):
        return self.args.hidden_size * len(self.dspark.target_layer_ids)

    def tap_rows(self, taps):
        """The target's streams at the tapped layers -> rows [T, layers * H]: each averaged over its HC copies."""
        return mx.concatenate([taps[i].mean(axis=1) for i in self.dspark.target_layer_ids], axis=-1)

    def block_hidden(self, target, anchor, context, context_start, block=None):
        """The draft block after the stages: (its HC-head output [block, H] before the final norm).

        `context` [S, layers * H]: tap rows of positions context_start, ..., ending just before the anchor's
        position (context_start + S); the block sits at the positions from there."""
        block = block or self.dspark.block_size
        first, last = self.stages[0], self.stages[-1]
        dtype = first.attn_norm.weight.dtype
        start = context_start + context.shape[0]
        main = first.main_norm(first.main_proj(context.astype(dtype))) if context.shape[0] else None
        ids = mx.array([int(anchor)] + [self.dspark.noise_token_id] * (block - 1), dtype=mx.int32)
        embedded = target.embed(ids).astype(mx.float32)
        streams = mx.broadcast_to(embedded[:, None, :], (block, self.args.hc_mult, self.args.hidden_size))
        for stage in self.stages:
            rows = stage.context_rows(main, context_start) if main is not None else None
            streams, _ = stage.run(streams, start, rows)
        return last.hc_head(streams)

    def base_logits(self, target, hidden):
        last = self.stages[-1]
        return target.lm_head(last.norm(hidden.astype(last.norm.weight.dtype))).astype(mx.float32)

    def markov_bias(self, previous):
        """The Markov head's logit bias after `previous` tokens (ints or an int array)."""
        e = self.markov_head.markov_w1(mx.array(previous, dtype=mx.int32).reshape(-1))
        return self.markov_head.markov_w2(e).astype(mx.float32)

    def confidence(self, hidden, previous):
        """Per position, sigmoid(proj([HC-head output ; markov_w1[previous token]]))."""
        e = self.markov_head.markov_w1(mx.array(previous, dtype=mx.int32).reshape(-1))
        features = mx.concatenate([hidden.astype(mx.float32), e.astype(mx.float32)], axis=-1)
        return mx.sigmoid(self.confidence_head.proj(features.astype(self.confidence_head.proj.weight.dtype))
                          .astype(mx.float32)[:, 0])

    def draft(self, target, anchor, context, context_start, choose, k, committed_tokens=()):
        """Up to k drafts after `anchor`: `choose(logits [vocab]) -> token` picks each one (argmax, or a
        draw) from the base logits plus the Markov bias of the token before it. -> (tokens, the logits
        each was chosen from [n, vocab], confidences [n])."""
        k = min(k, self.dspark.block_size)
        hidden = self.block_hidden(target, anchor, context, context_start)
        base = self.base_logits(target, hidden)
        tokens, rows, previous = [], [], int(anchor)
        for i in range(k):
            row = base[i] + self.markov_bias([previous])[0]
            previous = int(choose(row))
            tokens.append(previous)
            rows.append(row)
        conf = self.confidence(hidden[:k], [int(anchor)] + tokens[:-1])
        return tokens, mx.stack(rows), conf

    def sanitize(self, weights):
        out = sanitized(weights, self.args, [f"stages.{s}" for s in range(len(self.stages))])
        out.setdefault("confidence_head.proj.bias", mx.zeros((1,)))
        return held_transposed(self, out)
