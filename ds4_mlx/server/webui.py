"""The browser page at `/`: static files shipped in the package (server/web), nothing fetched elsewhere."""

from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).parent / "web"

# The page runs only its own script and talks only to this server; model text could never run as code
# even if it reached the DOM as markup (the page builds text nodes, this is a second lock).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers=PAGE_HEADERS)


def routes() -> list:
    return [web.get("/", index), web.static("/web", WEB_DIR)]
