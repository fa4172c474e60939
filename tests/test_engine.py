"""The server's engine in process: cancellation reaches the prefill, caches are kept per client."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from dflash_mlx import tiny
from dflash_mlx.api import load
from dflash_mlx.server import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    target, draft = tiny.write_pair(tmp_path_factory.mktemp("engine"))
    model, tokenizer = load(str(target), draft=str(draft))
    return Engine(model, tokenizer, "tiny", max_tokens_cap=64)


async def _events(engine, prompt, cancel_when=None, **options):
    job = engine.submit(prompt, {"max_tokens": 8, "temp": 0.0, **options})
    if cancel_when is not None:
        def watch():
            while not cancel_when():
                time.sleep(0.001)
            job.cancelled.set()
        threading.Thread(target=watch, daemon=True).start()
    events = []
    while not events or events[-1][0] != "done":
        events.append(await job.queue.get())
    return [kind for kind, _ in events]


def test_a_cancel_during_a_long_prefill_stops_it_between_chunks(engine):
    prompt = np.random.default_rng(0).integers(0, 500, 3000).tolist()
    pool = engine.prompt_caches
    before = engine.metrics.cancelled

    def prefill_started():
        return bool(pool.histories) and len(pool.histories[-1].tokens) > 0

    kinds = asyncio.run(_events(engine, prompt, cancel_when=prefill_started))
    assert kinds == ["done"] and engine.metrics.cancelled == before + 1  # no token: it never finished the prompt
    fed = len(pool.histories[-1].tokens)
    assert 0 < fed <= 2 * 512 < len(prompt)  # stopped within a chunk of the cancel
    # The engine is free, and the next request for that prompt goes on from where it stopped.
    kinds = asyncio.run(_events(engine, prompt, max_tokens=2))
    assert kinds.count("token") == 2 and engine.metrics.totals.cached_prompt_tokens >= fed
