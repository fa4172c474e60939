"""Batched decoding: every sequence in a batch gets exactly what it gets alone.

The oracle of "alone" is the same request run with no batch-mates (bit for bit: tokens and every
cache after every cycle) and the target decoding by itself (tokens, up to a proven near-tie:
``test_lossless.assert_lossless``). Batch-mates differ in prompt length, block size, acceptance
(oracle drafts wrong at scheduled slots), arrival, length, sampling and stop conditions.
"""

from __future__ import annotations

import itertools
from typing import Dict, List

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import tiny
from dflash_mlx.api import load
from dflash_mlx.decoder import ROW_LIMIT, Decoder, batch_min_rows, batch_row_limit, plan_blocks
from dflash_mlx.block_policy import AutoBlock, BlockStats, FixedBlock
from dflash_mlx.cache import GatedDeltaCache
from dflash_mlx.loading import load_target
from dflash_mlx.sampling import Sampler, propose
from dflash_mlx.scheduler import BatchRequest, Scheduler, batch_generate
from tests.reference import target_only
from tests.conftest import VOCAB, dflash2_config, make_draft, make_hf_moe_target, random_prompts, write_dflash2_draft
from tests.test_lossless import assert_lossless, take

GREEDY = Sampler()


class OracleState:
    """One sequence's oracle: the target's own continuation, wrong at one scheduled slot per cycle
    (entry ``e``: slot ``e`` wrong, so ``e`` accepted; ``e >= block - 1``: all accepted)."""

    window = None
    reads_no_context = False

    def __init__(self, sequence, schedule):
        self.sequence, self.schedule = list(sequence), list(schedule)
        self.position = 0  # tokens whose features reached the draft
        self.cycle = 0


class BatchOracle:
    """A draft whose every sequence has its own oracle (its cache): batch-mates in one pass get
    different acceptances."""

    mask_token_id = VOCAB - 1
    target_layer_ids = [0]

    def __init__(self, block_size=16):
        self.block_size = block_size
        self.passes: List[int] = []  # sequences per draft pass

    def cache_for(self, sequence, schedule):
        return [OracleState(sequence, schedule)]

    def add_context(self, features, cache):
        cache[0].position += features.shape[1]

    def add_context_batch(self, contexts, caches):
        for features, cache in zip(contexts, caches):
            self.add_context(features, cache)

    def propose(self, block, cache, sampler):
        return self.propose_batch([block], [cache], [sampler])[0]

    def propose_batch(self, blocks, caches, samplers, one_head=False):
        self.passes.append(len(blocks))
        out = []
        for block, (state,), sampler in zip(blocks, caches, samplers):
            n = block.size - 1
            want = state.sequence[state.position + 1 : state.position + 1 + n]
            want += [0] * (n - len(want))
            wrong = state.schedule[state.cycle % len(state.schedule)]
            state.cycle += 1
            if wrong < n:
                want[wrong] = (want[wrong] + 1) % (VOCAB - 1)
            out.append(propose(10.0 * mx.eye(VOCAB)[mx.array(want)], sampler))
        return out


def prefilled(decoder, prompt, sampler=GREEDY, **kwargs):
    gen = decoder.start(prompt, sampler, **kwargs)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def snapshot(cache) -> list:
    """Every array a target cache holds for its sequence (attention up to its length)."""
    out = []
    for c in cache:
        if isinstance(c, GatedDeltaCache):
            out += [c.conv_state, c.state]
        else:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    mx.eval(out)
    return out


def draft_snapshot(draft_cache) -> list:
    """What a draft cache holds for its sequence: each layer's position and its context keys and
    values (an oracle's position)."""
    out = []
    for c in draft_cache or []:
        if isinstance(c, OracleState):
            out.append(mx.array(c.position))
            continue
        out.append(mx.array([c.offset, c.start]))
        if c.keys is not None:
            used = c.offset - c.start
            out += [c.keys[..., :used, :], c.values[..., :used, :]]
    mx.eval(out)
    return out


# The rules a batch runs by (``Decoder``'s ``min_rows`` and ``shared_calls``): the CPU's (one row
# per sequence, one draft call for every sequence's hand-off and head) and a GPU's (two rows at
# least, the padding rolled back; a draft call per sequence). Both run here: a Mac takes the second.
RULES = {"cpu rules": dict(min_rows=1, shared_calls=True), "gpu rules": dict(min_rows=2, shared_calls=False)}
by_rules = pytest.mark.parametrize("rules", list(RULES.values()), ids=list(RULES))


