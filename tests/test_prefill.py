"""Prefill: the head on the last position only, attention in bounded row blocks on the CPU (the
same numbers as the whole chunk's), and memory that the chunk bounds, not the prompt."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.cache import cache_arrays
from dflash_mlx.models import layers  # the cached attention every target family shares
from dflash_mlx.prefill import default_prefill_step, prefill


def prompt(n: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 500, n).astype(np.int32))


def test_row_blocks_are_the_whole_chunk(target, monkeypatch):
    """A prefill whose attention goes in 16-row blocks gives the logits and caches of one that
    runs every chunk whole through one attention call, to the bit."""
    tokens = prompt(300)

    def run():
        cache = target.make_cache()
        return prefill(target, tokens, cache, 128), cache_arrays(cache)

    monkeypatch.setattr(layers, "SCORE_ELEMENTS", 1)  # the fewest rows a block
    assert layers.attention_rows(target.args.num_attention_heads, 128, 300) == layers.SCORE_ROWS_ALIGN
    blocks, block_caches = run()
    monkeypatch.setattr(layers, "attention_rows", lambda *_: None)
    whole, whole_caches = run()
    assert mx.array_equal(blocks, whole).item()
    assert len(block_caches) == len(whole_caches)
    assert all(mx.array_equal(a, b).item() for a, b in zip(block_caches, whole_caches))


def test_head_runs_on_the_last_position_only(target, monkeypatch):
    """Prefill asks the vocabulary head for one position (the last of the prompt), whatever the
    chunks; its logits are the whole forward's at that position."""
    tokens = prompt(200, seed=1)
    whole = target.forward(tokens[None])[0][0, -1]
    rows = []
    head = type(target).head
    monkeypatch.setattr(type(target), "head", lambda self, h: rows.append(h.shape[1]) or head(self, h))
    logits = prefill(target, tokens, target.make_cache(), 64, taps=(1, 2), on_features=lambda f: [f])
    assert rows and set(rows) == {1}, f"the head saw {rows} positions per chunk"
    np.testing.assert_allclose(np.array(logits), np.array(whole), atol=1e-5, rtol=0)
    last, _ = target.forward(tokens[None], last_only=True)
    assert last.shape == (1, 1, target.args.vocab_size) and mx.array_equal(last[0, -1], whole).item()


def test_the_last_token_goes_alone(target, monkeypatch):
    """As in mlx-lm, the chunks before the last token only fill the caches (what feeds nothing but
    the head is never computed for them) and the last token runs alone; split points still split."""
    calls = []
    forward = type(target).forward
    monkeypatch.setattr(type(target), "forward", lambda self, x, *a, **k: calls.append(x.shape[1]) or forward(self, x, *a, **k))
    prefill(target, prompt(300, seed=2), target.make_cache(), 128, split_at=[192])
    assert calls == [128, 64, 64, 43, 1]  # ends 128, 192 (the split), 256, 299, 300
    calls.clear()
    prefill(target, prompt(1), target.make_cache(), 128)
    assert calls == [1]


def _transient(target, n: int, step: int) -> tuple:
    """Peak memory above what the weights and the caches hold after a prefill of ``n`` tokens,
    and what the caches hold beyond their arrays' own bytes (a slice keeping a buffer alive)."""
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = target.make_cache()
    prefill(target, prompt(n, seed=n), cache, step)
    mx.clear_cache()
    held = mx.get_active_memory() - base
    return mx.get_peak_memory() - base - held, held - sum(a.nbytes for a in cache_arrays(cache))


def test_prefill_memory_is_bounded_by_the_chunk(target, monkeypatch):
    """The working memory of a prefill (its peak above the caches it leaves) does not grow with
    the prompt: 4096 tokens need no more than 1024 in chunks of 512; and the caches hold nothing
    but their own arrays (no chunk's buffer kept alive by a slice)."""
    monkeypatch.setattr(layers, "SCORE_ELEMENTS", 1 << 18)
    short, short_extra = _transient(target, 1024, 512)
    long, long_extra = _transient(target, 4096, 512)
    assert long < 1.25 * short + (256 << 10), (short, long)
    assert short_extra < (64 << 10) and long_extra < (64 << 10), (short_extra, long_extra)


def test_prefill_step_follows_the_backend(monkeypatch):
    """A GPU takes mlx-lm's 2048; the CPU the chunk measured there (docs/benchmarks.md)."""
    from dflash_mlx import prefill as chunks

    assert default_prefill_step() == (chunks.PREFILL_STEP_CPU if mx.default_device() == mx.cpu
                                      else chunks.PREFILL_STEP_GPU)
    assert chunks.PREFILL_STEP_GPU == 2048


