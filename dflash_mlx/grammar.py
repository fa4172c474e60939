"""Structured outputs under speculation: a request's constraint (a JSON schema, any JSON object, a
forced tool call) compiled by llguidance for one tokenizer, and the per-sequence matcher the decode
cycle drives.

Why llguidance (docs/server.md, "Structured outputs"): its matcher computes a token mask on the
CPU with no torch at run time (a Rust extension, abi3 wheels for macOS arm64 and Linux), and it has
what speculation needs: ``consume_token`` / ``rollback`` (a drafted block is walked, then undone,
and only what the cycle commits is consumed) and a packed 32-bit bitmask that MLX unpacks on the
device.

The cycle under a grammar (``Guide``): the draft's picks for a block are made unconstrained in one
read-back; walking the block, a pick the grammar refuses at its position is replaced by a pick from
the draft's masked row there (for sampling, a draw from the masked row's distribution; the
distribution rejection sampling is told is the one each proposal was drawn from: the free draw's
mass on allowed tokens, plus the refused mass times the masked row's).
The walk records the mask after every drafted prefix; the target verifies each row under its mask
(greedy: argmax of the masked logits; sampled: rejection sampling between the masked target and the
masked draft distributions), so the output is the constrained target's, token for token (greedy)
or in distribution (sampled).

What overlaps (``Grammars(overlap=True)``, the default): the mask of a block's first position
depends only on what the sequence committed, so ``Guide.prefetch`` computes it on a worker thread
(llguidance drops the GIL while it fills a mask) while the draft's pass runs; the walk joins it when
the draft's picks are read back. The mask after the whole block depends on no pick of the target's,
so the worker computes it (and rolls the matcher back) while the verify pass is built and queued;
``Guide.masks`` joins it. A batch's sequences' masks are computed side by side the same way. The
rest of the walk is sequential (each position's mask depends on the pick before it).
The worker only fills numpy bitmasks: MLX evaluates on the thread that owns its stream.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .grammar_formats import GemmaValues, UnsupportedSchema
from .reasoning import GEMMA4, GEMMA4_END, GEMMA4_START, HARMONY, LLAMA3, QWEN, chat_format
from .sampling import Sampler, categorical

# Compact JSON: a small model writing flexible whitespace can run on in blank lines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the part (a 400)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # a dependency: only a broken install lacks it
        raise GrammarError(f"structured outputs need llguidance ({exc}): pip install llguidance") from exc
    return llguidance


class Grammars:
    """The tokenizer-side setup of the grammar engine for one tokenizer (made once per loaded model:
    building it walks the vocabulary), and the compiler of requests' constraints for it.

    ``vocab``: the model's logit width (at least the tokenizer's; the rows past it are never
    allowed). ``stop_tokens``: the tokens that end an answer, allowed where the grammar is complete.
    ``tool_format``: how the family writes a tool call (``"xml"``: Qwen3.5's ``<function=NAME>``
    with ``<parameter=P>`` blocks, mlx-lm's ``qwen3_coder`` parser; ``"json"``: a JSON object with
    ``name`` and ``arguments``), between ``tool_call`` (start and end strings); those are Qwen's.
    ``family`` (``reasoning.chat_format``) writes the others' answers in their own formats:
    ``llama3`` (a call is the whole answer, ``{"name", "parameters"}`` JSON, optionally after
    ``<|python_tag|>``, several separated by ``;``), ``harmony`` (gpt-oss: an optional analysis
    message, then the final message's text or one call to ``functions.NAME`` with JSON arguments),
    ``gemma4`` (``<|tool_call>call:NAME{..}<tool_call|>`` in Gemma 4's value syntax,
    ``grammar_formats``; reasoning between ``think``, its ``<|channel>thought``/``<channel|>``). ``overlap``: two
    masks of each block (its first, while the draft's pass runs; the one after it, while the verify
    pass is queued) are computed on a worker thread (False: every mask on the calling thread, the
    serial path the tests compare it with)."""

    def __init__(self, tokenizer, vocab: int, stop_tokens: Sequence[int], tool_format: str = "xml",
                 tool_call: Tuple[str, str] = ("<tool_call>", "</tool_call>"),
                 think: Tuple[str, str] = ("<think>", "</think>"), overlap: bool = True, family: str = QWEN):
        if tool_format not in ("xml", "json"):
            raise ValueError(f"tool_format must be 'xml' or 'json', got {tool_format!r}")
        if family not in (QWEN, LLAMA3, HARMONY, GEMMA4):
            raise ValueError(f"family must be one of {QWEN}, {LLAMA3}, {HARMONY}, {GEMMA4}; got {family!r}")
        self.family = family
        self.tokenizer, self.vocab, self.tool_format = tokenizer, int(vocab), tool_format
        self.stop_tokens = sorted(set(int(t) for t in stop_tokens))
        self.tool_call, self.think = tool_call, think
        # One pool for every sequence under this tokenizer: a batch's masks side by side.
        self.pool = (ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="grammar-mask")
                     if overlap else None)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab: int, overlap: bool = True) -> "Grammars":
        """From mlx-lm's ``TokenizerWrapper`` (a Hugging Face fast tokenizer inside): its stop tokens,
        its tool-call markers, its tool parser's format, and its chat template's family."""
        llg = _llguidance()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise GrammarError(f"structured outputs need a fast (Rust) tokenizer; this one is {type(hf).__name__}")
        stops = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        ll = llg.LLTokenizer(backend.to_str(), n_vocab=max(vocab, len(hf)), eos_token=list(stops))
        parser = getattr(getattr(tokenizer, "tool_parser", None), "__module__", "") or ""
        fmt = "json" if parser.endswith("json_tools") else "xml"
        markers = (getattr(tokenizer, "tool_call_start", None) or "<tool_call>",
                   getattr(tokenizer, "tool_call_end", None) or "</tool_call>")
        family = chat_format(getattr(tokenizer, "chat_template", None) or getattr(hf, "chat_template", None))
        if family == GEMMA4:
            return cls(ll, vocab, stops, fmt, ("<|tool_call>", "<tool_call|>"), (GEMMA4_START, GEMMA4_END),
                       overlap=overlap, family=family)
        return cls(ll, vocab, stops, fmt, markers, overlap=overlap, family=family)

    # -- compiling a request's constraint ------------------------------------------------------

    def json_schema(self, schema: Any, reasoning: Optional[str] = None, param: str = "schema") -> "Constraint":
        """Answers that are JSON documents valid under ``schema`` (a dict, or its JSON text)."""
        return self.answer(schema=schema, reasoning=reasoning, schema_param=param)

    def json_object(self, reasoning: Optional[str] = None, param: str = "response_format") -> "Constraint":
        """Answers that are a JSON object (any)."""
        return self.answer(schema={"type": "object"}, reasoning=reasoning, schema_param=param)

    def tool_calls(self, tools: Sequence[Dict[str, Any]], name: Optional[str] = None, parallel: bool = True,
                   reasoning: Optional[str] = None, param: str = "tool_choice") -> "Constraint":
        """Answers that call the tools (one of them: ``name``; ``parallel`` False: one call)."""
        return self.answer(tools=tools, tool_name=name, calls="required", parallel=parallel, reasoning=reasoning,
                           tools_param=param)

    def answer(self, schema: Any = None, tools: Optional[Sequence[Dict[str, Any]]] = None, tool_name: Optional[str] = None,
               calls: str = "auto", parallel: bool = True, reasoning: Optional[str] = None,
               schema_param: str = "schema", tools_param: str = "tool_choice") -> Optional["Constraint"]:
        """A request's whole constraint, or None where it asks for none.

        ``schema``: the answer is a JSON document valid under it (or, with tools the model may
        call, such a document or tool calls). ``tools``: OpenAI function tools ({"type": "function",
        "function": {"name", "parameters"}}) or bare functions. ``calls``: ``"none"`` (tools are not
        called), ``"auto"``, ``"required"`` (the answer is tool calls; ``tool_name`` picks the tool).
        ``parallel`` False: one call at most (with ``"auto"`` and no schema: free text, then at
        most one call; Llama 3.1: free text that is not a call, or one call; harmony: no
        constraint, its ``<|call|>`` stop token ends the answer after one). ``reasoning``: see
        ``_prefix``. The ``*_param`` name the request's parts in errors."""
        if calls not in ("none", "auto", "required"):
            raise ValueError(f"calls must be 'none', 'auto' or 'required', got {calls!r}")
        rules: List[str] = []
        if schema is not None:
            rules.append(f"json: %json {_json(self._schema(schema, schema_param))}")
        calling = bool(tools) and calls != "none"
        if calling:
            rules += self._call_rules(tools, tool_name, tools_param)
            rules.append(self._calls_rule(parallel))
        if schema is not None and self.family == HARMONY:  # the final message's text
            rules.append(f"answer_json: {self._literal('<|channel|>final<|message|>')} json")
        elif schema is not None:
            rules.append("answer_json: json")
        if calls == "required":
            if not calling:
                raise GrammarError(f"{tools_param}: forcing a tool call needs at least one tool", tools_param)
            body = "calls"
        elif schema is not None:
            body = "answer_json | calls" if calling else "answer_json"
        elif calling and not parallel and self.family == LLAMA3:  # text that the parser cannot take for a call
            body = "TEXT | calls"
            rules.append("TEXT: /\\s*([^\\s{](.|\\n)*)?/")
        elif calling and not parallel and self.family != HARMONY:
            body = "TEXT calls?"
            rules.append("TEXT: /(.|\\n)*/")
        else:
            return None
        return self._compile(f"start: {self._prefix(reasoning)}({body})\n" + "\n".join(rules) + "\n",
                             schema_param if schema is not None and calls != "required" else tools_param)

    @staticmethod
    def _schema(schema: Any, param: str) -> Dict[str, Any]:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"{param} is not JSON: {exc}", param) from exc
        if not isinstance(schema, dict):
            raise GrammarError(f"{param} must be a JSON object (a JSON schema), got {type(schema).__name__}", param)
        return schema

    def _calls_rule(self, parallel: bool) -> str:
        """``calls``: the answer's calls, one of them unless ``parallel``, as the family separates them."""
        if self.family == LLAMA3:  # ``{..}; {..}``, optionally after <|python_tag|>
            tag = self._literal("<|python_tag|>")
            return f"calls: ({tag})? call" + (' ((";" | "; ") call)*' if parallel else "")
        if self.family == HARMONY:  # <|call|> is a stop token: one call per answer
            return "calls: call"
        if self.family == GEMMA4:  # blocks one after the other
            return "calls: call+" if parallel else "calls: call"
        return "calls: call (/\\s*/ call)*" if parallel else "calls: call"

    def _call_rules(self, tools: Sequence[Dict[str, Any]], name: Optional[str], param: str) -> List[str]:
        """``call``: one tool call in the family's format, of one of ``tools`` (or of ``name``)."""
        functions = {}
        for tool in tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise GrammarError(f"tools: a tool without a function name: {tool!r}"[:300], "tools")
            functions[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
        if name is not None:
            if name not in functions:
                raise GrammarError(f"{param}: no tool named {name!r} among the request's tools "
                                   f"({', '.join(functions) or 'none'})", param)
            functions = {name: functions[name]}
        rules = [self._call_rule(f"fn{i}", fn, parameters, param) for i, (fn, parameters) in enumerate(functions.items())]
        either = f"({' | '.join(f'fn{i}' for i in range(len(functions)))})"
        if self.family in (LLAMA3, HARMONY):  # the call is the (final) message: fn writes it whole
            rules.append(f"call: {either}")
        else:
            start, end = (self._literal(t) for t in self.tool_call)
            newline = "" if self.family == GEMMA4 else ' "\\n" '
            rules.append(f"call: {start}{newline or ' '}{either}{newline or ' '}{end}")
        return rules

    def _call_rule(self, rule: str, fn: str, parameters: Any, param: str) -> str:
        if not isinstance(parameters, dict):
            raise GrammarError(f"{param}: the parameters of tool {fn!r} are not a JSON schema object", param)
        if self.family == LLAMA3:  # what Llama 3.1's template asks for: name, then parameters
            schema = {"type": "object", "properties": {"name": {"const": fn}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False}
            return f"{rule}: %json {_json(schema)}"
        if self.family == HARMONY:  # <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS
            head = self._literal(f"<|channel|>commentary to=functions.{fn} <|constrain|>json<|message|>")
            return f"{rule}: {head} %json {_json(parameters)}"
        if self.family == GEMMA4:
            return self._gemma_call(rule, fn, parameters, param)
        if self.tool_format == "json":
            schema = {"type": "object", "properties": {"name": {"const": fn}, "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False}
            return f"{rule}: %json {_json(schema)}"
        # Qwen3.5 / qwen3_coder: <function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>
        properties, required = parameters.get("properties") or {}, parameters.get("required") or []
        if not isinstance(properties, dict) or not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarError(f"{param}: the parameters of tool {fn!r} need an object of properties and a list of "
                               "required names", param)
        required = set(required)
        parts, extra = [], []
        close = json.dumps("\n</parameter>\n")
        for j, (key, sub) in enumerate(properties.items()):
            value = self._xml_value(sub if isinstance(sub, dict) else {})
            if value is None:  # raw text: a lazy lexeme that takes the closing tag with it
                extra.append(f"{rule}_{j}[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/")
                value, tail = f"{rule}_{j}", ""
            else:
                tail = f" {close}"
            parts.append(f"({json.dumps(f'<parameter={key}>' + chr(10))} {value}{tail})" + ("" if key in required else "?"))
        head = json.dumps(f"<function={fn}>\n")
        return "\n".join([f"{rule}: {head} {' '.join(parts)} \"</function>\""] + extra)

    def _gemma_call(self, rule: str, fn: str, parameters: Dict[str, Any], param: str) -> str:
        """``call:NAME{..}`` with the arguments in Gemma 4's syntax (what mlx-lm's parser reads back:
        a name of letters, digits, ``_`` and ``-``); a schema feature it cannot write: a 400 naming
        the tool and the feature."""
        if not re.fullmatch(r"[A-Za-z0-9_-]+", fn):
            raise GrammarError(f"{param}: tool name {fn!r} cannot be written in Gemma 4's call syntax "
                               "(letters, digits, _ and - only)", param)
        quote = self._literal('<|"|>')
        values = GemmaValues(rule, quote, quote.startswith("<["), JSON_OPTIONS)
        try:
            args = values.value(parameters if parameters.get("type") or parameters.get("properties") else
                                {**parameters, "type": "object"}, "parameters")
        except UnsupportedSchema as exc:
            raise GrammarError(f"{param}: tool {fn!r}: Gemma 4's call syntax cannot express the schema's {exc}",
                               param) from exc
        return "\n".join([f"{rule}: {json.dumps('call:' + fn)} {args}"] + values.rules)

    @staticmethod
    def _xml_value(schema: Dict[str, Any]) -> Optional[str]:
        """A parameter's value as mlx-lm's qwen3_coder parser reads it back by the schema's type:
        strings raw (None: free text up to ``</parameter>``), numbers and booleans bare, anything
        else JSON."""
        kind = schema.get("type")
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]) and kind in (None, "string"):
            return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + ")"
        if kind == "string" and not ({"pattern", "format", "minLength", "maxLength", "const"} & schema.keys()):
            return None
        if kind == "integer" and not (schema.keys() - {"type", "description", "title"}):
            return "/-?(0|[1-9][0-9]*)/"
        if kind == "boolean":
            return "(\"true\" | \"false\")"
        return f"%json {_json(schema)}"

    def _literal(self, text: str) -> str:
        """A marker as the grammar writes it: the special tokens in it as such (``<[id]>``), the
        text around them as text."""
        parts, run = [], []
        for token in self.tokenizer.tokenize_str(text, parse_special=True) + [None]:
            if token is not None and not self.tokenizer.is_special_token(token):
                run.append(token)
                continue
            if run:
                parts.append(json.dumps(self.tokenizer.decode_str(run)))
                run = []
            if token is not None:
                parts.append(f"<[{token}]>")
        return " ".join(parts)

    def _prefix(self, reasoning: Optional[str]) -> str:
        """Reasoning before the constrained answer: ``"opened"`` (the prompt opened the block:
        free text, then its end), ``"optional"`` (the model may open a block itself), None: none.
        Harmony: ``"optional"`` is an analysis message before the answer's (the prompt ends with
        ``<|start|>assistant``)."""
        if reasoning is None:
            return ""
        if reasoning not in ("opened", "optional"):
            raise ValueError(f"reasoning must be None, 'opened' or 'optional', got {reasoning!r}")
        if self.family == HARMONY:
            if reasoning == "opened":
                raise ValueError("harmony's reasoning is an analysis message the model opens: 'optional' or None")
            start, end = (self._literal(t) for t in ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"))
            return f"({start} /(.|\\n)*/ {end})? "
        start, end = (self._literal(t) for t in self.think)
        # Qwen's template puts a blank line after </think>; Gemma 4's answer follows <channel|> at once.
        thought = f"/(.|\\n)*/ {end}" + ("" if self.family == GEMMA4 else " /\\s*/")
        return f"{thought} " if reasoning == "opened" else f"({start} {thought})? "

    def _compile(self, lark: str, param: str) -> "Constraint":
        llg = _llguidance()
        grammar = llg.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:  # llguidance's message, less its listing of our grammar
            why = "\n".join(line for line in messages[0].splitlines() if not re.match(r"\s*(\d+ \||\^$)", line))
            raise GrammarError(f"{param}: the grammar engine cannot compile it: {why.strip()}", param)
        return Constraint(grammar, self)


@dataclass(frozen=True)
class Constraint:
    """A request's compiled grammar (shared by the requests that send the same one);
    ``guide()`` gives a sequence its own matcher."""

    grammar: str
    grammars: Grammars

    def guide(self) -> "Guide":
        return Guide(self)


class Guide:
    """One sequence's matcher: the state after its committed tokens. ``mask()`` for the next
    position, ``propose`` for a drafted block (masks after every drafted prefix, the matcher back
    where it was), ``commit`` for what a cycle commits; ``prefetch`` starts the next mask on the
    worker thread (the matcher is touched by no one else until it is joined)."""

    def __init__(self, constraint: Constraint):
        llg = _llguidance()
        g = constraint.grammars
        self.matcher = llg.LLMatcher(g.tokenizer, constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar engine refused the grammar: {self.matcher.get_error()}")
        self.vocab, self.stop_tokens = g.vocab, set(g.stop_tokens)
        self.words = (max(g.vocab, g.tokenizer.vocab_size) + 31) // 32  # the engine's mask covers its vocabulary
        self._words: Optional[np.ndarray] = None  # the last proposed block's packed masks
        self._masks: Optional[mx.array] = None
        self.pool = g.pool
        # The worker's job on the matcher (and the row it fills: the next mask; None: the block's last)
        self.ahead: Optional[Tuple[Future, Optional[np.ndarray]]] = None
        self.mask_seconds = 0.0  # calling-thread time spent on masks and the walk (for measurements)
        self.ahead_seconds = 0.0  # worker time on the masks computed ahead (overlapped)

    def _fill(self, out: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self.matcher.get_error()}")

    def _fill_timed(self, out: np.ndarray) -> float:
        t = time.perf_counter()
        self._fill(out)
        return time.perf_counter() - t

    def prefetch(self) -> None:
        """Start computing the next position's mask (after the committed tokens) on the worker;
        the next ``mask``/``propose`` joins it. Nothing without a pool, or if one is running."""
        if self.pool is not None and self.ahead is None:
            row = np.zeros(self.words, np.int32)
            self.ahead = (self.pool.submit(self._fill_timed, row), row)

    def _last_mask(self, out: np.ndarray, consumed: int) -> float:
        """The worker's part of ``propose``: the mask after the block, then the matcher back."""
        elapsed = self._fill_timed(out)
        self.matcher.rollback(consumed)
        return elapsed

    @property
    def masks(self) -> mx.array:
        """[m + 1, V] bool: the masks after every prefix of the last proposed block (its last row
        joined from the worker: read it after the verify pass is queued)."""
        if self._masks is None:
            t = time.perf_counter()
            self._join()
            self.mask_seconds += time.perf_counter() - t
            self._masks = unpack(mx.array(self._words), self.vocab)
        return self._masks

    def _join(self) -> Optional[np.ndarray]:
        """Wait for the worker's job; the matcher is ours again. Its next mask, if that was the job."""
        if self.ahead is None:
            return None
        future, row = self.ahead
        self.ahead = None
        self.ahead_seconds += future.result()
        return row

    def _first(self, out: np.ndarray) -> None:
        """The next position's mask into ``out``: the one computed ahead, else computed now."""
        row = self._join()
        if row is None:
            self._fill(out)
        else:
            out[:] = row

    def mask(self) -> mx.array:
        """[V] bool: the tokens the grammar allows next."""
        t = time.perf_counter()
        words = np.zeros((1, self.words), np.int32)
        self._first(words[0])
        self.mask_seconds += time.perf_counter() - t
        return unpack(mx.array(words), self.vocab)[0]

    def propose(self, logits: mx.array, sampler: Sampler) -> Tuple[mx.array, Optional[mx.array]]:
        """The draft's proposals for a block under the grammar from its logits [n, V] (and, when
        sampling, the masked distributions they were drawn from); the masks after every drafted
        prefix go to ``self.masks`` ([m + 1, V] for m proposals). The block ends early after a
        stop token (nothing after it can be committed). The matcher is left where it was (with a
        pool: once ``masks`` is read)."""
        n = logits.shape[0]
        free = None if sampler.greedy else sampler.probs(logits)  # the unconstrained draws' distributions
        picks = (mx.argmax(logits, axis=-1) if sampler.greedy else categorical(free, sampler.key())).tolist()
        t = time.perf_counter()
        words = np.zeros((n + 1, self.words), np.int32)
        tokens: List[int] = []
        for k in range(n):
            (self._first if k == 0 else self._fill)(words[k])
            token = picks[k]
            if not (words[k, token >> 5] >> (token & 31)) & 1:  # refused here: the masked row's pick
                row = masked(logits[k], unpack(mx.array(words[k : k + 1]), self.vocab)[0])
                token = (mx.argmax(row) if sampler.greedy else categorical(sampler.probs(row[None]), sampler.key())[0]).item()
            tokens.append(token)
            if token in self.stop_tokens:  # the end: not consumed (llguidance's rollback would not count it)
                break
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"grammar matcher refused its own mask's token {token}: {self.matcher.get_error()}")
        m = len(tokens)
        self._words, self._masks = words[: m + 1], None
        if tokens[-1] in self.stop_tokens:
            words[m] = -1  # past the end: the row is never committed (any mask keeps it finite)
            self.matcher.rollback(m - 1)
        elif self.pool is not None:  # the last mask needs no pick of the target's: the worker's, during the verify
            self.ahead = (self.pool.submit(self._last_mask, words[m], m), None)
        else:
            self._fill(words[m])
            self.matcher.rollback(m)
        self.mask_seconds += time.perf_counter() - t
        proposals = mx.array(tokens, dtype=mx.int32)
        if sampler.greedy:
            return proposals, None
        # What each proposal was drawn from: a free draw kept where allowed, else a draw from the
        # masked row (with top-p/top-k/min-p the two differ: the filters pick among other tokens).
        walked = unpack(mx.array(words[:m]), self.vocab)  # the rows known now (the last: maybe on the worker)
        kept = mx.where(walked, free[:m], 0.0)
        probs = kept + (1.0 - kept.sum(axis=-1, keepdims=True)) * sampler.probs(masked(logits[:m], walked))
        return proposals, probs

    def commit(self, tokens: Iterable[int]) -> None:
        """Consume what a cycle committed, up to its stop token (which ends the sequence: nothing
        after it counts)."""
        self._join()  # a mask computed ahead is of the state before this commit: never used
        for token in tokens:
            if token in self.stop_tokens:
                break
            if not self.matcher.consume_token(int(token)):
                raise RuntimeError(f"grammar matcher refused committed token {token}: {self.matcher.get_error()}")


def _json(schema: Dict[str, Any]) -> str:
    """A schema as the grammar embeds it, with the JSON options (``x-guidance``) it is compiled by."""
    return json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}})


def unpack(words: mx.array, vocab: int) -> mx.array:
    """Packed 32-bit masks [n, W] (llguidance's layout: bit j of word i is token 32 i + j) as
    [n, vocab] bool, on the device."""
    bits = mx.right_shift(words.astype(mx.uint32)[:, :, None], mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(mx.bool_)


def masked(logits: mx.array, mask: mx.array) -> mx.array:
    """Logits with the tokens the mask refuses at -inf."""
    return mx.where(mask, logits, mx.array(-mx.inf, logits.dtype))
