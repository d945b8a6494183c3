"""`ds4-mlx serve`: the OpenAI and Anthropic compatible HTTP server.

The port is bound first, so a busy port fails at once; the model loads after, while `/health` answers
`loading` and generation requests get 503; a `ready:` line says when requests are served.
"""

import asyncio
import errno
import logging
import os
import signal
import socket
import sys

from ds4_mlx.cache import add_disk_arguments

THINKING_NOTE = ("thinking is on by default for the OpenAI APIs: answers start with reasoning (reasoning_content); "
                 "the model name deepseek-chat answers directly; /v1/messages thinks only when a request enables "
                 "\"thinking\"")


def run_serve(args):
    from ds4_mlx.chat import release_of
    from ds4_mlx.demo import DEMO_NOTE, load_for_cli
    from ds4_mlx.server.build import build_server
    from ds4_mlx.server.connections import fit_connection_cap
    from ds4_mlx.server.middleware import Access

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s",
                        datefmt="%m%d %H:%M:%S")
    log = logging.getLogger("ds4_mlx.server")
    if args.sessions < 1 or args.ctx < 2:
        raise ValueError("--sessions must be at least 1 and --ctx at least 2")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.prefill_chunk < 1 or args.shared_prefill_layers < 1 or args.batch < 1:
        raise ValueError("--prefill-chunk, --shared-prefill-layers and --batch must be at least 1")
    if args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    if args.max_body_mb is not None and args.max_body_mb <= 0:
        raise ValueError("--max-body-mb must be more than 0")
    if any(not key.strip() for key in args.api_key or ()):
        raise ValueError("--api-key must not be empty")
    if args.metrics_key is not None and (not args.metrics_key.strip() or args.metrics_key in (args.api_key or ())):
        raise ValueError("--metrics-key must not be empty nor one of the --api-key keys")

    from ds4_mlx.speculative import server_generate, speculation_from_args

    speculation = speculation_from_args(args)

    def load():  # runs on the worker thread once the app starts, so `server` below is set
        model, tokenizer, is_demo = load_for_cli(args.model)
        if is_demo:
            log.info(DEMO_NOTE)
        if speculation:
            speculation(model)  # the drafter, loaded with the model
        server.info.ctx = fit_context(args.ctx, model.args.max_position_embeddings, log)
        server.info.chat_release = release_of(tokenizer and tokenizer.config.get("chat_template"), args.model)
        return model, tokenizer

    from ds4_mlx.cache import disk_store_from_args

    server = build_server(load, model_id=args.model_id, ctx=args.ctx, sessions=args.sessions,
                          budget_bytes=int(args.cache_gib * 2**30), rewind_slack=args.rewind_slack,
                          checkpoint_every=args.checkpoint_every, prefill_chunk=args.prefill_chunk,
                          shared_prefill_layers=args.shared_prefill_layers,
                          exact_rewinds=args.exact_rewinds, batch=args.batch,
                          max_tokens=args.max_tokens,
                          **({"generate": server_generate(speculation, log.info)} if speculation else {}),
                          disk=disk_store_from_args(args),
                          max_body_bytes=int(args.max_body_mb * 2**20) if args.max_body_mb else None,
                          max_connections=fit_connection_cap(args.max_connections),
                          access=Access(api_keys=tuple(args.api_key or ()), cors_origins=tuple(args.cors or ()),
                                        allowed_hosts=tuple(h.lower() for h in args.allowed_host or ()),
                                        metrics_key=args.metrics_key))
    sock = listen(args.host, args.port)
    code = asyncio.run(serve(server, sock, log))
    # Everything is answered, saved and closed by now. Leave without the interpreter's teardown: it frees
    # MLX's compile cache after MLX's stream threads, which aborts the process ("terminate called without
    # an active exception", exit 134) instead of exiting 0.
    from ds4_mlx import distributed

    distributed.finish()  # across several ranks: the others stop too (`distributed.run` would after a return)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fit_context(requested: int, model_max: int, log) -> int:
    """The context to serve: --ctx, or the model's own limit when --ctx asks for more."""
    if requested <= model_max:
        return requested
    log.warning(f"--ctx {requested} is more than this model's context of {model_max} tokens: serving {model_max}")
    return model_max


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, before anything loads: a busy port is refused at once."""
    from ds4_mlx.server.connections import LISTEN_BACKLOG

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be from 0 to 65535, not {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}: {e.strerror}") from None
    try:
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as e:
        hint = " (another server is running there? pick another with --port)" if e.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}{hint}") from None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(server, sock: socket.socket, log) -> int:
    """Serve until SIGINT or SIGTERM (exit 0, also during the model load) or the worker's death (exit 1)."""
    loop = asyncio.get_running_loop()
    signalled = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: signalled.done() or signalled.set_result(sig))
    runner = server.runner()
    await runner.setup()  # starts loading the model in the background
    try:
        await server.serve_on(runner, sock)
        url = url_of(sock)
        log.info(f"listening on {url}; loading the model ({url}/health says \"loading\" until it is ready)")
        await _first_of(server.loaded, signalled)
        if signalled.done():
            log.info(f"{signal.Signals(signalled.result()).name} during the model load: stopped without serving")
            return 0
        server.loaded.result()  # a failed load raises here
        info, n = server.info, len(server.worker.slots)
        log.info(f"serving {info.model_id} (ctx {info.ctx}, {n} live session(s))")
        log.info(THINKING_NOTE)
        log.info(f"ready: {url} (OpenAI: /v1, Anthropic: /v1/messages)")
        await _first_of(signalled, server.worker_died.wait())
        if not signalled.done():
            log.error("the worker thread died (see above); exiting with status 1 so that a supervisor restarts "
                      "the server")
            return 1
        log.info(f"{signal.Signals(signalled.result()).name}: shutting down; open requests get an error"
                 + (", sessions are saved to the disk store" if server.worker.disk is not None else ""))
        return 0
    finally:
        await runner.cleanup()
        log.info("stopped")


