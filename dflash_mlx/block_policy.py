"""How many tokens each speculative cycle drafts: fixed, or chosen from what cycles cost and yield.

A cycle of block size ``b`` commits ``1 + accepted`` tokens and costs a draft pass, a verify pass
of ``b`` tokens, a rollback and a hand-off; ``b = 1`` is a plain decode step (whose tapped
features still reach the draft, so drafting can resume at any time). ``AutoBlock`` picks, each
cycle, the ``b`` in ``1..cap`` that maximises expected committed tokens per second,
``E[tokens | b] / cost(b)``, from two kinds of statistics:

- ``CycleCosts``: wall time per cycle, measured on this machine with this pair, as a function of
  ``b``, following the context as it grows. A property of the machine and the pair: kept across
  requests.
- ``SlotAcceptance``: the chance that draft slot ``i`` is accepted given that the slots before it
  were, so that one cycle at ``b = 8`` also informs ``b = 4``. A property of the request: each
  one starts fresh, with the previous request's totals as a weak prior.

A bounded share of cycles (at most ``PROBE_SHARE``, less while nothing surprises) probes other
sizes, so a workload that changes is noticed within a few dozen cycles. Nothing here touches
MLX or a model: decisions are pure functions of the statistics, testable on synthetic streams.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Union

PROBE_SHARE = 0.05  # the most cycles that may go to probing, in the long run
PROBE_GAP_MIN, PROBE_GAP_MAX = 20, 50  # cycles between probes: 5% right after a surprise, 2% when settled
PROBE_GAP_GROWTH = 1.5  # each unsurprising probe stretches the gap by this much
PROBE_BURST = 2.0  # probes that may be saved up and spent right after a surprise
SURPRISE = 0.1  # accepted at least this far with less than this chance: the workload changed
DEEP_PRIOR = 3.0  # cycles the prior of slots 2.. is worth
COLLAPSE = 0.002  # a run of first-slot rejections this unlikely: acceptance collapsed
OPTIMISM = 0.7  # decisions count each slot's acceptance this many standard errors high (see values)
CLOSE_CALL = 0.9  # drafting within 10% of plain decoding: probe at the shortest gap
RESTART_KEEP = 2.0  # outcomes per slot a restart keeps
FORGET = 0.97  # per outcome of a slot: acceptance remembers about the last 30 of them



class BlockChooser(Protocol):
    """What the decode loop asks for a block size and tells what the cycle did."""

    def choose(self) -> int: ...

    def shadow_tokens(self) -> int: ...

    def observe(
        self, block: int, accepted: int, seconds: float,
        committed: Sequence[int] = (), proposals: Sequence[int] = (), handed_off: int = 0,
    ) -> None: ...


@dataclass(frozen=True)
class BlockTokens:
    """A parsed ``block_tokens`` setting: ``N`` (exactly N), ``auto`` or ``auto:N`` (at most N)."""

    auto: bool
    tokens: Optional[int] = None  # fixed size, or auto's cap (None: the draft's block size)

    @classmethod
    def parse(cls, value: Union[None, int, str, "BlockTokens"]) -> "BlockTokens":
        if isinstance(value, BlockTokens):
            return value
        if value is None:
            return cls(auto=True)
        if isinstance(value, bool):
            raise ValueError(f"block_tokens {value!r}: expected an integer, 'auto' or 'auto:N'")
        if isinstance(value, int):
            tokens, auto = value, False
        else:
            text = str(value).strip().lower()
            auto = text == "auto" or text.startswith("auto:")
            digits = text[5:] if text.startswith("auto:") else (None if auto else text)
            try:
                tokens = None if digits is None else int(digits)
            except ValueError:
                raise ValueError(f"block_tokens {value!r}: expected an integer, 'auto' or 'auto:N'") from None
        if tokens is not None and tokens < 1:
            raise ValueError(f"block_tokens {value!r}: a block is at least 1 token")
        return cls(auto=auto, tokens=tokens)

    def cap(self, draft_block_size: Optional[int]) -> int:
        """The largest block this setting may use with a draft of ``draft_block_size`` (None: no
        draft, where only auto and 1 mean something): the one check of a setting against a pair."""
        if draft_block_size is None:
            if not self.auto and self.tokens != 1:
                raise ValueError(f"block_tokens {str(self)!r} needs a draft model")
            return 1
        tokens = draft_block_size if self.tokens is None else self.tokens
        if tokens > draft_block_size:
            raise ValueError(f"block_tokens {str(self)!r}: more than the draft's block size {draft_block_size}")
        return tokens

    def __str__(self) -> str:
        if not self.auto:
            return str(self.tokens)
        return "auto" if self.tokens is None else f"auto:{self.tokens}"


class FixedBlock:
    """Every cycle drafts the same block: what ``--block-tokens N`` means."""

    def __init__(self, block: int):
        self.block = block

    def choose(self) -> int:
        return self.block

    def shadow_tokens(self) -> int:
        return 0

    def observe(self, *args, **kwargs) -> None:
        pass


def _solve(a: List[List[float]], b: List[float]) -> List[float]:
    """``a x = b`` for a small symmetric positive definite ``a`` (Gaussian elimination).

    Plain Python on purpose: numpy's per-call overhead, measured inside the decode loop, was
    50 us for a 5x5 outer product, a sizeable share of a small model's decode step."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for k in range(n):
        pivot = m[k][k]
        for i in range(k + 1, n):
            ratio = m[i][k] / pivot
            if ratio:
                for j in range(k, n + 1):
                    m[i][j] -= ratio * m[k][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


class CycleCosts:
    """Seconds per cycle as a function of block size, measured online on this machine and pair.

    Two parts: each measured size's recent mean (an exponential average), and a line fitted by
    weighted least squares, ``cost = a + s*[b>1] + c*(b-1)`` (a decode step; the draft pass and
    hand-off; each verified token), for sizes never measured. A size's prediction moves from the
    line to its own mean as measurements come in, so kernels that change with the row count are
    seen where they matter. Both forget, which is how costs follow the context as it grows: a
    context term in the fit was tried and dropped, since within a request the context spans too
    little to separate from the intercept and its fitted slope came out negative. A weak ridge
    makes the line defined from the first measurement and, with ``b - 1`` unscaled, puts what
    one size cannot tell apart on the per-token slope: sizes between those measured look
    cheaper than a flat line would say, and get tried. The first measurement of each size is
    skipped (it pays for compiling); once a size is settled, its measurements are clipped at
    ``CLIP`` times its prediction (a paused consumer, a page fault, a neighbour's burst on a shared
    machine: one such cycle should move the mean a little, not a fifth of the way).

    The controller must cost far less than a cycle (a few milliseconds on a small model, where
    Python inside the decode loop ran about 3x slower than in isolation): a size measured
    ``SETTLED`` times keeps every ``SAMPLE``-th of its cycles only, and the line is solved every
    ``REFIT`` measurements. ``version`` changes whenever a prediction may have.
    """

    SETTLED, SAMPLE, REFIT, CLIP = 8, 8, 4, 1.5
    PRIOR_SIZES = 3  # distinct sizes measured before the line replaces the prior's shape

    def __init__(self, forget: float = 0.98, ridge: float = 1e-3, prior: Optional[Sequence[float]] = None):
        self.forget, self.ridge = forget, ridge
        # A modelled cost per size 1..n (in any unit: decode steps from ``traffic.auto_prior`` on a
        # Mac): the predictions before anything is measured, and, scaled to what has been, for the
        # sizes not measured until PRIOR_SIZES sizes have been. None: all sizes alike, then the line.
        self.prior: Optional[List[float]] = list(prior) if prior else None
        self.gram = [[0.0] * 3 for _ in range(3)]  # upper triangle used
        self.moment = [0.0] * 3
        self.weight = 0.0  # decayed number of measurements in the fit
        self.theta = [0.0] * 3
        self.recent: Dict[int, float] = {}  # block size -> recent mean seconds
        self.measured: Dict[int, int] = {}  # block size -> measurements kept
        self.cycles: Dict[int, int] = {}  # block size -> cycles seen
        self.smallest = float("inf")
        self.version = 0
        self._since_fit = 0

    def line(self, block: int) -> float:
        a, s, c = self.theta
        return a if block == 1 else a + s + c * (block - 1)

    def set_prior(self, prior: Optional[Sequence[float]]) -> None:
        """Start from modelled costs (``prior[b - 1]`` for size b; None leaves things as they are)."""
        if prior:
            self.prior = list(prior)
            self.version += 1

    def _modelled(self, block: int) -> float:
        """The prior's cost of ``block`` (extended along its last step past its end)."""
        p = self.prior
        if block <= len(p):
            return p[block - 1]
        step = p[-1] - p[-2] if len(p) > 1 else 0.0
        return p[-1] + step * (block - len(p))

    def observe(self, block: int, seconds: float) -> None:
        seen = self.cycles[block] = self.cycles.get(block, 0) + 1
        if seen == 1:
            return  # the first cycle of a size compiles
        if self.measured.get(block, 0) >= self.SETTLED and seen % self.SAMPLE:
            return
        if self.measured.get(block, 0) >= self.SETTLED:
            seconds = min(seconds, self.CLIP * self.predict(block, block)[0])
        drafting = 1.0 if block > 1 else 0.0
        x, f = (1.0, drafting, drafting * (block - 1)), self.forget
        for i, row in enumerate(self.gram):
            for j in range(i, 3):
                row[j] = f * row[j] + x[i] * x[j]
        self.moment = [f * m + xi * seconds for m, xi in zip(self.moment, x)]
        self.weight = f * self.weight + 1.0
        kept = self.measured[block] = self.measured.get(block, 0) + 1
        if kept == 1 or self._since_fit + 1 >= self.REFIT:  # a new size, or due
            g = self.gram
            ridged = [[g[min(i, j)][max(i, j)] + (self.ridge if i == j else 0.0) for j in range(3)] for i in range(3)]
            self.theta = _solve(ridged, self.moment)
            self._since_fit = 0
        else:
            self._since_fit += 1
        old = self.recent.get(block, seconds)
        self.recent[block] = old + max(1.0 / kept, 0.2) * (seconds - old)
        self.smallest = min(self.smallest, seconds)
        self.version += 1

    def predict(self, first: int, last: int) -> List[float]:
        """Predicted seconds per cycle for ``b = first..last``."""
        if not self.weight:  # nothing measured: the modelled costs, or all sizes alike
            return [self._modelled(b) if self.prior else 1.0 for b in range(first, last + 1)]
        # Where a size's prediction starts before its own measurements: the prior's shape scaled to
        # the sizes measured so far, until PRIOR_SIZES of them are; then the fitted line.
        unit = None
        if self.prior is not None and len(self.measured) < self.PRIOR_SIZES:
            kept = sum(self.measured.values())
            unit = sum(n * self.recent[b] / self._modelled(b) for b, n in self.measured.items()) / kept
        out = []
        for b in range(first, last + 1):
            kept = self.measured.get(b, 0)
            own = kept / (kept + 1.0)
            base = self.line(b) if unit is None else unit * self._modelled(b)
            cost = own * self.recent[b] + (1.0 - own) * base if kept else base
            out.append(max(cost, 0.5 * self.smallest))
        return out


class SlotAcceptance:
    """``P(slot i accepted | slots 1..i-1 accepted)`` per draft slot, forgetting old outcomes.

    Each slot's prior has the estimate of the slot before it as its mean (1/2 for the first,
    worth one cycle; ``DEEP_PRIOR`` cycles for the others, which are tried rarely and whose few
    outcomes would otherwise swing every slot after them): a slot is rarely more reliable than
    the one before it, so slots never tried are not assumed to be coin flips. Each slot forgets
    per outcome of its own (``FORGET``), not per cycle: at ``b = 1`` nothing is forgotten, so the
    sparse probes there add up instead of fading before the next one. Totals over the whole
    request (no forgetting) make the next request's prior: a request's end (an answer's last
    lines, after the file it copied) says little about how the next one starts.

    A cycle that drafted ``d`` tokens and accepted ``n`` tried slots ``1..min(n+1, d)`` and
    accepted slots ``1..n``; slots past the first rejection were not tried at all.
    """

    def __init__(self):
        self.accepted: List[float] = []
        self.tried: List[float] = []
        self.total_accepted: List[float] = []
        self.total_tried: List[float] = []
        self.version = 0

    def _grow(self, slots: int) -> None:
        grow = slots - len(self.tried)
        if grow > 0:
            for counts in (self.accepted, self.tried, self.total_accepted, self.total_tried):
                counts += [0.0] * grow

    def probabilities(self, slots: int, optimism: float = 0.0) -> List[float]:
        """Estimates for slots ``1..slots``; ``optimism`` adds that many standard errors to each."""
        self._grow(slots)
        out, prior, strength = [], 0.5, 1.0
        for a, t in zip(self.accepted[:slots], self.tried[:slots]):
            prior = (a + strength * prior) / (t + strength)
            if optimism:
                out.append(min(1.0, prior + optimism * math.sqrt(prior * (1.0 - prior) / (t + strength))))
            else:
                out.append(prior)
            strength = DEEP_PRIOR
        return out

    def expected_tokens(self, cap: int, optimism: float = 0.0) -> List[float]:
        """``E[committed tokens | b]`` for ``b = 1..cap``: 1 + expected accepted of ``b-1`` slots."""
        out, reach, total = [1.0], 1.0, 1.0
        for p in self.probabilities(cap - 1, optimism):
            reach *= p
            total += reach
            out.append(total)
        return out

    def chance_of_at_least(self, drafted: int, accepted: int) -> float:
        """The model's probability that ``drafted`` slots yield ``accepted`` or more."""
        reach = 1.0
        for p in self.probabilities(drafted)[:accepted]:
            reach *= p
        return reach

    def observe(self, drafted: int, accepted: int) -> None:
        self._grow(drafted)
        for i in range(min(accepted + 1, drafted)):
            hit = 1.0 if i < accepted else 0.0
            self.tried[i] = FORGET * self.tried[i] + 1.0
            self.accepted[i] = FORGET * self.accepted[i] + hit
            self.total_tried[i] += 1.0
            self.total_accepted[i] += hit
        self.version += 1

    def restart(self, keep: float = RESTART_KEEP) -> None:
        """After a change of workload: keep at most ``keep`` outcomes' worth of the past per slot,
        so that the next few cycles decide (one lucky probe alone does not)."""
        scale = [min(1.0, keep / t) if t > 0 else 0.0 for t in self.tried]
        self.tried = [t * f for t, f in zip(self.tried, scale)]
        self.accepted = [a * f for a, f in zip(self.accepted, scale)]
        self.version += 1

    def as_prior(self, weight: float = 4.0) -> "SlotAcceptance":
        """A fresh copy whose counts are this request's totals, scaled to at most ``weight``
        cycles per slot (this one's own prior, when it observed nothing)."""
        prior = SlotAcceptance()
        prior._grow(len(self.tried))
        if not any(self.total_tried):
            prior.tried, prior.accepted = list(self.tried), list(self.accepted)
            return prior
        scale = [min(1.0, weight / t) if t > 0 else 0.0 for t in self.total_tried]
        prior.tried = [t * s for t, s in zip(self.total_tried, scale)]
        prior.accepted = [a * s for a, s in zip(self.total_accepted, scale)]
        return prior


@dataclass
class BlockStats:
    """What ``AutoBlock`` keeps between requests: the costs, the last acceptance, the probe gap
    and the random generator (seeded: decisions are reproducible given the same measurements)."""

    costs: CycleCosts = field(default_factory=CycleCosts)
    acceptance: SlotAcceptance = field(default_factory=SlotAcceptance)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    probe_gap: float = float(PROBE_GAP_MIN)

    @classmethod
    def seeded(cls, seed: int) -> "BlockStats":
        return cls(rng=random.Random(seed))


class AutoBlock:
    """Per cycle, the block size with the most expected committed tokens per second.

    One instance per request: it starts a fresh ``SlotAcceptance`` from ``stats``' last one (as a
    prior) and shares ``stats.costs`` with every other request on this pair.

    Probes come every ``gap`` cycles (20, stretching to 50 while they confirm the model), from a
    bucket that refills at ``PROBE_SHARE`` per cycle. While drafting, a probe runs a random other
    size. At ``b = 1`` a greedy request probes with a *shadow*: the plain step also drafts
    ``cap - 1`` tokens without verifying them, and the tokens the target commits next say
    exactly how many a cycle of ``cap`` would have accepted, for the price of one draft pass
    (greedy verification accepts the longest prefix equal to the target's own tokens). Sampled
    requests probe at ``b = 2`` instead (their acceptance is a coin flip per token, not a match),
    and follow an accepted one at once with a probe at ``cap``. When drafting comes within
    ``CLOSE_CALL`` of plain decoding, probes keep the shortest gap and every other one drafts
    the best drafting size for real: a shadow measures acceptance but not what a cycle costs,
    and a cost measured in a busy moment would otherwise never be revisited.
    A surprise (a probe or cycle accepting far more than the model expected: the workload
    changed) makes the acceptance start over from its prior, and the next probe comes at once, at
    ``cap`` (a shadow at ``b = 1``); a request starts that way too, unless it starts at ``cap``.
    A collapse (first slots rejected in a row against odds below ``COLLAPSE``: two in a row
    where the first slot was 97% right) restarts the acceptance too; a gentler drop needs no
    help, the drafting cycles themselves measure it.
    """

    def __init__(self, stats: BlockStats, cap: int, shadow: bool = True):
        if cap < 1:
            raise ValueError(f"auto block cap must be at least 1, got {cap}")
        self.stats, self.cap, self.can_shadow = stats, cap, shadow and cap > 1
        self.acceptance = stats.acceptance.as_prior()
        stats.acceptance = self.acceptance  # the next request's prior is this one's result
        self.bucket = PROBE_BURST  # probes available now; refills at PROBE_SHARE per cycle
        self.gap = stats.probe_gap  # where the last request left it: probes thin out across requests too
        self.since_probe = 0
        self.probing = False
        self.surprised = True  # a new request may be a new workload: probe at once unless at cap
        self.shadowing = 0  # draft tokens the current step shadows
        self.shadow: List[int] = []  # shadow proposals not yet compared with committed tokens
        self.shadow_matched = 0
        self._decided_from = None  # the statistics' versions that best_size etc. were computed from
        self.best_size, self.close_call, self.best_drafting = 1, False, 1
        self.last_probe_shadowed = False
        self.rejected_run = 1.0  # the model's chance of the current run of first-slot rejections

    def values(self) -> List[float]:
        """Expected committed tokens per second for ``b = 1..cap``, optimistic by ``OPTIMISM``
        standard errors per slot: a size dropped after a few unlucky cycles is seen again only
        by sparse probes, so an estimate left low would stay low (the bias of stopping after bad
        luck); one left high is corrected by the very cycles it buys."""
        costs = self.stats.costs.predict(1, self.cap)
        return [e / c for e, c in zip(self.acceptance.expected_tokens(self.cap, OPTIMISM), costs)]

    def best(self) -> int:
        """The best size; recomputed only when the statistics moved."""
        key = (self.stats.costs.version, self.acceptance.version)
        if self._decided_from != key:
            values = self.values()
            best = 1 + values.index(max(values))
            # At b = 1 with drafting nearly as good, probes keep their shortest gap: the estimate
            # that put us here may be a few unlucky cycles, and a shadow settles it cheaply.
            runner_up = 2 + values[1:].index(max(values[1:])) if self.cap > 1 else 1
            close = best == 1 and self.cap > 1 and values[runner_up - 1] >= CLOSE_CALL * values[0]
            self._decided_from = key
            self.best_size, self.close_call, self.best_drafting = best, close, runner_up
        return self.best_size

    def choose(self) -> int:
        best = self.best()
        self.bucket = min(self.bucket + PROBE_SHARE, PROBE_BURST)
        self.since_probe += 1
        self.shadowing = 0
        if self.surprised and best == self.cap:
            self.surprised = False  # more acceptance than expected, at cap already: nothing to probe
        gap = PROBE_GAP_MIN if self.close_call else self.gap
        self.probing = self.cap > 1 and self.bucket >= 1.0 and (self.surprised or self.since_probe >= gap)
        if self.probing and best == 1 and self.can_shadow and self.shadow:
            self.probing = False  # the last shadow is still being compared
        if not self.probing:
            return best
        self.bucket -= 1.0
        self.since_probe = 0
        surprised, self.surprised = self.surprised, False
        if best == 1 and self.can_shadow and not (self.close_call and self.last_probe_shadowed):
            self.shadowing, self.last_probe_shadowed = self.cap - 1, True
            return 1
        self.last_probe_shadowed = False
        if best == 1 and self.close_call:  # measure what the best drafting size costs now
            return self.best_drafting
        if surprised and best != self.cap:
            return self.cap
        if best == 1:  # one drafted token: whether the first slot is accepted decides it all
            return 2
        return self.stats.rng.choice([b for b in range(1, self.cap + 1) if b != best])

    def shadow_tokens(self) -> int:
        """Draft tokens to propose, unverified, alongside the plain step just chosen (0: none)."""
        return self.shadowing

    def observe(
        self, block: int, accepted: int, seconds: float,
        committed: Sequence[int] = (), proposals: Sequence[int] = (), handed_off: int = 0,
    ) -> None:
        """What a cycle did: its size, accepted drafts, wall time and the tokens it committed;
        ``proposals``: the shadow drafted alongside it; ``handed_off``: plain steps whose features
        it gave the draft. Either makes its time something else than its size's cost."""
        if proposals:
            self.shadow, self.shadow_matched = list(proposals), 0
        if self.shadow:
            self._compare_shadow(committed)
        if block > 1:
            self._learn(block - 1, accepted)
        if not proposals and handed_off <= 1:
            self.stats.costs.observe(block, seconds)

    def _compare_shadow(self, committed: Sequence[int]) -> None:
        for token in committed:
            i = self.shadow_matched
            if token != self.shadow[i]:
                break
            self.shadow_matched = i + 1
            if self.shadow_matched == len(self.shadow):
                break
        else:
            return  # every committed token matched: more to compare
        drafted, self.shadow = len(self.shadow), []
        self._learn(drafted, self.shadow_matched, probe=True)

    def _learn(self, drafted: int, accepted: int, probe: bool = False) -> None:
        surprise = accepted > 0 and self.acceptance.chance_of_at_least(drafted, accepted) < SURPRISE
        # The other way: first slots rejected in a row, each against the odds the model gave it.
        first = self.acceptance.probabilities(1)[0]
        self.rejected_run = self.rejected_run * (1.0 - first) if accepted == 0 else 1.0
        if self.rejected_run < COLLAPSE:  # the draft stopped being right: decide from what comes next
            self.acceptance.restart()
            self.rejected_run = 1.0
        if surprise:  # a new workload: this cycle and the next ones decide alone
            self.acceptance.restart()
            self.surprised = True
            self.gap = float(PROBE_GAP_MIN)
        elif probe or self.probing:
            self.gap = min(self.gap * PROBE_GAP_GROWTH, PROBE_GAP_MAX)
            if self.probing and self.best_size == 1 and accepted:  # a sampled probe at b = 2 from b = 1:
                self.surprised = True  # one slot cannot tell copying from a lucky token; look at cap
        self.stats.probe_gap = self.gap
        self.acceptance.observe(drafted, accepted)


def describe(histogram: Dict[int, int]) -> str:
    """``blocks 4:71% 1:29%``: the share of cycles at each size, most used first."""
    total = sum(histogram.values())
    if not total:
        return "blocks -"
    ordered = sorted(histogram.items(), key=lambda kv: (-kv[1], -kv[0]))
    return "blocks " + " ".join(f"{b}:{100 * n / total:.0f}%" for b, n in ordered)
