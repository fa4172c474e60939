"""Rebuild the demo pair that ships as ``--model demo``, from scratch, offline.

    python examples/make_demo.py --work /tmp/demo-build            # about 2 h 45 min on 2 CPU cores
    python examples/make_demo.py --work /tmp/demo-build --install  # then copy it into the package

1. Corpus: the Python standard library of the running interpreter (no download). Functions and
   classes become chat examples: "write this function" (the answer is its source) and file
   edits (rename a function or a variable, add return hints, drop docstrings: the answer is
   the file copied with a small edit, which is what the bench's ``edit`` workload measures).
   Raw source chunks are mixed in for plain code modelling.
2. Tokenizer: a 511-token byte-level BPE trained on that corpus, with Qwen's special tokens and
   chat template (row 511 of the embedding is left free for the draft's mask token).
3. Target: a tiny Qwen3.5 (Gated DeltaNet + full attention) trained with transformers on torch,
   which is the fastest trainer on this CPU, and saved with ``save_pretrained``: the shipped
   weights go through the same HF loading path as any Qwen3.5 checkpoint.
   A second stage on the edit examples alone (loss on the answers) is what teaches it to copy.
4. Lookahead rounds on the target: extra heads (dropped at save) learn to predict 2..4 tokens ahead
   from each hidden state on the edit answers, so that the features the draft reads carry the
   next tokens; the last round weighs them at 0.3 so that the target keeps copying exactly.
5. Draft: ``dflash-mlx train-draft`` on the edit examples, labels = the target's greedy choices
   (what verification accepts), with the recipe that gets a small draft past the unigram plateau:
   2 layers (the second sees only the block), causal block, first layer initialised as a lookup
   of the position before the anchor, anchors in the answers (see the README, "Training a draft").
6. A model card (``README.md``) with data, sizes, steps and losses.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

from dflash_mlx.tiny import target_config

VOCAB_SIZE = 512  # embedding rows; the tokenizer uses 511 of them
# tiny.target_config's attention and Gated DeltaNet shapes, deeper, with tied embeddings; minus the
# keys that are not Qwen3_5TextConfig arguments.
TARGET_CONFIG = {
    k: v for k, v in target_config(
        VOCAB_SIZE, num_hidden_layers=6, layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        tie_word_embeddings=True,
    ).items() if k not in ("architectures", "model_type", "dtype", "eos_token_id")
}
DRAFT_TAPS = "1,3,5"  # the draft reads an early, a middle and the last layer
# train-draft options that get this small draft past the unigram plateau (README, "Training a draft").
DRAFT_RECIPE = ["--block-only-layers", "1", "--causal", "--init", "content-match", "--answers-only", "--decay-gamma", "2"]
SYSTEM_OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"  # Debian's libopenblas0
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "pydoc_data", "encodings", "__pycache__", "config-3.11-x86_64-linux-gnu"}
EDIT_REPLY = "Reply with the whole updated file and nothing else."
WORDS = ["total", "count", "items", "value", "result", "record", "entry", "buffer", "parse", "load", "read", "write",
         "build", "make", "check", "apply", "handle", "node", "name", "data", "index", "key", "path", "text", "line"]


# ----------------------------------------------------------------------------- corpus

def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if not SKIP_DIRS.intersection(path.relative_to(root).parts):
            yield path


def definitions(source: str):
    """Top-level functions and classes, and methods (dedented), as source text."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.append(ast.get_source_segment(source, node))
            if isinstance(node, ast.ClassDef):
                out.extend(textwrap.dedent(ast.get_source_segment(source, m, padded=True) or "") for m in node.body
                           if isinstance(m, ast.FunctionDef))
    return [s for s in out if s and s.isascii() and "\t" not in s and parses(s)]


def parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except SyntaxError:  # e.g. a method whose strings defeat dedent
        return False


def new_name(old: str, rng: random.Random) -> str:
    choice = rng.random()
    if choice < 0.4:
        return "_".join(rng.sample(WORDS, 2))
    if choice < 0.7:
        return old + rng.choice(["_all", "_impl", "_new", "_v2", "_safe", "_fast"])
    return rng.choice(["get_", "do_", "new_", "compute_"]) + old.lstrip("_")


