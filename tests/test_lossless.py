"""Greedy speculative output is token-identical to the target alone, for every acceptance length."""

from __future__ import annotations

import itertools
from typing import List

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.block_policy import AutoBlock, BlockStats
from dflash_mlx.cache import GatedDeltaCache, WindowCache
from dflash_mlx.models.dflash import quantize_draft
from dflash_mlx.sampling import Sampler, propose
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from tests.conftest import VOCAB, make_draft, random_prompts

GREEDY = Sampler()
BLOCKS = [2, 4, 8, 16]


def take(commits, n):
    """The first ``n`` tokens of a commit stream, and the commits that made them."""
    tokens, seen = [], []
    for commit in commits:
        seen.append(commit)
        tokens.extend(commit.tokens)
        if len(tokens) >= n:
            return tokens[:n], seen


def assert_lossless(target, prompt, expected, got):
    """Exact equality, or a proven near-tie of the target at the first divergence."""
    if expected == got:
        return
    j = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    context = mx.concatenate([prompt, mx.array(expected[:j], dtype=prompt.dtype)])
    logits = np.array(target(context[None])[0, -1].astype(mx.float32))
    top2 = np.argsort(logits)[-2:]
    gap = logits[top2[1]] - logits[top2[0]]
    assert {expected[j], got[j]} == set(top2.tolist()) and gap < 1e-5, (
        f"speculative output diverges at token {j}: {got[j]} instead of {expected[j]} "
        f"(target top-2 gap {gap:.3g}, not a floating-point near-tie)"
    )


class OracleDraft:
    """Proposes the target's own greedy continuation, wrong at one scheduled slot per cycle.

    Schedule entry ``e < block-1`` corrupts slot ``e`` (so exactly ``e`` tokens are accepted);
    ``block-1`` corrupts nothing (full acceptance).
    """

    mask_token_id = VOCAB - 1
    target_layer_ids = [0]

    def __init__(self, sequence, block_size, schedule):
        self.sequence, self.block_size, self.schedule = sequence, block_size, schedule
        self.position = 0  # tokens the target has committed to its cache
        self.cycle = 0

    def make_cache(self, window=None):
        return []

    def add_context(self, features, cache):
        self.position += features.shape[1]

    def __call__(self, block, cache):
        n = block.shape[1] - 1
        want = list(self.sequence[self.position + 1 : self.position + 1 + n])
        want += [0] * (n - len(want))
        wrong = self.schedule[self.cycle % len(self.schedule)]
        self.cycle += 1
        if wrong < n:
            want[wrong] = (want[wrong] + 1) % (VOCAB - 1)
        return (10.0 * mx.eye(VOCAB)[mx.array(want)])[None]

    def propose(self, block, cache, sampler):
        return propose(self(block[None], cache)[0], sampler)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(20, VOCAB, seed=7)


