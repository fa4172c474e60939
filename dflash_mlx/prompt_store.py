"""The prompt cache's disk tier: histories kept in safetensors files that outlive the process.

Coding agents send the same long head (system prompt, tools) at the start of every session, and
servers restart. ``PromptCachePool`` keeps histories in RAM; with a ``PromptStore`` a history it
releases is also written here when the disk lacks its head or it grew a quarter past the entry
there (``save``), one it evicts unless its longest checkpoint is here, and ``take`` loads the entry
that restarts a prompt further than any history in RAM. The worker only takes a snapshot (views of
evaluated arrays); one writer thread writes the files (``Writer``).

An entry holds what a request needs to resume at its longest checkpoint P exactly as if it had
prefilled there: every attention layer's K/V of the first P tokens, every Gated DeltaNet layer's
recurrent and convolution state at each of the history's checkpoints up to P, the draft's context
rows (or its window) up to P, and the P tokens. The arrays are the bits the RAM tier holds, so a
request resumed from disk is the request resumed from RAM, which is the request prefilled cold.

Files are named ``<fingerprint>-<prefix hash>-<crc32>.safetensors``. The fingerprint covers the
target's and the draft's weights (config and weight files' names, sizes and mtimes: cheap), their
quantization, the Gated DeltaNet recurrence, the MLX version and this format; the prefix hash the
tokens (the chat template's arguments are in the rendered tokens). The CRC is of the whole file,
computed as it is written and, at a load, on the arrays in memory (the file is read once): one
written by a writer killed midway never gets its name (temp file, fsync, atomic rename), and a
truncated or altered one fails it and is removed with one warning, never loaded. Entries of
another fingerprint are left alone (another server on the same directory) but count in the budget:
the least recently used files go first (a load touches its file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from . import paths
from .cache import GRID, GatedDeltaCache

FORMAT = "1"
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_SECONDS = 600  # a temp file untouched this long belongs to a killed writer
DEFAULT_DISK_GB = 16.0
# A released history is written again once its longest checkpoint is this fraction past the
# longest entry of its head already on disk (an agent's turns add 1-3k tokens to a 19k-token head:
# one ~1 GiB write every few turns, not every turn; bytes written over a session are at most
# (1 + 1/GROWTH) times its final entry, where a write per turn grows with the square of its turns).
GROWTH = 0.25

log = logging.getLogger(__name__)


def default_directory() -> Path:
    """Where ``serve`` and ``chat`` keep prompt caches by default."""
    return paths.home() / "prompt-cache"


def _weights_identity(path: Optional[Path]) -> list:
    """The config and the weight files' names, sizes and mtimes of a model folder (no weight read)."""
    if path is None:
        return [None]
    path = Path(path)
    config = path / "config.json"
    out = [hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None]
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def _quantization(model) -> list:
    """Each kind of quantized layer a model holds (bits, group size, mode): a pair quantized at load
    has the same weight files as one that is not."""
    if model is None:
        return [None]
    kinds = set()
    for _, m in model.named_modules():
        if hasattr(m, "bits") and hasattr(m, "group_size"):
            kinds.add((type(m).__name__, m.bits, m.group_size, getattr(m, "mode", "affine")))
    return sorted(kinds)


