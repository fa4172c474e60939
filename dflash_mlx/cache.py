"""Caches that can be rolled back after a verify pass.

Full-attention layers use mlx-lm's ``KVCache`` (rollback = ``trim``). Gated DeltaNet layers
use ``GatedDeltaCache``: during verification it keeps the state the block started from and a
tape, and ``rollback`` rebuilds the state after the committed prefix by replaying the tape.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import kernels


# Where prefill chunks (and so prefix-cache checkpoints) may end, in tokens from the start of the
# sequence: the Gated DeltaNet recurrence's chunk (``prefill``'s module docstring says why).
GRID = kernels.CHUNK


def on_grid(position: int) -> int:
    """The last grid position at or before ``position``."""
    return position - position % GRID


def features_from(draft_cache: list, count: int, at: int = 0) -> int:
    """The first of ``count`` new positions (the first at position ``at`` of the sequence) whose
    context features the draft is given: all of them unless every layer keeps a window of the last
    tokens (a sliding or ``--draft-window`` draft); then from the grid position at or before the
    window's start (a prefill boundary), and the target's layers after the last tap need not run
    for the positions before."""
    kept = [getattr(c, "window", None) for c in draft_cache if not getattr(c, "reads_no_context", False)]
    if not kept or any(w is None for w in kept):
        return 0
    return max(on_grid(at + max(count - max(kept), 0)) - at, 0)


@dataclass
class GatedDeltaTape:
    """What a verify pass records to undo its uncommitted steps."""

    start_state: mx.array  # [B, Hv, Dv, Dk] float32, state before the block
    conv_input: mx.array  # [B, K-1+T, C], conv state followed by the block's qkv rows
    k: mx.array  # [B, T, Hk, Dk]
    g: mx.array  # [B, T, Hv]
    delta: mx.array  # [B, T, Hv, Dv]


class GatedDeltaCache:
    """Conv state and recurrent state of one Gated DeltaNet layer."""

    def __init__(self, recurrence: Optional[kernels.Recurrence] = None):
        self.recurrence = recurrence or kernels.Recurrence.for_this_process()
        self.conv_state: Optional[mx.array] = None
        self.state: Optional[mx.array] = None
        self.offset = 0
        self.tape: Optional[GatedDeltaTape] = None
        self.tape_row: Optional[int] = None  # its batch row when ``tape`` is a batched pass's

    def rollback(self, steps_kept: int) -> None:
        """Keep the first ``steps_kept`` steps of the last taped pass; forget the rest."""
        tape, row = self._take_tape(steps_kept)
        if tape is None:
            return
        if row is not None:
            tape = GatedDeltaTape(*(_rows(part, slice(row, row + 1)) for part in _tape_parts(tape)))
        self._kept(self.recurrence.tape_replay(tape.start_state, tape.k, tape.g, tape.delta, steps_kept), tape, 0, steps_kept)

    def _take_tape(self, steps_kept: int):
        """The tape and row to roll back from (the tape forgotten), or ``(None, None)`` when all
        ``steps_kept`` steps stay."""
        tape, row = self.tape, self.tape_row
        self.tape = self.tape_row = None
        if tape is None:
            raise RuntimeError("rollback() needs a pass run with record_tape=True")
        steps = tape.k.shape[1]
        if steps_kept == steps:
            return None, None
        if not 0 <= steps_kept < steps:
            raise ValueError(f"steps_kept={steps_kept} outside 0..{steps}")
        return tape, row

    def _kept(self, state: mx.array, tape: GatedDeltaTape, row: int, steps_kept: int) -> None:
        """Its state after ``steps_kept`` steps of ``tape`` (row ``row`` of it): the conv rows and
        offset follow."""
        steps = tape.k.shape[1]
        n_conv = tape.conv_input.shape[1] - steps
        self.state = state
        self.conv_state = tape.conv_input[row : row + 1, steps_kept : steps_kept + n_conv]
        self.offset -= steps - steps_kept

    def update(self, conv_state: mx.array, state: mx.array, steps: int, tape: Optional[GatedDeltaTape],
               tape_row: Optional[int] = None) -> None:
        """After a pass of ``steps`` tokens: the new states, and the tape if it recorded one
        (``tape_row``: this cache's row of a batch's tape)."""
        self.conv_state, self.state, self.tape, self.tape_row = conv_state, state, tape, tape_row
        self.offset += steps

    @property
    def arrays(self) -> List[mx.array]:
        return [a for a in (self.conv_state, self.state) if a is not None]


class GatedDeltaBatch:
    """Several sequences' Gated DeltaNet caches seen as one batch for a pass over ``[B, T]``
    tokens: their states stacked on the batch axis going in, split back coming out. The batch's
    tape stays whole, each sequence holding its row of it: ``rollback_batch`` replays every row
    to its own step count at once, a sequence's own ``rollback`` slices its row. The recurrence
    and the convolution run per batch row, so each row's result is the one its sequence gets alone."""

    def __init__(self, members: List[GatedDeltaCache]):
        self.members = members

    @property
    def conv_state(self) -> mx.array:
        return mx.concatenate([m.conv_state for m in self.members])

    @property
    def state(self) -> mx.array:
        return mx.concatenate([m.state for m in self.members])

    def update(self, conv_state: mx.array, state: mx.array, steps: int, tape: Optional[GatedDeltaTape]) -> None:
        for i, m in enumerate(self.members):
            m.update(conv_state[i : i + 1], state[i : i + 1], steps, tape, None if tape is None else i)


