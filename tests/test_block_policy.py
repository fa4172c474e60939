"""The block-size controller on synthetic streams: no model, costs and acceptance given.

``simulate`` plays the decode loop's part. The target's greedy output is a counter (token t is
``t``); the draft's proposal for the slot ``i`` ahead matches with the profile's probability
``p[i]`` given the slots before it matched, drawn from a seeded generator. A cycle of size ``b``
costs ``cost(b)`` seconds, a shadow step ``cost(1) + draft``. Shares and settling times are
stated per test; each is far from what a controller without the feature would do.
"""

from __future__ import annotations

import random

import pytest

from dflash_mlx import block_policy
from dflash_mlx.block_policy import AutoBlock, BlockStats, BlockTokens, CycleCosts, FixedBlock, SlotAcceptance, describe

MS = 1e-3


def cpu_cost(b: int) -> float:
    """This machine's demo pair: a verify pass and a draft pass cost about 2 decode steps."""
    return MS * (1.0 if b == 1 else 2.05 + 0.22 * (b - 2))


def mac_cost(b: int) -> float:
    """Bandwidth-bound: a verify of b tokens costs little more than a decode step."""
    return MS * (1.0 if b == 1 else 1.25 + 0.02 * (b - 2))


def simulate(profile, cycles, cap=4, cost=cpu_cost, seed=0, stats=None, shadow=True, noise=0.1, draft=0.35 * MS):
    """Run a controller for ``cycles``; returns the chosen sizes (0 marks a shadow step), the
    committed tokens, and the seconds they took."""
    rng = random.Random(1000 + seed)
    stats = stats if stats is not None else BlockStats.seeded(seed)
    controller = AutoBlock(stats, cap, shadow=shadow)
    position, chosen, seconds, last = 0, [], 0.0, None

    def matches(t, k):
        p, n = profile(t), 0
        while n < k and rng.random() < p[min(n, len(p) - 1)]:
            n += 1
        return n

    for t in range(cycles):
        if last is not None:
            controller.observe(**last)
        b = controller.choose()
        assert 1 <= b <= cap
        ahead = controller.shadow_tokens() if b == 1 else 0
        proposals = []
        if ahead:
            m = matches(t, ahead)
            proposals = [position + 1 + i if i < m else -1 for i in range(ahead)]
        accepted = matches(t, b - 1) if b > 1 else 0
        committed = list(range(position + 1, position + 2 + accepted))
        spent = cost(b) + (draft if ahead else 0.0)
        last = dict(block=b, accepted=accepted, seconds=spent * (1 + noise * rng.uniform(-1, 1)),
                    committed=committed, proposals=proposals)
        chosen.append(0 if ahead else b)
        seconds += spent
        position += accepted + 1
    return chosen, position, seconds


def value(p, b, cost):
    """Expected committed tokens per second at block size ``b``."""
    reach, expected = 1.0, 1.0
    for i in range(b - 1):
        reach *= p[min(i, len(p) - 1)]
        expected += reach
    return expected / cost(b)


def good_sizes(p, cap, cost, within=0.07):
    """Sizes within ``within`` of the best: near ties are equally right."""
    values = {b: value(p, b, cost) for b in range(1, cap + 1)}
    return {b for b, v in values.items() if v >= (1 - within) * max(values.values())}


def share(chosen, sizes):
    return sum(1 for b in chosen if b in sizes) / len(chosen)


PROFILES = [
    # (name, per-slot acceptance, cap, cost, the sizes within 7% of the best)
    ("copying on a CPU", [0.95], 4, cpu_cost, {4}),
    ("copying, block 8", [0.97], 8, cpu_cost, {7, 8}),
    ("middling on a CPU", [0.9, 0.85, 0.2], 4, cpu_cost, {3, 4}),
    ("middling on a Mac", [0.7, 0.5, 0.3], 8, mac_cost, {3, 4, 5, 6, 7, 8}),
    ("prose on a CPU", [0.15, 0.1], 4, cpu_cost, {1}),
    ("prose on a Mac", [0.1, 0.05], 8, mac_cost, {1}),
    ("a little on a Mac", [0.45, 0.2], 8, mac_cost, {2, 3, 4, 5, 6, 7, 8}),
]


@pytest.mark.parametrize("name,p,cap,cost,good", PROFILES, ids=[p[0] for p in PROFILES])
@pytest.mark.parametrize("shadow", [True, False], ids=["greedy", "sampled"])
def test_settles_on_the_best_size(name, p, cap, cost, good, shadow):
    assert good_sizes(p, cap, cost) == good  # the profile is what its name says
    for seed in range(3):
        chosen, _, _ = simulate(lambda t: p, 400, cap=cap, cost=cost, seed=seed, shadow=shadow)
        # Settled within 40 cycles: from then on 85% of the cycles run a size within 7% of the
        # best (the rest are probes and rechecks of slots not tried lately).
        assert share(chosen[40:], good) >= 0.85, (seed, chosen)