async def _first_of(*waits):
    """Wait until one of the futures or coroutines is done; the others are left running (futures) or
    cancelled (coroutines)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for wait, task in zip(waits, tasks):
        if task is not wait:
            task.cancel()


def register(subparsers):
    p = subparsers.add_parser("serve", help="serve the OpenAI and Anthropic APIs over HTTP",
                              description="An HTTP server with OpenAI (chat, completions, responses) and "
                                          "Anthropic (messages) APIs. Requests reuse the live session that "
                                          "shares the longest token prefix with their prompt.")
    p.add_argument("-m", "--model", help="a .gguf file or converted MLX folder "
                   "(default: the built-in demo model, random weights: gibberish text)")
    p.add_argument("--host", default="127.0.0.1", help="(default %(default)s; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="(default %(default)s; 0 picks a free port)")
    p.add_argument("--ctx", type=int, default=32768,
                   help="context length in tokens, at most the model's (default %(default)s)")
    p.add_argument("--sessions", type=int, default=2, help="live sessions kept in memory (default %(default)s)")
    p.add_argument("--cache-gib", type=float, default=16.0,
                   help="memory budget of the live sessions; least recently used ones are emptied beyond it "
                        "(default %(default)s)")
    p.add_argument("--model-id", default="deepseek-v4-flash", help="the model name clients use (default %(default)s)")
    p.add_argument("--rewind-slack", type=int, default=4096, help="tokens a session can trim without replay (default %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=2048, help="tokens between session checkpoints (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="prompts are computed in chunks that end at multiples of this many tokens, whatever runs "
                        "beside them; longer chunks prefill faster on a GPU and hold more memory while they run "
                        "(default %(default)s)")
    p.add_argument("--shared-prefill-layers", type=int, default=1,
                   help="layers of a prompt's chunk computed a turn while other streams run; each of them waits "
                        "about that long for its next token (default %(default)s)")
    p.add_argument("--exact-rewinds", action="store_true",
                   help="every request gets a cold prefill's numbers bit for bit, whatever its session held: no "
                        "trim in place, a replay from the chunk grid instead (up to a chunk more computed a request)")
    p.add_argument("--batch", "--batched-session", type=int, default=4,
                   help="streams decoded together in one forward at most (ds4's --batched-session); each "
                        "still samples, stops and aborts on its own (default %(default)s)")
    p.add_argument("--max-tokens", type=int, help="most tokens any request may generate (default: the "
                   "context); a request asking for more stops there with finish reason length")
    p.add_argument("--max-body-mb", type=float, help="refuse request bodies longer than this (default: 4, or "
                   "32 bytes a token of --ctx when that is more)")
    p.add_argument("--max-connections", type=int, default=2048,
                   help="open connections served at once; more get a 503 (default %(default)s)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require this key from clients, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(/health stays open); repeatable: each key is a tenant whose cached prefixes no other "
                        "key reuses or learns about")
    p.add_argument("--metrics-key", metavar="KEY",
                   help="the key /metrics asks for; its counters sum over every tenant, so with --api-key it "
                        "answers this key only, and without --metrics-key it is refused")
    p.add_argument("--cors", action="append", metavar="ORIGIN",
                   help="let web pages from ORIGIN call the server (repeatable; * for any origin); requests "
                        "from other pages than the server's own are refused")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a name clients may reach the server by, besides loopback names and IP addresses "
                        "(repeatable; a request with another Host is refused, against DNS rebinding)")
    add_disk_arguments(p)
    from ds4_mlx.speculative import add_arguments as add_speculation_arguments

    add_speculation_arguments(p)
    p.set_defaults(func=run_serve)
