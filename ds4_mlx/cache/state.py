"""A Session saved to one safetensors file, and loaded back.

The file's metadata holds a JSON header (`HEADER_KEY`): format version, model identity, `quant_sim`,
row dtype, the token ids, the layers whose caches it holds (`layer_range`: all of them, or one rank's of a
model split across machines), each layer's `meta_state` and the lane positions; and a checksum over that
header and every tensor. Tensors: `layers.{i}.{name}` (each layer's `state`, with the raw rows of the last
`history` positions so that a rewind that deep after loading replays fewer than 128 tokens),
`lanes.{q}.{i}.{name}` (the compressor rows of the lanes in that range) and `logits`.

Writes are atomic (a temporary file, fsync, rename). A file that is truncated, altered, or written for
another model, `quant_sim` or row dtype raises `StateFileError` and is never applied.
"""

import bisect
import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

FORMAT_VERSION = 1
HEADER_KEY, CHECKSUM_KEY = "ds4_mlx.session", "ds4_mlx.checksum"


class StateFileError(Exception):
    """The file cannot be used: unreadable, corrupt, or for another model or setting."""


def model_identity(model) -> str:
    """A hash of the model config, `quant_sim`, its weight files' names and sizes (set by the loader)
    and the first embedding row, so that a state is only ever loaded into the model that wrote it."""
    probe = getattr(model, "embed", None)
    probe = np.asarray(probe.weight[:1].astype(mx.float32)).tobytes().hex() if probe is not None else None
    facts = {"config": model.args.to_dict(), "quant_sim": bool(getattr(model, "quant_sim", False)), "weights": getattr(model, "weight_files", None), "probe": probe}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def _layer_range(session):
    """[first, stop) of the decoder layers whose caches the session holds: all of them on one machine, one
    rank's range across several (`ds4_mlx.distributed`)."""
    held = getattr(session.model, "layer_range", None)
    held = range(session.model.args.num_hidden_layers) if held is None else held
    return [held.start, held.stop]


def _row_dtype(session):
    return str(session.cache[0].raw.dtype).split(".")[-1]


def export_session(session, history=256):
    """(arrays, header) for `session` at its current position."""
    pos = len(session.tokens)
    # lanes, and full checkpoints used as lanes: their raw rows come from the saved run of raw rows
    lanes = sorted(q for q, cp in session.checkpoints.items()
                   if pos - history <= q < pos and all(c.can_restore(layer) and q - c.ring_needs(q)[0] >= c.raw.floor
                                                       for c, layer in zip(session.cache, cp)))
    # the rows a trim in place back to `trim_from` needs (what the live session could still trim to)
    lowest = max(0, pos - history)
    trim_from = lowest + bisect.bisect_left(range(lowest, pos + 1), True,  # trimmable from some position on
                                            key=lambda q: all(c.can_trim(q) for c in session.cache))
    arrays = {}
    for i, c in enumerate(session.cache):
        for name, rows in c.export_state(back_to=min([trim_from] + lanes)).items():
            arrays[f"layers.{i}.{name}"] = rows
        names = [n for n, _ in c.named_rings()]
        for q in lanes:
            for name, rows in zip(names, session.checkpoints[q][i]["rows"]):
                if name != "raw" and rows is not None:
                    arrays[f"lanes.{q}.{i}.{name}"] = rows
    if session.logits is not None:
        arrays["logits"] = session.logits.astype(mx.float32)
    header = {"format": FORMAT_VERSION, "model": model_identity(session.model),
              "quant_sim": bool(getattr(session.model, "quant_sim", False)), "row_dtype": _row_dtype(session),
              "tokens": list(session.tokens), "layers": [c.meta_state for c in session.cache], "lanes": lanes,
              "clean": session.clean, "trim_from": trim_from, "layer_range": _layer_range(session)}
    return {k: v for k, v in arrays.items() if v.size}, header  # empty arrays are implied by the header


def _checksum(header_json: str, arrays: dict) -> str:
    h = hashlib.blake2b(header_json.encode(), digest_size=32)
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def file_size_bound(arrays, header) -> int:
    """An upper bound of the file size (for the disk budget, before writing)."""
    return (sum(a.nbytes for a in arrays.values()) + len(json.dumps(header)) + 160 * len(arrays) + 4096)