def run_batch(target, draft, specs, joins, record=False, passes=None, rules=None):
    """Decode ``specs`` (dicts: prompt, block, schedule, max_tokens) together, spec i joining at
    cycle ``joins[i]``: each one's tokens, and (``record``) its cache after every cycle it ran.
    ``passes`` (a list) gets each cycle's (sequences, rows per sequence). ``rules``: one of
    ``RULES`` (default: this device's)."""
    decoder = Decoder(target, draft, **(rules or dict(min_rows=batch_min_rows())))
    live, tokens, caches = {}, {i: [] for i in range(len(specs))}, {i: [] for i in range(len(specs))}
    for cycle in itertools.count():
        for i, spec in enumerate(specs):
            if joins[i] == cycle:
                draft_cache = draft.cache_for(spec["sequence"], spec["schedule"]) if isinstance(draft, BatchOracle) else None
                seq, commit = prefilled(decoder, spec["prompt"], chooser=FixedBlock(spec["block"]), draft_cache=draft_cache,
                                        max_tokens=spec["max_tokens"])
                tokens[i] += commit.tokens
                if not seq.done:
                    live[i] = seq
        if not live and cycle > max(joins):
            return tokens, caches
        if live:
            order = list(live)
            commits = decoder.cycle([live[i] for i in order])
            if passes is not None:
                passes.append((len(order), decoder.rows // len(order)))
            for i, commit in zip(order, commits):
                tokens[i] += commit.tokens
                if record:
                    caches[i].append(snapshot(live[i].cache) + draft_snapshot(live[i].draft_cache))
                if live[i].done:
                    del live[i]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, VOCAB, seed=21, low=4, high=30)


@pytest.fixture(scope="module")
def references(target, prompts):
    return [take(target_only(target, p, GREEDY), 60)[0] for p in prompts]


def oracle_specs(prompts, references):
    """Four batch-mates: blocks 4, 8, 16 and plain, each with its own acceptance schedule."""
    blocks = [4, 8, 16, 1]
    schedules = [[0, 3, 1, 2], [7, 0, 5, 2, 6], [15, 3, 9, 0, 12], [0]]
    lengths = [40, 33, 45, 25]
    return [dict(prompt=p, sequence=p.tolist() + r, block=b, schedule=s, max_tokens=n)
            for p, r, b, s, n in zip(prompts, references, blocks, schedules, lengths)]


@by_rules
@pytest.mark.parametrize("joins", [[0, 0, 0, 0], [0, 2, 5, 1]], ids=["together", "staggered"])
def test_each_sequence_gets_what_it_gets_alone(target, prompts, references, joins, rules):
    """Tokens and every cache after every cycle equal the sequence alone, bit for bit; tokens
    equal the target decoding alone; every acceptance length is met by some sequence."""
    specs = oracle_specs(prompts, references)
    together, caches = run_batch(target, BatchOracle(), specs, joins, record=True, rules=rules)
    for i, spec in enumerate(specs):
        alone, alone_caches = run_batch(target, BatchOracle(), [spec], [0], record=True, rules=rules)
        assert together[i] == alone[0], f"sequence {i}"
        assert len(caches[i]) == len(alone_caches[0])
        for cycle, (got, want) in enumerate(zip(caches[i], alone_caches[0])):
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want)), f"sequence {i}, cycle {cycle}"
        assert len(together[i]) == spec["max_tokens"]
        assert_lossless(target, spec["prompt"], references[i][: spec["max_tokens"]], together[i])


@by_rules
def test_plain_steps_in_a_batch_feed_min_rows_each(target, prompts, references, rules):
    """Target-only batches (the server's ``use_draft`` False, bench's target batched) feed every
    sequence one row on the CPU, alone or beside batch-mates (no padding row, no tape, no
    rollback), and two on a GPU (the second rolled back): tokens and caches after every cycle
    still equal each sequence alone, through passes where it ran alone and with mates. (A plain
    step beside drafting batch-mates, in their longer pass, is in
    ``test_each_sequence_gets_what_it_gets_alone``: it fails when one row runs the recurrence's
    step form, as it did before ``kernels._chunk_one``.)"""
    specs = [dict(prompt=p, block=1, max_tokens=n) for p, n in zip(prompts[:3], [30, 12, 20])]
    passes = []
    together, caches = run_batch(target, None, specs, [0, 3, 25], record=True, passes=passes, rules=rules)
    assert {count for count, _ in passes} == {1, 2}
    assert all(rows == rules["min_rows"] for _, rows in passes)
    for i, spec in enumerate(specs):
        alone, alone_caches = run_batch(target, None, [spec], [0], record=True, rules=rules)
        assert together[i] == alone[0], f"sequence {i}"
        for cycle, (got, want) in enumerate(zip(caches[i], alone_caches[0])):
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want)), f"sequence {i}, cycle {cycle}"
        assert_lossless(target, spec["prompt"], references[i][: spec["max_tokens"]], together[i])


def test_a_batch_pass_carries_different_acceptances(target, prompts, references):
    """The oracle's schedules give batch-mates different acceptance lengths in one pass: every
    length 0..block-1 occurs for the block-8 and block-16 sequences."""
    specs = oracle_specs(prompts, references)
    oracle = BatchOracle()
    decoder = Decoder(target, oracle, min_rows=batch_min_rows())
    seqs = [prefilled(decoder, s["prompt"], chooser=FixedBlock(s["block"]), draft_cache=oracle.cache_for(s["sequence"], s["schedule"] * 4),
                      max_tokens=400)[0] for s in specs]
    for s, spec in zip(seqs, specs):
        s.cache[0]  # noqa: B018 (touch: the sequences are live)
    seen: Dict[int, set] = {i: set() for i in range(len(specs))}
    for _ in range(6):
        for i, commit in enumerate(decoder.cycle(seqs)):
            seen[i].add(commit.accepted)
    assert seen[0] == {0, 1, 2, 3} and seen[3] == {0}
    assert {0, 2, 5, 6, 7} <= seen[1] and {0, 3, 9, 12, 15} <= seen[2]
    assert max(oracle.passes) == 3  # the plain sequence never drafts


