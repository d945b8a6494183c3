"""`ds4_mlx.load`: open a converted MLX folder, a `.gguf` file, or llama.cpp's split GGUF shards."""

import json
import os
import sys
from pathlib import Path

import mlx.core as mx

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.deepseek_v4 import Model
from ds4_mlx.models.gguf_names import held_name
from ds4_mlx.models.linear import dequantize_into


def build_model(args, weights: dict, quantization: dict, *, quant_sim: bool, packed_floats=None, layers=None):
    """The model holding `weights`; `quantization` names its quantized modules' formats, `packed_floats`
    the float parameters stored as exact codes (dequantized here, to float32). `layers`: a model holding
    only that range of layers (`Model`), from the weights, formats and packed floats it holds."""
    if layers is not None:
        weights, quantization, packed_floats = (held_part(d or {}, args, layers)
                                                for d in (weights, quantization, packed_floats))
    weights = unpack_floats(weights, packed_floats or {})
    model = Model(args, quant_sim=quant_sim, layers=layers)
    model.apply_quantization(quantization)
    try:
        model.load_weights(list(model.sanitize(weights).items()), strict=True)
    except ValueError as e:  # MLX lists every name, one a line: thousands for a foreign checkpoint
        raise ValueError(_names_in_short(str(e))) from None
    mx.eval(model.parameters())
    return model


def held_part(named: dict, args, layers: range) -> dict:
    """The entries of `named` (by parameter or module name) that a model holding only `layers` holds, under
    its names (`held_name`)."""
    out = {}
    for name, value in named.items():
        held = held_name(name, layers, args.num_hidden_layers)
        if held is not None:
            out[held] = value
    return out


def _names_in_short(message: str) -> str:
    """MLX's "Received N parameters not in model: \\na,\\nb..." as one line naming the first two."""
    head, _, names = message.partition(":")
    names = [n.strip(" ,.") for n in names.split("\n") if n.strip(" ,.")]
    if not names:
        return " ".join(message.split())
    more = f" and {len(names) - 2} more" if len(names) > 2 else ""
    return f"the weights do not fit the model: {head.strip().lower()} ({', '.join(names[:2])}{more})"


def unpack_floats(weights: dict, packed: dict) -> dict:
    """`weights` with each packed float parameter ({path: affine format}) as float32 values. The
    scales go up to float32 first, so codes * scale + bias is computed, exactly, in float32."""
    out = dict(weights)
    for path, fmt in packed.items():
        scales, biases = (out.pop(f"{path}.{part}") for part in ("scales", "biases"))
        out[path] = dequantize_into(mx.float32, out[path], scales, biases, group_size=fmt["group_size"],
                                    bits=fmt["bits"], mode=fmt["mode"])
    return out


def cache_root() -> Path:
    home = os.environ.get("DS4_MLX_HOME")
    return Path(home) if home else Path.home() / ".cache" / "ds4-mlx"


# while a command runs on several machines (`ds4_mlx.distributed.run`): loads this rank's part of a model
# instead, (path) -> (model, tokenizer)
stage_loader = None


def load(path, *, quant_sim=None, progress=True, layers=None):
    """Return (model, tokenizer). `quant_sim=None` simulates FP8/FP4 as the real model was trained
    (ds4 and the official inference do), False computes plain float math as transformers does.
    The tokenizer is None when the file carries none (tiny test models).

    GGUF files load directly: F32/F16/BF16, Q8_0, Q4_K and MXFP4 tensors in an MLX form that holds their
    values, Q2_K / IQ2_XXS / Q4_K routed experts in their own blocks where the machine has a native path
    for them (`gguf_blocks.native_available`). Elsewhere Q2_K / IQ2_XXS experts need requantizing, which
    is done once into a folder under `$DS4_MLX_HOME/converted` (named by the files' size, modification
    time and header hash) and reused.

    `layers`: a model holding only that range of layers (a stage of a pipeline, `ds4_mlx.distributed`),
    which reads only its own tensors."""
    if stage_loader is not None and layers is None:
        return stage_loader(path)
    path = Path(path)
    quant_sim = True if quant_sim is None else quant_sim
    if path.is_dir() and (path / "config.json").is_file():
        return _load_folder(path, quant_sim, layers)
    if path.is_dir() and not any(path.glob("*.gguf")):
        raise ValueError(f"{path}: not a model folder (no config.json); give a .gguf file or a folder made by "
                         "`ds4-mlx convert`")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    from ds4_mlx.convert.gguf import GGUFModel
    from ds4_mlx.tokenizer import Tokenizer

    g = GGUFModel(path)
    if g.needs_requant:
        return _load_folder(_converted_once(g, progress), quant_sim, layers)
    if layers is not None:  # read only the tensors this stage holds
        g.tensors = [t for t in g.tensors if held_name(t.path, layers, g.args.num_hidden_layers)]
    quantization, packed = {}, {}
    weights = dict(g.iter_weights(quantization, packed))
    model = build_model(g.args, weights, quantization, quant_sim=quant_sim, packed_floats=packed, layers=layers)
    model.weight_files = [(path.name, path.stat().st_size)]  # names and sizes identify saved sessions' model
    return model, Tokenizer.from_gguf(g.metadata)


