"""The exactness report's repro through the server, on the demo model (the real cache geometry: window
128, ratios 4 and 128, 2,048-token prefill chunks): B after A equals B sent alone to a fresh server, and
a session saved to the disk store and resumed after a restart equals a cold run."""

import numpy as np
from openai import OpenAI

from ds4_mlx.cache.store import DiskStore
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.tools.testing import DEMO_MODEL_ID as MODEL, demo_server
SENTENCES = "The quick brown fox jumps over the lazy dog. " * 60
A, B, C = SENTENCES + " extra words here" * 200, SENTENCES + " and then?", " Tell me more, please."


def serve(disk_dir=None):
    disk = DiskStore(disk_dir, 64) if disk_dir else None
    return BackgroundServer(demo_server(ctx=8192, disk=disk))


def complete(bg, prompt):
    """(text, logprobs of each generated token's top 5) at temperature 0."""
    client = OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)
    choice = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=48,
                                       logprobs=5).choices[0]
    return choice.text, [dict(top) for top in choice.logprobs.top_logprobs]


def assert_same(got, want):
    assert got[0] == want[0]
    first, expected = got[1][0], want[1][0]
    assert first.keys() == expected.keys()
    assert max(abs(first[t] - expected[t]) for t in first) <= 1e-4  # the first token's logprobs
    assert all(np.isclose(g[t], w[t], atol=1e-3) for g, w in zip(got[1], want[1]) for t in g)


def test_b_after_a_and_after_a_restart_equals_a_cold_server(tmp_path):
    with serve(tmp_path) as bg:
        complete(bg, A)
        after_a = complete(bg, B)  # rewinds into A's first 2,048-token chunk; saved at shutdown
    with serve() as bg:
        assert_same(after_a, complete(bg, B))
        cold = complete(bg, B + C)
    with serve(tmp_path) as bg:  # B's session from disk, then more
        assert_same(complete(bg, B + C), cold)
