"""JSON schemas in Gemma 4's tool-call value syntax, as Lark rules for llguidance (``grammar.Grammars``
writes each family's answer; this is the part that is not JSON).

Gemma 4 writes a call's arguments as ``{key:value,...}``: bare keys, strings between ``<|"|>``
delimiters (raw: no escapes), numbers, booleans and null as JSON, arrays and nested objects alike
(mlx-lm's ``tool_parsers/gemma4.py`` reads it back by quoting the keys and the strings; its key
pattern wants ``\\w+`` right after ``{`` or ``,``, so nothing here writes whitespace). Keys are
written sorted, as Gemma 4's template writes a call's arguments back (``dictsort``). A schema
feature this syntax or this translation cannot express is refused (``UnsupportedSchema`` names it),
never loosened; annotations (description, title, ...) are ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List

# What a schema may say without constraining the value.
ANNOTATIONS = {"description", "title", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
               "writeOnly"}
NUMBERS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
KEY = re.compile(r"[A-Za-z0-9_]+\Z")  # a key mlx-lm's parser finds (its \w+, ASCII here)
TYPED = {"string": {"minLength", "maxLength"}, "integer": NUMBERS, "number": NUMBERS, "boolean": set(), "null": set(),
         "array": {"items", "minItems", "maxItems"}, "object": {"properties", "required", "additionalProperties"}}


def _is(value: Any, kind: str) -> bool:
    """Whether a JSON value is of a JSON schema type."""
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    types = {"string": str, "boolean": bool, "null": type(None), "array": list, "object": dict}
    return kind in types and isinstance(value, types[kind])


class UnsupportedSchema(ValueError):
    """A schema feature Gemma 4's value grammar cannot express: the message names it and where."""


