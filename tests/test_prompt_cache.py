"""PromptCache: later prompts that share a prefix reuse the caches, and the output does not change:
a request resumed from a checkpoint gives the tokens and log-probs, bit for bit, of the same request
prefilled from scratch (checkpoints lie on the recurrence's 64-token grid, ``prefill.GRID``)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import stream_generate, tiny
from dflash_mlx.api import load
from dflash_mlx.prompt_cache import PromptCache, PromptCachePool, spread
from tests.test_lossless import assert_lossless


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = tiny.write_pair(tmp_path_factory.mktemp("pc"))
    return load(str(target_dir), draft=str(draft_dir))


def run(model, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=kwargs.pop("max_tokens", 20), **kwargs))
    return [r.token for r in responses], responses[-1]


def same_bits(model, tokenizer, prompt, **kwargs):
    """Run ``prompt`` with ``kwargs`` (on a prompt cache) and from scratch: the tokens of the first,
    its last response, and whether both runs gave the same tokens and log-probs bit for bit."""
    warm = list(stream_generate(model, tokenizer, prompt, max_tokens=kwargs.pop("max_tokens", 20), **kwargs))
    kwargs.pop("prompt_cache")
    cold = list(stream_generate(model, tokenizer, prompt, max_tokens=len(warm), **kwargs))
    same = [r.token for r in warm] == [r.token for r in cold] and all(
        mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(warm, cold))
    return [r.token for r in warm], warm[-1], same


def ids(seed, n):
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


@pytest.mark.parametrize("use_draft", [True, False], ids=["speculative", "target-only"])
def test_next_turn_resumes_from_the_previous_prompts_last_checkpoint(pair, use_draft):
    """The next turn goes on from the last grid checkpoint of the previous prompt (960 of 1000
    tokens, pinned: the evenly spaced ones stop at 896): the answer's states came from decode
    cycles, which round otherwise than a prefill of the same tokens, so they are prefilled again;
    the turn is then bit for bit the turn from scratch."""
    model, tokenizer = pair
    cache = PromptCache()
    turn1 = ids(1, 1000)
    out1, last1 = run(model, tokenizer, turn1, prompt_cache=cache, use_draft=use_draft, block_tokens=4 if use_draft else None)
    assert last1.cached_prompt_tokens == 0
    turn2 = turn1 + out1 + ids(2, 7)
    _, last2, same = same_bits(model, tokenizer, turn2, prompt_cache=cache, use_draft=use_draft,
                               block_tokens=4 if use_draft else None)
    assert last2.cached_prompt_tokens == 960 and same


def test_the_next_turn_after_a_length_stop_lines_up_the_drafts_context(pair):
    """Speculative, with a draft that is always right (blocks of 4): an answer cut by
    ``max_tokens`` = 11 = 1 + 4 + 4 + 2 ends inside what a full cycle would accept. The next turn
    resumes from the prompt's last grid checkpoint, and the draft's context lines up with the
    target's (every drafted token accepted)."""
    from dflash_mlx.api import DFlashModel
    from tests.test_lossless import OracleDraft

    model, tokenizer = pair
    cache, turn1 = PromptCache(), ids(21, 100)
    alone1, _ = run(model, tokenizer, turn1, use_draft=False, max_tokens=16)
    oracle = OracleDraft(turn1 + alone1, 4, schedule=[3])  # 3: no slot corrupted
    spec = DFlashModel(model.target, oracle)
    out1, last1 = run(spec, tokenizer, turn1, prompt_cache=cache, max_tokens=11, block_tokens=4)
    assert out1 == alone1[:11] and last1.finish_reason == "length"
    assert (last1.cycles, last1.accepted_tokens, last1.drafted_tokens) == (3, 7, 7)  # blocks 4, 4, 2
    turn2 = turn1 + out1 + ids(22, 7)
    alone2, _ = run(model, tokenizer, turn2, use_draft=False, max_tokens=11)
    oracle.sequence = turn2 + alone2  # the same draft object: the history belongs to this pair
    oracle.position = 64  # it keeps no cache to rewind: where the history resumes (its last grid checkpoint)
    out2, last2 = run(spec, tokenizer, turn2, prompt_cache=cache, max_tokens=11, block_tokens=4)
    assert last2.cached_prompt_tokens == 64
    assert out2 == alone2 and last2.accepted_tokens == 7  # the draft's context lines up with the target's


