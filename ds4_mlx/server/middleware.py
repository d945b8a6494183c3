"""What stands in front of the routes: browser and Host checks, CORS, the API key, and 503s while the model loads.

Browser safety by default, as Ollama does it: a request whose `Origin` is neither this server's own
page nor allowed by `--cors` is refused, so no other web page can drive the server (a simple request
needs no preflight). The `Host` must be an IP address, a loopback name or an `--allowed-host`, so a page
whose own name was rebound to this machine (DNS rebinding) is refused as well. A POST body is JSON:
`text/plain` and the form types a browser sends without asking are a 415.

The gates run inside the app's error middleware, so a refusal is an `APIError` answered in the body
format of the API the client called.
"""

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from ds4_mlx.server.errors import APIError

# answered without the API key: health checks carry no credentials, and the web page and its files hold no
# data (the page asks for the key, then sends it with every API request it makes)
PUBLIC_PATHS = {"/health", "/"}
PUBLIC_PREFIX = "/web/"
METRICS_PATH = "/metrics"
WITHOUT_MODEL_PATHS = {METRICS_PATH, "/openapi.json"}  # answered while the model loads
ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version"
TENANT = web.RequestKey("tenant", str)  # a hash of the request's API key


@dataclass(frozen=True)
class Access:
    """`api_keys`: empty serves everyone; else each key is a tenant with its own prefix-cache namespace.
    `metrics_key`: the one key `/metrics` answers once it or `api_keys` is set (its counters sum over
    every tenant, so no tenant key reads them; with `api_keys` and no `metrics_key`, `/metrics` is off).
    `cors_origins`: origins browsers may call from ("*": any). `allowed_hosts`: names besides loopback
    ones that clients may reach the server by."""
    api_keys: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    metrics_key: str | None = None

    def allows_origin(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.cors_origins or origin in self.cors_origins)

    def allows_host(self, host: str) -> bool:
        name = host.lower().rstrip(".")
        if name == "localhost" or name.endswith(".localhost") or name in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name.strip("[]"))
            return True  # an address names no domain that could be rebound to this machine
        except ValueError:
            return False


def gates(access: Access, server) -> list:
    """The middlewares, outermost first: browser checks, CORS preflight, the API key, readiness."""
    chain = [_browser_checks(access)]
    if access.cors_origins:
        chain.append(_preflight(access))
    if access.api_keys or access.metrics_key:
        chain.append(_api_key(access))
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


def _browser_checks(access: Access):
    @web.middleware
    async def browser_checks(request: web.Request, handler):
        host = request.headers.get("Host")  # a client without one (HTTP/1.0) is no browser
        if host is not None and not access.allows_host(urlsplit(f"//{host}").hostname or ""):
            raise APIError(403, f"the Host {request.host!r} is not allowed: reach the server by a loopback name or "
                                "address, or start it with --allowed-host NAME", code="host_not_allowed")
        origin = request.headers.get("Origin")
        if origin is not None and not access.allows_origin(origin) and origin != f"{request.scheme}://{request.host}":
            raise APIError(403, f"origin {origin!r} is not allowed (--cors)", code="origin_not_allowed")
        content_type = request.headers.get("Content-Type")
        if request.method == "POST" and content_type is not None and not _is_json(request.content_type):
            raise APIError(415, f"the body must be JSON (Content-Type: application/json), not {content_type!r}",
                           code="unsupported_media_type")
        return await handler(request)
    return browser_checks


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or media_type.endswith("+json")


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


def namespace_of(tenant: str, cache_salt: str | None) -> str:
    """The prefix-cache namespace of a request: its key's, salted by its `cache_salt` (vLLM's field);
    "" for a keyless request without a salt. A hash: neither the key nor the salt is kept."""
    if not tenant and cache_salt is None:
        return ""
    return hashlib.sha256(f"{tenant}\0{cache_salt or ''}".encode()).hexdigest()[:32]


def _given_key(request: web.Request) -> bytes:
    """The request's key, from `x-api-key` or `Authorization: Bearer`; a 401 without one."""
    given = request.headers.get("x-api-key")
    authorization = request.headers.get("Authorization", "")
    if given is None and authorization[:7].lower() == "bearer ":
        given = authorization[7:].strip()
    if given is None:
        raise APIError(401, "an API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       code="missing_api_key")
    # aiohttp keeps undecodable header bytes as surrogates: encoded back, such a key just does not match
    return given.encode(errors="surrogateescape")


def _api_key(access: Access):
    expected = [key.encode() for key in access.api_keys]
    metrics_key = access.metrics_key.encode() if access.metrics_key else None

    @web.middleware
    async def api_key(request: web.Request, handler):
        if request.path == METRICS_PATH:
            if metrics_key is None:
                raise APIError(403, "/metrics sums over every tenant, so no tenant key reads it: start the server "
                                    "with --metrics-key KEY and send that key", code="metrics_key_required")
            if not hmac.compare_digest(_given_key(request), metrics_key):
                raise APIError(403, "/metrics answers only the server's --metrics-key", code="metrics_key_required")
        elif expected and request.path not in PUBLIC_PATHS and not request.path.startswith(PUBLIC_PREFIX):
            given = _given_key(request)
            matches = [hmac.compare_digest(given, key) for key in expected]  # each compared, in constant time
            if not any(matches):
                raise APIError(401, "the API key is not valid", code="invalid_api_key")
            request[TENANT] = hashlib.sha256(given).hexdigest()
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
