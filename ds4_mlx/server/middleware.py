"""What stands in front of the routes: CORS for browser clients, the API key, and 503s while the model loads.

The gates run inside the app's error middleware, so a refusal is an `APIError` answered in the body
format of the API the client called.
"""

import hmac
from dataclasses import dataclass

from aiohttp import web

from ds4_mlx.server.errors import APIError

PUBLIC_PATHS = {"/health"}  # answered without the API key: health checks carry no credentials
WITHOUT_MODEL_PATHS = {"/metrics", "/openapi.json"}  # answered while the model loads
ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version"


@dataclass(frozen=True)
class Access:
    """`api_key`: None serves everyone. `cors_origins`: origins browsers may call from ("*": any)."""
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()

    def allows_origin(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.cors_origins or origin in self.cors_origins)


def gates(access: Access, server) -> list:
    """The middlewares, outermost first: CORS preflight, the API key, readiness."""
    chain = []
    if access.cors_origins:
        chain.append(_preflight(access))
    if access.api_key:
        chain.append(_api_key(access.api_key))
    chain.append(_readiness(server))
    return chain


def add_cors_headers(app: web.Application, access: Access):
    """Every response (streams included: the signal fires before the headers go out) to an allowed
    origin says so; an error too, so the browser lets the page read it."""
    if not access.cors_origins:
        return

    async def on_prepare(request: web.Request, response: web.StreamResponse):
        origin = request.headers.get("Origin")
        if access.allows_origin(origin):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in access.cors_origins else origin
            response.headers.add("Vary", "Origin")

    app.on_response_prepare.append(on_prepare)


def _preflight(access: Access):
    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        if not access.allows_origin(request.headers.get("Origin")):
            raise APIError(403, f"origin {request.headers.get('Origin')!r} is not allowed (--cors)")
        requested = request.headers.get("Access-Control-Request-Headers") or DEFAULT_ALLOWED_HEADERS
        return web.Response(status=204, headers={"Access-Control-Allow-Methods": ALLOWED_METHODS,
                                                 "Access-Control-Allow-Headers": requested,
                                                 "Access-Control-Max-Age": "600"})
    return preflight


def _api_key(key: str):
    expected = key.encode()

    @web.middleware
    async def api_key(request: web.Request, handler):
        if request.path not in PUBLIC_PATHS:
            given = request.headers.get("x-api-key")
            authorization = request.headers.get("Authorization", "")
            if given is None and authorization[:7].lower() == "bearer ":
                given = authorization[7:].strip()
            if given is None:
                raise APIError(401, "an API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                               code="missing_api_key")
            if not hmac.compare_digest(given.encode(), expected):
                raise APIError(401, "the API key is not valid", code="invalid_api_key")
        return await handler(request)
    return api_key


def _readiness(server):
    @web.middleware
    async def readiness(request: web.Request, handler):
        if server.ready or request.path in WITHOUT_MODEL_PATHS:
            return await handler(request)
        if server.load_failed:
            raise APIError(503, "the model failed to load; see the server's log", code="model_load_failed")
        if request.path == "/health":
            return web.json_response({"status": "loading", "model": server.info.model_id}, status=503,
                                     headers={"Retry-After": "5"})
        raise APIError(503, "the model is still loading; /health says \"ok\" once it is ready",
                       code="model_loading")
    return readiness
