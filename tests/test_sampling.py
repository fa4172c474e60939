"""Sampled speculative decoding follows the target's own distribution (and a biased rule is caught).

The expected distributions come from mlx-lm's own sampler (``mlx_lm_probs``), never from the
``Sampler`` under test."""

from __future__ import annotations

import inspect
import itertools
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from dflash_mlx import sampling
from dflash_mlx import decoder
from dflash_mlx import speculative as loop
from tests.reference import target_only
from dflash_mlx.driver import Driver, Request
from dflash_mlx.loading import load_target
from dflash_mlx.prompt_cache import PromptCache
from dflash_mlx.sampling import Sampler, make_sampler
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


def resend(target, draft=None, prompt=PROMPT):
    """Caches for one sample, at each call: forks of a prompt cache that prefilled ``prompt`` once
    (the draft's context too, ``draft`` given), holding all of it but its last token. A sample from
    them feeds ``prompt[-1:]``: the server's resend of a cached prompt, bit for bit the request from
    scratch (whose prefill feeds the last token alone too; ``test_a_resent_prompt_samples_what_a_fresh_one_does``),
    without the prefill of the rest, which the sampled tests would run thousands of times."""
    history = PromptCache()
    driver = Driver(target, draft)
    driver.submit(Request(prompt, lambda commit: True, Sampler().for_request(0), max_tokens=1,
                          block_tokens=getattr(draft, "block_size", 1), use_draft=draft is not None, history=history))
    driver.run()
    assert history.restart_point(prompt.size - 1, prompt.size) == prompt.size - 1, sorted(history.checkpoints)

    def caches():
        fork = history.fork(prompt.size - 1, prompt.size)
        return fork.cache, fork.draft_cache

    return caches


@contextmanager
def _captured_draw():
    """mlx-lm's sampler with its final draw replaced by a record of what it would draw from."""
    from mlx_lm import sample_utils

    seen, real = {}, sample_utils.categorical_sampling

    def record(logits, temp):
        seen["logits"], seen["temp"] = logits, temp
        return mx.zeros(logits.shape[:-1], dtype=mx.uint32)

    sample_utils.categorical_sampling = record
    try:
        yield seen
    finally:
        sample_utils.categorical_sampling = real


def mlx_lm_probs(logits, **arguments) -> np.ndarray:
    """The distribution mlx-lm's ``make_sampler(**arguments)`` draws from for ``logits`` [..., V]:
    its own filter chain on the log-probs its ``generate_step`` passes (float32 here), and the
    ``categorical_sampling`` it ends with (``categorical(logits * (1 / temp))``) read as a softmax."""
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    x = mx.array(logits).astype(mx.float32)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    with _captured_draw() as seen:
        mlx_lm_make_sampler(**arguments)(logprobs)
    return np.array(mx.softmax(seen["logits"] * (1.0 / seen["temp"]), axis=-1), dtype=np.float64)


def reference_probs(sampler: Sampler, logits) -> np.ndarray:
    """mlx-lm's distribution for a sampler's settings (written out here, not taken from ``sampling``)."""
    return mlx_lm_probs(logits, temp=sampler.temperature, top_p=sampler.top_p, min_p=sampler.min_p,
                        min_tokens_to_keep=sampler.min_tokens_to_keep, top_k=sampler.top_k)