def test_shared_context_restarts_from_a_checkpoint(pair):
    """Editors resend a long file with a different question: reuse up to the last checkpoint."""
    model, tokenizer = pair
    cache = PromptCache()
    context = ids(3, 1000)
    run(model, tokenizer, context + ids(4, 5), prompt_cache=cache, prefill_step_size=128)
    # 1005 tokens, 8 checkpoints: every ceil(1005 / 8) = 126 tokens rounded up to the grid, 128,
    # before the last token and on the grid before that.
    assert set(cache.checkpoints) == {128, 256, 384, 512, 640, 768, 896, 960, 1004}
    question = context + ids(5, 9)
    _, last, same = same_bits(model, tokenizer, question, prompt_cache=cache, prefill_step_size=128)
    assert last.cached_prompt_tokens == 960 and same  # the last checkpoint inside the 1000 shared tokens


def test_an_interrupted_generation_leaves_a_usable_cache(pair):
    model, tokenizer = pair
    cache = PromptCache()
    prompt = ids(6, 90)
    stream = stream_generate(model, tokenizer, prompt, max_tokens=50, prompt_cache=cache, block_tokens=8)
    for _ in range(5):
        next(stream)
    stream.close()  # e.g. Ctrl-C or a dropped client
    _, last, same = same_bits(model, tokenizer, prompt, prompt_cache=cache, block_tokens=8)
    assert last.cached_prompt_tokens == len(prompt) - 1 and same  # a resend: the checkpoint before its last token
    _, last, same = same_bits(model, tokenizer, prompt + ids(7, 4), prompt_cache=cache, block_tokens=8)
    assert last.cached_prompt_tokens == 64 and same  # a longer prompt: the grid checkpoint


def test_a_different_prompt_or_model_starts_over(pair):
    model, tokenizer = pair
    cache = PromptCache()
    run(model, tokenizer, ids(8, 20), prompt_cache=cache)
    _, last = run(model, tokenizer, ids(9, 20), prompt_cache=cache)
    assert last.cached_prompt_tokens == 0
    _, last = run(model, tokenizer, ids(9, 20) + [1, 2], prompt_cache=cache, use_draft=False)
    assert last.cached_prompt_tokens == 0  # the cache was the speculative pair's, with a draft cache


@pytest.mark.slow  # prefills prompts up to 8192 tokens
@pytest.mark.parametrize("length", [2048, 8192])
def test_an_edit_anywhere_reuses_all_but_at_most_l_over_c_tokens(pair, length):
    """The editor case: one token changed at 90%, 50% and 10% of a long prompt (in that order, so
    that one prefill serves the three: each edit keeps the checkpoints before it)."""
    model, tokenizer = pair
    prompt, cache = ids(10, length), PromptCache()
    run(model, tokenizer, prompt, prompt_cache=cache, max_tokens=1, use_draft=False)
    assert len(cache.checkpoints) <= cache.evenly_spaced + len(cache.pinned)
    for share in (0.9, 0.5, 0.1):
        edit = int(share * length)
        edited = prompt[:edit] + [(prompt[edit] + 1) % 500] + prompt[edit + 1 :]
        if share == 0.9:  # end to end: the request reports what it reused
            _, last = run(model, tokenizer, edited, prompt_cache=cache, max_tokens=1, use_draft=False)
            reused = last.cached_prompt_tokens
        else:
            reused = cache.prepare(model.target, None, edited)
        assert edit - length / cache.evenly_spaced <= reused <= edit, share


