"""The decode cycle, for one sequence or several: draft every drafting sequence's block in one pass,
verify all their rows in one target pass, then each sequence accepts, rolls back and stops on its own.

``Decoder.dispatch`` queues a cycle (nothing read back); ``resolve`` reads it back once and commits,
putting the caches of sequences that left meanwhile back where the cycle found them. The driver
(``driver.Driver``) dispatches a batch's next cycle before handing out the last one's commits.

A sequence's result never depends on the rest of the batch (docs/design.md, "Batched decoding"):
what mixes rows runs per sequence on its own rows and caches (attention, the Gated DeltaNet
recurrence and convolution, the draft's block attention); what runs on the whole batch works row
by row (matmuls, norms, activations, RoPE, the MoE router).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Container, Generator, List, Optional, Sequence as Seq, Tuple

import mlx.core as mx

from .block_policy import BlockChooser, FixedBlock
from .cache import batch_view, cache_arrays, features_from, restore, rollback_batch, snapshot
from .grammar import Constraint, Guide, masked
from .models.dflash import DFlashDraft
from .models.qwen3_5 import Model as Target
from .prefill import prefill_chunks
from .quantized import MAX_ROWS
from .records import Budget, Commit, logprobs
from .sampling import Sampler, accept

GREEDY = Sampler()  # shadows grade drafts by greedy tokens

# Rows a target pass may take on the CPU (sequences x block): past it the blocks are cut down
# (``plan_blocks``); 64 rows keep four sequences at block 16, or eight at block 8.
ROW_LIMIT = 64


def products_row_independent() -> bool:
    """Whether a product's row is the same bits whatever rows share the call, at any row count,
    on this process's device. On the CPU, yes (MLX's CPU matmuls, float and quantized, at one row
    too; and the recurrence runs one algebra at every length, ``kernels._chunk_one``). On a GPU a
    single row takes a matrix-vector kernel, attention kernels are picked by query count, and the
    verify kernel holds up to ``quantized.MAX_ROWS`` rows. ``batch_row_limit``, ``batch_min_rows``
    and the draft's per-sequence work after a verify pass (one call for all, or one per sequence)
    follow from it."""
    return mx.default_device() != mx.gpu


def batch_row_limit() -> int:
    """Rows one batched target pass may take. On a GPU the quantized layers' verify kernel is
    row-independent up to ``quantized.MAX_ROWS`` rows and stock MLX runs past it (its sums round
    apart), so a pass stays within the kernel: a sequence's bits never depend on how many rows its
    batch-mates add (and past a few rows a pass is arithmetic-bound on M1-M4 anyway,
    docs/kernels.md). On the CPU: ``ROW_LIMIT``."""
    return ROW_LIMIT if products_row_independent() else MAX_ROWS


def batch_min_rows() -> int:
    """Rows the batched engine feeds each sequence at least, so that a sequence's numbers never
    depend on its batch-mates: one where products are row-independent at one row too (the CPU);
    else two (a plain step alone would take a GPU's one-row kernels, beside a batch-mate its
    matrix kernels; the second row is padding, rolled back)."""
    return 1 if products_row_independent() else 2


def plan_blocks(wanted: Seq[int], row_limit: int = ROW_LIMIT, whole: Seq[bool] = ()) -> Tuple[int, List[int]]:
    """The pass's rows per sequence ``T`` and each sequence's block, from the blocks each one's own
    controller wants: ``T`` is the largest wanted, cut to ``row_limit // len(wanted)`` (at least 1)
    when the batch would pass ``row_limit`` rows; a block never exceeds ``T``. A sequence that wants
    1 runs a plain step: its one row rides with its batch-mates' blocks (padded to ``T``), and it
    costs the draft nothing. ``whole[i]``: sequence i's block is never cut (``Sequence.whole_block``;
    ``Decoder.fit`` chose a batch where it fits)."""
    if not wanted:
        raise ValueError("no sequence to plan")
    top = max(1, row_limit // len(wanted))
    whole = list(whole) or [False] * len(wanted)
    blocks = [b if keep else max(1, min(b, top)) for b, keep in zip(wanted, whole)]
    if len(blocks) * max(blocks) > max(row_limit, len(blocks)):
        raise ValueError(f"blocks {blocks} of which {whole} whole do not fit {row_limit} rows")
    return max(blocks), blocks


@dataclass(eq=False)
class Sequence:
    """One sequence's decoding state between cycles: its caches, sampler, controller and budget,
    and the token the next cycle feeds (the last one committed)."""

    cache: list
    draft_cache: Optional[list]
    sampler: Sampler
    chooser: BlockChooser
    budget: Budget
    token: mx.array  # [1]: the next cycle's first input
    pending: List[mx.array] = field(default_factory=list)  # plain steps' features, not yet in the draft
    done: bool = False  # its budget is spent or a stop token came: it leaves
    constraint: Optional[Guide] = None  # its grammar's matcher (structured outputs), at what it committed

    @property
    def context(self) -> int:
        return self.cache[0].offset

    @property
    def whole_block(self) -> Optional[int]:
        """The block a sampled sequence with a fixed size drafts this cycle, never cut by its
        batch-mates: a sampled cycle's draws depend on its block (the draft's distribution over a
        shorter block differs), so a seeded answer would change with the batch. None: any block
        within the pass's rows (greedy output does not depend on the block; auto picks per cycle)."""
        if self.sampler.greedy or not isinstance(self.chooser, FixedBlock) or self.draft_cache is None:
            return None
        left = self.budget.left
        return self.chooser.block if left is None else min(self.chooser.block, left)


