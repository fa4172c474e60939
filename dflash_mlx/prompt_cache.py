"""Reuse of target and draft caches across prompts that share a prefix (chat turns, editors).

Attention KV caches can be cut back to any length, but a Gated DeltaNet state cannot be run
backwards. So a history keeps *checkpoints*: the Gated DeltaNet states (immutable MLX arrays,
kept by reference, no copy) at chosen prompt positions, and the live state after the last step.
A new prompt restarts from the longest checkpoint inside the prefix it shares with the cached
tokens and prefills only the rest: the same computation a fresh run does, split elsewhere.

A resumed request is bit for bit the request run from scratch, by construction: a checkpoint
is a state the prefill passed through at one of its own chunk boundaries, which lie on the
recurrence's 64-token grid (``cache.GRID``), where a boundary changes no bits; so a prompt
resumed there feeds the rest in the chunks a prefill from scratch would. The one checkpoint off
the grid is the one before a prompt's last token (which a prefill always feeds alone): it serves
only a prompt of that same length (a resend). A state a decode cycle left (after an answer) is
never resumed from: a prefill of those tokens would round otherwise, and the answer would depend on
what the cache held; the tokens after the last checkpoint are prefilled again.

Where the checkpoints go: with a budget of C, a prefill of an L-token prompt checkpoints every
ceil(L/C) tokens, rounded up to the grid, so a change at any position p reuses at least
p - L/C - 64 tokens, plus where the request asks (on the grid at or before it: where the next chat
turn will differ), before its last token (a resend), on the grid before that (the next turn) and
before its last ``REWRITTEN_TAIL`` tokens (a next turn whose template renders the end otherwise),
and where another prompt left this history before its prompt's end (``heads``: the system prompt
and tools two sessions share, so that the next session resumes there).
When a later prompt adds checkpoints past the budget, the set is thinned to the one whose largest
gap is smallest. ``PromptCachePool`` keeps several histories (a chat and an editor's completions, two
projects) under one memory budget, least recently used first out; over a disk tier
(``prompt_store``), each history it releases is also written to disk, and a prompt that an entry
there restarts further than RAM can is resumed from it (the same arrays, so the same bits).
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .cache import GRID, GatedDeltaCache, WindowCache, cache_arrays, features_from, on_grid

CHECKPOINTS = 8  # spread over a prompt: about 50 MB each for the 9B target (24 Gated DeltaNet layers)
# The tokens at a prompt's end that the next turn's template may render otherwise: the generation
# prompt (Qwen's ``<|im_start|>assistant\n<think>\n``, a few tokens; with thinking off, a closed
# ``<think>`` block) that the next turn replaces by the answer as rendered without its reasoning.
REWRITTEN_TAIL = 16
HEADS = 2  # shared heads pinned per history (``PromptCache.diverged``): a checkpoint each


class PromptCache:
    """The caches of one token history, for one target (and draft)."""

    def __init__(self, checkpoints: int = CHECKPOINTS):
        if checkpoints < 1:
            raise ValueError(f"checkpoints must be at least 1, got {checkpoints}")
        self.tokens: List[int] = []  # exactly the tokens the target cache holds
        self.cache: Optional[list] = None
        self.draft_cache: Optional[list] = None
        self.owner: Optional[Tuple[int, int]] = None
        self.checkpoints: Dict[int, list] = {}
        self.evenly_spaced = checkpoints  # checkpoints spread evenly over a prompt
        self.pinned: Set[int] = set()  # positions of the latest request's own checkpoints, never thinned away
        # Grid positions where a later prompt left this history before its prompt's end (another
        # session after the same system prompt and tools: the head they share), the earliest:
        # pinned at every request, so that the next such prompt resumes there, not up to L/8 before.
        self.heads: List[int] = []
        self._prompt: List[int] = []  # the prompt being prefilled, and where its checkpoints go
        self._plan: Set[int] = set()

    def reset(self) -> None:
        self.tokens, self.cache, self.draft_cache, self.owner = [], None, None, None
        self.checkpoints.clear()
        self.pinned, self._plan, self.heads = set(), set(), []

    def _gdn_states(self) -> list:
        """What a checkpoint keeps: each Gated DeltaNet layer's states, each sliding window's rows
        (neither can be cut back to an earlier position)."""
        return [(c.conv_state, c.state) if isinstance(c, GatedDeltaCache) else c.checkpoint()
                for c in self.cache if isinstance(c, (GatedDeltaCache, WindowCache))]

    def shared_prefix(self, prompt: Sequence[int]) -> int:
        """How many leading tokens ``prompt`` shares with this history (all but its last at most:
        one prompt token must be fed to get logits)."""
        limit, shared = min(len(self.tokens), len(prompt) - 1), 0
        while shared < limit and self.tokens[shared] == prompt[shared]:
            shared += 1
        return shared

    def restart_point(self, shared: int, length: int) -> int:
        """The longest usable state within the first ``shared`` tokens of a prompt of ``length``
        tokens (0: none): a checkpoint on the grid, or the one before the prompt's last token."""
        return max([p for p in self.checkpoints if p <= shared and (p % GRID == 0 or p == length - 1)], default=0)

    def _draft_resumes(self, start: int, length: int) -> bool:
        """Rewind the draft's caches to ``start`` if they then hold every context row that a
        prefill of the ``length``-token prompt from scratch would give them (a window's rows
        before ``start`` included); False (nothing rewound) if not."""
        first = features_from(self.draft_cache, length)
        reading = [c for c in self.draft_cache if not c.reads_no_context]
        holds = start <= first or all(c.start <= first for c in reading)
        return holds and all(c.start <= start <= c.offset for c in reading) and all(c.rewind(start) for c in self.draft_cache)

    def checkpoint(self, position: int) -> None:
        """Remember the Gated DeltaNet states of the first ``position`` cached tokens (the live
        ones: call it when the cache holds exactly that many)."""
        self.checkpoints[position] = self._gdn_states()

    def prepare(self, target, draft, prompt: List[int], draft_window: Optional[int] = None,
                wanted: Iterable[int] = ()) -> int:
        """Make the caches hold a prefix of ``prompt``; returns its length (0 when starting over).
        ``wanted``: prompt positions this request wants a checkpoint at (kept through thinning)."""
        owner = (id(target), id(draft))
        shared = self.shared_prefix(prompt)
        start = self.restart_point(shared, len(prompt)) if self.owner == owner else 0
        if start and draft is not None and not self._draft_resumes(start, len(prompt)):
            # The draft's window has moved past what this prompt needs (the history went on further
            # than the prompt shares): a fresh draft cache, which the prefill fills from where one
            # from scratch would start feeding it, and the target from its last checkpoint before.
            self.draft_cache = draft.make_cache(draft_window)
            start = self.restart_point(min(shared, features_from(self.draft_cache, len(prompt))), len(prompt))
            for c in self.draft_cache:
                c.advance(start)
        if start == 0:
            self.reset()
            self.owner = owner
            self.cache = target.make_cache()
            self.draft_cache = draft.make_cache(draft_window) if draft is not None else None
            start = 0
        else:
            states = iter(self.checkpoints[start])
            for c in self.cache:
                if isinstance(c, GatedDeltaCache):
                    c.conv_state, c.state = next(states)
                    c.offset, c.tape = start, None
                elif isinstance(c, WindowCache):
                    c.resume(start, *next(states))
                else:
                    c.trim(c.offset - start)
            self.tokens = self.tokens[:start]
            self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= start}
        step = GRID * math.ceil(len(prompt) / (self.evenly_spaced * GRID))
        # The request's own checkpoints stay through thinning, also those it restarts from: else
        # resending the same prompt twice could thin away the point the third send needs.
        # Pinned too: before the last token (a resend) and the grid before it (the next turn, which
        # goes on past this prompt: it then prefills at most 63 of its tokens again, and the answer),
        # and the grid before the prompt's last REWRITTEN_TAIL tokens: the next turn's template may
        # render the generation prompt otherwise (Qwen's drops the answer's reasoning, and its
        # ``<think>``, once a user message follows), so it may differ a few tokens before the end.
        last = len(prompt) - 1
        self.pinned = {p for p in (*map(on_grid, wanted), last, on_grid(last), on_grid(last - REWRITTEN_TAIL), *self.heads)
                       if 0 < p < len(prompt) and (p >= start or p in self.checkpoints)}
        self._plan = {p for p in (*(j * step for j in range(1, self.evenly_spaced)), *self.pinned) if start < p < len(prompt)}
        self._prompt = list(prompt)
        return start

    @property
    def prompt_length(self) -> int:
        """Tokens of the last prompt prepared on this history (what the pool weighs a match against)."""
        return len(self._prompt) or len(self.tokens)

    def split_points(self) -> List[int]:
        """Where the prefill of the prepared prompt must stop for a checkpoint (absolute positions)."""
        return sorted(self._plan)

    def fed(self, position: int) -> None:
        """The prefill has fed the prepared prompt up to ``position``: record it, checkpoint where
        planned, and thin the checkpoints once the whole prompt is in."""
        self.tokens = self._prompt[:position]
        if position in self._plan:
            self.checkpoint(position)
        if position == len(self._prompt):
            chosen = spread(self.checkpoints, self.pinned, position, self.evenly_spaced + len(self.pinned))
            self.checkpoints = {p: s for p, s in self.checkpoints.items() if p in chosen}

    def diverged(self, prompt: Sequence[int]) -> None:
        """Remember where ``prompt`` leaves this history, if before the end of the history's last
        prompt (not in its answer, nor in the tail a template rewrites): a head shared with another
        conversation. The earliest ``HEADS`` are kept: later ones are mostly where a template
        rewrote a turn, which the tail pin of ``prepare`` serves."""
        shared = self.shared_prefix(prompt)
        if GRID <= shared < self.prompt_length - REWRITTEN_TAIL:
            self.heads = sorted({*self.heads, on_grid(shared)})[:HEADS]

    def extend(self, tokens: List[int]) -> None:
        """Record tokens the target cache now holds."""
        self.tokens.extend(tokens)

    def arrays(self) -> list:
        """Every array the history holds: live caches and checkpoints (shared ones repeat)."""
        out = cache_arrays(self.cache or []) + cache_arrays(self.draft_cache or [])
        for states in self.checkpoints.values():
            out += [a for pair in states for a in pair if a is not None]
        return out

    def settle(self) -> None:
        """Evaluate everything the history holds, on the thread that built it. The next turn may
        run on another thread (a web app's thread pool), and MLX runs an operation only on a
        stream of the thread that made it: work left pending on this thread's streams (the CPU
        side streams are per thread) would fail there."""
        mx.eval(self.arrays())

    @property
    def nbytes(self) -> int:
        return _unique_bytes(self.arrays())

    def fork(self, shared: int, length: int) -> Optional["PromptCache"]:
        """A new history holding this one's longest usable prefix within ``shared`` tokens, for a
        prompt of ``length`` tokens that would otherwise wipe this one. Arrays are sliced, never
        mutated in place (MLX slice assignment rewrites the array object itself). None if nothing
        is usable."""
        start = self.restart_point(shared, length)
        draft_cache = [c.fork(start) for c in self.draft_cache] if self.draft_cache is not None else None
        if start == 0 or (draft_cache is not None and None in draft_cache):
            return None
        states = iter(self.checkpoints[start])
        new = PromptCache(self.evenly_spaced)
        new.owner, new.tokens, new.draft_cache = self.owner, self.tokens[:start], draft_cache
        new.heads = [h for h in self.heads if h <= start]
        new.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= start}
        new.cache = []
        for c in self.cache:
            if isinstance(c, GatedDeltaCache):
                layer = GatedDeltaCache(c.recurrence)
                (layer.conv_state, layer.state), layer.offset = next(states), start
            elif isinstance(c, WindowCache):
                layer = c.fork(start, *next(states))
            else:
                layer = KVCache()
                layer.keys, layer.values = c.keys[..., :start, :], c.values[..., :start, :]
                layer.offset = start
            new.cache.append(layer)
        return new