def _tape_parts(tape: GatedDeltaTape) -> tuple:
    return tape.start_state, tape.conv_input, tape.k, tape.g, tape.delta


def _rows(tape_part, row: slice):
    """Batch rows of a tape's delta: an array, or mlx-lm's kernel's step inputs (a tuple of arrays)."""
    if isinstance(tape_part, mx.array):
        return tape_part[row]
    return type(tape_part)(**{f.name: getattr(tape_part, f.name)[row] for f in fields(tape_part)})


class KVBatch:
    """Several sequences' attention caches for a pass over ``[B, T]`` tokens: each row attends
    over its own cache with its own first ``rows[i]`` queries (the rest of its row is padding,
    which never enters its cache; see ``layers.cached_attention``)."""

    def __init__(self, members: List[KVCache], rows: List[int]):
        self.members, self.rows = members, rows

    @property
    def offset(self) -> mx.array:
        """Each row's position: RoPE takes one offset per batch row."""
        return mx.array([m.offset for m in self.members])


class WindowCache(KVCache):
    """The KV cache of a sliding-window attention layer (each query sees its own position and the
    ``window - 1`` before it), rolled back exactly by ``trim`` like a full one.

    A ring of ``window`` rows (mlx-lm's ``RotatingKVCache``) would have overwritten, by the time a
    verify block is rejected, rows the block's first query still needs once rolled back. Here a
    pass at position ``o`` drops only rows no query of it sees (before ``o - window + 1``) and keeps
    the rest until the next pass: a rollback to any position the pass fed from (``o`` and after) has
    every row it needs, and a window never holds more than ``window - 1`` rows plus the last pass's
    (a verify block, or a prefill chunk until the next pass). Rows live in a buffer that grows in
    ``step``s from ``start`` (the position of its first row) and is compacted when full.
    ``layers.cached_attention`` masks each query to its window."""

    def __init__(self, window: int):
        super().__init__()
        if window < 1:
            raise ValueError(f"sliding window {window} must be at least 1 token")
        self.window = window
        self.start = 0  # the position of the buffer's first row

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append a pass's rows; returns the rows its queries see (from the first query's window)."""
        o, T = self.offset, keys.shape[2]
        first = max(self.start, o - self.window + 1)
        if self.keys is None or o + T - self.start > self.keys.shape[2]:
            kept = o - first
            capacity = (kept + T + self.step - 1) // self.step * self.step + self.step
            B, H, _, D = keys.shape
            new_k = mx.zeros((B, H, capacity, D), keys.dtype)
            new_v = mx.zeros((B, H, capacity, values.shape[3]), values.dtype)
            if kept:
                new_k[..., :kept, :] = self.keys[..., first - self.start : o - self.start, :]
                new_v[..., :kept, :] = self.values[..., first - self.start : o - self.start, :]
            self.keys, self.values, self.start = new_k, new_v, first
        self.keys[..., o - self.start : o + T - self.start, :] = keys
        self.values[..., o - self.start : o + T - self.start, :] = values
        self.offset = o + T
        rows = slice(first - self.start, o + T - self.start)
        return self.keys[..., rows, :], self.values[..., rows, :]

    def trim(self, n: int) -> int:
        """Forget the last ``n`` rows; refused (ValueError) where the window before the new end
        was dropped already (further back than the last pass started)."""
        n = min(self.offset, n)
        end = self.offset - n
        if max(end - self.window + 1, 0) < self.start:
            raise ValueError(f"a sliding window of {self.window} holds positions {self.start}..{self.offset - 1}: "
                             f"it cannot roll back to {end} (that needs position {max(end - self.window + 1, 0)})")
        self.offset = end
        return n

    def checkpoint(self) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """The rows a pass from here reads before its own (the last ``window - 1``): with the
        position, all a later ``resume`` needs (slices; the buffer is never written in place)."""
        if self.keys is None or self.offset == 0:
            return None, None
        first = max(self.start, self.offset - self.window + 1)
        rows = slice(first - self.start, self.offset - self.start)
        return self.keys[..., rows, :], self.values[..., rows, :]

    def resume(self, position: int, keys: Optional[mx.array], values: Optional[mx.array]) -> "WindowCache":
        """Hold ``checkpoint()``'s rows as they were at ``position`` (a prompt cache's restart)."""
        rows = 0 if keys is None else keys.shape[2]
        if rows != min(position, self.window - 1):
            raise ValueError(f"{rows} rows do not make the window of {self.window} at position {position}")
        self.keys, self.values, self.offset, self.start = keys, values, position, position - rows
        return self

    def fork(self, position: int, keys, values) -> "WindowCache":
        """A new cache holding ``checkpoint()``'s rows taken at ``position``."""
        return WindowCache(self.window).resume(position, keys, values)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def batch_view(caches: List[list], rows: List[int]) -> list:
    """Per layer, the batch view over several sequences' caches (each a target cache list), each
    fed its first ``rows[i]`` rows of the pass (the Gated DeltaNet layers take the whole pass, the
    padding rolled back by the tape)."""
    return [GatedDeltaBatch(list(layer)) if isinstance(layer[0], GatedDeltaCache) else KVBatch(list(layer), rows)
            for layer in zip(*caches)]