@dataclass(eq=False)
class Step:
    """What one cycle dispatched for one sequence (nothing read back yet)."""

    block: int  # rows of it that count (1: a plain step)
    ahead: int = 0  # a shadow's draft tokens beside a plain step
    proposals: Optional[mx.array] = None  # the draft's tokens for the block
    draft_probs: Optional[mx.array] = None
    shadow: Optional[mx.array] = None
    handed_off: int = 0  # plain steps whose features reached the draft with this cycle
    accepted: Optional[mx.array] = None
    next_token: Optional[mx.array] = None
    undo: Optional[list] = None  # the target cache's snapshot from before the cycle

    @property
    def outputs(self) -> List[mx.array]:
        """What the cycle reads back for this sequence."""
        return [a for a in (self.accepted, self.next_token, self.proposals, self.shadow) if a is not None]


@dataclass(eq=False)
class Pass:
    """A dispatched cycle: its sequences, their steps, the rows fed to each and the target's output."""

    batch: List[Sequence]
    steps: List[Step]
    rows: int
    own: List[int]  # rows of it each sequence's attention took (its block, or min_rows), the rest padding
    logits: mx.array  # [B, rows, V]
    features: Optional[mx.array]  # [B, rows, taps x H]
    started: float
    read_at: float = 0.0  # when it was read back