def rename(code: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def drop_docstrings(code: str) -> str:
    tree = ast.parse(code)
    lines = code.splitlines(keepends=True)
    doomed = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str) and len(node.body) > 1:
                doomed.update(range(first.lineno - 1, first.end_lineno))
    return "".join(l for i, l in enumerate(lines) if i not in doomed)


def add_return_hints(code: str) -> str:
    """``-> None`` on functions that never return a value (a small, checkable edit)."""
    tree = ast.parse(code)
    lines = code.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.returns is None:
            returns_value = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node))
            yields = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(node))
            header = lines[node.lineno - 1]
            if not returns_value and not yields and header.rstrip().endswith("):"):
                lines[node.lineno - 1] = header.rstrip()[:-2] + ") -> None:\n"
    return "".join(lines)


def chat(user: str, answer: str, think: bool) -> str:
    prefix = "<think>\n\n</think>\n\n" if think else ""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{prefix}{answer}<|im_end|>\n"


def edit_example(snippet: str, rng: random.Random):
    """A file and a request to change it a little; the answer copies it with the change."""
    tree = ast.parse(snippet)
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    params = sorted({a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args
                     if len(a.arg) >= 3 and a.arg not in ("self", "cls")})
    kind = rng.random()
    if kind < 0.45 and functions:
        old = rng.choice(functions)
        new = new_name(old, rng)
        request, edited = f"Rename the function `{old}` to `{new}` everywhere in this file. {EDIT_REPLY}", rename(snippet, old, new)
    elif kind < 0.7 and params:
        old = rng.choice(params)
        new = new_name(old, rng)
        request, edited = f"Rename the variable `{old}` to `{new}` everywhere in this file. {EDIT_REPLY}", rename(snippet, old, new)
    elif kind < 0.85:
        request = "Add type hints to every function of this file without changing anything else. Reply with the whole updated file."
        edited = add_return_hints(snippet)
    else:
        request, edited = f"Remove the docstrings from this file. {EDIT_REPLY}", drop_docstrings(snippet)
    return f"{request}\n\n```python\n{snippet}```", f"```python\n{edited}```"


def write_example(code: str) -> tuple:
    tree = ast.parse(code)
    node = tree.body[0]
    doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
    kind = "class" if isinstance(node, ast.ClassDef) else "function"
    request = f"Write a Python {kind} `{node.name}`" + (f": {doc[0].lower()}{doc[1:]}" if doc else ".")
    return request, f"```python\n{code}\n```"


