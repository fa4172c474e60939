"""Sliding-window targets: attention over a window of positions, rolled back exactly.

A ``cache.WindowCache`` drops, at each pass, only the rows no query of that pass sees, so a verify
block rejected after the window moved still finds every row its rollback needs. Shown on tiny
float32 checkpoints that transformers writes, with a window (3 tokens) shorter than a block plus
its prompt: Qwen3 with alternating sliding and full layers (``qwen3_window``), gpt-oss (sinks,
YaRN, its mixture of experts) and Gemma 4 dense and mixture of experts (``gemma4``,
``gemma4_moe``). For each: the logits against transformers (and far from them without the window,
gpt-oss without its sinks, Gemma 4 without its value norm, layer scalars or soft-capping: the
comparison has teeth); cached
decoding, step by step and in chunks, equal to the full forward, the caches bounded by the window;
every acceptance length rolled back to the caches of the committed tokens, and a window that drops
rows as a ring of ``window`` rows would (too early) caught by that check; greedy speculative output
token-identical to the target alone with a tiny z-lab draft; a batch equal to each prompt alone,
through ``batch_generate`` and the scheduler on a Mac's batch rules; a prompt cache resuming from a
checkpoint past the window.

gpt-oss's layouts: mlx-community's (mlx-lm's names) and OpenAI's MXFP4 release against mlx-lm's
model of the same files, ``mlx_lm.convert``'s 4-bit, 8-bit and MXFP4 checkpoints, and
``convert-target``'s output tensor for tensor mlx-lm's converter's. Gemma 4's: mlx-lm's model of
the same files, the multimodal release layout, ``mlx_lm.convert``'s 4- and 8-bit checkpoints and
``convert-target``.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import tiny
from dflash_mlx.cache import WindowCache
from dflash_mlx.loading import load_target
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from tests.conftest import VOCAB, make_hf_family_target, random_prompts, spread_weights
from tests.test_families import TOLERANCE, logits, pair, stream_tokens, torch_forward  # noqa: F401 (pair: a fixture, on this module's hf_dir)
from tests.test_families import test_the_schedulers_batches_on_a_gpus_rules as gpu_batch_rules
from tests.test_lossless import OracleDraft, assert_caches_hold_the_committed_tokens, assert_lossless, stop_after, take
from tests.test_target import assert_cached_decoding_matches_the_full_forward

GREEDY = Sampler()
WINDOW = 3  # shorter than any block plus its prompt
KINDS = ("qwen3_window", "gpt_oss", "gemma4", "gemma4_moe")


def make_window_target(path, kind: str, dtype: str = "float32", truncate: bool = False, vocab_size: int = VOCAB,
                       **overrides):
    """A tiny random checkpoint of ``kind`` with sliding-window layers, saved by transformers
    (gpt-oss: its config as OpenAI's release writes it, ``rope_theta`` and ``rope_scaling``, YaRN
    with ``truncate`` as given: false in the release). ``overrides`` (and a ``vocab_size`` under 300:
    no tokenizer) for gpt-oss and Gemma 4: the emulated Metal tests' smaller targets."""
    if kind == "qwen3_window":
        return make_hf_family_target(path, "qwen3", dtype=dtype, use_sliding_window=True, sliding_window=WINDOW,
                                     layer_types=["sliding_attention", "full_attention"] * 2)
    if kind in ("gemma4", "gemma4_moe"):
        return make_gemma4_target(path, moe=kind == "gemma4_moe", dtype=dtype, vocab_size=vocab_size, **overrides)
    if kind != "gpt_oss":
        raise ValueError(f"unknown kind {kind!r}")
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    eos = tiny.write_tokenizer(path, vocab_size) if vocab_size >= 300 else None
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}  # YaRN's ramp within 32 dims
    config = GptOssConfig(**{**dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                                    num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
                                    rope_parameters=rope, eos_token_id=eos), **overrides})
    torch.manual_seed(0)
    model = spread_weights(GptOssForCausalLM(config).float().eval(), stacked=True)
    with torch.no_grad():  # biases and sinks that matter, expert activations past the clamp (7)
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
            elif name.endswith("gate_up_proj"):
                p.mul_(3.0)
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_gemma4_target(path, moe: bool, dtype: str = "float32", vocab_size: int = VOCAB, **overrides):
    """A tiny random ``Gemma4ForCausalLM`` (sliding and full layers alternating, the full ones with
    their own head size and proportional RoPE, soft-capped logits; ``moe``: the routed block beside
    each MLP and keys reused as values in full layers), its config as the releases write it
    (``global_head_dim``, ``num_global_key_value_heads``: what mlx-lm reads)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    eos = tiny.write_tokenizer(path, vocab_size) if vocab_size >= 300 else None
    params = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
                  final_logit_softcapping=30.0, max_position_embeddings=4096, eos_token_id=eos)
    if moe:
        params.update(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                      attention_k_eq_v=True, num_global_key_value_heads=1)
    params.update(overrides)
    torch.manual_seed(0)
    model = spread_weights(Gemma4ForCausalLM(Gemma4TextConfig(**params)).float().eval(), stacked=True)
    with torch.no_grad():  # gains that matter
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    config.pop("per_layer_config", None)
    config.update(global_head_dim=32, num_global_key_value_heads=1 if moe else None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_dir(kind, tmp_path_factory):
    return make_window_target(tmp_path_factory.mktemp(f"hf_{kind}"), kind)


@pytest.fixture(scope="module")
def target(hf_dir):
    return load_target(hf_dir)[0]


def test_logits_match_transformers_and_not_without_the_window(hf_dir, target):
    assert [type(c).__name__ for c in target.make_cache()] == ["WindowCache", "KVCache"] * 2
    reference, _ = torch_forward(hf_dir)
    np.testing.assert_allclose(logits(target), reference, atol=TOLERANCE, rtol=0)
    for what in mutations(target):
        broken, _ = load_target(hf_dir)
        for layer in broken.layers:
            if what == "window":
                layer.self_attn.window = None
            elif what == "sinks":
                layer.self_attn.pop("sinks")
            elif what == "v_norm":
                layer.self_attn.v_norm = nn.Identity()
            elif what == "layer_scalar":
                layer.layer_scalar = mx.ones((1,))
        if what == "soft-capping":
            broken.args.final_logit_softcapping = None
        assert np.abs(logits(broken) - reference).max() > 100 * TOLERANCE, f"without its {what}"


def mutations(target) -> tuple:
    """What each kind's model is checked to be wrong without."""
    if "sinks" in target.layers[0].self_attn:
        return ("window", "sinks")
    if "v_norm" in target.layers[0].self_attn:
        return ("window", "v_norm", "layer_scalar", "soft-capping")
    return ("window",)


