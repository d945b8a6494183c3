"""The mixture of experts: routing (top-k on biased scores, or fixed by the token id in hash layers), the
routed experts and the shared one."""

import os

import mlx.core as mx
import mlx.nn as nn

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.compiling import compiled
from ds4_mlx.models.kernels import (backend, clamped_swiglu, hashed_router, route_hashed, route_top_k,
                                    routed_experts, router)
from ds4_mlx.models.linear import (Linear, QuantizedSwitchLinear, SwitchLinear, gguf_expert_rows,
                                  plus_product, swiglu_product)


# routed-expert products for big batches: "gather" (sorted gather_qmm; GGUF experts off mlx-kquant: spans of
# experts dequantized at once, then sorted gather_mm) or "loop" (one product per expert); chosen per backend
# from measurements (docs/PERFORMANCE.md), DS4_MLX_EXPERT_PATH overrides
EXPERT_PATHS = {"cuda": "loop"}

# the most bytes one matrix's span of experts takes dequantized on the gather path of GGUF experts (a span's
# three matrices are alive at once; a stack within it is one span, which needs no sync); DS4_MLX_SPAN_BYTES
# overrides
SPAN_BYTES = 1 << 28


def expert_path():
    return os.environ.get("DS4_MLX_EXPERT_PATH") or EXPERT_PATHS.get(backend(), "gather")


def span_bytes():
    return int(os.environ.get("DS4_MLX_SPAN_BYTES") or SPAN_BYTES)


