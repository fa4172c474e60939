"""The Metal verify kernels (emulated) on the families beyond Qwen3.5: Llama 3.1, gpt-oss, Gemma 4.

Each target is a tiny bfloat16 checkpoint quantized as its users get it: Llama 3.1 (its ``llama3``
RoPE scaling) and Gemma 4 dense and mixture of experts (sliding and global layers, the global ones
with their own head size, soft-capped logits, the tied head; the MoE's router at 8 bits, group 64)
by ``convert-target`` at w4 group 32; gpt-oss (sinks, sliding and full layers, biases on q/k/v/o
and the router) by ``mlx_lm.convert``'s MXFP4 recipe, mlx-community's layout: dense layers and head
in ``mxfp4``, the router at 8 bits, the experts ``mxfp4`` through MLX's stock ``gather_qmm``.
Every quantized matmul of 1..16 rows is routed to the verify kernel and run by the emulator
(``tests/test_families_paths.qwen3_mac_pair``, Qwen3's pair).

Oracles independent of the kernel: each layer's and the target's own decode steps (one row at a
time) against its verify rows, bit for bit; the target alone for speculative output; the
routed layers counted from the checkpoint's own module tree, each seen in a verify pass's launches.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import quantized
from tests.conftest import make_hf_family_target, random_prompts
from tests.test_emulated_metal import SMALL_VOCAB, WRONG_ROW, check_every_acceptance_length, check_greedy_lossless
from tests.test_families_paths import qwen3_mac_pair
from tests.test_families_window import make_window_target, write_layout

pytestmark = pytest.mark.slow  # every matmul runs in the C++ emulator

TWO_LAYERS = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
# The layers a verify pass sends to the kernel, from each family's module tree (2 layers): q, k,
# v, o, and the MLP's gate, up, down or gpt-oss's router, per layer; the head (Gemma 4's tied
# embedding); Gemma 4 MoE's router per layer, and no v_proj in its full layer (keys are values).
ROUTED = {"llama": 2 * 7 + 1, "gpt_oss": 2 * 5 + 1, "gemma4": 2 * 7 + 1, "gemma4_moe": 2 * 8 - 1 + 1}


def quantized_checkpoint(root, kind: str):
    """``kind``'s tiny checkpoint, quantized the way its users download it (module docstring)."""
    from dflash_mlx.target_conversion import convert_target

    if kind == "gpt_oss":
        from mlx_lm.convert import convert

        from dflash_mlx import tiny
        from tests.test_mlx_layouts import RECIPES

        source = make_window_target(root / "hf", kind, vocab_size=SMALL_VOCAB, **TWO_LAYERS)  # float32: numpy reads it
        mlx = write_layout(source, root / "mlx", "mlx")
        tiny.write_tokenizer(mlx, 512)  # mlx_lm.convert loads one; the model never sees it
        convert(str(mlx), str(root / "q"), **dict(RECIPES["mxfp4"], dtype="bfloat16"))
        return root / "q"
    if kind == "llama":
        source = make_hf_family_target(root / "hf", "llama", vocab_size=SMALL_VOCAB, dtype="bfloat16", seed=3,
                                       num_hidden_layers=2)
    else:
        source = make_window_target(root / "hf", kind, dtype="bfloat16", vocab_size=SMALL_VOCAB, **TWO_LAYERS)
    return convert_target(str(source), root / "q", quant="w4:gs32")


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    return request.param, quantized_checkpoint(tmp_path_factory.mktemp(f"metal_{request.param}"), request.param)


def routed_layers(target) -> dict:
    """The target's quantized layers a pass calls as matmuls, by name: every linear one, the
    embedding where it is the head."""
    layers = {name: m for name, m in target.named_modules() if isinstance(m, quantized.QuantizedLinear)}
    if target.args.tie_word_embeddings:
        assert isinstance(target.model.embed_tokens, quantized.QuantizedEmbedding)
        layers["model.embed_tokens"] = target.model.embed_tokens
    return layers


@pytest.mark.parametrize("checkpoint", list(ROUTED), indirect=True)
def test_a_quantized_family_is_lossless_through_the_verify_kernel(checkpoint, tmp_path):
    """Each routed layer's verify rows (8 at once) bit for bit its decode rows; a verify pass of
    the target sends every routed layer (their count from the module tree) through the kernel, its
    logits bit for bit its decode steps' over the same cache (sliding windows rolled back by a
    trim); greedy speculative output the target's alone at block 8 and at every acceptance
    length; every kernel form that ran passed its self-check."""
    kind, path = checkpoint
    target, draft, metal = qwen3_mac_pair(path, tmp_path / "draft")  # its nn.quantize: nothing left to quantize
    routed = routed_layers(target)
    assert len(routed) == ROUTED[kind], sorted(routed)
    for layer in routed.values():
        matmul = layer.as_linear if isinstance(layer, quantized.QuantizedEmbedding) else layer
        x = mx.random.normal((8, layer["weight"].shape[1] * 32 // layer.bits), key=mx.random.key(1)).astype(mx.bfloat16)
        verify = np.array(matmul(x).astype(mx.float32))
        for r in range(8):
            np.testing.assert_array_equal(verify[r], np.array(matmul(x[r : r + 1]).astype(mx.float32))[0])

    prompts = random_prompts(3, SMALL_VOCAB, seed=8)
    block = mx.array([[3, 9, 27, 81, 17, 51, 25, 75]])
    cache = target.make_cache()
    target(prompts[0][None], cache)
    weights, run = [], metal.run
    metal.run = lambda launch: weights.append(launch.inputs[1]) or run(launch)  # the pass's kernel calls
    try:
        verify = np.array(target(block, cache).astype(mx.float32))[0]
    finally:
        del metal.run
    name_of = {id(layer["weight"]): name for name, layer in routed.items()}
    assert sorted(name_of.get(id(w), "another array") for w in weights) == sorted(routed)  # each once, none stock
    for c in cache:
        c.trim(8)
    for r in range(8):
        np.testing.assert_array_equal(verify[r], np.array(target(block[:, r : r + 1], cache).astype(mx.float32))[0, 0])

    check_greedy_lossless(target, draft, prompts[:1], [8], n=16)
    assert check_every_acceptance_length(target, prompts[1:2]) == set(range(4))
    report = {k: v for k, v in metal.report().items() if k.startswith("quantized_verify")}
    rows = {int(k.split("Rows=")[1].split()[0]) for k in report}
    assert {1, 2, 4, 8} <= rows and set(report.values()) == {"ok"}, report


@pytest.mark.parametrize("checkpoint", ["gpt_oss"], indirect=True)
def test_a_mutated_verify_kernel_fails_a_families_lossless_test(checkpoint, tmp_path):
    """gpt-oss (its kernel forms: MXFP4 projections and head, the 8-bit router) through a kernel
    whose rows past the first read the first row's input: speculative output leaves the target's."""
    from tests.metal_emulation import mutated_sources

    broken, _, _ = qwen3_mac_pair(checkpoint[1], tmp_path / "draft", mutated_sources(quantized.KERNEL, *WRONG_ROW),
                                  self_check=False)
    with pytest.raises(AssertionError):
        check_every_acceptance_length(broken, random_prompts(3, SMALL_VOCAB, seed=8))
