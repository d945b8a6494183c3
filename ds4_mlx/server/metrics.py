"""Prometheus metrics at `GET /metrics`, kept by prometheus-client in a registry of the server's own.

Counters: HTTP responses by route and status (499: the client left before the response began);
generation requests by endpoint and finish reason; prompt tokens by how they were served (reused from a
live session, replayed after a trim, computed); completion tokens; prefill and decode seconds. Gauges
read at scrape time: prefill and decode tokens per second over all requests so far, queued and running
requests, the sessions' tokens and bytes, MLX memory, whether the model is loaded, and the process's
memory (Linux). The counters sum over every tenant: with API keys, only the `--metrics-key` reads them.
"""

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, ProcessCollector,
                               generate_latest)

PREFIX = "ds4_mlx_"
CLIENT_GONE = "499"  # the status of a response whose client left before it began (nginx's name for it)


class ServerMetrics:
    def __init__(self, server):
        import mlx.core as mx

        worker = server.worker
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.http = Counter(PREFIX + "http_requests", "HTTP responses by route and status (499: the client "
                            "left first)", ["route", "status"], registry=r)
        self.requests = Counter(PREFIX + "requests", "generation requests by endpoint and finish reason "
                                "(dropped: the client left before it started)", ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens by how they were served: reused "
                                     "from a live session, replayed after a trim, or computed", ["kind"], registry=r)
        self.completion_tokens = Counter(PREFIX + "completion_tokens", "tokens generated", registry=r)
        self.prefill_seconds = Counter(PREFIX + "prefill_seconds", "time spent in prefills", registry=r)
        self.decode_seconds = Counter(PREFIX + "decode_seconds", "time spent decoding", registry=r)
        self._prefill = [0, 0.0]  # tokens replayed or computed, seconds
        self._decode = [0, 0.0]
        gauges = {
            "prefill_tokens_per_second": ("replayed and computed prompt tokens per second of prefill, all "
                                          "requests so far", lambda: _rate(self._prefill)),
            "decode_tokens_per_second": ("generated tokens per second of decoding, all requests so far",
                                         lambda: _rate(self._decode)),
            "queued_requests": ("requests waiting for a session", lambda: worker.queued),
            "running_requests": ("requests being served", lambda: sum(s.busy for s in worker.slots)),
            "session_tokens": ("tokens held by the live sessions", lambda: sum(len(s.tokens) for s in worker.slots)),
            "session_bytes": ("bytes held by the live sessions", lambda: sum(s.nbytes for s in worker.slots)),
            "mlx_active_memory_bytes": ("memory held by MLX arrays", mx.get_active_memory),
            "mlx_peak_memory_bytes": ("most memory MLX arrays held at once", mx.get_peak_memory),
            "ready": ("1 once the model is loaded and requests are served", lambda: int(server.ready)),
        }
        for name, (doc, read) in gauges.items():
            Gauge(PREFIX + name, doc, registry=r).set_function(read)

    def install(self, app: web.Application):
        app.router.add_get("/metrics", self.handle)
        app.on_response_prepare.append(self._count_response)

    async def handle(self, request):
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _count_response(self, request: web.Request, response: web.StreamResponse):
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        gone = request.transport is None or request.transport.is_closing()
        self.http.labels(route, CLIENT_GONE if gone else str(response.status)).inc()

    def finished(self, endpoint: str, outcome):
        """A generation request ended: `outcome` is the worker's `Outcome`, None for one dropped from the queue."""
        if outcome is None:
            self.requests.labels(endpoint, "dropped").inc()
            return
        self.requests.labels(endpoint, outcome.finish_reason).inc()
        for kind in ("reused", "replayed", "computed"):
            self.prompt_tokens.labels(kind).inc(getattr(outcome, kind))
        self.completion_tokens.inc(outcome.completion_tokens)
        self.prefill_seconds.inc(outcome.prefill_s)
        self.decode_seconds.inc(outcome.decode_s)
        self._prefill[0] += outcome.replayed + outcome.computed
        self._prefill[1] += outcome.prefill_s
        self._decode[0] += outcome.completion_tokens
        self._decode[1] += outcome.decode_s


def _rate(tokens_seconds) -> float:
    tokens, seconds = tokens_seconds
    return tokens / seconds if seconds > 0 else 0.0
