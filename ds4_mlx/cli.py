"""The `ds4-mlx` console command. Each room registers its own sub-command."""

import argparse
import importlib
import sys

# sub-command name -> module that defines `register(subparsers)`; the module's parser sets `func`.
SUBCOMMANDS = {
    "convert": "ds4_mlx.convert.cli",
    "chat": "ds4_mlx.repl",
    "generate": "ds4_mlx.generate",
    "serve": "ds4_mlx.server.cli",
    "bench": "ds4_mlx.bench",
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="ds4-mlx", description="DeepSeek V4 Flash on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as e:  # user errors (bad file, bad flag value): one line, no traceback
        print(f"ds4-mlx {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