def test_throughput_is_close_to_the_best_fixed_size():
    for name, p, cap, cost, _ in PROFILES:
        for seed in range(3):
            _, tokens, seconds = simulate(lambda t: p, 400, cap=cap, cost=cost, seed=seed)
            fixed = [simulate_fixed(p, 400, b, cost, seed) for b in range(1, cap + 1)]
            assert tokens / seconds >= 0.93 * max(fixed), (name, seed)


def simulate_fixed(p, cycles, b, cost, seed=0):
    rng = random.Random(1000 + seed)
    tokens = 0
    for _ in range(cycles):
        n = 0
        while n < b - 1 and rng.random() < p[min(n, len(p) - 1)]:
            n += 1
        tokens += n + 1
    return tokens / (cycles * cost(b))


@pytest.mark.parametrize("shadow", [True, False], ids=["greedy", "sampled"])
def test_zero_acceptance_settles_on_plain_decoding_with_few_probes(shadow):
    chosen, tokens, seconds = simulate(lambda t: [0.0], 600, cap=8, shadow=shadow)
    assert all(b <= 8 for b in chosen)
    assert chosen[10:].count(1) / len(chosen[10:]) >= 0.95
    probes = [b for b in chosen[10:] if b != 1]
    assert len(probes) <= 2 + 0.05 * len(chosen)  # the bucket: 2 at once, 5% in the long run
    settled = [b for b in chosen[300:] if b != 1]
    assert len(settled) <= 0.025 * 300  # nothing changes: probes thin out to 2%
    # Never slower than the target alone, to within what the probes cost.
    assert tokens / seconds >= 0.96 / cpu_cost(1)
    if shadow:
        assert set(probes) == {0}  # greedy probes are shadows: a plain step and a draft pass


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shadow", [True, False], ids=["greedy", "sampled"])
def test_a_workload_that_starts_copying_is_noticed(shadow, seed):
    switch = 300
    chosen, _, _ = simulate(lambda t: [0.0] if t < switch else [0.97], 500, cap=4, shadow=shadow, seed=seed)
    assert share(chosen[200:switch], {1}) >= 0.9
    moved = next(i for i in range(switch, 500) if chosen[i : i + 10].count(4) >= 8) - switch
    # The gap between probes is at most 50 cycles; after a surprise the next probe comes at
    # once (one lucky probe is not enough to draft), and should a cycle after it be unlucky,
    # the next within the shortest gap (20).
    assert moved <= 80, chosen[switch:]


def test_a_workload_that_stops_copying_is_noticed():
    switch = 300
    chosen, _, _ = simulate(lambda t: [0.97] if t < switch else [0.0], 500, cap=4)
    assert share(chosen[200:switch], {4}) >= 0.9
    moved = next(i for i in range(switch, 500) if chosen[i : i + 10].count(1) >= 9) - switch
    assert moved <= 25, chosen[switch:]


