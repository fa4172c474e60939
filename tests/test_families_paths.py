"""The families beyond Qwen3.5 on the paths around the decode cycle: ``convert-target``'s gpt-oss
folder read by mlx-lm itself (its module names), ``doctor``'s memory estimate for sliding-window
targets, the cycle-cost prior built from the loaded target's own layers, seeded sampling on a
sliding-window target, a quantized Qwen3 target through the Metal verify kernels' emulator, and
Qwen3, gpt-oss and Gemma 4 pipelined over two local ranks.

Oracles independent of the code under test: mlx-lm's loader and model (strict: every tensor named
as its model names it) and transformers' forward; a measured run's peak memory; numpy's
chi-square over many seeded draws against the target's own softmax; the target's decode steps.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.loading import load_target
from tests.test_families import TOLERANCE, logits, mlx_lm_model, torch_forward
from tests.test_families_window import make_window_target


# ---- convert-target of gpt-oss: mlx-lm's names ----------------------------------------------------


@pytest.fixture(scope="module")
def oss_truncated(tmp_path_factory):
    """gpt-oss with its YaRN ramp rounded (``truncate: true``), as mlx-lm's model computes it."""
    return make_window_target(tmp_path_factory.mktemp("oss_paths"), "gpt_oss", truncate=True)


def _tensor_names(folder) -> set:
    names = set()
    for f in folder.glob("*.safetensors"):
        names |= set(mx.load(str(f)).keys())
    return names


@pytest.mark.parametrize("quant", [None, "w4:gs32"])
def test_gpt_oss_convert_target_is_read_by_mlx_lm(oss_truncated, tmp_path, quant):
    """``convert-target`` from transformers' layout writes mlx-lm's module names (``mlp.router``,
    ``mlp.experts.*``; the router's 8-bit override keyed so): the folder's tensors are named as
    ``mlx_lm.convert``'s own, mlx-lm's strict loader reads it, and its logits equal ours on the
    same folder (and transformers' for the float one)."""
    from dflash_mlx.target_conversion import convert_target
    from tests.test_families_window import write_layout
    from tests.test_mlx_layouts import mlx_lm_convert

    ours = convert_target(str(oss_truncated), tmp_path / "ours", quant=quant)
    recipe = "affine4" if quant else "float32"
    theirs = mlx_lm_convert(write_layout(oss_truncated, tmp_path / "mlx", "mlx"), tmp_path / "mlx_lm", recipe,
                            moe=True)
    assert _tensor_names(ours) == _tensor_names(theirs)
    if quant:
        quantization = json.loads((ours / "config.json").read_text())["quantization"]
        assert quantization["model.layers.0.mlp.router"] == {"bits": 8, "group_size": 64}
    reference = logits(mlx_lm_model(ours))
    np.testing.assert_allclose(logits(load_target(ours)[0]), reference, atol=TOLERANCE, rtol=0)
    if not quant:
        np.testing.assert_allclose(reference, torch_forward(oss_truncated)[0], atol=TOLERANCE, rtol=0)


# ---- doctor's estimate for sliding-window targets -------------------------------------------------


def _wide_window_pair(root, kind: str):
    """A tiny float32 pair whose KV caches are most of its peak, with sliding layers of a 64-token
    window beside full ones: Gemma 4 whose full layers have 512-wide heads (``global_head_dim``)
    and its sliding ones 64-wide, or gpt-oss with 256-wide heads in every layer. Counting the
    sliding layers at the whole context (or Gemma 4's full layers at ``head_dim``) is off by far
    more than 10%. ``gemma4_moe``: Gemma 4 with a mixture of two 2048-wide experts beside its MLP
    and 128-wide full heads, whose prefill chunk peaks in the experts (their float32 activations
    four times the attention's projection)."""
    import torch

    from dflash_mlx import tiny
    from tests.conftest import VOCAB

    target = root / "target"
    eos = tiny.write_tokenizer(target, VOCAB)
    torch.manual_seed(0)
    if kind.startswith("gemma4"):
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        moe = dict(global_head_dim=128, enable_moe_block=True, num_experts=2, top_k_experts=2,
                   moe_intermediate_size=2048) if kind == "gemma4_moe" else {}
        model = Gemma4ForCausalLM(Gemma4TextConfig(**{
            **dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=64, global_head_dim=512, sliding_window=64,
                   layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
                   max_position_embeddings=8192, eos_token_id=eos), **moe}))
    else:
        from transformers import GptOssConfig, GptOssForCausalLM

        model = GptOssForCausalLM(GptOssConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, head_dim=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
            max_position_embeddings=8192, eos_token_id=eos))
    model.float().save_pretrained(str(target))
    config = json.loads((target / "config.json").read_text())
    if kind.startswith("gemma4"):
        config.pop("per_layer_config", None)
        config.update(global_head_dim=128 if kind == "gemma4_moe" else 512)
        (target / "config.json").write_text(json.dumps(config, indent=2))
    draft = tiny.draft_config(config, block_size=4)
    tiny.write_draft(root / "draft", draft)
    return target, root / "draft"