def test_cached_decoding_matches_the_full_forward_within_bounded_caches(target):
    assert_cached_decoding_matches_the_full_forward(target, atol=5e-5)
    cache, tokens = target.make_cache(), mx.array(random_prompts(1, VOCAB - 1, seed=2, low=640, high=641)[0])
    for s in range(0, 640, 16):  # verify-sized passes: the buffer is compacted, never longer than this
        target(tokens[None, s : s + 16], cache)
    for c in cache:
        if isinstance(c, WindowCache):
            assert c.offset == 640 and c.checkpoint()[0].shape[2] == WINDOW - 1
            assert c.keys.shape[2] <= WINDOW + 16 + 2 * WindowCache.step
        else:
            assert c.keys.shape[2] >= 640


def test_hf_bf16_checkpoint(kind, target, tmp_path):
    """The layout the releases are in, bf16: kept bf16 (experts in float32 on the CPU, where
    MLX's gather_mm has no other dtype), near the float32 model of the same seed."""
    model, _ = load_target(make_window_target(tmp_path, kind, dtype="bfloat16"))
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    got, full = logits(model), logits(target)
    assert np.sqrt(((got - full) ** 2).mean() / (full**2).mean()) < 0.05


@pytest.mark.parametrize("T,L", [(1, 40), (5, 40), (16, 1024)])
def test_windowed_attention_with_sinks_is_mlxs_fused_attention(T, L):
    """``layers.attention`` with a window mask and sinks on the CPU (split over the side streams at
    16 x 1024) against ``mx.fast.scaled_dot_product_attention``'s, which a GPU runs."""
    from dflash_mlx.models import layers

    mx.random.seed(1)
    q, k, v = mx.random.normal((1, 8, T, 32)), mx.random.normal((1, 2, L, 32)), mx.random.normal((1, 2, L, 32))
    sinks, mask = mx.random.normal((8,)), layers.window_mask(T, L, 7)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask, sinks=sinks)
    got = layers.attention(q, k, v, 0.2, mask, sinks)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=0)
    assert np.abs(np.array(layers.attention(q, k, v, 0.2, mask)) - np.array(want)).max() > 1e-2  # sinks matter


