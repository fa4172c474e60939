"""Structured outputs and forced tool choice, as the three APIs ask for them, made one grammar
(``grammar.Grammars.answer``) that the decode cycle follows with speculation on.

- Chat completions: ``response_format`` ``json_schema`` / ``json_object``; ``tool_choice``
  ``required`` or a named function; ``parallel_tool_calls: false``.
- Responses: ``text.format`` ``json_schema`` / ``json_object``; the same tool choices.
- Messages: ``output_config.format`` and the beta's ``output_format`` (``json_schema``);
  ``tool_choice`` ``any`` / ``tool``; ``disable_parallel_tool_use``.

What the grammar engine cannot compile is a 400 naming the request's part. The grammars write
the loaded template's family's own format (``Grammars.family``): Qwen's ``<think>`` and
``<tool_call>``, Llama 3.1's JSON calls, gpt-oss's harmony channels (the analysis message free, the
final message or the call constrained), Gemma 4's thought channel and ``<|tool_call>`` blocks (a
tool schema its call syntax cannot express: a 400 naming the tool and the feature).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..grammar import Constraint, GrammarError
from ..reasoning import GEMMA4, GEMMA4_END, GEMMA4_START, HARMONY, START, chat_format, opens_reasoning
from .errors import APIError


def reasoning_mode(tokenizer, prompt_ids: List[int]) -> Optional[str]:
    """``"opened"`` when the prompt left a ``<think>`` block open (Qwen3.5 thinking): the model
    reasons freely, then the constrained answer follows its end; else None (the answer starts
    constrained: a model that could open a block itself would reason where the answer belongs).
    gpt-oss: ``"optional"`` (an analysis message may come first, as the model writes it at every
    effort). Gemma 4: the generation prompt closes an empty thought when thinking is off (None),
    and opens none when it is on (``<|think|>`` in the system turn): ``"optional"``."""
    template = getattr(tokenizer, "chat_template", None) or ""
    family = chat_format(template)
    if family == HARMONY:
        return "optional"
    if family == GEMMA4:
        tail = tokenizer.decode(prompt_ids[-16:])
        if GEMMA4_START in tail:
            return "opened" if tail.rfind(GEMMA4_START) > tail.rfind(GEMMA4_END) else None
        return "optional" if "<|think|>" in tokenizer.decode(prompt_ids[:16]) else None
    if START not in template:
        return None
    return "opened" if opens_reasoning(tokenizer.decode(prompt_ids[-16:])) else None


def schema_of(fmt: Optional[Dict[str, Any]], param: str, nested: bool) -> Any:
    """The JSON schema a format asks for (``{"type": "object"}`` for ``json_object``), None for
    plain text. ``nested``: chat completions' shape (``{"type": "json_schema", "json_schema":
    {"name", "schema"}}``); else the flat one of Responses and Messages (``{"type":
    "json_schema", "schema"}``)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"{param} must be an object", param=param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise APIError(400, f"{param}.type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
                       param=f"{param}.type")
    holder, where = (fmt.get("json_schema"), f"{param}.json_schema") if nested else (fmt, param)
    if not isinstance(holder, dict):
        raise APIError(400, f"{where} is required for type 'json_schema'", param=where)
    schema = holder.get("schema")
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        return {"type": "object"}
    return schema


def constraint(engine, prompt_ids: List[int], schema: Any = None, tools: Optional[List[Dict[str, Any]]] = None,
               calls: str = "auto", tool_name: Optional[str] = None, parallel: bool = True,
               schema_param: str = "response_format", tools_param: str = "tool_choice") -> Optional[Constraint]:
    """The request's grammar, or None where it asks for nothing a grammar enforces (then the
    request costs nothing extra). A part the engine cannot compile: a 400 naming it."""
    if schema is None and calls != "required" and (parallel or not tools):
        return None
    if calls == "required" and not tools:
        raise APIError(400, f"{tools_param}: forcing a tool call needs tools", param=tools_param)
    if getattr(engine, "scheduler", None) is None:
        raise APIError(400, f"{schema_param if schema is not None else tools_param}: structured outputs and forced "
                       "tool calls need the batched engine (a pipelined target runs without it)",
                       param=schema_param if schema is not None else tools_param)
    try:
        return engine.grammars.answer(schema=schema, tools=tools, tool_name=tool_name, calls=calls, parallel=parallel,
                                       reasoning=reasoning_mode(engine.tokenizer, prompt_ids),
                                       schema_param=schema_param, tools_param=tools_param)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or schema_param) from e


def openai_tool_choice(choice: Any, param: str = "tool_choice") -> tuple:
    """(calls, tool name) from OpenAI's ``tool_choice``: none / auto / required, or a named function
    (chat completions: ``{"type": "function", "function": {"name"}}``; Responses: ``{"type":
    "function", "name"}``)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if isinstance(name, str) and name:
            return "required", name
        raise APIError(400, f"{param}: a function tool choice needs the function's name", param=param)
    raise APIError(400, f"{param} must be 'none', 'auto', 'required' or a named function, got {choice!r}"[:300],
                   param=param)


def anthropic_tool_choice(choice: Optional[Dict[str, Any]]) -> tuple:
    """(calls, tool name, parallel) from Anthropic's ``tool_choice``: auto / any / tool / none,
    with ``disable_parallel_tool_use``."""
    choice = choice or {}
    kind = choice.get("type", "auto")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, None, parallel
    if kind == "any":
        return "required", None, parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "tool_choice.name is required for type 'tool'", param="tool_choice.name")
        return "required", name, parallel
    raise APIError(400, f"tool_choice.type {kind!r} is not supported: use 'auto', 'any', 'tool' or 'none'",
                   param="tool_choice.type")

