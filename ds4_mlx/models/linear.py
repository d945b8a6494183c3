"""The linear layers and their quantized forms: dense, grouped (the attention's output projection), the
embedding, and the routed experts' stacks (MLX-quantized or the GGUF's own blocks); and when a quantized
dense product runs dequantized."""

import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ds4_mlx.models import gguf_blocks, kernels
from ds4_mlx.models.kernels import backend
from ds4_mlx.models.numerics import reshaped


# quantized dense products (attention projections, grouped output projection, shared experts, LM head)
# of at least this many rows dequantize the weight into the compute dtype once a call and run a dense
# product; fewer rows (a decoded token), and backends not listed, keep mx.quantized_matmul. Chosen per
# backend from measurements (docs/PERFORMANCE.md); DS4_MLX_DENSE_PATH=quantized or =dequantize forces
# one path for every product.
DEQUANTIZE_FROM_ROWS = {"cuda": 32}
DENSE_PATHS = ("quantized", "dequantize")


def dequantizes(rows):
    forced = os.environ.get("DS4_MLX_DENSE_PATH")
    if forced:
        if forced not in DENSE_PATHS:
            raise ValueError(f"DS4_MLX_DENSE_PATH must be one of {', '.join(DENSE_PATHS)}, got {forced!r}")
        return forced == "dequantize"
    threshold = DEQUANTIZE_FROM_ROWS.get(backend())
    return threshold is not None and rows >= threshold


def _row(a, i):
    """a[i] as a view (integer indexing would gather a copy)."""
    return a[i : i + 1].squeeze(0)


def dequantize_into(dtype, weight, scales, biases, *, group_size, bits, mode):
    """`mx.dequantize` into `dtype` values, each rounded once: it computes in the scales' dtype, so float
    scales of another dtype (float16 ones for float32 values) are widened to float32 first."""
    if mx.issubdtype(scales.dtype, mx.floating) and scales.dtype != dtype:
        scales, biases = scales.astype(mx.float32), None if biases is None else biases.astype(mx.float32)
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=dtype)


def dequantized(m, dtype):
    """The weight of quantized layer `m` as `dtype` values (`dequantize_into`)."""
    return dequantize_into(dtype, m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits,
                           mode=m.mode)


class Linear(nn.Linear):
    """A dense layer without bias; quantized, a `QuantizedLinear`."""

    def __init__(self, input_dims, output_dims):
        super().__init__(input_dims, output_dims, bias=False)

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_):
        return QuantizedLinear(self.weight.shape[1], self.weight.shape[0], False, group_size, bits, mode)


class TransposedLinear(nn.Module):
    """A dense float layer without bias holding its weight as [in, out]: the file's [out, in] transposed
    at load (`held_transposed`), a view of the same memory, so `x @ weight` is `nn.Linear`'s product on
    the same operands (the same numbers) without the transposed view `nn.Linear` makes on every call, a
    node of each step's graph. Quantized, a `QuantizedLinear` of the file's layout."""

    def __init__(self, input_dims, output_dims):
        super().__init__()
        scale = input_dims ** -0.5  # nn.Linear's initial weights
        self.weight = mx.random.uniform(-scale, scale, (output_dims, input_dims)).T

    def __call__(self, x):
        return x @ self.weight

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_):
        """This layer's weight quantized, as nn.Linear's `to_quantized` gives it."""
        layer = QuantizedLinear(self.weight.shape[0], self.weight.shape[1], False, group_size, bits, mode)
        layer.weight, layer.scales, *biases = mx.quantize(self.weight.T, layer.group_size, layer.bits, mode=mode)
        if biases:
            layer.biases = biases[0]
        return layer


def transposed_weights(module):
    """The parameter names of `module`'s `TransposedLinear` weights."""
    return {f"{path}.weight" if path else "weight" for path, m in module.named_modules()
            if isinstance(m, TransposedLinear)}


def held_transposed(module, weights):
    """`weights` (by parameter name, laid out as a file holds them) with each `TransposedLinear` weight of
    `module` as it holds it: transposed, a view (evaluating it copies nothing)."""
    names = transposed_weights(module)
    return {name: w.T if name in names else w for name, w in weights.items()}


