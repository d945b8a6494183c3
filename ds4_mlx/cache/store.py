"""The disk KV store: saved sessions under one folder, found again by token prefix, within a byte budget.

- Each file is a saved `Session` (`ds4_mlx.cache.state`), written atomically with a checksum.
- `index.json` lists the files with the hashes of their token prefixes at the positions each file can
  restore cheaply (its end, and every 128th position of the saved rewind history), so a lookup hashes
  the prompt once and finds the longest stored prefix without opening any file.
- A file that turns out corrupt, truncated or foreign (another model, `quant_sim` or row dtype) is
  logged, deleted and never used; the request goes on without it.
- The folder (files, temporary file and index) never exceeds the budget: before a write, files are
  evicted by value per byte, value = (1 + hits) halved every `half_life_s` since the last use, so a
  short prefix that many requests share outlives long conversations read once.

Every public method after the constructor logs a failure (a full disk, a folder removed underneath) and
answers as if nothing was stored, never raising: the disk is a cache, its caller goes on without it.

One process uses a folder at a time: it holds a lock on the folder's `.lock` file while it lives, and a
second process (another server, a REPL) is refused before it reads or deletes anything there.
"""

import fcntl
import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ds4_mlx.cache.state import (StateFileError, export_session, file_size_bound,
                                 import_session, model_identity, read_header, read_state_file, write_state_file)

log = logging.getLogger("ds4_mlx.kv_disk")

INDEX, SUFFIX, LOCK = "index.json", ".kv.safetensors", ".lock"


class FolderInUse(OSError):
    """Another process holds the folder."""


