"""Named models: the default pairing, and the demo pair that ships in the package.

Default: Qwopus3.5-9B-Coder (MLX 4-bit) with z-lab's Qwen3.5-9B draft converted for it, both
made on first use (``convert_target`` / ``convert_draft``) and kept under ``$DFLASH_MLX_HOME``
(default ``~/.cache/dflash-mlx``).

``demo``: a tiny Qwen3.5 target trained on the Python standard library and its DFlash draft
(``dflash_mlx/demo/``, rebuilt by ``examples/make_demo.py``), so that everything runs offline.

A family's pair by name (``PAIRS``: ``qwen3-8b``, ``llama-3.1-8b``, ``gpt-oss-20b``, ...): the
target's and z-lab's draft's Hugging Face repos, downloaded on first use as published.

``scripted``: a tiny pair with fixed answers that calls a coding agent's shell tool when asked
(``agents.scripted_pair``), made under ``$DFLASH_MLX_HOME/scripted`` on first use.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from .convert import DEFAULT_DRAFT, DEFAULT_TARGET, convert_draft
from .paths import home
from .target_conversion import convert_target

DEMO = "demo"
DEMO_DIR = Path(__file__).parent / "demo"
SCRIPTED = "scripted"
# The demo target's config says 4,096 positions, which cannot hold an agent's first request
# (18k-47k tokens with its tokenizer); its RoPE has no table to run out of, so `serve` and `agent`
# give it this much unless --context-size says otherwise (past its 1,024-token training windows its
# text is what it is).
DEMO_CONTEXT = 65536
# The demo draft was trained on windows of 1024 tokens (its model card): it never saw more context
# than that, and with the last 1024 tokens it accepts as much as with all of them at every length
# measured, for a draft pass that stops growing with the context (docs/design.md, "The draft's
# context"). Other drafts keep their whole context unless told otherwise.
DEMO_DRAFT_WINDOW = 1024
TARGET_FOLDER = "Qwopus3.5-9B-Coder-mlx-4bit"
DRAFT_FOLDER = "Qwen3.5-9B-DFlash-for-Qwopus"


@dataclass(frozen=True)
class Pair:
    """A target and the DFlash draft z-lab trained for it (Hugging Face repo ids, loaded as
    published). ``thinking``: the template's thinking switch the draft was trained with (None: the
    template's default); ``family``: the model file that runs the target."""

    target: str
    draft: str
    family: str
    thinking: Optional[bool] = None


# Each family's pair by name (``--model qwen3-8b``). The draft ids are those z-lab's README lists
# (github.com/z-lab/dflash); the Gemma 4 ones are named by the GGUF conversions made from them.
# z-lab's Qwen3-4B/8B drafts were trained with thinking off (their model cards).
PAIRS: Dict[str, Pair] = {
    "qwen3-4b": Pair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "qwen3", thinking=False),
    "qwen3-8b": Pair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3", thinking=False),
    "qwen3-coder-30b-a3b": Pair("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", "qwen3_moe"),
    "llama-3.1-8b": Pair("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "llama"),
    "gpt-oss-20b": Pair("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "gpt_oss"),
    "gpt-oss-120b": Pair("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", "gpt_oss"),
    "gemma-4-26b-a4b": Pair("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", "gemma4"),
    "gemma-4-31b": Pair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", "gemma4"),
    # gemma4_unified; z-lab spells this draft "gemma4-", no hyphen (named by its EXL3 and GGUF conversions)
    "gemma-4-12b": Pair("google/gemma-4-12B-it", "z-lab/gemma4-12B-it-DFlash", "gemma4"),
}


def demo(draft: Optional[str] = None) -> Tuple[str, str]:
    """The shipped demo pair's folders (``draft`` replaces the demo draft when given)."""
    from .loading import CheckpointError

    if not (DEMO_DIR / "target" / "config.json").exists():
        raise CheckpointError(
            f"the demo pair is missing from {DEMO_DIR}: reinstall dflash-mlx, or rebuild it with "
            "python examples/make_demo.py --work BUILD --install"
        )
    return str(DEMO_DIR / "target"), draft or str(DEMO_DIR / "draft")


def draft_window(draft_path) -> Optional[int]:
    """The draft's context window a pair runs with unless told (``load(draft_window="auto")``): the
    demo draft's training window, None (the whole context) for any other draft."""
    if draft_path is not None and Path(draft_path).resolve() == (DEMO_DIR / "draft").resolve():
        return DEMO_DRAFT_WINDOW
    return None


def context_size(model: Optional[str], given: Optional[int]) -> Optional[int]:
    """The context a server gets (``serve`` and ``agent`` alike): ``--context-size`` as given; else
    ``DEMO_CONTEXT`` for the demo pair; else None (what fits in memory, at most the target's own)."""
    if given is None and model == DEMO:
        return DEMO_CONTEXT
    return given


def template_args(model: Optional[str], given: Dict) -> Dict:
    """The chat template's arguments for every request a server answers: ``given``
    (``--chat-template-args``) over a named pair's thinking switch (its draft's training)."""
    pair = PAIRS.get(model) if model is not None else None
    if pair is None or pair.thinking is None:
        return given
    return {"enable_thinking": pair.thinking, **given}


def resolve(model: Optional[str], draft: Optional[str]) -> Tuple[str, Optional[str]]:
    """``--model``/``--draft`` as given, ``demo``, a named pair (``PAIRS``), or the default pair
    (converted and cached on first use). (``scripted`` is made by ``agents.scripted_pair``, a front
    end's, above this layer.)"""
    if model == DEMO:
        return demo(draft)
    if model in PAIRS:
        return PAIRS[model].target, draft or PAIRS[model].draft
    if model is not None:
        return model, draft
    target_dir = home() / TARGET_FOLDER
    if not target_dir.exists():
        print(f"First use: converting {DEFAULT_TARGET} to MLX 4-bit in {target_dir}", file=sys.stderr)
        convert_target(DEFAULT_TARGET, target_dir, quant="w4")
    if draft is None:
        draft_dir = home() / DRAFT_FOLDER
        if not draft_dir.exists():
            print(f"First use: converting {DEFAULT_DRAFT} for the Qwopus tokenizer in {draft_dir}", file=sys.stderr)
            convert_draft(draft_dir, draft=DEFAULT_DRAFT, target=DEFAULT_TARGET)
        draft = str(draft_dir)
    return str(target_dir), draft
