"""`ds4-mlx convert MODEL.gguf OUT_DIR`: a `deepseek4` GGUF file to an MLX model folder.

Heavy imports happen inside `convert`, so registering the sub-command costs nothing at start-up.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

from ds4_mlx.convert import EXPERT_BITS, GROUP_SIZES


def register(subparsers):
    p = subparsers.add_parser("convert", help="convert a deepseek4 GGUF file into an MLX model folder",
                              description="Convert a deepseek4 GGUF file into an MLX model folder "
                                          "(config.json, sharded safetensors, tokenizer).")
    p.add_argument("gguf", help="the .gguf file, one of its split shards (NAME-00001-of-0000N.gguf), or their folder")
    p.add_argument("out_dir", help="the folder to create")
    p.add_argument("--shard-size", type=float, default=5.0, metavar="GB", help="largest shard (default 5)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it already exists")
    p.add_argument("--experts", choices=("native", "affine"), default=None,
                   help="native: routed experts in Q2_K / IQ2_XXS / Q4_K keep the file's blocks (exact, the "
                        "file's size); affine: requantize them to MLX affine (--expert-bits). Default: native "
                        "where the machine runs them fast (mlx-kquant installed, or a CUDA GPU), else affine. "
                        "MXFP4 experts become MLX mxfp4 either way (exact)")
    p.add_argument("--expert-bits", "--q-bits", type=int, choices=EXPERT_BITS, default=None,
                   help="affine experts: bits Q2_K and IQ2_XXS experts are requantized to (default 2; "
                        "3 or 4 cost memory and cut the added error)")
    p.add_argument("--group-size", "--q-group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="group size of that format (default 64)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tokenizer", metavar="DIR", help="a folder with the tokenizer.json to use (needed when the "
                   "GGUF file carries no tokenizer; replaces the file's own otherwise)")
    p.set_defaults(func=run)


def run(args):
    start = time.perf_counter()
    out = convert(args.gguf, args.out_dir, shard_gb=args.shard_size, force=args.force, progress=not args.quiet,
                  expert_bits=args.expert_bits, group_size=args.group_size, experts=args.experts,
                  tokenizer_dir=args.tokenizer,
                  require_tokenizer=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"converted {args.gguf} to {out}: {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s")


def convert(gguf_path, out_dir, *, shard_gb=5.0, force=False, progress=True, log=None, expert_bits=None,
            group_size=None, experts=None, model=None, tokenizer_dir=None, require_tokenizer=False):
    """Convert a .gguf file, or llama.cpp's split shards (any shard or their folder); raise ValueError /
    OSError with a one-line message on bad input (nothing written). `model`: an already opened GGUFModel.
    The tokenizer is `tokenizer_dir`'s tokenizer.json if given, else the file's own; with
    `require_tokenizer` (the command line), a model left without one is refused."""
    from ds4_mlx.convert.gguf import GGUFModel

    out = Path(out_dir).resolve()
    if shard_gb <= 0:
        raise ValueError(f"--shard-size must be positive, got {shard_gb}")
    if not Path(gguf_path).exists():
        raise ValueError(f"{gguf_path}: no such file")
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: already exists (use --force to replace it)")
    from ds4_mlx.convert.drafters import DrafterGGUF, is_drafter_gguf

    if model is None and is_drafter_gguf(gguf_path):  # a DSpark or MTP drafter: into a folder of its own
        model = DrafterGGUF(gguf_path, experts=experts)
    if model is None:  # validates before anything is written
        model = GGUFModel(gguf_path, expert_bits=expert_bits, group_size=group_size, experts=experts)
    drafter = isinstance(model, DrafterGGUF)
    tokenizer = None if drafter else _tokenizer(model, gguf_path, tokenizer_dir, require_tokenizer)
    if model.notice:
        (log or (lambda msg: print(f"ds4-mlx: {msg}", file=sys.stderr)))(model.notice)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        _write(model, tmp, int(shard_gb * 1e9), progress, log, tokenizer)
        if out.exists():  # --force or an empty folder: swap in, then drop the old one
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as e:  # Ctrl+C included: leave nothing half-written
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, ValueError, OSError)):
            raise
        raise ValueError(f"{gguf_path}: conversion failed: {' '.join(str(e).split()) or type(e).__name__}") from None
    return out


def _tokenizer(model, gguf_path, tokenizer_dir, required):
    """The tokenizer to save with the model, or None; checked before anything is written."""
    from ds4_mlx.tokenizer import Tokenizer

    if tokenizer_dir is None:
        tokenizer = Tokenizer.from_gguf(model.metadata)
        if tokenizer is None and required:
            raise ValueError(f"{gguf_path}: the file carries no tokenizer, so the model could not read text; give "
                             "one with --tokenizer DIR (a folder with its tokenizer.json)")
        return tokenizer
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{tokenizer_dir}: no tokenizer.json in this folder (--tokenizer)")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises plain Exceptions on a bad file
        raise ValueError(f"{path}: not a tokenizer ({' '.join(str(e).split())})") from None
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(f"{path}: {tokenizer.vocab_size} tokens, more than the model's {model.args.vocab_size}")
    return tokenizer


def _write(model, folder, shard_bytes, progress, log, tokenizer):
    from tqdm import tqdm

    from ds4_mlx.convert.gguf import OpenFiles, tensor_chunks
    from ds4_mlx.convert.writer import ShardWriter, header_capacity

    names = [n for p in model.tensors for n, _, _ in p.outputs()]
    writer = ShardWriter(str(folder), shard_bytes, header_capacity(names))
    quantization, packed = {}, {}
    bar = tqdm(total=model.total_bytes, unit="B", unit_scale=True, desc="converting", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    say = log or (lambda msg: bar.write(msg, file=sys.stdout))
    try:
        with OpenFiles() as files:
            for i, plan in enumerate(model.tensors):
                bar.set_postfix_str(f"tensor {i + 1}/{len(model.tensors)}", refresh=False)
                writer.add(plan.outputs())
                done = 0
                for part in tensor_chunks(files[plan.file], plan, say):
                    if part is None:  # rare: the tensor is redone with float32 scales
                        bar.update(-done)
                        done = 0
                        writer.replace_last(plan.outputs())
                        continue
                    r0, r1, chunk, nbytes = part
                    for name, arr in chunk.items():
                        writer.write(name, r0 * arr[0].nbytes, arr)
                    bar.update(nbytes)
                    done += nbytes
                plan.record(quantization, packed)
        writer.finish()
    finally:
        writer.abort()
        bar.close()
    config = model.args.to_dict()
    config["quantization"] = quantization
    config["packed_floats"] = packed
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save(folder)
