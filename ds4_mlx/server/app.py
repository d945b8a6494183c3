"""The HTTP layer: routes, request bodies, SSE streaming, disconnects and errors.

A generation request is parsed by its API module into a `Prepared`, tokenized here (off the event
loop), checked against the context, and submitted to the worker as a `Job`; the worker's events are
turned into the API's response by its responder. The app never touches the model or a session.
"""

import asyncio
import json
import gc
import logging
import time
import traceback

from aiohttp import web

from ds4_mlx.server import anthropic_api, openai_api, protocol, responses_api, webui
from ds4_mlx.server.assembly import Answer, AnswerMemory
from ds4_mlx.server.connections import CappedSite
from ds4_mlx.server.errors import APIError, context_exceeded
from ds4_mlx.server.loading import start_in_background
from ds4_mlx.server.metrics import ServerMetrics
from ds4_mlx.server.middleware import TENANT, Access, add_cors_headers, gates, namespace_of
from ds4_mlx.server.openapi import openapi_spec
from ds4_mlx.server.protocol import Prepared, ServerInfo, parse_body
from ds4_mlx.server.sessions_api import sessions_snapshot
from ds4_mlx.server.sse import COMMENT_KEEPALIVE, sse
from ds4_mlx.server.tokens_api import routes as token_routes
from ds4_mlx.server.worker import GenerationRequest, Job, Worker

