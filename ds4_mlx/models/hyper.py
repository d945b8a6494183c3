"""Hyper-connections: the `hc` residual streams mixed into a sub-layer's input and back (Sinkhorn-balanced,
in `kernels.hc_mix`), and the head that mixes them into one."""

import mlx.core as mx
import mlx.nn as nn

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.kernels import hc_mix, hc_post, hc_project


class HyperConnection(nn.Module):
    """Mixes the `hc` residual streams into one sub-layer input, and back (pre / post / comb)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros(((2 + hc) * hc, hc * args.hidden_size))
        self.base = mx.zeros(((2 + hc) * hc,))
        self.scale = mx.ones((3,))
        self.hc, self.iters, self.eps, self.norm_eps = hc, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps

    def pre(self, streams, norm):
        """streams [T, hc, H] -> (sub-layer input [T, H]: the mix in float32, rounded once to the dtype of
        `norm` (the sub-layer's RMSNorm) and normed by it, in one launch; post [T, hc], comb [T, hc, hc],
        float32)."""
        T, hc, H = streams.shape
        mix = hc_project(streams.reshape(T, hc * H), self.fn, self.norm_eps)
        return hc_mix(mix, self.scale, self.base, streams, self.iters, self.eps, norm.weight.dtype, norm.weight,
                      norm.eps)

    @staticmethod
    def post(out, streams, post, comb):
        """The sub-layer's output `out` [T, H] back into the streams [T, hc, H] (`kernels.hc_post`)."""
        return hc_post(out, streams, post, comb)


class HyperHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros((hc, hc * args.hidden_size))
        self.base = mx.zeros((hc,))
        self.scale = mx.ones((1,))
        self.eps, self.norm_eps = args.hc_eps, args.rms_norm_eps

    def __call__(self, streams):
        T, hc, H = streams.shape
        mix = hc_project(streams.reshape(T, hc * H), self.fn, self.norm_eps)
        w = mx.sigmoid(mix * self.scale[0] + self.base) + self.eps
        return (w[:, :, None] * streams).sum(axis=1)
