"""Scripted pairs: tiny targets whose answers are fixed, for running real clients (coding agents,
editors) against ``serve`` offline, in seconds, with a context as long as an agent's first request.

The target has one Gated DeltaNet layer and no attention, so a 50k-token prompt prefills in
seconds on a CPU (an attention layer makes that minutes there), and its positions have no limit:
``max_position_embeddings`` is set to ``context``. Its sublayers' output projections are zero, so its
state at a token is that token's embedding, and its head maps each token of a chain to the next:
a deterministic bigram model. What it answers is chosen by the chat template, which ends the
generation prompt with one of three route tokens, each the start of its own chain:

- ``after_tool``: the conversation holds a tool result: the model answers ``after_tool``;
- ``tool``: a user message contains ``ask`` (and no tool result yet): the model thinks
  ``reasoning`` and calls ``call`` (the reasoning block is open, as Qwen3.5's template leaves it);
  a script with more ``calls`` (one per client: ``agents.scripted_pair``) makes the call whose
  name is among the request's tools, through a route token of its own (``tool_1``, ...);
- ``plain``: anything else: the model answers ``plain`` (the template closed the reasoning).

Each answer's text is cut into a few pieces at its tags, each piece one token added to the
tokenizer, no piece shared between answers (a bigram model has one successor per token).
The draft is a random DFlash draft: speculation runs, and rejects (the output is the target's).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import tiny

CONTEXT = 262144  # the scripted target's positions have no limit: long enough for any agent's first request
ROUTES = ("plain", "tool", "after_tool")
ROUTE_TOKENS = {route: f"<|scripted_{route}|>" for route in ROUTES}


def call_route(index: int) -> str:
    """The route of a script's ``index``-th call: ``tool`` for the first, ``tool_1``... after it."""
    return "tool" if index == 0 else f"tool_{index}"


def route_token(route: str) -> str:
    return f"<|scripted_{route}|>"
ASK = "run the scripted tool"


@dataclass
class Call:
    """A tool call as the model writes it (Qwen3.5's ``<function=...>`` format)."""

    name: str
    arguments: Sequence[Tuple[str, str]] = ()  # (parameter, value as the model writes it)

    def text(self) -> str:
        params = "".join(f"<parameter={p}>{v}</parameter>" for p, v in self.arguments)
        return f"<tool_call><function={self.name}>{params}</function></tool_call>"


@dataclass
class Script:
    plain: str = "Hello from the scripted pair."
    reasoning: str = "The user asked for the tool."
    call: Optional[Call] = None
    after_tool: str = "The tool ran."
    ask: str = ASK
    calls: Sequence[Call] = ()  # more calls: each made when the request offers a tool of its name

    def all_calls(self) -> List[Call]:
        """The calls in route order: ``call`` first (the one made when no tool name matches)."""
        return ([self.call] if self.call is not None else []) + list(self.calls)

    def replies(self) -> Dict[str, str]:
        out = {"plain": self.plain, "after_tool": self.after_tool}
        for i, call in enumerate(self.all_calls()):
            # Each chain starts with a piece of its own (a bigram model has one successor per token).
            reasoning = self.reasoning if i == 0 else f"{self.reasoning.removesuffix('.')} ({call.name})."
            out[call_route(i)] = f"{reasoning}</think>{call.text()}"
        return out