@pytest.mark.parametrize("kind", [pytest.param("gemma4", marks=pytest.mark.slow), "gpt_oss"])
def test_doctor_counts_the_kv_caches_a_sliding_window_target_holds(kind, tmp_path):
    """``doctor.estimate_memory``'s attention KV caches at 1200 tokens are the bytes the target's
    own caches hold after that context fed as a run feeds it (the prompt in prefill chunks, its
    last token alone, then single steps): the sliding layers their window and the last pass's
    rows, Gemma 4's full layers at ``global_head_dim``."""
    from dflash_mlx import doctor
    from dflash_mlx.prefill import default_prefill_step

    context = 1200
    target_dir, draft_dir = _wide_window_pair(tmp_path, kind)
    target, _ = load_target(target_dir)
    caches, fed = target.make_cache(), 0
    for n in doctor._chunks(context, default_prefill_step()):
        target(mx.array([[5] * n]), caches)
        fed += n
    mx.eval([c.keys for c in caches])
    assert fed == context and caches[0].offset == context
    held = sum(c.nbytes for c in caches)
    estimate = doctor.estimate_memory(target_dir, draft_dir, None, context)
    assert estimate["attention KV caches"] == held


@pytest.mark.slow  # a measured run in a subprocess (10 to 20 s each)
@pytest.mark.parametrize("kind,context", [("gpt_oss", 4096), ("gemma4", 2048), ("gemma4_moe", 2048)])
def test_doctor_estimates_a_sliding_window_target_as_a_measured_run(kind, context, tmp_path):
    """``doctor.estimate_memory`` is within 10% of the peak a DFlash run at that context measures
    in a process of its own (as tests/test_doctor.py checks Qwen3.5's), where a prefill chunk's
    working memory is not the attention scores': gpt-oss at 4096 tokens (a full layer's KV cache
    copied as it grows: 12% under without it), Gemma 4 (its attention projection with RoPE's and
    the norms' CPU tensors, 512-wide full heads: 24% under without it) and Gemma 4 with a mixture
    of experts (the experts' float32 activations: 57% under without them)."""
    from dflash_mlx import doctor
    from tests.test_doctor import measured_peak

    target_dir, draft_dir = _wide_window_pair(tmp_path, kind)
    measured = measured_peak(target_dir, draft_dir, context)
    estimate = doctor.estimate_memory(target_dir, draft_dir, None, context)
    assert abs(sum(estimate.values()) / measured - 1) < 0.10, (measured, estimate)


