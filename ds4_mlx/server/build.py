"""Putting a server together from a model loader: the worker with its slots, the app, and a way to run it."""

import asyncio
import socket
import threading
from functools import partial

from ds4_mlx.generate import stream_generate
from ds4_mlx.server.app import DEFAULT_MAX_BODY_BYTES, Server
from ds4_mlx.server.middleware import Access
from ds4_mlx.server.protocol import ServerInfo
from ds4_mlx.server.worker import Worker


def build_server(load, *, model_id: str, ctx: int, sessions: int, budget_bytes: int,
                 rewind_slack: int = 4096, checkpoint_every: int = 2048, prefill_chunk: int = 2048,
                 shared_prefill_layers: int = 1, exact_rewinds: bool = False,
                 keepalive_s: float = 5.0,
                 generate=partial(stream_generate, yield_prefill=True, together=True), batch: int = 4,
                 max_tokens: int | None = None,
                 access: Access = Access(), disk=None, max_body_bytes: int | None = None, **limits) -> Server:
    """`batch`: how many streams decode in one forward at most (`Worker`); `max_tokens` caps every request's output (a request asking for more stops there, as `length`);
    `max_body_bytes` refuses longer request bodies (default: `body_limit(ctx)`); `limits` are the
    connection limits of `Server`."""
    from ds4_mlx.distributed import new_session  # in lockstep on every rank, when launched on several

    worker = Worker(load, n_slots=sessions, budget_bytes=budget_bytes,
                    session_factory=lambda m: new_session(m, rewind_slack=rewind_slack,
                                                          checkpoint_every=checkpoint_every,
                                                          max_chunk=prefill_chunk, exact_rewinds=exact_rewinds),
                    generate=generate, disk=disk, shared_prefill_layers=shared_prefill_layers, batch=batch)
    return Server(worker, ServerInfo(model_id=model_id, ctx=ctx, max_tokens=max_tokens), keepalive_s=keepalive_s,
                  access=access, max_body_bytes=max_body_bytes or body_limit(ctx), **limits)


def body_limit(ctx: int) -> int:
    """Room for a full context of JSON-escaped text with tools and settings around it: 32 bytes a token
    (a CJK character escaped as a surrogate pair is 12), and at least `DEFAULT_MAX_BODY_BYTES`."""
    return max(DEFAULT_MAX_BODY_BYTES, 32 * ctx)


class BackgroundServer:
    """A server on 127.0.0.1 and a free port, run by its own event loop in a thread (tests, notebooks).

        with BackgroundServer(server) as bg:
            OpenAI(base_url=bg.url + "/v1", api_key="-")
    """

    def __init__(self, server: Server, host: str = "127.0.0.1", *, wait_ready: bool = True):
        self.server = server
        self.wait_ready = wait_ready
        self.host = host
        self._sock = socket.create_server((host, 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="ds4-http", daemon=True)

    def __enter__(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self):
        self._runner = self.server.runner()
        await self._runner.setup()
        await self.server.serve_on(self._runner, self._sock)
        if self.wait_ready:
            await self.server.loaded