def template(ask: str = ASK, call_names: Sequence[str] = ()) -> str:
    """Qwen3.5's chat format in small, with its refusals: one system message, first, joined to the
    tools' system turn (a later one raises "System message must be at the beginning."), tool
    results as user turns, earlier answers with their calls' arguments taken as a mapping
    (``|items``, which a JSON string fails) and their reasoning only after the last user query (a
    user message that is not a tool result), as Qwen's template drops it: a new user turn rewrites
    the history inside the answers since the previous one, and the prefix cache must live with it;
    the generation prompt ends in a route token (for a call: that of the first of ``call_names`` the
    request's tools offer, else the first call's)."""
    ask = json.dumps(ask)
    pick = "".join(
        "{%- if not ns.picked and f['name'] == " + json.dumps(name) + " -%}"
        "{%- set ns.route = " + json.dumps(route_token(call_route(i))) + " -%}{%- set ns.picked = true -%}{%- endif -%}"
        for i, name in enumerate(call_names)
    )
    return (
        "{%- set ns = namespace(tool=false, ask=false, route=" + json.dumps(ROUTE_TOKENS["tool"]) + ", picked=false,"
        " last_query=(messages | length) - 1, query_found=false) -%}"
        # Qwen's last_query_index: the last user message that is not a tool result (none: the last message).
        "{%- for m in messages | reverse -%}"
        "{%- if not ns.query_found and m['role'] == 'user' and not (m['content'] is string"
        " and m['content'].startswith('<tool_response>') and m['content'].endswith('</tool_response>')) -%}"
        "{%- set ns.last_query = (messages | length) - loop.index -%}{%- set ns.query_found = true -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for t in tools or [] -%}"
        "{%- set f = t['function'] if t['function'] is defined else t -%}" + pick +
        "{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'tool' -%}{%- set ns.tool = true -%}{%- endif -%}"
        "{%- if m['role'] == 'user' -%}"
        "{%- if m['content'] is string -%}{%- if " + ask + " in m['content'] -%}{%- set ns.ask = true -%}{%- endif -%}"
        "{%- else -%}{%- for p in m['content'] or [] -%}"
        "{%- if p['text'] is defined and p['text'] is string and " + ask + " in p['text'] -%}{%- set ns.ask = true -%}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
        "{% if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
        "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nIf you choose to call a function ONLY reply in "
        "the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
        "{% if system %}\n\n{{ system }}{% endif %}<|im_end|>\n"
        "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
        "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and m.get('reasoning_content') and loop.index0 > ns.last_query %}"
        "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] or [] %}{{ p['text'] or '' }}{% endfor %}{% endif %}"
        "{% for c in m.get('tool_calls') or [] %}<tool_call>\n<function={{ c['function']['name'] }}>\n"
        "{% for k, v in c['function']['arguments'] | items %}"
        "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}"
        "<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
        "{% if ns.tool %}\n</think>\n\n" + ROUTE_TOKENS["after_tool"] +
        "{% elif ns.ask %}{{ ns.route }}"
        "{% else %}\n</think>\n\n" + ROUTE_TOKENS["plain"] + "{% endif %}{% endif %}"
    )


def _pieces(text: str, taken: set) -> List[str]:
    """The text cut before each tag, pieces already taken merged into the one before."""
    out: List[str] = []
    for piece in [p for p in re.split(r"(?=<)", text) if p]:
        if out and (piece in taken or piece in out):
            out[-1] += piece
            while out[-1] in taken or out[-1] in out[:-1]:
                if len(out) == 1:
                    raise ValueError(f"cannot cut {text!r} into pieces no other answer uses")
                last = out.pop()
                out[-1] += last
        else:
            out.append(piece)
    if out and out[0] in taken:
        raise ValueError(f"the answer {text!r} begins like another one")
    taken.update(out)
    return out


