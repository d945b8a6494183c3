"""Shared fixtures: MLX on the CPU, tiny GGUF models written once per test session, the demo model, and
the demo model served for a test module. Helpers that are not fixtures (a server of given options, a
served process, waiting for /health, cold-prefill logits) are in `ds4_mlx.tools.testing`."""

import gc
import os
import sys
from pathlib import Path

import mlx.core as mx
import pytest

mx.set_default_device(mx.cpu)
# MLX compiles the CPU kernels of compiled functions with the g++ it finds on PATH: tests/bin/g++ makes each
# library appear whole in the cache the test processes share, and compiles the kernels' preamble once
os.environ["PATH"] = f"{Path(__file__).parent / 'bin'}{os.pathsep}{os.environ['PATH']}"
# MLX's CPU allocator keeps few freed buffers for reuse by default: the tests at the real cache geometry
# free far larger temporaries every step, and each new one is a fresh mapping whose pages fault in one by
# one. A larger cache (the GPU backends keep one) spares that time.
mx.set_cache_limit(2**30)

# seeds of `ds4_mlx.tools.testing.tiny_args`: 0 is the fixed tiny shape, the others draw other shapes
TINY_SEEDS = [0, 2, 4]


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """What lives as a test module starts (the imported libraries, session fixtures) kept out of the
    garbage collector's sweeps: a full collection walks every tracked object, torch's and transformers'
    included, and each server that stops runs two."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{seed: (gguf path, transformers model, ModelArgs)}, built lazily (needs torch + transformers)."""
    pytest.importorskip("transformers")
    from ds4_mlx.tools.testing import tiny_args, write_tiny_gguf

    folder = tmp_path_factory.mktemp("tiny_gguf")
    built = {}

    def get(seed):
        if seed not in built:
            args = tiny_args(seed)
            path, model = write_tiny_gguf(folder / f"tiny-{seed}.gguf", args, seed=seed)
            built[seed] = (path, model, args)
        return built[seed]

    return get


@pytest.fixture(scope="session", params=TINY_SEEDS, ids=lambda s: f"seed{s}")
def tiny_gguf(request, tiny_models):
    """(gguf path, transformers model, ModelArgs) for each of the tiny configs."""
    return tiny_models(request.param)


@pytest.fixture(scope="session")
def demo():
    """The demo model's (model, tokenizer), loaded once."""
    from ds4_mlx.demo import load_for_cli

    return load_for_cli(None)[:2]


@pytest.fixture(scope="module")
def bg(request):
    """The demo model served in the background for one test module: `demo_server` with the module's
    `SERVER_OPTIONS` (a dict), if it has one."""
    from ds4_mlx.server.build import BackgroundServer
    from ds4_mlx.tools.testing import demo_server

    with BackgroundServer(demo_server(**getattr(request.module, "SERVER_OPTIONS", {}))) as server:
        yield server


@pytest.fixture(scope="module")
def oai(bg):
    """An OpenAI SDK client of `bg` (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=bg.url + "/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def claude(bg):
    """An Anthropic SDK client of `bg`."""
    import anthropic

    return anthropic.Anthropic(base_url=bg.url, api_key="-", max_retries=0)


_exit_status = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown once pytest is done. MLX used from a thread other than
    the main one (the in-process servers' workers) can abort that teardown at random ("terminate called
    without an active exception", exit 134; ml-explore/mlx#3126) after every test passed: the run's
    status must be pytest's own. `ds4-mlx serve` leaves the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[-1] if _exit_status else 0)
