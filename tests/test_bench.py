"""The bench's numbers: the aggregator on known runs, and the mlx-lm baseline on a real checkpoint."""

from __future__ import annotations

import pytest

from dflash_mlx import tiny
from dflash_mlx.api import load
from dflash_mlx.bench import Run, load_mlx_lm, measure, measure_mlx_lm, run_all, summarize


def run(mode, index, tps, block=None, output=(1, 2, 3)):
    return Run(suite="code", prompt_index=index, mode=mode, block_tokens=block, tokens=3, tps=tps, prompt_tps=0.0,
               tokens_per_cycle=1.0, acceptance_rate=0.0, peak_memory_gb=0.0, output=list(output))


def test_speedups_are_medians_of_every_repeat_on_both_sides():
    """The case that was biased: baselines 100/100/50 tok/s over repeats, DFlash 100/100/100 -> 1.00x."""
    runs = [run("baseline", 0, tps) for tps in (100, 100, 50)] + [run("dflash", 0, 100, "4") for _ in range(3)]
    runs += [run("mlx_lm", 0, tps) for tps in (80, 40, 50)]
    (row,) = summarize(runs)
    assert row["baseline_tps"] == 100 and row["dflash_tps"] == 100 and row["speedup"] == pytest.approx(1.0)
    assert row["mlx_lm_tps"] == 50 and row["speedup_vs_mlx_lm"] == pytest.approx(2.0)
    assert row["identical"] and row["mlx_lm_identical"]


def test_medians_span_prompts_and_outputs_are_compared_per_prompt():
    runs = [run("baseline", 0, 200, output=(1,)), run("baseline", 1, 100, output=(2,)), run("baseline", 1, 100, output=(2,)),
            run("dflash", 0, 300, "auto", output=(1,)), run("dflash", 1, 150, "auto", output=(9,)), run("dflash", 1, 150, "auto", output=(2,))]
    (row,) = summarize(runs)
    assert row["speedup"] == pytest.approx(1.5) and row["mlx_lm_tps"] is None
    assert not row["identical"]  # prompt 1's first DFlash output differs from its baseline


def test_the_mlx_lm_baseline_runs_mlx_lm_on_the_same_checkpoint(tmp_path):
    """mlx-lm's build of a text-only checkpoint, its own decode loop: greedy, the same tokens as ours."""
    target_dir, draft_dir = tiny.write_pair(tmp_path)
    model, tokenizer = load(str(target_dir), draft=str(draft_dir))
    baseline = load_mlx_lm(target_dir)
    assert type(baseline).__module__ == "mlx_lm.models.qwen3_5"
    ours = measure(model, tokenizer, "hello world", False, None, 24, chat=False)
    theirs = measure_mlx_lm(baseline, tokenizer, "hello world", 24, chat=False)
    assert theirs.mode == "mlx_lm" and theirs.output == ours.output and len(ours.output) == 24
    jobs = [("code", 0, 0, "hello world")]
    runs = run_all(model, tokenizer, jobs, ["4"], 8, False, mlx_lm_model=baseline, progress=lambda done, label: None)
    assert sorted(r.mode for r in runs) == ["baseline", "dflash", "mlx_lm"]


def test_the_mlx_lm_column_samples_the_same_distribution():
    """The bench's sampling flags, as our ``stream_generate`` takes them and as mlx-lm's
    ``make_sampler`` gets them: the same distribution (mlx-lm's own filter chain, its draw captured)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.sample_utils import greedy_sampler, make_sampler

    from dflash_mlx.bench import mlx_lm_sampler_arguments
    from dflash_mlx.sampling import Sampler
    from tests.test_sampling import mlx_lm_probs

    rows = mx.array(np.random.default_rng(1).standard_normal((3, 40)).astype(np.float32) * 2)
    for sampling in (dict(temp=0.7), dict(temp=0.7, top_p=1.0, top_k=0, min_p=0.0), dict(temp=1.3, top_p=0.9, top_k=5),
                     dict(temp=0.5, top_p=0.8, min_p=0.1), dict(temp=1.0, top_p=0.95, top_k=8, min_p=0.05, seed=3)):
        ours = Sampler(sampling["temp"], top_p=sampling.get("top_p", 1.0), top_k=sampling.get("top_k", 0),
                       min_p=sampling.get("min_p", 0.0))  # as stream_generate builds it from the same arguments
        theirs = mlx_lm_probs(rows, **mlx_lm_sampler_arguments(sampling))
        np.testing.assert_allclose(np.array(ours.probs(rows)), theirs, atol=2e-6, err_msg=str(sampling))
    assert make_sampler(**mlx_lm_sampler_arguments(dict(temp=0.0, top_p=0.9))) is greedy_sampler
