"""Reuse of target and draft caches across prompts that share a prefix (chat turns, editors).

Attention KV caches can be cut back to any length, but a Gated DeltaNet state cannot be run
backwards. So the cache keeps *checkpoints*: the Gated DeltaNet states (immutable MLX arrays,
kept by reference, no copy) at the end of every prefill chunk and of every prompt, and the live
state after the last step. A new prompt restarts from the longest checkpoint inside the prefix it
shares with the cached tokens and prefills only the rest. The result is the same computation a
fresh run does, split at a different place.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .cache import GatedDeltaCache

MAX_CHECKPOINTS = 8


class PromptCache:
    """The caches of one token history, for one target (and draft)."""

    def __init__(self, max_checkpoints: int = MAX_CHECKPOINTS):
        self.tokens: List[int] = []  # exactly the tokens the target cache holds
        self.cache: Optional[list] = None
        self.draft_cache: Optional[list] = None
        self.owner: Optional[Tuple[int, int]] = None
        self.checkpoints: Dict[int, list] = {}
        self.max_checkpoints = max_checkpoints

    def reset(self) -> None:
        self.tokens, self.cache, self.draft_cache, self.owner = [], None, None, None
        self.checkpoints.clear()

    def _gdn_states(self) -> list:
        return [(c.conv_state, c.state) for c in self.cache if isinstance(c, GatedDeltaCache)]

    def checkpoint(self, position: int) -> None:
        """Remember the Gated DeltaNet states of the first ``position`` cached tokens (the
        live ones: call it when the cache holds exactly that many)."""
        self.checkpoints[position] = self._gdn_states()
        while len(self.checkpoints) > self.max_checkpoints:
            del self.checkpoints[min(self.checkpoints)]

    def checkpoint_here(self) -> None:
        """Checkpoint at the current length of the target cache."""
        self.checkpoint(self.cache[0].offset)

    def prepare(self, target, draft, prompt: List[int], draft_window: Optional[int] = None) -> int:
        """Make the caches hold a prefix of ``prompt``; returns its length (0 when starting over)."""
        owner = (id(target), id(draft))
        shared = 0
        if self.owner == owner and self.cache is not None:
            limit = min(len(self.tokens), len(prompt) - 1)  # at least one prompt token must be fed
            while shared < limit and self.tokens[shared] == prompt[shared]:
                shared += 1
        live = len(self.tokens)
        # A generation stopped mid-step (Ctrl-C, a dropped client) leaves the live state ahead of
        # the recorded tokens: then only the checkpoints are trustworthy.
        live_ok = shared > 0 and all(c.offset == live for c in self.cache + (self.draft_cache or []))
        candidates = [p for p in self.checkpoints if p <= shared] + ([live] if live_ok and live <= shared else [])
        start = max(candidates, default=0)
        if start == 0 or (draft is not None and not all(c.rewind(start) for c in self.draft_cache)):
            self.reset()
            self.owner = owner
            self.cache = target.make_cache()
            self.draft_cache = draft.make_cache(draft_window) if draft is not None else None
            return 0
        states = iter(self._gdn_states() if start == live else self.checkpoints[start])
        for c in self.cache:
            if isinstance(c, GatedDeltaCache):
                c.conv_state, c.state = next(states)
                c.offset, c.tape = start, None
            else:
                c.trim(c.offset - start)
        self.tokens = self.tokens[:start]
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= start}
        return start

    def extend(self, tokens: List[int]) -> None:
        """Record tokens the target cache now holds."""
        self.tokens.extend(tokens)
