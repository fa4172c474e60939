"""Sampled speculative decoding follows the target's own distribution (and a biased rule is caught)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from dflash_mlx import sampling
from dflash_mlx import speculative as loop
from dflash_mlx.loading import load_target
from dflash_mlx.sampling import Sampler
from tests.conftest import make_draft, make_hf_target

V = 8  # small vocabulary: the joint distribution of two tokens has 64 cells
SAMPLES = 1200
PROMPT = mx.array([1, 5, 2, 6, 3], dtype=mx.int32)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    path = make_hf_target(tmp_path_factory.mktemp("small_target"), vocab_size=V, seed=11)
    target, config = load_target(path)
    draft = make_draft(tmp_path_factory.mktemp("small_draft"), target, config, block_size=4, seed=12)
    return target, draft


def exact_joint(target, sampler):
    """P(t2, t3) under target-only sampling: the target samples t1, then t2, t3."""
    p1 = np.array(sampler.probs(target(PROMPT[None])[0, -1]))
    seqs = np.array([[*PROMPT.tolist(), a] for a in range(V)])
    p2 = np.array(sampler.probs(target(mx.array(seqs))[:, -1]))  # [t1, t2]
    seqs3 = np.array([[*PROMPT.tolist(), a, b] for a in range(V) for b in range(V)])
    p3 = np.array(sampler.probs(target(mx.array(seqs3))[:, -1])).reshape(V, V, V)  # [t1, t2, t3]
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def sampled_joint(target, draft, sampler, seed, blocks=lambda: 4, samples=SAMPLES):
    """``blocks()`` gives each sample's block setting: a size or a fresh chooser. Path tests (another
    dtype, another backend, another target) take fewer samples than the rule's own tests."""
    mx.random.seed(seed)
    counts = np.zeros((V, V))
    for _ in range(samples):
        tokens = []
        # Cycles are capped at what max_tokens leaves: 1 + the block keeps the first cycle whole (at 3
        # a block of 4 would run as 2, and the rule past the second slot, the biased rule's negative
        # control with it, would go untested); 5 lets scripted sizes up to 4 follow a plain step.
        # No more: the loops dispatch one step ahead, and a cycle past the third token is wasted.
        setting = blocks()
        max_tokens = 1 + setting if isinstance(setting, int) else 5
        for commit in loop.speculative(target, draft, PROMPT, sampler, block_tokens=setting, max_tokens=max_tokens):
            tokens.extend(commit.tokens)
            if len(tokens) >= 3:
                break
        counts[tokens[1], tokens[2]] += 1
    return counts


def goodness_of_fit(counts, expected_probs):
    expected_probs = expected_probs.astype(np.float64).ravel()
    observed = counts.ravel()
    assert observed[expected_probs == 0].sum() == 0, "sampled a token the filters exclude"
    expected = expected_probs / expected_probs.sum() * counts.sum()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    observed, expected = observed[~small], expected[~small]
    if small.any() and expected_probs[small].sum() > 0:
        observed = np.append(observed, counts.ravel()[small].sum())
        expected = np.append(expected, counts.sum() - expected.sum())
    return chisquare(observed, expected).pvalue


SAMPLERS = [Sampler(temperature=1.0), Sampler(temperature=0.8, top_p=0.9, top_k=6, min_p=0.02)]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["plain", "filtered"])
def test_speculative_samples_follow_the_target_distribution(small_pair, sampler):
    target, draft = small_pair
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=0), exact_joint(target, sampler))
    assert pvalue > 1e-3, f"speculative samples do not follow the target (chi-square p={pvalue:.2g})"


def test_bfloat16_sampling_follows_the_target(tmp_path_factory):
    """A bfloat16 pair (what Macs run): the filtered distribution still holds through sampling,
    acceptance and residuals computed from 16-bit logits."""
    path = make_hf_target(tmp_path_factory.mktemp("small_bf16"), vocab_size=V, seed=11, dtype="bfloat16")
    target, config = load_target(path)
    draft = make_draft(tmp_path_factory.mktemp("small_bf16_draft"), target, config, block_size=4, seed=12)
    draft.set_dtype(mx.bfloat16)
    sampler = SAMPLERS[1]
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=4, samples=SAMPLES // 2), exact_joint(target, sampler))
    assert pvalue > 1e-3, f"bfloat16 speculative samples do not follow the target (chi-square p={pvalue:.2g})"