def fingerprint(target, draft, target_path: Optional[Path], draft_path: Optional[Path], matmuls=None) -> str:
    """What must match for an entry's arrays to be the states this pair would compute (``matmuls``:
    the quantized layers' kernel choices on an Apple GPU, ``QuantizedMatmuls``)."""
    recurrences = {repr((type(c.recurrence.metal).__name__, c.recurrence.chunked))
                   for c in target.make_cache() if isinstance(c, GatedDeltaCache)}
    parts = {"format": FORMAT, "mlx": mx.__version__, "device": str(mx.default_device()),
             "recurrence": sorted(recurrences), "target": _weights_identity(target_path),
             "draft": _weights_identity(draft_path) if draft is not None else None,
             "quantization": [_quantization(target), _quantization(draft)],
             "matmuls": None if matmuls is None else [getattr(matmuls, "exact", None),
                                                       sorted(map(str, getattr(matmuls, "choices", {}).items()))]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def prefix_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()[:16]


def file_crc(path: Path, chunk: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def is_entry_name(name: str) -> bool:
    """A file name ``write_entry`` gives (``<16 hex>-<16 hex>-<8 hex>.safetensors``): any other
    file in the directory is not ours, and is neither read, counted nor removed."""
    if not name.endswith(SUFFIX):
        return False
    parts = name[: -len(SUFFIX)].split("-")
    return [len(p) for p in parts] == [16, 16, 8] and all(c in "0123456789abcdef" for p in parts for c in p)


DTYPES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16", mx.uint32: "U32",
          mx.int32: "I32", mx.uint64: "U64", mx.int64: "I64", mx.float16: "F16", mx.bfloat16: "BF16",
          mx.float32: "F32"}
_SAME_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


@dataclass
class Block:
    """One array of an entry, as the writer thread gets it: a numpy view of the evaluated MLX
    array's own memory (no copy; it keeps the array alive), under its safetensors dtype."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    data: np.ndarray


def snapshot(arrays: Dict[str, mx.array]) -> List[Block]:
    """The arrays as blocks another thread can write: evaluated here (a slice of an evaluated
    array is a view: no copy), then seen as unsigned integers of their size (numpy has no
    bfloat16) through the buffer protocol. MLX evaluates only on the thread whose streams made an
    array, so this runs on the worker; the writer thread then touches numpy memory only. An MLX
    array is never written in place while a view of its buffer is alive (a cache update then
    copies instead of reusing the buffer), so the blocks keep the bits they had here."""
    names = sorted(arrays)
    for name in names:
        if arrays[name].dtype not in DTYPES:
            raise ValueError(f"array {name!r} has dtype {arrays[name].dtype}, which an entry cannot hold")
    raw = [arrays[n].view(_SAME_SIZE[arrays[n].dtype.size]) for n in names]
    mx.eval(raw)
    return [Block(n, DTYPES[arrays[n].dtype], tuple(arrays[n].shape), np.asarray(memoryview(r)))
            for n, r in zip(names, raw)]


def _chunks(data: np.ndarray):
    """``data``'s bytes in row-major order, as contiguous pieces of its own memory (a cache's
    K/V slice is contiguous per head: one piece each)."""
    if data.flags.c_contiguous:
        yield data.reshape(-1).view(np.uint8)
    elif data.ndim > 1:
        for row in data:
            yield from _chunks(row)
    else:
        yield np.ascontiguousarray(data).view(np.uint8)


def write_blocks(directory: Path, stem: str, blocks: Sequence[Block], metadata: Dict[str, str]) -> Path:
    """Write ``blocks`` as the safetensors file ``<stem>-<crc32>.safetensors`` atomically: a temp
    file of a name no other writer uses, fsync, then a rename (readers see the whole file or
    none). The CRC is of the whole file, computed as it is written (one pass over the bytes). No
    MLX here: this runs on the writer thread."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for b in blocks:
        header[b.name] = {"dtype": b.dtype, "shape": list(b.shape), "data_offsets": [offset, offset + b.data.nbytes]}
        offset += b.data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the arrays start 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    temp = directory / f"{TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{SUFFIX}"
    try:
        with open(temp, "wb") as f:
            crc = zlib.crc32(head)
            f.write(head)
            for b in blocks:
                for piece in _chunks(b.data):
                    crc = zlib.crc32(piece, crc)
                    f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        final = directory / f"{stem}-{crc:08x}{SUFFIX}"
        os.replace(temp, final)
    except BaseException:
        try:
            temp.unlink()
        except OSError:
            pass
        raise
    try:  # the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return final


def write_entry(directory: Path, stem: str, arrays: Dict[str, mx.array], metadata: Dict[str, str]) -> Path:
    """``write_blocks`` of MLX arrays, on this thread."""
    return write_blocks(directory, stem, snapshot(arrays), metadata)


def loaded_crc(head: bytes, header: dict, arrays: Dict[str, mx.array]) -> Optional[int]:
    """The CRC-32 of the file ``mx.load`` read ``arrays`` from, computed from the arrays in memory
    (evaluated: contiguous, the file's bytes) and the header's bytes ``head``, so the file is read
    once; None if its arrays do not lie back to back (then read it again: ``file_crc``)."""
    crc, end = zlib.crc32(head), 0
    for name, spec in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                             key=lambda kv: kv[1]["data_offsets"]):
        start, stop = spec["data_offsets"]
        if start != end or name not in arrays or arrays[name].nbytes != stop - start:
            return None
        if stop > start:
            crc = zlib.crc32(memoryview(arrays[name]), crc)
        end = stop
    return crc