@by_rules
def test_the_real_draft_in_a_batch(target, draft, prompts, references, rules):
    """The tiny random draft (its own attention over each sequence's context, padded blocks of
    different lengths in one pass, the committed features handed off for all sequences in one
    draft call, or a call each by a GPU's rules): each sequence as alone, its target and draft
    caches after every cycle too, and as the target alone."""
    specs = [dict(prompt=p, block=b, max_tokens=n) for p, b, n in zip(prompts[:4], [2, 16, 5, 1], [30, 24, 36, 20])]
    together, caches = run_batch(target, draft, specs, [0, 1, 3, 0], record=True, rules=rules)
    for i, spec in enumerate(specs):
        alone, alone_caches = run_batch(target, draft, [spec], [0], record=True, rules=rules)
        assert together[i] == alone[0] and len(caches[i]) == len(alone_caches[0])  # the same cycles
        for got, want in zip(caches[i][-1], alone_caches[0][-1]):
            assert mx.array_equal(got, want).item()
        for cycle, (got, want) in enumerate(zip(caches[i], alone_caches[0])):
            assert len(got) == len(want) and all(mx.array_equal(a, b).item() for a, b in zip(got, want)), \
                f"sequence {i}, cycle {cycle}"
        assert_lossless(target, spec["prompt"], references[i][: spec["max_tokens"]], together[i])


def draft_of_kind(tmp_path, target, target_config, kind):
    """A tiny DFlash draft (a full-attention and a block-only layer) or DFlash2 one (sliding
    window of 20) for the session's target."""
    from dflash_mlx import loading

    if kind == "DFlash":
        return make_draft(tmp_path, target, target_config, block_size=8, layer_types=["full_attention", "block_attention"])
    write_dflash2_draft(tmp_path, dflash2_config(target_config, block_size=8, sliding_window=20), seed=3)
    return loading.load_draft(tmp_path)[0].bind(target)


