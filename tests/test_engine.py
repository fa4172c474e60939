"""The server's engine in process: cancellation reaches the prefill, caches are kept per client."""

from __future__ import annotations

import asyncio
import threading

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


class CancelWhen(threading.Event):
    """A job's cancel flag that turns itself on when it is polled once ``condition()`` holds: the
    cancel lands at a known point of the work, in the worker's own thread, whatever the
    machine's speed (a watcher thread polling every millisecond raced a 512-token chunk)."""

    def __init__(self, condition):
        super().__init__()
        self.condition = condition

    def is_set(self) -> bool:
        if not super().is_set() and self.condition():
            self.set()
        return super().is_set()


async def _events(engine, prompt, **options):
    job = engine.submit(prompt, {"max_tokens": 8, "temp": 0.0, **options})
    events = []
    while not events or events[-1][0] != "done":
        events.append(await job.queue.get())
    return [kind for kind, _ in events]


def test_a_cancel_during_a_long_prefill_stops_it_between_chunks(engine, monkeypatch):
    """The client leaves once the first prefill chunk is in: the prefill stops there (the engine
    polls the job's flag between chunks), not after the whole 3000-token prompt."""
    from dflash_mlx.server import engine as engine_module

    prompt = np.random.default_rng(0).integers(0, 500, 3000).tolist()
    pool = engine.prompt_caches
    before = engine.metrics.cancelled

    def prefill_started():
        history = pool.histories[-1] if pool.histories else None
        return history is not None and 0 < len(history.tokens) and history.tokens == prompt[:len(history.tokens)]

    real_job = engine_module.Job
    monkeypatch.setattr(engine_module, "Job", lambda *args, **kwargs: real_job(*args, cancelled=CancelWhen(prefill_started), **kwargs))
    kinds = asyncio.run(_events(engine, prompt))
    monkeypatch.setattr(engine_module, "Job", real_job)
    assert kinds == ["done"] and engine.metrics.cancelled == before + 1  # no token: it never finished the prompt
    fed = len(pool.histories[-1].tokens)
    assert 0 < fed <= 512 < len(prompt), fed  # stopped at the first chunk's end
    # The engine is free, and the next request for that prompt goes on from where it stopped.
    kinds = asyncio.run(_events(engine, prompt, max_tokens=2))
    assert kinds.count("token") == 2 and engine.metrics.totals.cached_prompt_tokens >= fed


def test_the_worker_starts_once_every_field_exists(engine, monkeypatch):
    """The worker thread uses the engine's queue, caches, jobs and metrics: it starts last."""
    fields_at_start = []

    class Recording(threading.Thread):
        def start(self):
            fields_at_start.append(set(vars(self._target.__self__)))
            super().start()

    monkeypatch.setattr(threading, "Thread", Recording)
    made = Engine(engine.model, engine.tokenizer, "tiny")
    assert fields_at_start == [set(vars(made))]


def _response(text: str, n: int, finish=None):
    from dflash_mlx.api import GenerationResponse

    return GenerationResponse(text=text, token=n, logprobs=None, from_draft=False, prompt_tokens=3, prompt_tps=0.0,
                              generation_tokens=n, generation_tps=0.0, peak_memory=0.0, finish_reason=finish)


def test_the_tokens_of_one_cycle_wake_the_loop_once_and_reach_the_client_as_one_event(monkeypatch):
    """A cycle's tokens, emitted together by the worker, are handed to the event loop in one call
    and come out of ``job_events`` as one ``token`` event: their texts joined in order, the last
    one's statistics. A ``done`` after them is kept, and a token emitted later is its own event."""
    from dflash_mlx.server.engine import Job, job_events

    async def scenario():
        loop = asyncio.get_running_loop()
        handovers = []
        real = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *args: (handovers.append(args), real(*args))[1])
        job = Job([1, 2, 3], {}, asyncio.Queue(), loop)
        events = job_events(job)
        for i, text in enumerate(["def", " f", "(x", "):"]):  # one cycle's commit, before the loop runs
            job.emit("token", _response(text, i + 1))
        first = await events.__anext__()
        job.emit("token", _response("\n", 5, finish="stop"))
        job.emit("done")
        rest = [event async for event in events]
        return handovers, [first, *rest]

    handovers, events = asyncio.run(scenario())
    assert len(handovers) == 2  # the first cycle's four tokens in one hand-over, then the last token and done
    assert [kind for kind, _ in events] == ["token", "token", "done"]
    (_, joined), (_, last) = events[0], events[1]
    assert (joined.text, joined.generation_tokens) == ("def f(x):", 4)
    assert (last.text, last.generation_tokens, last.finish_reason) == ("\n", 5, "stop")


def test_a_job_the_worker_cannot_schedule_fails_alone_and_the_worker_serves_on(engine):
    """A job whose options the scheduler cannot take (a bug in a route, say) is answered with an
    error, and the worker goes on: the next request is served (before, the worker's thread died
    and every later request waited for ever)."""
    before = engine.metrics.errors
    bounded = lambda events: asyncio.run(asyncio.wait_for(events, 60))  # a dead worker answers nothing
    assert bounded(_events(engine, [5, 6, 7], no_such_option=1)) == ["error", "done"]
    assert engine.metrics.errors == before + 1 and not engine.jobs
    assert bounded(_events(engine, [5, 6, 7])).count("token") == 8


def test_one_engine_whatever_the_concurrency(engine):
    """``--max-concurrent 1`` runs its requests through the same scheduler as 4 (one at a time):
    a request is the same computation whatever the server's concurrency."""
    one = Engine(engine.model, engine.tokenizer, "tiny", max_tokens_cap=64, max_concurrent=1)
    assert one.scheduler is not None and one.scheduler.max_active == 1
    assert engine.scheduler is not None and engine.scheduler.max_active == 4