def build_corpus(out: Path, seed: int, max_files: int) -> dict:
    rng = random.Random(seed)
    texts, stats = [], {"files": 0, "edit": 0, "write": 0, "raw": 0}
    for path in list(stdlib_files())[:max_files]:
        try:
            source = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        stats["files"] += 1
        defs = definitions(source)
        for code in defs:
            if 80 <= len(code) <= 1200:
                texts.append(chat(*write_example(code), think=rng.random() < 0.2))
                stats["write"] += 1
        # Edits: runs of consecutive top-level definitions, about the size of a small file.
        i = 0
        while i < len(defs):
            snippet = ""
            while i < len(defs) and len(snippet) < rng.randint(250, 900):
                snippet += defs[i] + "\n\n\n"
                i += 1
            snippet = snippet.rstrip("\n") + "\n"
            if 200 <= len(snippet) <= 1300:
                try:
                    for _ in range(2):
                        texts.append(chat(*edit_example(snippet, rng), think=rng.random() < 0.2))
                        stats["edit"] += 1
                except SyntaxError:
                    pass
        if source.isascii():
            for start in range(0, len(source), 2000):
                texts.append(source[start : start + 2000])
                stats["raw"] += 1
    rng.shuffle(texts)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    stats["chars"] = sum(len(t) for t in texts)
    return stats


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(corpus: Path, target_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dflash_mlx.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((json.loads(l)["text"] for l in corpus.open()), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    target_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(target_dir))
    return fast.convert_tokens_to_ids("<|im_end|>")


# ----------------------------------------------------------------------------- target

def is_edit(text: str) -> bool:
    return text.startswith("<|im_start|>user\n") and "updated file" in text.split("<|im_end|>")[0]


def fit(model, next_batch, steps: int, lr: float, seed: int, label: str, target_dir: Path, loss_fn=None, extra=None) -> list:
    """AdamW with warmup and cosine decay to 0.1x over ``steps``; saves the model to ``target_dir``.

    ``loss_fn(ids, labels)`` replaces the model's own next-token loss; ``extra`` (a module) is
    trained alongside and not saved.
    """
    import numpy as np
    import torch

    params = list(model.parameters()) + (list(extra.parameters()) if extra is not None else [])
    loss_fn = loss_fn or (lambda ids, labels: model(input_ids=ids, labels=labels).loss)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    rng = np.random.default_rng(seed)
    losses, t0 = [], time.time()
    for step in range(steps):
        ids, labels = next_batch(rng)
        loss = loss_fn(ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            mean = sum(losses[-20:]) / len(losses[-20:])
            print(f"{label} step {step + 1}/{steps} loss {mean:.3f} ({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    model.save_pretrained(str(target_dir))
    record_attention_interval(target_dir)
    return losses


def record_attention_interval(target_dir: Path) -> None:
    """Write ``full_attention_interval`` beside ``layer_types`` (transformers saves only the latter,
    and mlx-lm places full attention by the interval alone, 4 when it is missing)."""
    config_file = target_dir / "config.json"
    config = json.loads(config_file.read_text())
    types = config["layer_types"]
    interval = types.index("full_attention") + 1
    if any((t == "full_attention") != ((i + 1) % interval == 0) for i, t in enumerate(types)):
        raise ValueError(f"layer_types {types} are not one full-attention layer every {interval}")
    config["full_attention_interval"] = interval
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def train_target(corpus: Path, target_dir: Path, eos: int, steps: int, batch: int, seq_len: int, lr: float, seed: int) -> list:
    """Rows of ``seq_len`` tokens, each starting at a document boundary, loss on every token."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    docs = [tokenizer.encode(json.loads(l)["text"], add_special_tokens=False) + [tokenizer.pad_token_id] for l in corpus.open()]
    stream = np.concatenate([np.array(d, dtype=np.int64) for d in docs])
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])  # rows start at a document boundary
    starts = starts[starts < len(stream) - seq_len]
    print(f"target: {len(stream):,} tokens in {len(docs):,} documents", flush=True)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(eos_token_id=eos, **TARGET_CONFIG)).float().train()

    def next_batch(rng):
        x = torch.from_numpy(np.stack([stream[s : s + seq_len] for s in rng.choice(starts, batch)]))
        return x, x  # transformers shifts the labels itself

    losses = fit(model, next_batch, steps, lr, seed, "target", target_dir)
    return losses, sum(p.numel() for p in model.parameters()), len(stream)


def edit_examples(corpus: Path, tokenizer, seq_len: int) -> list:
    """(prompt ids, answer ids) of every edit example that fits in ``seq_len``."""
    split = "<|im_start|>assistant\n"
    examples = []
    for line in corpus.open():
        text = json.loads(line)["text"]
        if is_edit(text):
            head, answer = text.split(split, 1)
            prompt = tokenizer.encode(head + split, add_special_tokens=False)
            reply = tokenizer.encode(answer, add_special_tokens=False)
            if len(prompt) + len(reply) <= seq_len:
                examples.append((prompt, reply))
    return examples


def answer_batches(examples: list, batch: int, pad_id: int):
    """One example per row, padded; labels only on the answers (-100 elsewhere)."""
    import torch

    def next_batch(rng):
        chosen = [examples[i] for i in rng.choice(len(examples), batch)]
        width = max(len(p) + len(r) for p, r in chosen)
        ids = torch.full((batch, width), pad_id)
        labels = torch.full((batch, width), -100)
        for row, (p, r) in enumerate(chosen):
            ids[row, : len(p) + len(r)] = torch.tensor(p + r)
            labels[row, len(p) : len(p) + len(r)] = torch.tensor(r)
        return ids, labels

    return next_batch


def train_copy_stage(corpus: Path, target_dir: Path, steps: int, batch: int, seq_len: int, lr: float, seed: int) -> list:
    """Continue the target on edit examples alone, one per row, with the loss on the answer only."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    examples = edit_examples(corpus, tokenizer, seq_len)
    print(f"copy stage: {len(examples):,} edit examples", flush=True)
    model = Qwen3_5ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).train()
    return fit(model, answer_batches(examples, batch, tokenizer.pad_token_id), steps, lr, seed, "copy", target_dir)


def train_lookahead_stage(corpus: Path, target_dir: Path, steps: int, batch: int, seq_len: int, lr: float, seed: int,
                          horizon: int, weight: float = 1.0) -> list:
    """Continue the target on edit answers with extra heads predicting tokens 2..``horizon`` ahead.

    The draft reads the target's hidden states. Trained on the next token alone, this target keeps
    little about the tokens after it, so the draft has nothing to read them from; Qwen3.5 itself is
    trained with multi-token prediction. The heads (residual MLPs into the tied output) are dropped
    when the target is saved: its architecture and loading path do not change. ``weight`` scales
    the heads' mean loss against the next-token loss: at 1.0 this small target copies worse.
    Returns [next-token loss, +2 loss, ...] per step.
    """
    import torch
    from torch.nn import functional as F
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    examples = edit_examples(corpus, tokenizer, seq_len)
    print(f"lookahead stage: {len(examples):,} edit examples, horizon {horizon}", flush=True)
    model = Qwen3_5ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).train()
    width = model.config.hidden_size
    heads = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
        for _ in range(horizon - 1)
    )
    for head in heads:  # start as the next-token head
        torch.nn.init.zeros_(head[2].weight)
        torch.nn.init.zeros_(head[2].bias)
    per_offset = []

    def loss_fn(ids, labels):
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
        losses = []
        for k in range(1, horizon + 1):  # the hidden state at p predicts the token at p + k
            h = hidden[:, :-k]
            logits = model.lm_head(h if k == 1 else h + heads[k - 2](h))
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, k:].reshape(-1), ignore_index=-100))
        per_offset.append([x.item() for x in losses])
        return losses[0] + weight * sum(losses[1:]) / max(len(losses) - 1, 1)

    fit(model, answer_batches(examples, batch, tokenizer.pad_token_id), steps, lr, seed, "lookahead", target_dir,
        loss_fn=loss_fn, extra=heads)
    return per_offset


