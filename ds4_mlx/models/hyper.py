"""Hyper-connections: the `hc` residual streams mixed into a sub-layer's input and back (Sinkhorn-balanced,
in `kernels.hc_mix`), and the head that mixes them into one."""

import mlx.core as mx
import mlx.nn as nn

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.kernels import hc_mix, hc_post, hc_post_project, hc_project


class HyperConnection(nn.Module):
    """Mixes the `hc` residual streams into one sub-layer input, and back (pre / post / comb)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros(((2 + hc) * hc, hc * args.hidden_size))
        self.base = mx.zeros(((2 + hc) * hc,))
        self.scale = mx.ones((3,))
        self.hc, self.iters, self.eps, self.norm_eps = hc, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps

    def pre(self, streams, norm, mix=None):
        """streams [T, hc, H] -> (sub-layer input [T, H]: the mix in float32, rounded once to the dtype of
        `norm` (the sub-layer's RMSNorm) and normed by it, in one launch; post [T, hc], comb [T, hc, hc],
        float32). `mix`: this connection's projection of the streams, where the post that wrote them made
        it (`post`'s `then`)."""
        if mix is None:
            mix = project(self, streams)
        return hc_mix(mix, self.scale, self.base, streams, self.iters, self.eps, norm.weight.dtype, norm.weight,
                      norm.eps)

    @staticmethod
    def post(out, streams, post, comb, then=None):
        """The sub-layer's output `out` [T, H] back into the streams [T, hc, H] (`kernels.hc_post`). With
        `then`, the `HyperConnection` that reads the streams next: (streams, its projection of them, for its
        `pre`), in one launch for a few tokens (`kernels.hc_post_project`)."""
        if then is None:
            return hc_post(out, streams, post, comb)
        return hc_post_project(out, streams, post, comb, then.fn, then.norm_eps)


class HyperHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros((hc, hc * args.hidden_size))
        self.base = mx.zeros((hc,))
        self.scale = mx.ones((1,))
        self.eps, self.norm_eps = args.hc_eps, args.rms_norm_eps

    def __call__(self, streams):
        mix = project(self, streams)
        w = mx.sigmoid(mix * self.scale[0] + self.base) + self.eps
        return (w[:, :, None] * streams).sum(axis=1)


def project(connection, streams):
    """The mixing weights of `connection` (a `HyperConnection` or `HyperHead`) for streams [T, hc, H]: their
    RMS-normed flattening times its `fn`, [T, rows of fn]."""
    return hc_project(streams, connection.fn, connection.norm_eps)