def read_header(path: Path) -> Tuple[dict, int, bytes]:
    """A safetensors file's header, the size its tensors say the file has, and the header's bytes
    (its length field included: the start of the file's CRC); ValueError if it is not one."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 256 << 20:
            raise ValueError(f"a header of {n} bytes")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError("truncated header")
    header = json.loads(raw)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return header, 8 + n + end, head + raw


CHECKPOINTED = "gw"  # layer kinds a checkpoint keeps states of (``PromptCache.checkpoint``)


def _kind(cache) -> str:
    """A target layer's cache, as an entry stores it: ``g`` a Gated DeltaNet layer (its states at
    each checkpoint), ``w`` a sliding window (its rows at each checkpoint, put back by ``resume``),
    ``k`` a full attention layer (K/V of the first P positions), ``?`` one this format cannot keep."""
    if isinstance(cache, GatedDeltaCache):
        return "g"
    if isinstance(cache, KVCache) and hasattr(cache, "resume") and hasattr(cache, "checkpoint"):
        return "w"
    return "k" if type(cache) is KVCache else "?"


@dataclass
class Entry:
    """What the index knows of one file (its header, not its arrays)."""

    path: Path
    fingerprint: str
    crc: int
    tokens: Tuple[int, ...]
    checkpoints: Tuple[int, ...]  # ascending

    def restart(self, prompt: Sequence[int]) -> int:
        """The longest checkpoint of this entry a prompt can restart from (0: none): within the
        prefix they share, on the grid or before the prompt's last token (``PromptCache``'s rule)."""
        last = len(prompt) - 1
        for p in reversed(self.checkpoints):
            if p <= last and (p % GRID == 0 or p == last) and tuple(prompt[:p]) == self.tokens[:p]:
                return p
        return 0


@dataclass
class StoreStats:
    """Counters for /metrics (written by the worker and writer threads, read by the event loop:
    plain numbers)."""

    hits: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    writes: int = 0
    written_bytes: int = 0
    write_seconds: float = 0.0  # on the writer thread
    save_seconds: float = 0.0  # on the worker thread, in ``save``: its stall (the snapshot; the write too if inline)
    write_errors: int = 0
    superseded: int = 0  # queued writes a newer entry of the same history replaced
    dropped: int = 0  # queued writes dropped: the queue full, or closed without a flush
    evictions: int = 0
    evicted_bytes: int = 0
    bad_files: int = 0


@dataclass
class _Write:
    """A queued entry: its name's stem, what the index will know of it, and its blocks."""

    stem: str
    tokens: Tuple[int, ...]
    checkpoints: Tuple[int, ...]
    blocks: List[Block]
    metadata: Dict[str, str]


