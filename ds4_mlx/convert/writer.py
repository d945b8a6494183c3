"""Streaming safetensors shards: arrays are written in row chunks straight to their place in the file.

A shard's JSON header is only known once the shard is full, so each shard reserves room for a
header at its start (the safetensors format allows padding the header with spaces) and fills it
in when closed. Shards get their final `model-0000N-of-0000M` names once M is known.
"""

import json
import os

import numpy as np

ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "U8": 1, "I32": 4}


class ShardWriter:
    def __init__(self, folder, max_shard_bytes, header_capacity):
        self.folder, self.max = folder, max_shard_bytes
        self.cap = (header_capacity + 7) // 8 * 8
        self.shards = []  # [(temporary path, header dict)]
        self.f = None
        self.where = {}  # array name -> (file, absolute offset of its data)

    def add(self, arrays):
        """Reserve space for one tensor's arrays [(name, safetensors dtype, shape)], all in the same shard."""
        sizes = [int(ITEMSIZE[d] * np.prod(s, dtype=np.int64)) for _, d, s in arrays]
        if self.f is None or (self.pos > 0 and self.pos + sum(sizes) > self.max):
            self._open()
        self._last = (self.pos, [name for name, _, _ in arrays])
        self._reserve(arrays)

    def _reserve(self, arrays):
        header = self.shards[-1][1]
        for name, dtype, shape in arrays:
            n = int(ITEMSIZE[dtype] * np.prod(shape, dtype=np.int64))
            header[name] = {"dtype": dtype, "shape": [int(x) for x in shape],
                            "data_offsets": [self.pos, self.pos + n]}
            self.where[name] = (self.f, 8 + self.cap + self.pos)
            self.pos += n

    def replace_last(self, arrays):
        """Reserve the last tensor's arrays again, in place, with new dtypes (float16 -> float32 scales)."""
        start, names = self._last
        header = self.shards[-1][1]
        for name in names:
            del header[name]
        self.pos = start
        self.f.truncate(8 + self.cap + start)
        self._reserve(arrays)

    def write(self, name, byte_offset, array):
        f, base = self.where[name]
        f.seek(base + byte_offset)
        f.write(memoryview(np.ascontiguousarray(array)).cast("B"))

    def _open(self):
        self._close()
        path = os.path.join(self.folder, f"shard-{len(self.shards):05d}.partial")
        self.f, self.pos = open(path, "wb"), 0
        self.shards.append((path, {"__metadata__": {"format": "mlx"}}))

    def _close(self):
        if self.f is None:
            return
        header = json.dumps(self.shards[-1][1], separators=(",", ":")).encode()
        if len(header) > self.cap:
            raise ValueError("internal error: safetensors header larger than reserved")
        self.f.seek(0)
        self.f.write(np.uint64(self.cap).tobytes() + header + b" " * (self.cap - len(header)))
        self.f.close()
        self.f = None

    def finish(self):
        """Close the last shard, give shards their final names, write the index. Returns total bytes."""
        self._close()
        n, weight_map, total = len(self.shards), {}, 0
        for i, (path, header) in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, os.path.join(self.folder, name))
            for k, v in header.items():
                if k != "__metadata__":
                    weight_map[k] = name
                    total += v["data_offsets"][1] - v["data_offsets"][0]
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        return total

    def abort(self):
        if self.f is not None:
            self.f.close()
            self.f = None


def header_capacity(names):
    """Bytes that surely hold a header listing `names` (ints of up to 20 digits, fixed keys)."""
    return 64 + sum(len(n.encode()) + 160 for n in names)
