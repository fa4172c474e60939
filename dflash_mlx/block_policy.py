"""How many tokens each speculative cycle drafts: fixed, or chosen from what cycles cost and yield.

A cycle of block size ``b`` commits ``1 + accepted`` tokens and costs a draft pass, a verify pass
of ``b`` tokens, a rollback and a hand-off; ``b = 1`` is a plain decode step (whose tapped
features still reach the draft, so drafting can resume at any time). ``AutoBlock`` picks, each
cycle, the ``b`` in ``1..cap`` that maximises expected committed tokens per second,
``E[tokens | b] / cost(b, context)``, from two kinds of statistics:

- ``CycleCosts``: wall time per cycle, measured on this machine with this pair, as a function of
  ``b`` and of the context length (the verify pass's and the draft's attention read the whole
  context, a plain step's too, so a cycle's cost grows with it). A property of the machine and the
  pair: kept across requests, so a request at 32k tokens after one at 1k starts from costs
  extrapolated along the slopes measured so far, not from the 1k costs.
- ``SlotAcceptance``: the chance that draft slot ``i`` is accepted given that the slots before it
  were, so that one cycle at ``b = 8`` also informs ``b = 4``. A property of the request: each
  one starts fresh, with the previous request's totals as a weak prior.

Exploring, budgeted in time
---------------------------
The size with the best point estimate, ``v* = max_b E[tokens | b] / cost(b)``, is what a cycle
runs unless it explores: a *probe* (another size), a *shadow* (a plain step that also drafts,
unverified, to measure acceptance) or an *optimistic* choice (a size that only wins once each
slot's acceptance is counted ``OPTIMISM`` standard errors high). Exploring is paid from a bucket
of seconds, shared by every request on the pair (``BlockStats.bucket``):

- every cycle refills it by ``PROBE_SHARE`` times its wall time; it holds at most
  ``PROBE_BURST`` cycles at ``cap`` (their predicted seconds at the current context);
- an exploring cycle may start only while the bucket holds its *predicted regret*: its predicted
  seconds minus the time the best size would take to commit the tokens it is expected to commit,
  ``cost(b) - E[tokens | b] / v*`` (a shadow: its draft pass, ``CycleCosts.shadow``);
- once done it is charged its *measured* regret, ``seconds - committed / v*`` (a shadow:
  ``seconds - cost(1)``), which may leave the bucket below zero until it refills;
- a routine probe must also leave in the bucket what the probe after a surprise would need, so
  that the probe that matters most is not kept waiting by the ones that confirm the model; a
  pair's first cycles, before any cost is measured (they compile), are not charged.

The bound: over any stretch of ``T`` seconds of decoding, the exploring cycles' regret adds up to
at most ``PROBE_SHARE * T + B + d`` seconds, ``B`` the bucket at the stretch's start (at most
``PROBE_BURST`` cycles at ``cap``) and ``d`` one cycle's overshoot (the last exploring cycle's
measured regret above its prediction). Since an exploring cycle commits ``v* * (seconds - regret)``
tokens by the definition of its regret, the tokens per second over the stretch are at least
``(1 - PROBE_SHARE) * v* - v* * (B + d) / T`` if the other cycles run at ``v*``: with
``PROBE_SHARE = 0.03``, 97% of the best size's rate under the model's estimates, less two cycles
per stretch (when ``v*`` moves, each exploring cycle's regret is weighted by the ``v*`` of its
moment). What the bound does not cover is the estimates' error: a cycle that exploits runs at its
size's true rate, not at ``v*``. The costs are measured by the cycles that exploit (every one of
them while the context has moved away from where a size was last measured), the acceptance by
every drafting cycle, so an error lasts a few cycles at the size it misjudges; the probes and
shadows, budgeted above, are what finds errors about sizes not being run. The time spent exploring
is kept: ``AutoBlock.probe_seconds`` (wall time of the exploring cycles), ``probe_regret`` (their
charged regret) and ``seconds`` (all cycles) per request, and the same totals in ``BlockStats`` per
pair.

Probes are paced in cycles too (every ``PROBE_GAP_MIN`` cycles after a surprise, stretching to
``PROBE_GAP_MAX`` while they confirm the model), so a workload that changes is noticed within a
few dozen cycles wherever they are cheap. Nothing here touches MLX or a model: decisions are pure
functions of the statistics, testable on synthetic streams.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Union

PROBE_SHARE = 0.03  # the most of the elapsed time that exploring may cost (its regret), in the long run
PROBE_BURST = 2.0  # the bucket holds at most this many cycles at cap: probes saved up for right after a surprise
PROBE_GAP_MIN, PROBE_GAP_MAX = 20, 50  # cycles between probes: right after a surprise, and when settled
PROBE_GAP_GROWTH = 1.5  # each unsurprising probe stretches the gap by this much
SURPRISE = 0.1  # accepted at least this far with less than this chance: the workload changed
DEEP_PRIOR = 3.0  # cycles the prior of slots 2.. is worth
COLLAPSE = 0.002  # a run of first-slot rejections this unlikely: acceptance collapsed
OPTIMISM = 0.7  # decisions count each slot's acceptance this many standard errors high (see values)
CLOSE_CALL = 0.9  # drafting within 10% of plain decoding: probe at the shortest gap
RESTART_KEEP = 2.0  # outcomes per slot a restart keeps
# Cycles per slot the last request's acceptance counts for at the start of the next: two, so that a
# request whose workload differs (an agent's short tool answer after a long copy) drops a wrong
# prior in two or three cycles, each of which costs a cycle where a plain step was due (2.6 plain
# steps at 4k on this CPU); with four it took three to six.
PRIOR_WEIGHT = 2.0
FORGET = 0.97  # per outcome of a slot: acceptance remembers about the last 30 of them
CONTEXT_UNIT = 4096  # tokens: CycleCosts' context slopes are seconds per this many tokens of context



class BlockChooser(Protocol):
    """What the decode loop asks for a block size and tells what the cycle did."""

    def choose(self) -> int: ...

    def shadow_tokens(self) -> int: ...

    def observe(
        self, block: int, accepted: int, seconds: float,
        committed: Sequence[int] = (), proposals: Sequence[int] = (), handed_off: int = 0,
        context: Optional[int] = None,
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
    """Seconds per cycle as a function of block size and context, measured online on this machine
    and pair.

    Two parts: each measured size's recent mean (an exponential average) with the context it was
    measured at, and a line fitted by weighted least squares,
    ``cost = a + s*[b>1] + c*(b-1) + u * (g + h*[b>1] + e*(b-1))`` with ``u`` the context in
    ``CONTEXT_UNIT`` tokens (a decode step; the draft pass and hand-off; each verified token; and
    what each of them adds per unit of context: a plain step's attention, the draft's attention
    over its context, the verify pass's attention for each further query). A size's prediction
    moves from the line to its own mean as measurements come in, so kernels that change with the
    row count are seen where they matter; the mean is carried to the current context along the
    line's slope for that size. The slopes have a prior worth ``SLOPE_PRIOR`` measurements one unit
    of context apart, pulling them to zero: within a request the context spans too little to
    separate a slope from the intercept (fitted freely, the slope came out negative), while a
    request or a turn at another context, or a long generation, moves it. Until drafting has been
    measured at two contexts, drafting sizes grow with the context as fast as a plain step (the
    verify pass reads the whole context too): a request that starts longer than the last one does
    not start from short-context costs. A negative fitted slope is not extrapolated.

    Both parts forget (per kept measurement), which is how costs follow a machine that gets busier
    or cooler; but a size is measured only while it runs, and a plain step runs rarely while a
    copying workload drafts. So the means also share the machine's *level* (its log speed): when
    two kept measurements of a settled size in a row land more than ``LEVEL_JUMP`` from its
    prediction the same way (a speed jump, not noise nor the slow growth of a context), the level
    moves by ``LEVEL_STEP`` of that surprise and every size's mean moves with it. Without it, plain
    steps measured while the machine ran at half speed kept that cost through a suite at block 4,
    and the next workload drafted block 4 at 11% acceptance: 0.60x of the target alone
    (docs/benchmarks.md, "A machine that changes speed"). A weak ridge makes the line defined
    from the first measurement and, with ``b - 1`` unscaled, puts what one size cannot tell apart
    on the per-token slope: sizes between those measured look cheaper than a flat line would say,
    and get tried. The first measurement of
    each size is skipped (it pays for compiling); once a size is settled, its measurements are
    clipped at ``CLIP`` times its prediction (a paused consumer, a page fault, a neighbour's burst
    on a shared machine: one such cycle should move the mean a little, not a fifth of the way). A
    size measured at a context ``DRIFT`` away from its mean's (a quarter, or 512 tokens) is no longer
    settled: its next measurements are all kept, unclipped, and move its mean quickly.

    A shadow (a plain step that also drafts ``cap - 1`` tokens unverified) costs a plain step plus
    a draft pass and the hand-off of the plain steps before it: ``shadow(context)`` predicts that
    extra from its own recent mean, carried along the draft's context slope ``h``.

    The controller must cost far less than a cycle (a few milliseconds on a small model, where
    Python inside the decode loop ran about 3x slower than in isolation): a size measured
    ``SETTLED`` times keeps every ``SAMPLE``-th of its cycles only, and the line is solved every
    ``REFIT`` measurements. ``version`` changes whenever a prediction may have.
    """

    SETTLED, SAMPLE, REFIT, CLIP = 8, 8, 4, 1.5
    SLOPE_PRIOR = 1.0  # ridge on the context slopes (g, h, e), in measurements one unit of context apart
    DRIFT, DRIFT_FLOOR = 0.25, 512 / CONTEXT_UNIT  # a size unsettles past this relative (or absolute) context move
    LEVEL_STEP = 0.5  # how much of a settled size's surprise (in log seconds) is taken as the machine's
    LEVEL_JUMP = math.log(1.25)  # a settled size's surprise beyond this is the machine's speed, not the context's
    PRIOR_SIZES = 3  # distinct sizes measured before the line replaces the prior's shape

    def __init__(self, forget: float = 0.98, ridge: float = 1e-3, prior: Optional[Sequence[float]] = None):
        self.forget, self.ridge = forget, ridge
        # A modelled cost per size 1..n (in any unit: decode steps from ``traffic.auto_prior`` on a
        # Mac): the predictions before anything is measured, and, scaled to what has been, for the
        # sizes not measured until PRIOR_SIZES sizes have been. None: all sizes alike, then the line.
        self.prior: Optional[List[float]] = list(prior) if prior else None
        self.gram = [[0.0] * 6 for _ in range(6)]  # upper triangle used
        self.moment = [0.0] * 6
        self.weight = 0.0  # decayed number of measurements in the fit
        self.theta = [0.0] * 6
        self.center = 0.0  # the fit's mean context (units): where negative slopes stop extrapolating
        self.recent: Dict[int, float] = {}  # block size -> recent mean seconds, at the machine level of level_at
        self.level = 0.0  # the machine's log speed, as the settled sizes' measurements have moved it
        self.level_at: Dict[int, float] = {}  # block size -> the level its recent mean was measured at
        self.jumped: Dict[int, float] = {}  # block size -> its last kept measurement's surprise beyond LEVEL_JUMP (or 0)
        self.where: Dict[int, float] = {}  # block size -> the context (units) that mean was measured at
        self.measured: Dict[int, int] = {}  # block size -> measurements kept
        self.cycles: Dict[int, int] = {}  # block size -> cycles seen
        self.shadow_extra: Optional[float] = None  # a shadow's recent mean seconds beyond a plain step
        self.shadow_where = 0.0
        self.shadows = 0
        self.smallest = float("inf")
        self.version = 0
        self._since_fit = 0

    def slope(self, block: int) -> float:
        """Fitted seconds per unit of context for size ``block`` (may be negative: see line)."""
        _, _, _, g, h, e = self.theta
        return g if block == 1 else g + h + e * (block - 1)

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

    def line(self, block: int, units: float = 0.0) -> float:
        a, s, c = self.theta[:3]
        base = a if block == 1 else a + s + c * (block - 1)
        slope = self.slope(block)
        return base + slope * self.center + (slope if slope > 0 else 0.0) * (units - self.center)

    def observe(self, block: int, seconds: float, context: int = 0) -> None:
        units = context / CONTEXT_UNIT
        seen = self.cycles[block] = self.cycles.get(block, 0) + 1
        if seen == 1:
            return  # the first cycle of a size compiles
        kept = self.measured.get(block, 0)
        if kept >= self.SETTLED:
            where = self.where[block]
            if abs(units - where) > max(self.DRIFT * where, self.DRIFT_FLOOR):
                kept = self.measured[block] = 2  # measured elsewhere: keep the next ones, unclipped
            elif seen % self.SAMPLE:
                return
            else:
                seconds = min(seconds, self.CLIP * self.predict(block, block, context)[0])
        drafting = 1.0 if block > 1 else 0.0
        x = (1.0, drafting, drafting * (block - 1), units, drafting * units, drafting * (block - 1) * units)
        f = self.forget
        for i, row in enumerate(self.gram):
            xi = x[i]
            for j in range(i, 6):
                row[j] = f * row[j] + xi * x[j]
        self.moment = [f * m + xi * seconds for m, xi in zip(self.moment, x)]
        self.weight = f * self.weight + 1.0
        kept = self.measured[block] = kept + 1
        if kept == 1 or self._since_fit + 1 >= self.REFIT:  # a new size, or due
            self._fit()
        else:
            self._since_fit += 1
        if block in self.recent:
            expected = self._at(block, units)
            surprise = math.log(seconds / expected) if seconds > 0 and expected > 0 else 0.0
            if kept <= self.SETTLED or abs(surprise) <= self.LEVEL_JUMP:
                surprise = 0.0
            elif surprise * self.jumped.get(block, 0.0) > 0:  # twice the same way: the machine's speed moved
                self.level += self.LEVEL_STEP * surprise
            self.jumped[block] = surprise
            self.recent[block] *= math.exp(self.level - self.level_at[block])
        self.level_at[block] = self.level
        step = max(1.0 / kept, 0.2)
        old = self.recent.get(block, seconds)
        self.recent[block] = old + step * (seconds - old)
        old = self.where.get(block, units)
        self.where[block] = old + step * (units - old)
        self.smallest = min(self.smallest, seconds)
        self.version += 1

    def _fit(self) -> None:
        g = self.gram
        ridge = (self.ridge,) * 3 + (self.SLOPE_PRIOR,) * 3
        ridged = [[g[min(i, j)][max(i, j)] + (ridge[i] if i == j else 0.0) for j in range(6)] for i in range(6)]
        self.theta = _solve(ridged, self.moment)
        self.center = g[0][3] / g[0][0]
        self._since_fit = 0

    def observe_shadow(self, seconds: float, context: int = 0) -> None:
        """A shadowed plain step: what it took beyond the plain step's predicted cost."""
        if not self.weight:
            return  # no plain step measured yet: nothing to subtract
        units = context / CONTEXT_UNIT
        extra = max(seconds - self.predict(1, 1, context)[0], 0.0)
        self.shadows += 1
        step = max(1.0 / self.shadows, 0.2)
        if self.shadow_extra is None:
            self.shadow_extra, self.shadow_where = extra, units
        else:
            self.shadow_extra += step * (extra - self.shadow_extra)
            self.shadow_where += step * (units - self.shadow_where)
        self.version += 1

    def shadow(self, context: int = 0) -> float:
        """Predicted seconds a shadow adds to a plain step at ``context``: its own mean carried along
        the draft's slope, or, before any was measured, a drafting cycle of 2 over a plain step."""
        if self.shadow_extra is None:
            one, two = self.predict(1, 2, context)
            return max(two - one, 0.0)
        h = self.theta[4]
        return max(self.shadow_extra + (h if h > 0 else 0.0) * (context / CONTEXT_UNIT - self.shadow_where), 0.0)

    def _at(self, block: int, units: float) -> float:
        """A measured size's recent mean carried to the machine's level now and to ``units`` of
        context along its slope."""
        slope = self.slope(block)
        own = self.recent[block] * math.exp(self.level - self.level_at[block])
        return own + (slope if slope > 0 else 0.0) * (units - self.where[block])

    def predict(self, first: int, last: int, context: int = 0) -> List[float]:
        """Predicted seconds per cycle for ``b = first..last`` at ``context`` tokens (``line`` and
        ``slope`` inlined: this runs whenever a statistic moved, for every size up to the cap)."""
        if not self.weight:  # nothing measured: the modelled costs, or all sizes alike
            return [self._modelled(b) if self.prior else 1.0 for b in range(first, last + 1)]
        units = context / CONTEXT_UNIT
        a, s, c, g, h, e = self.theta
        center, floor = self.center, 0.5 * self.smallest
        recent, where, measured, level, level_at = self.recent, self.where, self.measured, self.level, self.level_at
        # Where a size's prediction starts before its own measurements: the prior's shape scaled to
        # the sizes measured so far (their means carried to this context), until PRIOR_SIZES of them
        # are; then the fitted line.
        unit = None
        if self.prior is not None and len(measured) < self.PRIOR_SIZES:
            unit = sum(n * self._at(b, units) / self._modelled(b) for b, n in measured.items()) / sum(measured.values())
        out = []
        for b in range(first, last + 1):
            if b == 1:
                base, slope = a, g
            else:
                base, slope = a + s + c * (b - 1), g + h + e * (b - 1)
            up = slope if slope > 0 else 0.0
            cost = base + slope * center + up * (units - center) if unit is None else unit * self._modelled(b)
            kept = measured.get(b, 0)
            if kept:
                own = kept / (kept + 1.0)
                cost = own * (recent[b] * math.exp(level - level_at[b]) + up * (units - where[b])) + (1.0 - own) * cost
            out.append(cost if cost > floor else floor)
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

    def expectations(self, cap: int, optimism: float) -> "tuple[List[float], List[float]]":
        """``expected_tokens(cap)`` and ``expected_tokens(cap, optimism)`` in one pass."""
        point, optimistic = [1.0], [1.0]
        reach, reach_up, total, total_up = 1.0, 1.0, 1.0, 1.0
        self._grow(cap - 1)
        prior, strength = 0.5, 1.0
        for a, t in zip(self.accepted[: cap - 1], self.tried[: cap - 1]):
            prior = (a + strength * prior) / (t + strength)
            up = min(1.0, prior + optimism * math.sqrt(prior * (1.0 - prior) / (t + strength)))
            strength = DEEP_PRIOR
            reach, reach_up = reach * prior, reach_up * up
            total, total_up = total + reach, total_up + reach_up
            point.append(total)
            optimistic.append(total_up)
        return point, optimistic

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
    """What ``AutoBlock`` keeps between requests: the costs, the last acceptance, the probe gap,
    the exploration bucket, the last context seen and the random generator (seeded: decisions are
    reproducible given the same measurements). ``seconds``, ``probe_seconds`` and ``probe_regret``
    add up every request's (see ``AutoBlock``): a bench row or ``/metrics`` reads them as totals."""

    costs: CycleCosts = field(default_factory=CycleCosts)
    acceptance: SlotAcceptance = field(default_factory=SlotAcceptance)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    probe_gap: float = float(PROBE_GAP_MIN)
    bucket: Optional[float] = None  # seconds of regret exploring may spend now (None: full, once known)
    context: int = 0  # the context length at the last cycle any request observed
    seconds: float = 0.0
    probe_seconds: float = 0.0
    probe_regret: float = 0.0

    @classmethod
    def seeded(cls, seed: int) -> "BlockStats":
        return cls(rng=random.Random(seed))


class AutoBlock:
    """Per cycle, the block size with the most expected committed tokens per second.

    One instance per request: it starts a fresh ``SlotAcceptance`` from ``stats``' last one (as a
    prior) and shares ``stats.costs`` and the exploration bucket with every other request on this
    pair. The decode loop passes ``context`` (tokens in the target's cache) to ``observe``; a
    request's first choice uses the context the last request ended at.

    A cycle runs the size with the best point estimate unless it explores, and it explores only as
    far as the bucket allows (see the module's docstring for the rule and the bound). Probes are
    due every ``gap`` cycles (20, stretching to 50 while they confirm the model). While drafting, a
    probe runs a random other size. At ``b = 1`` a greedy request probes with a *shadow*: the plain
    step also drafts ``cap - 1`` tokens without verifying them, and the tokens the target commits
    next say exactly how many a cycle of ``cap`` would have accepted, for the price of one draft
    pass (greedy verification accepts the longest prefix equal to the target's own tokens).
    Sampled requests probe at ``b = 2`` instead (their acceptance is a coin flip per token, not a
    match), and follow an accepted one at once with a probe at ``cap``. When drafting comes within
    ``CLOSE_CALL`` of plain decoding, probes keep the shortest gap and every other one drafts the
    best drafting size for real: a shadow measures acceptance but not what a cycle costs, and a
    cost measured in a busy moment would otherwise never be revisited. A probe that is due but
    does not fit the bucket waits for it (at long context, where a cycle costs several plain steps
    and the draft is rarely right, probes thin out by as much).
    A surprise (a probe or cycle accepting far more than the model expected: the workload
    changed) makes the acceptance start over from its prior, and the next probe comes as soon as
    the bucket allows, at ``cap`` (a shadow at ``b = 1``); a request starts that way too, unless it
    starts at ``cap``. The first drafts a request grades (a cycle's or a shadow's) guess its
    answer's opening (a code fence, the chat template's words), which a draft predicts whatever
    follows: accepted where the estimates say plain steps pay, they are not learnt and the next
    probe comes at once; otherwise they count as any outcome. (Learnt, three accepted opening
    tokens kept `edit` at 4k drafting its garbage answer for five more cycles, docs/benchmarks.md;
    where drafting pays already, they agree with the estimates.) A collapse (first slots rejected
    in a row against odds below ``COLLAPSE``: two in a row where the first slot was 97% right)
    restarts the acceptance too; a gentler drop needs no help, the drafting cycles measure it.

    ``seconds``, ``probe_seconds`` (wall time of the cycles that explored: probes, shadows and
    optimistic choices), ``probe_regret`` (what they were charged: their time beyond what the best
    size would have taken for the same tokens) and ``probe_cycles``: this request's; ``stats``
    holds the pair's totals.
    """

    def __init__(self, stats: BlockStats, cap: int, shadow: bool = True):
        if cap < 1:
            raise ValueError(f"auto block cap must be at least 1, got {cap}")
        self.stats, self.cap, self.can_shadow = stats, cap, shadow and cap > 1
        self.acceptance = stats.acceptance.as_prior(PRIOR_WEIGHT)
        stats.acceptance = self.acceptance  # the next request's prior is this one's result
        self.gap = stats.probe_gap  # where the last request left it: probes thin out across requests too
        self.context = stats.context
        self.since_probe = 0
        self.probing = False  # the cycle in flight is a probe (or a shadow)
        self.exploring = False  # the cycle in flight is charged to the bucket
        self.surprised = True  # a new request may be a new workload: probe at once unless at cap
        self.opening = True  # the next outcome learnt is this answer's first
        self.shadowing = 0  # draft tokens the current step shadows
        self.shadow: List[int] = []  # shadow proposals not yet compared with committed tokens
        self.shadow_matched = 0
        self._decided_from = None  # the statistics' versions and context that the decision was computed from
        self.best_size, self.close_call, self.best_drafting = 1, False, 1
        self.point_best, self.rate, self.expected, self.costs = 1, 1.0, [1.0], [1.0]
        self.bucket_cap = 0.0
        self.last_probe_shadowed = False
        self.rejected_run = 1.0  # the model's chance of the current run of first-slot rejections
        self.seconds = self.probe_seconds = self.probe_regret = 0.0
        self.probe_cycles = 0

    def values(self, optimism: float = OPTIMISM) -> List[float]:
        """Expected committed tokens per second for ``b = 1..cap`` at the current context, optimistic
        by ``optimism`` standard errors per slot: a size dropped after a few unlucky cycles is seen
        again only by sparse probes, so an estimate left low would stay low (the bias of stopping
        after bad luck); one left high is corrected by the very cycles it buys. Choosing a size for
        its optimism alone is exploring: it is charged like a probe."""
        costs = self.stats.costs.predict(1, self.cap, self.context)
        return [e / c for e, c in zip(self.acceptance.expected_tokens(self.cap, optimism), costs)]

    def best(self) -> int:
        """The best size, optimistically; recomputed only when the statistics or the context moved."""
        key = (self.stats.costs.version, self.acceptance.version, self.context >> 7)
        if self._decided_from != key:
            costs = self.stats.costs.predict(1, self.cap, self.context)
            expected, optimistic = self.acceptance.expectations(self.cap, OPTIMISM)
            values = [e / c for e, c in zip(optimistic, costs)]
            points = [e / c for e, c in zip(expected, costs)]
            best = 1 + values.index(max(values))
            # At b = 1 with drafting nearly as good, probes keep their shortest gap: the estimate
            # that put us here may be a few unlucky cycles, and a shadow settles it cheaply.
            runner_up = 2 + values[1:].index(max(values[1:])) if self.cap > 1 else 1
            close = best == 1 and self.cap > 1 and values[runner_up - 1] >= CLOSE_CALL * values[0]
            self._decided_from = key
            self.best_size, self.close_call, self.best_drafting = best, close, runner_up
            self.rate = max(points)
            self.point_best = 1 + points.index(self.rate)
            self.expected, self.costs = expected, costs
            self.bucket_cap = PROBE_BURST * costs[-1] if self.stats.costs.weight else 0.0  # 0: nothing measured
        return self.best_size

    def regret(self, block: int, shadow: bool = False) -> float:
        """Predicted seconds a cycle of ``block`` (with a shadow: a shadowed plain step) loses against
        the best size committing the same expected tokens."""
        if shadow:
            return self.stats.costs.shadow(self.context)
        return max(self.costs[block - 1] - self.expected[block - 1] / self.rate, 0.0)

    def _affords(self, block: int, shadow: bool = False, routine: bool = True) -> bool:
        """Whether the bucket holds this cycle's predicted regret; a routine probe (not one after a
        surprise, nor an optimistic choice) with what the probe after a surprise would need left
        over: routine probes must not leave nothing for the one that matters most. Before any cost
        is measured (a pair's first cycles, which compile) there is nothing to predict with: free."""
        if not self.bucket_cap:
            return True
        if self.stats.bucket is None:
            self.stats.bucket = self.bucket_cap
        reserve = 0.0
        if routine and not self.surprised:
            reserve = self.regret(1, True) if self.best_size == 1 and self.can_shadow else self.regret(self.cap)
        return self.stats.bucket >= self.regret(block, shadow) + reserve

    def choose(self) -> int:
        best = self.best()
        self.since_probe += 1
        self.shadowing = 0
        self.probing = self.exploring = False
        if self.surprised and best == self.cap:
            self.surprised = False  # more acceptance than expected, at cap already: nothing to probe
        gap = PROBE_GAP_MIN if self.close_call else self.gap
        due = self.cap > 1 and (self.surprised or self.since_probe >= gap)
        if due and best == 1 and self.can_shadow and self.shadow:
            due = False  # the last shadow is still being compared
        if due:
            block, shadowed = self._probe(best)
            if self._affords(block, shadowed):
                self.probing = self.exploring = True
                self.since_probe = 0
                self.surprised = False
                self.last_probe_shadowed = shadowed
                self.shadowing = self.cap - 1 if shadowed else 0
                return block
        if best != self.point_best:  # only optimism prefers it: explore if the bucket allows
            if not self._affords(best, routine=False):
                return self.point_best
            self.exploring = True
        return best

    def _probe(self, best: int):
        """The probe due now: ``(size, shadowed)``."""
        if best == 1 and self.can_shadow and not (self.close_call and self.last_probe_shadowed):
            return 1, True
        if best == 1 and self.close_call:  # measure what the best drafting size costs now
            return self.best_drafting, False
        if self.surprised and best != self.cap:
            return self.cap, False
        if best == 1:  # one drafted token: whether the first slot is accepted decides it all
            return 2, False
        return self.stats.rng.choice([b for b in range(1, self.cap + 1) if b != best]), False

    def shadow_tokens(self) -> int:
        """Draft tokens to propose, unverified, alongside the plain step just chosen (0: none)."""
        return self.shadowing

    def observe(
        self, block: int, accepted: int, seconds: float,
        committed: Sequence[int] = (), proposals: Sequence[int] = (), handed_off: int = 0,
        context: Optional[int] = None,
    ) -> None:
        """What a cycle did: its size, accepted drafts, wall time and the tokens it committed;
        ``proposals``: the shadow drafted alongside it; ``handed_off``: plain steps whose features
        it gave the draft (either makes its time something else than its size's cost: a shadow's is
        learnt apart, a hand-off's not at all); ``context``: tokens in the target's cache now."""
        if context is not None:
            self.context = self.stats.context = context
        if proposals:
            self.shadow, self.shadow_matched = list(proposals), 0
        if self.shadow:
            self._compare_shadow(committed)
        if block > 1:
            self._learn(block - 1, accepted)
        costs = self.stats.costs
        if proposals:
            costs.observe_shadow(seconds, self.context)
        elif handed_off <= 1:
            costs.observe(block, seconds, self.context)
        self._charge(block, accepted, seconds, bool(proposals))

    def _charge(self, block: int, accepted: int, seconds: float, shadowed: bool) -> None:
        stats = self.stats
        regret = 0.0
        if self.exploring and self.bucket_cap:  # (with nothing measured when it was chosen: free)
            if shadowed:  # the plain step commits what the best (b = 1) would have
                regret = seconds - self.costs[0]
            else:
                regret = seconds - (1 + accepted) / self.rate
            self.probe_regret += regret
            stats.probe_regret += regret
        if self.exploring:
            self.probe_seconds += seconds
            self.probe_cycles += 1
            stats.probe_seconds += seconds
            self.exploring = False
        if self.bucket_cap:
            bucket = self.bucket_cap if stats.bucket is None else stats.bucket
            stats.bucket = min(bucket + PROBE_SHARE * seconds - regret, self.bucket_cap)
        self.seconds += seconds
        stats.seconds += seconds

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
        opening, self.opening = self.opening, False
        if opening and accepted and self.point_best == 1:  # an opening predicted: not yet a reason to draft
            self.surprised = True
            return
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