@pytest.mark.parametrize("kind", ["DFlash", "DFlash2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("one_head", [False, True], ids=["head per block", "one head"])
def test_one_draft_pass_proposes_what_each_block_gets_alone(tmp_path, target, target_config, kind, temperature, one_head):
    """``propose_batch`` over blocks of different lengths and contexts of different lengths (one
    past a sliding window) gives each block the proposals and distributions ``propose`` gives it
    alone, bit for bit (sampling: the same draws from the same seeded generator), whether the
    head runs per block or once over every block's rows (DFlash2: its selector per block)."""
    draft = draft_of_kind(tmp_path, target, target_config, kind)
    width = len(draft.target_layer_ids) * target_config["hidden_size"]
    contexts = [5, 31, 12]
    caches = [draft.make_cache() for _ in contexts]
    for cache, n in zip(caches, contexts):
        draft.add_context(mx.random.normal((1, n, width), key=mx.random.key(n)), cache)
    blocks = [mx.array([3] + [draft.mask_token_id] * (n - 1)) for n in (4, 8, 2)]
    samplers = [Sampler(temperature).for_request(seed) for seed in (1, 2, 3)]
    together = draft.propose_batch(blocks, caches, samplers, one_head=one_head)
    samplers = [Sampler(temperature).for_request(seed) for seed in (1, 2, 3)]
    for (tokens, probs), block, cache, sampler in zip(together, blocks, caches, samplers):
        alone_tokens, alone_probs = draft.propose(block, cache, sampler)
        assert mx.array_equal(tokens, alone_tokens).item() and tokens.size == block.size - 1
        assert (probs is None) == (alone_probs is None) == (temperature == 0)
        if probs is not None:
            assert mx.array_equal(probs, alone_probs).item()


@pytest.mark.parametrize("kind", ["DFlash", "DFlash2"])
def test_one_hand_off_fills_each_draft_cache_as_alone(tmp_path, target, target_config, kind):
    """``add_context_batch`` (one ``fc``, norm and projection over every sequence's committed
    features, RoPE and the append per sequence) leaves each draft cache bit for bit as
    ``add_context`` alone: contexts of different lengths (one past the sliding window, a
    block-only layer's positions), hand-offs of 1 to 5 rows, twice in a row."""
    draft = draft_of_kind(tmp_path, target, target_config, kind)
    width = len(draft.target_layer_ids) * target_config["hidden_size"]
    features = lambda n, seed: mx.random.normal((1, n, width), key=mx.random.key(seed))  # noqa: E731
    contexts = [5, 31, 12, 1]
    together, alone = ([draft.make_cache() for _ in contexts] for _ in range(2))
    for caches in (together, alone):
        for cache, n in zip(caches, contexts):
            draft.add_context(features(n, n), cache)
    for hand_off, lengths in enumerate([[1, 4, 2, 5], [3, 1, 5, 2]]):
        fed = [features(n, 100 * hand_off + i) for i, n in enumerate(lengths)]
        draft.add_context_batch(fed, together)
        for x, cache in zip(fed, alone):
            draft.add_context(x, cache)
        for i, (got, want) in enumerate(zip(together, alone)):
            got, want = draft_snapshot(got), draft_snapshot(want)
            assert len(got) == len(want) and all(mx.array_equal(a, b).item() for a, b in zip(got, want)), \
                f"hand-off {hand_off}, sequence {i}"


@pytest.mark.parametrize("survivors", [[0, 1, 2, 3, 4], [0, 1, 2, 3], [4, 2, 0]], ids=["all", "the last left", "out of order"])
@pytest.mark.parametrize("form", ["chunked", "reference", "metal"])
def test_one_replay_per_layer_rolls_each_row_back_to_its_own_count(form, survivors):
    """``rollback_batch`` replays a batched pass's tape once per layer, each row to its own kept
    count (every count 0..T beside the others, one row keeping all): each sequence's state and
    conv rows bit for bit those of its own rollback from its row of the tape, and within float32
    rounding of numpy stepping the recurrence (the chunked form, the step form, the emulated
    Metal replay kernel). Sequences that left while the pass ran are not rolled back: the others
    are given in any order and each still gets its own row (a survivor-subset replay of the whole
    tape with the survivors' counts killed every batch whose last row left)."""
    from dflash_mlx import kernels
    from dflash_mlx.cache import GatedDeltaBatch, GatedDeltaTape, rollback_batch

    if form == "metal":
        from tests.test_emulated_metal import emulated_recurrence

        recurrence = emulated_recurrence()
    else:
        recurrence = kernels.Recurrence(chunked=form == "chunked")
    T, Hk, Hv, Dk, Dv, conv = 4, 1, 2, 32, 8, 3
    keeps = [2, 0, 4, 1, 3]
    B = len(keeps)
    key = iter(mx.random.split(mx.random.key(11), 5))
    tape = GatedDeltaTape(mx.random.normal((B, Hv, Dv, Dk), key=next(key)),
                          mx.random.normal((B, conv + T, 6), key=next(key)),
                          mx.random.normal((B, T, Hk, Dk), key=next(key)) * Dk**-0.5,
                          mx.random.uniform(0.3, 1.0, (B, T, Hv), key=next(key)),
                          mx.random.normal((B, T, Hv, Dv), key=next(key)))
    after = recurrence.tape_replay(tape.start_state, tape.k, tape.g, tape.delta, T)  # the pass's own state
    together = [[GatedDeltaCache(recurrence)] for _ in keeps]
    GatedDeltaBatch([c[0] for c in together]).update(tape.conv_input[:, -conv:], after, T, tape)
    alone = []
    for i, keep in enumerate(keeps):
        cache = GatedDeltaCache(recurrence)
        row = slice(i, i + 1)
        cache.update(tape.conv_input[row, -conv:], after[row], T,
                     GatedDeltaTape(*(getattr(tape, f)[row] for f in ("start_state", "conv_input", "k", "g", "delta"))))
        cache.rollback(keep)
        alone.append(cache)
    rollback_batch([together[i] for i in survivors], fed=[T] * len(survivors), kept=[keeps[i] for i in survivors])
    k, g, delta = (np.array(a, dtype=np.float64) for a in (tape.k, tape.g, tape.delta))
    k = np.repeat(k, Hv // Hk, axis=2)
    for i, (keep, [got], want) in enumerate(zip(keeps, together, alone)):
        if i not in survivors:
            continue
        assert got.offset == want.offset == keep and got.tape is None, f"row {i}"
        assert mx.array_equal(got.conv_state, want.conv_state).item(), f"row {i}"
        assert mx.array_equal(got.conv_state, tape.conv_input[i : i + 1, keep : keep + conv]).item()
        assert mx.array_equal(got.state, want.state).item(), f"row {i} keeping {keep}"
        state = np.array(tape.start_state[i], dtype=np.float64)
        for t in range(keep):
            state = state * g[i, t][:, None, None] + delta[i, t][:, :, None] * k[i, t][:, None, :]
        np.testing.assert_allclose(np.array(got.state[0]), state, rtol=1e-5, atol=1e-5)
    if form == "metal":  # the replay ran the kernel, not a fallback
        report = recurrence.metal.report()
        assert any(name.startswith("tape_replay") for name in report) and set(report.values()) == {"ok"}


def test_a_mixture_of_experts_target_in_a_batch(tmp_path):
    """Routing stays per token: each sequence of a MoE target as alone, and as the target alone."""
    target, config = load_target(make_hf_moe_target(tmp_path / "moe"))
    draft = make_draft(tmp_path / "draft", target, config, block_size=8)
    prompts = random_prompts(3, VOCAB, seed=5, low=5, high=25)
    specs = [dict(prompt=p, block=b, max_tokens=n) for p, b, n in zip(prompts, [4, 8, 1], [20, 24, 16])]
    together, _ = run_batch(target, draft, specs, [0, 2, 1])
    for i, spec in enumerate(specs):
        alone, _ = run_batch(target, draft, [spec], [0])
        assert together[i] == alone[0]
        expected = take(target_only(target, spec["prompt"], GREEDY), spec["max_tokens"])[0]
        assert_lossless(target, spec["prompt"], expected, together[i])


# --- block sizes in a batch ----------------------------------------------------------------------


def test_plan_takes_the_longest_block_within_the_row_limit():
    assert plan_blocks([4, 1, 8]) == (8, [4, 1, 8])
    assert plan_blocks([1, 1]) == (1, [1, 1])
    assert plan_blocks([16] * 4) == (16, [16] * 4)  # 64 rows: at the limit
    assert plan_blocks([16] * 8) == (8, [8] * 8)  # 128 rows wanted: cut to 64
    assert plan_blocks([16, 2, 1, 4, 16], row_limit=20) == (4, [4, 2, 1, 4, 4])
    assert plan_blocks([8] * 100, row_limit=ROW_LIMIT) == (1, [1] * 100)  # never below a plain step
    with pytest.raises(ValueError):
        plan_blocks([])


def pass_seconds(rows: int, drafts: bool) -> float:
    """A synthetic pass: a fixed cost (reading the weights), a cost per row, and a draft pass."""
    return 0.010 + 0.0004 * rows + (0.003 if drafts else 0.0)


def synthetic_batch(acceptance, cycles: int, seed: int = 0):
    """Controllers sharing one pair's statistics (as a server's requests do), each with its own
    acceptance (slot k accepted with probability ``a`` given the ones before; ``acceptance(cycle)``
    or fixed), each told the batch cycle's time as ``Decoder.resolve`` tells it. The pass length
    ``T`` and the blocks of every cycle."""
    rng = np.random.default_rng(seed)
    stats = BlockStats()
    count = len(acceptance(0)) if callable(acceptance) else len(acceptance)
    choosers = [AutoBlock(stats, 16, shadow=True) for _ in range(count)]
    history = []
    for cycle in range(cycles):
        T, blocks = plan_blocks([c.choose() for c in choosers])
        aheads = [c.shadow_tokens() if b == 1 else 0 for c, b in zip(choosers, blocks)]
        seconds = pass_seconds(count * max(T, batch_min_rows()), any(b > 1 or a for b, a in zip(blocks, aheads)))
        rates = acceptance(cycle) if callable(acceptance) else acceptance
        for c, block, ahead, a in zip(choosers, blocks, aheads, rates):
            accepted = 0
            while accepted < block - 1 and rng.random() < a:
                accepted += 1
            # A shadow's proposals are graded against the tokens committed after it.
            committed = [7 if rng.random() < a else 3] + [0] * accepted if ahead else [0] * (accepted + 1)
            c.observe(block=block, accepted=accepted, seconds=seconds, committed=committed, proposals=[7] * ahead,
                      context=1000)
        history.append((T, blocks))
    return np.array([t for t, _ in history]), np.array([b for _, b in history])


def test_a_sequence_that_drafts_badly_never_lengthens_its_batch_mates_pass():
    """Beside a good drafter, a bad one drafts only within the pass the good one sets (its rows
    ride free); the pass follows the good drafter. Two bad drafters run plain steps."""
    T, blocks = synthetic_batch([0.9, 0.0], cycles=400)
    assert np.mean(blocks[200:, 1] <= blocks[200:, 0]) > 0.95
    assert np.mean(T[200:]) > 12 and np.mean(T[200:] == blocks[200:, 0]) > 0.95
    T, blocks = synthetic_batch([0.0, 0.0], cycles=400, seed=1)
    assert np.mean(blocks[200:] == 1) > 0.9 and np.mean(T[200:] == 1) > 0.9


def test_blocks_follow_each_sequences_acceptance_when_it_changes():
    """Both draft well; then both collapse: the batch goes to plain steps. Then one recovers."""
    phases = lambda cycle: [0.9, 0.9] if cycle < 200 else [0.0, 0.0] if cycle < 500 else [0.9, 0.0]
    T, blocks = synthetic_batch(phases, cycles=800, seed=3)
    assert np.mean(T[100:200]) > 12
    assert np.mean(T[400:500] == 1) > 0.9, T[400:500]
    assert np.mean(T[700:]) > 8 and np.mean(blocks[700:, 1] <= blocks[700:, 0]) > 0.95, blocks[700:]


# --- the scheduler ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_model(tmp_path_factory):
    target_dir, draft_dir = tiny.write_pair(tmp_path_factory.mktemp("batch_pair"), block_size=8)
    return load(str(target_dir), draft=str(draft_dir))


def schedule(model, tokenizer, specs, arrivals, max_active=4, cancel_after=None, rules=None):
    """Run requests through a ``Scheduler``, request i submitted at round ``arrivals[i]``
    (``cancel_after[i]``: cancelled once it has that many tokens): each one's tokens and text.
    ``rules``: one of ``RULES`` (default: this device's)."""
    scheduler = Scheduler(model, tokenizer, max_active, **(rules or {}))
    tokens = {i: [] for i in range(len(specs))}
    texts = {i: "" for i in range(len(specs))}
    flags = {i: False for i in range(len(specs))}
    requests = []
    for i, spec in enumerate(specs):
        def emit(response, i=i):
            tokens[i].append(response.token)
            texts[i] += response.text
            if cancel_after and cancel_after.get(i) is not None and len(tokens[i]) >= cancel_after[i]:
                flags[i] = True
        requests.append(BatchRequest(emit=emit, cancelled=lambda i=i: flags[i], **spec))
    for round_ in itertools.count():
        for i, r in enumerate(requests):
            if arrivals[i] == round_:
                scheduler.submit(r)
        if round_ > max(arrivals) and scheduler.idle:
            break
        scheduler.step()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    assert all(r.done for r in requests)
    return tokens, texts, requests


@by_rules
def test_staggered_requests_with_a_cancel_and_a_stop_string(pair_model, rules):
    model, tokenizer = pair_model
    prompts = [p.tolist() for p in random_prompts(4, 200, seed=9, low=5, high=40)]
    specs = [dict(prompt=p, max_tokens=n, block_tokens=b) for p, n, b in zip(prompts, [40, 25, 50, 30], [4, "auto", 8, 1])]
    alone = [schedule(model, tokenizer, [s], [0], rules=rules) for s in specs]
    stop_text = alone[2][1][0][30:34]  # four characters from the middle of request 2's answer
    assert stop_text
    specs[2]["stop"] = [stop_text]
    tokens, texts, _ = schedule(model, tokenizer, specs, [0, 2, 3, 7], cancel_after={1: 9}, rules=rules)
    assert tokens[0] == alone[0][0][0] and tokens[3] == alone[3][0][0]
    assert tokens[1] == alone[1][0][0][: len(tokens[1])] and 9 <= len(tokens[1]) < 25  # cancelled within a cycle
    assert texts[2] == alone[2][1][0][: alone[2][1][0].index(stop_text)]  # cut before the stop string
    assert tokens[2] == alone[2][0][0][: len(tokens[2])]
    for i in (0, 3):  # and each is what the target alone decodes
        expected = take(target_only(model.target, mx.array(prompts[i]), GREEDY), specs[i]["max_tokens"])[0]
        assert_lossless(model.target, mx.array(prompts[i]), expected, tokens[i])


def test_more_requests_than_slots_wait_in_arrival_order(pair_model):
    model, tokenizer = pair_model
    prompts = [p.tolist() for p in random_prompts(5, 200, seed=4, low=5, high=12)]
    scheduler = Scheduler(model, tokenizer, max_active=2)
    order = []
    requests = [BatchRequest(p, emit=lambda r, i=i: order.append(i) if i not in order else None, max_tokens=6, block_tokens=4)
                for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.submit(r)
    active = []
    while not scheduler.idle:
        scheduler.step()
        active.append(len(scheduler.active) + len(scheduler.prefilling))
    assert max(active) == 2 and order == [0, 1, 2, 3, 4]


def test_a_long_prompt_pauses_the_active_streams_one_chunk_at_a_time(pair_model):
    """A 700-token prompt in 64-token chunks: each round runs one chunk and one cycle, so the
    active stream commits between every two chunks."""
    model, tokenizer = pair_model
    scheduler = Scheduler(model, tokenizer, 4, prefill_step_size=64)
    events = []
    short = BatchRequest(random_prompts(1, 200, seed=1)[0].tolist(), emit=lambda r: events.append("token"), max_tokens=40,
                         block_tokens=4)
    scheduler.submit(short)
    scheduler.step()
    scheduler.step()
    long_prompt = random_prompts(1, 200, seed=2, low=700, high=701)[0].tolist()
    scheduler.submit(BatchRequest(long_prompt, emit=lambda r: None, max_tokens=2))
    chunks = []
    while not short.done:
        before = len(events)
        scheduler.step()
        fed = scheduler.prefilling[0] if scheduler.prefilling else None
        chunks.append((fed is not None, len(events) > before))
    prefill_rounds = [gotten for prefilling, gotten in chunks if prefilling]
    assert len(prefill_rounds) >= 10 and all(prefill_rounds)  # the short stream got tokens every round


def test_short_prompts_join_in_one_round_within_one_chunk_of_prefill(pair_model, monkeypatch):
    """A round prefills several requests' chunks, in arrival order, up to ``prefill_step_size``
    prompt tokens in all: three 20-token prompts join the batch in the first round (not one every
    two rounds), a 50-token one waits for the next, and no round feeds more than the step. Each
    answer is the one its request gets alone."""
    from dflash_mlx import decoder as decoder_module

    model, tokenizer = pair_model
    fed_per_round: List[List[int]] = [[]]
    real = decoder_module.prefill_chunks

    def recording(target, prompt, *args, **kwargs):
        chunks = real(target, prompt, *args, **kwargs)
        start = 0
        try:
            while True:
                end = next(chunks)
                fed_per_round[-1].append(end - start)
                start = end
                yield end
        except StopIteration as done:
            return done.value

    monkeypatch.setattr(decoder_module, "prefill_chunks", recording)
    prompts = [p.tolist() for p in random_prompts(3, 200, seed=21, low=20, high=21)]
    prompts.append(random_prompts(1, 200, seed=22, low=50, high=51)[0].tolist())
    scheduler = Scheduler(model, tokenizer, 4, prefill_step_size=64)
    tokens = {i: [] for i in range(4)}
    for i, prompt in enumerate(prompts):
        scheduler.submit(BatchRequest(prompt, emit=lambda r, i=i: tokens[i].append(r.token), max_tokens=6, block_tokens=4))
    joined = []
    while not scheduler.idle:
        scheduler.step()
        joined.append(len(scheduler.active))
        fed_per_round.append([])
    assert joined[0] == 3  # the three short prompts in the first round
    assert sum(fed_per_round[0]) == 60 and sum(fed_per_round[1]) == 50
    assert all(sum(round_) <= 64 for round_ in fed_per_round)
    monkeypatch.setattr(decoder_module, "prefill_chunks", real)
    for i, prompt in enumerate(prompts):
        alone = schedule(model, tokenizer, [dict(prompt=prompt, max_tokens=6, block_tokens=4)], [0])[0][0]
        assert tokens[i] == alone


def test_seeded_sampling_does_not_depend_on_batch_mates(pair_model):
    model, tokenizer = pair_model
    prompts = [p.tolist() for p in random_prompts(4, 200, seed=13, low=5, high=20)]
    sampled = dict(prompt=prompts[0], max_tokens=30, block_tokens=4, temp=1.0, top_p=0.95, seed=1234)
    alone = schedule(model, tokenizer, [sampled], [0])[0][0]
    mates = [dict(prompt=p, max_tokens=n, block_tokens=b, temp=t, seed=s)
             for p, n, b, t, s in zip(prompts[1:], [20, 35, 12], [8, 1, 2], [0.0, 0.7, 1.0], [None, 7, None])]
    for arrivals in ([0, 0, 0, 0], [3, 0, 1, 5]):
        together = schedule(model, tokenizer, [sampled, *mates], arrivals)[0][0]
        assert together == alone
    other_seed = schedule(model, tokenizer, [dict(sampled, seed=99)], [0])[0][0]
    assert other_seed != alone  # the seed matters (the test could fail)


def test_batch_generate_gives_mlx_lms_texts(pair_model, tmp_path):
    """``batch_generate`` answers what mlx-lm's ``batch_generate`` answers with mlx-lm's own model
    of the same checkpoint (greedy, float32: the same tokens; mlx-lm's token ids leave out the
    end of turn, and its texts are theirs decoded whole: the tiny random target's byte fragments
    stream otherwise), each as it is alone, with statistics."""
    import importlib

    from mlx_lm.utils import load_model

    from tests.test_mlx_layouts import multimodal

    model, tokenizer = pair_model
    reference, _ = load_model(multimodal(model.target_path, tmp_path / "mlx_lm"))
    prompts = [p.tolist() for p in random_prompts(3, 200, seed=17, low=5, high=20)]
    out = batch_generate(model, tokenizer, prompts, max_tokens=[12, 20, 7], block_tokens=4)
    theirs = importlib.import_module("mlx_lm.generate").batch_generate(reference, tokenizer, prompts, max_tokens=[12, 20, 7],
                                                                        return_token_ids=True)
    eos = set(tokenizer.eos_token_ids)
    ours = [[t for t in ids if t not in eos] for ids in out.token_ids]
    assert ours == theirs.token_ids and theirs.texts == [tokenizer.decode(ids) for ids in ours] and all(ours)
    for prompt, text, n in zip(prompts, out.texts, [12, 20, 7]):
        alone = schedule(model, tokenizer, [dict(prompt=prompt, max_tokens=n, block_tokens=4)], [0])[1][0]
        assert text == alone
    counts = [r.generation_tokens for r in out.responses]
    assert all(c <= n for c, n in zip(counts, [12, 20, 7])) and out.generation_tokens == sum(counts) > 0
    assert out.generation_tps > 0
    with pytest.raises(ValueError, match="2 max_tokens for 3 prompts"):
        batch_generate(model, tokenizer, prompts, max_tokens=[1, 2])


def test_prefix_cache_reuse_in_a_batch(pair_model):
    """Batched requests take their caches from the pool and give their histories back: a resend
    reuses its prompt, even while its first send's history is busy with another request."""
    from dflash_mlx.prompt_cache import PromptCachePool

    model, tokenizer = pair_model
    pool = PromptCachePool(1 << 30)
    scheduler = Scheduler(model, tokenizer, 4, prompt_cache=pool)
    prompt = random_prompts(1, 200, seed=3, low=200, high=201)[0].tolist()
    lasts = {}
    first = BatchRequest(prompt, emit=lambda r: lasts.__setitem__(0, r), max_tokens=8, block_tokens=4)
    scheduler.submit(first)
    scheduler.run()
    assert lasts[0].cached_prompt_tokens == 0
    second = BatchRequest(prompt, emit=lambda r: lasts.__setitem__(1, r), max_tokens=30, block_tokens=4)
    third = BatchRequest(prompt + [5, 6], emit=lambda r: lasts.__setitem__(2, r), max_tokens=8, block_tokens=4)
    scheduler.submit(second)
    scheduler.step()
    scheduler.submit(third)  # the history `second` runs on is busy: a fork of it
    scheduler.run()
    assert lasts[1].cached_prompt_tokens == len(prompt) - 1
    assert lasts[2].cached_prompt_tokens == 192  # the last grid checkpoint before the fork
    assert not pool.busy


# --- the emulated Mac path, and sampling --------------------------------------------------------------


@pytest.mark.slow  # every kernel call runs in the C++ emulator
def test_a_batch_on_the_emulated_metal_path(tmp_path):
    """The target as a Mac runs it (Gated DeltaNet layers on the kernels, every recurrence and replay
    through the Metal kernels, here the emulator; a GPU's batch rules: two rows at least, a draft
    call per sequence): the batch's recurrence runs B rows in one kernel call, each sequence still
    as alone, bit for bit, and as the target alone."""
    from tests.conftest import make_hf_target
    from tests.test_emulated_metal import emulated_recurrence, kernels_used

    heads = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_value_head_dim=8)
    target, config = load_target(make_hf_target(tmp_path / "t", dtype="bfloat16", **heads), recurrence=emulated_recurrence())
    draft = make_draft(tmp_path / "d", target, config, block_size=4)
    prompts = random_prompts(3, VOCAB, seed=2, low=4, high=12)
    specs = [dict(prompt=p, block=b, max_tokens=n) for p, b, n in zip(prompts, [4, 1, 3], [10, 8, 12])]
    together, caches = run_batch(target, draft, specs, [0, 1, 0], record=True, rules=RULES["gpu rules"])
    for i, spec in enumerate(specs):
        alone, alone_caches = run_batch(target, draft, [spec], [0], record=True, rules=RULES["gpu rules"])
        assert together[i] == alone[0] and len(caches[i]) == len(alone_caches[0])
        for got, want in zip(caches[i][-1], alone_caches[0][-1]):
            assert mx.array_equal(got, want).item()
        expected = take(target_only(target, spec["prompt"], GREEDY), spec["max_tokens"])[0]
        assert_lossless(target, spec["prompt"], expected, together[i])
    assert set(kernels_used(target).values()) == {"ok"}  # the kernels ran, none fell back


@pytest.mark.slow  # chi-square over a thousand sampled runs
def test_sampling_inside_a_batch_follows_the_target(tmp_path_factory):
    """Four sampled sequences per batch (each its own generator, batch-mates at other blocks): the
    joint distribution of tokens 2-3 of every one of them is the target's (test_sampling's oracle:
    mlx-lm's filters, computed exactly)."""
    from tests import test_sampling as ts

    target, draft = ts.small_pair.__wrapped__(tmp_path_factory)
    sampler = ts.SAMPLERS[1]
    counts = np.zeros((ts.V, ts.V))
    decoder = Decoder(target, draft, min_rows=batch_min_rows())
    generator = Sampler(sampler.temperature, top_p=sampler.top_p, top_k=sampler.top_k, min_p=sampler.min_p)
    caches = ts.resend(target, draft)  # each sequence resends the prompt: bit for bit a prefill from scratch
    for run in range(ts.SAMPLES // 4):
        seqs, tokens = [], []
        for j, block in enumerate([4, 2, 3, 4]):
            cache, draft_cache = caches()
            seq, commit = prefilled(decoder, ts.PROMPT[-1:], generator.for_request(run * 4 + j), chooser=FixedBlock(block),
                                    max_tokens=1 + block, cache=cache, draft_cache=draft_cache)
            seqs.append(seq)
            tokens.append(list(commit.tokens))
        live = [s for s in seqs if not s.done]
        while live and any(len(t) < 3 for t in tokens):
            for s, commit in zip(live, decoder.cycle(live)):
                tokens[seqs.index(s)] += commit.tokens
            live = [s for s in live if not s.done]
        for t in tokens:
            counts[t[1], t[2]] += 1
    pvalue = ts.goodness_of_fit(counts, ts.exact_joint(target, sampler))
    assert pvalue > 1e-3, f"samples inside a batch do not follow the target (chi-square p={pvalue:.2g})"


def test_the_engine_refuses_to_batch_a_pipelined_target_and_bad_settings():
    """A pipelined target's ranks run one request's cycle in lockstep: more than one at a time is
    refused with the reason (``serve`` under mlx.launch then runs with 1 and says so)."""
    import types

    from dflash_mlx.runner import Pipelined
    from dflash_mlx.server.engine import Engine

    pipelined = types.SimpleNamespace(runner=Pipelined(pipeline=object()))
    with pytest.raises(ValueError, match="a pipelined target serves one generation at a time"):
        Engine(pipelined, None, "m", max_concurrent=2)
    with pytest.raises(ValueError, match="max_concurrent must be at least 1, got 0"):
        Engine(pipelined, None, "m", max_concurrent=0)
    with pytest.raises(ValueError, match="max_queue must not be negative, got -1"):
        Engine(pipelined, None, "m", max_concurrent=1, max_queue=-1)
    with pytest.raises(ValueError, match="batching needs every layer here"):
        Scheduler(pipelined, None)


def test_a_pass_stays_within_the_devices_row_limit(pair_model):
    """More sequences than a pass's rows can hold (at least one row each on the CPU, two on a GPU,
    within 16 rows there: the verify kernel's row-independent range) are refused, naming the count;
    on the CPU the limit is ``ROW_LIMIT``."""
    model, tokenizer = pair_model
    assert batch_row_limit() == ROW_LIMIT and batch_min_rows() == 1
    with pytest.raises(ValueError, match="max_active 9: a pass takes at most 8 rows on this device.*at most 8 at once"):
        Scheduler(model, tokenizer, max_active=9, row_limit=8)
    assert Scheduler(model, tokenizer, max_active=8, row_limit=8).row_limit == 8
    with pytest.raises(ValueError, match="max_active 9: .* at most 16 rows .* at least 2 per sequence.*at most 8 at once"):
        Scheduler(model, tokenizer, max_active=9, row_limit=16, **RULES["gpu rules"])  # what a Mac says


def test_a_stop_string_while_the_next_cycle_is_in_flight_leaves_the_history_as_recorded(pair_model):
    """The scheduler dispatches a request's next cycle before its responses are made; a stop
    string found in them drops the request from that cycle when it is read back, the next round:
    the history it gives back holds exactly the tokens it recorded (every target layer at that length, the draft's
    context one token behind, as after any generation), and its batch-mate is unaffected."""
    from dflash_mlx.cache import GatedDeltaCache
    from dflash_mlx.prompt_cache import PromptCachePool

    model, tokenizer = pair_model
    prompts = [p.tolist() for p in random_prompts(2, 200, seed=12, low=20, high=30)]
    specs = [dict(prompt=p, max_tokens=40, block_tokens=4) for p in prompts]
    alone = [schedule(model, tokenizer, [s], [0]) for s in specs]
    stop_text = alone[0][1][0][20:23]
    assert stop_text
    pool = PromptCachePool(1 << 30)
    scheduler = Scheduler(model, tokenizer, 4, prompt_cache=pool)
    done = []
    requests = [BatchRequest(s["prompt"], emit=lambda r: None, max_tokens=40, block_tokens=4, stop=[stop_text] if i == 0 else None,
                             on_done=lambda i=i: done.append(i)) for i, s in enumerate(specs)]
    for r in requests:
        scheduler.submit(r)
    rounds, stopped_at, left_at = 0, None, None
    while not scheduler.idle:
        scheduler.step()
        rounds += 1
        if requests[0].driven._leaving and stopped_at is None:
            stopped_at = rounds
        if 0 in done and left_at is None:
            left_at = rounds
    assert stopped_at is not None and left_at == stopped_at + 1, (stopped_at, left_at)  # the next round
    assert sorted(done) == [0, 1]
    assert requests[1].last.text is not None and not pool.busy
    history = requests[0].driven._history or max(pool.histories, key=lambda h: h.shared_prefix(prompts[0]))
    for layer in history.cache:
        offset = layer.offset
        assert offset == len(history.tokens), (offset, len(history.tokens))
        if isinstance(layer, GatedDeltaCache):
            assert layer.tape is None
