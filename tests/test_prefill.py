"""Prefill: the head on the last position only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dflash_mlx.speculative import prefill


def prompt(n: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 500, n).astype(np.int32))


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
