"""The mixture-of-experts target (``qwen3_5_moe``): parity with transformers and mlx-lm in every
expert layout people publish, the router's exactness under verification, and lossless decoding."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx.loading import CheckpointError, load_target
from dflash_mlx.models import qwen3_5_moe
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from tests import subprocess_env
from tests.conftest import VOCAB, make_draft, make_hf_moe_target, random_prompts
from tests.test_lossless import (
    OracleDraft,
    assert_caches_hold_the_committed_tokens,
    stop_after,
    assert_lossless,
    take,
)

from tests.test_target import PROMPT, assert_cached_decoding_matches_the_full_forward  # noqa: E402
GREEDY = Sampler()


@pytest.fixture(scope="module")
def per_expert_dir(tmp_path_factory):
    return make_hf_moe_target(tmp_path_factory.mktemp("moe_per_expert"), "per_expert")


@pytest.fixture(scope="module")
def fused_dir(tmp_path_factory):
    return make_hf_moe_target(tmp_path_factory.mktemp("moe_fused"), "fused")


@pytest.fixture(scope="module")
def moe(per_expert_dir):
    return load_target(per_expert_dir)


def torch_logits(path, ids=PROMPT):
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_both_hf_expert_layouts_match_transformers(per_expert_dir, fused_dir, moe):
    target, _ = moe
    assert isinstance(target, qwen3_5_moe.Model)
    reference = torch_logits(per_expert_dir)
    ours = np.array(target(mx.array(PROMPT)))
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    fused, config = load_target(fused_dir)  # the multimodal BF16 release's layout, fused experts
    assert config["model_type"] == "qwen3_5_moe"
    np.testing.assert_array_equal(np.array(fused(mx.array(PROMPT))), ours)


def test_cached_decoding_matches_the_full_forward(moe):
    assert_cached_decoding_matches_the_full_forward(moe[0], atol=5e-5)  # the router's float32 softmax and gathers


def test_a_mixture_of_expert_layouts_is_a_clear_error(per_expert_dir, fused_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    fused = load_file(str(fused_dir / "model.safetensors"))
    per_expert = load_file(str(per_expert_dir / "model.safetensors"))
    mixed = {k: v for k, v in fused.items() if ".layers.1.mlp.experts." not in k}
    mixed.update({k.replace("model.", "model.language_model.", 1): v for k, v in per_expert.items() if ".layers.1.mlp.experts." in k})
    save_file(mixed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((fused_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="mixes expert layouts"):
        load_target(tmp_path)
    missing = {k: v for k, v in per_expert.items() if ".layers.2.mlp.experts.5." not in k}
    save_file(missing, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((per_expert_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing for experts \[5\]"):
        load_target(tmp_path)


def test_qwen3_6_configs_load(per_expert_dir, moe, tmp_path):
    """Qwen3.6's extra fields (output_gate_type "swish", language_model_only, text-level bos_token_id)."""
    import shutil

    shutil.copy(per_expert_dir / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((per_expert_dir / "config.json").read_text())
    config.update(output_gate_type="swish", language_model_only=True, bos_token_id=248044)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = load_target(tmp_path)
    np.testing.assert_array_equal(np.array(model(mx.array(PROMPT))), np.array(moe[0](mx.array(PROMPT))))


class BatchRoundingGate(nn.Module):
    """A router projection whose rounding depends on how many rows one call carries, as Metal's
    gemv (one row) and gemm (several) may: the router must never show a row to it beside others."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.inner = gate

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        logits = self.inner(x)
        wobble = mx.where(mx.arange(logits.shape[-1]) % 2 == 0, 1.0, -1.0)  # per expert, so ranks can change
        return logits * (1.0 + 1e-6 * (rows - 1) * wobble)


def tied_router(block: qwen3_5_moe.SparseMoeBlock, tie: str, seed: int = 0) -> None:
    """Router rows that make two experts tie for the k-th place on every token with u.x > 0:
    ``exact`` (experts 0 and 2, the same row) or ``near`` (expert 1 one ulp above expert 0), the
    k - 1 places above taken by the last experts."""
    E, H = block.gate.weight.shape
    k = block.top_k
    u = np.random.default_rng(seed).standard_normal(H).astype(np.float32)
    w = np.stack([-u * (1 + 0.01 * e) for e in range(E)])
    for j in range(k - 1):
        w[E - 1 - j] = 3 * u * (1 + 0.01 * j)
    w[0] = u
    if tie == "exact":
        w[2] = u
    else:
        w[1] = u * np.float32(1 + 2e-7)
    block.gate.weight = mx.array(w)


@pytest.mark.parametrize("tie", ["exact", "near"])
def test_router_choice_is_independent_of_the_rows_verified_with_it(moe, tie):
    """Each token's experts (and weights) in a T-token call equal a one-token call's, with an
    exact or a one-ulp tie at the k-th place and a router projection that rounds by batch size
    (as Metal's gemv and gemm may); routed in one batched projection, the near tie flips."""
    target, _ = moe
    block = target.layers[0].mlp
    saved, saved_weight = block.gate, block.gate.weight
    x = mx.array(np.random.default_rng(1).standard_normal((1, 12, target.args.hidden_size)).astype(np.float32))
    try:
        tied_router(block, tie)
        block.gate = BatchRoundingGate(block.gate)
        singles = [block.route(x[:, t : t + 1]) for t in range(12)]
        for T in (2, 5, 8, 12):
            batched, weights = block.route(x[:, :T])
            for t in range(T):
                alone, alone_weights = singles[t]
                assert set(np.array(batched[0, t]).tolist()) == set(np.array(alone[0, 0]).tolist()), (T, t)
                np.testing.assert_array_equal(np.sort(np.array(weights[0, t])), np.sort(np.array(alone_weights[0, 0])))
        if tie == "near":  # the test has teeth: one batched projection picks other experts
            probs = mx.softmax(block.gate(x).astype(mx.float32), axis=-1)
            picked = mx.argpartition(probs, kth=-block.top_k, axis=-1)[..., -block.top_k:]
            flips = [set(np.array(picked[0, t]).tolist()) != set(np.array(singles[t][0][0, 0]).tolist()) for t in range(12)]
            assert any(flips)
    finally:
        block.gate = saved
        saved.weight = saved_weight  # the module-wide target, as it was


@pytest.fixture(scope="module")
def moe_pair(moe, tmp_path_factory):
    target, config = moe
    draft = make_draft(tmp_path_factory.mktemp("moe_draft"), target, config, block_size=16, seed=2)
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(20, VOCAB, seed=3)


@pytest.fixture(scope="module")
def references(moe, prompts):
    return [take(target_only(moe[0], p, GREEDY), 24)[0] for p in prompts]


@pytest.mark.parametrize("block", [4, pytest.param(16, marks=pytest.mark.slow)])  # every acceptance length: below
def test_moe_greedy_is_lossless(moe_pair, prompts, references, block):
    target, draft = moe_pair
    for prompt, expected in zip(prompts, references):
        got, _ = take(speculative(target, draft, prompt, GREEDY, block_tokens=block), 24)
        assert_lossless(target, prompt, expected, got)


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_moe_every_acceptance_length_and_rollback(moe, prompts, block):
    target, _ = moe
    seen = set()
    n = block * (block + 1) // 2 + 1  # the whole schedule: every acceptance length once
    for k, prompt in enumerate(prompts[: min(block, 4)]):
        expected, _ = take(target_only(target, prompt, GREEDY), n)
        schedule = list(range(block))[k % block :] + list(range(block))[: k % block]
        oracle = OracleDraft(prompt.tolist() + expected, block, schedule)
        committed, commits = [], []
        for commit in speculative(target, oracle, prompt, GREEDY, block_tokens=block):
            commits.append(commit)
            committed.extend(commit.tokens)
            if len(committed) >= n:
                break
        if k == 0:  # streams stopped after a short, a middle and a long acceptance
            for cycles in sorted({1, block // 2, block}):
                cache = target.make_cache()
                stopped = stop_after(speculative(target, oracle, prompt, GREEDY, block_tokens=block, cache=cache), cycles)
                assert_caches_hold_the_committed_tokens(target, cache, prompt, stopped[:-1], 2e-5, f"cycle {cycles}")
        assert_lossless(target, prompt, expected[:n], committed[:n])
        seen.update(c.accepted for c in commits[1:])
    assert seen == set(range(block))


@pytest.mark.slow  # chi-square over sampled runs
def test_moe_sampling_follows_the_target(tmp_path_factory):
    from tests import test_sampling

    path = make_hf_moe_target(tmp_path_factory.mktemp("moe_small"), vocab_size=test_sampling.V, seed=5)
    target, config = load_target(path)
    draft = make_draft(tmp_path_factory.mktemp("moe_small_draft"), target, config, block_size=4, seed=6)
    sampler = test_sampling.SAMPLERS[1]
    counts = test_sampling.sampled_joint(target, draft, sampler, seed=0, samples=test_sampling.SAMPLES // 2)
    pvalue = test_sampling.goodness_of_fit(counts, test_sampling.exact_joint(target, sampler))
    assert pvalue > 1e-3, f"speculative samples with the MoE target do not follow it (p={pvalue:.2g})"


@pytest.mark.slow  # converts through the CLI
def test_a_nested_schema_draft_for_a_moe_target_converts_and_is_lossless(tmp_path):
    """z-lab's MoE drafts read 8 taps (nested schema): `dflash-mlx convert` pairs one with a MoE
    target in the release layout, and the pair decodes losslessly."""
    import subprocess
    import sys

    from dflash_mlx import api, tiny

    target_dir = make_hf_moe_target(tmp_path / "target", "fused", num_hidden_layers=8, seed=7)
    text = json.loads((target_dir / "config.json").read_text())["text_config"]
    tiny.write_draft(tmp_path / "zlab", tiny.draft_config(text, block_size=8, target_layer_ids=list(range(8))), seed=3)
    done = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "convert", "--out", str(tmp_path / "out"), "--draft",
                           str(tmp_path / "zlab"), "--target", str(target_dir), "--base-tokenizer", "none"],
                          capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert done.returncode == 0, done.stderr
    model, _ = api.load(str(target_dir), draft=str(tmp_path / "out"))
    assert isinstance(model.target, qwen3_5_moe.Model) and model.draft.target_layer_ids == list(range(8))
    cli = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "generate", "-m", str(target_dir), "-d", str(tmp_path / "out"),
                          "-p", "w1 w2 w3", "--max-tokens", "12", "--no-chat-template", "--json"], capture_output=True, text=True, timeout=300,
                         env=subprocess_env())
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["generation_tokens"] == 12
    for prompt in random_prompts(4, VOCAB, seed=9):
        expected, _ = take(target_only(model.target, prompt, GREEDY), 20)
        for block in (4, 8):
            got, _ = take(speculative(model.target, model.draft, prompt, GREEDY, block_tokens=block), 20)
            assert_lossless(model.target, prompt, expected, got)


def test_a_verify_pass_takes_one_expert_gather_path_whatever_its_rows(tmp_path, monkeypatch):
    """mlx-lm's SwitchGLU sorts a call's tokens once it has 64 expert indices, which on a Mac moves
    the experts from ``gather_qmv`` to sorted ``gather_qmm``: a batch-mate's rows could move a
    sequence across that line. With eight experts a token, a verify pass of up to 16 rows (a GPU
    batch's limit) never sorts (one path, a decode step's); a prefill chunk sorts."""
    from mlx_lm.models import switch_layers

    target, _ = load_target(make_hf_moe_target(tmp_path / "moe8", num_experts_per_tok=8))
    seen = []
    real = switch_layers.SwitchLinear.__call__
    monkeypatch.setattr(switch_layers.SwitchLinear, "__call__",
                        lambda self, x, indices, sorted_indices=False: seen.append(sorted_indices)
                        or real(self, x, indices, sorted_indices))
    tokens = mx.array(np.arange(40) % (VOCAB - 1))
    for batch, rows in ((1, 1), (1, 8), (2, 8), (4, 4)):  # 8 to 128 indices a call
        mx.eval(target(mx.stack([tokens[:rows]] * batch)))
        assert seen and not any(seen), (batch, rows)
        seen.clear()
    mx.eval(target(tokens[None, :40]))
    assert seen and all(seen)
