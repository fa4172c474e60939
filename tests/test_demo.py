"""The demo pair shipped in the package: it loads offline, stays small, the target copies, and
the draft's acceptance on a fixed prompt stays above a floor measured once (so that a broken
loader, kernel or draft is caught, not only a wrong output)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from dflash_mlx import load, stream_generate
from dflash_mlx.bench import _EDIT_SOURCE, SUITES
from dflash_mlx.defaults import DEMO_DIR
from tests.test_lossless import assert_lossless


@pytest.fixture(scope="module")
def demo():
    return load("demo")


def test_the_demo_pair_is_a_small_qwen3_5_with_a_dflash_draft(demo):
    model, tokenizer = demo
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert total <= 25 * 2**20, f"demo pair is {total / 2**20:.1f} MB"
    kinds = {"linear" if layer.is_linear else "full" for layer in model.target.layers}
    assert kinds == {"linear", "full"}
    assert model.draft is not None and model.draft.block_size == 4
    build = json.loads((DEMO_DIR / "build.json").read_text())
    assert build["target"]["steps"] > 0 and build["draft"]["steps"] > 0
    assert f"{build['target']['params']:,} parameters" in (DEMO_DIR / "README.md").read_text()


def test_the_demo_target_copies_the_edit_file_and_speculation_is_lossless(demo):
    model, tokenizer = demo
    prompt = [{"role": "user", "content": SUITES["edit"][0]}]
    baseline = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=160, use_draft=False)]
    text = tokenizer.decode(baseline)
    head = "\n".join(_EDIT_SOURCE.splitlines()[:10])
    assert head in text, text  # a broken loader or damaged weights do not copy ten lines verbatim
    drafted = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=160, block_tokens=4)]
    assert_lossless(model.target, mx.array(tokenizer.apply_chat_template(prompt, add_generation_prompt=True)), baseline, drafted)


# Measured with the shipped (bfloat16) pair (greedy, edit prompt 0, 160 tokens, block 4): 3.3125
# tokens per cycle (159 tokens after the prompt's in 48 cycles, 111 of 142 drafted tokens accepted;
# the last cycle drafts 1, what max_tokens leaves). Greedy at a fixed block, the figure is exact for
# a given build: the floor is just under it, so that one cycle more fails (159 / 49 = 3.245). A draft
# that does not draft gives about 1.0.
TOKENS_PER_CYCLE_MEASURED = 3.3125
TOKENS_PER_CYCLE_FLOOR = 3.3
# Auto's choices follow measured cycle times: with real times the same run gave 2.0-3.3 tokens per
# cycle on this 2-core machine (blocks 2 and 3 when a neighbour's load made drafting look dear).
# So the test hands the controller modelled times instead (``cycle_cost``, in decode steps: a verify
# cycle of 4 costs 2.7, as measured here, DESIGN.md §7) and its choices become exact too: 3.245
# tokens per cycle (159 in 49 cycles: blocks 4: 41, 3: 6, 2: 2); the floor fails at 50 cycles.
AUTO_TOKENS_PER_CYCLE_MEASURED = 3.245
AUTO_TOKENS_PER_CYCLE_FLOOR = 3.2


def cycle_cost(block: int) -> float:
    """Seconds (in decode steps) a cycle of ``block`` costs on this CPU: a draft pass of 0.7, a
    third of a step per verified draft row."""
    return 1.0 if block == 1 else 1.7 + (block - 1) / 3


def tokens_per_cycle(model, tokenizer, block_tokens) -> float:
    prompt = [{"role": "user", "content": SUITES["edit"][0]}]
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=160, block_tokens=block_tokens):
        pass
    assert last.generation_tokens == 160
    return last.tokens_per_cycle


def test_the_demo_draft_keeps_its_measured_acceptance(demo):
    model, tokenizer = demo
    got = tokens_per_cycle(model, tokenizer, 4)
    assert got >= TOKENS_PER_CYCLE_FLOOR, (got, TOKENS_PER_CYCLE_MEASURED)


def test_auto_keeps_its_measured_acceptance_on_the_demo(demo, monkeypatch):
    from dflash_mlx import driver
    from dflash_mlx.block_policy import AutoBlock, BlockStats

    class ModelledTimes(AutoBlock):
        def observe(self, block, accepted, seconds, *args, **kwargs):
            super().observe(block, accepted, cycle_cost(block), *args, **kwargs)

    model, tokenizer = demo
    monkeypatch.setattr(driver, "AutoBlock", ModelledTimes)
    monkeypatch.setattr(model, "block_stats", BlockStats())  # as a fresh load starts
    got = tokens_per_cycle(model, tokenizer, "auto")
    assert got >= AUTO_TOKENS_PER_CYCLE_FLOOR, (got, AUTO_TOKENS_PER_CYCLE_MEASURED)