def rollback_check(target, block: int, cache_class=WindowCache) -> set:
    """Every acceptance length (an oracle draft wrong at scheduled slots) is lossless and leaves the
    caches of the committed tokens, with sliding-window layers' caches of ``cache_class``; the
    acceptance lengths seen."""
    seen = set()
    n = block * (block + 1) // 2 + 1

    def make_cache():
        return [cache_class(c.window) if isinstance(c, WindowCache) else c for c in target.make_cache()]

    for k, prompt in enumerate(random_prompts(4, VOCAB - 1, seed=5)):
        expected, _ = take(target_only(target, prompt, GREEDY), n + block)
        schedule = list(range(block))[k % block :] + list(range(block))[: k % block]
        oracle = OracleDraft(prompt.tolist() + expected, block, schedule)
        got, commits = take(speculative(target, oracle, prompt, GREEDY, block_tokens=block, cache=make_cache()), n)
        assert_lossless(target, prompt, expected[:n], got)
        seen.update(c.accepted for c in commits[1:])
        for cycles in sorted({1, block // 2, block}):
            cache = make_cache()
            stopped = stop_after(speculative(target, oracle, prompt, GREEDY, block_tokens=block, cache=cache), cycles)
            assert_caches_hold_the_committed_tokens(target, cache, prompt, stopped[:-1], 2e-5, f"cycle {cycles}")
    return seen


@pytest.mark.parametrize("block", [4, 8])
def test_every_acceptance_length_rolls_the_window_back(target, block):
    assert rollback_check(target, block) == set(range(block))


class RingWindow(WindowCache):
    """The mutation: after each pass only the rows the next query sees stay (as in a ring of
    ``window`` rows), so a rolled-back block has lost what its first query needs."""

    def update_and_fetch(self, keys, values):
        out = super().update_and_fetch(keys, values)
        drop = max(self.offset - self.window + 1 - self.start, 0)
        self.keys, self.values, self.start = self.keys[..., drop:, :], self.values[..., drop:, :], self.start + drop
        return out

    def trim(self, n):
        self.offset -= n
        if self.offset < self.start:  # rows gone: go on from here without them
            self.keys, self.values, self.start = self.keys[..., :0, :], self.values[..., :0, :], self.offset
        return n


def test_a_window_dropped_too_early_fails_the_rollback_check(target):
    with pytest.raises(AssertionError):
        rollback_check(target, 8, RingWindow)


@pytest.fixture(scope="module")
def prompts():
    return [p.tolist() for p in random_prompts(3, VOCAB - 1, seed=11, low=4, high=24)]


def test_speculative_output_is_the_targets_alone(pair, prompts):
    model, tokenizer = pair
    for prompt in prompts[:2]:
        expected, _ = stream_tokens(model, tokenizer, prompt, use_draft=False)
        for block in (4, 16):
            got, last = stream_tokens(model, tokenizer, prompt, block_tokens=block)
            assert_lossless(model.target, mx.array(prompt), expected, got)
            assert last.drafted_tokens > 0


def test_batch_generate_gives_each_prompt_its_answer_alone(pair, prompts):
    from dflash_mlx.scheduler import batch_generate

    model, tokenizer = pair
    limits = [20, 12, 16]
    out = batch_generate(model, tokenizer, prompts, max_tokens=limits, block_tokens=8)
    for prompt, got, n in zip(prompts, out.token_ids, limits):
        alone, _ = stream_tokens(model, tokenizer, prompt, max_tokens=n, block_tokens=8)
        assert got == alone


def test_the_schedulers_batches_on_a_gpus_rules(pair, prompts):
    """test_families' run of the scheduler on a Mac's batch rules (padding rows, requests joining
    at different rounds with blocks 4, 1, 8), on sliding-window targets: each as the target alone."""
    gpu_batch_rules(pair, prompts)


def test_a_prompt_cache_resumes_past_the_window(pair, prompts):
    """The next turn restarts from a checkpoint whose window rows the history kept (the live
    caches have long dropped them), and decodes as a fresh run; so does a resend."""
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


def test_a_prompt_cache_resumes_where_the_windows_have_moved_on(pair):
    """A prompt that leaves a long history at 300 tokens: its windows were compacted far past
    there (prefilled in chunks of 256), so only the checkpoint's rows can bring them back; the
    output is a fresh run's."""
    from dflash_mlx.prompt_cache import PromptCache

    model, tokenizer = pair
    cache = PromptCache()
    opening = random_prompts(1, VOCAB - 1, seed=13, low=700, high=701)[0].tolist()
    stream_tokens(model, tokenizer, opening, max_tokens=4, block_tokens=4, prompt_cache=cache, prefill_step_size=256)
    windows = [c for c in cache.cache if isinstance(c, WindowCache)]
    assert windows and all(c.start > 300 for c in windows)
    branch = opening[:300] + random_prompts(1, VOCAB - 1, seed=14, low=9, high=10)[0].tolist()
    got, last = stream_tokens(model, tokenizer, branch, block_tokens=4, prompt_cache=cache, prefill_step_size=256)
    assert last.cached_prompt_tokens >= 256
    fresh, _ = stream_tokens(model, tokenizer, branch, block_tokens=4, prefill_step_size=256)
    assert got == fresh


# ---- gpt-oss's checkpoint layouts -----------------------------------------------------------------


@pytest.fixture(scope="module")
def oss_truncated(tmp_path_factory):
    """A gpt-oss checkpoint whose YaRN ramp is rounded (``truncate: true``), which mlx-lm's model
    computes as transformers does (mlx-lm always rounds it; the release does not)."""
    return make_window_target(tmp_path_factory.mktemp("oss_truncated"), "gpt_oss", truncate=True)


def write_layout(source, out, layout: str):
    """``source``'s transformers-layout gpt-oss checkpoint rewritten in a published layout:
    ``"mlx"`` (mlx-community's: mlx-lm's names, experts [E, out, in]) or ``"mxfp4"`` (OpenAI's
    release: the experts as MXFP4 blocks and scales, gate and up interleaved by rows). Derived here
    from transformers' tensors with numpy and ``mx.quantize``, apart from ``gpt_oss.sanitize``."""
    import shutil

    from safetensors.numpy import load_file

    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights, new = load_file(str(source / "model.safetensors")), {}
    for key, value in weights.items():
        if ".mlp.experts." not in key:
            new[key] = value
            continue
        prefix, name = key.rsplit(".", 1)
        if name.endswith("_bias"):
            if layout == "mlx" and name == "gate_up_proj_bias":
                new[f"{prefix}.gate_proj.bias"], new[f"{prefix}.up_proj.bias"] = value[:, ::2], value[:, 1::2]
            elif layout == "mlx":
                new[f"{prefix}.down_proj.bias"] = value
            else:
                new[key] = value
            continue
        rows = np.ascontiguousarray(value.transpose(0, 2, 1))  # [E, out, in]; gate_up's rows interleaved
        if layout == "mlx" and name == "gate_up_proj":
            new[f"{prefix}.gate_proj.weight"], new[f"{prefix}.up_proj.weight"] = rows[:, ::2], rows[:, 1::2]
        elif layout == "mlx":
            new[f"{prefix}.down_proj.weight"] = rows
        else:
            packed, scales = mx.quantize(mx.array(rows), group_size=32, bits=4, mode="mxfp4")
            E, n, words = packed.shape
            new[f"{key}_blocks"] = np.array(packed.view(mx.uint8)).reshape(E, n, words // 4, 16)
            new[f"{key}_scales"] = np.array(scales)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(np.ascontiguousarray(v)) for k, v in new.items()})
    if layout == "mxfp4":
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                         "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def oss_mutations(model) -> dict:
    """gpt-oss's model wrong in one of its own things each: no sinks, the plain SiLU gate instead
    of the clamped one (alpha 1), the router's softmax over every expert (not over the top k)."""
    import copy

    from dflash_mlx.models import layers

    broken = {}
    for what in ("no sinks", "alpha 1", "softmax over all experts"):
        m = copy.deepcopy(model)
        for layer in m.layers:
            if what == "no sinks":
                layer.self_attn.pop("sinks")
            elif what == "alpha 1":
                layer.mlp.switch_mlp.activation.alpha = 1.0
            else:
                layer.mlp.route = lambda x, moe=layer.mlp: layers.SparseMoe.route(moe, x)
        broken[what] = m
    return broken


def test_gpt_oss_matches_mlx_lm_in_mlx_communitys_layout(oss_truncated, tmp_path):
    from tests.test_families import mlx_lm_model

    path = write_layout(oss_truncated, tmp_path / "mlx", "mlx")
    ours, theirs = load_target(path)[0], mlx_lm_model(path)
    assert type(theirs).__module__ == "mlx_lm.models.gpt_oss"
    reference = logits(theirs)
    np.testing.assert_allclose(logits(ours), reference, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(logits(ours), torch_forward(oss_truncated)[0], atol=TOLERANCE, rtol=0)
    np.testing.assert_array_equal(logits(ours), logits(load_target(oss_truncated)[0]))  # one model, two layouts
    for what, broken in oss_mutations(ours).items():
        assert np.abs(logits(broken) - reference).max() > 100 * TOLERANCE, what


def test_gpt_oss_openai_mxfp4_release_layout(oss_truncated, tmp_path):
    """OpenAI's release: MXFP4 experts (blocks and scales, ``quant_method: mxfp4``) load as MLX's
    ``mxfp4`` quantized experts, at mlx-lm's logits for the same files, each expert's weights
    (dequantized) near the float model's (gate and up not swapped, rows not shifted)."""
    from tests.test_families import mlx_lm_model

    path = write_layout(oss_truncated, tmp_path / "mxfp4", "mxfp4")
    model, _ = load_target(path)
    experts = model.layers[0].mlp.switch_mlp
    assert experts.gate_proj.mode == "mxfp4" and experts.down_proj.bits == 4
    assert isinstance(model.layers[0].mlp.gate, nn.Linear) and not hasattr(model.layers[0].mlp.gate, "scales")
    np.testing.assert_allclose(logits(model), logits(mlx_lm_model(path)), atol=TOLERANCE, rtol=0)
    full = load_target(oss_truncated)[0].layers[0].mlp.switch_mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        q, want = getattr(experts, name), np.array(getattr(full, name).weight)
        got = np.array(mx.dequantize(q.weight, q.scales, group_size=32, bits=4, mode="mxfp4").astype(mx.float32))
        assert np.sqrt(((got - want) ** 2).mean() / (want**2).mean()) < 0.2, name


@pytest.mark.parametrize("recipe,bits", [("affine4", 4), ("affine8", 8), ("mxfp4", 4)])
def test_gpt_oss_mlx_lm_converted_checkpoints(oss_truncated, tmp_path, recipe, bits):
    """``mlx_lm.convert`` of mlx-community's float layout at 4 and 8 bits and in MXFP4 (the router
    at 8 bits, group 64: mlx-lm's recipe): mlx-lm's logits."""
    from tests.test_families import mlx_lm_model
    from tests.test_mlx_layouts import mlx_lm_convert

    out = mlx_lm_convert(write_layout(oss_truncated, tmp_path / "mlx", "mlx"), tmp_path / "q", recipe, moe=True)
    model, _ = load_target(out)
    mlp = model.layers[0].mlp
    assert mlp.switch_mlp.gate_proj.bits == bits and mlp.gate.bits == 8
    assert model.layers[0].self_attn.q_proj.bits == bits
    np.testing.assert_allclose(logits(model), logits(mlx_lm_model(out)), atol=TOLERANCE, rtol=0)


def assert_same_conversion(ours, theirs, model_type: str) -> None:
    """Our ``convert-target`` folder holds mlx-lm's converter's config quantization and tensors,
    bit for bit."""
    from mlx.utils import tree_flatten

    config, reference = (json.loads((folder / "config.json").read_text()) for folder in (ours, theirs))
    assert config["model_type"] == model_type
    assert {k: v for k, v in config["quantization"].items() if not isinstance(v, dict)} == \
        {k: v for k, v in reference["quantization"].items() if not isinstance(v, dict)}
    got = dict(tree_flatten(load_target(ours)[0].parameters()))
    want = dict(tree_flatten(load_target(theirs)[0].parameters()))
    assert got.keys() == want.keys()
    for key in want:
        assert mx.array_equal(got[key], want[key]).item(), key


def test_gpt_oss_convert_target_writes_what_mlx_lm_convert_writes(oss_truncated, tmp_path):
    """``convert-target`` from transformers' layout: mlx-lm's converter's tensors (from the same
    weights in mlx-community's layout) bit for bit, the router's 8-bit override too."""
    from dflash_mlx.target_conversion import convert_target
    from tests.test_mlx_layouts import mlx_lm_convert

    convert_target(str(oss_truncated), tmp_path / "ours", quant="w4:gs32")
    mlx_lm_convert(write_layout(oss_truncated, tmp_path / "mlx", "mlx"), tmp_path / "mlx_lm", "affine4", moe=True)
    assert_same_conversion(tmp_path / "ours", tmp_path / "mlx_lm", "gpt_oss")


# ---- Gemma 4's checkpoint layouts -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["gemma4", "gemma4_moe"])
def gemma_dir(request, tmp_path_factory):
    return make_window_target(tmp_path_factory.mktemp(request.param), request.param)


def test_gemma4_matches_mlx_lm_and_loads_the_multimodal_release_layout(gemma_dir, tmp_path):
    """mlx-lm's model of the same files gives our logits; the release's multimodal layout
    (``model.language_model.*`` beside a vision tower, the text config nested) gives the same
    model, bit for bit."""
    from safetensors.numpy import load_file, save_file

    from tests.test_families import mlx_lm_model

    ours = logits(load_target(gemma_dir)[0])
    theirs = mlx_lm_model(gemma_dir)
    assert type(theirs).__module__ == "mlx_lm.models.gemma4_text"
    np.testing.assert_allclose(ours, logits(theirs), atol=TOLERANCE, rtol=0)
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(gemma_dir / "model.safetensors")).items()}
    weights["model.vision_tower.encoder.weight"] = np.zeros((4, 4), np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    text = json.loads((gemma_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text,
                                                      "architectures": ["Gemma4ForConditionalGeneration"]}))
    np.testing.assert_array_equal(logits(load_target(tmp_path)[0]), ours)


