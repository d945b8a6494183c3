"""The precision policy, in one place (docs/PRECISION.md is the contract).

- The exact mode is float32 weights and compute with `quant_sim` off: the logits equal transformers'
  float32 `DeepseekV4ForCausalLM` on the same weights to float32 rounding (1e-4 at real widths), and a
  session's logits after any rewind equal a cold prefill of its tokens.
- In it, float32 matrix products run in full float32 on every backend. MLX runs them on TF32 tensor
  cores by default (CUDA; M5-class Macs), which moves logits by up to ~1.6 at real widths; it reads
  `MLX_ENABLE_TF32` once, at the first matrix-product-family call of the process, so the first forward
  pass in the exact mode sets it to 0 (`exact_float32`) before it runs anything, and checks that it took.
- Everything else stays fast: half-precision compute (`Model.cast`) keeps the parameters
  `keeps_float32` names in float32 and is unaffected by TF32; the default (`quant_sim` on) leaves
  MLX's TF32 setting as it is.
"""

import os
import re
import warnings

import mlx.core as mx

TF32_VARIABLE = "MLX_ENABLE_TF32"
_exact_chosen = False  # `exact_float32` ran in this process


def keeps_float32(path: str) -> bool:
    """Parameters whose math stays float32 under a half-precision compute dtype (hyper-connection mixing
    and Sinkhorn, attention sinks, router scores and bias, the compressor's score offsets). RMS norms
    accumulate in float32 in `mx.fast.rms_norm`, and attention scores and softmax, compressor pooling and
    the residual streams are float32 in the forward itself."""
    return bool(re.search(r"(^|\.)hc_(attn|ffn|head)\.|\.sinks$|\.ffn\.(gate\.weight|bias)$|\.ape$", path))


def tf32_active() -> bool:
    """Whether float32 matrix products on the default device round their inputs to TF32 (10 mantissa
    bits): a product whose exact result needs 13. Always False on the CPU. The probe is itself a matrix
    product, so MLX has read `MLX_ENABLE_TF32` after it."""
    if mx.default_device() == mx.cpu:
        return False
    n = 256
    a = mx.full((n, n), 1 + 2.0**-12, mx.float32)
    out = a @ mx.eye(n, dtype=mx.float32)
    return bool(mx.any(out != a).item())


def exact_float32():
    """Full float32 matrix products for the rest of the process (the exact mode): sets `MLX_ENABLE_TF32=0`
    unless the caller chose otherwise, and warns when MLX had already read the variable (a float32 product
    ran earlier in the process with TF32 on): then only a new process with the variable set is exact.
    Once a process; later calls return at once."""
    global _exact_chosen
    if _exact_chosen:
        return
    _exact_chosen = True
    os.environ.setdefault(TF32_VARIABLE, "0")
    if os.environ[TF32_VARIABLE] != "0":
        warnings.warn(f"{TF32_VARIABLE}={os.environ[TF32_VARIABLE]}: float32 products may run on TF32 tensor "
                      "cores, and the exact mode is not exact", stacklevel=2)
    elif tf32_active():
        warnings.warn(f"MLX ran float32 products on TF32 tensor cores before the exact mode was chosen: start "
                      f"the process with {TF32_VARIABLE}=0 for exact float32 logits", stacklevel=2)