# ---- the cycle-cost prior from the loaded target's own layers ------------------------------------


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma4_moe"])
def test_the_cost_prior_reads_the_loaded_targets_layers(kind, tmp_path):
    """``traffic.auto_prior`` on an Apple GPU's facts prices gpt-oss and Gemma 4 (not None, as
    Qwen3.5's shapes would make it): a decode step first, every longer cycle costing more; the
    cost model's description of the target is its checkpoint's (config.json read here: each layer's
    window from ``layer_types``, Gemma 4's full layers at ``global_head_dim`` and its global key
    heads, the experts), and a sliding layer's attention costs the same at any context past its
    window while a full one's grows."""
    from dflash_mlx import device, tiny, traffic
    from dflash_mlx.api import load

    target_dir = make_window_target(tmp_path / "target", kind)
    config = json.loads((target_dir / "config.json").read_text())
    tiny.write_draft(tmp_path / "draft", tiny.draft_config(config, block_size=8), seed=3)
    model, _ = load(str(target_dir), draft=str(tmp_path / "draft"))
    m3 = device.DeviceFacts("Apple M3 Pro", "applegpu_g15s", True, 15, None, None)
    prior = traffic.auto_prior(model, m3)
    assert prior is not None and len(prior) == 16
    assert prior[0] == pytest.approx(1.0) and min(prior[1:]) > 1.0

    c = traffic.config_of(model.target)
    window = config["sliding_window"]
    want = []
    for kind_of_layer in config["layer_types"]:
        full = kind_of_layer == "full_attention"
        head_dim = config["global_head_dim"] if full and "global_head_dim" in config else config["head_dim"]
        kv = config["num_global_key_value_heads"] if full and config.get("num_global_key_value_heads") else \
            config["num_key_value_heads"]
        want.append((config["num_attention_heads"], kv, head_dim, None if full else window))
    assert c["attention"] == want
    experts = (config.get("num_local_experts") or config["num_experts"],
               config.get("num_experts_per_tok") or config["top_k_experts"],
               config.get("moe_intermediate_size") or config["intermediate_size"])
    assert (c["experts"], c["top_k"], c["expert_width"], c["expert_layers"]) == (*experts, len(want))

    gpu = traffic.gpu_of(m3)
    for i, (heads, kv, head_dim, w) in enumerate(want):
        alone = dict(c, attention=[want[i]])
        grows = traffic.attention_seconds(alone, 4, gpu, 8192) > traffic.attention_seconds(alone, 4, gpu, 1024)
        assert grows == (w is None), (i, w)


# ---- seeded sampling on a sliding-window target ---------------------------------------------------