@pytest.fixture(scope="module")
def references(target, prompts):
    """Target-only greedy continuations, long enough for the oracle's longest schedule."""
    return [take(target_only(target, p, GREEDY), 16 * 17 // 2 + 20)[0] for p in prompts]


@pytest.mark.parametrize("block", [b if b in (2, 8) else pytest.param(b, marks=pytest.mark.slow) for b in BLOCKS])
def test_random_draft_is_lossless(target, draft, prompts, references, block):
    for prompt, expected in zip(prompts, references):
        got, commits = take(speculative(target, draft, prompt, GREEDY, block_tokens=block), 24)
        assert_lossless(target, prompt, expected[:24], got)
        assert all(c.drafted == block - 1 for c in commits[1:])


@pytest.mark.parametrize("block", BLOCKS)
def test_every_acceptance_length_is_lossless(target, prompts, references, block):
    seen = set()
    for k, (prompt, expected) in enumerate(zip(prompts, references)):
        schedule = list(range(block))
        schedule = schedule[k % block :] + schedule[: k % block]
        oracle = OracleDraft(prompt.tolist() + expected, block, schedule)
        n = block * (block + 1) // 2 + 1
        got, commits = take(speculative(target, oracle, prompt, GREEDY, block_tokens=block), n)
        assert_lossless(target, prompt, expected[:n], got)
        accepted = [c.accepted for c in commits[1:]]
        seen.update(accepted)
        # The oracle's schedule is followed exactly, so the loop accepted what it should.
        assert accepted[: len(schedule)] == schedule[: len(accepted)]
    assert seen == set(range(block)), f"acceptance lengths seen: {sorted(seen)}"


def test_w4_draft_is_lossless(tmp_path, target, target_config, prompts, references):
    w4 = make_draft(tmp_path, target, target_config, block_size=8, seed=5)
    quantize_draft(w4, "w4:gs32")
    for prompt, expected in itertools.islice(zip(prompts, references), 8):
        got, _ = take(speculative(target, w4, prompt, GREEDY, block_tokens=8), 24)
        assert_lossless(target, prompt, expected[:24], got)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_target_with_a_quantized_draft_is_lossless(tmp_path, hf_target_dir, prompts, bits):
    """The flagship set-up in small: a w4 (w8) target with a w4 (w8) draft, greedy at blocks 4
    and 8 with a random draft and at every acceptance length with the oracle draft."""
    import mlx.nn as nn

    from dflash_mlx.loading import load_target

    target, config = load_target(hf_target_dir)
    nn.quantize(target, group_size=32, bits=bits)
    draft = make_draft(tmp_path, target, config, block_size=8, seed=6)
    quantize_draft(draft, f"w{bits}:gs32")
    seen = set()
    for k, prompt in enumerate(prompts[:6]):
        expected, _ = take(target_only(target, prompt, GREEDY), 24)
        for block in (4, 8):
            got, _ = take(speculative(target, draft, prompt, GREEDY, block_tokens=block), 24)
            assert_lossless(target, prompt, expected, got)
        schedule = list(range(4))[k % 4 :] + list(range(4))[: k % 4]
        oracle = OracleDraft(prompt.tolist() + expected, 4, schedule)
        got, commits = take(speculative(target, oracle, prompt, GREEDY, block_tokens=4), 11)
        assert_lossless(target, prompt, expected[:11], got)
        seen.update(c.accepted for c in commits[1:])
    assert seen == set(range(4))


def _cache_tensors(cache):
    def host(x):
        return np.array(x.astype(mx.float32))  # numpy has no bfloat16

    out = []
    for c in cache:
        if isinstance(c, GatedDeltaCache):
            out.append(("conv", c.offset, host(c.conv_state)))
            out.append(("state", c.offset, host(c.state)))
        elif isinstance(c, WindowCache):  # the rows a next pass reads (those before are dropped)
            keys, values = c.checkpoint()
            out.append(("window keys", c.offset, host(keys)))
            out.append(("window values", c.offset, host(values)))
        else:
            out.append(("keys", c.offset, host(c.keys[..., : c.offset, :])))
            out.append(("values", c.offset, host(c.values[..., : c.offset, :])))
    return out


def assert_caches_hold_the_committed_tokens(target, cache, prompt, committed, tolerance, label):
    """``cache`` equals the caches of feeding ``prompt + committed`` directly."""
    direct = target.make_cache()
    fed = mx.concatenate([prompt, mx.array(committed, dtype=prompt.dtype)])
    target(fed[None], direct)
    for (name, offset, got), (_, want_offset, want) in zip(_cache_tensors(cache), _cache_tensors(direct)):
        assert offset == want_offset == fed.size, name
        np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance,
                                   err_msg=f"{label}: {name}")


def stop_after(stream, cycles: int) -> List[int]:
    """Take ``cycles + 1`` commits, then close the stream (a consumer that stops); the tokens."""
    committed = []
    for i, commit in enumerate(stream):
        committed.extend(commit.tokens)
        if i == cycles:
            break
    stream.close()
    return committed


@pytest.mark.parametrize("block", [4, 8])
def test_rollback_leaves_the_caches_of_the_committed_tokens(target, prompts, references, block):
    prompt, expected = prompts[3], references[3]
    oracle = OracleDraft(prompt.tolist() + expected, block, list(range(block)) * 2)
    for cycles in range(2 * block + 1):
        cache = target.make_cache()
        committed = stop_after(speculative(target, oracle, prompt, GREEDY, block_tokens=block, cache=cache), cycles)
        # Everything committed except the newest token (the next cycle's input) is in the cache:
        # the cycle dispatched before the last yield was undone when the stream closed.
        assert_caches_hold_the_committed_tokens(target, cache, prompt, committed[:-1], 2e-5, f"cycle {cycles}")


@pytest.mark.parametrize("loop", ["speculative", "target-only"])
def test_the_next_step_is_dispatched_before_a_commit_is_yielded(target, draft, prompts, loop):
    """The device never waits on the consumer: at each yield the next step is in the cache already."""
    cache = target.make_cache()
    stream = (speculative(target, draft, prompts[0], GREEDY, block_tokens=4, cache=cache) if loop == "speculative"
              else target_only(target, prompts[0], GREEDY, cache=cache))
    committed = 0
    for i, commit in enumerate(stream):
        committed += len(commit.tokens)
        in_flight = 4 if loop == "speculative" else 1  # the fed block: last token + 3 proposals
        assert cache[0].offset == prompts[0].size + committed - 1 + in_flight, f"step {i}"
        if i == 6:
            break
    stream.close()
    assert cache[0].offset == prompts[0].size + committed - 1


def _recurrence_inputs(seed=0, T=8, B=1, Hk=2, Hv=4, Dk=32, Dv=16):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, Hk, Dk)).astype(np.float32) for _ in range(2))
    q, k = (mx.array(x / np.linalg.norm(x, axis=-1, keepdims=True)) for x in (q * Dk**-0.5, k))
    v = mx.array(rng.standard_normal((B, T, Hv, Dv)).astype(np.float32))
    g = mx.array(rng.uniform(0.5, 1.0, (B, T, Hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0, 1, (B, T, Hv)).astype(np.float32))
    state = mx.array(rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32))
    return q, k, v, g, beta, state


