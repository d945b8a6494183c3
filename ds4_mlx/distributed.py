"""One model over several machines: a pipeline of layer ranges on MLX's distributed layer (`mx.distributed`).

Every process runs the same command, started by `mlx.launch` (docs/distributed.md). Rank r holds a
contiguous range of the decoder layers, balanced by their bytes in the model file (`plan_layers`), with
their caches; rank 0 also holds the embedding, the last rank the head. A forward passes the residual
streams from rank to rank (`mx.distributed.send` / `recv`), and the last rank's logits go back to rank 0.

Speculative decoding (`--mtp`): the drafter runs on rank 0, beside the sampler and the acceptance rule, with
a copy of the LM head (rank 0 holds the embedding already). The streams it reads (`cache.taps.TapLog`) travel
down the pipeline with the residual streams, from the ranks whose layers make them, and back to rank 0 with
the logits: of each forward, only the last rows the log keeps.

Sessions run in lockstep: rank 0 runs the command (generate, chat, serve) and decides; each session
operation it makes (new, sync, step, trim, reset, snapshot, restore, save, load, ...) is first broadcast to
the other ranks as its name and arguments (`Leader`), and every rank runs the same `Session` code on its own
layers' caches (`follow`). Where a session decides from its caches (can a rewind trim in place, is a
checkpoint whole) the ranks agree first (`RankSession._everywhere`), so all take the same branch and a
rewind is as exact as on one machine. The disk store is rank 0's to decide as well (`LockstepStore`): each
rank writes and reads its own layers' file of an entry as rank 0 orders (`PartFolder`).

A rank that fails or leaves: the ring backend raises on the others' next exchange with it, and an exchange
that waits longer than `DS4_MLX_RANK_TIMEOUT` seconds stops the process; rank 0 reports it in one line and
the others stop.
"""

import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import mlx.core as mx

from ds4_mlx import cache, loader
from ds4_mlx.cache.geometry import lane_every
from ds4_mlx.cache.state import (StateFileError, export_session, file_size_bound, model_identity, read_header,
                                 write_state_file)
from ds4_mlx.cache.store import LOCK, DiskStore, lock_folder, log
from ds4_mlx.models.deepseek_v4 import run_to_end
from ds4_mlx.session import Session, step_together

BROADCAST_BYTES = 512  # an order up to this long goes to the other ranks in one exchange
RANK_TIMEOUT_S = 600.0
BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")  # how MLX's backends begin an exchange's error  # longest wait for another rank: a prefill chunk of the largest model fits in it


class RankLost(BaseException):
    """Another rank of the pipeline failed or left. It ends the command, as KeyboardInterrupt does: no
    handler of one request's failure (the server's, the REPL's) takes it for that request's alone."""