def rollback(cache: list, fed: int, kept: int) -> None:
    """Undo the last ``fed - kept`` tokens of a verify pass in every layer's cache."""
    for c in cache:
        if isinstance(c, GatedDeltaCache):
            c.rollback(kept)
        elif fed > kept:
            c.trim(fed - kept)


def rollback_batch(caches: List[list], fed: List[int], kept: List[int]) -> None:
    """``rollback`` for every sequence of a batched pass (``caches[i]`` keeps ``kept[i]`` of the
    ``fed[i]`` tokens its attention took). Per Gated DeltaNet layer, one replay over the batch's tape brings every row
    to its own step count (``Recurrence.tape_replay_rows``: the steps past a row's count add
    exact zeros), instead of a replay per sequence; attention caches are trimmed per sequence.

    ``caches`` may be any of the pass's sequences, in any order (those that left while the pass
    ran are not rolled back here): each cache names its own row of the tape (``tape_row``), and
    the rows of sequences not given replay to the end, their states unused."""
    for layer in zip(*caches):
        if not isinstance(layer[0], GatedDeltaCache):
            for c, f, n in zip(layer, fed, kept):
                if f > n:
                    c.trim(f - n)
            continue
        shared = layer[0].tape
        batched = (len(layer) > 1 and shared is not None and isinstance(shared.delta, mx.array)
                   and all(c.tape is shared and c.tape_row is not None for c in layer))
        if not batched:  # a pass of its own (or mlx-lm's kernel's tape): each as alone
            for c, n in zip(layer, kept):
                c.rollback(n)
            continue
        steps = shared.k.shape[1]
        counts = [steps] * shared.k.shape[0]  # one per row of the tape
        for c, n in zip(layer, kept):
            counts[c.tape_row] = n
        taken = [(c.tape_row, c, n) for c, n in zip(layer, kept)]
        taken = [(row, c, n) for row, c, n in taken if c._take_tape(n)[0] is not None]
        if not taken:
            continue
        states = layer[0].recurrence.tape_replay_rows(shared.start_state, shared.k, shared.g, shared.delta,
                                                      mx.array(counts))
        for row, c, n in taken:
            c._kept(states[row : row + 1], shared, row, n)


def cache_arrays(cache: list) -> List[mx.array]:
    """Every array a list of caches holds (target or draft), for ``mx.eval``."""
    out = []
    for c in cache:
        if hasattr(c, "arrays"):  # GatedDeltaCache, and the draft's ContextCache
            out.extend(c.arrays)
        elif isinstance(c, KVCache) and c.keys is not None:
            out.extend([c.keys, c.values])
    return out


def snapshot(cache: list) -> list:
    """What ``restore`` needs to undo the steps fed after it: the Gated DeltaNet states (immutable
    arrays, kept by reference) and every layer's length."""
    return [(c.conv_state, c.state, c.offset) if isinstance(c, GatedDeltaCache) else c.offset for c in cache]


def restore(cache: list, saved: list) -> None:
    """Put every layer back where ``snapshot`` found it (attention caches are trimmed)."""
    for c, s in zip(cache, saved):
        if isinstance(c, GatedDeltaCache):
            (c.conv_state, c.state, c.offset), c.tape = s, None
        else:
            c.trim(c.offset - s)
