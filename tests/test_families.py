"""Targets beyond Qwen3.5, the plain-attention families: Qwen3 (``qwen3``), Llama 3.1 (``llama``,
its ``llama3`` RoPE scaling) and Qwen3-MoE (``qwen3_moe``).

For each, on a tiny random checkpoint that transformers writes (conftest ``make_hf_family_target``):
the logits against transformers' forward and against mlx-lm's model of the same files, and that
both comparisons fail for a model that is wrong in one thing; the Hugging Face bf16 layout,
``mlx_lm.convert`` 4- and 8-bit checkpoints and our ``convert-target``; greedy speculative output
token-identical to the target alone with a tiny z-lab draft through ``stream_generate``/``generate``
at several block sizes, through ``batch_generate`` (each prompt as alone), through the scheduler on
a GPU's batch rules and with a prompt cache;
every acceptance length with the rollback (a KV-cache trim: these targets have no Gated DeltaNet
layer) leaving the caches of the committed tokens.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import tiny
from dflash_mlx.loading import CheckpointError, load_target
from dflash_mlx.models import layers
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from tests.conftest import FAMILIES, VOCAB, make_hf_family_target, random_prompts, release_config
from tests.test_lossless import OracleDraft, assert_caches_hold_the_committed_tokens, assert_lossless, stop_after, take
from tests.test_target import PROMPT, assert_cached_decoding_matches_the_full_forward

GREEDY = Sampler()
TOLERANCE = 1e-4  # float32 logits, as the Qwen3.5 parity tests
BLOCKS = (2, 4, 8, 16)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_dir(family, tmp_path_factory):
    return make_hf_family_target(tmp_path_factory.mktemp(f"hf_{family}"), family)


@pytest.fixture(scope="module")
def target(hf_dir):
    return load_target(hf_dir)[0]


def torch_forward(path, ids=PROMPT):
    """transformers' logits and hidden states (``hidden_states[i + 1]``: layer i's output)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def mlx_lm_model(path):
    """mlx-lm's own model of a checkpoint, built by its loader."""
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def logits(model, ids=PROMPT) -> np.ndarray:
    return np.array(model(mx.array(ids)).astype(mx.float32))


# ---- parity ----------------------------------------------------------------------------------------


