"""Reading `deepseek4` GGUF files into MLX arrays, tensor by tensor."""

import numpy as np
import mlx.core as mx
from gguf import GGUFReader, GGMLQuantizationType as T

from ds4_mlx.models import deepseek_v4 as dsv4


def _field_value(field):
    v = field.contents()
    return v


class GGUFModel:
    """A `deepseek4` GGUF file opened memory-mapped. Raises ValueError with one line on bad input."""

    def __init__(self, path):
        try:
            self.reader = GGUFReader(str(path), "r")
        except Exception as e:  # gguf raises many types on corrupt / truncated input
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
        self.metadata = {k: _field_value(f) for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        arch = self.metadata.get("general.architecture")
        if arch != "deepseek4":
            raise ValueError(f"{path}: architecture is {arch!r}, expected 'deepseek4'")
        self.by_name = {t.name: t for t in self.reader.tensors}
        embd = self.by_name.get("token_embd.weight")
        if embd is None:
            raise ValueError(f"{path}: missing tensor token_embd.weight")
        self.args = dsv4.args_from_gguf(self.metadata, vocab_size=int(embd.shape[1]))
        have = {n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n for n in self.by_name}
        for name in dsv4.expected_gguf_names(self.args):
            if name not in have:
                raise ValueError(f"{path}: missing tensor {name}")
        for name in self.by_name:
            if dsv4.mlx_name(name) is None:
                raise ValueError(f"{path}: unknown tensor {name}")

    def iter_weights(self, quantization: dict):
        """Yield (param path, mx.array); record quantized modules' params in `quantization`."""
        for t in self.reader.tensors:
            path = dsv4.mlx_name(t.name)
            yield from convert_tensor(t, path, quantization)


def convert_tensor(t, path, quantization):
    if t.tensor_type in (T.F32, T.F16, T.BF16, T.I32):
        shape = tuple(int(s) for s in reversed(t.shape))
        data = np.asarray(t.data)
        if t.tensor_type == T.BF16:
            arr = mx.array(data.view(np.uint16).reshape(shape)).view(mx.bfloat16).astype(mx.float32)
        else:
            arr = mx.array(data.reshape(shape))
        if t.tensor_type == T.F16:
            arr = arr.astype(mx.float32)
        yield path, arr
        return
    raise ValueError(f"tensor {t.name}: unsupported type {t.tensor_type.name}")
