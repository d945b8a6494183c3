"""`POST /tokenize` and `POST /detokenize`, in llama-server's shapes.

    /tokenize   {"content": "text", "with_pieces": false, "add_special": false, "parse_special": true}
                -> {"tokens": [ids]} (with_pieces: {"tokens": [{"id": id, "piece": "text"}]})
    /detokenize {"tokens": [ids]} -> {"content": "text"}

By default the text is tokenized as is: special-token strings (BOS, `<think>`, ...) become their ids and
nothing is added, so the ids are those of the same text inside a rendered prompt. `parse_special: false`
tokenizes them as plain text (as client text in a chat is); `add_special: true` puts BOS first.
"""

import asyncio

from aiohttp import web

from ds4_mlx.chat import Client, Prompt
from ds4_mlx.server import schema
from ds4_mlx.server.errors import APIError
from ds4_mlx.server.fields import field


def routes(server) -> list:
    async def tokenize(request):
        body = await server._body(request)
        schema.check(body, schema.TOKENIZE)
        text = field(body, "content", str, required=True)
        if not field(body, "parse_special", bool, True):
            text = Prompt.join([Client(text)])  # no template spans: every character is plain text
        ids = await server._tokenize(text)
        if field(body, "add_special", bool, False):
            ids = [server.worker.tokenizer.bos_id] + ids
        if not field(body, "with_pieces", bool, False):
            return web.json_response({"tokens": ids})
        pieces = await _off_loop(lambda: [server.worker.tokenizer.decode([i]) for i in ids])
        return web.json_response({"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces)]})

    async def detokenize(request):
        body = await server._body(request)
        schema.check(body, schema.DETOKENIZE)
        ids = field(body, "tokens", list, required=True)
        vocab = server.worker.tokenizer.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"'tokens' must be token ids from 0 to {vocab - 1}, not {bad[0]!r}", param="tokens")
        return web.json_response({"content": await _off_loop(lambda: server.worker.tokenizer.decode(ids))})

    return [web.post("/tokenize", tokenize), web.post("/detokenize", detokenize)]


async def _off_loop(fn):
    return await asyncio.get_running_loop().run_in_executor(None, fn)