class GemmaValues:
    """Lark rules for values valid under JSON schemas, written in Gemma 4's syntax. ``prefix``: the
    rules' names start with it; ``quote``: the string delimiter as the grammar writes it (``<[id]>``
    where it is a special token, which no text lexeme can contain, else its quoted text);
    ``json_options``: the ``x-guidance`` options numbers are compiled with. ``rules`` collects what
    ``value`` needs."""

    def __init__(self, prefix: str, quote: str, quote_is_token: bool, json_options: Dict[str, Any]):
        self.prefix, self.quote, self.quote_is_token, self.json_options = prefix, quote, quote_is_token, json_options
        self.rules: List[str] = []
        self._any = None

    def _rule(self, body: str) -> str:
        name = f"{self.prefix}_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: Any, where: str) -> str:
        """A Lark expression for the values valid under ``schema`` (``where``: its path, for errors)."""
        if schema is True:
            return self.any()
        if not isinstance(schema, dict):
            raise UnsupportedSchema(f"{where}: {schema!r} is not a schema"[:200])
        keys = set(schema) - ANNOTATIONS
        if "const" in schema or "enum" in schema:  # the values that are all of const, enum and type say
            self._only(keys, {"const", "enum", "type"}, where)
            values = schema.get("enum", [schema.get("const")])
            if not isinstance(values, list):
                raise UnsupportedSchema(f"{where}: enum that is not a list")
            kinds = schema.get("type", list(TYPED))
            kinds = kinds if isinstance(kinds, list) else [kinds]
            values = [v for v in values if ("const" not in schema or v == schema["const"]) and any(_is(v, k) for k in kinds)]
            if not values:
                raise UnsupportedSchema(f"{where}: const/enum/type that no value satisfies")
            return "(" + " | ".join(self.literal(v, where) for v in values) + ")"
        if "anyOf" in schema:
            self._only(keys, {"anyOf"}, where)
            if not isinstance(schema["anyOf"], list) or not schema["anyOf"]:
                raise UnsupportedSchema(f"{where}: anyOf must be a non-empty list")
            return "(" + " | ".join(self.value(s, f"{where}.anyOf[{i}]") for i, s in enumerate(schema["anyOf"])) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):  # ["integer", "null"]: either, each with the keywords of its type
            if not kind or not all(t in TYPED for t in kind):
                raise UnsupportedSchema(f"{where}: type {kind!r}")
            self._only(keys, set().union(*(TYPED[t] for t in kind)) | {"type"}, where)
            return "(" + " | ".join(self.value({k: v for k, v in schema.items() if k in TYPED[t]} | {"type": t}, where)
                                    for t in kind) + ")"
        if kind is None:
            if keys & TYPED["object"]:
                kind = "object"
            elif keys & TYPED["array"]:
                kind = "array"
            else:
                self._only(keys, set(), where)
                return self.any()
        if kind not in TYPED:
            raise UnsupportedSchema(f"{where}: type {kind!r}")
        self._only(keys, TYPED[kind] | {"type"}, where)
        if kind == "string":
            return self.string(schema.get("minLength", 0), schema.get("maxLength"), where)
        if kind in ("integer", "number"):  # the same as JSON's: llguidance's own JSON grammar for it
            return f"%json {json.dumps({**schema, 'x-guidance': self.json_options})}"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self.array(schema, where)
        return self.object(schema, where)

    @staticmethod
    def _only(keys, allowed, where: str) -> None:
        extra = sorted(keys - allowed)
        if extra:
            raise UnsupportedSchema(f"{where}: {', '.join(extra)}")

    def literal(self, value: Any, where: str) -> str:
        """One value (a const or an enum's member) as Gemma 4 writes it."""
        if isinstance(value, str):
            if '<|"|>' in value:
                raise UnsupportedSchema(f'{where}: a string holding the delimiter <|"|>')
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if isinstance(value, list):
            return '"[" ' + ' "," '.join(self.literal(v, where) for v in value) + ' "]"' if value else '"[]"'
        if isinstance(value, dict):
            parts = []
            for key in sorted(value):
                self._key(key, where)
                parts.append(f'"{key}:" {self.literal(value[key], where)}')
            return '"{" ' + ' "," '.join(parts) + ' "}"' if parts else '"{}"'
        return json.dumps(json.dumps(value))  # numbers, booleans, null: as JSON

    @staticmethod
    def _key(key: str, where: str) -> None:
        if not KEY.match(key):
            raise UnsupportedSchema(f"{where}: property name {key!r} (Gemma 4's bare keys are letters, digits and _)")

    def string(self, least: Any, most: Any, where: str) -> str:
        if not isinstance(least, int) or (most is not None and not isinstance(most, int)):
            raise UnsupportedSchema(f"{where}: minLength/maxLength that are not integers")
        count = "*" if least == 0 and most is None else f"{{{least},{'' if most is None else most}}}"
        if self.quote_is_token:  # no text lexeme holds the special token: free text up to it
            return f"{self.quote} /(.|\\n){count}/ {self.quote}"
        if least:
            raise UnsupportedSchema(f'{where}: minLength where <|"|> is not a special token')
        # The first delimiter ends the string, as the parser reads it: a lazy lexeme that takes it.
        text = self._rule(f"/(.|\\n){count}<\\|\"\\|>/")
        self.rules[-1] = self.rules[-1].replace(":", "[lazy]:", 1)
        return f"{self.quote} {text}"

    def array(self, schema: Dict[str, Any], where: str) -> str:
        item = self.value(schema.get("items", True), f"{where}.items")
        least, most = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(least, int) or (most is not None and not isinstance(most, int)):
            raise UnsupportedSchema(f"{where}: minItems/maxItems that are not integers")
        if most == 0:
            return '"[]"'
        more = "*" if most is None and least <= 1 else f"{{{max(least - 1, 0)},{'' if most is None else most - 1}}}"
        items = f'{item} ("," {item}){more}'
        return f'"[" {items} "]"' if least else f'"[" ({items})? "]"'

    def object(self, schema: Dict[str, Any], where: str) -> str:
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        extra = schema.get("additionalProperties", True)
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise UnsupportedSchema(f"{where}: properties must be an object and required a list")
        missing = [r for r in required if r not in properties]
        if missing:
            raise UnsupportedSchema(f"{where}: required names no property: {', '.join(map(str, missing))}")
        if not properties:
            if extra is False:
                return '"{}"'
            value = self.value(extra, f"{where}.additionalProperties") if isinstance(extra, dict) else self.any()
            pair = f'/[A-Za-z0-9_]+/ ":" {value}'
            return f'"{{" ({pair} ("," {pair})*)? "}}"'
        if isinstance(extra, dict) and extra:
            raise UnsupportedSchema(f"{where}: additionalProperties with a schema beside properties")
        # Only the listed properties (sorted): ``first[i]`` writes those from i on when none came before.
        keys = sorted(properties)
        pairs = []
        for key in keys:
            self._key(key, where)
            pairs.append(f'"{key}:" {self.value(properties[key], f"{where}.{key}")}')
        after, first = [""] * (len(keys) + 1), [""] * (len(keys) + 1)  # "": nothing left to write
        for i in range(len(keys) - 1, -1, -1):
            need = keys[i] in required
            tail = f'"," {pairs[i]}' if need else f'("," {pairs[i]})?'
            after[i] = self._rule(f"{tail} {after[i + 1]}".strip())
            rest = f"{pairs[i]} {after[i + 1]}".strip()
            first[i] = self._rule(rest if need else f"({rest}) | {first[i + 1]}" if first[i + 1] else f"({rest})?")
        return f'"{{" {first[0]} "}}"'

    def any(self) -> str:
        """Any value (a schema that says nothing): one rule, made once."""
        if self._any is None:
            self._any = f"{self.prefix}_any"
            pair = f'/[A-Za-z0-9_]+/ ":" {self._any}'
            number = f"%json {json.dumps({'type': 'number', 'x-guidance': self.json_options})}"
            text = self.string(0, None, "any")
            self.rules.append(f'{self._any}: {text} | {number} | "true" | "false" | "null" '
                              f'| "[" ({self._any} ("," {self._any})*)? "]" | "{{" ({pair} ("," {pair})*)? "}}"')
        return self._any
