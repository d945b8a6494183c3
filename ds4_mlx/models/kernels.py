"""Fused GPU kernels for the hot paths of `deepseek_v4`, each with the plain-MLX function it replaces.

The plain function is the definition: the CPU runs it, and tests/test_kernels.py checks each kernel
against it on the backend that runs the kernel (Metal or CUDA). `use_kernels(False)` or the environment
variable DS4_MLX_KERNELS=0 forces the plain functions everywhere (for profiling, or to rule a kernel out).
"""

import os
from functools import lru_cache

import mlx.core as mx

_enabled = os.environ.get("DS4_MLX_KERNELS", "1") != "0"


def use_kernels(on: bool):
    global _enabled
    _enabled = on


def backend():
    """'metal', 'cuda' or None (CPU, or kernels switched off) for the default device."""
    if not _enabled or mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


# ---------------------------------------------------------------------------------------------
# Hyper-connection mixing: sigmoid gates, softmax + Sinkhorn on the 4x4 stream mix, and the collapse
# of the streams into one sub-layer input. As plain MLX this is ~230 tiny ops a call; fused, one launch.


def hc_mix_reference(mix, scale, base, streams, iters, eps):
    """mix [T, (2+hc)*hc] float32, streams [T, hc, H] -> (x [T, H], post [T, hc], comb [T, hc, hc])."""
    T, hc, H = streams.shape
    pre = mx.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * mx.sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mix[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(T, hc, hc)  # [source, destination]
    comb = mx.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    x = (pre[:, :, None] * streams).sum(axis=1)
    return x, post, comb


# One threadgroup per token: its first thread does the 4x4 softmax + Sinkhorn in registers and shares
# the `pre` weights; all threads then collapse the streams, feature by feature (coalesced reads).
_HC_BODY = """
    const int W = (2 + HC) * HC;
    if (tid == 0) {
        float c[HC * HC];
        for (int k = 0; k < HC; ++k)
            shared_pre[k] = 1.0f / (1.0f + exp(-(mix[t * W + k] * scale[0] + base[k]))) + EPS;
        for (int k = 0; k < HC; ++k)
            post[t * HC + k] = 2.0f / (1.0f + exp(-(mix[t * W + HC + k] * scale[1] + base[HC + k])));
        for (int j = 0; j < HC; ++j) {
            float m = -INFINITY;
            for (int k = 0; k < HC; ++k) {
                c[j * HC + k] = mix[t * W + 2 * HC + j * HC + k] * scale[2] + base[2 * HC + j * HC + k];
                m = fmax(m, c[j * HC + k]);
            }
            float s = 0.0f;
            for (int k = 0; k < HC; ++k) { c[j * HC + k] = exp(c[j * HC + k] - m); s += c[j * HC + k]; }
            for (int k = 0; k < HC; ++k) c[j * HC + k] = c[j * HC + k] / s + EPS;
        }
        for (int it = 0; it < ITERS; ++it) {
            if (it > 0) {
                for (int j = 0; j < HC; ++j) {
                    float s = 0.0f;
                    for (int k = 0; k < HC; ++k) s += c[j * HC + k];
                    for (int k = 0; k < HC; ++k) c[j * HC + k] /= s + EPS;
                }
            }
            for (int k = 0; k < HC; ++k) {
                float s = 0.0f;
                for (int j = 0; j < HC; ++j) s += c[j * HC + k];
                for (int j = 0; j < HC; ++j) c[j * HC + k] /= s + EPS;
            }
        }
        for (int k = 0; k < HC * HC; ++k) comb[t * HC * HC + k] = c[k];
    }
    BARRIER;
    for (int h = tid; h < H; h += GROUP) {
        float acc = 0.0f;
        for (int j = 0; j < HC; ++j) acc += shared_pre[j] * streams[(t * HC + j) * H + h];
        x[t * H + h] = acc;
    }
"""
_GROUP = 256
_HEADS = {
    "metal": "const int t = threadgroup_position_in_grid.x, tid = thread_position_in_threadgroup.x;\n"
             "threadgroup float shared_pre[HC];\n#define BARRIER threadgroup_barrier(mem_flags::mem_threadgroup)\n",
    "cuda": "const int t = blockIdx.x, tid = threadIdx.x;\n"
            "__shared__ float shared_pre[HC];\n#define BARRIER __syncthreads()\n",
}


@lru_cache(maxsize=None)
def _hc_kernel(kind, eps):
    source = _HEADS[kind] + f"#define EPS {float(eps)!r}f\n#define GROUP {_GROUP}\n" + _HC_BODY
    make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
    return make(name="ds4_hc_mix", input_names=["mix", "scale", "base", "streams"],
                output_names=["x", "post", "comb"], source=source)


def hc_mix(mix, scale, base, streams, iters, eps):
    """`hc_mix_reference`, fused into one kernel on Metal and CUDA (float32 throughout)."""
    kind = backend()
    if kind is None:
        return hc_mix_reference(mix, scale, base, streams, iters, eps)
    T, hc, H = streams.shape
    f32 = mx.float32
    return _hc_kernel(kind, eps)(
        inputs=[mix.astype(f32), scale.astype(f32), base.astype(f32), streams.astype(f32)],
        template=[("HC", hc), ("ITERS", iters), ("H", H)],
        grid=(T * _GROUP, 1, 1), threadgroup=(_GROUP, 1, 1),
        output_shapes=[(T, H), (T, hc), (T, hc, hc)], output_dtypes=[f32, f32, f32])