def exact_joint(target, sampler):
    """P(t2, t3) under target-only sampling: the target samples t1, then t2, t3."""
    p1 = reference_probs(sampler, target(PROMPT[None])[0, -1])
    seqs = np.array([[*PROMPT.tolist(), a] for a in range(V)])
    p2 = reference_probs(sampler, target(mx.array(seqs))[:, -1])  # [t1, t2]
    seqs3 = np.array([[*PROMPT.tolist(), a, b] for a in range(V) for b in range(V)])
    p3 = reference_probs(sampler, target(mx.array(seqs3))[:, -1]).reshape(V, V, V)  # [t1, t2, t3]
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def sampled_joint(target, draft, sampler, seed, blocks=lambda: 4, samples=SAMPLES):
    """``blocks()`` gives each sample's block setting: a size or a fresh chooser. Path tests (another
    dtype, another backend, another target) take fewer samples than the rule's own tests. The
    samples draw from one generator seeded with ``seed``; each is one request, resending PROMPT
    (``resend``)."""
    sampler = sampler.for_request(seed)
    caches = resend(target, draft)
    counts = np.zeros((V, V))
    for _ in range(samples):
        tokens = []
        # Cycles are capped at what max_tokens leaves: 1 + the block keeps the first cycle whole (at 3
        # a block of 4 would run as 2, and the rule past the second slot, the biased rule's negative
        # control with it, would go untested); 5 lets scripted sizes up to 4 follow a plain step.
        # No more: the loops dispatch one step ahead, and a cycle past the third token is wasted.
        setting = blocks()
        max_tokens = 1 + setting if isinstance(setting, int) else 5
        cache, draft_cache = caches()
        for commit in loop.speculative(target, draft, PROMPT[-1:], sampler, block_tokens=setting, max_tokens=max_tokens,
                                       cache=cache, draft_cache=draft_cache):
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


@pytest.mark.slow  # chi-square over thousands of sampled runs
@pytest.mark.parametrize("sampler", SAMPLERS, ids=["plain", "filtered"])
def test_speculative_samples_follow_the_target_distribution(small_pair, sampler):
    target, draft = small_pair
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=0), exact_joint(target, sampler))
    assert pvalue > 1e-3, f"speculative samples do not follow the target (chi-square p={pvalue:.2g})"


@pytest.mark.slow  # chi-square over thousands of sampled runs
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


@pytest.mark.slow  # chi-square over thousands of sampled runs
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
    accepted = mx.cumprod((mx.random.uniform(shape=(n,), key=sampler.key()) * q_d < p_d).astype(mx.int32)).sum()
    return accepted, sampling.categorical(p, sampler.key())[accepted]


@pytest.mark.slow  # chi-square over thousands of sampled runs
def test_negative_control_biased_rule_is_detected(small_pair, monkeypatch):
    target, draft = small_pair
    sampler = SAMPLERS[0]
    monkeypatch.setattr(decoder, "accept", biased_accept)
    # Half the samples: p = 3e-17 and 4e-7 for seeds 0 and 3 (before the last cycles were capped at
    # what max_tokens leaves: 3e-7, 1e-10 and 9e-15 for seeds 0, 3 and 5; at a quarter: 2e-4 for seed 5).
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=0, samples=SAMPLES // 2), exact_joint(target, sampler))
    assert pvalue < 1e-4, f"the test cannot tell a biased acceptance rule apart (p={pvalue:.2g})"


def wrong_bonus_accept(target_logits, drafted, draft_probs, sampler):
    """Another bug: when every draft is accepted, draw the bonus from the last draft's row."""
    n = drafted.shape[0]
    p = sampler.probs(target_logits)
    accepted, token = sampling.accept(target_logits, drafted, draft_probs, sampler)
    bonus = sampling.categorical(p[n - 1 : n], sampler.key())[0]
    return accepted, mx.where(accepted == n, bonus, token)


