"""The target's layers split into contiguous stages, one per rank, balanced by weight bytes.

Rank 0 also holds the embedding; the last rank the final norm, the head and the draft (with the
embedding again, which the draft reads). Each rank builds and loads only what its stage holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

_LAYER = re.compile(r"^model\.layers\.(\d+)(\.|$)")


class StageError(ValueError):
    """A stage split that cannot work (it names the bad value)."""


@dataclass(frozen=True)
class Stage:
    """Layers ``[start, end)`` of the target, on ``rank`` of ``world``."""

    rank: int
    world: int
    start: int
    end: int
    embedding: bool  # whether this rank holds the embedding (rank 0; the last too, for the draft)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def local_name(self, key: str) -> Optional[str]:
        """A target tensor or module name as this stage's model names it (its layers renumbered
        from 0); None for what another rank holds."""
        match = _LAYER.match(key)
        if match:
            index = int(match.group(1))
            if not self.start <= index < self.end:
                return None
            return f"model.layers.{index - self.start}{key[match.end(1):]}"
        if key.startswith("model.embed_tokens"):
            return key if self.embedding else None
        if key.startswith(("model.norm", "lm_head")):
            return key if self.last else None
        return key

    def keep_only(self, model) -> None:
        """Drop from a freshly built target (parameters not yet loaded) what other ranks hold."""
        model.model.layers = model.model.layers[self.start:self.end]
        if not self.embedding:
            del model.model["embed_tokens"]
        if not self.last:
            del model.model["norm"]
            if "lm_head" in model:
                del model["lm_head"]


def weight_bytes(weights: Dict[str, mx.array], num_layers: int) -> Tuple[List[int], int, int]:
    """Bytes of each decoder layer, of the embedding, and of the final norm and head (the
    arrays are lazily loaded: nothing is read)."""
    layers = [0] * num_layers
    embedding = head = 0
    for key, value in weights.items():
        match = _LAYER.match(key)
        if match:
            layers[int(match.group(1))] += value.nbytes
        elif key.startswith("model.embed_tokens"):
            embedding += value.nbytes
        else:
            head += value.nbytes
    return layers, embedding, head


@dataclass(frozen=True)
class Split:
    """Where a pair's weights go over the ranks: each rank's layer range and weight bytes."""

    ranges: List[Tuple[int, int]]
    weight_bytes: List[int]


def split_pair(weights: Dict[str, mx.array], num_layers: int, world: int, counts: Optional[Sequence[int]] = None,
               draft_bytes: int = 0, has_draft: bool = False, tied: bool = False) -> Split:
    """The split of a target's (sanitized, lazily loaded) weights over ``world`` ranks: rank 0
    holds the embedding; the last rank the final norm, the head, the draft, and the embedding
    again when the draft needs it (it embeds its blocks) or the head is the embedding (tied)."""
    layer_bytes, embedding, head = weight_bytes(weights, num_layers)
    first_extra = embedding
    last_extra = head + draft_bytes + (embedding if has_draft or tied else 0)
    ranges = plan(layer_bytes, world, counts, first_extra, last_extra)
    held = [sum(layer_bytes[s:e]) + (first_extra if r == 0 else 0) + (last_extra if r == world - 1 else 0)
            for r, (s, e) in enumerate(ranges)]
    return Split(ranges, held)


def parse_counts(text: Optional[str]) -> Optional[List[int]]:
    """``--stages 10,14``: layers per rank, in rank order."""
    if text is None or not text.strip():
        return None
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise StageError(f"--stages {text!r}: expected layer counts per rank, comma-separated (e.g. 10,14)") from None
    return counts


def plan(layer_bytes: Sequence[int], world: int, counts: Optional[Sequence[int]] = None,
         first_extra: int = 0, last_extra: int = 0) -> List[Tuple[int, int]]:
    """The layer range of each rank: ``counts`` if given (checked), else the contiguous split whose
    largest stage (rank 0 counting ``first_extra`` bytes, the last rank ``last_extra``) is
    smallest."""
    n = len(layer_bytes)
    if world < 2:
        raise StageError(f"a pipeline needs at least 2 ranks, got {world}")
    if world > n:
        raise StageError(f"{world} ranks for a target of {n} layers: each rank needs at least one layer")
    if counts is not None:
        if len(counts) != world:
            raise StageError(f"--stages {','.join(map(str, counts))} lists {len(counts)} stages for {world} ranks")
        if any(c < 1 for c in counts) or sum(counts) != n:
            raise StageError(f"--stages {','.join(map(str, counts))}: every rank needs at least one layer, "
                             f"and the counts must add up to the target's {n} layers")
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        return list(zip(bounds[:-1], bounds[1:]))
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(rank: int, start: int, end: int) -> int:
        extra = (first_extra if rank == 0 else 0) + (last_extra if rank == world - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[r][e]: the smallest largest stage over splits of layers [0, e) among ranks 0..r.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(world)]
    cut = [[0] * (n + 1) for _ in range(world)]
    for e in range(1, n + 1):
        best[0][e] = cost(0, 0, e)
    for r in range(1, world):
        for e in range(r + 1, n + 1):
            for s in range(r, e):
                value = max(best[r - 1][s], cost(r, s, e))
                if value < best[r][e]:
                    best[r][e], cut[r][e] = value, s
    ranges, end = [], n
    for r in range(world - 1, 0, -1):
        start = cut[r][end]
        ranges.append((start, end))
        end = start
    ranges.append((0, end))
    return ranges[::-1]


def agree(group, ranges: Sequence[Tuple[int, int]]) -> None:
    """Check that every rank planned the same split (the same checkpoint and ``--stages`` on every
    machine): a sum over the ranks equals each rank's own plan times the ranks only if all agree."""
    flat = [x for r in ranges for x in r]
    total = mx.distributed.all_sum(mx.array(flat, dtype=mx.int32), group=group)
    mx.eval(total)
    if total.tolist() != [x * group.size() for x in flat]:
        raise StageError(f"rank {group.rank()} split the target as {list(ranges)}, other ranks differently: "
                         "every machine needs the same checkpoint and the same --stages")