def test_checkpoints_are_thinned_to_the_smallest_largest_gap():
    # Candidates every 100 tokens up to 1600 and at 1550 (fixed), room for 5: gaps of at most 350
    # (300, 600, 900, 1200, 1550).
    chosen = spread([*range(100, 1700, 100), 1550], {1550}, 1700, 5)
    assert len(chosen) <= 5 and 1550 in chosen
    edges = [0, *sorted(chosen), 1700]
    assert max(b - a for a, b in zip(edges, edges[1:])) <= 350
    assert spread([10, 20], set(), 30, 5) == {10, 20}  # within budget: all kept


def test_a_growing_history_keeps_its_checkpoints_within_budget(pair):
    """Chat turns add checkpoints every time; the history thins them and stays lossless."""
    model, tokenizer = pair
    cache, prompt = PromptCache(checkpoints=4), ids(11, 40)
    for turn in range(4):
        out, last = run(model, tokenizer, prompt, prompt_cache=cache, max_tokens=6, block_tokens=4)
        assert len(cache.checkpoints) <= cache.evenly_spaced + len(cache.pinned), turn
        fresh, _ = run(model, tokenizer, prompt, max_tokens=6, block_tokens=4)
        assert out == fresh, turn
        prompt = prompt + out + ids(20 + turn, 30)
    edges = [0, *sorted(cache.checkpoints), len(cache.tokens)]
    assert max(b - a for a, b in zip(edges, edges[1:])) < len(cache.tokens) / 2


def test_two_alternating_clients_both_reuse_their_caches(pair):
    model, tokenizer = pair
    pool = PromptCachePool(budget_bytes=1 << 30)
    chat, editor = ids(12, 200), ids(13, 230)
    for round in range(3):
        for name in ("chat", "editor"):
            prompt = chat if name == "chat" else editor
            out, last, same = same_bits(model, tokenizer, prompt, prompt_cache=pool, max_tokens=5, block_tokens=4)
            if round:  # all but the answer and what is new, and at most a grid's width before them
                assert last.cached_prompt_tokens >= len(prompt) - 64 - 5 - 20, (round, name)
            assert same
            grown = prompt + out + ids(30 + round, 20)
            chat, editor = (grown, editor) if name == "chat" else (chat, grown)
    assert len(pool.histories) == 2


def test_a_prompt_sharing_only_a_system_prompt_forks_the_history(pair):
    model, tokenizer = pair
    pool = PromptCachePool(budget_bytes=1 << 30)
    system = ids(14, 130)
    first = system + ids(15, 200)
    run(model, tokenizer, first, prompt_cache=pool, max_tokens=3, block_tokens=4)
    second = system + ids(16, 64)
    _, last, same = same_bits(model, tokenizer, second, prompt_cache=pool, max_tokens=3, block_tokens=4)
    assert last.cached_prompt_tokens == 128 and len(pool.histories) == 2 and same
    _, again = run(model, tokenizer, first, prompt_cache=pool, max_tokens=3, block_tokens=4)
    assert again.cached_prompt_tokens == len(first) - 1  # the first history survived the fork


def test_resending_a_forked_prompt_always_reuses_all_but_its_last_token(pair):
    """A fork keeps its parent's checkpoints inside the shared prefix, so the forked prompt's
    history can hold one more than its budget; the point a resend restarts from must survive the
    thinning (it did not: the third send restarted 22 tokens early, in CI's server test)."""
    model, tokenizer = pair
    pool = PromptCachePool(budget_bytes=1 << 30)
    system = ids(17, 70)
    run(model, tokenizer, system + ids(18, 100), prompt_cache=pool, max_tokens=3, block_tokens=4)
    forked = system + ids(19, 1000)  # forks at the parent's checkpoint 64, then one every 192 and at 1069
    for send in range(4):
        out, last = run(model, tokenizer, forked, prompt_cache=pool, max_tokens=3, block_tokens=4)
        assert last.cached_prompt_tokens == (len(forked) - 1 if send else 64), send
    assert len(pool.histories) == 2
    fresh, _ = run(model, tokenizer, forked, max_tokens=3, block_tokens=4)
    assert out == fresh


