"""Caches that can be rolled back after a verify pass.

Full-attention layers use mlx-lm's ``KVCache`` (rollback = ``trim``). Gated DeltaNet layers
use ``GatedDeltaCache``: during verification it keeps the state the block started from and a
tape, and ``rollback`` rebuilds the state after the committed prefix by replaying the tape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import kernels


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

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` steps of the last taped pass; forget the rest."""
        tape = self.tape
        self.tape = None
        if tape is None:
            raise RuntimeError("rollback() needs a pass run with record_tape=True")
        steps = tape.k.shape[1]
        if keep == steps:
            return
        if not 0 <= keep < steps:
            raise ValueError(f"keep={keep} outside 0..{steps}")
        self.state = self.recurrence.tape_replay(tape.start_state, tape.k, tape.g, tape.delta, keep)
        n_conv = tape.conv_input.shape[1] - steps
        self.conv_state = tape.conv_input[:, keep : keep + n_conv]
        self.offset -= steps - keep

    @property
    def arrays(self) -> List[mx.array]:
        return [a for a in (self.conv_state, self.state) if a is not None]


def rollback(cache: list, fed: int, keep: int) -> None:
    """Undo the last ``fed - keep`` tokens of a verify pass in every layer's cache."""
    for c in cache:
        if isinstance(c, GatedDeltaCache):
            c.rollback(keep)
        elif fed > keep:
            c.trim(fed - keep)


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