def test_replayed_state_is_bit_identical_to_the_forward_state(monkeypatch):
    """Step by step, replaying a tape reproduces the recurrence's own state exactly."""
    from dflash_mlx import kernels

    monkeypatch.setenv(kernels.BACKEND_ENV, "reference")
    q, k, v, g, beta, state = _recurrence_inputs()
    recurrence = kernels.Recurrence.for_this_process()
    T = q.shape[1]
    for n in range(T + 1):
        _, direct, _ = recurrence.gated_delta(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state) if n else (None, state, None)
        _, _, tape = recurrence.gated_delta(q, k, v, g, beta, state)
        np.testing.assert_array_equal(np.array(recurrence.tape_replay(state, k, g, tape, n)), np.array(direct))


@pytest.mark.parametrize("T", [1, 2, 7, 16, 150])
def test_chunked_recurrence_and_replay_match_the_reference(T):
    """The chunked (triangular-solve) form used on the CPU equals the step-by-step one."""
    from dflash_mlx import kernels

    q, k, v, g, beta, state = _recurrence_inputs(seed=T, T=T)
    g = mx.where(mx.arange(T)[None, :, None] == T // 2, 0.0, g)  # a decay that underflowed
    want_y, want_state, want_delta = kernels.gated_delta_reference(q, k, v, g, beta, state)
    y, final, delta = kernels.gated_delta_chunked(q, k, v, g, beta, state)  # 150: three chunks
    for got, want in ((y, want_y), (final, want_state), (delta, want_delta)):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-5)
    for n in sorted({1, T // 2, T - 1, T}):
        np.testing.assert_allclose(
            np.array(kernels.tape_replay_chunked(state, k, g, delta, n)),
            np.array(kernels.tape_replay_reference(state, k, g, want_delta, n)), atol=2e-5, rtol=1e-5,
        )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_decode_step_is_row_0_of_a_verify_block_bit_for_bit(dtype):
    """On the CPU the recurrence runs one algebra at every length, so a token's output, tape and
    state do not depend on how many rows its pass carried: a one-token call equals row 0 of a
    2..16-token block, and replaying one step of the block's tape gives the one-token call's state.
    (The decode loop, the verify pass and the batch rest on it; the step form at T = 1 rounds its
    decay apart: ``g`` against ``exp(log g)``.)"""
    from dflash_mlx import kernels

    recurrence = kernels.Recurrence(chunked=True)
    for T in (2, 5, 16):
        q, k, v, g, beta, state = _recurrence_inputs(seed=T, T=T)
        q, k, v, beta = (a.astype(dtype) for a in (q, k, v, beta))
        y1, state1, delta1 = recurrence.gated_delta(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)
        y, _, delta = recurrence.gated_delta(q, k, v, g, beta, state)
        assert mx.array_equal(y1, y[:, :1]).item() and mx.array_equal(delta1, delta[:, :1]).item(), T
        assert mx.array_equal(recurrence.tape_replay(state, k, g, delta, 1), state1).item(), T


# ---- block sizes chosen per cycle (block_tokens="auto") ----------------------------------------


class ScriptedBlock:
    """A ``BlockChooser`` that follows a script of ``(size, shadow tokens)``: the block changes
    every cycle, passes through 1 (plain steps whose features wait for the draft) and shadows."""

    def __init__(self, script):
        self.script, self.cycle, self.reports = script, -1, []

    def choose(self):
        self.cycle += 1
        return self.script[self.cycle % len(self.script)][0]

    def shadow_tokens(self):
        return self.script[self.cycle % len(self.script)][1]

    def observe(self, **report):
        self.reports.append(report)


def changing_blocks(cap):
    """Every size up to ``cap``, with plain steps and shadows between them."""
    script = []
    for b in range(2, cap + 1):
        script += [(b, 0), (1, 0), (1, min(b, cap - 1)), (1, 0)]
    return script + [(cap, 0), (2, 0), (cap, 0), (1, cap - 1)]


@pytest.mark.parametrize("chooser", ["auto", "scripted"])
def test_random_draft_is_lossless_with_changing_blocks(target, draft, prompts, references, chooser):
    stats = BlockStats.seeded(0)
    for prompt, expected in zip(prompts, references):
        blocks = AutoBlock(stats, 16) if chooser == "auto" else ScriptedBlock(changing_blocks(16))
        got, commits = take(speculative(target, draft, prompt, GREEDY, block_tokens=blocks), 48)
        assert_lossless(target, prompt, expected[:48], got)
    if chooser == "auto":
        assert stats.costs.measured, "the controller measured no cycle"


class RecordingOracle(OracleDraft):
    """The oracle, also recording for each call what it proposed and how many were right."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def __call__(self, block, cache):
        wrong = self.schedule[self.cycle % len(self.schedule)]
        out = super().__call__(block, cache)
        n = block.shape[1] - 1
        self.calls.append((min(wrong, n), mx.argmax(out[0], axis=-1).tolist()))
        return out


def test_every_acceptance_length_with_changing_blocks_and_shadows(target, prompts, references):
    """Sizes change every cycle and pass through 1; the draft is an oracle wrong at a scheduled
    slot, so each cycle must accept exactly what the schedule says and each shadow must report
    exactly the proposals that match the tokens committed after it. Both fail if the plain steps'
    features do not reach the draft (the oracle reads its position from them)."""
    script = changing_blocks(8)
    seen = set()
    for k, (prompt, expected) in enumerate(zip(prompts[:6], references)):
        schedule = [(k + 3 * i) % 8 for i in range(8)]
        oracle = RecordingOracle(prompt.tolist() + expected, 8, schedule)
        blocks = ScriptedBlock(script)
        got, commits = take(speculative(target, oracle, prompt, GREEDY, block_tokens=blocks), 120)
        assert_lossless(target, prompt, expected[:120], got)
        calls = iter(oracle.calls)
        for i, commit in enumerate(commits[1:]):
            size, shadow = script[i % len(script)]
            assert commit.drafted == size - 1
            if size > 1:
                right, _ = next(calls)
                assert commit.accepted == right, f"cycle {i} at block {size}"
                seen.add((size, commit.accepted))
            elif shadow:
                right, proposed = next(calls)
                report = blocks.reports[i] if i < len(blocks.reports) else None
                if report is not None:
                    assert report["proposals"] == proposed
                after = sum(len(c.tokens) for c in commits[: i + 1])
                if after + right < len(got):  # the last cycles run past the tokens taken
                    assert proposed[:right] == got[after : after + right]
                    assert right == len(proposed) or proposed[right] != got[after + right]
    assert seen == {(b, a) for b in range(2, 9) for a in range(b)}, sorted(seen)


def test_rollback_state_with_changing_blocks(target, prompts, references):
    prompt, expected = prompts[3], references[3]
    oracle = OracleDraft(prompt.tolist() + expected, 8, [0, 3, 7, 1, 5, 2, 6, 4])
    for cycles in range(0, 31, 3):
        cache = target.make_cache()
        blocks = ScriptedBlock(changing_blocks(8))
        committed = stop_after(speculative(target, oracle, prompt, GREEDY, block_tokens=blocks, cache=cache), cycles)
        assert_caches_hold_the_committed_tokens(target, cache, prompt, committed[:-1], 2e-5, f"cycle {cycles}")


def test_the_draft_sees_every_committed_token_across_plain_steps(target, draft, prompts):
    """Wherever a stream stops (plain steps pending or not), the draft's context cache covers
    exactly the target's cache."""
    for cycles in range(0, 41, 4):
        cache, draft_cache = target.make_cache(), draft.make_cache()
        blocks = ScriptedBlock(changing_blocks(16))
        stream = speculative(target, draft, prompts[0], GREEDY, block_tokens=blocks, cache=cache, draft_cache=draft_cache)
        committed = stop_after(stream, cycles)
        assert cache[0].offset == prompts[0].size + len(committed) - 1, f"cycle {cycles}"
        assert all(c.offset == cache[0].offset for c in draft_cache), f"cycle {cycles}"
    for max_tokens in range(2, 40, 5):  # streams that end by themselves, some right after plain steps
        cache, draft_cache = target.make_cache(), draft.make_cache()
        blocks = ScriptedBlock(changing_blocks(16))
        commits = list(speculative(target, draft, prompts[0], GREEDY, block_tokens=blocks, cache=cache,
                                   draft_cache=draft_cache, max_tokens=max_tokens))
        committed = sum(len(c.tokens) for c in commits)
        assert committed == max_tokens  # the last cycles are capped at what is left
        assert cache[0].offset == prompts[0].size + committed - 1, f"max_tokens {max_tokens}"
        assert all(c.offset == cache[0].offset for c in draft_cache), f"max_tokens {max_tokens}"




# ---- the last cycles: no row verified past max_tokens -------------------------------------------


def verified_rows_fit(commits, max_tokens):
    """Each cycle's rows (its input token and its proposals, each committing at most one token)
    fit in what was left of ``max_tokens`` when it was dispatched; the rows of every cycle."""
    done, rows = len(commits[0].tokens), []
    for i, c in enumerate(commits[1:]):
        assert c.drafted + 1 <= max_tokens - done, (
            f"cycle {i} verified {c.drafted + 1} rows with {max_tokens - done} tokens left")
        rows.append(c.drafted + 1)
        done += len(c.tokens)
    return rows


@pytest.mark.parametrize("block", [4, 8])
def test_the_last_cycles_verify_no_row_past_max_tokens(target, prompts, references, block):
    """An oracle that is always right (and one wrong at scheduled slots): whatever ``max_tokens``,
    the output is the target's first ``max_tokens`` tokens and no cycle verifies a row past them;
    always right, the rows verified after the prompt's token are exactly ``max_tokens - 1``."""
    prompt, expected = prompts[5], references[5]
    for schedule in ([block - 1], [block - 1, 1, block - 1, 0, 2]):
        for max_tokens in range(1, 2 * block + 4):
            oracle = OracleDraft(prompt.tolist() + expected, block, schedule)
            commits = list(speculative(target, oracle, prompt, GREEDY, block_tokens=block, max_tokens=max_tokens))
            got = [t for c in commits for t in c.tokens]
            assert len(got) == max_tokens
            assert_lossless(target, prompt, expected[:max_tokens], got)
            rows = verified_rows_fit(commits, max_tokens)
            if schedule == [block - 1]:
                assert sum(rows) == max_tokens - 1, (max_tokens, rows)


def test_the_last_cycles_fit_max_tokens_with_changing_blocks_and_shadows(target, prompts, references):
    """Scripted sizes through 1 and shadows: no cycle verifies past ``max_tokens`` and no shadow
    drafts more tokens than are left to grade it with."""
    prompt, expected = prompts[5], references[5]
    script = changing_blocks(8)
    for max_tokens in range(1, 30):
        oracle = OracleDraft(prompt.tolist() + expected, 8, [7])
        blocks = ScriptedBlock(script)
        commits = list(speculative(target, oracle, prompt, GREEDY, block_tokens=blocks, max_tokens=max_tokens))
        got = [t for c in commits for t in c.tokens]
        assert len(got) == max_tokens
        assert_lossless(target, prompt, expected[:max_tokens], got)
        verified_rows_fit(commits, max_tokens)
        done = len(commits[0].tokens)
        for i, (commit, report) in enumerate(zip(commits[1:], blocks.reports)):
            assert report["block"] == commit.drafted + 1  # the size that ran, not the one chosen
            done += len(commit.tokens)
            assert len(report["proposals"]) <= max_tokens - done, f"cycle {i}: a shadow nothing can grade"


class AlwaysAt(AutoBlock):
    """``AutoBlock``'s statistics, fed by the loop, with its choices fixed at ``block`` (its own
    follow measured times)."""

    def __init__(self, block):
        super().__init__(BlockStats.seeded(0), block)
        self.block = block
        self.opening = False  # its choices do not look past an answer's opening: every outcome is learnt

    def choose(self):
        self.probing, self.shadowing = False, 0
        return self.block


def test_a_capped_cycle_teaches_the_controller_only_what_ran(target, prompts, references):
    """With an oracle that is always right, the controller must never see a rejected slot: a
    capped cycle reported at the size it was chosen at would count the slot after its last
    proposal as tried and rejected. The cost statistics see the sizes that ran."""
    prompt, expected = prompts[5], references[5]
    for max_tokens in (2, 5, 12, 15):  # 1 + 8 + 3, 1 + 8 + 6: the last cycle capped
        blocks = AlwaysAt(8)
        oracle = OracleDraft(prompt.tolist() + expected, 8, [7])
        commits = list(speculative(target, oracle, prompt, GREEDY, block_tokens=blocks, max_tokens=max_tokens))
        ran = [c.drafted + 1 for c in commits[1:]]
        assert sum(ran) == max_tokens - 1
        stats = blocks.acceptance
        assert stats.total_accepted == stats.total_tried, (max_tokens, ran, stats.total_tried, stats.total_accepted)
        assert (stats.total_tried or [0.0])[0] == sum(b > 1 for b in ran)
        assert blocks.stats.costs.cycles == {b: ran.count(b) for b in set(ran)}


# ---- what the draft is handed after plain steps ----------------------------------------------------


def draft_context(cache):
    """Each draft layer's context keys and values (the rows it holds), as float32 numpy arrays."""
    out = []
    for c in cache:
        used = c.offset - c.start
        out.append((c.start, c.offset, np.array(c.keys[..., :used, :].astype(mx.float32)),
                    np.array(c.values[..., :used, :].astype(mx.float32))))
    return out


def assert_draft_holds_the_committed_features(target, draft, draft_cache, prompt, committed, tolerance, label):
    """``draft_cache`` equals the context cache of handing the draft the features of
    ``prompt + committed``, tapped from one target pass over them."""
    fed = mx.concatenate([prompt, mx.array(committed, dtype=prompt.dtype)])
    _, features = target.forward(fed[None], target.make_cache(), draft.target_layer_ids)
    direct = draft.make_cache()
    draft.add_context(features, direct)
    for layer, (got, want) in enumerate(zip(draft_context(draft_cache), draft_context(direct))):
        assert got[:2] == want[:2] == (0, fed.size), f"{label}: layer {layer} holds {got[:2]}"
        for name, g, w in (("keys", got[2], want[2]), ("values", got[3], want[3])):
            np.testing.assert_allclose(g, w, rtol=0, atol=tolerance, err_msg=f"{label}: layer {layer} {name}")


# Plain steps in runs of 1-3 between drafting cycles of 4 and 8, a shadow among them.
PLAIN_RUNS = [(1, 0), (1, 0), (1, 0), (4, 0), (1, 0), (4, 0), (1, 3), (1, 0), (8, 0), (1, 0), (1, 0), (4, 0)]


def test_the_draft_is_handed_the_plain_steps_features(target, draft, prompts):
    """Not only as many rows as the target's cache: the same rows. After plain steps, wherever a
    stream stops (features pending or handed off), the draft's context keys and values equal
    those of feeding the committed tokens' features directly.

    Tolerance 1e-4 (keys and values of order 1): the target's features come from passes of 1, 4
    and 8 rows and a rollback instead of one pass, so they differ by float32 rounding, which the
    draft's projections carry over: measured up to 3e-6 on keys and values up to 3.8. The features
    of other tokens, or zeros, differ by order 1."""
    prompt = prompts[2]
    for cycles in (3, 4, 6, 9, 12, 15):
        draft_cache = draft.make_cache()
        stream = speculative(target, draft, prompt, GREEDY, block_tokens=ScriptedBlock(PLAIN_RUNS),
                             draft_cache=draft_cache)
        committed = stop_after(stream, cycles)
        assert_draft_holds_the_committed_features(target, draft, draft_cache, prompt, committed[:-1], 1e-4,
                                                  f"stopped after cycle {cycles}")
    for max_tokens in (4, 11, 20):  # streams that end by themselves
        draft_cache = draft.make_cache()
        commits = list(speculative(target, draft, prompt, GREEDY, block_tokens=ScriptedBlock(PLAIN_RUNS),
                                   draft_cache=draft_cache, max_tokens=max_tokens))
        committed = [t for c in commits for t in c.tokens]
        assert_draft_holds_the_committed_features(target, draft, draft_cache, prompt, committed[:-1], 1e-4,
                                                  f"max_tokens {max_tokens}")