def test_the_pool_evicts_least_recently_used_histories_over_budget(pair):
    model, tokenizer = pair
    pool = PromptCachePool(budget_bytes=1 << 30)
    prompts = [ids(40 + i, 50) for i in range(3)]
    for p in prompts:
        run(model, tokenizer, p, prompt_cache=pool, max_tokens=2, block_tokens=4)
    assert len(pool.histories) == 3
    one = pool.histories[-1].nbytes
    assert one > 0 and pool.nbytes >= 2 * one
    pool.budget_bytes = int(2.5 * one)
    run(model, tokenizer, prompts[0] + [1, 2, 3], prompt_cache=pool, max_tokens=2, block_tokens=4)  # prompts[0]: most recent
    assert pool.nbytes <= pool.budget_bytes and len(pool.histories) == 2
    assert pool.histories[-1].tokens[: len(prompts[0])] == prompts[0]
    assert pool.histories[0].tokens[:50] == prompts[2]  # prompts[1] was the least recently used


def test_a_cancelled_prefill_stops_between_chunks_and_leaves_a_usable_cache(pair):
    model, tokenizer = pair
    cache, prompt, chunks = PromptCache(), ids(17, 300), []

    def cancel_after_two():  # polled before every round: before the first chunk, then after each
        chunks.append(len(cache.tokens))
        return len(chunks) >= 3

    out = list(stream_generate(model, tokenizer, prompt, max_tokens=4, prompt_cache=cache, prefill_step_size=64,
                               cancelled=cancel_after_two, block_tokens=4))
    assert out == [] and len(cache.tokens) == chunks[-1] == 128  # stopped after the second chunk
    _, last, same = same_bits(model, tokenizer, prompt, prompt_cache=cache, max_tokens=6, block_tokens=4)
    assert last.cached_prompt_tokens == 128 and same  # the next request goes on from there