# ----------------------------------------------------------------------------- draft

def write_edit_corpus(corpus: Path, out: Path, limit: int, seed: int) -> int:
    """A shuffled sample of the edit chats: the draft trains where the demo is meant to draft."""
    lines = [line for line in corpus.open() if is_edit(json.loads(line)["text"])]
    random.Random(seed).shuffle(lines)
    out.write_text("".join(lines[:limit]))
    return min(limit, len(lines))


def train_draft(target_dir: Path, corpus: Path, draft_dir: Path, args) -> list:
    if draft_dir.exists():
        shutil.rmtree(draft_dir)
    cmd = [sys.executable, "-m", "dflash_mlx.cli", "train-draft", "--model", str(target_dir), "--data", str(corpus),
           "--out", str(draft_dir), "--layers", str(args.draft_layers), "--taps", DRAFT_TAPS, "--block-size", str(args.block_size),
           "--steps", str(args.draft_steps), "--seq-len", str(args.draft_seq_len), "--anchors", str(args.draft_anchors),
           "--learning-rate", str(args.draft_lr), "--seed", str(args.seed), *DRAFT_RECIPE]
    env = dict(os.environ)
    if args.blas:
        # MLX's Linux CPU wheel bundles the reference BLAS (about 1 GFLOP/s here); preloading an optimised
        # one only makes training faster: same sgemm interface, same results up to rounding.
        env.update(LD_PRELOAD=args.blas, OPENBLAS_NUM_THREADS="1")
    print("draft:", " ".join(cmd), f"(LD_PRELOAD={args.blas})" if args.blas else "", flush=True)
    subprocess.run(cmd, check=True, env=env)
    state = json.loads((draft_dir / "training_state" / "state.json").read_text())
    return state["losses"]


