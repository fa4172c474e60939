"""PromptCache: later prompts that share a prefix reuse the caches, and the output does not change."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import stream_generate, tiny
from dflash_mlx.api import load
from dflash_mlx.prompt_cache import PromptCache
from tests.test_lossless import assert_lossless


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = tiny.write_pair(tmp_path_factory.mktemp("pc"))
    return load(str(target_dir), draft=str(draft_dir))


def run(model, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=kwargs.pop("max_tokens", 20), **kwargs))
    return [r.token for r in responses], responses[-1]


def ids(seed, n):
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


@pytest.mark.parametrize("use_draft", [True, False], ids=["speculative", "target-only"])
def test_next_turn_prefills_only_what_is_new(pair, use_draft):
    model, tokenizer = pair
    cache = PromptCache()
    turn1 = ids(1, 30)
    out1, last1 = run(model, tokenizer, turn1, prompt_cache=cache, use_draft=use_draft, block_tokens=4 if use_draft else None)
    assert last1.cached_prompt_tokens == 0
    turn2 = turn1 + out1 + ids(2, 7)
    out2, last2 = run(model, tokenizer, turn2, prompt_cache=cache, use_draft=use_draft, block_tokens=4 if use_draft else None)
    # Everything but the last answer token (never fed to the target) came from the cache.
    assert last2.cached_prompt_tokens == len(turn1) + len(out1) - 1
    fresh, _ = run(model, tokenizer, turn2, use_draft=use_draft, block_tokens=4 if use_draft else None)
    assert_lossless(model.target, mx.array(turn2), fresh, out2)


def test_shared_context_restarts_from_a_checkpoint(pair):
    """Editors resend a long file with a different question: reuse up to the last checkpoint."""
    model, tokenizer = pair
    cache = PromptCache()
    context = ids(3, 40)
    run(model, tokenizer, context + ids(4, 5), prompt_cache=cache, prefill_step_size=16)
    # 45 tokens, 8 checkpoints: every ceil(45 / 8) = 6 tokens, and before the last token.
    assert set(cache.checkpoints) == {6, 12, 18, 24, 30, 36, 42, 44}
    question = context + ids(5, 9)
    out, last = run(model, tokenizer, question, prompt_cache=cache, prefill_step_size=16)
    assert last.cached_prompt_tokens == 36  # the last checkpoint inside the 40 shared tokens
    fresh, _ = run(model, tokenizer, question)
    assert_lossless(model.target, mx.array(question), fresh, out)


def test_an_interrupted_generation_leaves_a_usable_cache(pair):
    model, tokenizer = pair
    cache = PromptCache()
    prompt = ids(6, 25)
    stream = stream_generate(model, tokenizer, prompt, max_tokens=50, prompt_cache=cache, block_tokens=8)
    for _ in range(5):
        next(stream)
    stream.close()  # e.g. Ctrl-C or a dropped client
    follow_up = prompt + ids(7, 4)
    out, last = run(model, tokenizer, follow_up, prompt_cache=cache, block_tokens=8)
    assert last.cached_prompt_tokens == len(prompt) - 1  # the checkpoint before the prompt's last token
    fresh, _ = run(model, tokenizer, follow_up, block_tokens=8)
    assert_lossless(model.target, mx.array(follow_up), fresh, out)


def test_a_different_prompt_or_model_starts_over(pair):
    model, tokenizer = pair
    cache = PromptCache()
    run(model, tokenizer, ids(8, 20), prompt_cache=cache)
    _, last = run(model, tokenizer, ids(9, 20), prompt_cache=cache)
    assert last.cached_prompt_tokens == 0
    _, last = run(model, tokenizer, ids(9, 20) + [1, 2], prompt_cache=cache, use_draft=False)
    assert last.cached_prompt_tokens == 0  # the cache was the speculative pair's, with a draft cache
