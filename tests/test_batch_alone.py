"""Every request through the scheduler is bit for bit the request alone: tokens and log-probs,
whatever its batch-mates do (arrive, leave by cancel, stop string, end of turn or max_tokens,
sample with seeds, hit the row limit) and whatever the prefix-cache pool holds.

The oracle is the same request alone: a scheduler of one, with no prefix cache, under the same
batch rules. Both rules run here: the CPU's (one row a sequence, one draft call for all) and a
GPU's (16 rows a pass, two rows a sequence at least, a draft call per sequence), so that the path
a Mac takes runs here too. The pair is the shipped demo (a trained draft: acceptance varies from
cycle to cycle, so rows leave their passes at every count).
"""

from __future__ import annotations

import itertools
import random
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import pytest

from dflash_mlx.api import load
from dflash_mlx.prompt_cache import PromptCachePool
from dflash_mlx.scheduler import BatchRequest, Scheduler

RULES = {"cpu rules": dict(row_limit=64, min_rows=1, shared_calls=True),
         "gpu rules": dict(row_limit=16, min_rows=2, shared_calls=False)}
by_rules = pytest.mark.parametrize("rules", list(RULES.values()), ids=list(RULES))
SOURCE = Path(textwrap.__file__).read_text()  # real code that does not change with ours


@pytest.fixture(scope="module")
def demo():
    return load("demo")


def chat(i: int, length: int) -> List[Dict[str, str]]:
    """A request to repeat a slice of real code (the demo draft accepts much of it, not all)."""
    start = (i * 977) % (len(SOURCE) - length)
    return [{"role": "user", "content": f"Repeat this code exactly:\n```python\n{SOURCE[start:start + length]}\n```"}]


def run(model, tokenizer, specs, arrivals, rules, pool: Optional[PromptCachePool] = None, max_active: int = 4):
    """Requests through one scheduler, request i submitted at round ``arrivals[i]`` (a spec's
    ``cancel_after``: cancelled once it has that many tokens): each one's (token, log-probs) pairs."""
    scheduler = Scheduler(model, tokenizer, max_active, prompt_cache=pool, **rules)
    got: List[list] = [[] for _ in specs]
    flags = [False] * len(specs)
    requests = []
    for i, spec in enumerate(specs):
        spec = dict(spec)
        cancel_after = spec.pop("cancel_after", None)

        def emit(response, i=i, n=cancel_after):
            got[i].append((response.token, response.logprobs))
            if n is not None and len(got[i]) >= n:
                flags[i] = True

        requests.append(BatchRequest(emit=emit, cancelled=lambda i=i: flags[i], **spec))
    for round_ in itertools.count():
        for i, r in enumerate(requests):
            if arrivals[i] == round_:
                scheduler.submit(r)
        if round_ >= max(arrivals) and scheduler.idle:
            break
        scheduler.step()
    assert [r.error for r in requests] == [None] * len(requests)
    assert all(r.done for r in requests)
    if pool is not None:
        assert not pool.busy  # every history went back
    return got


_ALONE: Dict[str, list] = {}


def alone(model, tokenizer, spec, rules):
    """The request alone (memoized: the tests ask for the same requests under several mates)."""
    spec = {k: v for k, v in spec.items() if k != "cancel_after"}
    key = repr((sorted(spec.items()), sorted(rules.items())))
    if key not in _ALONE:
        _ALONE[key] = run(model, tokenizer, [spec], [0], rules, max_active=1)[0]
    return _ALONE[key]


def assert_same(got, want, what):
    """Tokens equal and log-probs equal bit for bit."""
    assert [t for t, _ in got] == [t for t, _ in want], what
    for n, ((_, a), (_, b)) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), f"{what}: log-probs differ at token {n}"


def check(model, tokenizer, specs, arrivals, rules, pool=None, max_active=4):
    together = run(model, tokenizer, specs, arrivals, rules, pool, max_active)
    for i, spec in enumerate(specs):
        want = alone(model, tokenizer, spec, rules)
        if spec.get("cancel_after") is not None:  # cancelled: a prefix of its answer alone
            assert len(together[i]) >= min(spec["cancel_after"], len(want)), i
            want = want[: len(together[i])]
        assert_same(together[i], want, f"request {i} of {specs}")
    return together


