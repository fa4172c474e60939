"""A tiny pair whose target answers one fixed text, for testing what the server does with a
model's output formats (reasoning blocks, later tool calls) on the real decode path.

Every sublayer's output projection is zero, so the target's state at a token is that token's
embedding, and its head maps each token of a chain to the next one: a deterministic bigram
model. The chain starts at the generation prompt's last token, so the text must not repeat a
token (nor use that one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from dflash_mlx import tiny

# Qwen3.5's chat format (see the published template): the generation prompt opens <think>;
# enable_thinking=False closes it empty; earlier answers carry their reasoning_content.
QWEN35_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}"
)


def write_scripted_pair(root: Path, reply: str, template: str = QWEN35_TEMPLATE) -> tuple[Path, Path]:
    from tokenizers import Tokenizer

    target_dir, draft_dir = tiny.write_pair(root)
    (target_dir / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    newline = tokenizer.encode("\n", add_special_tokens=False).ids
    chain = newline[-1:] + tokenizer.encode(reply, add_special_tokens=False).ids + [tokenizer.token_to_id("<|im_end|>")]
    if len(set(chain)) != len(chain):
        raise ValueError(f"the reply's tokens repeat (or use the prompt's last one): {chain}")
    weights = load_file(str(target_dir / "model.safetensors"))
    for name in weights:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")) or name == "model.norm.weight":
            weights[name] = np.zeros_like(weights[name])  # zero-centred final norm: a weight of one
    embeddings = weights["model.embed_tokens.weight"]
    normed = embeddings / np.sqrt((embeddings**2).mean(axis=-1, keepdims=True) + 1e-6)
    head = np.random.default_rng(0).standard_normal(weights["lm_head.weight"].shape).astype(np.float32) * 0.01
    for current, following in zip(chain, chain[1:]):
        head[following] = normed[current]
    weights["lm_head.weight"] = head
    save_file(weights, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    return target_dir, draft_dir