def write_state_file(path, arrays, header):
    """Write atomically: a temporary file in the same folder, fsync, rename, fsync the folder."""
    from safetensors.numpy import save_file

    path = Path(path)
    mx.eval(list(arrays.values()))
    tensors = {k: np.asarray(v) for k, v in arrays.items()}
    header_json = json.dumps(header)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={HEADER_KEY: header_json, CHECKSUM_KEY: _checksum(header_json, tensors)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path.stat().st_size


def read_header(path) -> dict:
    """The JSON header alone (not checked against the checksum: for indexing, never for loading)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return json.loads(f.metadata()[HEADER_KEY])
    except Exception as e:  # noqa: BLE001 - any failure means the file is unusable
        raise StateFileError(f"unreadable: {type(e).__name__}: {e}") from e


def read_state_file(path):
    """(arrays as numpy, header) after checking the checksum; StateFileError otherwise."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
        header_json, checksum = meta[HEADER_KEY], meta[CHECKSUM_KEY]
        header = json.loads(header_json)
    except Exception as e:  # noqa: BLE001 - truncated, not safetensors, no header: all unusable
        raise StateFileError(f"unreadable: {type(e).__name__}: {e}") from e
    if _checksum(header_json, arrays) != checksum:
        raise StateFileError("checksum mismatch")
    if header.get("format") != FORMAT_VERSION:
        raise StateFileError(f"format {header.get('format')}, expected {FORMAT_VERSION}")
    return arrays, header


def check_compatible(session, header):
    held, mine = header.get("layer_range"), _layer_range(session)
    if held is not None and held != mine:  # (older files name no range: the model identity still tells)
        raise StateFileError(f"holds the caches of layers {held[0]} to {held[1] - 1}, this process holds layers "
                             f"{mine[0]} to {mine[1] - 1} (the model split across ranks another way)")
    expected = {"model": model_identity(session.model),
                "quant_sim": bool(getattr(session.model, "quant_sim", False)), "row_dtype": _row_dtype(session)}
    for key, value in expected.items():
        if header.get(key) != value:
            raise StateFileError(f"written for another {key.replace('_', ' ')}")


def import_session(session, arrays, header):
    """Make `session` hold the saved state (after `check_compatible`); StateFileError if it does not fit."""
    check_compatible(session, header)
    before = session.snapshot()
    session.reset()
    try:
        layers = header["layers"]
        if len(layers) != len(session.cache):
            raise ValueError(f"{len(layers)} layers, the model has {len(session.cache)}")
        for i, (c, meta) in enumerate(zip(session.cache, layers)):
            widths = {**{n: r.width for n, r in c.named_rings()}, **{n: b.width for n, b in c.named_buffers()}}
            state = {n: mx.array(arrays[f"layers.{i}.{n}"]) if f"layers.{i}.{n}" in arrays else mx.zeros((0, w))
                     for n, w in widths.items()}
            c.load_state(state, meta)
        tokens = [int(t) for t in header["tokens"]]
        if any(c.pos != len(tokens) for c in session.cache):
            raise ValueError("layer positions differ from the token count")
        for q in header["lanes"]:
            lane = []
            for i, c in enumerate(session.cache):
                rows = [None if n == "raw" else mx.array(arrays[f"lanes.{q}.{i}.{n}"])
                        if f"lanes.{q}.{i}.{n}" in arrays else mx.zeros((0, r.width)) for n, r in c.named_rings()]
                lane.append({"pos": int(q), "rows": rows})
            session.checkpoints[int(q)] = lane
        session.tokens = tokens
        session.clean = min(int(header.get("clean", 0)), len(tokens))
        session.logits = mx.array(arrays["logits"]) if "logits" in arrays else None
        mx.eval([c.arrays() for c in session.cache], [] if session.logits is None else session.logits)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, the session is as it was
        session.restore(before)
        raise StateFileError(f"does not fit the model: {type(e).__name__}: {e}") from e
