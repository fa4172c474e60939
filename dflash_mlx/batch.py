"""Several sequences decoded together: one draft pass for all their blocks, one target pass over
all their rows, then each sequence accepts, rolls back and stops on its own.

Each sequence's output is the one it gets alone (docs/design.md, "Batched decoding"): every
operation that mixes rows runs per sequence on that sequence's own rows and caches (attention,
the Gated DeltaNet recurrence and convolution, the draft's block attention), and what runs on the
whole batch works row by row (matmuls, norms, activations, the MoE router). Each sequence keeps
its own sampler and generator, block-size controller, budget and stop tokens. Sequences join after
their prefill and leave after any cycle; the cycle reads back once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Container, Generator, List, Optional, Sequence as Seq, Tuple

import mlx.core as mx

from .block_policy import BlockChooser, FixedBlock
from .cache import batch_view, cache_arrays, rollback
from .models.dflash import DFlashDraft
from .models.qwen3_5 import Model as Target
from .sampling import Sampler, accept
from .speculative import GREEDY, Commit, _Budget, _logprobs, features_from, prefill_chunks

# Rows a target pass may take per batch (sequences x block): past it the blocks are cut down
# (``plan_blocks``). On a Mac a pass costs about one read of the weights until the rows reach the
# GPU's arithmetic roof; 64 rows keep four sequences at block 16, or eight at block 8.
ROW_LIMIT = 64
# Rows a target pass feeds each sequence at least. MLX multiplies one row by another kernel than
# several (a matrix-vector product; on the CPU its sums round differently, measured), so a plain
# step fed alone would not give the bits the same step gives beside a batch-mate. Two rows at
# least make every pass the same kind of product, whatever the batch: a sequence's numbers then
# never depend on who else is in it. (The second row is padding, rolled back.)
MIN_ROWS = 2


def plan_blocks(wanted: Seq[int], row_limit: int = ROW_LIMIT) -> Tuple[int, List[int]]:
    """The pass's rows per sequence ``T`` and each sequence's block, from the blocks each one's
    own controller wants: ``T`` is the largest wanted, cut to ``row_limit // len(wanted)`` (at
    least 1) when the batch would pass ``row_limit`` rows; a block never exceeds ``T``. A sequence
    that wants 1 runs a plain step: its one row rides with its batch-mates' blocks (padded to ``T``),
    and it costs the draft nothing."""
    if not wanted:
        raise ValueError("no sequence to plan")
    top = max(1, row_limit // len(wanted))
    blocks = [max(1, min(b, top)) for b in wanted]
    return max(blocks), blocks


@dataclass(eq=False)
class Sequence:
    """One sequence's decoding state between cycles: its caches, sampler, controller and budget,
    and the token the next cycle feeds (the last one committed)."""

    cache: list
    draft_cache: Optional[list]
    sampler: Sampler
    chooser: BlockChooser
    budget: _Budget
    token: Optional[mx.array] = None  # [1]: the next cycle's first input
    pending: List[mx.array] = field(default_factory=list)  # plain steps' features, not yet in the draft
    done: bool = False  # its budget is spent or a stop token came: it leaves the batch
    # What the cycle dispatched for it (set by BatchDecoder.cycle)
    _block: int = 1
    _ahead: int = 0
    _drafted: Optional[mx.array] = None
    _draft_probs: Optional[mx.array] = None
    _shadow: Optional[mx.array] = None
    _handed_off: int = 0

    @property
    def context(self) -> int:
        return self.cache[0].offset


class BatchDecoder:
    """The cycle over a batch of sequences of one target and draft (``draft`` None: plain steps)."""

    def __init__(self, target: Target, draft: Optional[DFlashDraft], row_limit: int = ROW_LIMIT):
        self.target, self.draft, self.row_limit = target, draft, row_limit
        self.taps = draft.target_layer_ids if draft is not None else ()
        self.rows = 0  # rows of the last target pass (sequences x T), for /metrics

    def start(self, prompt: mx.array, sampler: Sampler, chooser: Optional[BlockChooser] = None,
              cache=None, draft_cache=None, draft_window: Optional[int] = None, max_tokens: Optional[int] = None,
              stop_tokens: Container[int] = (), prefill_step_size: Optional[int] = None, split_at: Seq[int] = ()
              ) -> Generator[int, None, Tuple[Sequence, Commit]]:
        """Prefill a new sequence one chunk per ``next`` (yielding the prompt tokens fed so far, so
        that a scheduler runs decode cycles between chunks); returns the sequence, ready to join,
        and its first commit (the token after the prompt)."""
        draft, target = self.draft, self.target
        cache = target.make_cache() if cache is None else cache
        chooser = chooser if chooser is not None else FixedBlock(draft.block_size if draft is not None else 1)
        on_features = on_skipped = None
        first_kept = 0
        if draft is not None:
            draft_cache = draft.make_cache(draft_window) if draft_cache is None else draft_cache
            first_kept = features_from(draft_cache, prompt.size)
            for c in draft_cache:
                if hasattr(c, "reserve"):
                    c.reserve(prompt.size - first_kept + draft.block_size)

            def on_features(features):
                draft.add_context(features, draft_cache)
                return cache_arrays(draft_cache)

            def on_skipped(count):
                for c in draft_cache:
                    c.advance(count)

        logits = yield from prefill_chunks(target, prompt, cache, prefill_step_size, self.taps, on_features, split_at,
                                           first_kept, on_skipped)
        token = sampler(logits).reshape(1)
        seq = Sequence(cache, draft_cache, sampler, chooser, _Budget(max_tokens, stop_tokens), token)
        commit = Commit([token.item()], _logprobs(logits)[None])
        seq.done = seq.budget.spent(commit)
        return seq, commit

    def cycle(self, batch: Seq[Sequence]) -> List[Commit]:
        """One cycle for every sequence of ``batch`` (none of them done): each one's commit."""
        started = time.perf_counter()
        T = max(self._plan(batch), MIN_ROWS)
        drafting = [s for s in batch if s._block > 1 or s._ahead]
        if drafting:
            self._draft(drafting)
        rows = []
        for s in batch:
            fed = s.token if s._block == 1 else mx.concatenate([s.token, s._drafted.astype(s.token.dtype)])
            rows.append(fed if fed.size == T else mx.concatenate([fed, mx.repeat(fed[-1:], T - fed.size)]))
        self.rows = len(batch) * T
        logits, features = self.target.forward(mx.stack(rows), batch_view([s.cache for s in batch]), self.taps,
                                               record_tape=True)
        verdicts = []
        for i, s in enumerate(batch):
            if s._block == 1:
                next_token = s.sampler(logits[i, 0])
                verdicts.append((mx.array(0), next_token))
            else:
                verdicts.append(accept(logits[i, : s._block], s._drafted, s._draft_probs, s.sampler))
        mx.eval(verdicts, [s._drafted for s in drafting if s._block > 1], [s._shadow for s in drafting if s._shadow is not None])
        # Each sequence's controller is told the whole cycle's time: what its stream waited for its
        # tokens. A block within the pass's length costs it only draft rows; one that lengthens the
        # pass costs it (and its batch-mates) the longer pass, so a sequence that drafts badly
        # stays at plain steps or rides within the blocks its batch-mates set (docs/design.md).
        seconds = time.perf_counter() - started
        return [self._resolve(i, s, T, logits, features, n.item(), t.item(), seconds)
                for i, (s, (n, t)) in enumerate(zip(batch, verdicts))]

    def _plan(self, batch: Seq[Sequence]) -> int:
        """Each sequence's block (its controller's choice within its budget, then ``plan_blocks``)
        and shadow; the pass's rows per sequence."""
        wanted = []
        for s in batch:
            left = s.budget.left
            block = s.chooser.choose() if self.draft is not None else 1
            wanted.append(block if left is None else min(block, left))
        T, blocks = plan_blocks(wanted, self.row_limit)
        for s, block in zip(batch, blocks):
            ahead = s.chooser.shadow_tokens() if block == 1 and self.draft is not None else 0
            left = s.budget.left  # a shadow is graded by the tokens after it
            s._block, s._ahead = block, ahead if left is None else max(0, min(ahead, left - 1))
        return T

    def _draft(self, drafting: Seq[Sequence]) -> None:
        """One draft pass for every drafting sequence's block (and every shadow)."""
        draft = self.draft
        for s in drafting:  # plain steps' features reach the draft before it drafts again
            s._handed_off = len(s.pending)
            if s.pending:
                draft.add_context(mx.concatenate(s.pending, axis=1), s.draft_cache)
                s.pending.clear()
        lengths = [s._block if s._block > 1 else s._ahead + 1 for s in drafting]
        blocks = [mx.concatenate([s.token, mx.full((n - 1,), draft.mask_token_id, s.token.dtype)])
                  for s, n in zip(drafting, lengths)]
        samplers = [s.sampler if s._block > 1 else GREEDY for s in drafting]
        for s, (tokens, probs) in zip(drafting, draft.propose_batch(blocks, [s.draft_cache for s in drafting], samplers)):
            if s._block > 1:
                s._drafted, s._draft_probs, s._shadow = tokens, probs, None
            else:
                s._shadow = tokens
        mx.async_eval([s._drafted if s._block > 1 else s._shadow for s in drafting])

    def _resolve(self, i: int, s: Sequence, T: int, logits, features, accepted: int, next_token: int,
                 seconds: float) -> Commit:
        """Roll sequence ``i`` back to what it committed, feed its draft, tell its controller."""
        kept = accepted + 1
        rollback(s.cache, fed=T, keep=kept)
        row = features[i : i + 1, :kept] if self.taps else None
        if s._block == 1:
            if self.draft is not None:
                s.pending.append(row)
            commit = Commit([next_token], _logprobs(logits[i, :1]))
        else:
            self.draft.add_context(row, s.draft_cache)
            commit = Commit(s._drafted.tolist()[:accepted] + [next_token], _logprobs(logits[i, :kept]),
                            drafted=s._block - 1, accepted=accepted)
        s.chooser.observe(block=s._block, accepted=accepted, seconds=seconds, committed=commit.tokens,
                          proposals=s._shadow.tolist() if s._block == 1 and s._shadow is not None else [],
                          handed_off=s._handed_off, context=s.context)
        s.token = mx.array([next_token], dtype=s.token.dtype)
        s._drafted = s._draft_probs = s._shadow = None
        s._handed_off = 0
        s.done = s.budget.spent(commit)
        return commit

    def finish(self, s: Sequence) -> None:
        """A sequence leaving: its plain steps' features reach the draft, so that its draft cache
        is level with its target cache (as ``speculative`` leaves them for the prompt cache)."""
        if s.pending and self.draft is not None:
            self.draft.add_context(mx.concatenate(s.pending, axis=1), s.draft_cache)
            s.pending.clear()