# token-expert pairs below which a MoE call is decode-sized: one compiled graph, the fused expert
# kernels, per-token expert products (no sort)
FEW_PAIRS = 64


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        E, H, I = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        self.args = args
        self.hashed = layer_id < args.num_hash_layers
        self.gate = Linear(H, E)
        if self.hashed:
            self.tid2eid = mx.zeros((args.vocab_size, args.num_experts_per_tok), mx.int32)
        else:
            self.bias = mx.zeros((E,))
        self.experts = {"gate": SwitchLinear(E, H, I), "up": SwitchLinear(E, H, I), "down": SwitchLinear(E, I, H)}
        shared = I * args.n_shared_experts
        self.shared = {"gate": Linear(H, shared), "up": Linear(H, shared), "down": Linear(shared, H)}

    def __call__(self, x, ids):
        if x.shape[0] * self.args.num_experts_per_tok < FEW_PAIRS:  # one compiled graph, no sync inside
            return self._compiled_forward(x, ids)
        return self._forward(x, ids)

    def _forward(self, x, ids):
        args = self.args
        chosen, weights = self._route(x, ids)
        y = self._fused_experts(x, chosen, weights)
        if y is None:  # GGUF experts' rows, each times its weight: the shared product's launch sums them
            y = gguf_expert_rows(self.experts, x, chosen, args.swiglu_limit, weights)
        if y is None:
            routed = self._experts(x, chosen)
            y = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)
        s = self.shared
        return plus_product(s["down"], swiglu_product(s["gate"], s["up"], x, args.swiglu_limit), y)

    _compiled_forward = compiled(_forward)

    def _route(self, x, ids):
        """-> (experts [T, k], their weights [T, k] float32): two kernels on CUDA for a few tokens, unless the
        router was quantized (then its own product, and the plain routing after it)."""
        args, gate = self.args, self.gate
        if not isinstance(gate, Linear):
            logits = gate(x.astype(mx.float32))
            if self.hashed:
                chosen = self.tid2eid[ids]
                return chosen, route_hashed(logits, chosen, args.routed_scaling_factor)
            return route_top_k(logits, self.bias, args.num_experts_per_tok, args.routed_scaling_factor)
        weight = gate.weight  # [E, H], as the file holds it
        if self.hashed:
            return hashed_router(x, weight, self.tid2eid, ids, args.routed_scaling_factor)
        return router(x, weight, self.bias, args.num_experts_per_tok, args.routed_scaling_factor)

    def _fused_experts(self, x, chosen, weights):
        """The routed experts' weighted sum in two kernels for a few tokens (CUDA, affine experts)."""
        e = self.experts
        if chosen.size >= FEW_PAIRS or not isinstance(e["gate"], QuantizedSwitchLinear):
            return None
        matrices = [e[name].packed() for name in ("gate", "up", "down")]
        if None in matrices:
            return None
        y = routed_experts(x, chosen, weights, *matrices, self.args.swiglu_limit)
        return None if y is None else y.astype(x.dtype)

    def _experts(self, x, chosen):
        """[T, H] with chosen experts [T, k] -> [T, k, H]; rows sorted by expert for big batches."""
        T, k = chosen.shape
        if T * k < FEW_PAIRS:
            return self._glu(x[:, None, None, :], chosen, False)[:, :, 0, :]
        flat = chosen.flatten()
        order = mx.argsort(flat)
        xs, idx = x[order // k], flat[order]
        if expert_path() == "loop":
            y = self._expert_loop(xs, idx)
        elif getattr(self.experts["gate"], "gathers", lambda dtype: True)(xs.dtype):
            y = self._glu(xs[:, None, :], idx, True)[:, 0, :]
        else:
            y = self._expert_spans(xs, idx)
        return y[mx.argsort(order)].reshape(T, k, -1)

    def _glu(self, xs, idx, sorted_):
        e, limit = self.experts, self.args.swiglu_limit
        h = clamped_swiglu(e["gate"](xs, idx, sorted_), e["up"](xs, idx, sorted_), limit)
        return e["down"](h, idx, sorted_)

    def _rows_per_expert(self, idx):
        """The sorted rows' count for each expert, read on the host (a sync)."""
        return mx.zeros((self.args.n_routed_experts,), mx.int32).at[idx].add(1).tolist()

    def _expert_loop(self, xs, idx):
        """One product per expert over its contiguous rows (CUDA's choice: when it was measured, `gather_qmm`
        did not batch an expert's rows)."""
        e, limit = self.experts, self.args.swiglu_limit
        counts = self._rows_per_expert(idx)
        # half-precision products get a kernel built per row count: round the rows up to a few sizes
        # (the extra rows are the next expert's, or zeros at the end, and their outputs are dropped)
        step = 16 if xs.dtype in (mx.bfloat16, mx.float16) else 1
        if step > 1:
            xs = mx.concatenate([xs, mx.zeros((step, xs.shape[-1]), xs.dtype)])
        outs, start = [], 0
        for i, n in enumerate(counts):
            if n:
                rows = xs[start : start + -(-n // step) * step]
                y = e["down"].one(clamped_swiglu(e["gate"].one(rows, i), e["up"].one(rows, i), limit), i)
                outs.append(y[:n] if step > 1 else y)
                start += n
        return mx.concatenate(outs)

    def _expert_spans(self, xs, idx):
        """GGUF experts a span at a time: each matrix's span of experts dequantized in one launch and the
        span's rows through it in one sorted gather product (a product per expert makes a chunk's graph
        thousands of nodes a layer). A stack that is one span needs no row counts, so no sync."""
        n = self.args.n_routed_experts
        width = max(1, span_bytes() // (self.experts["gate"].weight.shape[1] * xs.shape[-1] * xs.dtype.size))
        if width >= n:
            return self._span(xs[:, None, :], idx, 0, n)[:, 0, :]
        counts = self._rows_per_expert(idx)
        outs, start = [], 0
        for first in range(0, n, width):
            last = min(first + width, n)
            rows = sum(counts[first:last])
            if rows:
                outs.append(self._span(xs[start : start + rows, None, :], idx[start : start + rows] - first, first,
                                       last)[:, 0, :])
                start += rows
        return mx.concatenate(outs)

    def _span(self, x, at, first, last):
        """Rows x [P, 1, in] through the experts `at` [P] (sorted, counted from `first`) of the span first..last."""
        e = self.experts
        h = clamped_swiglu(e["gate"].span(x, at, first, last), e["up"].span(x, at, first, last),
                           self.args.swiglu_limit)
        return e["down"].span(h, at, first, last)