def test_logits_and_taps_match_transformers(family, hf_dir, target):
    assert type(target).__module__ == f"dflash_mlx.models.{family}"
    reference, hidden = torch_forward(hf_dir)
    ours, taps = target.forward(mx.array(PROMPT), taps=(0, 2))
    np.testing.assert_allclose(np.array(ours), reference, atol=TOLERANCE, rtol=0)
    H = target.args.hidden_size  # taps: the residual stream after each chosen layer
    np.testing.assert_allclose(np.array(taps[..., :H]), hidden[1], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(np.array(taps[..., H:]), hidden[3], atol=TOLERANCE, rtol=0)


def test_logits_match_mlx_lm(family, hf_dir, target):
    reference = mlx_lm_model(hf_dir)
    assert type(reference).__module__ == f"mlx_lm.models.{family}"
    np.testing.assert_allclose(logits(target), logits(reference), atol=TOLERANCE, rtol=0)


def break_model(model, family: str) -> str:
    """Make ``model`` wrong in the one thing its family adds: Qwen3 without its per-head q/k norms,
    Llama 3.1 with plain RoPE (no ``llama3`` scaling), Qwen3-MoE without renormalizing its top k."""
    for layer in model.layers:
        attn = layer.self_attn
        if family == "qwen3":
            attn.pop("q_norm"), attn.pop("k_norm")
        elif family == "llama":
            attn.rope = layers.make_rope(attn.head_dim, model.args.rope_theta)
        elif isinstance(layer.mlp, layers.SparseMoe):
            layer.mlp.norm_topk_prob = False
    return {"qwen3": "no q/k norm", "llama": "no llama3 RoPE scaling", "qwen3_moe": "top k not renormalized"}[family]


def test_both_parity_checks_fail_for_a_wrong_model(family, hf_dir):
    """The comparisons above have teeth: each family's model, wrong in the one thing it adds, is
    far outside the tolerance from transformers and from mlx-lm."""
    broken, _ = load_target(hf_dir)
    what = break_model(broken, family)
    got = logits(broken)
    for name, reference in (("transformers", torch_forward(hf_dir)[0]), ("mlx-lm", logits(mlx_lm_model(hf_dir)))):
        gap = np.abs(got - reference).max()
        assert gap > 100 * TOLERANCE, f"{family} with {what} is within {gap:.2g} of {name}"


def test_transformers_5_configs_load_the_same(family, hf_dir, target, tmp_path):
    """The config as transformers 5 saves it (``rope_parameters``; Qwen3-MoE's ``num_local_experts``)
    gives the same model as the published style (``rope_theta``/``rope_scaling``, ``num_experts``)."""
    path = make_hf_family_target(tmp_path, family, style="transformers5")
    config = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in config and "rope_scaling" not in config
    assert release_config(config) == json.loads((hf_dir / "config.json").read_text())
    model, _ = load_target(path)
    assert mx.array_equal(model(mx.array(PROMPT)), target(mx.array(PROMPT))).item()


def test_cached_decoding_matches_the_full_forward(target):
    assert_cached_decoding_matches_the_full_forward(target, atol=5e-5)
    assert all(type(c).__name__ == "KVCache" for c in target.make_cache())


def test_refused_configs_are_clear_errors(family, hf_dir, tmp_path):
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    layer_types = ["linear_attention"] + ["full_attention"] * (config["num_hidden_layers"] - 1)
    (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": layer_types}))
    with pytest.raises(CheckpointError, match=r"layer types \['linear_attention'\] are not attention layers"):
        load_target(tmp_path)
    sliding = ["sliding_attention"] * config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": sliding, "sliding_window": 0}))
    with pytest.raises(CheckpointError, match="need a sliding_window of at least 1, got 0"):
        load_target(tmp_path)
    draft = tiny.draft_config(config)
    (tmp_path / "config.json").write_text(json.dumps(draft))  # a draft's config says model_type qwen3
    with pytest.raises(CheckpointError, match="DFlash draft, not a target"):
        load_target(tmp_path)


# ---- checkpoint layouts ----------------------------------------------------------------------------


def test_hf_bf16_checkpoint(family, hf_dir, target, tmp_path):
    """The layout Hugging Face releases are in: bf16 weights, kept bf16 (experts in float32 on the
    CPU, where MLX's gather_mm has no other dtype), near the float32 model of the same seed and, for
    the dense families, at mlx-lm's logits on the same files."""
    path = make_hf_family_target(tmp_path, family, dtype="bfloat16")
    model, _ = load_target(path)
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert model.embed_tokens.weight.dtype == mx.bfloat16
    got, full = logits(model), logits(target)
    assert np.sqrt(((got - full) ** 2).mean() / (full**2).mean()) < 0.05
    if family != "qwen3_moe":  # mlx-lm's bf16 experts do not run on the CPU
        np.testing.assert_allclose(got, logits(mlx_lm_model(path)), atol=2e-2, rtol=0)


@pytest.mark.parametrize("recipe,bits", [("affine4", 4), ("affine8", 8)])
def test_mlx_lm_converted_quantized_checkpoint(family, hf_dir, target, tmp_path, recipe, bits):
    """A checkpoint written by ``mlx_lm.convert`` at 4 bits (group 32) or 8 (group 64), Qwen3-MoE's
    router at 8 bits, group 64 (mlx-lm's recipe): quantized layers where it quantized them,
    mlx-lm's logits."""
    from tests.test_mlx_layouts import mlx_lm_convert

    out = mlx_lm_convert(hf_dir, tmp_path / "mlx", recipe, moe=family == "qwen3_moe")
    model, config = load_target(out)
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == bits
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    if family == "qwen3_moe":
        assert model.layers[0].mlp.gate.bits == 8 and model.layers[0].mlp.switch_mlp.gate_proj.bits == bits
        assert isinstance(model.layers[2].mlp, layers.MLP) and model.layers[2].mlp.up_proj.bits == bits
    got = logits(model)
    np.testing.assert_allclose(got, logits(mlx_lm_model(out)), atol=TOLERANCE, rtol=0)
    if family != "qwen3_moe":  # near the float model (a tiny MoE's 4-bit routing flips experts)
        full = logits(target)
        assert np.sqrt(((got - full) ** 2).mean() / (full**2).mean()) < (0.35 if bits == 4 else 0.05)


def test_convert_target_writes_what_mlx_lm_convert_writes(family, hf_dir, tmp_path):
    """``convert-target`` takes these families: its 4-bit output holds mlx-lm's converter's tensors
    bit for bit (and the same per-layer overrides: Qwen3-MoE's router), under the source's own
    model type."""
    from mlx.utils import tree_flatten

    from dflash_mlx.target_conversion import convert_target
    from tests.test_mlx_layouts import mlx_lm_convert

    convert_target(str(hf_dir), tmp_path / "ours", quant="w4:gs32")
    mlx_lm_convert(hf_dir, tmp_path / "mlx_lm", "affine4", moe=family == "qwen3_moe")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs = json.loads((tmp_path / "mlx_lm" / "config.json").read_text())
    assert ours["model_type"] == family and ours["quantization"] == theirs["quantization"]
    assert (tmp_path / "ours" / "tokenizer.json").exists()
    got = dict(tree_flatten(load_target(tmp_path / "ours")[0].parameters()))
    want = dict(tree_flatten(load_target(tmp_path / "mlx_lm")[0].parameters()))
    assert got.keys() == want.keys()
    for key in want:
        assert mx.array_equal(got[key], want[key]).item(), key


# ---- lossless decoding ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(hf_dir, tmp_path_factory):
    """``dflash_mlx.load`` of the target with a tiny z-lab draft (nested schema, block 16) for it."""
    from dflash_mlx import load

    config = json.loads((hf_dir / "config.json").read_text())
    draft_dir = tmp_path_factory.mktemp("draft")
    tiny.write_draft(draft_dir, tiny.draft_config(config, block_size=16), seed=3)
    return load(str(hf_dir), draft=str(draft_dir))


@pytest.fixture(scope="module")
def prompts():
    return [p.tolist() for p in random_prompts(4, VOCAB - 1, seed=11, low=4, high=24)]


def stream_tokens(model, tokenizer, prompt, max_tokens=24, **kwargs):
    """The tokens and the last response of one ``stream_generate`` run."""
    from dflash_mlx import stream_generate

    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs))
    return [r.token for r in responses], responses[-1]


