"""Attention with sinks over a sliding window of raw rows plus compressed rows (all of them, or those the
indexer picks), in two parts: `project` reads no cache, `attend` reads and writes one session's arrays."""

import mlx.core as mx
import mlx.nn as nn

from ds4_mlx.cache.geometry import window_reach
from ds4_mlx.cache.slots import BatchSlots, RingSlots, Slots
from ds4_mlx.models.args import CSA, SLIDING, ModelArgs
from ds4_mlx.models.compiling import compiled
from ds4_mlx.models.compressor import Compressor, Indexer
from ds4_mlx.models.kernels import (attend, decode_attention, fp4_rounding, fused_decode_attention, index_top_rows,
                                    kv_rounding, logged_rows, norm_rope, norm_rope_pair)
from ds4_mlx.models.linear import GroupedLinear, Linear, pair_product
from ds4_mlx.models.numerics import Rope, counting, hadamard, write_rows


INDEXER_TILE_BYTES = 1 << 28
# a step of this many tokens or fewer (a verify's drafts) attends in the decode kernel where it runs: each
# token reads its own keys, where the plain path would gather every token's window and rows
FUSED_ROWS = 16


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.args = args
        self.kind = args.layer_type(layer_id)
        self.ratio = args.compress_ratios[layer_id]
        H, nh, hd = args.hidden_size, args.num_attention_heads, args.head_dim
        self.n_heads, self.head_dim = nh, hd
        self.q_a = Linear(H, args.q_lora_rank)
        self.q_a_norm = nn.RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.q_b = Linear(args.q_lora_rank, nh * hd)
        self.kv = Linear(H, hd)
        self.kv_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.sinks = mx.zeros((nh,))
        self.o_a = GroupedLinear(args.o_groups, nh * hd // args.o_groups, args.o_lora_rank)
        self.o_b = Linear(args.o_groups * args.o_lora_rank, H)
        if self.kind == SLIDING:
            self.rope = Rope(args.qk_rope_head_dim, args.rope_theta)
        else:
            self.rope = Rope(args.qk_rope_head_dim, args.compress_rope_theta, args.rope_scaling)
            self.compressor = Compressor(args, self.ratio, hd)
        if self.kind == CSA:
            self.indexer = Indexer(args)

    def project(self, x, positions, in_blocks, selecting, quant_sim):
        """What the step's tokens compute from themselves alone, reading no cache (so the tokens of several
        sessions run it together): x [N, H] at `positions` [N], `in_blocks` [N] their offsets in their
        compressed blocks; `selecting`: some session's indexer picks its rows. -> rows by name, [N, ...] each."""
        qr, q, kv = self._project(x, positions, not quant_sim)
        rows = {"q": q, "kv": self._store_kv(kv, quant_sim)}
        if self.kind == SLIDING:
            return rows
        selecting = selecting and self.kind == CSA
        rows["frontier"], *indexer = self._logged(x, in_blocks, selecting)
        if self.kind == CSA:
            rows["index_frontier"] = indexer[0]
            if selecting:
                rows["index_q"], rows["index_w"] = self._index_query(qr, positions, quant_sim), indexer[1]
        return rows

    def _logged(self, x, in_blocks, selecting):
        """What the compressors log of x (`Compressor.project`) and, where the indexer selects, its head
        weights: one launch on CUDA for a few tokens (`kernels.logged_rows`)."""
        compressors = [self.compressor] + ([self.indexer.compressor] if self.kind == CSA else [])
        maps = [(c.kv_gate, c.ape) for c in compressors]
        maps += [(self.indexer.proj, self._index_scale)] if selecting else []
        logged = logged_rows(x, in_blocks, [(_plain_weight(layer), extra) for layer, extra in maps])
        if logged is not None:
            return logged
        head_weights = [self.indexer.proj(x).astype(mx.float32) * self._index_scale] if selecting else []
        return [c.project(x, in_blocks) for c in compressors] + head_weights

    def attend(self, rows, steps, quant_sim, attend_one):
        """Each session's cache part of the step (`attend_one`: `_attend_one` or its compiled graph) on its
        own rows of `rows` (`project`'s). -> (outputs [N, nh, hd] with RoPE still on, each session's arrays
        written)."""
        T = steps[0][0].tokens
        outs, written = [], []
        for b, (slots, arrays) in enumerate(steps):
            mine = {name: r[b * T : (b + 1) * T] for name, r in rows.items()} if len(steps) > 1 else rows
            out, arrays = attend_one(mine, slots, arrays, quant_sim)
            outs.append(out)
            written.append(arrays)
        return mx.concatenate(outs) if len(outs) > 1 else outs[0], written

    def _attend_one(self, rows, slots: Slots, arrays, quant_sim):
        """One session's part of a step: write its rows into its cache arrays and attend over its window and
        compressed rows. -> (attention output [T, nh, hd] with RoPE still on, the arrays written)."""
        arrays = dict(arrays)
        ring = arrays["raw"]  # read before the write: a decoded token's window reads it in place
        kv = rows["kv"].astype(ring.dtype)
        arrays["raw"] = write_rows(ring, slots.raw.write, kv[kv.shape[0] - slots.raw.write.shape[0] :])
        compressed = selected = None
        if self.kind != SLIDING:
            compressed = self._compress(self.compressor, rows["frontier"], slots, slots.frontier, arrays, "frontier",
                                        "rows", lambda r: self._store_kv(r, quant_sim))
            if self.kind == CSA:
                index_rows = self._compress(self.indexer.compressor, rows["index_frontier"], slots,
                                            slots.index_frontier, arrays, "index_frontier", "index_rows",
                                            _index_rounding(quant_sim))
                if slots.selecting:
                    selected = self._top_rows(rows["index_q"], rows["index_w"], index_rows, slots.visible)
        if slots.tokens == 1 or slots.tokens <= FUSED_ROWS and fused_decode_attention(self.head_dim):
            # a decoded token, or a verify's rows: the fused kernel reads the window from the ring in place
            return decode_attention(rows["q"], ring, kv, compressed, selected, slots.positions, self.sinks,
                                    slots.window, self.ratio, slots.visible, slots.picks,
                                    consecutive=slots.tokens > 1), arrays
        window = mx.concatenate([ring[slots.raw.read], kv])  # the raw rows from start - (W - 1) on
        return self._attend_rows(rows["q"], window, compressed, selected, slots), arrays

    _compiled_attend_one = compiled(_attend_one)

    def attend_batch(self, rows, slots: BatchSlots, arrays, quant_sim):
        """`_attend_one` for one decoded token of each of B sessions, on their pooled arrays (flat [S * rows,
        width], row `slots.pool_rows[b]` of the pool token b's session's: `cache/pool.py`) in launches that do
        not grow with B; each row's numbers are those of the session's own step. -> (outputs [B, nh, hd] with
        RoPE still on, the arrays written)."""
        arrays = dict(arrays)
        ring = arrays["raw"]  # read before the write, as `_attend_one` does
        kv = rows["kv"].astype(ring.dtype)
        arrays["raw"] = write_rows(ring, slots.raw_write, kv)
        compressed = selected = None
        if self.kind != SLIDING:
            compressed = self._compress_each(self.compressor, rows["frontier"], slots, slots.frontier_write,
                                             slots.frontier_block, arrays, "frontier", "rows",
                                             lambda r: self._store_kv(r, quant_sim))
            if self.kind == CSA:
                index_rows = self._compress_each(self.indexer.compressor, rows["index_frontier"], slots,
                                                 slots.index_write, slots.index_block, arrays, "index_frontier",
                                                 "index_rows", _index_rounding(quant_sim))
                if slots.selecting:
                    selected = self._top_rows(rows["index_q"], rows["index_w"], index_rows, slots.visible,
                                              (slots.pool_rows, slots.own_rows))
        out = decode_attention(rows["q"], ring, kv, compressed, selected, slots.positions, self.sinks,
                               self.args.sliding_window, self.ratio, slots.visible, slots.picks, slots.pool_rows,
                               per_session=(slots.raw_capacity, slots.buffer_rows))
        return out, arrays

    _compiled_attend_batch = compiled(attend_batch)

    def _compress_each(self, compressor, fresh, slots: BatchSlots, write, block, arrays, ring, buffer, rounding):
        """`_compress` for one token of each session: pool every session's open block (rows of positions
        still to come are junk) and write it as the block's row, which is read only once the block is
        complete (so no graph depends on which sessions complete one). -> the pooled buffer [S * rows, width]."""
        arrays[ring], finished = compressor.step_each(fresh, arrays[ring], write, block, slots.in_blocks,
                                                      slots.open_row, self.rope)
        arrays[buffer] = write_rows(arrays[buffer], slots.row_write, rounding(finished))
        return arrays[buffer]

    def _attend_rows(self, q, window, compressed, selected, slots: Slots):
        """Each token's heads q [T, nh, hd] over its window (from `window`: the raw rows of positions
        start - (W - 1) on) and its compressed rows (`selected` ones, else all visible). -> [T, nh, hd]"""
        T, W = slots.tokens, slots.window
        reach = counting(T)[:, None] + counting(W)[None, :]  # [T, W] into `window`
        keys = [window[reach] if T > 1 else window[None]]
        masks = [(slots.positions[:, None] - window_reach(W) + counting(W)[None, :]) >= 0]
        visible = None if compressed is None else slots.visible[:, None]
        if selected is not None:
            keys.append(compressed[selected])
            masks.append(selected < visible)
        elif compressed is not None:
            keys.append(mx.broadcast_to(compressed[None], (T,) + compressed.shape))
            masks.append(counting(compressed.shape[0])[None, :] < visible)
        f32 = mx.float32  # scores and softmax in float32 (head_dim 512 loses too much in half precision)
        keys = mx.concatenate(keys, axis=1) if len(keys) > 1 else keys[0]
        return attend(q.astype(f32), keys.astype(f32), mx.concatenate(masks, axis=1) if len(masks) > 1 else masks[0],
                      self.sinks.astype(f32), self.head_dim ** -0.5)

    def _compress(self, compressor, fresh, slots: Slots, at: RingSlots, arrays, ring, buffer, rounding):
        """A compressor's part of a step on the named arrays: log its rows, pool the blocks the step
        completes into finished rows of `buffer`. -> the buffer's first `slots.rows` rows (rows from a
        token's visible count on are not valid for it)."""
        rows = slots.first_row + counting(slots.pooled) if slots.pooled else None
        arrays[ring], finished = compressor.step(fresh, arrays[ring], at, rows, self.rope)
        if finished is not None:
            arrays[buffer] = write_rows(arrays[buffer], rows, rounding(finished))
        return arrays[buffer][: slots.rows]

    def _store_kv(self, kv, quant_sim):
        """kv rows [n, hd] as the cache holds them: under `quant_sim`, ds4's rounding (in float16, the cache's
        dtype then; one launch on CUDA for a few rows)."""
        if not quant_sim:
            return kv
        return kv_rounding(kv, self.head_dim - self.args.qk_rope_head_dim, mx.float16)

    @compiled
    def _project(self, x, positions, kv_in_float32):
        """-> (q_a output [T, q_lora_rank], queries [T, nh, hd], kv rows [T, hd]) at `positions` [T]; the kv
        rows in float32 where `kv_in_float32` (rounded to x's dtype all the same: the ring's dtype without
        quant_sim, whose rounding takes them as they are)."""
        T = x.shape[0]
        low, kv = pair_product(self.q_a, self.kv, x)
        qr = self.q_a_norm(low)
        nh, hd = self.n_heads, self.head_dim
        q, kv = norm_rope_pair(self.q_b(qr), kv, self.rope, positions, hd, (None, self.args.rms_norm_eps),
                               (self.kv_norm.weight, self.kv_norm.eps), shape=(T, nh, hd),
                               dtype2=mx.float32 if kv_in_float32 else None)
        return qr, q, kv

    @compiled
    def _project_out(self, out, positions):
        """Attention output [T, nh, hd] (RoPE still on) -> [T, H], in the compute dtype."""
        T, G = out.shape[0], self.args.o_groups
        out = norm_rope(out, self.rope, positions, self.head_dim, inverse=True, shape=(T, G, out.size // (T * G)),
                        dtype=self.q_a_norm.weight.dtype)
        low = self.o_a(out)  # each head group has its own projection
        return self.o_b(low.reshape(T, -1))

    @property
    def _index_scale(self):
        return (self.indexer.head_dim * self.indexer.n_heads) ** -0.5

    def _index_query(self, qr, positions, quant_sim):
        """The indexer's queries [T, heads, dim] of tokens at `positions`."""
        idx = self.indexer
        T = qr.shape[0]
        qi = norm_rope(idx.q_b(qr), self.rope, positions, idx.head_dim, shape=(T, idx.n_heads, idx.head_dim),
                       dtype=mx.float32)
        return _index_rounding(quant_sim)(qi)

    def _top_rows(self, qi, w, index_rows, visible, pooled=None):
        """The index_topk rows of `index_rows` [C, dim] with the highest scores for each query (`_index_query`),
        rows at or past `visible` [T] excluded. `pooled`: (pool_rows [T], own_rows [T, C]) where `index_rows`
        is a pool's flat buffer, each query's rows its session's. Two launches on CUDA for a few queries."""
        idx, args = self.indexer, self.args
        T = qi.shape[0]
        pool_rows, own_rows = pooled or (None, None)
        C = index_rows.shape[0] if own_rows is None else own_rows.shape[1]
        picked = index_top_rows(qi, w, index_rows, visible, args.index_topk, pool_rows, C)
        if picked is not None:
            return picked
        if own_rows is not None:
            index_rows = index_rows[own_rows]  # [T, C, dim]
        visible = visible[:, None]
        # ReLU per head, weighted over heads; in tiles of rows so [T, heads, rows] stays ~256 MB
        tile = max(1, INDEXER_TILE_BYTES // (4 * T * idx.n_heads))
        scores = mx.concatenate([(w[:, None, :] @ mx.maximum(qi @ index_rows[..., i : i + tile, :].swapaxes(-1, -2),
                                                             0))[:, 0]
                                 for i in range(0, C, tile)], axis=1)  # [T, C]
        scores = mx.where(counting(C)[None, :] < visible, scores, -mx.inf)
        # a stable sort, not a partition: the choice and its order (ties to the lower row) are the same
        # whatever rows past the visible ones there are, so a session's rows in a pool choose as it does alone
        return mx.argsort(-scores, axis=-1)[:, : args.index_topk]


def _plain_weight(layer):
    """A dense float layer's weight [out, in] as the file holds it (row-contiguous, no copy), or None for a
    quantized one."""
    return layer.weight if isinstance(layer, Linear) else None


def _index_rounding(quant_sim):
    """What the indexer's rows and queries go through before they are used: under `quant_sim` (ds4's) FP4
    after a Hadamard transform, then float16; the rounding one launch on CUDA for a few tokens."""
    return (lambda r: fp4_rounding(hadamard(r))) if quant_sim else (lambda r: r)