def test_deterministic_for_a_seed():
    profile = lambda t: [0.6, 0.5, 0.4]  # noqa: E731 -- near ties: probes and choices vary with the seed
    runs = [simulate(profile, 300, cap=8, seed=s, cost=mac_cost)[0] for s in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_cost_statistics_outlive_a_request_and_acceptance_starts_from_a_weak_prior():
    stats = BlockStats.seeded(0)
    simulate(lambda t: [0.97], 200, stats=stats)
    measured = dict(stats.costs.measured)
    assert measured[4] > 0
    second = AutoBlock(stats, 4)
    assert stats.costs.measured == measured  # shared, not reset
    assert max(second.acceptance.tried) <= 4.0  # at most four cycles' worth per slot
    assert second.acceptance.probabilities(3)[0] > 0.7  # but it leans the way the last request went
    # A request that turns out different takes over within a few cycles.
    chosen, _, _ = simulate(lambda t: [0.0], 40, stats=stats)
    assert chosen[10:].count(1) >= 25


def test_cycle_costs_fit_a_line_and_learn_what_it_misses():
    costs = CycleCosts()
    truth = {1: 1.0, 2: 2.0, 3: 2.3, 4: 5.0}  # a line from 2 to 3, then a jump (a kernel change)
    for _ in range(30):
        for b in (1, 2, 3, 4):
            costs.observe(b, truth[b] * MS)
    predicted = costs.predict(1, 8)
    for b in (1, 2, 3, 4):
        assert predicted[b - 1] == pytest.approx(truth[b] * MS, rel=0.05), b
    assert predicted[7] > predicted[2]  # an unmeasured size follows the line


def test_cycle_costs_start_from_a_modelled_prior_until_measured():
    """On a Mac auto starts from the cost model (decode steps per size): before any measurement
    it predicts the prior; measured sizes scale its shape to seconds for the sizes not measured;
    from PRIOR_SIZES measured sizes on, the fitted line takes over. A prior where cycles of 8+
    tokens are dear makes the first choice a smaller block than the flat start would."""
    prior = [1.0, 1.3, 1.4, 1.5, 1.8, 2.0, 2.3, 3.0] + [3.0 + 0.5 * i for i in range(1, 9)]
    costs = CycleCosts(prior=prior)
    assert costs.predict(1, 16) == prior and costs.predict(17, 17) == [prior[-1] + 0.5]
    costs.observe(4, 9.0)  # compiles: ignored
    costs.observe(4, 3 * MS)  # 1.5 steps measured as 3 ms: a step is 2 ms
    assert costs.predict(8, 8)[0] == pytest.approx(3.0 * 2 * MS)
    assert costs.predict(4, 4)[0] == pytest.approx(3 * MS)
    for b, steps in ((1, 1.0), (2, 1.3)):
        costs.observe(b, 9.0)
        for _ in range(5):
            costs.observe(b, steps * 2 * MS)
    assert costs.predict(8, 8)[0] == pytest.approx(costs.line(8))  # three sizes measured: the line

    acceptance = SlotAcceptance()
    for _ in range(20):
        acceptance.observe(drafted=15, accepted=15)  # everything accepted so far
    flat, modelled = BlockStats.seeded(0), BlockStats.seeded(0)
    modelled.costs.set_prior([1.0, 1.1, 1.2, 1.3] + [4.0 + i for i in range(12)])
    for stats in (flat, modelled):
        stats.acceptance = acceptance
    assert AutoBlock(flat, 16).best() == 16 and AutoBlock(modelled, 16).best() == 4


def test_cycle_costs_skip_the_compiling_cycle_and_clip_outliers():
    costs = CycleCosts()
    costs.observe(2, 1.0)  # the first cycle of a size compiles: ignored
    for _ in range(20):
        costs.observe(2, 2 * MS)
    costs.observe(2, 10.0)  # a paused consumer
    assert costs.predict(2, 2)[0] < 4 * MS
    assert costs.predict(1, 1)[0] > 0


def test_one_cycle_at_a_large_block_informs_the_small_ones():
    acceptance = SlotAcceptance()
    for _ in range(10):
        acceptance.observe(drafted=7, accepted=7)
    expected = acceptance.expected_tokens(8)
    assert expected[0] == 1.0 and expected[3] > 3.5 and expected[7] > 6.5
    rejected = SlotAcceptance()
    for _ in range(10):
        rejected.observe(drafted=7, accepted=0)
    assert rejected.expected_tokens(8)[7] < 1.2  # untried slots lean on the slot before them


def test_block_tokens_settings():
    assert BlockTokens.parse(None) == BlockTokens(auto=True)
    assert BlockTokens.parse("auto") == BlockTokens(auto=True)
    assert BlockTokens.parse("AUTO:8") == BlockTokens(auto=True, tokens=8)
    assert BlockTokens.parse(4) == BlockTokens.parse("4") == BlockTokens(auto=False, tokens=4)
    assert str(BlockTokens.parse("auto:8")) == "auto:8" and str(BlockTokens.parse(" 4 ")) == "4"
    assert BlockTokens.parse("auto").cap(16) == 16 and BlockTokens.parse("auto:4").cap(16) == 4
    for bad in ("four", "auto:", "auto:x", "0", "-2", "auto:0", True, 2.5):
        with pytest.raises(ValueError, match="block_tokens"):
            BlockTokens.parse(bad)
    with pytest.raises(ValueError, match="more than the draft's block size 8"):
        BlockTokens.parse("auto:16").cap(8)


def test_fixed_block_is_exactly_n():
    fixed = FixedBlock(4)
    assert [fixed.choose() for _ in range(5)] == [4] * 5 and fixed.shadow_tokens() == 0


def test_describe():
    assert describe({4: 70, 1: 20, 3: 10}) == "blocks 4:70% 1:20% 3:10%"
    assert describe({}) == "blocks -"


def test_the_controller_is_cheap():
    """Pure Python, a few microseconds a cycle: numpy's per-call overhead is the reason it is not
    numpy (see CycleCosts). Counted in operations, not timed: no timed assertions in tests."""
    import sys

    stats = BlockStats.seeded(0)
    simulate(lambda t: [0.9], 100, stats=stats)
    controller = AutoBlock(stats, 16)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        for _ in range(64):
            controller.observe(block=controller.choose(), accepted=0, seconds=MS, committed=[0])
    finally:
        sys.setprofile(None)
    assert calls / 64 < 40, calls / 64
    assert "numpy" not in sys.modules or not hasattr(block_policy, "np")