@pytest.mark.slow  # chi-square over thousands of sampled runs
def test_the_all_accepted_bonus_draw_follows_the_target(small_pair, monkeypatch):
    """Block 2: token 3 is the bonus draw whenever token 2 (the one draft) is accepted, so the
    joint covers that path too; drawing the bonus from the wrong row is caught."""
    target, draft = small_pair
    sampler = SAMPLERS[1]
    accepted = []
    real_accept = decoder.accept

    def counting(*args):
        n, token = real_accept(*args)
        accepted.append(n)
        return n, token

    monkeypatch.setattr(decoder, "accept", counting)
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=3, blocks=lambda: 2), exact_joint(target, sampler))
    assert pvalue > 1e-3, f"speculative samples with the bonus draw do not follow the target (p={pvalue:.2g})"
    assert sum(int(n.item()) for n in accepted) > 0.2 * SAMPLES, "the bonus path was rarely taken: the test would not see it"
    monkeypatch.setattr(decoder, "accept", wrong_bonus_accept)
    try:  # caught either way: a token the filters exclude at that position, or the wrong distribution
        # (a quarter of the samples: excluded tokens came up for seeds 0, 3 and 5 alike)
        counts = sampled_joint(target, draft, sampler, seed=3, blocks=lambda: 2, samples=SAMPLES // 4)
        pvalue = goodness_of_fit(counts, exact_joint(target, sampler))
    except AssertionError:
        pvalue = 0.0
    assert pvalue < 1e-4, f"a bonus drawn from the wrong row is not caught (p={pvalue:.2g})"


@pytest.mark.slow  # a statistical sampling run
@pytest.mark.parametrize("loop", ["the package's plain decoding", "the tests' reference"])
def test_plain_sampling_follows_its_distribution(small_pair, loop):
    """Plain decoding (the driver with no draft) and the tests' reference loop sample from the same
    filtered distribution."""
    from dflash_mlx.speculative import speculative

    target, _ = small_pair
    sampler = SAMPLERS[1].for_request(1)
    p1 = reference_probs(sampler, target(PROMPT[None])[0, -1])
    caches = resend(target)
    counts = np.zeros(V)
    for _ in range(SAMPLES):
        cache, _ = caches()
        steps = (speculative(target, None, PROMPT[-1:], sampler, cache=cache, max_tokens=1) if loop.startswith("the package")
                 else target_only(target, PROMPT[-1:], sampler, cache=cache, max_tokens=1))
        counts[next(steps).tokens[0]] += 1
    assert goodness_of_fit(counts, p1) > 1e-3


def test_filters_keep_what_they_promise():
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.array(Sampler(1.0, top_k=2).probs(logits)).round(4).tolist() == [[0.625, 0.375, 0.0, 0.0]]
    assert (np.array(Sampler(1.0, top_p=0.7).probs(logits)) > 0).tolist() == [[True, True, False, False]]
    assert (np.array(Sampler(1.0, top_p=0.85).probs(logits)) > 0).tolist() == [[True, True, True, False]]
    assert (np.array(Sampler(1.0, min_p=0.2).probs(logits)) > 0).tolist() == [[True, True, True, False]]
    for off in (dict(top_p=0.0), dict(top_p=1.0), dict(top_k=0), dict(top_k=4), dict(min_p=0.0)):  # mlx-lm's "off"
        np.testing.assert_allclose(np.array(Sampler(1.0, **off).probs(logits)), [[0.5, 0.3, 0.15, 0.05]], atol=1e-6)
    # The filters see the untempered distribution; the temperature comes last: at 3.0 top-p 0.7
    # still keeps two tokens (tempered, 0.5 and 0.3 become 0.34 and 0.28: it would keep three).
    kept = np.array([0.5, 0.3]) ** (1 / 3)
    np.testing.assert_allclose(np.array(Sampler(3.0, top_p=0.7).probs(logits)), [[*kept / kept.sum(), 0, 0]], atol=1e-6)
    # mlx-lm's order: top-p first (0.5 + 0.3 needed for 0.6), then top-k 2 keeps both; top-k first would
    # leave 0.5/0.8 and 0.3/0.8 and top-p 0.6 then keeps only the first.
    assert (np.array(Sampler(1.0, top_p=0.6, top_k=2).probs(logits)) > 0).tolist() == [[True, True, False, False]]
    # min_tokens_to_keep survives min-p: 0.05 < 0.5 * 0.5 drops two, but three must stay.
    assert (np.array(Sampler(1.0, min_p=0.5, min_tokens_to_keep=3).probs(logits)) > 0).tolist() == [[True, True, True, False]]
    for bad, named in ((dict(temperature=-1), "temperature must be >= 0 .*got -1"), (dict(top_p=1.5), "top_p .*got 1.5"),
                       (dict(top_p=-0.1), "top_p .*got -0.1"), (dict(top_k=-1), "top_k .*got -1"),
                       (dict(top_k=2.5), "top_k .*got 2.5"), (dict(min_p=1.2), "min_p .*got 1.2"),
                       (dict(min_tokens_to_keep=0), "min_tokens_to_keep .*got 0")):
        with pytest.raises(ValueError, match=named):
            Sampler(**bad)
    with pytest.raises(TypeError):
        Sampler(1.0, 0.9)  # only the temperature goes by position


def test_make_sampler_has_mlx_lms_signature():
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    theirs = [(p.name, p.default) for p in inspect.signature(mlx_lm_make_sampler).parameters.values()]
    ours = [(p.name, p.default) for p in inspect.signature(make_sampler).parameters.values()]
    assert ours == theirs
    assert make_sampler(0.7, 0.9, 0.05, 2, 5) == Sampler(0.7, top_p=0.9, min_p=0.05, min_tokens_to_keep=2, top_k=5)
    assert make_sampler() == Sampler() and make_sampler().greedy
    with pytest.raises(ValueError, match="XTC"):
        make_sampler(0.7, xtc_probability=0.5)


def _logit_rows():
    """A spread row, ties (top-k's and min_tokens_to_keep's boundaries fall inside them), a peaked
    row and a flat one, over 64 tokens."""
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(64) * 2.5
    ties = np.repeat([3.0, 2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -4.0], 8)[rng.permutation(64)]
    peaked = rng.standard_normal(64)
    peaked[5] = 9.0
    return np.stack([spread, ties, peaked, np.zeros(64)]).astype(np.float32)


FILTERS = [dict(), dict(top_k=3), dict(top_k=20), dict(top_p=0.8), dict(top_p=0.95), dict(min_p=0.1),
           dict(top_k=5, top_p=0.7), dict(top_k=10, top_p=0.6), dict(top_p=0.9, min_p=0.05),
           dict(top_k=12, top_p=0.9, min_p=0.05), dict(min_p=0.3, min_tokens_to_keep=4),
           dict(top_k=3, min_p=0.5, min_tokens_to_keep=5), dict(top_k=12, top_p=0.8, min_p=0.2, min_tokens_to_keep=10)]


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_probs_are_the_distribution_mlx_lms_sampler_draws_from(temperature):
    """``Sampler.probs`` against mlx-lm's own ``make_sampler`` chain, at several temperatures and
    filter combinations. Tokens with equal logits may trade places (which of the tied tokens a
    partition keeps is arbitrary in both), so each group of equal logits is compared as a multiset."""
    rows = _logit_rows()
    for filters in FILTERS:
        ours = np.array(Sampler(temperature, **filters).probs(mx.array(rows)), dtype=np.float64)
        theirs = mlx_lm_probs(rows, temp=temperature, **filters)
        for row, mine, want in zip(rows, ours, theirs):
            for value in np.unique(row):
                tied = row == value
                np.testing.assert_allclose(np.sort(mine[tied]), np.sort(want[tied]), atol=2e-6, rtol=1e-5,
                                           err_msg=f"temperature {temperature}, {filters}, logit {value}")
        assert np.allclose(ours.sum(axis=-1), 1.0, atol=1e-5)


class NearDraft:
    """A draft that proposes each slot from ``q = 0.75 p + 0.25 uniform``, ``p`` the target's
    reference distribution given everything before the slot (its own earlier proposals included):
    blocks of 4 are often accepted whole (the bonus drawn after 3 drafts) and rejected at every
    slot, also for tokens the filters exclude (``q`` puts mass on them, ``p`` none). ``tree`` maps
    the tokens generated so far (a tuple) to ``p`` for the next one; deeper slots draw uniformly.
    Draws take the request's keys; the tokens are followed through ``add_context`` as the loop
    commits them (the features of ``t_last`` and the accepted proposals)."""

    mask_token_id = V - 1
    target_layer_ids = [0]
    block_size = 4

    def __init__(self, tree):
        self.tree = tree

    def make_cache(self, window=None):
        self.generated, self.block = [], None
        return []

    def add_context(self, features, cache):
        if self.block is not None:  # after prefill: a cycle's committed prefix
            self.generated += self.block[: features.shape[1]]

    def propose(self, block, cache, sampler):
        context, rows = self.generated + [int(block[0].item())], []
        for _ in range(block.size - 1):
            p = self.tree.get(tuple(context))
            q = np.full(V, 1.0 / V) if p is None else 0.75 * p + 0.25 / V
            rows.append(q)
            context.append(int(sampling.categorical(mx.array(q[None], dtype=mx.float32), sampler.key())[0].item()))
        self.block = context[len(self.generated):]
        return mx.array(self.block[1:], dtype=mx.int32), mx.array(np.stack(rows), dtype=mx.float32)


@pytest.fixture(scope="module")
def markov_target(tmp_path_factory):
    """The small target with every sublayer's output projection zeroed: its state at a token is that
    token's embedding, so its next-token distribution depends on the last token alone (a bigram
    model, as tests/scripted.py builds) and the reference for every history is one row."""
    from safetensors.numpy import load_file, save_file

    path = make_hf_target(tmp_path_factory.mktemp("markov_target"), vocab_size=V, seed=11)
    weights = load_file(str(path / "model.safetensors"))
    for name in weights:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return load_target(path)[0]


def reference_tree(target, sampler, depth):
    """A bigram target's reference distribution of each generated token t_0..t_depth given the ones
    before it, {(t_0, .., t_{d-1}): p(t_d)}: the row of the last token (the prompt's for t_0)."""
    rows = reference_probs(sampler, target(mx.arange(V)[:, None])[:, -1])
    start = reference_probs(sampler, target(PROMPT[None])[0, -1])
    np.testing.assert_allclose(start, rows[int(PROMPT[-1].item())], atol=1e-5)  # it is a bigram model
    return {tail: rows[tail[-1]] if tail else start for d in range(depth + 1) for tail in itertools.product(range(V), repeat=d)}


def tree_joint(tree, positions, depth):
    """P(t_i, t_j) for ``positions`` (i, j) from the reference tree of the first ``depth + 1`` tokens."""
    joint = np.zeros((V, V))
    for tokens in itertools.product(range(V), repeat=depth + 1):
        p = 1.0
        for d in range(depth + 1):
            p *= tree[tokens[:d]][tokens[d]]
            if p == 0:
                break
        joint[tokens[positions[0]], tokens[positions[1]]] += p
    return joint


@pytest.mark.slow  # chi-square over thousands of sampled runs
def test_deep_blocks_follow_the_target(markov_target):
    """Slots 2 and 3 of a block and the bonus after 3 accepted drafts: with a draft close to the
    target, the first cycle (tokens t_1..t_4) is often accepted whole and rejected at every slot.
    The joints of (t_2, t_3) (slots 2 and 3) and (t_3, t_4) (slot 3 and the bonus) are mlx-lm's."""
    target = markov_target
    sampler = SAMPLERS[1].for_request(7)
    tree = reference_tree(target, sampler, depth=4)
    draft = NearDraft(tree)
    slots, bonus, accepted = np.zeros((V, V)), np.zeros((V, V)), []
    samples = SAMPLES
    caches = resend(target, draft)
    for _ in range(samples):
        tokens, commits = [], []
        cache, _ = caches()  # the draft starts each sample over: its cache is its own
        for commit in loop.speculative(target, draft, PROMPT[-1:], sampler, block_tokens=4, max_tokens=5, cache=cache,
                                       draft_cache=draft.make_cache()):
            commits.append(commit)
            tokens.extend(commit.tokens)
            if len(tokens) >= 5:
                break
        accepted.append(commits[1].accepted)  # commits[0] is t_0, from the prefill
        slots[tokens[2], tokens[3]] += 1
        bonus[tokens[3], tokens[4]] += 1
    accepted = np.bincount(accepted, minlength=4)
    assert accepted[3] > 0.25 * samples, f"the bonus after 3 drafts is rare ({accepted}): the test would not see it"
    assert min(accepted[:3]) > 0.05 * samples, f"some slot is rarely rejected ({accepted})"
    for name, counts, positions in (("slots 2 and 3", slots, (2, 3)), ("slot 3 and the bonus", bonus, (3, 4))):
        pvalue = goodness_of_fit(counts, tree_joint(tree, positions, 4))
        assert pvalue > 1e-3, f"{name}: speculative samples do not follow the target (chi-square p={pvalue:.2g})"


def test_requests_draw_from_their_own_generator(small_pair):
    """A request neither uses nor advances MLX's global generator, and a seeded one gives the same
    tokens whatever ran before it (an unseeded request, other global draws)."""
    target, draft = small_pair

    def run(seed, use_draft=True):
        sampler = SAMPLERS[0].for_request(seed)
        steps = (loop.speculative(target, draft, PROMPT, sampler, block_tokens=4, max_tokens=16) if use_draft
                 else loop.speculative(target, None, PROMPT, sampler, max_tokens=16))
        return [t for commit in steps for t in commit.tokens]

    mx.random.seed(0)
    following = mx.random.uniform(shape=(4,)).tolist()  # the global generator's next draws
    mx.random.seed(0)
    first, alone = run(5), run(5, use_draft=False)
    assert mx.random.uniform(shape=(4,)).tolist() == following, "a request drew from the global generator"
    run(None)
    mx.random.seed(123)
    mx.random.uniform()
    assert run(5) == first and run(5, use_draft=False) == alone
    assert len({tuple(run(seed)) for seed in (6, 7, 8)} | {tuple(first)}) > 1


def test_a_resent_prompt_samples_what_a_fresh_one_does(small_pair):
    """The sampled tests start every sample from ``resend``'s caches: each sample is, bit for bit
    (tokens, log-probs, drafts accepted), the request from scratch drawing from a generator seeded
    alike: with the draft (a fixed block, blocks changing every cycle), without it, and through the
    tests' reference loop."""
    from tests.test_lossless import ScriptedBlock

    target, draft = small_pair
    script = [(1, 2), (3, 0), (4, 0), (2, 0)]
    paths = {"block 4": (draft, lambda: 4), "changing blocks": (draft, lambda: ScriptedBlock(script)),
             "plain": (None, lambda: None), "reference": (None, None)}
    seen = set()
    for name, (used, blocks) in paths.items():
        caches = resend(target, used)
        fresh, resent = SAMPLERS[1].for_request(9), SAMPLERS[1].for_request(9)
        for _ in range(5):
            cache, draft_cache = caches()
            if blocks is None:
                runs = [target_only(target, PROMPT, fresh, max_tokens=8),
                        target_only(target, PROMPT[-1:], resent, cache=cache, max_tokens=8)]
            else:
                runs = [loop.speculative(target, used, PROMPT, fresh, block_tokens=blocks(), max_tokens=8),
                        loop.speculative(target, used, PROMPT[-1:], resent, block_tokens=blocks(), max_tokens=8,
                                         cache=cache, draft_cache=draft_cache)]
            want, got = ([(c.tokens, np.array(c.logprobs), c.drafted, c.accepted) for c in run] for run in runs)
            assert [w[0] for w in want] == [g[0] for g in got], name
            for w, g in zip(want, got):
                assert w[2:] == g[2:] and np.array_equal(w[1], g[1]), f"{name}: {w[0]} {w[2:]} vs {g[0]} {g[2:]}"
            seen.add(tuple(t for w in want for t in w[0]))
    assert len(seen) > 1, "every sample came out the same: the comparison would not see a difference"