@pytest.fixture(scope="module")
def long_answers(demo):
    """Four requests whose answers run to max_tokens, and their texts alone (a stop string's source)."""
    model, tokenizer = demo
    specs = [dict(prompt=chat(i, 160), max_tokens=28, block_tokens=4) for i in range(4)]
    texts = []
    for spec in specs:
        out = run(model, tokenizer, [spec], [0], RULES["cpu rules"], max_active=1)[0]
        assert len(out) == 28
        texts.append(tokenizer.decode([t for t, _ in out]))
    return specs, texts


@by_rules
@pytest.mark.parametrize("kind", ["cancel", "stop", "max_tokens"])
@pytest.mark.parametrize("position", range(4))
def test_a_request_leaving_from_any_row_leaves_its_batch_mates_as_alone(demo, long_answers, rules, kind, position):
    """Four requests decode together; the one in row ``position`` leaves early (while its next
    cycle is in flight, as the scheduler always has one): the others are each exactly what they
    are alone, and so is it up to where it left."""
    model, tokenizer = demo
    specs, texts = long_answers
    specs = [dict(s) for s in specs]
    leaving = specs[position]
    if kind == "cancel":
        leaving["cancel_after"] = 6
    elif kind == "stop":
        leaving["stop"] = [texts[position][12:16]]
    else:
        leaving["max_tokens"] = 9
    check(model, tokenizer, specs, [0, 0, 0, 0], rules)


