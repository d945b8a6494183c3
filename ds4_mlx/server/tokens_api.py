"""`POST /tokenize` and `POST /detokenize`, in llama-server's shapes.

    /tokenize   {"content": "text", "with_pieces": false} -> {"tokens": [ids]}
                (with_pieces: {"tokens": [{"id": id, "piece": "text"}]})
    /detokenize {"tokens": [ids]} -> {"content": "text"}

The text is tokenized as is: special-token strings (BOS, `<think>`, ...) become their ids and nothing is
added, so the ids are those of the same text inside a rendered prompt.
"""

import asyncio

from aiohttp import web

from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field


def routes(server) -> list:
    async def tokenize(request):
        body = await server._body(request)
        text = field(body, "content", str, required=True)
        ids = await server._tokenize(text)
        if not field(body, "with_pieces", bool, False):
            return web.json_response({"tokens": ids})
        pieces = await _off_loop(lambda: [server.worker.tokenizer.decode([i]) for i in ids])
        return web.json_response({"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces)]})

    async def detokenize(request):
        body = await server._body(request)
        ids = field(body, "tokens", list, required=True)
        vocab = server.worker.tokenizer.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"'tokens' must be token ids from 0 to {vocab - 1}, not {bad[0]!r}", param="tokens")
        return web.json_response({"content": await _off_loop(lambda: server.worker.tokenizer.decode(ids))})

    return [web.post("/tokenize", tokenize), web.post("/detokenize", detokenize)]


async def _off_loop(fn):
    return await asyncio.get_running_loop().run_in_executor(None, fn)