def spread(positions: Iterable[int], fixed: Set[int], end: int, budget: int) -> Set[int]:
    """At most ``budget`` of ``positions`` (``fixed`` always among them) such that the largest gap
    between 0, the kept positions and ``end`` is as small as possible: for a given gap the greedy
    walk keeps the fewest; bisection finds the smallest gap that fits the budget."""
    positions = sorted(set(positions))
    fixed = set(fixed) & set(positions)
    if len(positions) <= budget:
        return set(positions)

    def cover(reach: int) -> Optional[Set[int]]:
        kept, here = set(fixed), 0
        for i, p in enumerate(positions):
            following = positions[i + 1] if i + 1 < len(positions) else end
            if p - here > reach:
                return None  # a gap no choice closes
            if p in fixed or following - here > reach:
                kept.add(p)
                here = p
        return kept if end - here <= reach else None

    low, high, best = 1, max(end, 1), set(fixed)
    while low <= high:
        reach = (low + high) // 2
        kept = cover(reach)
        if kept is not None and len(kept) <= budget:
            best, high = kept, reach - 1
        else:
            low = reach + 1
    return best


def _unique_bytes(arrays: Iterable) -> int:
    seen, total = set(), 0
    for a in arrays:
        if id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes
    return total


class PromptCachePool:
    """Several histories under one memory budget, so that clients that alternate (a chat and an
    editor's completions) do not wipe each other's caches.

    A prompt goes to the history it shares the longest prefix with. If that prefix is under half
    of the history's last prompt (another file, another conversation with the same system prompt),
    the history is forked at it instead, so both stay. (Half of the prompt, not of the history: a
    short prompt resent after a long answer shares its whole prompt, and forked every time it grew
    the pool by one history a send.) After each generation the least recently used
    histories go until the pool fits ``budget_bytes``; the one just used always stays.
    """

    def __init__(self, budget_bytes: int, checkpoints: int = CHECKPOINTS, store=None):
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache budget must not be negative, got {budget_bytes}")
        self.budget_bytes, self.checkpoints = budget_bytes, checkpoints
        self.histories: List[PromptCache] = []  # least recently used first
        self.busy: List[PromptCache] = []  # taken by a generation not yet released
        # The disk tier (``prompt_store.PromptStore``; None: RAM only): released histories are
        # written there, and ``take`` loads an entry that restarts a prompt further than RAM can.
        self.store = store
        self.ram_hits = self.evictions = 0

    def take(self, prompt: Sequence[int]) -> PromptCache:
        """The history to run ``prompt`` on, now the most recently used, busy until ``release``. A
        history another generation is running on is never handed out twice: a prompt that matches
        it best gets a fork at the shared prefix (its arrays are never written in place)."""
        best = max(self.histories, key=lambda h: h.shared_prefix(prompt), default=None)
        shared = best.shared_prefix(prompt) if best is not None else 0
        in_ram = best.restart_point(shared, len(prompt)) if best is not None else 0
        found = self.store.find(prompt, better_than=in_ram) if self.store is not None else None
        loaded = self.store.load(found[0], self.checkpoints) if found is not None else None
        if loaded is not None:
            chosen = loaded
        elif best is not None and shared > 0 and 2 * shared >= best.prompt_length and best not in self.busy:
            chosen = best
        else:
            chosen = (best.fork(shared, len(prompt)) if best is not None and shared > 0 else None) or PromptCache(self.checkpoints)
        if loaded is None and in_ram > 0:
            self.ram_hits += 1
        chosen.diverged(prompt)
        if chosen in self.histories:
            self.histories.remove(chosen)
        self.histories.append(chosen)
        self.busy.append(chosen)
        return chosen

    def release(self, history: Optional[PromptCache]) -> None:
        """The generation on ``history`` is over: it may be taken again; the pool is trimmed."""
        if history in self.busy:
            self.busy.remove(history)
        if self.store is not None and history is not None:
            self.store.save(history)  # when the disk lacks its head, or it grew: ``PromptStore.save``
        self.trim()

    def trim(self) -> None:
        """Evict least recently used histories until the pool fits its budget (all but the last,
        and none a generation is running on); with a disk tier, each goes to disk unless an entry
        there ends at its longest checkpoint already (eviction is not loss)."""
        idle = [h for h in self.histories[:-1] if h not in self.busy]
        while idle and self.nbytes > self.budget_bytes:
            evicted = idle.pop(0)
            if self.store is not None:
                self.store.save(evicted, evicted=True)
            self.histories.remove(evicted)
            self.evictions += 1

    def reset(self) -> None:
        self.histories.clear()

    @property
    def nbytes(self) -> int:
        return _unique_bytes(a for h in self.histories for a in h.arrays())