@pytest.mark.parametrize("recipe,bits", [("affine4", 4), ("affine8", 8)])
def test_gemma4_mlx_lm_converted_checkpoints(gemma_dir, tmp_path, recipe, bits):
    from tests.test_families import mlx_lm_model
    from tests.test_mlx_layouts import mlx_lm_convert

    out = mlx_lm_convert(gemma_dir, tmp_path / "q", recipe, moe=True)
    model, _ = load_target(out)
    layer = model.layers[0]
    assert layer.self_attn.q_proj.bits == bits and layer.mlp.up_proj.bits == bits
    if "moe" in layer:
        assert layer.moe.gate.bits == 8 and layer.moe.switch_mlp.gate_proj.bits == bits
    got = logits(model)
    np.testing.assert_allclose(got, logits(mlx_lm_model(out)), atol=TOLERANCE, rtol=0)
    if bits == 4:  # the same as mlx-lm's multimodal model names it (language_model.*, a vision tower)
        np.testing.assert_array_equal(logits(load_target(as_multimodal_mlx(out, tmp_path / "mm"))[0]), got)


def as_multimodal_mlx(path, out):
    """An MLX text checkpoint renamed as mlx-lm's multimodal Gemma 4 holds it: ``language_model.``
    before every tensor and quantization override, a vision tower beside, the config nested."""
    out.mkdir()
    weights = {f"language_model.{k}": v for k, v in mx.load(str(path / "model.safetensors")).items()}
    weights["vision_tower.encoder.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    text = json.loads((path / "config.json").read_text())
    quantization = {k if not isinstance(v, dict) else f"language_model.{k}": v
                    for k, v in text.pop("quantization").items()}
    text.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text,
                                                 "quantization": quantization}))
    return out


def test_gemma4_convert_target_writes_what_mlx_lm_convert_writes(gemma_dir, tmp_path):
    from dflash_mlx.target_conversion import convert_target
    from tests.test_mlx_layouts import mlx_lm_convert

    convert_target(str(gemma_dir), tmp_path / "ours", quant="w4:gs32")
    mlx_lm_convert(gemma_dir, tmp_path / "mlx_lm", "affine4", moe=True)
    assert_same_conversion(tmp_path / "ours", tmp_path / "mlx_lm", "gemma4_text")
