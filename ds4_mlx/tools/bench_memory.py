"""`ds4-mlx bench memory`: what a session holds at real V4 Flash widths.

A real-width 43-layer session is filled by writing rows straight into its caches (no forward pass):
the `RowWriter` below stands in for the model, writing a chunk's rows as the model does (`TokenRing.log`,
compressed rows as blocks complete), so the session chunks, checkpoints and thins exactly as with the
real model, and `session.nbytes` is what a real prefill of that many tokens would hold.
"""

import gc
import sys

import mlx.core as mx

from ds4_mlx.models.args import ModelArgs
from ds4_mlx.models.deepseek_v4 import Model
from ds4_mlx.models.numerics import write_rows


class RowWriter:
    """A stand-in for the model: writes each chunk's rows (raw KV, compressor inputs, compressed and
    indexer rows) into the caches and returns zero logits. Rows come from one fixed random block, so
    the fill costs memory traffic only."""

    def __init__(self, args: ModelArgs, quant_sim=True):
        self.args, self.quant_sim = args, quant_sim
        self.layer_range = range(args.num_hidden_layers)  # every layer, as `Model.make_cache` reads it
        self._blocks = {}
        self._logits = mx.zeros((1, 1, args.vocab_size))

    def make_cache(self, **kwargs):
        return Model.make_cache(self, **kwargs)

    def _block(self, n, width, dtype):
        key = (width, dtype)
        if key not in self._blocks or self._blocks[key].shape[0] < n:
            self._blocks[key] = mx.random.normal((max(n, 256), width)).astype(dtype)
        return self._blocks[key][:n]

    def forward_steps(self, ids, views, *, last_only=True, layers_per_step=None, taps=None):
        """Random rows where the forward writes its rows (`Model.forward_steps`' contract; no taps)."""
        written = []
        for slots, arrays in views[0]:
            arrays = dict(arrays)
            for name in ("raw", "frontier", "index_frontier"):
                at = getattr(slots, name)
                if at is not None:
                    rows = self._block(at.write.shape[0], arrays[name].shape[1], arrays[name].dtype)
                    arrays[name] = write_rows(arrays[name], at.write, rows)
            for name in ("rows", "index_rows"):
                if name in arrays:
                    rows = self._block(slots.pooled, arrays[name].shape[1], arrays[name].dtype)
                    arrays[name] = write_rows(arrays[name], slots.first_row + mx.arange(slots.pooled), rows)
            written.append(arrays)
        return self._logits, [written]
        yield  # a generator, as the model's


def session_parts(session) -> dict:
    """Bytes by kind: token rings, compressed rows (attention and indexer), checkpoints."""
    rings = sum(r.nbytes for c in session.cache for r in c.rings())
    rows = sum(b.nbytes for c in session.cache for b in c.buffers())
    return {"rings": rings, "rows": rows, "checkpoints": session.nbytes - rings - rows}


def bench_memory(a):
    """Session memory at real widths (43 layers) filled to each context length, no forward pass."""
    from ds4_mlx.cache.state import export_session, file_size_bound
    from ds4_mlx.session import Session

    if a.contexts is None:  # 1M tokens of real-width rows take ~8 GB: a CPU here is a test or CI machine
        a.contexts = "4096,8192" if mx.default_device() == mx.cpu else "32768,131072,1048576"
    contexts = sorted(int(c) for c in a.contexts.split(","))
    writer = RowWriter(ModelArgs(), quant_sim=not a.float32)
    session = Session(writer, **({} if a.rewind_slack is None else {"rewind_slack": a.rewind_slack}))
    results, done = [], 0
    for ctx in contexts:
        step = 1 << 20
        while done < ctx:  # sync in pieces so the token list, not the fill, sets the pace
            n = min(step, ctx - done)
            session.sync(session.tokens + [0] * n)
            done += n
        parts = session_parts(session)
        file_bytes = file_size_bound(*export_session(session))  # shapes only: nothing is computed
        row = {"context": ctx, "nbytes": session.nbytes, **parts,
               "bytes_per_token": session.nbytes / ctx, "checkpoints_kept": len(session.checkpoints),
               "file_bytes_at_most": file_bytes}
        results.append(row)
        print(f"{ctx:>9,} tokens: {session.nbytes / 1e9:6.3f} GB  (rings {parts['rings'] / 1e9:.3f}, "
              f"compressed rows {parts['rows'] / 1e9:.3f}, checkpoints {parts['checkpoints'] / 1e9:.3f}; "
              f"{row['bytes_per_token']:,.0f} B/token, {row['checkpoints_kept']} checkpoints); "
              f"saved file <= {file_bytes / 1e9:.3f} GB", file=sys.stderr, flush=True)
    del session
    gc.collect()
    return {"layers": ModelArgs().num_hidden_layers, "quant_sim": not a.float32, "results": results}


def memory_options(q):
    q.add_argument("--contexts", default=None,
                   help="context lengths, comma separated (default: 32768,131072,1048576 on a GPU, 4096,8192 "
                        "on a CPU)")
    q.add_argument("--rewind-slack", type=int, default=None, help="the session's slack (default: Session's)")
    q.add_argument("--float32", action="store_true", help="a quant_sim=False session (float32 rows)")