def test_an_interrupt_between_verify_and_rollback_falls_back_to_a_checkpoint(pair, monkeypatch):
    """Ctrl-C inside a cycle leaves the live caches ahead of the recorded tokens: the next request
    must not trust them, and stays lossless."""
    import dflash_mlx.decoder as speculative_module  # where the cycle rolls back

    model, tokenizer = pair
    cache, prompt = PromptCache(), ids(18, 100)
    calls = []
    real_rollback = speculative_module.rollback_batch

    def interrupted_rollback(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_rollback(*args, **kwargs)

    monkeypatch.setattr(speculative_module, "rollback_batch", interrupted_rollback)
    with pytest.raises(KeyboardInterrupt):
        run(model, tokenizer, prompt, prompt_cache=cache, max_tokens=40, block_tokens=8)
    monkeypatch.setattr(speculative_module, "rollback_batch", real_rollback)
    assert cache.cache[0].offset != len(cache.tokens)  # the verify pass was fed, never rolled back
    follow_up = cache.tokens + ids(19, 5)
    _, last, same = same_bits(model, tokenizer, follow_up, prompt_cache=cache, max_tokens=8, block_tokens=8)
    assert last.cached_prompt_tokens == 64 and same  # the checkpoint, not the live state


@pytest.mark.parametrize("use_draft", [True, False], ids=["speculative", "target-only"])
def test_a_history_serves_the_next_turn_on_another_thread(pair, use_draft):
    """A web app answers from a thread pool: each turn may run on another thread. MLX runs an
    operation only on a stream of the thread that made it (the CPU side streams are per thread),
    so a history left holding unevaluated work failed the next turn elsewhere ("There is no
    Stream(cpu, 1) in current thread"); a finished generation leaves its history evaluated."""
    import threading

    model, tokenizer = pair
    kwargs = dict(use_draft=use_draft, block_tokens=4 if use_draft else None)
    for cache in (PromptCache(), PromptCachePool(1 << 30)):
        turn1 = ids(31, 100)
        got = {}

        def first_turn():
            got["out"], got["last"] = run(model, tokenizer, turn1, prompt_cache=cache, **kwargs)

        worker = threading.Thread(target=first_turn)
        worker.start()
        worker.join()
        turn2 = turn1 + got["out"] + ids(32, 9)
        out2, last2 = run(model, tokenizer, turn2, prompt_cache=cache, **kwargs)
        assert last2.cached_prompt_tokens == 64
        fresh, _ = run(model, tokenizer, turn2, **kwargs)
        assert fresh == out2


def test_a_batched_history_serves_the_next_turn_on_another_thread(pair):
    """The same through the scheduler (the server's engine): a request that leaves settles its
    history before the pool takes it back."""
    import threading

    from dflash_mlx.scheduler import BatchRequest, Scheduler

    model, tokenizer = pair
    pool, turn1, got = PromptCachePool(1 << 30), ids(41, 100), {}

    def answer(prompt):
        responses = []
        scheduler = Scheduler(model, tokenizer, 2, pool)
        request = BatchRequest(prompt, responses.append, max_tokens=20, block_tokens=4)
        scheduler.submit(request)
        while not scheduler.idle:
            scheduler.step()
        assert request.error is None, request.error
        return [r.token for r in responses], responses[-1]

    worker = threading.Thread(target=lambda: got.update(out=answer(turn1)[0]))
    worker.start()
    worker.join()
    turn2 = turn1 + got["out"] + ids(42, 9)
    out2, last2 = answer(turn2)
    assert last2.cached_prompt_tokens == 64
    assert out2 == run(model, tokenizer, turn2, block_tokens=4)[0]


def test_a_short_prompt_resent_after_a_long_answer_keeps_one_history(pair):
    """An answer longer than its prompt: the resend shares the whole prompt but under half of the
    history, and was forked every time (one more history a send, until the budget evicted)."""
    model, tokenizer = pair
    pool, prompt = PromptCachePool(budget_bytes=1 << 30), ids(50, 12)
    for send in range(3):
        out, last = run(model, tokenizer, prompt, prompt_cache=pool, max_tokens=40, block_tokens=4)
        assert len(out) > 2 * len(prompt) and last.cached_prompt_tokens == (len(prompt) - 1 if send else 0)
    assert len(pool.histories) == 1


@pytest.mark.parametrize("temp, shared", [(0.0, 1500), pytest.param(0.8, 2000, marks=pytest.mark.slow)],
                         ids=["greedy, rows dropped", "seeded, window short"])
def test_a_windowed_draft_that_moved_on_keeps_the_targets_checkpoints(temp, shared):
    """The demo draft keeps a window of 1024 tokens. A history that went on past what the next
    prompt shares has dropped rows that prompt's window needs (all of them before the shared end,
    or, with 2,000 shared, the window's first 900: a rewind would succeed and leave the draft a
    short window): the draft's cache alone
    starts over (filled by the prefill from where a cold one would feed it), the target goes on
    from its last checkpoint before that window, and the answer is the cold answer bit for bit
    (sampled with a seed too: the draft's context decides which tokens are proposed). Before, the
    whole history was thrown away (an agent resuming a session reused 0 of 32k tokens)."""
    model, tokenizer = load("demo")
    source = (Path(__file__).parent.parent / "dflash_mlx" / "prompt_cache.py").read_text()
    text = tokenizer.encode(source)
    assert len(text) > 3000
    cache = PromptCache()
    run(model, tokenizer, text[:3000], prompt_cache=cache, max_tokens=4, block_tokens=4)
    assert 1500 < cache.draft_cache[0].start <= 2000 - 64  # the window has moved on
    prompt = text[:shared] + tokenizer.encode("\n# done\n")
    _, last, same = same_bits(model, tokenizer, prompt, prompt_cache=cache, max_tokens=24, block_tokens=4, temp=temp,
                              seed=7)
    window_start = (len(prompt) - 1024) // 64 * 64
    assert 0 < last.cached_prompt_tokens <= window_start and same