@by_rules
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_random_traffic_each_request_as_alone(demo, rules, seed):
    """Random arrivals, prompt lengths, blocks (fixed, auto, plain), greedy and seeded sampling,
    cancels, stop strings and lengths, eight requests through six slots (more rows than a GPU's
    pass takes: blocks are cut), on a pool that is empty, warmed by related prompts, or absent."""
    model, tokenizer = demo
    rng = random.Random(seed)
    specs = []
    for i in range(8):
        spec = dict(prompt=chat(rng.randrange(50), rng.choice([40, 150, 400, 900])), max_tokens=rng.randrange(4, 40),
                    block_tokens=rng.choice([1, 2, 3, 4, "auto"]))
        if rng.random() < 0.4:
            spec.update(temp=0.8, top_p=0.95, seed=rng.randrange(1000), block_tokens=rng.choice([2, 3, 4]))
        leave = rng.choice(["none", "none", "cancel", "stop"])
        if leave == "cancel":
            spec["cancel_after"] = rng.randrange(1, 8)
        elif leave == "stop":
            text = tokenizer.decode([t for t, _ in alone(model, tokenizer, spec, rules)])
            if len(text) > 12:
                start = rng.randrange(len(text) - 4)
                spec["stop"] = [text[start:start + 3]]
        specs.append(spec)
    arrivals = [rng.randrange(6) for _ in specs]
    pool_state = ["none", "empty", "warm"][seed % 3]
    pool = None if pool_state == "none" else PromptCachePool(1 << 30)
    if pool_state == "warm":  # histories that share prefixes with these prompts, some mid-way
        warmers = [dict(s, max_tokens=3, stop=None, cancel_after=None) for s in specs[:3]]
        for w in warmers:
            w["prompt"] = [dict(m, content=m["content"][: len(m["content"]) * 2 // 3]) for m in w["prompt"]]
        run(model, tokenizer, [{k: v for k, v in w.items() if k != "cancel_after"} for w in warmers], [0, 0, 1],
            rules, pool)
    check(model, tokenizer, specs, arrivals, rules, pool, max_active=6)


@by_rules
def test_seeded_requests_past_the_row_limit_each_as_alone(demo, rules):
    """Eight seeded sampled requests at block 4 beside two greedy ones: more rows than a pass takes
    (a GPU's 16; the CPU's 64 with the two at block 16... the demo drafts 4, so the CPU's limit is cut
    here to 24). A sampled cycle's draws depend on its block, so a seeded request's block is never
    cut: requests that do not fit sit the cycle out instead, and each answer is its answer alone."""
    model, tokenizer = demo
    rules = dict(rules, row_limit=min(rules["row_limit"], 24))
    specs = [dict(prompt=chat(i, 200), max_tokens=24, block_tokens=4, temp=0.9, seed=100 + i) for i in range(8)]
    specs += [dict(prompt=chat(20 + i, 200), max_tokens=24, block_tokens=4) for i in range(2)]
    check(model, tokenizer, specs, [0] * 8 + [1, 2], rules, max_active=8)


def test_each_sequence_attends_over_its_own_rows(demo):
    """A pass carries every sequence at its longest block; the shorter ones' padding rows go
    through the matmuls but never into their attention: each attention cache grows by the
    sequence's own rows (its block, or two on a GPU), the call that computes its attention has its
    own query count (a Mac picks the attention kernel by it), and the rollback trims exactly that."""
    from dflash_mlx.block_policy import FixedBlock
    from dflash_mlx.cache import GatedDeltaCache
    from dflash_mlx.decoder import Decoder
    from dflash_mlx.sampling import Sampler

    model, tokenizer = demo
    decoder = Decoder(model.target, model.draft, row_limit=16, min_rows=2, shared_calls=False)
    seqs = []
    for i, block in enumerate([4, 1, 2, 3]):
        start = decoder.start(mx.array(tokenizer.encode(SOURCE[i * 300:i * 300 + 400])), Sampler(), FixedBlock(block))
        while True:
            try:
                next(start)
            except StopIteration as done:
                seqs.append(done.value[0])
                break
    layer = next(i for i, c in enumerate(seqs[0].cache) if not isinstance(c, GatedDeltaCache))
    before = [s.cache[layer].offset for s in seqs]
    cycle = decoder.dispatch(seqs)
    assert cycle.rows == 4 and cycle.own == [4, 2, 2, 3]
    assert [s.cache[layer].offset - b for s, b in zip(seqs, before)] == [4, 2, 2, 3]
    commits = decoder.resolve(cycle)
    assert [s.cache[layer].offset - b for s, b in zip(seqs, before)] == [len(c.tokens) for c in commits]


def test_stream_generate_is_the_computation_a_batch_runs(demo):
    """``stream_generate`` runs its request through the driver as a batch of one: its tokens and
    log-probs are, bit for bit, what the same request gets among batch-mates in the server's
    scheduler (greedy at fixed and auto blocks, seeded sampling), and a stream closed early
    leaves the pool's history holding exactly the tokens it was handed."""
    from dflash_mlx.api import stream_generate

    model, tokenizer = demo
    specs = [dict(prompt=chat(3, 150), max_tokens=20, block_tokens=4),
             dict(prompt=chat(9, 400), max_tokens=16, block_tokens="auto"),
             dict(prompt=chat(17, 150), max_tokens=18, block_tokens=3, temp=0.8, top_p=0.95, seed=5)]
    together = run(model, tokenizer, specs, [0, 0, 1], RULES["cpu rules"])
    for spec, want in zip(specs, together):
        options = {k: v for k, v in spec.items() if k != "prompt"}
        got = [(r.token, r.logprobs) for r in stream_generate(model, tokenizer, spec["prompt"], **options)]
        assert_same(got, want, f"stream_generate {spec}")
    pool = PromptCachePool(1 << 30)
    stream = stream_generate(model, tokenizer, specs[0]["prompt"], max_tokens=20, block_tokens=4, prompt_cache=pool)
    handed = [next(stream).token for _ in range(7)]
    stream.close()  # a cycle is in flight: it is dropped, the caches put back
    (history,) = pool.histories
    assert not pool.busy and history.tokens[-6:] == handed[:6]  # the 7th is the next cycle's input
    assert all(c.offset == len(history.tokens) for c in history.cache)