def write_pair(root: Path, script: Script, context: int = CONTEXT, vocab_size: int = 512) -> Tuple[Path, Path]:
    """The scripted target (with its tokenizer and template) and a draft for it under ``root``."""
    from tokenizers import AddedToken, Tokenizer

    target_dir, draft_dir = root / "target", root / "draft"
    taken: set = set()
    chains = {route: _pieces(text, taken) for route, text in script.replies().items()}
    routes = list(dict.fromkeys([*ROUTE_TOKENS.values(), *(route_token(r) for r in chains)]))
    specials = set(tiny.SPECIAL_TOKENS) | set(routes)
    added = sorted({p for pieces in chains.values() for p in pieces} - specials)
    eos = tiny.write_tokenizer(target_dir, vocab_size - len(added), extra_special_tokens=routes)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in added])
    tokenizer.save(str(target_dir / "tokenizer.json"))
    config_path = target_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2))
    (target_dir / "chat_template.jinja").write_text(template(script.ask, [c.name for c in script.all_calls()]))
    over = dict(num_hidden_layers=1, layer_types=["linear_attention"], max_position_embeddings=context)
    target_config = tiny.write_target(target_dir, tiny.target_config(vocab_size, eos_token_id=eos, **over))
    tiny.write_draft(draft_dir, tiny.draft_config(target_config, block_size=16, target_layer_ids=[0]))
    _script_head(target_dir, tokenizer, {route: [route_token(route), *pieces, "<|im_end|>"] for route, pieces in chains.items()})
    return target_dir, draft_dir


def cached_pair(root: Path, script: Script, context: int = CONTEXT) -> Tuple[Path, Path]:
    """The scripted pair for ``script`` under ``root``, written on first use: in a folder named by
    a digest of the script and of the code that writes it, so that a changed script or writer gets
    a new pair, and moved into place whole (a server starting beside another never reads half a pair)."""
    source = Path(__file__).read_bytes() + Path(tiny.__file__).read_bytes()
    key = json.dumps([script.replies(), script.ask, [c.name for c in script.all_calls()], context])
    folder = root / hashlib.sha256(source + key.encode()).hexdigest()[:16]
    if not folder.exists():
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
        try:
            write_pair(scratch, script, context)
            os.rename(scratch, folder)
        except OSError:
            if not folder.exists():  # not another process's pair that got there first
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder / "target", folder / "draft"


def _script_head(target_dir: Path, tokenizer, chains: Dict[str, List[str]]) -> None:
    """Point the head of each chain's token at the next one (chains of single-token pieces)."""
    id_chains = []
    for chain in chains.values():
        ids = [tokenizer.token_to_id(piece) for piece in chain]
        if None in ids:
            raise ValueError(f"a piece of {chain} is not one token")
        id_chains.append(ids)
    point_head(target_dir, id_chains)


def point_head(target_dir: Path, chains: List[List[int]]) -> None:
    """Make a target folder's model follow token chains: the sublayers' outputs zeroed, so the
    last hidden state is the (normalised) embedding of the token just fed, and the head row of
    each token set to the embeddings of the tokens it follows (every token then predicts its
    successor in the chains, greedy and near-certain)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(target_dir / "model.safetensors"))
    for name in weights:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")) or name == "model.norm.weight":
            weights[name] = np.zeros_like(weights[name])  # zero-centred final norm: a weight of one
    embeddings = weights["model.embed_tokens.weight"]
    used = sorted({token for ids in chains for token in ids})
    if len(used) <= embeddings.shape[1]:
        # The chains' tokens get orthogonal embeddings (unit RMS): a token's head row, the sum of its
        # predecessors' embeddings, then scores only them, however many chains there are (random
        # embeddings of 64 dimensions let a successor shared by five chains outscore the right one).
        basis, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((embeddings.shape[1], len(used))))
        embeddings[used] = (basis.T * np.sqrt(embeddings.shape[1])).astype(embeddings.dtype)
        weights["model.embed_tokens.weight"] = embeddings
    normed = embeddings / np.sqrt((embeddings**2).mean(axis=-1, keepdims=True) + 1e-6)
    head = np.random.default_rng(0).standard_normal(weights["lm_head.weight"].shape).astype(np.float32) * 0.01
    before: Dict[int, List[int]] = {}  # each token's predecessors
    for ids in chains:
        for current, following in zip(ids, ids[1:]):
            before.setdefault(following, []).append(current)
    for following, currents in before.items():
        head[following] = normed[currents].sum(axis=0)
    weights["lm_head.weight"] = head
    save_file(weights, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
