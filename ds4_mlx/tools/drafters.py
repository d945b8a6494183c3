"""Drafters for tests and benches: random-weight DSpark and MTP heads for a target, an oracle that drafts
from a known continuation with a chosen acceptance, and a drafter whose drafts are random tokens."""

import random

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from ds4_mlx.models.dspark import DSpark, DSparkArgs
from ds4_mlx.models.linear import file_weights, held_transposed
from ds4_mlx.models.mtp import MTP

GOLDEN_STEP = (5 ** 0.5 - 1) / 2  # the oracle's points in [0, 1): the most even spread of a sequence


def randomize(module, seed=0, dtype=mx.float32):
    """Random weights of the scale `tools.random_model` gives a target."""
    mx.random.seed(seed)
    params = {}
    for name, v in file_weights(module).items():  # drawn as a file holds them, then held as the module does
        if name.endswith("norm.weight"):
            params[name] = (1 + 0.1 * mx.random.normal(v.shape)).astype(dtype)
        elif v.ndim >= 2:
            params[name] = (mx.random.normal(v.shape) / np.sqrt(v.shape[-1])).astype(dtype)
        else:
            params[name] = (0.5 * mx.random.normal(v.shape)).astype(dtype)
    module.update(tree_unflatten(list(held_transposed(module, params).items())))
    mx.eval(module.parameters())
    return module


def random_dspark(target_args, seed=0, **dspark):
    n = target_args.num_hidden_layers
    d = {"target_layer_ids": [max(0, n - 3), max(0, n - 2), n - 1], "noise_token_id": target_args.vocab_size - 1,
         "markov_rank": 16, **dspark}
    return randomize(DSpark(target_args, DSparkArgs(**d)), seed)


def random_mtp(target_args, seed=0):
    return randomize(MTP(target_args), seed)


class OracleDrafter:
    """Drafts the target's own greedy continuation (`continuation`, computed ahead, indexed by position)
    but makes a draft of each round wrong, at a first-rejection point chosen so that a round of `k` drafts
    commits `accepted_length` tokens on average (the target's own included). The points follow the
    distribution of independent drafts each right with one chance, drawn at golden-ratio steps rather than
    at random: the few rounds of a short run already average the chosen length."""

    tap_keys = ()
    tap_width = 1

    def __init__(self, continuation, accepted_length, k, seed=0):
        if not 1 <= accepted_length <= k + 1:
            raise ValueError(f"accepted length {accepted_length} is outside 1 .. {k + 1}")
        self.continuation, self.k = continuation, k
        self.point = random.Random(seed).random()
        self.per_draft = _per_draft_acceptance(accepted_length, k)

    @staticmethod
    def tap_rows(taps):
        return None

    def draft(self, target, anchor, context, context_start, choose, k, committed_tokens=()):
        pos = len(committed_tokens) + 1  # the first draft's position
        right_ones, vocab = self._right_ones(), target.args.vocab_size
        tokens = []
        for i in range(min(k, self.k)):
            right = self.continuation[pos + i] if pos + i < len(self.continuation) else 0
            tokens.append(right if i < right_ones else (right + 1) % vocab)
        return tokens, mx.zeros((len(tokens), vocab)), None

    def _right_ones(self):
        """The drafts of this round before its first wrong one: i with chance a^i (1 - a), k with a^k."""
        self.point = (self.point + GOLDEN_STEP) % 1.0
        below, a = 0.0, self.per_draft
        for i in range(self.k):
            below += a ** i * (1 - a)
            if self.point < below:
                return i
        return self.k


def _per_draft_acceptance(accepted_length, k):
    """The chance a with 1 + a + a^2 + ... + a^k = accepted_length (independent drafts)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(k + 1)) < accepted_length:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


class RandomDrafter(OracleDrafter):
    """Random tokens: accepts about nothing."""

    def __init__(self, k, seed=0):
        self.k, self.rng = k, random.Random(seed)

    def draft(self, target, anchor, context, context_start, choose, k, committed_tokens=()):
        tokens = [self.rng.randrange(target.args.vocab_size) for _ in range(min(k, self.k))]
        return tokens, mx.zeros((len(tokens), target.args.vocab_size)), None


class LookaheadDrafter(OracleDrafter):
    """Drafts the target's own greedy continuation, computed now by running the target from scratch
    (slow, any prompt): every draft is accepted under greedy decoding. For tests of the multi-token
    rounds where the prompt is not known ahead (the server renders it)."""

    def __init__(self, k):
        self.k = k

    def draft(self, target, anchor, context, context_start, choose, k, committed_tokens=()):
        ids = list(committed_tokens) + [int(anchor)]
        tokens = []
        for _ in range(min(k, self.k)):
            logits = target(mx.array([ids], dtype=mx.int32), last_only=True)[0, -1]
            tokens.append(int(mx.argmax(logits)))
            ids.append(tokens[-1])
        return tokens, mx.zeros((len(tokens), target.args.vocab_size)), None
