"""The `ds4-mlx` console command. Each room registers its own sub-command."""

import argparse
import importlib
import sys

# sub-command name -> module that defines `register(subparsers)`; the module's parser sets `func`.
SUBCOMMANDS = {
    "convert": "ds4_mlx.convert.cli",
    "chat": "ds4_mlx.repl",
    "generate": "ds4_mlx.generate_cli",
    "serve": "ds4_mlx.server.cli",
    "bench": "ds4_mlx.tools.bench",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ds4-mlx", description="DeepSeek V4 Flash on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    # import only the room a command needs, so start-up stays fast
    wanted = [argv[0]] if argv and argv[0] in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in wanted:
        importlib.import_module(SUBCOMMANDS[name]).register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # never a traceback for the user: one line naming the problem
        print(f"ds4-mlx {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