def test_stream_generate_is_lossless_at_every_block_size(pair, prompts):
    from dflash_mlx import generate

    model, tokenizer = pair
    for prompt in prompts[:3]:
        expected, _ = stream_tokens(model, tokenizer, prompt, use_draft=False)
        alone, _ = take(target_only(model.target, mx.array(prompt), GREEDY), len(expected))
        assert expected == alone[: len(expected)]
        for block in BLOCKS:
            got, last = stream_tokens(model, tokenizer, prompt, block_tokens=block)
            assert_lossless(model.target, mx.array(prompt), expected, got)
            assert last.drafted_tokens > 0 or len(got) < 3, f"block {block}: nothing was drafted"
    text = generate(model, tokenizer, prompts[0], max_tokens=24, block_tokens=8)
    assert text == generate(model, tokenizer, prompts[0], max_tokens=24, use_draft=False)


@pytest.mark.parametrize("block", [4, 8])
def test_every_acceptance_length_rolls_the_kv_caches_back(target, block):
    """An oracle draft wrong at scheduled slots: every acceptance length 0..block-1 happens, the
    output is the target's, and wherever the stream stops (the step in flight undone) the caches
    equal those of feeding the committed tokens directly."""
    seen = set()
    n = block * (block + 1) // 2 + 1
    for k, prompt in enumerate(random_prompts(4, VOCAB - 1, seed=5)):
        expected, _ = take(target_only(target, prompt, GREEDY), n + block)
        schedule = list(range(block))[k % block :] + list(range(block))[: k % block]
        oracle = OracleDraft(prompt.tolist() + expected, block, schedule)
        got, commits = take(speculative(target, oracle, prompt, GREEDY, block_tokens=block), n)
        assert_lossless(target, prompt, expected[:n], got)
        seen.update(c.accepted for c in commits[1:])
        if k == 0:
            for cycles in sorted({1, block // 2, block}):
                cache = target.make_cache()
                stopped = stop_after(speculative(target, oracle, prompt, GREEDY, block_tokens=block, cache=cache), cycles)
                assert_caches_hold_the_committed_tokens(target, cache, prompt, stopped[:-1], 2e-5, f"cycle {cycles}")
    assert seen == set(range(block))


def test_batch_generate_gives_each_prompt_its_answer_alone(pair, prompts):
    from dflash_mlx.scheduler import batch_generate

    model, tokenizer = pair
    limits = [20, 12, 24, 16]
    for block in (4, 8):
        out = batch_generate(model, tokenizer, prompts, max_tokens=limits, block_tokens=block)
        for prompt, got, n in zip(prompts, out.token_ids, limits):
            alone, _ = stream_tokens(model, tokenizer, prompt, max_tokens=n, block_tokens=block)
            assert got == alone
            expected, _ = stream_tokens(model, tokenizer, prompt, max_tokens=n, use_draft=False)
            assert_lossless(model.target, mx.array(prompt), expected, got)
        assert sum(r.drafted_tokens for r in out.responses) > 0


def test_a_prompt_cache_reuses_the_shared_prefix(pair, prompts):
    """A second prompt that extends the first (a chat's next turn) starts from the cache (these
    targets' checkpoints hold no state: the KV caches are cut back to one) and decodes as a fresh
    run; so does a resend. The first prompt is long enough for checkpoints on the prefill's grid."""
    from dflash_mlx.prompt_cache import PromptCache

    model, tokenizer = pair
    cache = PromptCache()
    opening = random_prompts(1, VOCAB - 1, seed=12, low=150, high=151)[0].tolist()
    first, _ = stream_tokens(model, tokenizer, opening, block_tokens=4, prompt_cache=cache)
    follow_up = opening + first + prompts[1]
    got, last = stream_tokens(model, tokenizer, follow_up, block_tokens=4, prompt_cache=cache)
    assert last.cached_prompt_tokens >= 64
    fresh, _ = stream_tokens(model, tokenizer, follow_up, block_tokens=4)
    assert got == fresh
    again, last = stream_tokens(model, tokenizer, follow_up, block_tokens=4, prompt_cache=cache)
    assert again == fresh and last.cached_prompt_tokens > 0


def test_the_schedulers_batches_on_a_gpus_rules(pair, prompts):
    """The rules a Mac's batches follow, run here: every sequence fed two rows at least (a plain
    step's second row is padding, trimmed away) and the draft called per sequence; requests with
    blocks 4, 1 (the target alone), 8 and 2 joining at different rounds each decode as the target
    alone."""
    from dflash_mlx.scheduler import BatchRequest, Scheduler

    model, tokenizer = pair
    scheduler = Scheduler(model, tokenizer, 4, min_rows=2, shared_calls=False)
    limits, blocks, arrivals = [16, 20, 12, 18], [4, 1, 8, 2], [0, 0, 2, 3]
    tokens = [[] for _ in prompts]
    requests = [BatchRequest(p, lambda r, i=i: tokens[i].append(r.token), max_tokens=n, block_tokens=b)
                for i, (p, n, b) in enumerate(zip(prompts, limits, blocks))]
    for round_ in range(1000):
        for request, arrival in zip(requests, arrivals):
            if arrival == round_:
                scheduler.submit(request)
        if round_ > max(arrivals) and scheduler.idle:
            break
        scheduler.step()
    assert all(r.done and r.error is None for r in requests), [r.error for r in requests]
    for prompt, got, n in zip(prompts, tokens, limits):
        expected, _ = stream_tokens(model, tokenizer, prompt, max_tokens=n, use_draft=False)
        assert_lossless(model.target, mx.array(prompt), expected, got)