def _load_folder(path, quant_sim, layers=None):
    from ds4_mlx.tokenizer import Tokenizer

    try:
        config = json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'config.json'}: not JSON ({' '.join(str(e).split())})") from None
    _check_converted(path, config)
    quantization = config.pop("quantization", {})
    packed = config.pop("packed_floats", {})
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))  # lazy: a stage of a pipeline reads only the arrays it keeps
    args = ModelArgs.from_dict(config)
    tok = Tokenizer.from_file(path / "tokenizer.json") if (path / "tokenizer.json").exists() else None
    try:
        model = build_model(args, weights, quantization, quant_sim=quant_sim, packed_floats=packed, layers=layers)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    model.weight_files = [(f.name, f.stat().st_size) for f in sorted(path.glob("*.safetensors"))]
    return model, tok


_MADE_BY_CONVERT = "give the model's .gguf file, or a folder made from it by `ds4-mlx convert MODEL.gguf OUT_DIR`"


def _check_converted(path, config):
    """Refuse, in one line, a folder `ds4-mlx convert` did not make: it writes `quantization` and no
    `architectures` (which transformers checkpoints, and folders made from them, carry)."""
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config.json is not a ds4-mlx model's; {_MADE_BY_CONVERT}")
    architectures = config.get("architectures")
    if architectures:
        kind = "an mlx-lm" if "quantization" in config else "a Hugging Face transformers"
        raise ValueError(f"{path}: {kind} checkpoint ({', '.join(map(str, architectures))}), which ds4-mlx does not "
                         f"load (it reads DeepSeek V4 Flash from GGUF files): {_MADE_BY_CONVERT}")
    if "quantization" not in config:
        raise ValueError(f"{path}: config.json is not a ds4-mlx model's (no `quantization` entry); {_MADE_BY_CONVERT}")


def converted_folder(g) -> Path:
    """Where the one-time conversion of GGUF model `g` lives."""
    stem = Path(g.path).name.removesuffix(".gguf")
    return cache_root() / "converted" / f"{stem}-{g.fingerprint()}"


def _converted_once(g, progress):
    from ds4_mlx.convert.cli import convert

    folder = converted_folder(g)
    if (folder / "config.json").exists():
        return folder
    if progress:
        print(f"ds4-mlx: {g.notice}", file=sys.stderr)
        print(f"ds4-mlx: {Path(g.path).name}: converting once into {folder} (later loads reuse it; "
              "`ds4-mlx convert` picks the folder)", file=sys.stderr)
    try:
        convert(g.path, folder, progress=progress, log=lambda msg: None, model=g)
    except ValueError:
        if not (folder / "config.json").exists():  # not a concurrent load that finished first
            raise
    return folder


def load_drafter(path, target, *, experts=None):
    """A speculative drafter for `target` (`ds4_mlx.models.dspark.DSpark` or `ds4_mlx.models.mtp.MTP`) from
    ds4's DSpark or MTP GGUF, or from a folder `ds4-mlx convert` made of one. Raises ValueError naming
    the file and the problem (not a drafter, a tensor that does not fit the target)."""
    path = Path(path)
    if path.is_dir():
        config_file = path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "drafter" not in config:
            raise ValueError(f"{path}: not a converted drafter folder (its config.json names no drafter)")
        quantization, packed = config.pop("quantization", {}), config.pop("packed_floats", {})
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
    elif path.is_file():
        from ds4_mlx.convert.drafters import DrafterGGUF

        g = DrafterGGUF(path, experts=experts)
        config, quantization, packed = g.args.to_dict(), {}, {}
        weights = dict(g.iter_weights(quantization, packed))
    else:
        raise FileNotFoundError(f"{path}: no such file or folder")
    return build_drafter(config, target, weights, quantization, packed, source=path)


def build_drafter(config, target, weights, quantization, packed, *, source="drafter"):
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from ds4_mlx.models.dspark import DSpark, DSparkArgs
    from ds4_mlx.models.mtp import MTP
    from ds4_mlx.precision import keeps_float32

    kind = config["drafter"]
    if kind not in ("dspark", "mtp"):
        raise ValueError(f"{source}: unknown drafter {kind!r}")
    drafter = DSpark(target.args, DSparkArgs.from_dict(config.get("dspark", {}))) if kind == "dspark" else MTP(target.args)
    if quantization:
        nn.quantize(drafter, class_predicate=lambda p, m: quantization.get(p, False))
    try:
        drafter.load_weights(list(drafter.sanitize(unpack_floats(weights, packed)).items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{source}: the {kind} drafter does not fit this model ({' '.join(str(e).split())})") from None
    dtype = target.norm.weight.dtype  # compute as the target does
    if dtype != mx.float32:
        drafter.update(tree_unflatten([(k, v.astype(mx.float32 if keeps_float32(k) else dtype))
                                       for k, v in tree_flatten(drafter.parameters())
                                       if mx.issubdtype(v.dtype, mx.floating)]))
    mx.eval(drafter.parameters())
    return drafter