def test_a_windowed_draft_is_fed_only_the_features_it_keeps(target, draft, monkeypatch):
    """With a draft that keeps the last W tokens' context, the prompt's chunks before its last W
    positions run without taps (the layers after the last tap are never computed for them), the
    draft's cache ends with the same last W rows as when fed every position, and the output is the
    target's."""
    from dflash_mlx import decoder
    from dflash_mlx import speculative as loop
    from tests.reference import target_only
    from dflash_mlx.sampling import Sampler

    tokens, window = prompt(300, seed=3), 40

    def run(skip: bool):
        calls, cache = [], draft.make_cache(window)
        forward = type(target).forward
        monkeypatch.setattr(type(target), "forward", lambda self, x, c=None, taps=(), *a, **k:
                            calls.append((x.shape[1], bool(taps))) or forward(self, x, c, taps, *a, **k))
        if not skip:
            monkeypatch.setattr(decoder, "features_from", lambda *_: 0)
        first = next(loop.speculative(target, draft, tokens, Sampler(), 4, prefill_step_size=128, draft_cache=cache))
        monkeypatch.undo()
        return calls, cache, first.tokens

    calls, cache, first = run(skip=True)
    # The window's 40 positions start at 260: features from the grid position before it, 256.
    assert calls[:3] == [(128, False), (128, False), (43, True)] and calls[3] == (1, True), calls
    _, full, first_full = run(skip=False)
    assert first == first_full and cache[0].offset == full[0].offset == 300
    for c, f in zip(cache, full):
        used, used_full = c.offset - c.start, f.offset - f.start
        assert window <= used < window + 64 and used <= used_full  # the window, from the grid before it
        np.testing.assert_allclose(np.array(c.keys[..., used - window : used, :]),
                                   np.array(f.keys[..., used_full - window : used_full, :]), atol=1e-5, rtol=0)
    alone = [c.tokens[0] for c in target_only(target, tokens, Sampler(), max_tokens=12)]
    windowed = [t for c in loop.speculative(target, draft, tokens, Sampler(), 4, draft_window=window, max_tokens=12)
                for t in c.tokens]
    assert windowed[:12] == alone


def test_the_draft_cache_grows_once_for_a_prompt(target, draft):
    """The decoder reserves room for the prompt's features before its prefill: the draft's context
    cache is allocated once, not reallocated (old, new and a copy alive) every chunk."""
    from dflash_mlx.block_policy import FixedBlock
    from dflash_mlx.decoder import Decoder
    from dflash_mlx.sampling import Sampler

    cache, capacities = draft.make_cache(), []
    for _ in Decoder(target, draft).start(prompt(600, seed=4), Sampler(), FixedBlock(4), draft_cache=cache,
                                          prefill_step_size=128):  # one chunk a step
        capacities.append(cache[0].keys.shape[2])
    assert len(capacities) == 6 and set(capacities) == {768}, capacities  # 600 + a block, in steps of 256


def test_chunk_sizes_that_keep_the_recurrences_chunks_give_the_same_bits(target, draft):
    """On the CPU a prompt prefilled in chunks of 512, 256 or 128 tokens (multiples of the
    recurrence's 64-token chunk) leaves the target's and the draft's caches and the first token
    exactly as 2048 does (the scheduler prefills in 512-token chunks, the single stream in 2048);
    a boundary at 100 moves the recurrence's chunk boundaries and changes the bits (why a chunk of
    100, or a boundary off the grid, is refused)."""
    from dflash_mlx.decoder import Decoder
    from dflash_mlx.sampling import Sampler

    prompt = mx.array(np.random.default_rng(3).integers(0, 200, 700))

    def prefilled(step):
        start = Decoder(target, draft).start(prompt, Sampler(), prefill_step_size=step, max_tokens=4)
        while True:
            try:
                next(start)
            except StopIteration as done:
                seq, commit = done.value
                return cache_arrays(seq.cache) + cache_arrays(seq.draft_cache), commit.tokens

    want, first = prefilled(2048)
    for step in (512, 256, 128):
        got, token = prefilled(step)
        assert token == first and all(mx.array_equal(a, b).item() for a, b in zip(got, want)), step
    with pytest.raises(ValueError, match="prefill_step_size must be a positive multiple of 64.*got 100"):
        prefilled(100)
    with pytest.raises(ValueError, match=r"prefill boundaries \[100\] \(after 0 cached tokens\) are off the 64-token grid"):
        prefill(target, prompt, target.make_cache(), 128, split_at=[100])
    split, whole = target.make_cache(), target.make_cache()  # what such a boundary would do
    target.forward(prompt[None, :100], split)
    target.forward(prompt[None, 100:], split)
    target.forward(prompt[None], whole)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(cache_arrays(split), cache_arrays(whole)))
