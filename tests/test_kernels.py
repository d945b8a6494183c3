"""Each fused kernel of `ds4_mlx.models.kernels` against the plain-MLX function it replaces, on the GPU
backend that runs it (Metal or CUDA). Skipped where MLX has no GPU (this CPU CI): the device run calls
`run_all()` (see docs/PERFORMANCE.md)."""

import mlx.core as mx
import pytest

from ds4_mlx.models import kernels

HAS_GPU = mx.metal.is_available() or mx.cuda.is_available()


def check_hc_mix(T, H, hc=4, iters=20, eps=1e-6, seed=0):
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    mix = 3 * mx.random.normal((T, (2 + hc) * hc), key=k1)
    scale = mx.random.uniform(0.5, 2.0, (3,), key=k2)
    base = mx.random.normal(((2 + hc) * hc,), key=k3)
    streams = mx.random.normal((T, hc, H), key=k4)
    with mx.stream(mx.gpu):
        previous = mx.default_device()
        mx.set_default_device(mx.gpu)
        try:
            assert kernels.backend() in ("metal", "cuda")
            got = kernels.hc_mix(mix, scale, base, streams, iters, eps)
            want = kernels.hc_mix_reference(mix, scale, base, streams, iters, eps)
            mx.eval(got, want)
        finally:
            mx.set_default_device(previous)
    for name, g, w in zip(("x", "post", "comb"), got, want):
        assert g.shape == w.shape and g.dtype == mx.float32, name
        err = float(mx.abs(g - w).max())
        assert err <= 1e-5 * max(1.0, float(mx.abs(w).max())), f"{name}: max |diff| {err:.2e} (T={T}, H={H})"
    # the comb matrix is doubly stochastic after Sinkhorn: columns sum to 1 (to within eps)
    assert float(mx.abs(got[2].sum(axis=-2) - 1).max()) < 1e-4


@pytest.mark.skipif(not HAS_GPU, reason="no Metal or CUDA device")
@pytest.mark.parametrize("T,H", [(1, 4096), (3, 64), (517, 4096)])
def test_hc_mix_kernel_matches_reference(T, H):
    check_hc_mix(T, H)


def run_all():
    """The checks above, for a device run without pytest; prints one line per case."""
    for T, H in [(1, 4096), (3, 64), (517, 4096)]:
        check_hc_mix(T, H)
        print(f"hc_mix kernel ok: T={T} H={H} backend={kernels.backend() or 'gpu'}")


if __name__ == "__main__":
    run_all()
