"""Connections: at most `max_connections` open at once, and none held open by a client that sends nothing.

The time limits are aiohttp's own: its keep-alive timer starts when a connection opens and closes it
while no complete request head has arrived, so one `idle_timeout_s` bounds both a slow request head and
an idle keep-alive connection; the body's read is bounded by the app (`Server.body_timeout_s`). The cap
sits in front of aiohttp's protocol factory: beyond it a new connection gets a 503 and is closed at once,
so a flood of connections cannot use up the process's file descriptors. Each burst of refusals is
logged once when it starts and once when it ends, never per connection.
"""

import asyncio
import logging
import resource

from aiohttp import web

log = logging.getLogger("ds4_mlx.server")

REFUSAL = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n"
SPARE_DESCRIPTORS = 64  # beyond the connections: the model's files, the disk store, the listening socket
# Connections the kernel holds for accept: a burst beyond it has its SYNs dropped and retried after 1, 3,
# 7 s, so even /health would wait seconds (Linux caps it at net.core.somaxconn)
LISTEN_BACKLOG = 1024


class _Refused(asyncio.Protocol):
    def connection_made(self, transport):
        transport.write(REFUSAL)
        transport.close()


class _CappedFactory:
    def __init__(self, server: web.Server, limit: int):
        self.server, self.limit = server, limit
        self.refused = 0  # in the current burst

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) < self.limit:
            if self.refused:
                log.warning(f"accepting connections again: {self.refused} refused at the cap of {self.limit}")
                self.refused = 0
            return self.server()
        if not self.refused:
            log.warning(f"{self.limit} connections open (--max-connections): refusing new ones until some close")
        self.refused += 1
        return _Refused()


class CappedSite(web.SockSite):
    """aiohttp's site on a listening socket, with the connection cap in front of its protocol factory."""

    def __init__(self, runner: web.AppRunner, sock, max_connections: int):
        super().__init__(runner, sock, backlog=LISTEN_BACKLOG)
        self.max_connections = max_connections

    async def start(self):
        await web.BaseSite.start(self)
        factory = _CappedFactory(self._runner.server, self.max_connections)
        self._server = await asyncio.get_running_loop().create_server(factory, sock=self._sock,
                                                                      backlog=self._backlog)


def fit_connection_cap(requested: int) -> int:
    """The cap, raising the soft limit of open files toward the hard one to fit it; a lower cap (with a
    log line) when the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = requested + SPARE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(1, soft - SPARE_DESCRIPTORS)
        log.warning(f"--max-connections {requested} needs {wanted} open files, the limit is {soft}: "
                    f"serving at most {fitted} connections")
        return fitted
    return requested