class Decoder:
    """The cycle over sequences of one target and draft (``draft`` None: plain steps).
    ``min_rows``: rows fed to each sequence at least (``batch_min_rows()`` for a batch whose
    sequences must not depend on each other, what the driver uses for every request). ``shared_calls``:
    whether the draft's hand-off and head after a verify pass take every sequence's rows in one
    call (default ``products_row_independent()``). The tests run a GPU's rules (two rows, a call
    per sequence) on the CPU too, so that the path a Mac takes runs here."""

    def __init__(self, target: Target, draft: Optional[DFlashDraft], row_limit: int = ROW_LIMIT, min_rows: int = 1,
                 shared_calls: Optional[bool] = None):
        self.target, self.draft, self.row_limit, self.min_rows = target, draft, row_limit, min_rows
        self.shared_calls = products_row_independent() if shared_calls is None else shared_calls
        self.taps = draft.target_layer_ids if draft is not None else ()
        self.rows = 0  # rows of the last target pass (sequences x rows each), for /metrics

    def start(self, prompt: mx.array, sampler: Sampler, chooser: Optional[BlockChooser] = None,
              cache=None, draft_cache=None, draft_window: Optional[int] = None, max_tokens: Optional[int] = None,
              stop_tokens: Container[int] = (), prefill_step_size: Optional[int] = None, split_at: Seq[int] = (),
              constraint: Optional[Constraint] = None) -> Generator[int, None, Tuple[Sequence, Commit]]:
        """Prefill a new sequence one chunk per ``next`` (yielding the prompt tokens fed so far);
        returns the sequence, ready for its first cycle, and its first commit (the token after the
        prompt). ``constraint``: a grammar every token it commits follows (``grammar``)."""
        draft, target = self.draft, self.target
        cache = target.make_cache() if cache is None else cache
        chooser = chooser if chooser is not None else FixedBlock(draft.block_size if draft is not None else 1)
        on_features = on_skipped = None
        first_kept = 0
        if draft is not None:
            draft_cache = draft.make_cache(draft_window) if draft_cache is None else draft_cache
            first_kept = features_from(draft_cache, prompt.size, cache[0].offset)
            for c in draft_cache:  # room for the prompt's features (and a first block) in one growth
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
        guide = constraint.guide() if constraint is not None else None
        token = sampler(logits if guide is None else masked(logits, guide.mask())).reshape(1)
        seq = Sequence(cache, draft_cache, sampler, chooser, Budget(max_tokens, stop_tokens), token, constraint=guide)
        commit = Commit([token.item()], logprobs(logits)[None])
        if guide is not None:
            guide.commit(commit.tokens)
        seq.done = seq.budget.spent(commit)
        return seq, commit

    def cycle(self, batch: Seq[Sequence]) -> List[Commit]:
        """One cycle for every sequence of ``batch`` (none done), read back: each one's commit."""
        return self.resolve(self.dispatch(batch))

    def fit(self, batch: Seq[Sequence]) -> List[Sequence]:
        """The sequences of ``batch`` (in priority order) that the next pass takes: all of them,
        unless a sequence's whole block (``Sequence.whole_block``) would take the pass past the row
        limit: then it and those after it that would not fit sit this cycle out (the caller puts
        them first next time). The others' blocks are cut to fit (``plan_blocks``)."""
        going: List[Sequence] = []
        need = self.min_rows
        for seq in batch:
            rows = max(need, seq.whole_block or 1)
            if (len(going) + 1) * rows <= self.row_limit or not going:
                going.append(seq)
                need = rows
        return going

    def dispatch(self, batch: Seq[Sequence]) -> Pass:
        """Plan, draft and verify, queued: nothing is read back. ``batch`` must fit one pass
        (``fit``)."""
        started = time.perf_counter()
        steps = self._plan(batch)
        rows = max(max(s.block for s in steps), self.min_rows)
        drafting = [(seq, step) for seq, step in zip(batch, steps) if step.block > 1 or step.ahead]
        if drafting:
            self._draft(drafting)
        fed = []
        for seq, step in zip(batch, steps):
            tokens = seq.token if step.block == 1 else mx.concatenate([seq.token, step.proposals.astype(seq.token.dtype)])
            fed.append(tokens if tokens.size == rows else mx.concatenate([tokens, mx.repeat(tokens[-1:], rows - tokens.size)]))
            step.undo = snapshot(seq.cache)  # references and lengths: what ``resolve`` restores a leaver to
        self.rows = len(batch) * rows
        own = [max(step.block, self.min_rows) for step in steps]  # what each one's attention takes
        cache = batch[0].cache if len(batch) == 1 else batch_view([seq.cache for seq in batch], own)
        logits, features = self.target.forward(mx.stack(fed), cache, self.taps, record_tape=rows > 1,
                                               proposed=[step.block - 1 for step in steps])
        for i, (seq, step) in enumerate(zip(batch, steps)):
            if seq.constraint is not None:  # each row under the grammar's mask after the prefix before it
                allowed = seq.constraint.mask()[None] if step.block == 1 else seq.constraint.masks
                guided = masked(logits[i, : step.block], allowed)
                step.accepted, step.next_token = ((None, seq.sampler(guided[0])) if step.block == 1 else
                                                  accept(guided, step.proposals, step.draft_probs, seq.sampler))
            elif step.block == 1:
                step.accepted, step.next_token = None, seq.sampler(logits[i, 0])
            else:
                step.accepted, step.next_token = accept(logits[i, : step.block], step.proposals, step.draft_probs, seq.sampler)
        mx.async_eval([s.outputs for s in steps])
        return Pass(list(batch), steps, rows, own, logits, features, started)

    def resolve(self, p: Pass, dropped: Container[int] = ()) -> List[Optional[Commit]]:
        """Read the cycle back (its one host synchronisation), roll each sequence back to what it
        committed, feed its draft, tell its controller (the cycle's time runs from its dispatch).
        ``dropped``: the positions of sequences that left while the cycle ran: their caches go back
        to where the cycle found them (the one way to abandon a cycle), and their commit is None."""
        mx.eval([s.outputs for s in p.steps])
        # Each sequence's controller is told the whole cycle's time: what its stream waited for its
        # tokens. A block within the pass's length costs it only draft rows; one that lengthens the
        # pass costs it (and its batch-mates) the longer pass (docs/design.md, "Batched decoding").
        p.read_at = time.perf_counter()
        seconds = p.read_at - p.started
        for i in dropped:
            restore(p.batch[i].cache, p.steps[i].undo)
            self.finish(p.batch[i])
        going = [i for i in range(len(p.batch)) if i not in dropped]
        accepted = {i: 0 if p.steps[i].accepted is None else p.steps[i].accepted.item() for i in going}
        if p.rows > 1:
            rollback_batch([p.batch[i].cache for i in going], [p.own[i] for i in going], [accepted[i] + 1 for i in going])
        features = {i: p.features[i : i + 1, : accepted[i] + 1] if self.taps else None for i in going}
        drafted = [i for i in going if p.steps[i].block > 1]
        if drafted:
            self._hand_off([features[i] for i in drafted], [p.batch[i].draft_cache for i in drafted])
        return [None if i in dropped else
                self._commit(seq, step, p.logits[i, : accepted[i] + 1], accepted[i], features[i], seconds)
                for i, (seq, step) in enumerate(zip(p.batch, p.steps))]

    def finish(self, seq: Sequence) -> None:
        """A sequence leaving: its plain steps' features reach the draft, so that its draft cache is
        level with its target cache (what a prompt cache keeps)."""
        self._hand_off_pending([seq])

    def _hand_off_pending(self, batch: Seq[Sequence]) -> None:
        """The features of each sequence's plain steps since its last draft pass, to its draft."""
        waiting = [seq for seq in batch if seq.pending]
        if waiting and self.draft is not None:
            self._hand_off([mx.concatenate(seq.pending, axis=1) for seq in waiting], [seq.draft_cache for seq in waiting])
            for seq in waiting:
                seq.pending.clear()

    def _plan(self, batch: Seq[Sequence]) -> List[Step]:
        """Each sequence's block (its controller's choice within its budget, then ``plan_blocks``)
        and shadow. A cycle commits at most its block: with ``left`` tokens to go, drafting more
        verifies rows for nothing. The controller is told the size that ran."""
        wanted = []
        for seq in batch:
            block = seq.chooser.choose() if self.draft is not None else 1
            wanted.append(block if seq.budget.left is None else min(block, seq.budget.left))
        whole = [seq.whole_block is not None for seq in batch]
        _, blocks = plan_blocks(wanted, self.row_limit, whole)
        steps = []
        for seq, block in zip(batch, blocks):
            ahead = seq.chooser.shadow_tokens() if block == 1 and self.draft is not None else 0
            left = seq.budget.left  # a shadow is graded by the tokens after it
            steps.append(Step(block, ahead if left is None else max(0, min(ahead, left - 1))))
        return steps

    def _hand_off(self, contexts: List[mx.array], caches: List[list]) -> None:
        """Committed features [1, S_i, taps*H] to their sequences' draft caches: one draft call
        for all where a product's row does not depend on its batch-mates (``shared_calls``), else a
        call per sequence."""
        if len(contexts) > 1 and self.shared_calls:
            self.draft.add_context_batch(contexts, caches)
        else:
            for context, cache in zip(contexts, caches):
                self.draft.add_context(context, cache)

    def _draft(self, drafting: Seq[Tuple[Sequence, Step]]) -> None:
        """One draft pass for every drafting sequence's block (and every shadow); the plain steps'
        features reach the draft first."""
        draft = self.draft
        for seq, step in drafting:
            step.handed_off = len(seq.pending)
            if seq.constraint is not None:  # its first mask, on a worker while the draft's pass runs
                seq.constraint.prefetch()
        self._hand_off_pending([seq for seq, _ in drafting])
        blocks = [mx.concatenate([seq.token, mx.full((max(step.block, step.ahead + 1) - 1,), draft.mask_token_id,
                                                    seq.token.dtype)]) for seq, step in drafting]
        samplers = [seq.sampler if step.block > 1 else GREEDY for seq, step in drafting]
        guides = [seq.constraint.propose if seq.constraint is not None and step.block > 1 else None
                  for seq, step in drafting]  # a grammar's walk picks that sequence's proposals
        guided = {"guides": guides} if any(g is not None for g in guides) else {}
        if len(drafting) == 1:
            proposals = [draft.propose(blocks[0], drafting[0][0].draft_cache, samplers[0],
                                       **({"guide": guides[0]} if guided else {}))]
        else:
            proposals = draft.propose_batch(blocks, [seq.draft_cache for seq, _ in drafting], samplers,
                                            one_head=self.shared_calls, **guided)
        for (seq, step), (tokens, probs) in zip(drafting, proposals):
            if step.block > 1:
                step.proposals, step.draft_probs = tokens, probs
                if seq.constraint is not None:  # a grammar's block ends at a stop token
                    step.block = tokens.size + 1
            else:
                step.shadow = tokens
        # The draft runs while Python builds the verify graph (on a GPU: on MLX's CPU backend
        # async_eval returns once all but ten of the graph's operations have run).
        mx.async_eval([a for _, step in drafting for a in (step.proposals, step.draft_probs, step.shadow) if a is not None])

    def _commit(self, seq: Sequence, step: Step, logits: mx.array, accepted: int, features: Optional[mx.array],
                seconds: float) -> Commit:
        """A sequence's commit (``logits``: its kept rows) after its caches were rolled back and
        its features handed off (``resolve``); a plain step's features wait for its next draft pass."""
        next_token = step.next_token.item()
        if step.block == 1:
            if self.draft is not None:
                seq.pending.append(features)
            commit = Commit([next_token], logprobs(logits))
        else:
            commit = Commit(step.proposals.tolist()[:accepted] + [next_token], logprobs(logits),
                            drafted=step.block - 1, accepted=accepted)
        seq.chooser.observe(block=step.block, accepted=accepted, seconds=seconds, committed=commit.tokens,
                            proposals=step.shadow.tolist() if step.shadow is not None else [],
                            handed_off=step.handed_off, context=seq.context)
        seq.token = step.next_token.reshape(1)
        seq.done = seq.budget.spent(commit)
        if seq.constraint is not None:
            seq.constraint.commit(commit.tokens)
        return commit
