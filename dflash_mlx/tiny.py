"""Tiny random checkpoints in the real file layouts.

Weights cannot be downloaded everywhere (CI, air-gapped machines), yet the loaders, the
loop and the CLI must run on real files: these writers produce a Hugging Face Qwen3.5
text checkpoint, a z-lab DFlash draft (either config schema) and a byte-level tokenizer
with a chat template, small enough to run on a CPU in milliseconds. At run time they write the
scripted pair (``scripted``: ``dflash-mlx agent --model scripted``); the tests and examples use
them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
from safetensors.numpy import save_file

# Qwen3.5's conventions in small: tools in the system turn, calls in the qwen3_coder format.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as:\n<tool_call>\n<function=name>\n<parameter=arg>\nvalue\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>{% else %}{{ m['content'] or '' }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n<function={{ c['function']['name'] }}>\n</function>\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
]

_CORPUS = """def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()
The quick brown fox jumps over the lazy dog. Speculative decoding drafts a block of tokens
and the target model verifies them in one pass, keeping the longest agreeing prefix.
"""


def target_config(vocab_size: int = 512, **overrides) -> Dict:
    """A 4-layer Qwen3.5 text config: three Gated DeltaNet layers and one full attention."""
    config = dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        eos_token_id=None,
        dtype="float32",
    )
    config.update(overrides)
    n = config["num_hidden_layers"]
    config.setdefault(
        "layer_types", ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    )
    return config


def normal(rng, shape, scale) -> np.ndarray:
    """Random float32 weights of ``shape``, standard normal times ``scale``."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def write_target(path: Path, config: Optional[Dict] = None, seed: int = 0) -> Dict:
    """Random weights in the layout ``Qwen3_5ForCausalLM.save_pretrained`` writes."""
    config = config or target_config()
    rng = np.random.default_rng(seed)
    H, V = config["hidden_size"], config["vocab_size"]
    I = config["intermediate_size"]
    kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    vd = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    hv = config["linear_num_value_heads"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    K = config["linear_conv_kernel_dim"]
    w = {"model.embed_tokens.weight": normal(rng, (V, H), 0.5), "model.norm.weight": normal(rng, (H,), 0.1)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(rng, (V, H), H**-0.5)
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal(rng, (H,), 0.1)
        w[p + "post_attention_layernorm.weight"] = normal(rng, (H,), 0.1)
        w[p + "mlp.gate_proj.weight"] = normal(rng, (I, H), H**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(rng, (I, H), H**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(rng, (H, I), I**-0.5)
        if kind == "linear_attention":
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = normal(rng, (2 * kd + vd, H), H**-0.5)
            w[a + "in_proj_z.weight"] = normal(rng, (vd, H), H**-0.5)
            w[a + "in_proj_b.weight"] = normal(rng, (hv, H), H**-0.5)
            w[a + "in_proj_a.weight"] = normal(rng, (hv, H), H**-0.5)
            w[a + "conv1d.weight"] = normal(rng, (2 * kd + vd, 1, K), 0.5)
            w[a + "dt_bias"] = np.ones(hv, np.float32)
            w[a + "A_log"] = np.log(rng.uniform(1, 16, hv)).astype(np.float32)
            w[a + "norm.weight"] = 1.0 + normal(rng, (config["linear_value_head_dim"],), 0.1)
            w[a + "out_proj.weight"] = normal(rng, (H, vd), vd**-0.5)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = normal(rng, (2 * nh * hd, H), H**-0.5)
            w[a + "k_proj.weight"] = normal(rng, (nkv * hd, H), H**-0.5)
            w[a + "v_proj.weight"] = normal(rng, (nkv * hd, H), H**-0.5)
            w[a + "o_proj.weight"] = normal(rng, (H, nh * hd), (nh * hd) ** -0.5)
            w[a + "q_norm.weight"] = normal(rng, (hd,), 0.1)
            w[a + "k_norm.weight"] = normal(rng, (hd,), 0.1)
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config


def draft_config(
    target: Dict,
    num_layers: int = 2,
    block_size: int = 16,
    mask_token_id: Optional[int] = None,
    target_layer_ids: Optional[List[int]] = None,
    schema: str = "nested",
    layer_types: Optional[List[str]] = None,
    sliding_window: Optional[int] = None,
    is_causal: Optional[bool] = None,
) -> Dict:
    """A z-lab draft config for ``target``, in the nested (2026) or legacy schema."""
    H = target["hidden_size"]
    ids = target_layer_ids if target_layer_ids is not None else [1, target["num_hidden_layers"] - 2]
    mask = target["vocab_size"] - 1 if mask_token_id is None else mask_token_id
    config = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=H // 4,
        rms_norm_eps=1e-6,
        vocab_size=target["vocab_size"],
        max_position_embeddings=4096,
        num_target_layers=target["num_hidden_layers"],
        attention_bias=False,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if schema == "legacy":
        config.update(block_size=block_size, rope_theta=1_000_000.0)
        config["dflash_config"] = {"mask_token_id": mask, "target_layer_ids": ids}
    elif schema == "nested":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
        config["dflash_config"] = {"block_size": block_size, "mask_token_id": mask, "target_layer_ids": ids}
        config["layer_types"] = layer_types or ["full_attention"] * num_layers
        if sliding_window:
            config["sliding_window"] = sliding_window
    else:
        raise ValueError(f"unknown draft schema {schema!r}")
    if is_causal is not None:
        config["is_causal"] = is_causal  # top level, where z-lab's loaders read it
    return config


def write_draft(path: Path, config: Dict, seed: int = 1, dtype=np.float32) -> Dict:
    """Random draft weights with z-lab's tensor names (no ``model.`` prefix)."""
    rng = np.random.default_rng(seed)
    H, I = config["hidden_size"], config["intermediate_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n_taps = len(config["dflash_config"]["target_layer_ids"])
    w = {
        "fc.weight": normal(rng, (H, n_taps * H), (n_taps * H) ** -0.5),
        "hidden_norm.weight": 1.0 + normal(rng, (H,), 0.1),
        "norm.weight": 1.0 + normal(rng, (H,), 0.1),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + normal(rng, (H,), 0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal(rng, (H,), 0.1)
        w[p + "self_attn.q_proj.weight"] = normal(rng, (nh * hd, H), H**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(rng, (nkv * hd, H), H**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(rng, (nkv * hd, H), H**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(rng, (H, nh * hd), (nh * hd) ** -0.5)
        w[p + "self_attn.q_norm.weight"] = 1.0 + normal(rng, (hd,), 0.1)
        w[p + "self_attn.k_norm.weight"] = 1.0 + normal(rng, (hd,), 0.1)
        w[p + "mlp.gate_proj.weight"] = normal(rng, (I, H), H**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(rng, (I, H), H**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(rng, (H, I), I**-0.5)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.astype(dtype) for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config


def write_tokenizer(path: Path, vocab_size: int = 512, extra_special_tokens: Sequence[str] = ()) -> int:
    """A byte-level BPE tokenizer with Qwen-style special tokens and chat template.

    Returns the id of ``<|im_end|>`` (the EOS of chat turns). Ids stay below
    ``vocab_size - 1`` so that the last row of the embedding is free for the draft's mask.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return fast.convert_tokens_to_ids("<|im_end|>")


def write_pair(root: Path, vocab_size: int = 512, block_size: int = 16, seed: int = 0) -> tuple[Path, Path]:
    """A tiny target (with tokenizer) and a matching draft under ``root``."""
    target_dir, draft_dir = root / "target", root / "draft"
    eos = write_tokenizer(target_dir, vocab_size)
    config = write_target(target_dir, target_config(vocab_size, eos_token_id=eos), seed=seed)
    write_draft(draft_dir, draft_config(config, block_size=block_size), seed=seed + 1)
    return target_dir, draft_dir
