"""The `ds4-mlx` console command. Each room registers its own sub-command."""

import argparse
import importlib
import os
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
    parser.add_argument("--no-kernels", action="store_true",
                        help="run every custom GPU kernel's plain definition instead (as DS4_MLX_KERNELS=0)")
    sub = parser.add_subparsers(dest="command", required=True)
    # import only the room a command needs, so start-up stays fast
    command = next((a for a in argv if not a.startswith("-")), None)
    wanted = [command] if command in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in wanted:
        importlib.import_module(SUBCOMMANDS[name]).register(sub)
    args = parser.parse_args(argv)
    if args.no_kernels:
        from ds4_mlx.models import kernels

        os.environ["DS4_MLX_KERNELS"] = "0"  # for the processes a command starts too
        kernels.use_kernels(False)
    try:
        if any(os.environ.get(v) for v in ("MLX_HOSTFILE", "MLX_RANK", "OMPI_COMM_WORLD_SIZE")):  # by mlx.launch
            from ds4_mlx import distributed

            return distributed.run(args, args.func) or 0
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # never a traceback for the user: one line naming the problem
        print(f"ds4-mlx {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
