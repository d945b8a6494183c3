"""`ds4_mlx.load`: open a `.gguf` file or a converted MLX folder."""

import json
from pathlib import Path

import mlx.core as mx

from ds4_mlx.models import deepseek_v4 as dsv4


def build_model(args, weights: dict, quantization: dict, *, quant_sim: bool):
    model = dsv4.Model(args, quant_sim=quant_sim)
    model.apply_quantization(quantization)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def load(path, *, quant_sim=None):
    """Return (model, tokenizer). `quant_sim=None` simulates FP8/FP4 as the real model was trained
    (ds4 and the official inference do), False computes plain float math as transformers does.
    The tokenizer is None when the file carries none (tiny test models)."""
    from ds4_mlx.tokenizer import Tokenizer

    path = Path(path)
    quant_sim = True if quant_sim is None else quant_sim
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        quantization = config.pop("quantization", {})
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        args = dsv4.ModelArgs.from_dict(config)
        tok = Tokenizer.from_file(path / "tokenizer.json") if (path / "tokenizer.json").exists() else None
        model = build_model(args, weights, quantization, quant_sim=quant_sim)
        model.weight_files = [(f.name, f.stat().st_size) for f in sorted(path.glob("*.safetensors"))]
        return model, tok
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    from ds4_mlx.convert.gguf import GGUFModel

    g = GGUFModel(path)
    quantization = {}
    weights = dict(g.iter_weights(quantization))
    model = build_model(g.args, weights, quantization, quant_sim=quant_sim)
    model.weight_files = [(path.name, path.stat().st_size)]  # names and sizes identify saved sessions' model
    return model, Tokenizer.from_gguf(g.metadata)