def file_weights(module):
    """`module`'s parameters by name laid out as a file holds them (a transposition is its own inverse)."""
    return held_transposed(module, dict(tree_flatten(module.parameters())))


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear`; many rows at once (a prefill chunk) go through the weight dequantized into
    their dtype and a dense product where the backend's quantized product is slower (`dequantizes`)."""

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        if dequantizes(rows):
            return x @ dequantized(self, x.dtype).T
        flat = _few_rows_of(x, self)
        y = None if flat is None else kernels.few_rows(flat, *_one_map(self))
        if y is not None:
            return reshaped(y, *x.shape[:-1], -1)
        return super().__call__(x)


def _one_map(layer):
    """A quantized layer's arrays as the few-row kernels take them (one map: [out, in] as they are)."""
    return layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits, layer.mode


def _few_rows_of(x, *layers):
    """x's rows [rows, in] where the few-row kernels may take the products of these layers (quantized, no
    bias), else None. A decoded token's x is that already: no view."""
    rows = x.size // x.shape[-1]
    if rows > kernels.FEW_ROWS_MAX or dequantizes(rows):
        return None
    if not all(isinstance(m, QuantizedLinear) and "bias" not in m for m in layers):
        return None
    return reshaped(x, rows, -1)


def pair_product(first, second, x):
    """(first(x), second(x)) of two layers that read the same x; one launch for a few rows of two 8-bit
    layers."""
    rows = _few_rows_of(x, first, second)
    ys = None if rows is None else kernels.few_rows_pair(rows, _one_map(first), _one_map(second))
    if ys is not None:
        return tuple(reshaped(y, *x.shape[:-1], -1) for y in ys)
    return first(x), second(x)


def swiglu_product(gate, up, x, limit):
    """clamped_swiglu(gate(x), up(x)); one launch for a few rows of two 8-bit layers."""
    rows = _few_rows_of(x, gate, up)
    y = None if rows is None else kernels.few_rows_glu(rows, _one_map(gate), _one_map(up), limit)
    if y is not None:
        return reshaped(y, *x.shape[:-1], -1)
    return kernels.clamped_swiglu(gate(x), up(x), limit)


def plus_product(layer, x, addend):
    """addend + layer(x), where addend is x's rows of the output [..., out] or of several terms to sum first
    [..., terms, out]; one launch for a few rows of an 8-bit layer, rounded as the plain sums are."""
    rows = _few_rows_of(x, layer) if addend.dtype == x.dtype else None
    y = None if rows is None else kernels.few_rows(rows, *_one_map(layer), addend=addend)  # read flat
    if y is not None:
        return y.reshape(x.shape[:-1] + addend.shape[-1:])
    return (addend.sum(axis=-2) if addend.ndim > x.ndim else addend) + layer(x)


def grouped_product(x, w):
    """x [T, groups, in] with w [groups, out, in] -> [T, groups, out], row j of every token through map j."""
    return (x.swapaxes(0, 1) @ w.swapaxes(-1, -2)).swapaxes(0, 1)


class GroupedLinear(nn.Module):
    """Linear maps [groups, out, in], each token's row j through map j (the grouped output projection)."""

    def __init__(self, groups, input_dims, output_dims):
        super().__init__()
        self.weight = mx.zeros((groups, output_dims, input_dims))

    def __call__(self, x):
        return grouped_product(x, self.weight)

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_):
        return QuantizedGroupedLinear(*self.weight.shape, group_size, bits, mode)


def hold_quantized_stack(module, n, output_dims, input_dims, group_size, bits, mode):
    """Give `module` the arrays of a quantized stack of n [output_dims, input_dims] matrices (zeros until
    its weights load)."""
    module.group_size, module.bits, module.mode = group_size, bits, mode
    w, scales, *biases = mx.quantize(mx.zeros((n, output_dims, input_dims)), group_size, bits, mode=mode)
    module.weight, module.scales = w, scales
    if biases:
        module.biases = biases[0]


class QuantizedGroupedLinear(nn.Module):
    def __init__(self, groups, output_dims, input_dims, group_size, bits, mode="affine"):
        super().__init__()
        hold_quantized_stack(self, groups, output_dims, input_dims, group_size, bits, mode)
        # the map of each row, made once: a compiled graph reads them rather than running a kernel a call
        # (evaluated now, so they do not belong to the stream of the thread that first uses them)
        self._maps = mx.arange(groups)
        mx.eval(self._maps)
        self.freeze()

    def __call__(self, x):
        if dequantizes(x.shape[0]):
            return grouped_product(x, dequantized(self, x.dtype))
        y = kernels.few_rows(x, self.weight, self.scales, self.get("biases"), self.group_size, self.bits, self.mode)
        if y is not None:
            return y
        y = mx.gather_qmm(x[:, :, None, :], self.weight, self.scales, self.get("biases"), rhs_indices=self._maps,
                          transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode)
        return y[:, :, 0, :]


class Embedding(nn.Embedding):
    """The token embedding. Its quantized form gives rows in float32: a Q8_0 row (int8 codes times a
    float16 scale, up to 19 significant bits) keeps its exact values, which float16 would round."""

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_):
        return QuantizedEmbedding(*self.weight.shape, group_size, bits, mode)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    def __call__(self, x):
        biases = self.get("biases")
        return dequantize_into(mx.float32, self["weight"][x], self["scales"][x], None if biases is None else biases[x],
                               group_size=self.group_size, bits=self.bits, mode=self.mode)


def gather_product(x, w, indices, sorted_indices=False):
    """x [..., M, in] times the maps w[indices] [..., out, in] transposed (`mx.gather_mm`), in w's dtype."""
    wide = w
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:  # MLX's CPU gather_mm is float32 only
        x, wide = x.astype(mx.float32), w.astype(mx.float32)
    y = mx.gather_mm(x, wide.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    return y.astype(w.dtype)


class SwitchLinear(nn.Module):
    """A stack of linear maps [n, out, in]; each token row picks its own (the routed experts)."""

    def __init__(self, n, input_dims, output_dims):
        super().__init__()
        self.weight = mx.zeros((n, output_dims, input_dims))

    def __call__(self, x, indices, sorted_indices=False):
        return gather_product(x, self.weight, indices, sorted_indices)

    def one(self, x, i):
        """x [n, in] through map i alone."""
        return x @ _row(self.weight, i).T

    def to_quantized(self, group_size=None, bits=None, mode="affine", gguf_type=None, **_):
        n, out, inp = self.weight.shape
        if gguf_type is not None:
            return GGUFSwitchLinear(n, inp, out, gguf_type)
        return QuantizedSwitchLinear(n, inp, out, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    def __init__(self, n, input_dims, output_dims, group_size, bits, mode="affine"):
        super().__init__()
        hold_quantized_stack(self, n, output_dims, input_dims, group_size, bits, mode)
        self.freeze()

    # x is not cast to the scales' dtype: the compute dtype is x's. Converted scales are float16 (or
    # uint8 for MXFP4) whatever the compute dtype, and MLX promotes them, as nn.QuantizedLinear relies on.
    def __call__(self, x, indices, sorted_indices=False):
        return mx.gather_qmm(x, self.weight, self.scales, self.get("biases"),
                             rhs_indices=indices, transpose=True, group_size=self.group_size, bits=self.bits,
                             mode=self.mode, sorted_indices=sorted_indices)

    def one(self, x, i):
        w, scales, biases = self._maps()[i]
        return mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)

    def packed(self):
        """(weight, scales, biases, group size, bits) for the fused expert kernels, None unless affine."""
        if self.mode != "affine":
            return None
        return self.weight, self.scales, self.biases, self.group_size, self.bits

    def _maps(self):
        """Per-map (weight, scales, biases) views, made once per set of parameter arrays: a prefill
        chunk calls `one` for every expert of every layer, and views are graph nodes too."""
        arrays = (self.weight, self.scales, self.get("biases"))
        cached = self.__dict__.get("_views")
        if cached is None or any(a is not b for a, b in zip(cached[0], arrays)):
            views = [tuple(None if a is None else _row(a, i) for a in arrays) for i in range(self.weight.shape[0])]
            mx.eval([v for triple in views for v in triple if v is not None])
            self.__dict__["_views"] = cached = (arrays, views)
        return cached[1]


def gguf_dequantized(w, codec, dtype):
    """uint8 blocks [..., rows, row bytes] -> dtype [..., rows, cols], on the current path."""
    if gguf_blocks.path() == "kquant":
        scales = gguf_blocks.placeholder_scales()
        return gguf_blocks.kquant().dequantize(w, scales, codec, mx.float32).astype(dtype)
    values = kernels.gguf_dequantize(w, codec, dtype)  # one launch on CUDA
    return (gguf_blocks.dequantize(w, codec) if values is None else values).astype(dtype)


def _pair_rows(x, lead):
    """x [..., 1, in] as the rows [X, in] that the pairs of `lead` (indices' shape) read in order, X dividing
    their count: x itself where its batch axes are lead's first ones (the rest broadcast), else broadcast."""
    batch = (1,) * (len(lead) - x.ndim + 2) + x.shape[:-2]
    kept = len(batch)
    while kept and batch[kept - 1] == 1:
        kept -= 1
    if len(batch) != len(lead) or batch[:kept] != lead[:kept]:
        x = mx.broadcast_to(x, lead + x.shape[-2:])
    return reshaped(x, -1, x.shape[-1])


def gguf_gather_product(x, w, indices, codec, sorted_indices):
    """`mx.gather_qmm`'s contract (transposed) on GGUF blocks w [n, out, row bytes]: x [..., M, in] times
    map indices[...] -> [..., M, out]. On CUDA, a kernel for one row a pair (`kernels.gguf_rows`); the
    reference dequantizes each index's whole matrix: for few rows."""
    if gguf_blocks.path() == "kquant" and x.dtype != mx.float32:
        return gguf_blocks.kquant().gather_qmm(x, w, gguf_blocks.placeholder_scales(), codec,
                                               rhs_indices=indices.astype(mx.uint32), transpose=True,
                                               sorted_indices=sorted_indices)
    if x.shape[-2] == 1:
        lead = tuple(indices.shape)
        y = kernels.gguf_rows(_pair_rows(x, lead), w, indices, codec)
        if y is not None:
            return reshaped(y, *lead, 1, -1)
    return x @ gguf_dequantized(w[indices], codec, x.dtype).swapaxes(-1, -2)


def gguf_expert_rows(experts, x, chosen, limit, weights=None):
    """The routed experts of a few tokens, [T, k, out]: x [T, in] through the GGUF experts `chosen` [T, k] in
    two launches of the rows kernel (gate, up and SwiGLU; then down, each row times its weight [T, k] where
    given) that read x and their results as they are. None where the kernels do not take them (the caller's
    own path)."""
    gate, up, down = experts["gate"], experts["up"], experts["down"]
    if (not all(isinstance(m, GGUFSwitchLinear) for m in (gate, up, down)) or gate.gguf_type != up.gguf_type
            or (gguf_blocks.path() == "kquant" and x.dtype != mx.float32)):
        return None
    h = kernels.gguf_rows_glu(x, gate.weight, up.weight, chosen, gate.gguf_type, limit)
    return None if h is None else kernels.gguf_rows(h, down.weight, chosen, down.gguf_type, weights)


class GGUFSwitchLinear(nn.Module):
    """Routed experts kept in the GGUF's own blocks (uint8 [n, out, row bytes] of a `gguf_blocks.CODECS`
    type), computed as `gguf_blocks.path()` says: no requantization, the file's exact values."""

    def __init__(self, n, input_dims, output_dims, gguf_type):
        super().__init__()
        self.gguf_type = gguf_type
        self.weight = mx.zeros((n, output_dims, gguf_blocks.row_bytes(gguf_type, input_dims)), mx.uint8)
        self.freeze()

    def __call__(self, x, indices, sorted_indices=False):
        return gguf_gather_product(x, self.weight, indices, self.gguf_type, sorted_indices)

    def one(self, x, i):
        return x @ gguf_dequantized(_row(self.weight, i), self.gguf_type, x.dtype).T

    def span(self, x, indices, first, last):
        """x [P, 1, in] through the maps `indices` [P] (sorted, counted from `first`) of the span first..last
        of the stack: the span dequantized at once, then one sorted gather product."""
        return gather_product(x, gguf_dequantized(self.weight[first:last], self.gguf_type, x.dtype), indices,
                              sorted_indices=True)

    def gathers(self, dtype):
        """Whether a big sorted batch should go through `__call__` (mlx-kquant's gather) rather than spans
        of experts dequantized at once (`MoE._expert_spans`)."""
        return gguf_blocks.path() == "kquant" and dtype != mx.float32
