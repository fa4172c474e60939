"""The bench's numbers: the aggregator on known runs, and the mlx-lm baseline on a real checkpoint."""

from __future__ import annotations

import pytest

from dflash_mlx import tiny
from dflash_mlx.api import load
from dflash_mlx.bench import Run, _identical, load_mlx_lm, measure, measure_mlx_lm, run_all, summarize


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
    assert _identical(row) == "yes"
    (row,) = summarize(runs[:-1] + [run("mlx_lm", 0, 50, output=(1, 2, 4))])
    assert row["identical"] and row["mlx_lm_identical"] is False and _identical(row) == "yes (mlx-lm: NO)"


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


def scripted_logits(tokens):
    """A scripted target over 128 tokens: after [1, 2, 3, 10, 11] its top two are 12 and 99 one
    bfloat16 ulp apart (a near-tie); after [4, 5] its top two are 20 and 21 a whole logit apart;
    after [6, 7, 30] the top is 31, with 98 one ulp below it."""
    import mlx.core as mx

    logits = [0.0] * 128
    if tokens == [1, 2, 3, 10, 11]:
        logits[12], logits[99] = 5.0, 5.0 - 2.0**-5  # bfloat16 spacing at 5 is 2^-5
    elif tokens == [4, 5]:
        logits[20], logits[21] = 6.0, 5.0
    else:
        logits[31], logits[98] = 5.0, 5.0 - 2.0**-5
    return mx.array(logits).astype(mx.bfloat16)


def test_bench_reports_greedy_divergences_and_fails_only_off_a_near_tie():
    from dflash_mlx import bench

    prompts = {("code", 0, 0): [1, 2, 3], ("code", 0, 1): [4, 5], ("code", 0, 2): [6, 7]}
    base = [run("baseline", 0, 100, output=(10, 11, 12, 13)), run("baseline", 1, 100, output=(20, 22)),
            run("baseline", 2, 100, output=(30, 31))]
    tie = run("dflash", 0, 150, "4", output=(10, 11, 99, 13))
    real = run("dflash", 1, 150, "4", output=(21, 22))
    same = run("dflash", 2, 150, "4", output=(30, 31))
    found = bench.find_divergences(base + [tie, same], prompts, scripted_logits)
    assert [(d.position, d.expected, d.got, d.near_tie) for d in found] == [(2, 12, 99, True)]
    assert found[0].top2 == (12, 99) and found[0].ulps == pytest.approx(1.0) and same.divergence is None
    (row,) = bench.summarize(base + [tie, same])
    lines, failed = bench.divergence_report([row])
    assert not row["identical"] and not failed and bench._identical(row) == "near-tie"
    assert lines == ["code block 4 prompt 1: token 2: 99 instead of 12 (target top-2 (12, 99), gap 0.0312 = 1.0 ulp: a near-tie)"]

    bench.find_divergences(base + [tie, real], prompts, scripted_logits)
    (row,) = bench.summarize(base + [tie, real])
    lines, failed = bench.divergence_report([row])
    assert failed and bench._identical(row) == "NO"
    assert "prompt 2: token 0: 21 instead of 20 (target top-2 (20, 21), gap 1 = 32.0 ulp: not a near-tie)" in lines[1]
    # A near-tie of the target's top two does not cover a third token.
    other = run("dflash", 2, 150, "4", output=(30, 40))
    (d,) = bench.find_divergences(base + [other], {**prompts, ("code", 0, 2): [6, 7]}, scripted_logits)
    assert d.position == 1 and not d.near_tie
    assert not bench.first_divergence([1], [2, 3], [2], scripted_logits).near_tie  # DFlash stopped early
    assert bench.first_divergence([1], [2, 3], [2, 3], scripted_logits) is None


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


def test_rows_weigh_each_prompts_median_by_its_tokens():
    """Two prompts of different speeds (a 22-token answer at 100 tok/s, a 66-token one at 200), the
    same per-prompt medians on both sides, different spreads: 1.00x. A median pooled over the six
    runs of each side lands on the clusters' edges, (104 + 190) / 2 against (101 + 199) / 2, and
    read 1.02x."""
    def timed(mode, index, tps, tokens):
        r = run(mode, index, tps, None if mode == "baseline" else "1")
        r.tokens, r.cpu_ms_per_token = tokens, 1e3 / tps
        return r
    runs = [timed("baseline", 0, tps, 22) for tps in (96, 100, 104)] + [timed("baseline", 1, tps, 66) for tps in (190, 200, 210)]
    runs += [timed("dflash", 0, tps, 22) for tps in (92, 100, 101)] + [timed("dflash", 1, tps, 66) for tps in (199, 200, 201)]
    (row,) = summarize(runs)
    assert row["speedup"] == pytest.approx(1.0) and row["cpu_speedup"] == pytest.approx(1.0)
    # 88 tokens over 22/100 + 66/200 seconds: the tokens a user gets per second running both.
    assert row["baseline_tps"] == pytest.approx(88 / (0.22 + 0.33))
    runs = [r for r in runs if not (r.mode == "dflash" and r.prompt_index == 1)]
    runs += [timed("dflash", 1, tps, 66) for tps in (399, 400, 401)]  # twice as fast on the long answer
    (row,) = summarize(runs)
    assert row["speedup"] == pytest.approx((0.22 + 0.33) / (0.22 + 0.165))
