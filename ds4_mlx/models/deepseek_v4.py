"""DeepSeek V4 Flash in MLX: the decoder layer and the model, one forward over [B, T] tokens.

The blocks live in sibling modules, one idea each (docs/ARCHITECTURE.md walks through them in the order
of a layer): hyper-connections (`hyper`), attention (`attention`) with its compressor and indexer
(`compressor`), the MoE (`moe`). The model changes no cache: it takes each layer's `Slots` and arrays
and returns the arrays it wrote, which the cache commits."""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ds4_mlx.cache.slots import BatchSlots
from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.attention import Attention
from ds4_mlx.models.compiling import compiled
from ds4_mlx.models.hyper import HyperConnection, HyperHead
from ds4_mlx.models.linear import Embedding, Linear, held_transposed
from ds4_mlx.models.moe import FEW_PAIRS, MoE
from ds4_mlx.precision import exact_float32, keeps_float32


# tokens a session's step may have to run as a compiled graph: a decoded token, or a verify of a few drafts
COMPILED_TOKENS = 8


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_attn = HyperConnection(args)
        self.hc_ffn = HyperConnection(args)
        self.attn = Attention(args, layer_id)
        self.ffn = MoE(args, layer_id)
        self.few_rows = max(1, FEW_PAIRS // args.num_experts_per_tok)

    def __call__(self, streams, ids, positions, steps, quant_sim):
        """streams [B * T, hc, H] (float32) of T tokens of each of B sessions, their ids and `positions`
        [B * T]; `steps`: each session's (`Slots`, arrays) of this layer (`LayerCache.view`). -> (streams,
        each session's arrays written). A few rows of a few tokens each (decoded tokens, a verify of drafts)
        run as compiled graphs: one for one session; for several, one for what reads no cache and one for
        each session's cache part (a graph over all of them would be traced anew for every mix of their
        steps). Longer steps run as plain MLX: a graph is traced for every length, and prompts end anywhere.
        `steps` may instead be one (`BatchSlots`, pooled arrays) pair: one token of each session against a
        pool of their caches (`cache/pool.py`), whose cache part is one compiled graph for all of them. ->
        (streams, the pooled arrays written)."""
        if isinstance(steps[0], BatchSlots):
            return self._pooled_step(streams, ids, positions, *steps, quant_sim)
        if steps[0][0].tokens > COMPILED_TOKENS or streams.shape[0] >= self.few_rows:
            return self._step(streams, ids, positions, steps, quant_sim)
        if len(steps) == 1:
            return self._compiled_step(streams, ids, positions, steps, quant_sim)
        post, comb, rows = self._compiled_enter(streams, positions, _in_blocks(steps),
                                                any(s.selecting for s, _ in steps), quant_sim)
        out, written = self.attn.attend(rows, steps, quant_sim, self.attn._compiled_attend_one)
        return self._compiled_leave(out, positions, streams, post, comb, ids), written

    def _pooled_step(self, streams, ids, positions, slots, arrays, quant_sim):
        few = streams.shape[0] < self.few_rows
        enter, leave = (self._compiled_enter, self._compiled_leave) if few else (self._enter, self._leave)
        post, comb, rows = enter(streams, positions, slots.in_blocks, slots.selecting, quant_sim)
        out, written = self.attn._compiled_attend_batch(rows, slots, arrays, quant_sim)
        return leave(out, positions, streams, post, comb, ids), written

    def _step(self, streams, ids, positions, steps, quant_sim):
        post, comb, rows = self._enter(streams, positions, _in_blocks(steps), any(s.selecting for s, _ in steps),
                                       quant_sim)
        out, written = self.attn.attend(rows, steps, quant_sim, self.attn._attend_one)
        return self._leave(out, positions, streams, post, comb, ids), written

    def _enter(self, streams, positions, in_blocks, selecting, quant_sim):
        """Up to the cache: HC pre with the norm, `Attention.project`."""
        x, post, comb = self.hc_attn.pre(streams, self.attn_norm)
        return post, comb, self.attn.project(x, positions, in_blocks, selecting, quant_sim)

    def _leave(self, out, positions, streams, post, comb, ids):
        """From the attention outputs on: the output projection, HC post, the MoE, HC post."""
        streams, mix = HyperConnection.post(self.attn._project_out(out, positions), streams, post, comb,
                                            then=self.hc_ffn)
        x, post, comb = self.hc_ffn.pre(streams, self.ffn_norm, mix)
        out = self.ffn(x, ids)
        return HyperConnection.post(out, streams, post, comb)

    _compiled_step = compiled(_step)
    _compiled_enter = compiled(_enter)
    _compiled_leave = compiled(_leave)


def _in_blocks(steps):
    """The sessions' tokens' offsets in their compressed blocks, in row order (None without compression)."""
    if steps[0][0].in_blocks is None or len(steps) == 1:
        return steps[0][0].in_blocks
    return mx.concatenate([s.in_blocks for s, _ in steps])


class Model(nn.Module):
    takes_pools = True  # `forward` takes a pool's views of B sessions' caches (`cache/pool.py`)

    def __init__(self, args: ModelArgs, quant_sim: bool = True, layers: Optional[range] = None):
        """`layers`: hold only this contiguous range of the decoder layers (one stage of a pipeline over
        several machines, `ds4_mlx.distributed`), as `layers.0` on; the embedding comes with the first
        layer, the head with the last. By default, all of them."""
        super().__init__()
        self.args, self.quant_sim = args, quant_sim
        self.layer_range = range(args.num_hidden_layers) if layers is None else layers
        if self.layer_range.start == 0:
            self.embed = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in self.layer_range]
        if self.layer_range.stop == args.num_hidden_layers:
            self.hc_head = HyperHead(args)
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            self.lm_head = Linear(args.hidden_size, args.vocab_size)

    def make_cache(self, *, history=0, frontier_history=None):
        """Per-layer caches; `history` extra positions kept so rewinds of that many tokens are free
        (`frontier_history` of them for the compressor inputs). Rows rounded to float16 by `quant_sim`
        are stored as float16."""
        from ds4_mlx.cache.layers import make_caches

        held = self.layer_range
        return make_caches(self.args, history=history, frontier_history=frontier_history,
                           row_dtype=mx.float16 if self.quant_sim else mx.float32)[held.start : held.stop]

    def forward(self, ids, views, *, last_only=False, taps=None):
        """The one forward: ids int32 [B, T], T tokens of each of B sessions; `views`: each session's
        per-layer (`Slots`, arrays) (`LayerCache.view(T)`). Prefill chunks (B = 1), decoded tokens (T = 1),
        a verify of drafted tokens and batched streams are all this. Changes no cache: -> (logits
        [B, T, vocab] float32 (or [B, 1, vocab] with `last_only`), each session's per-layer arrays written,
        for `LayerCache.commit`).

        `taps`: None, or a dict whose keys name residual streams a drafter reads (speculative decoding):
        a layer index i (the streams leaving layer i) or "final" (leaving the last layer, before the HC
        head); the forward sets each key to those streams, [B * T, hc, H] float32, for every row.

        `views` may instead be a pool's (`cache/pool.py`: each layer's `BatchSlots` and pooled arrays, T = 1):
        the arrays written are then each layer's pooled arrays, for `Pool.commit`."""
        return run_to_end(self.forward_steps(ids, views, last_only=last_only, taps=taps))

    def forward_steps(self, ids, views, *, last_only=False, layers_per_step=None, taps=None):
        """`forward` as a generator: with `layers_per_step`, it evaluates the layers so far and yields after
        every that many layers (a server runs other streams' tokens in between; the arithmetic is the same
        as in one piece). Its return value is `forward`'s."""
        B, T = ids.shape
        flat = ids.reshape(-1)
        pooled = isinstance(views[0][0], BatchSlots)
        if pooled:
            positions = views[0][0].positions
        else:
            positions = mx.concatenate([v[0][0].positions for v in views]) if B > 1 else views[0][0][0].positions
        streams = self._streams(flat)
        written = [] if pooled else [[] for _ in views]
        for i, layer in enumerate(self.layers):
            if pooled:
                streams, arrays = layer(streams, flat, positions, views[i], self.quant_sim)
                written.append(arrays)
            else:
                streams, steps = layer(streams, flat, positions, [v[i] for v in views], self.quant_sim)
                for mine, step in zip(written, steps):
                    mine.append(step)
            if taps is not None and i in taps:
                taps[i] = streams
            if layers_per_step and (i + 1) % layers_per_step == 0 and i + 1 < len(self.layers):
                mx.eval(streams, written)
                yield
        if taps is not None and "final" in taps:
            taps["final"] = streams
        if last_only and T > 1:  # one token a row: its streams are the last already (no views)
            streams = streams.reshape(B, T, *streams.shape[1:])[:, -1]
        return self._logits(streams).reshape(B, -1, self.args.vocab_size), written

    def __call__(self, inputs, cache=None, *, last_only=False, taps=None):
        """inputs int32 [1, T] after the tokens `cache` holds (a fresh cache when None); returns logits
        [1, T, vocab] (or [1, 1, vocab] with last_only). `forward` with the cache's view and commit."""
        if cache is None:
            cache = self.make_cache()
        logits, written = self.forward(inputs, [[c.view(inputs.shape[1]) for c in cache]], last_only=last_only,
                                       taps=taps)
        for c, arrays in zip(cache, written[0]):
            c.commit(arrays, inputs.shape[1])
        return logits

    def _streams(self, ids):

        """Token ids [T] -> the residual streams [T, hc, H], float32 (the exact mode first switches off
        TF32 for its float32 products: `ds4_mlx.precision`)."""
        if not self.quant_sim and self.layers[0].attn_norm.weight.dtype == mx.float32:
            exact_float32()
        embedded = self.embed(ids).astype(mx.float32)
        # laid out once: the first HC pre flattens the streams and its kernel reads them row-contiguous, and a
        # broadcast would be copied for each
        return mx.contiguous(mx.broadcast_to(embedded[:, None, :], (ids.shape[0], self.args.hc_mult,
                                                                    self.args.hidden_size)))

    def _logits(self, streams):
        """Residual streams [T, hc, H] -> logits [T, vocab], float32."""
        x = self.norm(self.hc_head(streams).astype(self.norm.weight.dtype))
        return self.lm_head(x).astype(mx.float32)

    def cast(self, dtype):
        """Compute in `dtype` (bfloat16 or float16), but for the parameters `keeps_float32` names."""
        self.update(tree_unflatten([(k, v.astype(mx.float32 if keeps_float32(k) else dtype))
                                    for k, v in tree_flatten(self.parameters())
                                    if mx.issubdtype(v.dtype, mx.floating)]))
        return self

    # Weights -------------------------------------------------------------------------------
    def apply_quantization(self, quantization: dict):
        """Swap the modules named in `quantization` ({path: {group_size, bits, mode}}) for quantized ones."""
        if quantization:
            nn.quantize(self, class_predicate=lambda path, m: quantization.get(path, False))

    def sanitize(self, weights: dict) -> dict:
        """Reshape the grouped output projection to [groups, rank, in]; stack each compressor's kv and gate
        matrices and put zeros before its score offsets (see `Compressor`); default the optional router bias;
        hold the `TransposedLinear` weights transposed."""
        a = self.args
        out = dict(weights)
        for name, w in weights.items():
            if ".attn.o_a." in name and w.ndim == 2:
                out[name] = w.reshape(a.o_groups, -1, w.shape[-1])
            prefix = name[: -len("kv.weight")]
            if name.endswith("compressor.kv.weight") and prefix + "gate.weight" in out:
                out[prefix + "kv_gate.weight"] = mx.concatenate([out.pop(name), out.pop(prefix + "gate.weight")])
                if prefix + "ape" in out:
                    ape = out[prefix + "ape"]
                    out[prefix + "ape"] = mx.concatenate([mx.zeros_like(ape), ape], axis=-1)
        for held, i in enumerate(self.layer_range):
            if i >= a.num_hash_layers:
                out.setdefault(f"layers.{held}.ffn.bias", mx.zeros((a.n_routed_experts,)))
        for name in list(out):
            if name.endswith("tid2eid"):
                out[name] = out[name].astype(mx.int32)
        return held_transposed(self, out)


def run_to_end(steps):
    """Run a `forward_steps` generator through all its pieces; -> its return value (`forward`'s)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