class Writer:
    """One background thread that writes queued entries in order, so that a request's end costs the
    worker only a snapshot (views of evaluated arrays). The queue is bounded (``limit``): a newer
    entry of the same history (whose tokens extend a queued one's) replaces the queued one, and
    past the limit the oldest queued write is dropped. The thread runs while there is work and is
    not a daemon: a process that exits with writes queued first finishes them (``close(False)``
    drops them instead); a process killed midway leaves only a temp file, never an entry's name."""

    def __init__(self, store: "PromptStore", limit: int = 4):
        if limit < 1:
            raise ValueError(f"the write queue must hold at least 1 entry, got {limit}")
        self.store, self.limit = store, limit
        self._cv = threading.Condition()
        self._queue: List[_Write] = []
        self._busy: Optional[_Write] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._paused = 0

    def put(self, job: _Write) -> bool:
        """Queue ``job`` (False if the writer is closed)."""
        with self._cv:
            if self._closed:
                return False
            kept = [j for j in self._queue if job.tokens[: len(j.tokens)] != j.tokens]
            self.store.stats.superseded += len(self._queue) - len(kept)
            while len(kept) >= self.limit:
                kept.pop(0)
                self.store.stats.dropped += 1
            self._queue = kept + [job]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dflash-prompt-store-write")
                self._thread.start()
            self._cv.notify_all()
        return True

    def pending(self) -> List[_Write]:
        """The writes queued or in flight."""
        with self._cv:
            return self._queue + ([self._busy] if self._busy is not None else [])

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._paused and self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    self._thread = None
                    self._cv.notify_all()
                    return
                job = self._busy = self._queue.pop(0)
            try:
                self.store._write(job)
            except Exception as e:  # a bug, not the disk (``_write`` warns of those): the writer goes on
                self.store.stats.write_errors += 1
                log.warning("prompt cache: writing an entry failed (%r); requests go on without it", e)
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write is on disk (False if ``timeout`` seconds passed first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, flush: bool = True) -> None:
        """Write what is queued (``flush``) or drop it, then take no more; a write in flight
        finishes either way (its temp file is never left half written by us)."""
        with self._cv:
            self._paused = 0
            if not flush:
                self.store.stats.dropped += len(self._queue)
                self._queue.clear()
            self._cv.notify_all()
        self.flush()
        with self._cv:
            self._closed = True

    @contextmanager
    def paused(self):
        """Writes wait while inside (a timed section of a benchmark, a test of a queued write)."""
        with self._cv:
            self._paused += 1
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self._cv.notify_all()


