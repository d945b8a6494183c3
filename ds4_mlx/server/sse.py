"""Server-sent events: one event as bytes, and the keepalive that fills silences."""

import json

COMMENT_KEEPALIVE = b": keepalive\n\n"


def sse(event: str | None, data) -> bytes:
    """`data` is JSON-encoded unless it is already a string (such as OpenAI's [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return ((f"event: {event}\n" if event else "") + f"data: {payload}\n\n").encode()