def lock_folder(directory):
    """Hold `directory`'s lock (its `.lock` file) until this process ends; FolderInUse if another process
    holds it. A POSIX record lock (lockf) belongs to the process, so stores opened again in one process (a
    restart in a test) share it."""
    directory = Path(directory)
    lock_file = open(directory / LOCK, "a+")
    try:
        fcntl.lockf(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock_file.seek(0)
        holder = lock_file.read().strip()
        lock_file.close()
        raise FolderInUse(f"{directory} is in use by another ds4-mlx process"
                          + (f" (pid {holder})" if holder else "")
                          + ": give each server its own --kv-disk-dir") from None
    lock_file.truncate(0)
    lock_file.write(str(os.getpid()))
    lock_file.flush()
    return lock_file


@dataclass
class Entry:
    name: str
    model: str  # model identity
    tokens: int
    keys: dict  # {prefix length: prefix hash} for the positions this file restores cheaply
    size: int
    reason: str  # evict, shutdown, prefill, chat
    namespace: str = ""  # the tenant whose prefixes these are (its hashes are salted with it)
    hits: int = 0
    last_used: float = 0.0
    created: float = field(default_factory=time.time)


def prefix_hashes(tokens, lengths, namespace: str = "") -> dict:
    """{length: hash of tokens[:length]} for each length, in one pass over the tokens; salted with the
    namespace (vLLM's `cache_salt`), so no lookup matches another namespace's prefix."""
    ids = np.asarray(tokens, dtype=np.int32)
    h, done, out = hashlib.blake2b(namespace.encode(), digest_size=16), 0, {}
    for n in sorted(set(lengths)):
        h.update(ids[done:n].tobytes())
        done = n
        out[n] = h.hexdigest()
    return out


def _never_raises(default=None):
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the disk is a cache: its failure costs a recompute
                log.warning(f"kv disk: {method.__name__} failed, going on without it: {type(e).__name__}: {e}")
                return default
        return guarded
    return wrap


class DiskStore:
    def __init__(self, directory, budget_mb, *, history=256, index_every=128, min_tokens=256,
                 prefill_every=8192, half_life_s=6 * 3600, clock=time.time):
        self.dir = Path(directory)
        self.budget = int(budget_mb * 2**20)
        self.history, self.index_every, self.min_tokens = history, index_every, min_tokens
        self.prefill_every, self.half_life_s, self.clock = prefill_every, half_life_s, clock
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_file = lock_folder(self.dir)
        self.entries: dict[str, Entry] = {}
        self._identities = {}  # id(model) -> identity
        self._bound_to = None
        self._index_bytes = 0
        self._open()

    # -- public ------------------------------------------------------------------------------
    @_never_raises()
    def save(self, session, reason, namespace: str = "") -> Entry | None:
        """Write `session` (if long enough and not already stored) for `namespace`; returns its entry."""
        n = len(session.tokens)
        if n < self.min_tokens:
            return None
        identity = self._bind(session.model)
        full_key = prefix_hashes(session.tokens, [n], namespace)[n]
        for e in self.entries.values():
            if e.model == identity and e.keys.get(str(n)) == full_key:
                e.last_used = self.clock()  # already restorable from this file
                self._write_index()
                return e
        try:
            part, bound = self._export(session, namespace)
            if bound + self._index_reserve > self.budget:
                log.warning(f"kv disk: a {n}-token session ({bound / 2**20:.1f} MiB) exceeds the "
                            f"{self.budget / 2**20:.0f} MiB budget; not saved")
                return None
            self._make_room(bound)
            name = f"{full_key}{SUFFIX}"
            t = time.perf_counter()
            size = self._write(session, name, part)
        except Exception as e:  # noqa: BLE001 - a failed save must not fail the request
            log.warning(f"kv disk: saving a {n}-token session failed: {type(e).__name__}: {e}")
            return None
        entry = Entry(name, identity, n, self._keys(session.tokens, part[1], namespace), size, reason,
                      last_used=self.clock(), namespace=namespace)
        for old in [e for e in self.entries.values() if e.model == identity and e.name != name
                    and e.namespace == namespace
                    and entry.keys.get(str(e.tokens)) == e.keys.get(str(e.tokens))]:
            entry.hits += old.hits  # the new file restores the old one's end: it takes its place
            self._delete(old, "covered")
        self.entries[name] = entry
        self._write_index()
        log.info(f"kv disk: stored tokens={n} reason={reason} size={size / 2**20:.2f} MiB "
                 f"save={(time.perf_counter() - t) * 1000:.0f} ms file={name}")
        return entry

    @_never_raises()
    def find(self, model, prompt, namespace: str = "") -> tuple[Entry, int] | None:
        """The stored file of `namespace` sharing the longest prefix with `prompt`, and that prefix's length."""
        identity = self._bind(model)
        candidates = {}
        for e in self.entries.values():
            if e.model == identity and e.namespace == namespace:
                for length, key in e.keys.items():
                    if int(length) <= len(prompt):
                        candidates.setdefault(int(length), {})[key] = e
        if not candidates:
            return None
        hashes = prefix_hashes(prompt, candidates, namespace)
        for length in sorted(candidates, reverse=True):
            entry = candidates[length].get(hashes[length])
            if entry is not None:
                return entry, length
        return None

    @_never_raises(False)
    def load(self, session, entry) -> bool:
        """Make `session` hold `entry`'s state; a bad file is logged, deleted, and False returned."""
        t = time.perf_counter()
        try:
            self._import(session, entry.name)
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, foreign: the request goes on cold
            log.warning(f"kv disk: {entry.name} is unusable ({type(e).__name__}: {e}); deleted")
            self._delete(entry, "unusable")
            self._write_index()
            return False
        entry.hits += 1
        entry.last_used = self.clock()
        self._write_index()
        log.info(f"kv disk: hit tokens={entry.tokens} hits={entry.hits} "
                 f"load={(time.perf_counter() - t) * 1000:.0f} ms file={entry.name}")
        return True

    def load_longer_prefix(self, session, prompt, shared, namespace: str = "") -> int:
        """Before serving `prompt` of `namespace` from `session`, which shares `shared` tokens with it:
        load the stored file with a longer shared prefix, if any. Returns the tokens now shared."""
        found = self.find(session.model, prompt, namespace)
        if found is None or found[1] < shared + self.index_every:
            return shared
        entry, length = found
        return length if self.load(session, entry) else shared

    @_never_raises()
    def during_prefill(self, session, namespace: str = ""):
        """Called after each prefill chunk: save at every multiple of `prefill_every` tokens."""
        if self.prefill_every and session.tokens and len(session.tokens) % self.prefill_every == 0:
            self.save(session, "prefill", namespace)

    def latest(self, reason=None) -> Entry | None:
        entries = [e for e in self.entries.values() if reason is None or e.reason == reason]
        return max(entries, key=lambda e: e.last_used, default=None)

    @_never_raises()
    def remove(self, entry):
        self._delete(entry, "replaced")
        self._write_index()

    @property
    def used_bytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    # -- the files ----------------------------------------------------------------------------
    def _export(self, session, namespace):
        """((arrays, header) of `session`'s file, a bound of the file's size)."""
        arrays, header = export_session(session, self.history)
        header["namespace"] = namespace  # so that an index rebuilt from the files keeps it
        return (arrays, header), file_size_bound(arrays, header)

    def _write(self, session, name, part) -> int:
        """Write `part` (from `_export`) as the file `name`; its size."""
        return write_state_file(self.dir / name, *part)

    def _import(self, session, name):
        """Make `session` hold the file `name`; StateFileError (the session unchanged) if it cannot."""
        import_session(session, *read_state_file(self.dir / name))  # checks the header against the session first

    def _unlink(self, name):
        (self.dir / name).unlink(missing_ok=True)

    def _indexed(self, entry, path) -> bool:
        """Whether the index's `entry` still describes the file at `path`."""
        return entry is not None and entry.size == path.stat().st_size

    # -- internals ----------------------------------------------------------------------------
    def _bind(self, model) -> str:
        """The model's identity; the first time, files of any other model are deleted."""
        identity = self._identities.get(id(model))
        if identity is None:
            identity = self._identities[id(model)] = model_identity(model)
        if self._bound_to != identity:
            self._bound_to = identity
            foreign = [e for e in self.entries.values() if e.model != identity]
            for e in foreign:
                log.warning(f"kv disk: {e.name} was written by another model or setting; deleted")
                self._delete(e, "foreign")
            if foreign:
                self._write_index()
        return identity

    def _value(self, e: Entry) -> float:
        age = max(0.0, self.clock() - e.last_used)
        return (1 + e.hits) * 0.5 ** (age / self.half_life_s) / max(e.size, 1)

    def _make_room(self, incoming: int):
        while self.entries and self.used_bytes + incoming + self._index_reserve > self.budget:
            victim = min(self.entries.values(), key=lambda e: (self._value(e), e.last_used))
            self._delete(victim, "budget")
        self._write_index()

    def _delete(self, entry, why):
        self.entries.pop(entry.name, None)
        self._unlink(entry.name)
        log.info(f"kv disk: removed tokens={entry.tokens} hits={entry.hits} size={entry.size / 2**20:.2f} MiB "
                 f"reason={why} file={entry.name}")

    @_never_raises()  # files are indexed again from their headers when the index is missing or stale
    def _write_index(self):
        tmp = self.dir / f".{INDEX}.{os.getpid()}.tmp"
        text = json.dumps({"entries": [asdict(e) for e in self.entries.values()]})
        tmp.write_text(text)
        os.replace(tmp, self.dir / INDEX)
        self._index_bytes = len(text)

    @property
    def _index_reserve(self):
        """Room for the index and its temporary copy, with margin for a few more entries."""
        return 2 * self._index_bytes + 16384

    def _open(self):
        """Read the index, check it against the folder, index files it misses, drop leftovers."""
        try:
            listed = json.loads((self.dir / INDEX).read_text())["entries"]
            entries = {d["name"]: Entry(**d) for d in listed}
        except FileNotFoundError:
            entries = {}
        except (ValueError, KeyError, TypeError) as e:
            log.warning(f"kv disk: {INDEX} unreadable ({e}); rebuilding it from the files")
            entries = {}
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # an interrupted write
            elif path.name.endswith(SUFFIX):
                e = entries.get(path.name)
                if not self._indexed(e, path):
                    e = self._entry_from_file(path)
                if e is not None:
                    self.entries[path.name] = e
        self._make_room(0)
        log.info(f"kv disk: {self.dir} holds {len(self.entries)} session(s), "
                 f"{self.used_bytes / 2**20:.1f} of {self.budget / 2**20:.0f} MiB")

    def _entry_from_file(self, path) -> Entry | None:
        try:
            header = read_header(path)
            tokens = [int(t) for t in header["tokens"]]
            identity = header["model"]
            namespace = str(header.get("namespace", ""))
        except (StateFileError, KeyError, TypeError, ValueError) as e:
            log.warning(f"kv disk: {path.name} is unusable ({e}); deleted")
            path.unlink(missing_ok=True)
            return None
        stat = path.stat()
        return Entry(path.name, identity, len(tokens), self._keys(tokens, header, namespace), stat.st_size,
                     "found", last_used=stat.st_mtime, created=stat.st_mtime, namespace=namespace)

    def _keys(self, tokens, header, namespace: str) -> dict:
        """Prefix hashes at the end and at each `index_every`-th position whose previous position (where
        a prompt of exactly that length rewinds to) the file restores cheaply: from where its rows trim in
        place, or its oldest lane, on."""
        n = len(tokens)
        lowest = max(min(header["lanes"] + [header.get("trim_from", n)]) + 1, self.min_tokens, 1)
        lengths = [q for q in range(n - n % self.index_every, lowest - 1, -self.index_every)] + [n]
        return {str(k): v for k, v in prefix_hashes(tokens, lengths, namespace).items()}