def test_sampling_with_block_sizes_that_change_every_cycle(small_pair):
    """The block changes between the cycles that make tokens 2 and 3 (through 1, with shadows),
    and under the real controller; the joint distribution is still the target's."""
    from dflash_mlx.block_policy import AutoBlock, BlockStats
    from tests.test_lossless import ScriptedBlock

    target, draft = small_pair
    sampler = SAMPLERS[1]
    scripts = [[(1, 2), (3, 0)], [(2, 0), (1, 0)], [(4, 0), (2, 0)], [(1, 0), (1, 3)]]
    turn = iter(range(10**9))
    scripted = lambda: ScriptedBlock(scripts[next(turn) % len(scripts)])  # noqa: E731
    stats = BlockStats.seeded(0)
    # The scripted sizes are the rule's test; the controller's choices are a path through it (half the samples).
    for name, blocks, samples in (("scripted", scripted, SAMPLES), ("auto", lambda: AutoBlock(stats, 4, shadow=False), SAMPLES // 2)):
        counts = sampled_joint(target, draft, sampler, seed=2, blocks=blocks, samples=samples)
        pvalue = goodness_of_fit(counts, exact_joint(target, sampler))
        assert pvalue > 1e-3, f"{name}: speculative samples do not follow the target (chi-square p={pvalue:.2g})"


def biased_accept(target_logits, drafted, draft_probs, sampler):
    """A classic bug: on rejection, draw from p instead of the residual max(p - q, 0)."""
    n = drafted.shape[0]
    p = sampler.probs(target_logits)
    p_d = mx.take_along_axis(p[:n], drafted[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(draft_probs, drafted[:, None], axis=-1)[:, 0]
    accepted = mx.cumprod((mx.random.uniform(shape=(n,)) * q_d < p_d).astype(mx.int32)).sum()
    return accepted, sampling.categorical(p)[accepted]


def test_negative_control_biased_rule_is_detected(small_pair, monkeypatch):
    target, draft = small_pair
    sampler = SAMPLERS[0]
    monkeypatch.setattr(loop, "accept", biased_accept)
    # Half the samples: p = 3e-17 and 4e-7 for seeds 0 and 3 (before the last cycles were capped at
    # what max_tokens leaves: 3e-7, 1e-10 and 9e-15 for seeds 0, 3 and 5; at a quarter: 2e-4 for seed 5).
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=0, samples=SAMPLES // 2), exact_joint(target, sampler))
    assert pvalue < 1e-4, f"the test cannot tell a biased acceptance rule apart (p={pvalue:.2g})"


def wrong_bonus_accept(target_logits, drafted, draft_probs, sampler):
    """Another bug: when every draft is accepted, draw the bonus from the last draft's row."""
    n = drafted.shape[0]
    p = sampler.probs(target_logits)
    accepted, token = sampling.accept(target_logits, drafted, draft_probs, sampler)
    bonus = sampling.categorical(p[n - 1 : n])[0]
    return accepted, mx.where(accepted == n, bonus, token)


def test_the_all_accepted_bonus_draw_follows_the_target(small_pair, monkeypatch):
    """Block 2: token 3 is the bonus draw whenever token 2 (the one draft) is accepted, so the
    joint covers that path too; drawing the bonus from the wrong row is caught."""
    target, draft = small_pair
    sampler = SAMPLERS[1]
    accepted = []
    real_accept = loop.accept

    def counting(*args):
        n, token = real_accept(*args)
        accepted.append(n)
        return n, token

    monkeypatch.setattr(loop, "accept", counting)
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=3, blocks=lambda: 2), exact_joint(target, sampler))
    assert pvalue > 1e-3, f"speculative samples with the bonus draw do not follow the target (p={pvalue:.2g})"
    assert sum(int(n.item()) for n in accepted) > 0.2 * SAMPLES, "the bonus path was rarely taken: the test would not see it"
    monkeypatch.setattr(loop, "accept", wrong_bonus_accept)
    try:  # caught either way: a token the filters exclude at that position, or the wrong distribution
        # (a quarter of the samples: excluded tokens came up for seeds 0, 3 and 5 alike)
        counts = sampled_joint(target, draft, sampler, seed=3, blocks=lambda: 2, samples=SAMPLES // 4)
        pvalue = goodness_of_fit(counts, exact_joint(target, sampler))
    except AssertionError:
        pvalue = 0.0
    assert pvalue < 1e-4, f"a bonus drawn from the wrong row is not caught (p={pvalue:.2g})"


def test_target_only_sampling_follows_its_distribution(small_pair):
    """The baseline samples from the same filtered distribution (sanity of the reference)."""
    target, _ = small_pair
    sampler = SAMPLERS[1]
    mx.random.seed(1)
    p1 = np.array(sampler.probs(target(PROMPT[None])[0, -1]))
    counts = np.zeros(V)
    for _ in range(SAMPLES):
        counts[next(loop.target_only(target, PROMPT, sampler, max_tokens=1)).tokens[0]] += 1
    assert goodness_of_fit(counts, p1) > 1e-3


def test_filters_keep_what_they_promise():
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.array(Sampler(1.0, top_k=2).probs(logits)).round(4).tolist() == [[0.625, 0.375, 0.0, 0.0]]
    assert (np.array(Sampler(1.0, top_p=0.7).probs(logits)) > 0).tolist() == [[True, True, False, False]]
    assert (np.array(Sampler(1.0, top_p=0.85).probs(logits)) > 0).tolist() == [[True, True, True, False]]
    assert (np.array(Sampler(1.0, min_p=0.2).probs(logits)) > 0).tolist() == [[True, True, True, False]]
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=1)):
        with pytest.raises(ValueError):
            Sampler(**bad)
