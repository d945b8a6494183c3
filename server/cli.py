"""`ds4-mlx serve`: the OpenAI and Anthropic compatible HTTP server."""

import logging
import sys

from ds4_mlx.cache import add_disk_arguments


def run_serve(args):
    from aiohttp import web

    from ds4_mlx.generate import DEMO_NOTE, load_for_cli
    from ds4_mlx.server.build import build_server

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s",
                        datefmt="%m%d %H:%M:%S")
    log = logging.getLogger("ds4_mlx.server")
    if args.sessions < 1 or args.ctx < 2:
        raise ValueError("--sessions must be at least 1 and --ctx at least 2")
    def load():
        model, tokenizer, is_demo = load_for_cli(args.model)
        if is_demo:
            log.info(DEMO_NOTE)
        return model, tokenizer

    from ds4_mlx.cache import disk_store_from_args

    server = build_server(load, model_id=args.model_id, ctx=args.ctx, sessions=args.sessions,
                          budget_bytes=int(args.cache_gib * 2**30), rewind_slack=args.rewind_slack,
                          checkpoint_every=args.checkpoint_every, disk=disk_store_from_args(args))
    log.info(f"loading the model, then serving {args.model_id} on http://{args.host}:{args.port} "
             f"(ctx {args.ctx}, {args.sessions} live session(s), {args.cache_gib:g} GiB for them)")
    web.run_app(server.app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


def register(subparsers):
    p = subparsers.add_parser("serve", help="serve the OpenAI and Anthropic APIs over HTTP",
                              description="An HTTP server with OpenAI (chat, completions, responses) and "
                                          "Anthropic (messages) APIs. Requests reuse the live session that "
                                          "shares the longest token prefix with their prompt.")
    p.add_argument("-m", "--model", help="a .gguf file or converted MLX folder "
                   "(default: the built-in demo model, random weights: gibberish text)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ctx", type=int, default=32768, help="context length in tokens (default %(default)s)")
    p.add_argument("--sessions", type=int, default=2, help="live sessions kept in memory (default %(default)s)")
    p.add_argument("--cache-gib", type=float, default=16.0,
                   help="memory budget of the live sessions; least recently used ones are emptied beyond it")
    p.add_argument("--model-id", default="deepseek-v4-flash", help="the model name clients use")
    p.add_argument("--rewind-slack", type=int, default=4096, help="tokens a session can trim without replay")
    p.add_argument("--checkpoint-every", type=int, default=2048, help="tokens between session checkpoints")
    add_disk_arguments(p)
    p.set_defaults(func=run_serve)