log = logging.getLogger("ds4_mlx.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
CACHE_SALT = web.RequestKey("cache_salt", object)  # the body's `cache_salt`, a str or None
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


class Server:
    def __init__(self, worker: Worker, info: ServerInfo, *, keepalive_s: float = 5.0, access: Access = Access(),
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = 60.0,
                 idle_timeout_s: float = 15.0, max_connections: int = 2048):
        """`max_body_bytes` refuses longer bodies before they are read; `body_timeout_s` bounds the read of
        one body (a client dripping it holds no slot, only its connection); `idle_timeout_s` closes a
        connection that sends no complete request head for that long; `max_connections` caps the open
        connections (see `connections`)."""
        self.worker = worker
        self.info = info
        self.keepalive_s = keepalive_s
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.answer_memory = AnswerMemory()
        self.access = access
        self.metrics = ServerMetrics(self)
        self.loaded = None  # the model load, a future once the app starts
        self.worker_died = asyncio.Event()  # set if the worker thread dies: `serve` then exits non-zero

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, *gates(self.access, self)],
                              client_max_size=self.max_body_bytes)
        app.add_routes([
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.get("/openapi.json", self.openapi),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/v1/messages", self.messages),
            web.post("/v1/messages/count_tokens", self.count_tokens),
            web.post("/v1/responses", self.responses),
            *token_routes(self),
            web.get("/v1/sessions", self.sessions),
            *webui.routes(),
        ])
        self.metrics.install(app)
        add_cors_headers(app, self.access)
        app.on_startup.append(self._start_worker)
        app.on_shutdown.append(self._fail_jobs)
        app.on_cleanup.append(self._stop_worker)
        return app

    def runner(self) -> web.AppRunner:
        return web.AppRunner(self.app(), access_log=None, keepalive_timeout=self.idle_timeout_s)

    async def serve_on(self, runner: web.AppRunner, sock):
        """Serve `runner` on the listening socket `sock`, within the connection cap."""
        await CappedSite(runner, sock, self.max_connections).start()

    async def _start_worker(self, app):
        loop = asyncio.get_running_loop()
        self.worker.on_death = lambda: loop.call_soon_threadsafe(self.worker_died.set)
        self.loaded = start_in_background(self.worker)  # the port is served meanwhile: 503s until ready

    @property
    def ready(self) -> bool:
        done = self.loaded is not None and self.loaded.done()
        return done and not self.loaded.cancelled() and self.loaded.exception() is None

    @property
    def load_failed(self) -> bool:
        return self.loaded is not None and self.loaded.done() and not self.ready

    async def _fail_jobs(self, app):
        self.worker.shutdown()  # open requests get an error now, so the server need not wait for them

    async def _stop_worker(self, app):
        if not self.ready:
            return  # left during the load, or it failed: the loading thread is a daemon, nothing to wait for
        # on this thread, not an executor's: a thread still running as the process exits can crash it
        # ("terminate called without an active exception"). It waits for one chunk at most (_fail_jobs).
        self.worker.stop()
        gc.collect()

    # -- plain endpoints ------------------------------------------------------------------------------

    async def health(self, request):
        trouble = self.worker.health()
        if trouble is not None:
            return web.json_response({"status": "error", "model": self.info.model_id, "error": trouble}, status=503)
        # counts only: the tokens a slot holds are its tenant's business (/v1/sessions shows a tenant its own)
        slots = [{"slot": s.index, "busy": s.busy} for s in self.worker.slots]
        return web.json_response({"status": "ok", "model": self.info.model_id, "context_length": self.info.ctx,
                                  "queued": self.worker.queued, "slots": slots})

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "ds4-mlx",
                "context_length": self.info.ctx, "max_model_len": self.info.ctx}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in self.info.model_names]})

    async def model(self, request):
        name = self.info.model_name({"model": request.match_info["model"]})
        return web.json_response(self._model_card(name))

    async def openapi(self, request):
        return web.json_response(openapi_spec(self.info))

    async def sessions(self, request):
        salt = request.query.get("cache_salt")
        return web.json_response(sessions_snapshot(self.worker, self.info, _namespace(request, salt)))

    # -- generation endpoints -------------------------------------------------------------------------

    async def chat_completions(self, request):
        body, prepared = await self._parse(request, lambda body, memory: openai_api.parse_chat(body, self.info,
                                                                                              memory))
        responder = openai_api.ChatResponder(prepared, include_usage=openai_api.include_usage(body))
        return await self._generate(request, prepared, responder, "chat")

    async def completions(self, request):
        body, prompts = await self._parse(request, lambda body, _: openai_api.parse_completions(body, self.info))
        responses = []
        for echo, prepared in prompts:  # one choice per prompt
            responder = openai_api.CompletionResponder(prepared, include_usage=openai_api.include_usage(body),
                                                       echo=echo)
            responses.append(await self._generate(request, prepared, responder, "completion"))
            if prepared.stream or responses[-1].status != 200:
                return responses[-1]
        return web.json_response(openai_api.merge_completions([json.loads(r.body) for r in responses]))

    async def messages(self, request):
        _, prepared = await self._parse(request, lambda body, memory: anthropic_api.parse_messages(body, self.info,
                                                                                                  memory))
        return await self._generate(request, prepared, anthropic_api.MessagesResponder(prepared), "messages")

    async def count_tokens(self, request):
        _, prepared = await self._parse(request, lambda body, memory: anthropic_api.parse_messages(
            body, self.info, memory, counting=True))
        ids = await self._tokenize(prepared.prompt_text)
        return web.json_response({"input_tokens": len(ids)})

    async def responses(self, request):
        body, prepared = await self._parse(request, lambda body, memory: responses_api.parse_responses(
            body, self.info, memory))
        return await self._generate(request, prepared, responses_api.ResponsesResponder(prepared, body), "responses")

    # -- the generation loop --------------------------------------------------------------------------

    async def _generate(self, request: web.Request, prepared: Prepared, responder, label: str):
        self._check_length_bound(prepared)
        protocol.check_token_ids(prepared.sampling, self.worker.tokenizer.vocab_size)
        ids = await self._tokenize(prepared.prompt_text)
        room = self.info.ctx - len(ids)
        if room <= 0:
            raise context_exceeded(len(ids), self.info.ctx, prepared.param)
        max_tokens = min(prepared.max_tokens or room, room, self.info.max_tokens or room)
        namespace = _namespace(request, request.get(CACHE_SALT))
        job = Job(GenerationRequest(ids, max_tokens, prepared.sampling, prepared.stop, label, namespace),
                  asyncio.get_running_loop(), client_gone=lambda: _client_gone(request))
        answer = Answer(thinking=prepared.thinking, tools=prepared.tools, memory=self.answer_memory.of(namespace),
                        tool_id_prefix=prepared.tool_id_prefix)
        if prepared.stream:
            return await self._stream(request, job, answer, responder)
        self.worker.submit(job)
        return await self._collect(job, answer, responder)

    async def _collect(self, job: Job, answer: Answer, responder):
        error = None
        while True:
            kind, payload = await job.events.get()
            if kind == "chunk":
                answer.feed_chunk(payload)
                if payload.finish_reason:
                    answer.finish()
            elif kind == "error":
                error = payload
            elif kind == "done":
                self.metrics.finished(job.request.label, payload)
                break
        if error is not None:
            raise APIError(503 if self.worker.shutting_down else 500, error)
        if payload is None or payload.finish_reason == "abort":
            return web.Response(status=499)  # the client left; nobody reads this
        return web.json_response(responder.body(payload, answer))

    async def _stream(self, request: web.Request, job: Job, answer: Answer, responder):
        """Send the headers, then submit the job and stream its events. A client gone before the headers
        went out is counted as dropped, and its job never submitted; one gone later is aborted, counted
        when the worker has let go of its job."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await response.prepare(request)
        except ConnectionError:
            log.info(f"{job.request.label} dropped: the client left before the response began")
            self.metrics.finished(job.request.label, None)
            return response
        self.worker.submit(job)
        keepalive = getattr(responder, "keepalive", COMMENT_KEEPALIVE)
        last_write = time.monotonic()
        done = False
        try:
            while True:
                timeout = max(0.0, last_write + self.keepalive_s - time.monotonic())
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout)
                except asyncio.TimeoutError:
                    kind, payload = "keepalive", None
                if kind == "done":
                    done = True
                    self.metrics.finished(job.request.label, payload)
                    if payload is not None and payload.finish_reason not in ("abort", "error"):
                        await self._write(response, responder.end(payload, answer))
                    break
                if kind == "keepalive" or kind == "prefill":
                    if time.monotonic() - last_write >= self.keepalive_s:
                        await response.write(keepalive)
                        last_write = time.monotonic()
                    continue
                if kind == "started":
                    events = responder.start(payload)
                elif kind == "chunk":
                    parsed = answer.feed_chunk(payload) + (answer.finish() if payload.finish_reason else [])
                    events = responder.deltas(parsed)
                else:  # error
                    events = responder.error(payload)
                if events:
                    await self._write(response, events)
                    last_write = time.monotonic()
        except (ConnectionError, RuntimeError):  # the client went away mid-stream
            job.cancel()
            while not done:  # the worker stops the job at its next step
                kind, payload = await job.events.get()
                if kind == "done":
                    done = True
                    self.metrics.finished(job.request.label, payload)
        return response

    @staticmethod
    async def _write(response: web.StreamResponse, events):
        await response.write(b"".join(sse(event, data) for event, data in events))

    # -- helpers --------------------------------------------------------------------------------------

    def _check_length_bound(self, prepared: Prepared):
        """A prompt needs at least one token per `longest_token_bytes` bytes (and so characters): one
        surely over the context is refused before it is tokenized."""
        at_least = len(prepared.prompt_text) // self.worker.longest_token_bytes
        if at_least > self.info.ctx:
            raise APIError(413, f"the prompt has at least {at_least} tokens, the context holds {self.info.ctx}",
                           param=prepared.param, code="context_length_exceeded")

    async def _tokenize(self, text: str) -> list[int]:
        return await _off_loop(self.worker.tokenizer.encode, text)

    async def _body(self, request: web.Request) -> dict:
        return await _off_loop(parse_body, await self._read(request))

    async def _parse(self, request: web.Request, parse) -> tuple:
        """(body, parse(body, memory)), both made on an executor thread: a large body is parsed, checked and
        rendered while the loop goes on serving. `memory` holds the answers of the request's namespace."""
        raw = await self._read(request)

        def parsed():
            body = parse_body(raw)
            salt = body.pop("cache_salt", None)  # read here for every API: vLLM's field, no API module's
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise APIError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
            return salt, body, parse(body, self.answer_memory.of(_namespace(request, salt)))
        request[CACHE_SALT], body, prepared = await _off_loop(parsed)
        return body, prepared

    async def _read(self, request: web.Request) -> bytes:
        too_large = APIError(413, f"the body is larger than {self.max_body_bytes / 2**20:g} MiB (--max-body-mb)",
                             code="body_too_large")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise too_large  # refused before a byte of it is read
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise APIError(408, f"the body did not arrive within {self.body_timeout_s:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            error = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            error = APIError(e.status, f"{request.method} {request.path}: {e.reason}")
        except Exception as e:  # noqa: BLE001 - answered as a 500, never a traceback to the client
            log.error(f"{request.method} {request.path} failed:\n{traceback.format_exc()}")
            error = APIError(500, f"internal error: {type(e).__name__}")
        if 400 <= error.status < 500:  # one line per refused request, so a client's mistake can be seen
            log.info("%s %s %d: %.300s", request.method, request.path, error.status, error.message)
        body = error.anthropic_body() if is_anthropic(request) else error.openai_body()
        return web.json_response(body, status=error.status)


def _namespace(request: web.Request, cache_salt: str | None) -> str:
    return namespace_of(request.get(TENANT, ""), cache_salt)


async def _off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _client_gone(request: web.Request) -> bool:
    """Read from the worker thread: a closed or closing connection means nobody waits for output."""
    transport = request.transport
    return transport is None or transport.is_closing()