def launched():
    """Whether this process is one of several started by `mlx.launch` (or MPI)."""
    return bool(os.environ.get("MLX_HOSTFILE") or os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_SIZE")) \
        and mx.distributed.is_available()


class Group:
    """This process's place in the group, and the exchanges between ranks, each waited for at most
    `timeout_s` seconds (then the process stops: a receive cannot be cancelled)."""

    def __init__(self, group=None, timeout_s=None):
        self.group = group if group is not None else mx.distributed.init(strict=True)
        self.rank, self.size = self.group.rank(), self.group.size()
        self.timeout_s = float(os.environ.get("DS4_MLX_RANK_TIMEOUT", RANK_TIMEOUT_S)) if timeout_s is None else timeout_s
        self.lost = None  # what the first failed exchange said: the backend may hang on any exchange after it

    def wait(self, arrays, what, *, forever=False):
        """Evaluate `arrays` (which send to or receive from other ranks); `forever`: with no time limit (a
        rank waiting for rank 0's next order, which may come after hours of an idle server)."""
        def give_up():
            print(f"ds4-mlx: rank {self.rank}: no answer from the other ranks for {self.timeout_s:g} s while {what}; "
                  "stopping (DS4_MLX_RANK_TIMEOUT sets the wait)", file=sys.stderr, flush=True)
            os._exit(3)

        if self.lost is not None:
            raise RankLost(self.lost)
        timer = threading.Timer(self.timeout_s, give_up)
        timer.daemon = True
        if not forever:
            timer.start()
        try:
            mx.eval(arrays)
        except RuntimeError as e:
            if not str(e).startswith(BACKEND_ERRORS):  # this rank's own computation failed
                raise
            self.lost = f"rank {self.rank} lost another rank of the pipeline while {what} ({e})"
            raise RankLost(self.lost) from None
        finally:
            timer.cancel()
        return arrays

    def agree(self, holds):
        """Whether `holds` is true on every rank."""
        dissent = mx.distributed.all_sum(mx.array([0 if holds else 1], mx.int32), group=self.group)
        return self.wait(dissent, "agreeing on a cache decision").item() == 0

    def broadcast(self, message=None, *, forever=False):
        """Rank 0's `message` (JSON) on every rank; the others pass nothing and wait for it. It goes down the
        pipeline, each rank passing it on to the next (the links the streams take, in the same order); one
        exchange a link for a short message (its length and itself in `BROADCAST_BYTES`), a second for the rest.
        `forever`: wait for it with no time limit."""
        data = json.dumps(message).encode() if self.rank == 0 else b""
        head = (len(data).to_bytes(4, "little") + data)[:BROADCAST_BYTES].ljust(BROADCAST_BYTES, b"\0")
        head = self._pass_bytes(head, BROADCAST_BYTES, "waiting for rank 0's next order", forever)
        n, got = int.from_bytes(head[:4], "little"), head[4:]
        if n > len(got):
            got += self._pass_bytes(data[len(got) :], n - len(got), "receiving rank 0's order")
        return json.loads(got[:n].decode())

    def _pass_bytes(self, data, n, what, forever=False):
        """Rank 0's `n` bytes `data` on every rank: received from the rank before, sent on to the next."""
        if self.rank:
            data = mx.distributed.recv((n,), mx.uint8, self.rank - 1, group=self.group)
            data = bytes(memoryview(self.wait(data, what, forever=forever)))
        if self.rank + 1 < self.size:
            self.send(mx.array(list(data), mx.uint8), self.rank + 1, "passing on rank 0's order")
        return data

    def send(self, x, to, what):
        self.wait(mx.distributed.send(x, to, group=self.group), what)

    def recv(self, shape, dtype, source, what):
        return self.wait(mx.distributed.recv(shape, dtype, source, group=self.group), what)


# -------------------------------------------------------------------------------------------------------
# Which rank holds which layers


def tensor_bytes(path) -> dict:
    """{parameter name: bytes} of a model file, a set of split shards or a converted folder, from the
    headers alone (GGUF tensor table, safetensors header)."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        sizes = {}
        for f in sorted(path.glob("*.safetensors")):
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            sizes.update({name: t["data_offsets"][1] - t["data_offsets"][0]
                          for name, t in header.items() if name != "__metadata__"})
        return sizes
    from ds4_mlx.convert.gguf import GGUFModel

    return {t.path: t.nbytes for t in GGUFModel(path).tensors}


def plan_layers(sizes: dict, n_layers: int, ranks: int, rank_0_extra: int = 0) -> list:
    """Contiguous layer ranges, one a rank, with the largest rank's bytes as small as can be; rank 0 also
    holds the embedding and `rank_0_extra` bytes (a drafter and a copy of the head), the last rank the head
    (`sizes`: bytes by parameter name)."""
    if ranks > n_layers:
        raise ValueError(f"{ranks} ranks for {n_layers} layers: at most one rank a layer")
    layer = [0] * n_layers
    embed = head = 0
    for name, nbytes in sizes.items():
        m = re.match(r"layers\.(\d+)\.", name)
        if m:
            layer[int(m.group(1))] += nbytes
        elif name.split(".")[0] == "embed":
            embed += nbytes
        else:
            head += nbytes
    before = list(itertools.accumulate(layer, initial=0))

    def load(rank, a, b):
        return before[b] - before[a] + (embed + rank_0_extra if rank == 0 else 0) + (head if rank == ranks - 1 else 0)

    # best[r][b]: the smallest largest load of ranks 0..r holding layers [0, b); cut[r][b]: where rank r starts
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(ranks)]
    cut = [[0] * (n_layers + 1) for _ in range(ranks)]
    for b in range(1, n_layers + 1):
        best[0][b] = load(0, 0, b)
    for r in range(1, ranks):
        for b in range(r + 1, n_layers + 1):
            for a in range(r, b):
                worst = max(best[r - 1][a], load(r, a, b))
                if worst < best[r][b]:
                    best[r][b], cut[r][b] = worst, a
    ranges, b = [], n_layers
    for r in range(ranks - 1, 0, -1):
        a = cut[r][b]
        ranges.append(range(a, b))
        b = a
    ranges.append(range(0, b))
    return ranges[::-1]


def plan_model(path, ranks, drafters=()) -> list:
    """`plan_layers` for the model at `path`, rank 0 also holding the `drafters` files and then a copy of
    the head (`Stage.hold_head`)."""
    sizes = tensor_bytes(path)
    layer = re.compile(r"layers\.(\d+)\.")
    n_layers = 1 + max(int(m.group(1)) for m in map(layer.match, sizes) if m)
    extra = 0
    if drafters:
        extra = sum(b for name, b in sizes.items() if not layer.match(name) and name.split(".")[0] != "embed")
        for drafter in map(Path, drafters):
            extra += sum(f.stat().st_size for f in ([drafter] if drafter.is_file() else drafter.glob("*.safetensors")))
    return plan_layers(sizes, n_layers, ranks, extra)


# -------------------------------------------------------------------------------------------------------
# This rank's part of the model


class Stage:
    """This rank's layers with the pipeline's forward: what a `Session` calls on a model (`make_cache`,
    `forward`, `forward_steps`), passing streams on to the next rank. Rank 0 gets the logits (float32,
    exactly the last rank's); the other ranks get a placeholder of one value a row."""

    def __init__(self, model, group: Group, ranges):
        self.model, self.group, self.ranges = model, group, ranges
        self.args, self.quant_sim = model.args, model.quant_sim
        self.layer_range = ranges[group.rank]
        # what names a saved session's model (`cache.state.model_identity`): each rank saves its own layers
        self.weight_files = getattr(model, "weight_files", None), [self.layer_range.start, self.layer_range.stop]
        self.embed = getattr(model, "embed", None)
        self.first, self.last = group.rank == 0, group.rank == group.size - 1

    def hold_head(self, path):
        """Rank 0 also holds the LM head of the model at `path` (read from the file alone): a drafter on
        rank 0 computes its logits with it (`ds4_mlx.speculative`)."""
        from ds4_mlx.loader import load

        n = self.args.num_hidden_layers
        head, _ = load(path, quant_sim=self.quant_sim, progress=False, layers=range(n, n))
        self.lm_head, self.norm = head.lm_head, head.norm

    def make_cache(self, **options):
        return self.model.make_cache(**options)

    def forward(self, ids, views, *, last_only=False, taps=None):
        """`Model.forward` over the pipeline: ids int32 [B, T]; `views` this rank's layers' views of each
        session. -> (logits [B, T or 1, vocab] on rank 0, each session's arrays written by this rank's
        layers); one exchange a link for all B sessions. Changes no cache. `taps`: as `Model.forward`'s, on
        rank 0 (the streams of one session, B = 1: the last rows the drafter's log keeps; of B sessions, all).
        The other ranks pass the same keys: each passes on the streams its layers make."""
        return run_to_end(self.forward_steps(ids, views, last_only=last_only, taps=taps))

    def forward_steps(self, ids, views, *, last_only=False, layers_per_step=None, taps=None):
        """`Model.forward_steps` over the pipeline. With `layers_per_step`, the pieces are the whole model's:
        every rank pauses after every that many layers counted from the model's first, those of other
        ranks included, so that all pause as often and at the same points (rank 0 orders each next piece).
        The streams cross from rank to rank within the piece that holds the last layer before the
        boundary, and the logits within the last piece: no exchange is left open while other sessions' steps
        run between two pieces."""
        with self._in_step():
            return (yield from self._pieces(ids, views, last_only, layers_per_step, taps))

    @contextlib.contextmanager
    def _in_step(self):
        """A step that fails here leaves the ranks out of step (the others wait for this one's streams, or
        hold caches this one lacks): this rank stops, and the others learn it from their next exchange."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            print(f"ds4-mlx: rank {self.group.rank}: a forward failed ({type(e).__name__}: {e}); the ranks can no "
                  "longer keep step: stopping", file=sys.stderr, flush=True)
            os._exit(1)

    def _pieces(self, ids, views, last_only, layers_per_step, taps):
        B, T = ids.shape
        kept = B * T if B > 1 or taps is None else min(T, self._tap_rows_kept())
        flat = ids.reshape(-1)
        positions = mx.concatenate([v[0][0].positions for v in views]) if B > 1 else views[0][0][0].positions
        n, held = self.args.num_hidden_layers, self.layer_range
        ends = [*range(layers_per_step, n, layers_per_step), n] if layers_per_step else [n]
        streams = self.model._streams(flat) if self.first else None
        written = [[] for _ in views]
        begin = 0
        for end in ends:
            if not self.first and begin < held.start <= end:  # the previous rank's last layer is in this piece
                streams = self._received_streams(flat)
                self._receive_taps(taps, self.group.rank - 1, kept)
            for i in range(max(begin, held.start), min(end, held.stop)):
                streams, steps = self.model.layers[i - held.start](streams, flat, positions,
                                                                   [v[i - held.start] for v in views], self.quant_sim)
                for mine, step in zip(written, steps):
                    mine.append(step)
                if taps is not None and i in taps:
                    taps[i] = streams[-kept:]
            if not self.last and begin < held.stop <= end:  # this rank's last layer is in this piece
                self.group.send(streams, self.group.rank + 1, "passing on the streams of a forward")
                self._send_taps(taps, self.group.rank + 1)
            if end < n:
                mx.eval([] if streams is None else streams, written)
                yield
            begin = end
        if self.last and taps is not None and "final" in taps:
            taps["final"] = streams[-kept:]
        return self._logits(streams, B, 1 if last_only else T, taps, kept), written

    def _tap_rows_kept(self):
        """How many of a session's last rows a drafter's log keeps (`Speculation.attach`): no more need to
        reach rank 0."""
        from ds4_mlx.speculative import TAP_SLACK

        return self.args.sliding_window + TAP_SLACK

    def _passed_taps(self, taps, through):
        """The keys of `taps` that ranks 1 to `through` make (rank 0 keeps its own), in the order of `taps`."""
        if taps is None:
            return []
        last = self.group.size - 1
        return [k for k in taps if 1 <= (last if k == "final" else self._holder(k)) <= through]

    def _holder(self, layer):
        return next(r for r, held in enumerate(self.ranges) if layer in held)

    def _send_taps(self, taps, to):
        """The tapped streams made from rank 1 up to this one, on to rank `to`, in one exchange."""
        keys = self._passed_taps(taps, self.group.rank)
        if keys:
            self.group.send(mx.stack([taps[k] for k in keys]), to, "passing on the streams a drafter reads")

    def _receive_taps(self, taps, source, rows):
        """Into `taps`: the tapped streams made from rank 1 up to rank `source` (of `rows` rows), from it."""
        keys = self._passed_taps(taps, source)
        if keys:
            shape = (len(keys), rows, self.args.hc_mult, self.args.hidden_size)
            got = self.group.recv(shape, mx.float32, source, "receiving the streams a drafter reads")
            for i, k in enumerate(keys):
                taps[k] = got[i]

    def _received_streams(self, ids):
        if not self.model.quant_sim and self.model.layers[0].attn_norm.weight.dtype == mx.float32:
            from ds4_mlx.precision import exact_float32

            exact_float32()
        shape = (ids.shape[0], self.args.hc_mult, self.args.hidden_size)
        return self.group.recv(shape, mx.float32, self.group.rank - 1, "receiving the streams of a forward")

    def _logits(self, streams, B, rows, taps, kept):
        """The last rank's logits of each of B sessions' last `rows` positions [B, rows, vocab], on rank 0;
        a placeholder [B, rows, 1] elsewhere (`streams` [B * T, hc, H]: the last rank's, whole, as the next
        ranks' caches need every position). The tapped streams of the other ranks (`kept` rows) follow them."""
        g = self.group
        if self.last:
            tail = streams.reshape(B, -1, *streams.shape[1:])[:, -rows:]
            logits = self.model._logits(tail.reshape(B * rows, *streams.shape[1:])).reshape(B, rows, -1)
            if self.first:
                return logits
            g.send(logits, 0, "passing on the logits of a forward")
            self._send_taps(taps, 0)
        elif self.first:
            logits = g.recv((B, rows, self.args.vocab_size), mx.float32, g.size - 1,
                            "receiving the logits of a forward")
            self._receive_taps(taps, g.size - 1, kept)
            return logits
        return mx.zeros((B, rows, 1))


def load_stage(path, group: Group, *, quant_sim=None, progress=True, drafters=()):
    """(Stage, tokenizer): this rank's layers of the model at `path` (the same file, shards or folder on
    every machine; each reads only its own tensors), the ranges planned on rank 0 (which also holds the
    `drafters` files, if any, and then a copy of the head). None when rank 0 has no model to load (its
    command ended before)."""
    from ds4_mlx.loader import load

    ranges = None
    if group.rank == 0:
        ranges = [[r.start, r.stop] for r in plan_model(path, group.size, drafters)]
    ranges = group.broadcast(ranges, forever=True)  # rank 0's command may take its time to load
    if ranges is None:  # rank 0's command ended before it loaded a model
        return None
    ranges = [range(a, b) for a, b in ranges]
    model, tokenizer = load(path, quant_sim=quant_sim, progress=progress and group.rank == 0,
                            layers=ranges[group.rank])
    if model.args.num_hidden_layers != ranges[-1].stop:
        raise ValueError(f"{path}: {model.args.num_hidden_layers} layers here, rank 0's file has {ranges[-1].stop}")
    return Stage(model, group, ranges), tokenizer


# -------------------------------------------------------------------------------------------------------
# Sessions in lockstep


class RankSession(Session):
    """A `Session` of one rank's layers: its cache decisions agreed with the other ranks, its lanes spaced
    as the whole model's, its saved state in a file of its own (`part_path`)."""

    def reset(self):
        super().reset()
        ratios = lane_every(self.model.args.compress_ratios)  # the whole model's: every rank takes the same lanes
        self.lane_every = math.lcm(ratios, self.max_chunk) if ratios else None

    def _everywhere(self, holds):
        return self.model.group.agree(holds)

    def save(self, path, **options):
        return super().save(part_path(path, self.model.group.rank), **options)

    def load(self, path):
        self.load_part(part_path(path, self.model.group.rank))

    def load_part(self, path):
        """Hold the part of a saved session at `path` (this rank's file). Every rank loads its part, or none
        does: a part that does not fit, or that holds other tokens than rank 0's (a file from another save),
        is an error on every rank."""
        group = self.model.group
        before, error = self.snapshot(), None
        try:
            super().load(path)
        except (StateFileError, OSError) as e:
            error = e
        tokens = hashlib.sha256(json.dumps(self.tokens).encode()).hexdigest() if error is None else None
        first = group.broadcast({"tokens": tokens, "lanes": sorted(self.checkpoints)} if group.rank == 0 else None)
        if error is None and tokens != first["tokens"]:
            error = StateFileError(f"rank {group.rank}'s part holds other tokens than rank 0's (another save?)")
        if not self._everywhere(error is None):
            if error is None:
                self.restore(before)
            raise error if error is not None else StateFileError("another rank's part of the saved session does not "
                                                                 "fit (its own error is on its console)")
        # keep the lanes every rank holds (each file has those its own layers could still restore)
        held = mx.array([int(q in self.checkpoints) for q in first["lanes"]] or [0], mx.int32)
        held = group.wait(mx.distributed.all_sum(held, group=group.group), "agreeing on the saved lanes").tolist()
        self.checkpoints = {q: self.checkpoints[q] for q, n in zip(first["lanes"], held) if n == group.size}


class TapRelay:
    """A session's stand-in for a drafter's `TapLog` on ranks other than 0: its forwards ask for the streams
    rank 0's log records (this rank's pass on towards rank 0, `Stage`), and it keeps none."""

    def __init__(self, keys):
        self.keys = tuple(keys)

    def request(self):
        return {k: None for k in self.keys}

    def record(self, start, taps, chunk=None):
        pass

    def trim(self, n):
        pass

    def restart(self, pos):
        pass

    def snapshot(self):
        return None


def part_path(path, rank):
    """Where rank `rank` keeps its part of a saved session: rank 0 at `path`, the others beside it."""
    return Path(path) if rank == 0 else Path(f"{path}.rank{rank}")


class Leader:
    """Rank 0's side: sessions whose every operation is ordered on all ranks first."""

    def __init__(self, group: Group, stage=None):
        self.group, self.stage = group, stage
        self.store = None  # the disk store (`LockstepStore`), if the command made one
        self.ids = itertools.count()
        self.drafters = []  # the files of drafters that run on rank 0 (`Stage.hold_head`)
        self.forgotten = []  # sessions and snapshots rank 0 dropped: the others drop theirs with the next order

    def order(self, *message):
        forgotten, self.forgotten = self.forgotten, []
        self.group.broadcast([forgotten, *message])

    def session(self, **options):
        return LockstepSession(self, **options)

    def finish(self):
        """Tell the other ranks that the command is done."""
        self.order("exit")


class LockstepSession:
    """A `Session` on rank 0 whose operations every rank runs on its own layers (`follow`). Reads
    (tokens, logits, last_sync, nbytes of rank 0's part) are the local session's."""

    # ordered on every rank when set to another value
    _SETTINGS = ("max_chunk", "rewind_slack", "checkpoint_every", "frontier_horizon", "recent_checkpoints",
                 "exact_rewinds", "layers_per_turn")

    def __init__(self, leader: Leader, **options):
        object.__setattr__(self, "_leader", leader)
        object.__setattr__(self, "_id", next(leader.ids))
        leader.order("new", self._id, options)
        object.__setattr__(self, "_local", RankSession(leader.stage, **options))
        weakref.finalize(self, leader.forgotten.append, self._id)

    def __getattr__(self, name):
        return getattr(self._local, name)

    def __setattr__(self, name, value):
        if name in self._SETTINGS and getattr(self._local, name) != value:  # (a server sets some every turn)
            self._leader.order("set", self._id, name, value)
        if name == "tap_log":  # a drafter's log: the other ranks' forwards pass on the streams it reads
            self._leader.order("taps", self._id, None if value is None else list(value.keys))
        setattr(self._local, name, value)

    def _order(self, method, *args):
        self._leader.order("call", self._id, method, *args)
        return getattr(self._local, method)(*args)

    def sync(self, prompt_ids, *, on_chunk=None):
        from ds4_mlx.session import SyncInterrupted

        for done, total in self.sync_steps(prompt_ids):
            if on_chunk is not None and on_chunk(done, total) and done < total:
                raise SyncInterrupted(f"stopped after {done} of {total} prompt tokens")
        return self.logits

    def sync_steps(self, prompt_ids):
        """`Session.sync_steps`, one chunk at a time on every rank: each rank steps its own generator when
        rank 0 asks for the next chunk, and drops it when rank 0 stops."""
        prompt = [int(t) for t in prompt_ids]
        self._leader.order("sync", self._id, prompt)
        steps = self._local.sync_steps(prompt)
        try:
            while True:
                self._leader.order("next", self._id)
                try:
                    done = next(steps)
                except StopIteration:
                    return
                yield done
        finally:
            self._leader.order("stop", self._id)

    def step(self, token_id):
        return self._order("step", int(token_id))

    def step_async(self, token):
        """`Session.step_async`: the token is read here (the other ranks need its id)."""
        self.step(int(token.reshape(-1)[0].item()))
        return self._local.logits

    def settle(self):
        return self._local.settle()

    def trim(self, n, *, logits=None):
        """`Session.trim`; `logits` (a verify's row) are rank 0's alone: the others hold none."""
        self._leader.order("call", self._id, "trim", int(n))
        return self._local.trim(int(n), logits=logits)

    def verify(self, ids):
        return self._order("verify", [int(t) for t in ids])

    def reset(self):
        return self._order("reset")

    def save(self, path, **options):
        self._leader.order("call", self._id, "save", str(path), options)
        return self._local.save(path, **options)

    def load(self, path):
        return self._order("load", str(path))

    def snapshot(self):
        snap_id = next(self._leader.ids)
        self._leader.order("snapshot", self._id, snap_id)
        return _Snapshot(self._leader, snap_id, self._local.snapshot())

    def restore(self, snapshot):
        self._leader.order("restore", self._id, snapshot.id)
        self._local.restore(snapshot.state)

    @staticmethod
    def step_together(sessions, tokens):
        """`session.step_together` for sessions in lockstep: every rank steps its own together."""
        leader = sessions[0]._leader
        ids = [int(t) for t in tokens.reshape(-1).tolist()]
        leader.order("together", [s._id for s in sessions], ids)
        return step_together([s._local for s in sessions], mx.array(ids, mx.int32))


class _Snapshot:
    """A snapshot held on every rank: rank 0's state, and the id the other ranks keep theirs under until
    this handle is dropped (sessions are forgotten the same way)."""

    def __init__(self, leader, snap_id, state):
        self.id, self.state = snap_id, state
        weakref.finalize(self, leader.forgotten.append, snap_id)


# -------------------------------------------------------------------------------------------------------
# The disk store in lockstep


class LockstepStore(DiskStore):
    """The disk store (`ds4_mlx.cache.store`) of sessions in lockstep, on rank 0. Rank 0 keeps the index and
    decides every hit, miss and eviction; an entry is one file a rank under one name, each holding its own
    layers' caches (and naming them in its header, so that a file of another split is refused): rank 0's in
    the folder, rank r's in the folder's `rank{r}` subfolder on its own machine (`PartFolder`). An entry is
    written, read and deleted on every rank or on none. Its size is its largest file's: the budget holds
    for each rank's folder."""

    def __init__(self, leader: Leader, directory, budget_mb, **options):
        self.leader, self.joined = leader, False
        super().__init__(directory, budget_mb, **options)
        leader.store = self
        if leader.stage is not None:  # else once the model is loaded: the other ranks wait for it until then
            self.join()

    def join(self):
        """Bring in the other ranks' folders: each keeps its files of this index's entries (those that fit
        its layers) and deletes the rest; an entry that some rank lacks is deleted. A rank that cannot use
        its folder leaves the store unused for this run, as one process goes on without a folder it cannot
        use."""
        entries = list(self.entries.values())
        self._order("join", str(self.dir), [e.name for e in entries])
        rows = gathered(self.leader.group, [1] + [e.size for e in entries], "opening the disk store")
        failed = [rank for rank, row in enumerate(rows) if not row[0]]
        if failed:
            log.warning(f"kv disk: rank {', '.join(map(str, failed))} cannot use its folder (its error is on its "
                        "console); going on without the disk store: no session is saved or restored")
            return
        self.joined = True
        for e, sizes in zip(entries, list(zip(*rows))[1:]):
            if min(sizes):
                e.size = max(sizes)
            else:
                self._delete(e, "missing-part")
        self._write_index()

    # unused until every rank has its folder
    def save(self, session, reason, namespace: str = ""):
        return super().save(session, reason, namespace) if self.joined else None

    def find(self, model, prompt, namespace: str = ""):
        return super().find(model, prompt, namespace) if self.joined else None

    def latest(self, reason=None):
        return super().latest(reason) if self.joined else None

    def _order(self, what, *args):
        self.leader.order("disk", what, *args)

    def _export(self, session, namespace):
        part, bound = super()._export(session, namespace)
        self._order("bound", session._id, self.history, namespace)
        return part, max(_everyones(self.leader.group, bound, "sizing a stored session", "export its part"))

    def _write(self, session, name, part):
        self._order("write", session._id, name, self.history, part[1]["namespace"])
        return _written_everywhere(self.leader.group, self.dir / name,
                                   lambda: super(LockstepStore, self)._write(session, name, part))

    def _import(self, session, name):
        self._order("load", session._id, name)
        session._local.load_part(self.dir / name)

    def _unlink(self, name):
        super()._unlink(name)
        if self.joined:
            self._order("delete", name)

    def _indexed(self, entry, path) -> bool:
        return entry is not None and entry.size >= path.stat().st_size  # an entry's size is its largest file's


class PartFolder:
    """Rank r's side of the disk store (r > 0): its files of rank 0's entries, in the store folder's `rank{r}`
    subfolder, written, read and deleted as rank 0 orders (`LockstepStore`)."""

    def __init__(self, stage: Stage):
        self.stage, self.dir = stage, None

    def join(self, directory, names):
        group, held = self.stage.group, set(names)
        try:
            self.dir = Path(directory) / f"rank{group.rank}"
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock_file = lock_folder(self.dir)
            identity = model_identity(self.stage)
            sizes = [self._size_if_fits(self.dir / name, identity) for name in names]
            for path in self.dir.iterdir():
                if path.is_file() and path.name != LOCK and path.name not in held:  # rank 0 knows no such entry
                    path.unlink()  # (or its write was cut short)
            usable = 1
        except OSError as e:
            print(f"ds4-mlx: rank {group.rank}: kv disk: cannot use {self.dir}: {e}", file=sys.stderr, flush=True)
            usable, sizes = 0, [0] * len(names)
        gathered(group, [usable] + sizes, "opening the disk store")

    def bound(self, session, history, namespace):
        error = None
        try:
            bound = file_size_bound(*self._export(session, history, namespace))
        except Exception as e:  # noqa: BLE001 - told to every rank, then raised (`follow` prints it)
            bound, error = -1, e
        _everyones(self.stage.group, bound, "sizing a stored session", "export its part")
        if error is not None:
            raise error

    def write(self, session, name, history, namespace):
        _written_everywhere(self.stage.group, self.dir / name,
                            lambda: write_state_file(self.dir / name, *self._export(session, history, namespace)))

    def load(self, session, name):
        session.load_part(self.dir / name)

    def delete(self, name):
        (self.dir / name).unlink(missing_ok=True)

    @staticmethod
    def _export(session, history, namespace):
        arrays, header = export_session(session, history)
        header["namespace"] = namespace
        return arrays, header

    @staticmethod
    def _size_if_fits(path, identity):
        """The size of the file at `path` if it holds this rank's layers of this model, else 0."""
        try:
            header = read_header(path)
        except StateFileError:
            return 0
        return path.stat().st_size if header.get("model") == identity else 0  # (the identity names the layers)


def gathered(group: Group, values, what):
    """Every rank's `values` (integers) on every rank: one list a rank."""
    every = mx.distributed.all_gather(mx.array(values, mx.int64), group=group.group)
    return group.wait(every, what).reshape(group.size, -1).tolist()


def _everyones(group: Group, value, what, failed):
    """Every rank's `value`; OSError on every rank where one is negative (that rank could not `failed`)."""
    values = [row[0] for row in gathered(group, [value], what)]
    if min(values) < 0:
        raise OSError(f"rank {values.index(min(values))} could not {failed} (its error is on its console)")
    return values


def _written_everywhere(group: Group, path, write):
    """`write()` on every rank, each writing its own file at `path` -> the largest file's size. Where any rank
    failed, every rank deletes its file and raises."""
    error = None
    try:
        size = write()
    except Exception as e:  # noqa: BLE001 - told to every rank first
        size, error = -1, e
    try:
        return max(_everyones(group, size, "writing a stored session", "write its part"))
    except OSError as elsewhere:
        path.unlink(missing_ok=True)
        raise error or elsewhere from None


def follow(stage: Stage):
    """The other ranks' side: run rank 0's orders on this rank's sessions until it says exit. An error in
    an order is rank 0's too (the same code on the same arguments), which reports it; this rank goes on."""
    sessions, snapshots, steps = {}, {}, {}
    group, parts = stage.group, PartFolder(stage)
    while True:
        forgotten, kind, *rest = group.broadcast(forever=True)
        for dropped in forgotten:  # one numbering for both
            sessions.pop(dropped, None)
            snapshots.pop(dropped, None)
        try:
            if kind == "exit":
                return
            if kind == "new":
                sid, options = rest
                sessions[sid] = RankSession(stage, **options)
            elif kind == "set":
                sid, name, value = rest
                setattr(sessions[sid], name, value)
            elif kind == "taps":
                sid, keys = rest
                sessions[sid].tap_log = None if keys is None else TapRelay(keys)
            elif kind == "call":
                sid, method, *args = rest
                if method == "save":
                    sessions[sid].save(args[0], **args[1])
                else:
                    getattr(sessions[sid], method)(*args)
            elif kind == "sync":
                sid, prompt = rest
                steps[sid] = sessions[sid].sync_steps(prompt)
            elif kind == "next":
                next(steps[rest[0]], None)
            elif kind == "stop":
                steps.pop(rest[0], None)
            elif kind == "snapshot":
                sid, snap_id = rest
                snapshots[snap_id] = sessions[sid].snapshot()
            elif kind == "restore":
                sid, snap_id = rest
                sessions[sid].restore(snapshots[snap_id])
            elif kind == "together":
                sids, ids = rest
                step_together([sessions[s] for s in sids], mx.array(ids, mx.int32))
                for s in sids:
                    sessions[s].settle()
            elif kind == "disk":  # the disk store: join, bound, write, load or delete (`LockstepStore`)
                what, *args = rest
                if what in ("bound", "write", "load"):
                    args[0] = sessions[args[0]]
                getattr(parts, what)(*args)
            else:
                raise ValueError(f"unknown order {kind!r}")
        except RankLost:
            raise
        except Exception as e:  # noqa: BLE001 - rank 0 meets the same error and reports it
            print(f"ds4-mlx: rank {group.rank}: {kind}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------------
# The command on every rank

# rank 0's leader while a launched command runs (`run`); None on one machine
_leader = None
# how long rank 0 stays after its command: mlx.launch stops reading a process's output when it exits
LINGER_S = 0.5


def new_session(model, **options):
    """A session of `model`: in lockstep on every rank when the command runs on several (rank 0's model is
    then a `Stage`), else a plain `Session`."""
    if isinstance(model, Stage):
        return _leader.session(**options)
    return Session(model, **options)


def run(args, command):
    """Run the parsed CLI command (`args.model`: the model, or the demo model) on the launched group: rank 0
    runs `command(args)`, its model's load giving its `Stage`, its sessions in lockstep and its disk store
    a `LockstepStore`; the others load their layers and follow rank 0 until it is done, printing nothing
    but errors."""
    global _leader
    group = Group() if launched() else None
    if group is None or group.size == 1:
        return command(args)
    if group.rank != 0:
        return _follow_command(args, group)
    _leader = Leader(group)
    loader.stage_loader = _load_rank_0
    cache.store_factory = lambda directory, budget_mb, **options: LockstepStore(_leader, directory, budget_mb,
                                                                                **options)
    mtp = getattr(args, "mtp", None)  # a drafter runs on rank 0, which then holds the head too
    _leader.drafters = [mtp] if isinstance(mtp, str) else list(mtp or ())  # (a test's tool passes several)
    lost = False
    try:
        return command(args)
    except RankLost as e:
        lost = True
        print(f"ds4-mlx: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        finish(others_there=not lost)


def finish(*, others_there=True):
    """Rank 0's command is done: tell the other ranks so (they stop), and wait a moment for mlx.launch to
    read what this rank printed last. `run` does this as the command returns; a command that leaves with
    `os._exit` (the server) calls it first. Does nothing on one machine, or a second time."""
    global _leader
    leader, _leader, loader.stage_loader, cache.store_factory = _leader, None, None, None
    if leader is None:
        return
    try:
        if others_there and leader.stage is None:
            leader.group.broadcast(None)  # the command ended before loading a model: the others wait for none
        elif others_there:
            leader.finish()
    except RankLost:
        pass  # they are gone already
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(LINGER_S)


def _load_rank_0(path):
    if _leader.stage is not None:
        raise ValueError("a command launched on several ranks loads one model")
    try:
        stage, tokenizer = load_stage(path, _leader.group, drafters=_leader.drafters)
        if _leader.drafters:
            stage.hold_head(path)
        _leader.stage = stage
        if _leader.store is not None:  # made before the model (the server's)
            _leader.store.join()
    except RankLost as e:  # a load that failed, reported as any other (the server loads on a thread of its own)
        raise RuntimeError(str(e)) from None
    return stage, tokenizer


def _follow_command(args, group):
    from ds4_mlx.demo import demo_model_path

    sys.stdout = open(os.devnull, "w")  # rank 0 alone speaks
    # rank 0 decides when the ranks stop: at Ctrl+C or SIGTERM a server saves its sessions on every rank
    # before it says exit, so this rank follows until then (or until rank 0 is gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        loaded = load_stage(getattr(args, "model", None) or demo_model_path(), group, progress=False)
        if loaded is not None:
            follow(loaded[0])
    except RankLost as e:
        print(f"ds4-mlx: {e}; stopping", file=sys.stderr, flush=True)
        return 1
    return 0