def cast_checkpoint(folder: Path, dtype: str) -> None:
    """Rewrite a checkpoint's floating-point weights in ``dtype``, in place (training runs in float32).

    The demo ships in bfloat16, like Qwen's own checkpoints: half the size, and MLX's CPU backend
    multiplies bfloat16 in its own SIMD code, about twice as fast as the reference BLAS its Linux
    wheel bundles for float32 once a product has several rows, as a verify block's have (a
    single-row decode step costs the same). Per-operation dispatch dominates this model's cycle,
    so end to end that is a few percent (README, "The demo pair")."""
    import mlx.core as mx

    path = folder / "model.safetensors"
    weights, metadata = mx.load(str(path), return_metadata=True)
    cast = {k: v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    partial = path.with_name("model.partial.safetensors")
    mx.save_safetensors(str(partial), cast, metadata=metadata)
    partial.replace(path)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def curve(losses, points=8):
    n = len(losses)
    marks = sorted({max(1, round(n * i / points)) for i in range(1, points + 1)})
    return ", ".join(f"{m}: {sum(losses[max(0, m - 20):m]) / len(losses[max(0, m - 20):m]):.2f}" for m in marks)


def lookahead_paragraph(info: dict) -> str:
    if not info.get("lookahead_rounds"):
        return ""
    rounds = info["lookahead_rounds"]
    lines = "\n".join(
        f"- {r['steps']} steps, peak lr {r['lr']}, weight {r['weight']}, {r['minutes']:.0f} min; final answer losses per offset: "
        + ", ".join(f"+{k + 1}: {v:.2f}" for k, v in enumerate(r["final_losses"]))
        for r in rounds
    )
    return (f"Lookahead rounds then trained extra heads (dropped at save) to predict up to {rounds[0]['horizon']} tokens\n"
            f"ahead from each hidden state, on the edit answers (loss: next token + weight x mean of the heads'):\n{lines}\n\n")


def model_card(info: dict) -> str:
    c, t, d, k = info["corpus"], info["target"], info["draft"], info["copy_stage"]
    layers = TARGET_CONFIG["layer_types"]
    return f"""# dflash-mlx demo pair

A tiny Qwen3.5-architecture target and a DFlash draft trained for it, shipped inside the package so
that `dflash-mlx generate --model demo`, `chat --model demo` and `bench --model demo` run offline.
It writes Python-looking code and copies files with small edits; it is a speed demo, not an assistant.
Rebuild it with `python examples/make_demo.py --work BUILD --install` (numbers below are from that run).

## Data
The Python {sys.version.split()[0]} standard library of the build machine ({c["files"]} files, tests and
IDLE excluded, {c["chars"]:,} characters of training text): {c["write"]:,} "write this function/class"
chat examples (answer: its source), {c["edit"]:,} file-edit chat examples (rename a function or a variable,
add `-> None` hints, drop docstrings; the answer copies the file with the edit) and {c["raw"]:,} raw
source chunks. Tokenizer: byte-level BPE, {VOCAB_SIZE - 1} tokens trained on the same text, Qwen special tokens
and chat template; embedding row {VOCAB_SIZE - 1} is the draft's mask token.

## Target
`Qwen3_5ForCausalLM`: hidden {TARGET_CONFIG["hidden_size"]}, {len(layers)} layers
({layers.count("linear_attention")} Gated DeltaNet, {layers.count("full_attention")} full attention), MLP {TARGET_CONFIG["intermediate_size"]},
tied embeddings, {t["params"]:,} parameters, trained in float32, shipped in {info.get("dtype", "float32")}. Trained with transformers on torch (CPU):
{t["steps"]} steps x {t["batch"]} rows x {t["seq_len"]} tokens (from {t["corpus_tokens"]:,} corpus tokens),
AdamW lr {t["lr"]} with warmup and cosine decay, {t["minutes"]:.0f} min including corpus and tokenizer.
Training loss (mean of 20 steps, at step): {t["losses"]}; final {t["final_loss"]:.2f}.
That model wrote code-like text but did not copy a file it was given, so a second stage trained it on
the edit examples alone, one per row, with the loss on the answers only: {k["rounds"]} rounds of
{k["steps"]} steps (warmup, cosine decay, peak lr {k["lr"]}), {k["minutes"]:.0f} min. Answer loss
(per round, at step): {k["losses"]}; final {k["final_loss"]:.2f}.
The price: after that stage it copies well but no longer writes fresh code (asked for a function it
repeats itself or writes blank lines). A stage on the whole mix (200 steps, lr 1e-3) brought fresh
code back only by breaking the copying, so it is not part of the build.

{lookahead_paragraph(info)}## Draft
DFlash draft, {d.get("layers", 1)} decoder layers, block size {d["block_size"]}, reading target layers {DRAFT_TAPS},
trained with `dflash-mlx train-draft` (target frozen, labels = the target's greedy choices) on the
{d.get("edit_chats", 0):,} edit chats, with `{d.get("recipe", "")}`:
{d["steps"]} steps, windows of {d["seq_len"]} tokens with {d["anchors"]} anchored blocks each,
peak lr {d["lr"]}, {d["minutes"]:.0f} min (BLAS: {d["blas"]}). Loss (weighted block CE, mean of 20 steps, at step): {d["losses"]};
final {d["final_loss"]:.2f}.
"""


DEFAULT_LOOKAHEAD = ["300:1e-3:1", "400:1e-3:1", "300:5e-4:0.3"]


def lookahead_round(spec: str):
    """``STEPS:LR:WEIGHT`` -> (steps, lr, weight)."""
    try:
        steps, lr, weight = spec.split(":")
        parsed = int(steps), float(lr), float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected STEPS:LR:WEIGHT, e.g. 300:1e-3:1") from None
    if parsed[0] < 0 or (parsed[0] and (parsed[1] <= 0 or parsed[2] < 0)):
        raise argparse.ArgumentTypeError(f"{spec!r}: steps must be >= 0, lr > 0 and weight >= 0")
    return parsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="Build folder (corpus, target/, draft/, README.md).")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the corpus mix, data order and inits.")
    parser.add_argument("--max-files", type=int, default=10_000, help="Standard-library files to read at most.")
    parser.add_argument("--target-steps", type=int, default=900, help="First target stage: steps on the whole mix.")
    parser.add_argument("--batch", type=int, default=12, help="Target rows per step.")
    parser.add_argument("--seq-len", type=int, default=1024, help="Target tokens per row.")
    parser.add_argument("--lr", type=float, default=3e-3, help="First target stage peak learning rate.")
    parser.add_argument("--block-size", type=int, default=4, help="Draft block size.")
    parser.add_argument("--draft-steps", type=int, default=3000, help="train-draft --steps.")
    parser.add_argument("--draft-seq-len", type=int, default=1024, help="train-draft --seq-len.")
    parser.add_argument("--draft-anchors", type=int, default=64, help="train-draft --anchors.")
    parser.add_argument("--draft-lr", type=float, default=3e-3, help="train-draft --learning-rate.")
    parser.add_argument("--blas", default=SYSTEM_OPENBLAS if Path(SYSTEM_OPENBLAS).exists() else "",
                        help="Optimised BLAS to preload for train-draft on Linux ('' for none); default: Debian's OpenBLAS if installed.")
    parser.add_argument("--copy-steps", type=int, default=400, help="Second target stage: edit examples, loss on the answers.")
    parser.add_argument("--copy-lr", type=float, default=3e-3, help="Second target stage peak learning rate.")
    parser.add_argument("--copy-rounds", type=int, default=2, help="Rounds of the second stage (each --copy-steps long).")
    parser.add_argument("--lookahead-round", action="append", type=lookahead_round, dest="lookahead_rounds",
                        metavar="STEPS:LR:WEIGHT", default=None,
                        help="A third-stage round (repeatable, in order): multi-token heads on edit answers. "
                             f"Default: {' '.join(DEFAULT_LOOKAHEAD)}. Give 0:0:0 to skip the stage.")
    parser.add_argument("--lookahead-horizon", type=int, default=4, help="Tokens ahead the lookahead heads predict (2..N).")
    parser.add_argument("--draft-layers", type=int, default=2, help="train-draft --layers (the last one sees only the block).")
    parser.add_argument("--draft-chats", type=int, default=3000, help="Edit chats (a shuffled sample) the draft trains on.")
    parser.add_argument("--corpus-only", action="store_true",
                        help="Write work/corpus.jsonl and the draft's edit chats (work/edit_corpus.jsonl) and stop: the data "
                             "`train-draft --model demo --from-draft demo` trains on.")
    parser.add_argument("--skip-target", action="store_true", help="Reuse work/target: skip the first target stage.")
    parser.add_argument("--skip-copy", action="store_true", help="Skip the second (copy-focused) target stage.")
    parser.add_argument("--skip-draft", action="store_true", help="Stop after the target.")
    parser.add_argument("--install", action="store_true", help="Copy the result into dflash_mlx/demo/.")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="Weights' dtype in the installed pair (training always runs in float32).")
    args = parser.parse_args()
    if args.lookahead_horizon < 2:
        parser.error(f"--lookahead-horizon {args.lookahead_horizon}: must be at least 2 (the token after next)")
    rounds = [r for r in (args.lookahead_rounds or [lookahead_round(r) for r in DEFAULT_LOOKAHEAD]) if r[0] > 0]
    work = args.work
    corpus, target_dir, draft_dir = work / "corpus.jsonl", work / "target", work / "draft"
    info_file = work / "build.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    if args.corpus_only:
        work.mkdir(parents=True, exist_ok=True)
        print("corpus:", build_corpus(corpus, args.seed, args.max_files), flush=True)
        print("edit chats:", write_edit_corpus(corpus, work / "edit_corpus.jsonl", args.draft_chats, args.seed + 1), flush=True)
        return
    if not args.skip_target:
        started = time.time()
        info["corpus"] = build_corpus(corpus, args.seed, args.max_files)
        print("corpus:", info["corpus"], flush=True)
        eos = train_tokenizer(corpus, target_dir)
        losses, params, tokens = train_target(corpus, target_dir, eos, args.target_steps, args.batch, args.seq_len, args.lr, args.seed)
        info["target"] = dict(steps=args.target_steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, params=params,
                              corpus_tokens=tokens, losses=curve(losses), final_loss=sum(losses[-50:]) / len(losses[-50:]),
                              minutes=(time.time() - started) / 60)
        info_file.write_text(json.dumps(info, indent=2))
    if not args.skip_copy:
        # Stage 2: edit examples only, loss on the answers. Stage 1 alone leaves a model that writes
        # code-like text but does not copy the file it is given (no induction yet).
        started, curves = time.time(), []
        for round_ in range(args.copy_rounds):  # each round: warmup, then cosine decay
            losses = train_copy_stage(corpus, target_dir, args.copy_steps, args.batch, args.seq_len, args.copy_lr,
                                      args.seed + 1 + round_)
            curves.append(curve(losses))
        info["copy_stage"] = dict(rounds=args.copy_rounds, steps=args.copy_steps, lr=args.copy_lr, losses=" | ".join(curves),
                                  final_loss=sum(losses[-50:]) / len(losses[-50:]), minutes=(time.time() - started) / 60)
        info_file.write_text(json.dumps(info, indent=2))
    if rounds:
        info["lookahead_rounds"] = []
        for i, (steps, lr, weight) in enumerate(rounds):
            started = time.time()
            per_offset = train_lookahead_stage(corpus, target_dir, steps, args.batch, args.seq_len, lr, args.seed + 10 + i,
                                               args.lookahead_horizon, weight)
            tail = per_offset[-50:]
            info["lookahead_rounds"].append(dict(steps=steps, lr=lr, weight=weight, horizon=args.lookahead_horizon,
                                                 final_losses=[sum(col) / len(col) for col in zip(*tail)],
                                                 minutes=(time.time() - started) / 60))
            info_file.write_text(json.dumps(info, indent=2))
    if args.skip_draft:
        return
    started = time.time()
    edits = write_edit_corpus(corpus, work / "edit_corpus.jsonl", args.draft_chats, args.seed + 1)
    losses = train_draft(target_dir, work / "edit_corpus.jsonl", draft_dir, args)
    info["draft"] = dict(blas=args.blas or "bundled reference BLAS", steps=args.draft_steps, block_size=args.block_size, seq_len=args.draft_seq_len,
                         anchors=args.draft_anchors, lr=args.draft_lr, layers=args.draft_layers, recipe=" ".join(DRAFT_RECIPE),
                         edit_chats=edits, losses=curve(losses),
                         final_loss=sum(losses[-50:]) / len(losses[-50:]), minutes=(time.time() - started) / 60)
    info["dtype"] = args.dtype  # of the installed pair
    info_file.write_text(json.dumps(info, indent=2))
    shutil.rmtree(draft_dir / "training_state", ignore_errors=True)
    (work / "README.md").write_text(model_card(info))
    if args.install:
        from dflash_mlx.defaults import DEMO_DIR

        shutil.rmtree(DEMO_DIR, ignore_errors=True)
        DEMO_DIR.mkdir(parents=True)
        for name in ("target", "draft"):
            shutil.copytree(work / name, DEMO_DIR / name)
            if args.dtype != "float32":
                cast_checkpoint(DEMO_DIR / name, args.dtype)
        shutil.copy(work / "README.md", DEMO_DIR / "README.md")
        shutil.copy(info_file, DEMO_DIR / "build.json")
        print(f"installed into {DEMO_DIR}")


if __name__ == "__main__":
    main()