class PromptStore:
    """A directory of prompt-cache entries for one pair, under a byte budget (least recently used
    out). ``target``/``draft``: the pair's models (a loaded history gets their caches' layout).
    The directory is scanned on a background thread that reads file headers only (no MLX); all MLX
    work (``save``'s snapshot, ``load``) runs on the caller's thread, the worker's, and the files
    are written on the ``Writer``'s thread (``background=False``: on the caller's, as a
    measurement's baseline). ``growth``: how much longer than the entry already on disk for a
    history's head its longest checkpoint must be for a release to write it again (see ``save``)."""

    def __init__(self, directory, budget_bytes: int, target, draft=None, target_path: Optional[Path] = None,
                 draft_path: Optional[Path] = None, matmuls=None, scan: bool = True, background: bool = True,
                 growth: float = GROWTH):
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's disk budget must not be negative, got {budget_bytes}")
        if growth < 0:
            raise ValueError(f"the growth before a history is written again must not be negative, got {growth}")
        self.growth = growth
        self.writer: Optional[Writer] = Writer(self) if background else None
        self.directory = Path(directory).expanduser()
        self.budget_bytes = budget_bytes
        self.target, self.draft = target, draft
        self.fingerprint = fingerprint(target, draft, target_path, draft_path, matmuls)
        self.stats = StoreStats()
        self._entries: Dict[str, Entry] = {}  # file name -> entry (this fingerprint's only)
        self._seen: set = set()  # file names already looked at (any fingerprint)
        self._lock = threading.Lock()
        self._warned: set = set()
        self._usable = True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._warn_once("mkdir", f"prompt cache directory {self.directory} unusable ({e}); no disk tier")
            self._usable = False
        self._scanner: Optional[threading.Thread] = None
        if scan and self._usable:
            self._scanner = threading.Thread(target=self.refresh, name="dflash-prompt-store-scan", daemon=True)
            self._scanner.start()

    @classmethod
    def for_model(cls, model, directory, budget_bytes: int, **kwargs) -> Optional["PromptStore"]:
        """The store for a loaded ``DFlashModel`` (None when the budget is 0: the tier is off)."""
        if budget_bytes <= 0:
            return None
        return cls(directory, budget_bytes, model.target, model.draft, model.target_path, model.draft_path,
                   getattr(model, "matmuls", None), **kwargs)

    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _bad(self, path: Path, why: str) -> None:
        """A file that is not a whole entry of ours: one warning, and it goes."""
        log.warning("prompt cache: skipping and removing %s (%s)", path, why)
        self.stats.bad_files += 1
        with self._lock:
            self._entries.pop(path.name, None)
        try:
            path.unlink()
        except OSError:
            pass

    # -- the index ---------------------------------------------------------------------------

    def wait_scanned(self, timeout: Optional[float] = None) -> None:
        """Block until the first scan is over (tests, benchmarks)."""
        if self._scanner is not None:
            self._scanner.join(timeout)

    @property
    def scanned(self) -> bool:
        return self._scanner is None or not self._scanner.is_alive()

    def refresh(self) -> None:
        """Index the files not looked at yet (another server may have written some), forget those
        gone, remove temp files of killed writers."""
        if not self._usable:
            return
        try:
            listing = list(os.scandir(self.directory))
        except OSError as e:
            self._warn_once("scan", f"prompt cache directory {self.directory} unreadable ({e})")
            return
        names = set()
        now = time.time()
        for item in listing:
            name = item.name
            names.add(name)
            if name.startswith(TEMP_PREFIX):
                try:
                    if now - item.stat().st_mtime > STALE_TEMP_SECONDS:
                        os.unlink(item.path)
                except OSError:
                    pass
                continue
            if name in self._seen or not is_entry_name(name):
                continue
            self._seen.add(name)
            entry = self._read_entry(Path(item.path))
            if entry is not None and entry.fingerprint == self.fingerprint:
                with self._lock:
                    self._entries[name] = entry
        with self._lock:
            for name in set(self._entries) - names:
                if not self._entries[name].path.exists():  # not one the writer added since the listing
                    del self._entries[name]
        self._seen &= names

    def _read_entry(self, path: Path) -> Optional[Entry]:
        parts = path.name[: -len(SUFFIX)].split("-")
        try:
            header, size, _ = read_header(path)
            actual = path.stat().st_size
            meta = header.get("__metadata__", {})
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, not {FORMAT}")
            if actual != size:
                raise ValueError(f"{actual} bytes where its header says {size}")
            if meta["fingerprint"] != parts[0]:
                raise ValueError("its name and its fingerprint disagree")
            tokens = tuple(int(t) for t in meta["tokens"].split(",") if t)
            checkpoints = tuple(sorted(int(p) for p in meta["checkpoints"].split(",") if p))
            if prefix_hash(tokens) != parts[1]:
                raise ValueError("its name and its tokens disagree")
            return Entry(path, meta["fingerprint"], int(parts[2], 16), tokens, checkpoints)
        except FileNotFoundError:
            return None  # another server removed it: a miss
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._bad(path, f"not a whole entry: {e}")
            return None

    def find(self, prompt: Sequence[int], better_than: int = 0) -> Optional[Tuple[Entry, int]]:
        """The entry that restarts ``prompt`` furthest, past ``better_than`` tokens, and where."""
        if self.scanned:
            self.refresh()
        with self._lock:
            entries = list(self._entries.values())
        best, where = None, better_than
        for e in entries:
            if e.tokens and prompt and e.tokens[0] == prompt[0] and len(e.tokens) > where:
                p = e.restart(prompt)
                if p > where:
                    best, where = e, p
        return (best, where) if best is not None else None

    # -- loading -----------------------------------------------------------------------------

    def load(self, entry: Entry, checkpoints: int):
        """The entry as a ``PromptCache`` (``checkpoints``: its evenly spaced budget), its arrays
        read once each (``mx.load``: one read per array, evaluated here) and the file's CRC checked
        on them in memory, before any is used; None if the file is gone, or is corrupt (then removed
        with a warning)."""
        from .prompt_cache import PromptCache

        started = time.perf_counter()
        try:
            header, _, head = read_header(entry.path)
            arrays, meta = mx.load(str(entry.path), return_metadata=True)
            mx.eval(list(arrays.values()))
            crc = loaded_crc(head, header, arrays)
            if (crc if crc is not None else file_crc(entry.path)) != entry.crc:
                self._bad(entry.path, "checksum mismatch")
                return None
            history = self._history(arrays, meta, entry, PromptCache(checkpoints))
            mx.eval(history.arrays())
        except FileNotFoundError:  # another server evicted it: a miss
            with self._lock:
                self._entries.pop(entry.path.name, None)
            return None
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            self._bad(entry.path, f"unreadable: {e}")
            return None
        try:
            os.utime(entry.path)  # least recently used goes first
        except OSError:
            pass
        self.stats.hits += 1
        self.stats.loaded_bytes += history.nbytes
        self.stats.load_seconds += time.perf_counter() - started
        return history

    def _history(self, arrays: Dict[str, mx.array], meta: Dict[str, str], entry: Entry, history):
        """Rebuild the history ``save`` wrote: the target's caches at the longest checkpoint, the
        checkpoints, the draft's context caches."""
        from .models.dflash import ContextCache

        P = entry.checkpoints[-1]
        cache = self.target.make_cache()
        kinds = "".join(map(_kind, cache))
        if meta["kinds"] != kinds:
            raise ValueError(f"layers {meta['kinds']!r}, this target has {kinds!r}")
        kept = [i for i, k in enumerate(kinds) if k in CHECKPOINTED]
        for p in entry.checkpoints:
            history.checkpoints[p] = [(arrays.get(f"checkpoint.{p}.{i}.0"), arrays.get(f"checkpoint.{p}.{i}.1"))
                                      for i in kept]
        states = iter(history.checkpoints[P])
        for i, c in enumerate(cache):
            if kinds[i] == "g":
                (c.conv_state, c.state), c.offset = next(states), P
            elif kinds[i] == "w":
                c.resume(P, *next(states))
            else:
                c.keys, c.values, c.offset = arrays[f"target.{i}.keys"], arrays[f"target.{i}.values"], P
                if c.keys.shape[2] != P:
                    raise ValueError(f"layer {i} holds {c.keys.shape[2]} positions, not {P}")
        draft = json.loads(meta["draft"])
        if draft is None:
            history.draft_cache, owner_draft = None, None
        else:
            if self.draft is None:
                raise ValueError("an entry with a draft's context, and this store has no draft")
            history.draft_cache, owner_draft = [], self.draft
            for i, layer in enumerate(draft):
                c = ContextCache(layer["window"])
                c.start, c.offset = layer["start"], layer["offset"]
                if c.offset > c.start and not c.reads_no_context:
                    c.keys, c.values = arrays[f"draft.{i}.keys"], arrays[f"draft.{i}.values"]
                history.draft_cache.append(c)
        history.cache, history.tokens = cache, list(entry.tokens)
        history.owner = (id(self.target), id(owner_draft))
        return history

    # -- saving ------------------------------------------------------------------------------

    def covered(self, tokens: Sequence[int]) -> int:
        """The length of the longest entry on disk or queued whose tokens begin ``tokens`` (0: none)."""
        with self._lock:
            held = [e.tokens for e in self._entries.values()]
        held += [j.tokens for j in self.writer.pending()] if self.writer is not None else []
        best = 0
        for t in held:
            if best < len(t) <= len(tokens) and t[0] == tokens[0] and tuple(tokens[: len(t)]) == t:
                best = len(t)
        return best

    def save(self, history, evicted: bool = False) -> int:
        """Queue ``history`` for writing up to its longest checkpoint P, if the disk does not hold
        its head well enough: no entry (on disk or queued) of a prefix of its tokens, or the longest
        one ends before P / (1 + growth); ``evicted`` (it leaves RAM): unless one ends at P, so that
        eviction is not loss. Returns the bytes queued. Here, on the worker, only the snapshot
        (``snapshot``: views, no copy); the write is the writer thread's, and a failed one (a full
        disk, a read-only directory) costs a warning, never a request."""
        if not self._usable or history.cache is None or history.owner is None or not history.tokens:
            return 0
        if history.owner[0] != id(self.target) or history.owner[1] not in (id(self.draft), id(None)):
            return 0  # another pair's history
        positions = [p for p in history.checkpoints if p <= len(history.tokens)]
        if not positions:
            return 0
        started = time.perf_counter()
        P = max(positions)
        tokens = history.tokens[:P]
        covered = self.covered(tokens)
        if covered == P or (not evicted and covered and P < covered * (1 + self.growth)):
            return 0
        arrays, meta = self._arrays(history, P)
        if arrays is None:
            return 0
        size = sum(a.nbytes for a in arrays.values())
        if size > self.budget_bytes:
            return 0
        job = _Write(f"{self.fingerprint}-{prefix_hash(tokens)}", tuple(tokens), tuple(sorted(positions)),
                     snapshot(arrays), meta)
        if self.writer is None or not self.writer.put(job):
            self._write(job)
        self.stats.save_seconds += time.perf_counter() - started
        return size

    def _write(self, job: _Write) -> None:
        """Write a queued entry, index it and trim the directory to its budget (the writer's thread)."""
        started = time.perf_counter()
        try:
            path = write_blocks(self.directory, job.stem, job.blocks, job.metadata)
            size = path.stat().st_size
        except OSError as e:
            self.stats.write_errors += 1
            self._warn_once(("write", getattr(e, "errno", None)),
                            f"prompt cache: could not write to {self.directory} ({e}); requests go on without it")
            return
        self.stats.writes += 1
        self.stats.written_bytes += size
        self.stats.write_seconds += time.perf_counter() - started
        parts = path.name[: -len(SUFFIX)].split("-")
        entry = Entry(path, self.fingerprint, int(parts[2], 16), job.tokens, job.checkpoints)
        with self._lock:
            self._entries[path.name] = entry
            self._seen.add(path.name)
        self.trim()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write is on disk (tests, benchmarks, a server that stops)."""
        return self.writer.flush(timeout) if self.writer is not None else True

    def close(self, flush: bool = True) -> None:
        """Write what is queued (``flush``) or drop it; later releases are written inline."""
        if self.writer is not None:
            self.writer.close(flush)

    def _arrays(self, history, P: int):
        """The arrays and metadata of ``history``'s entry at its checkpoint ``P`` (None, None if
        a cache of a kind this format does not know)."""
        arrays: Dict[str, mx.array] = {}
        kinds = "".join(map(_kind, history.cache))
        if "?" in kinds:
            return None, None
        kept = [i for i, k in enumerate(kinds) if k in CHECKPOINTED]
        for i, c in enumerate(history.cache):
            if kinds[i] in CHECKPOINTED:
                continue
            if c.keys is None or c.offset < P:
                return None, None
            arrays[f"target.{i}.keys"] = c.keys[..., :P, :]
            arrays[f"target.{i}.values"] = c.values[..., :P, :]
        checkpoints = sorted(p for p in history.checkpoints if p <= P)
        for p in checkpoints:
            for i, pair in zip(kept, history.checkpoints[p]):
                for j, a in enumerate(pair):
                    if a is not None:
                        arrays[f"checkpoint.{p}.{i}.{j}"] = a
        draft = None
        if history.draft_cache is not None:
            forks = [c.fork(P) for c in history.draft_cache]
            if None in forks:  # the window moved past P: the draft refills from the target's features
                draft = [{"window": c.window, "start": 0, "offset": 0} for c in history.draft_cache]
            else:
                draft = []
                for i, c in enumerate(forks):
                    draft.append({"window": c.window, "start": c.start, "offset": c.offset})
                    if c.keys is not None:
                        arrays[f"draft.{i}.keys"], arrays[f"draft.{i}.values"] = c.keys, c.values
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "kinds": kinds,
                "tokens": ",".join(map(str, history.tokens[:P])), "checkpoints": ",".join(map(str, checkpoints)),
                "draft": json.dumps(draft)}
        return arrays, meta

    # -- the budget --------------------------------------------------------------------------

    def files(self) -> List[os.stat_result]:
        """Every entry file in the directory (any pair's), with its stat, oldest use first."""
        out = []
        try:
            for item in os.scandir(self.directory):
                if is_entry_name(item.name):
                    try:
                        out.append((item.stat().st_mtime, item.path, item.stat().st_size))
                    except OSError:
                        pass
        except OSError:
            return []
        return sorted(out)

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.files())

    def trim(self) -> None:
        """Remove the least recently used files until the directory fits the budget."""
        files = self.files()
        total = sum(size for _, _, size in files)
        for _, path, size in files:
            if total <= self.budget_bytes:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another server took it
            except OSError:
                continue
            total -= size
            self.stats.evictions += 1
            self.stats.evicted_bytes += size
            with self._lock:
                self._entries.pop(Path(path).name, None)


def directory_usage(directory) -> Tuple[int, int]:
    """Entry files and their bytes in a prompt cache directory (doctor): (0, 0) if it is absent."""
    count = size = 0
    try:
        for item in os.scandir(Path(directory).expanduser()):
            if is_entry_name(item.name):
                count += 1
                size += item.stat().st_size
    except OSError:
        pass
    return count, size