@pytest.fixture(scope="module")
def small_oss(tmp_path_factory):
    """gpt-oss over an 8-token vocabulary (sinks, a 3-token window shorter than the prompt plus a
    block, its experts) and a tiny draft of block 4 bound to it: the joint distribution of two
    sampled tokens has 64 cells."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.conftest import make_draft, spread_weights
    from tests.test_sampling import V

    path = tmp_path_factory.mktemp("small_oss")
    config = GptOssConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=3, max_position_embeddings=512,
                          eos_token_id=V + 1, bos_token_id=V + 2, pad_token_id=0)  # eos never sampled
    torch.manual_seed(5)
    model = spread_weights(GptOssForCausalLM(config).float().eval(), stacked=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    model.save_pretrained(str(path))
    target, target_config = load_target(path)
    draft = make_draft(tmp_path_factory.mktemp("small_oss_draft"), target, target_config, block_size=4, seed=12)
    return target, draft


@pytest.mark.slow  # chi-square over 2 x 600 sampled runs (about 15 s)
def test_sampled_speculative_decoding_on_gpt_oss_follows_the_target(small_oss, monkeypatch):
    """Seeded sampled speculative decoding on a sliding-window target with sinks: the joint
    distribution of the second and third tokens against the target's own (mlx-lm's sampler over
    the target's logits, tests/test_sampling's oracle), by chi-square; and the biased acceptance
    rule of tests/test_sampling's negative control is caught on the same samples' budget."""
    from tests.test_sampling import SAMPLERS, exact_joint, goodness_of_fit, sampled_joint

    target, draft = small_oss
    window = [type(c).__name__ for c in target.make_cache()]
    assert window == ["WindowCache", "KVCache"]
    sampler = SAMPLERS[0]
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=0, samples=600), exact_joint(target, sampler))
    assert pvalue > 1e-3, f"speculative samples do not follow gpt-oss (chi-square p={pvalue:.2g})"
    from dflash_mlx import decoder
    from tests.test_sampling import biased_accept

    monkeypatch.setattr(decoder, "accept", biased_accept)
    pvalue = goodness_of_fit(sampled_joint(target, draft, sampler, seed=0, samples=600), exact_joint(target, sampler))
    assert pvalue < 1e-4, f"the test cannot tell a biased acceptance rule apart on gpt-oss (p={pvalue:.2g})"


def test_a_seeded_request_in_a_batch_is_itself_alone(tmp_path):
    """Seeded sampled requests on gpt-oss (window 3, sinks, experts) through ``batch_generate`` each
    give the tokens the same request gives alone through ``stream_generate``."""
    from dflash_mlx import load, tiny
    from dflash_mlx.scheduler import batch_generate
    from tests.conftest import VOCAB, random_prompts
    from tests.test_families import stream_tokens

    target_dir = make_window_target(tmp_path / "target", "gpt_oss")
    config = json.loads((target_dir / "config.json").read_text())
    tiny.write_draft(tmp_path / "draft", tiny.draft_config(config, block_size=8), seed=3)
    model, tokenizer = load(str(target_dir), draft=str(tmp_path / "draft"))
    prompts = [p.tolist() for p in random_prompts(3, VOCAB - 1, seed=11, low=4, high=24)]
    limits = [16, 10, 12]
    options = dict(block_tokens=4, temp=0.8, top_p=0.95, seed=7)
    out = batch_generate(model, tokenizer, prompts, max_tokens=limits, **options)
    for prompt, got, n in zip(prompts, out.token_ids, limits):
        alone, _ = stream_tokens(model, tokenizer, prompt, max_tokens=n, **options)
        assert got == alone
    assert len({tuple(t) for t in out.token_ids}) > 1


# ---- the Metal verify kernels (emulated) on a Qwen3 target -----------------------------------------


def qwen3_mac_pair(path, draft_dir, sources=None, self_check=True):
    """A w4 Qwen3 target (bfloat16 checkpoint) and w4 draft on the Mac path: every quantized matmul
    of 1..16 rows through the verify kernel, run by the emulator (tests/test_emulated_metal's
    ``quantized_mac_pair`` for Qwen3.5)."""
    import mlx.nn as nn

    from dflash_mlx import kernels
    from dflash_mlx.models.dflash import quantize_draft
    from tests.conftest import make_draft
    from tests.metal_emulation import LOWEST_FIRST, EmulatedMetal
    from tests.test_emulated_metal import route_every_shape

    target, config = load_target(path)
    nn.quantize(target, group_size=32, bits=4)
    draft = make_draft(draft_dir, target, config, block_size=8, seed=4)
    quantize_draft(draft, "w4:gs32")
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, sources), self_check=self_check)
    route_every_shape(metal, target, draft)
    assert all(layer.kernel_matmuls is not None for layer in [*target.layers, *draft.layers])
    return target, draft, metal


@pytest.fixture(scope="module")
def qwen3_bf16_dir(tmp_path_factory):
    from tests.conftest import make_hf_family_target
    from tests.test_emulated_metal import SMALL_VOCAB

    return make_hf_family_target(tmp_path_factory.mktemp("mac_qwen3"), "qwen3", vocab_size=SMALL_VOCAB,
                                 dtype="bfloat16", seed=3, num_hidden_layers=2)


@pytest.mark.slow  # every matmul runs in the C++ emulator
def test_a_quantized_qwen3_is_lossless_through_the_verify_kernel(qwen3_bf16_dir, tmp_path):
    """A w4 Qwen3 target on the emulated Mac path: each quantized layer's verify rows (8 at once)
    bit for bit its decode steps (a row at a time), the target's logits over a verify block bit
    for bit its decode steps' over the same cache; greedy speculative output equal to the target
    alone at blocks 2 and 8 and at every acceptance length; every kernel form that ran passed its
    self-check. A kernel whose rows past the first read the first row's input fails it."""
    from dflash_mlx import quantized
    from tests.metal_emulation import mutated_sources
    from tests.test_emulated_metal import SMALL_VOCAB, WRONG_ROW, check_every_acceptance_length, check_greedy_lossless
    from tests.conftest import random_prompts

    prompts = random_prompts(3, SMALL_VOCAB, seed=8)
    target, draft, metal = qwen3_mac_pair(qwen3_bf16_dir, tmp_path / "draft")
    routed = [m for _, m in target.named_modules() if isinstance(m, quantized.QuantizedLinear)]
    assert len(routed) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    for layer in routed:
        x = mx.random.normal((8, layer.weight.shape[1] * 32 // layer.bits), key=mx.random.key(1)).astype(mx.bfloat16)
        verify = np.array(layer(x).astype(mx.float32))
        for r in range(8):
            np.testing.assert_array_equal(verify[r], np.array(layer(x[r : r + 1]).astype(mx.float32))[0])
    prompt, block = prompts[0], mx.array([[3, 9, 27, 81, 17, 51, 25, 75]])
    cache = target.make_cache()
    target(prompt[None], cache)
    verify = np.array(target(block, cache).astype(mx.float32))[0]
    for c in cache:
        c.trim(8)
    for r in range(8):
        np.testing.assert_array_equal(verify[r], np.array(target(block[:, r : r + 1], cache).astype(mx.float32))[0, 0])

    check_greedy_lossless(target, draft, prompts[:1], [2, 8], n=16)
    assert check_every_acceptance_length(target, prompts[1:2]) == set(range(4))
    report = {k: v for k, v in metal.report().items() if k.startswith("quantized_verify")}
    rows = {int(k.split("Rows=")[1].split()[0]) for k in report}
    assert {1, 2, 4, 8} <= rows and set(report.values()) == {"ok"}, report

    broken, _, _ = qwen3_mac_pair(qwen3_bf16_dir, tmp_path / "draft_broken",
                                  mutated_sources(quantized.KERNEL, *WRONG_ROW), self_check=False)
    with pytest.raises(AssertionError):
        check_every_acceptance_length(broken, prompts)


# ---- the pipeline over two local ranks ------------------------------------------------------------


@pytest.mark.slow  # two pipeline ranks per family (processes)
@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss", "gemma4_moe"])
def test_pipelined_families_give_the_targets_own_greedy_tokens(kind, tmp_path):
    """A Qwen3 target, a gpt-oss one (sliding-window caches of 3 rows, sinks, experts) and a Gemma 4
    mixture of experts (windows, 32-wide global heads, scaled embedding on rank 0, soft-capped head
    on rank 1) split over two local ranks (tests/test_pipeline's launcher; its worker): greedy answers at blocks 4, 1 and
    auto, and a prefill chunked at the smallest step, token for token the target's own greedy
    continuation computed in this process without a draft (``target_only``), and sampled seeded
    answers equal to one process's."""
    import dflash_mlx
    from dflash_mlx import tiny
    from dflash_mlx.sampling import Sampler
    from tests.conftest import VOCAB, make_hf_family_target, random_prompts
    from tests.reference import target_only
    from tests.test_lossless import take
    from tests.test_pipeline import WORKER, finish, launch

    if kind == "qwen3":
        target_dir = make_hf_family_target(tmp_path / "target", "qwen3")
    else:
        target_dir = make_window_target(tmp_path / "target", kind)
    config = json.loads((target_dir / "config.json").read_text())
    tiny.write_draft(tmp_path / "draft", tiny.draft_config(config, block_size=8, target_layer_ids=[3, 1]), seed=3)
    target, _ = load_target(target_dir)
    prompts = [p.tolist() for p in random_prompts(2, VOCAB, seed=5)]
    # Every variant for gpt-oss (windows and sinks: the most a rank's caches must roll back); the
    # others one greedy and one sampled answer (the suite's time: each case launches two ranks).
    full = kind == "gpt_oss"
    runs, expected = [], []
    cases = ((prompts[0], ("4", "1", "auto")), (prompts[1], ("4",))) if full else ((prompts[0], ("4",)),)
    for prompt, blocks in cases:
        greedy, _ = take(target_only(target, mx.array(prompt), Sampler()), 16)
        for block in blocks:
            runs.append(dict(prompt=prompt, max_tokens=16, block_tokens=block, temp=0.0, seed=None))
            expected.append(greedy)
    if full:
        long = random_prompts(1, VOCAB, seed=6, low=70, high=71)[0]  # chunked at the smallest step: 64, 5, then 1
        runs.append(dict(prompt=long.tolist(), max_tokens=8, block_tokens="4", temp=0.0, seed=None, prefill_step_size=64))
        expected.append(take(target_only(target, long, Sampler()), 8)[0])
    model, tokenizer = dflash_mlx.load(str(target_dir), draft=str(tmp_path / "draft"))
    for seed in ((3, 4) if full else (3,)):
        runs.append(dict(prompt=prompts[1], max_tokens=12, block_tokens="4", temp=1.0, seed=seed))
        expected.append([r.token for r in dflash_mlx.stream_generate(model, tokenizer, prompts[1], max_tokens=12,
                                                                     block_tokens="4", temp=1.0, seed=seed)])
    (tmp_path / "spec.json").write_text(json.dumps(dict(target=str(target_dir), draft=str(tmp_path / "draft"),
                                                        runs=runs, stages={"0": "2,2", "1": "2,2"})))
    results = finish(launch(tmp_path, 2, WORKER + [str(tmp_path / "spec.json"), str(tmp_path)]))
    failed = [f"rank {rank} failed:\n{err[-3000:]}" for rank, (code, _, err) in enumerate(results) if code]
    assert not failed, "\n".join(failed)
    answers = json.loads((tmp_path / "answers.json").read_text())
    for run, want, got in zip(runs, expected, answers):
        assert got == want, {k: run.get(k) for k in ("block_tokens", "temp", "seed", "prefill_step_size")}
