"""Structured outputs and forced tool calls for gpt-oss (harmony), Llama 3.1 and Gemma 4, each
written in the family's own format, with speculation on.

The pairs are tiny bigram targets behind tests/test_formats.py's templates, with each family's
special tokens, scripted to reason (gpt-oss's analysis message, Gemma 4's thought) and then left to
the grammar (``write_pair``: several chains, none ending the answer, unlike test_formats' one
scripted answer). Oracles, none of them the code under test: greedy speculation against the
constrained target alone (tests/test_structured.py's loop: the target's full forward, masked by
llguidance's own matcher, argmax); the answer's text against the call or JSON as the family writes
it (the published formats, written here); what the routes return against a schema check written
here and the reasoning the target was scripted to write; a batched request against itself alone;
the grammars against llguidance's matcher on texts written here.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Dict, List

import pytest

from dflash_mlx import tiny
from dflash_mlx.scripted import point_head
from tests.test_formats import FAMILIES as FORMATS
from tests.test_formats import REASONING, USER, Family, family_checkpoints, kwargs

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"]
GEMMA_TOKENS = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|turn>", "<turn|>", "<|think|>"]
LLAMA_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
TEMPLATES = {f.name: f for f in FORMATS}
# Each family's target scripted to reason (the grammar writes the rest of the markers: a bigram
# model has one successor per token, and "analysis" / "thought" repeat letters), then left to the
# grammar. ``pieces``: the chain from the generation prompt; ``more``: further chains.
FAMILIES = {
    "gpt-oss": Family("gpt-oss", TEMPLATES["gpt-oss"].template, ["<|channel|>", "an"], HARMONY_TOKENS, REASONING),
    "llama3.1": Family("llama3.1", TEMPLATES["llama3.1"].template, [], LLAMA_TOKENS, ""),
    "gemma4": Family("gemma4", TEMPLATES["gemma4"].template, ["<|channel>", "t"], GEMMA_TOKENS, REASONING, thinking=True),
}
MORE = {"gpt-oss": [["<|message|>", REASONING, "<|end|>"]], "llama3.1": [], "gemma4": [["t", REASONING, "<channel|>"]]}

# Bounded schemas: every answer under them ends, whatever a random head picks.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
# What Gemma 4's value syntax is asked to write: nested objects, arrays, optional keys, anyOf, const.
TRIP = {"type": "object", "properties": {
    "where": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "near": {"type": "boolean"}},
              "required": ["city"], "additionalProperties": False},
    "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7}, "minItems": 1, "maxItems": 2},
    "note": {"type": "string", "maxLength": 4},
    "mode": {"anyOf": [{"const": "car"}, {"type": "null"}]},
    "party": {"type": ["integer", "null"], "minimum": 1, "maximum": 4}},
    "required": ["where", "days", "mode"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "plan_trip", "description": "Plan a trip", "parameters": TRIP}}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tag": {"enum": ["a", "b"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


def valid(value: Any, schema: Dict[str, Any]) -> bool:
    """The JSON schema features the schemas above use, checked here by hand."""
    if "anyOf" in schema:
        return any(valid(value, s) for s in schema["anyOf"])
    if "const" in schema:
        return value == schema["const"]
    if "enum" in schema:
        return value in schema["enum"]
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return any(_valid_as(value, kind, schema) for kind in kinds)


def _valid_as(value, kind, schema) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
                and all(valid(v, schema["items"]) for v in value))
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema["required"]) <= value.keys() <= props.keys()
                and all(valid(value[k], props[k]) for k in value))
    raise AssertionError(kind)


def write_pair(root, family: Family, more: List[List[str]]):
    """A tiny pair whose target follows the family's chains after its generation prompt."""
    target_dir, draft_dir, _, prompt, _, ids = family_checkpoints(root, family)
    chains = [[prompt[-1]] + ids(family.pieces)] + [ids(c) for c in more]
    successors = {}
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            assert successors.setdefault(a, b) == b, f"{family.name}: token {a} has two successors in {chains}"
    point_head(target_dir, chains)
    return target_dir, draft_dir


@contextmanager
def serving(family: Family, root):
    """The family's pair behind an in-process server: (family, client, tokenizer, model)."""
    from fastapi.testclient import TestClient

    from dflash_mlx.api import load
    from dflash_mlx.server import create_app

    target, draft = write_pair(root, family, MORE[family.name])
    model, tokenizer = load(str(target), draft=str(draft))
    with TestClient(create_app(model, tokenizer, "tiny", chat_template_args=kwargs(family))) as client:
        yield family, client, tokenizer, model


# The quick tier serves Gemma 4 (its own value syntax); the full suite every family.
@pytest.fixture(scope="module", params=[name if name == "gemma4" else pytest.param(name, marks=pytest.mark.slow)
                                      for name in FAMILIES])
def served(request, tmp_path_factory):
    with serving(FAMILIES[request.param], tmp_path_factory.mktemp(request.param)) as served:
        yield served


def test_greedy_speculation_is_the_constrained_target_alone(served):
    """A forced call of the nested tool and a JSON answer, after the scripted reasoning, at block 4:
    token for token the oracle's (the target's full forward masked by llguidance's own matcher),
    each written in the family's format (its parser reads it back: the reasoning apart, the call or
    the JSON valid). The prompt is the rendered one's last 32 tokens (the generation prompt: all the
    bigram target reads; the oracle's full forward at every step stays short)."""
    import mlx.core as mx

    from dflash_mlx.decoder import Decoder
    from dflash_mlx.grammar import Grammars
    from dflash_mlx.reasoning import splitters
    from dflash_mlx.sampling import Sampler
    from dflash_mlx.server.structured import reasoning_mode
    from dflash_mlx.server.tool_calls import ToolCallScanner, answer_parts
    from tests.test_structured import constrained_target_only, cut, decode_commits

    family, _, tokenizer, model = served
    grammars = Grammars.for_tokenizer(tokenizer, model.target.args.vocab_size)
    prompt = list(tokenizer.apply_chat_template(USER, add_generation_prompt=True, **kwargs(family)))
    mode = reasoning_mode(tokenizer, prompt)
    prompt = prompt[-32:]
    stops = set(tokenizer.eos_token_ids)
    accepted = 0
    for constraint, check in ((grammars.tool_calls(TOOLS, name="plan_trip", parallel=False, reasoning=mode), "call"),
                              (grammars.json_schema(ANSWER, reasoning=mode), "json")):
        want = constrained_target_only(model.target, mx.array(prompt), constraint.grammar, grammars.tokenizer, 120, stops)
        _, (commits,) = decode_commits(Decoder(model.target, model.draft), [mx.array(prompt)], [constraint], [Sampler()],
                                       120, stops, block=4)
        got = cut([t for c in commits for t in c.tokens], 120, stops)
        accepted += sum(c.accepted for c in commits)
        assert got == want, (family.name, check, tokenizer.decode(got), tokenizer.decode(want))
        assert got[-1] in stops, tokenizer.decode(got)
        thought, text, calls = answer_parts(tokenizer.decode(got[:-1]), splitters(tokenizer, prompt)(),
                                            ToolCallScanner(tokenizer, TOOLS))
        assert reasoned(thought, family) and (not thought or family.reasoning not in text), tokenizer.decode(got)
        if check == "call":
            assert text.strip() == "" and [c.name for c in calls] == ["plan_trip"], tokenizer.decode(got)
            assert valid(calls[0].arguments, TRIP), calls[0].arguments
            answer = written_call(family, "plan_trip", calls[0].arguments)
        else:
            assert valid(json.loads(text), ANSWER), text
            answer = ("<|channel|>final<|message|>" if family.name == "gpt-oss" else "") + compact(json.loads(text))
        assert tokenizer.decode(got[:-1]) == written_reasoning(family, thought) + answer
    assert accepted > 0  # drafted tokens were accepted: speculation ran under the grammar


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def written_call(family: Family, name: str, arguments: Dict[str, Any]) -> str:
    """A call as the family's model writes it (the published formats, written here, compact):
    Llama 3.1's JSON with ``parameters``; harmony's commentary message to ``functions.NAME`` with
    ``<|constrain|>json``; Gemma 4's ``call:NAME{..}`` with bare keys, sorted, strings in ``<|"|>``."""
    if family.name == "llama3.1":
        return compact({"name": name, "parameters": arguments})
    if family.name == "gpt-oss":
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{compact(arguments)}"

    def gemma(value) -> str:
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{gemma(value[k])}" for k in sorted(value)) + "}"
        if isinstance(value, list):
            return "[" + ",".join(gemma(v) for v in value) + "]"
        return f'<|"|>{value}<|"|>' if isinstance(value, str) else json.dumps(value)

    return f"<|tool_call>call:{name}{gemma(arguments)}<tool_call|>"


def written_reasoning(family: Family, thought: str) -> str:
    """The reasoning before the answer as the family writes it (harmony: an analysis message, then
    the next message's start; Gemma 4: its thought channel)."""
    if family.name == "gpt-oss":
        return f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant"
    if family.name == "gemma4":
        return f"<|channel>thought{thought}<channel|>"
    return thought


def test_a_batched_constrained_request_is_as_alone(served):
    """A forced call beside a free request, decoded together, greedy and seeded sampling: each is
    bit for bit itself decoded alone."""
    import mlx.core as mx

    from dflash_mlx.decoder import Decoder
    from dflash_mlx.grammar import Grammars
    from dflash_mlx.sampling import Sampler
    from dflash_mlx.server.structured import reasoning_mode
    from tests.test_structured import decode

    family, _, tokenizer, model = served
    grammars = Grammars.for_tokenizer(tokenizer, model.target.args.vocab_size)
    prompt = list(tokenizer.apply_chat_template(USER, add_generation_prompt=True, **kwargs(family)))
    constraint = grammars.tool_calls(TOOLS, name="plan_trip", reasoning=reasoning_mode(tokenizer, prompt))
    prompts, constraints = [mx.array(prompt[-32:]), mx.array(prompt[-20:])], [constraint, None]
    stops = set(tokenizer.eos_token_ids)
    for settings in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.95)):
        samplers = lambda: [Sampler(**settings).for_request(5), Sampler(**settings).for_request(6)]  # noqa: E731
        together = decode(Decoder(model.target, model.draft), prompts, constraints, samplers(), 40, block=4,
                          stop_tokens=stops)
        alone = [decode(Decoder(model.target, model.draft), [p], [c], [s], 40, block=4, stop_tokens=stops)[0]
                 for p, c, s in zip(prompts, constraints, samplers())]
        assert together == alone, settings


# ---- through the routes ------------------------------------------------------------------------

def reasoned(thought, family: Family) -> bool:
    """The reasoning the target was scripted to end its thought with (Gemma 4's grammar writes
    "thought" token by token from a bigram head, which may add a few letters before it), or none."""
    return (thought or "").endswith(family.reasoning) and bool(thought) == bool(family.reasoning)


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 120,
                                                     "temperature": 0, **body})


def anthropic_tools():
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in TOOLS]


def responses_tools():
    return [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.mark.parametrize("tool", ["get_weather", "plan_trip"])
def test_a_forced_named_call_on_every_route(served, tool):
    """The call the request names comes back as that tool's parsed call whose arguments are valid
    under its schema, the reasoning in the reasoning fields, no text beside it (one call: each
    route's way of asking for one, else a bigram head calls on to max_tokens)."""
    family, client, _, _ = served
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == tool)
    reply = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": tool}},
                 parallel_tool_calls=False)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert reasoned(message.get("reasoning_content"), family) and not message.get("content"), message
    assert [c["function"]["name"] for c in message["tool_calls"]] == [tool], message
    assert valid(json.loads(message["tool_calls"][0]["function"]["arguments"]), schema), message

    reply = client.post("/v1/messages", json={"model": "tiny", "messages": USER, "max_tokens": 120, "temperature": 0,
                                              "tools": anthropic_tools(),
                                              "tool_choice": {"type": "tool", "name": tool, "disable_parallel_tool_use": True}})
    assert reply.status_code == 200, reply.text
    content = reply.json()["content"]
    assert [b["type"] for b in content] == (["thinking"] if family.reasoning else []) + ["tool_use"], content
    assert reasoned("".join(b.get("thinking", "") for b in content), family)
    assert content[-1]["name"] == tool and valid(content[-1]["input"], schema), content

    reply = client.post("/v1/responses", json={"model": "tiny", "input": USER[0]["content"], "max_output_tokens": 120,
                                               "temperature": 0, "tools": responses_tools(),
                                               "tool_choice": {"type": "function", "name": tool},
                                               "parallel_tool_calls": False})
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert [i["type"] for i in output] == (["reasoning"] if family.reasoning else []) + ["function_call"], output
    assert reasoned("".join(c["text"] for i in output if i["type"] == "reasoning" for c in i["content"]), family)
    assert output[-1]["name"] == tool and valid(json.loads(output[-1]["arguments"]), schema), output


def test_a_json_schema_answer_on_every_route(served):
    """``response_format`` / ``output_config.format`` / ``text.format``: content that json.loads and
    satisfies the schema, the reasoning apart from it."""
    family, client, _, _ = served
    reply = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert reasoned(message.get("reasoning_content"), family), message
    assert valid(json.loads(message["content"]), ANSWER), message

    reply = client.post("/v1/messages", json={"model": "tiny", "messages": USER, "max_tokens": 120, "temperature": 0,
                                              "output_config": {"format": {"type": "json_schema", "schema": ANSWER}}})
    assert reply.status_code == 200, reply.text
    content = reply.json()["content"]
    assert reasoned("".join(b.get("thinking", "") for b in content), family), content
    assert valid(json.loads("".join(b["text"] for b in content if b["type"] == "text")), ANSWER), content

    reply = client.post("/v1/responses", json={"model": "tiny", "input": USER[0]["content"], "max_output_tokens": 120,
                                               "temperature": 0,
                                               "text": {"format": {"type": "json_schema", "name": "a", "schema": ANSWER}}})
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert reasoned("".join(c["text"] for i in output if i["type"] == "reasoning" for c in i["content"]), family)
    text = "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"])
    assert valid(json.loads(text), ANSWER), output


REFUSED = [
    ("pattern", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
    ("property name 'zip-code'", {"type": "object", "properties": {"zip-code": {"type": "string"}}}),
    ("oneOf", {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}}),
]


def test_a_gemma_schema_feature_it_cannot_write_is_a_400_naming_it(served):
    """Gemma 4's call syntax has no way to say these here: the request is refused, naming the tool
    and the feature, not answered under a looser grammar; the families that write JSON arguments
    take the same tools (llguidance's JSON grammar says them)."""
    family, client, _, _ = served
    for feature, schema in REFUSED:
        tools = [{"type": "function", "function": {"name": "lookup", "description": "x", "parameters": schema}}]
        reply = chat(client, tools=tools, tool_choice="required", max_tokens=4)
        if family.name != "gemma4":
            assert reply.status_code == 200, (family.name, feature, reply.text)
            continue
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "tool_choice" and "'lookup'" in error["message"] and feature in error["message"], error


# ---- the grammars themselves: the family's format accepted, nothing looser -------------------------

def grammars_for(root, family: Family, tokens: List[str]):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    from dflash_mlx.grammar import Grammars

    tiny.write_tokenizer(root, extra_special_tokens=tokens)
    (root / "chat_template.jinja").write_text(family.template)
    return Grammars.for_tokenizer(TokenizerWrapper(AutoTokenizer.from_pretrained(str(root))), 512, overlap=False)


def accepts(grammars, constraint, text: str) -> bool:
    """Whether llguidance's own matcher takes ``text`` whole under the constraint's grammar."""
    import llguidance as llg

    matcher = llg.LLMatcher(grammars.tokenizer, constraint.grammar, log_level=0)
    return all(matcher.consume_token(t) for t in grammars.tokenizer.tokenize_str(text, parse_special=True)) \
        and matcher.is_accepting()


F = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"s": {"type": "string", "maxLength": 6}, "t": {"type": "string"}},
    "required": ["s"], "additionalProperties": False}}}]
Q = '<|"|>'


@pytest.mark.parametrize("quote_is_token", [True, False], ids=["quote-token", "quote-text"])
def test_gemma_calls_are_its_syntax_and_nothing_looser(tmp_path, quote_is_token):
    """Strings between ``<|"|>`` (a special token, or text: the first delimiter ends the string, as
    mlx-lm's parser reads it), bare keys, the schema's bounds and required keys."""
    tokens = [t for t in GEMMA_TOKENS if quote_is_token or t != Q]
    grammars = grammars_for(tmp_path, FAMILIES["gemma4"], tokens)
    constraint = grammars.tool_calls(F, name="f")
    for args, ok in [(f"s:{Q}ab,c{Q},t:{Q}x y{Q}", True), (f"s:{Q}ab{Q}", True), (f"s:{Q}abcdefg{Q}", False),
                     (f"t:{Q}a{Q}", False), (f'"s":{Q}a{Q}', False), (f"s:{Q}a{Q}x{Q}", False), ('s:"a"', False)]:
        assert accepts(grammars, constraint, f"<|tool_call>call:f{{{args}}}<tool_call|>") == ok, args


def test_llama_calls_and_text_beside_one_call(tmp_path):
    """Calls are the whole answer (``parameters``, ``;`` between, ``<|python_tag|>`` before);
    ``parallel_tool_calls: false`` with auto: one call, or text the parser cannot take for a call."""
    grammars = grammars_for(tmp_path, FAMILIES["llama3.1"], LLAMA_TOKENS)
    call = '{"name":"f","parameters":{"s":"ab"}}'
    many, one = grammars.tool_calls(F), grammars.answer(tools=F, calls="auto", parallel=False)
    assert accepts(grammars, many, f"<|python_tag|>{call}; {call}") and accepts(grammars, many, call)
    assert not accepts(grammars, many, call.replace("parameters", "arguments"))
    assert accepts(grammars, one, call) and accepts(grammars, one, "It is sunny.")
    assert not accepts(grammars, one, f"{call};{call}") and not accepts(grammars, one, ' {"a":1}')


def test_harmony_answers_are_its_channels(tmp_path):
    """The analysis message free, then the final message's JSON or one call to ``functions.NAME``
    with ``<|constrain|>json``; auto with one call at most needs no grammar (``<|call|>`` stops)."""
    grammars = grammars_for(tmp_path, FAMILIES["gpt-oss"], HARMONY_TOKENS)
    analysis = "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant"
    call = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"s":"ab"}'
    forced = grammars.tool_calls(F, name="f", reasoning="optional")
    assert accepts(grammars, forced, analysis + call) and accepts(grammars, forced, call)
    assert not accepts(grammars, forced, call.replace(" <|constrain|>json", ""))
    assert not accepts(grammars, forced, call.replace("functions.f", "f"))
    schema = grammars.json_schema({"type": "object"}, reasoning="optional")
    assert accepts(grammars, schema, analysis + '<|channel|>final<|message|>{"a":1}')
    assert not accepts(grammars, schema, '{"a":1}')
    assert grammars.answer(tools=F, calls="auto", parallel=False) is None


@pytest.mark.parametrize("thinking, mode", [(True, "optional"), (False, None)])
def test_gemma_reasoning_follows_the_thinking_switch(tmp_path, thinking, mode):
    """Thinking on, the template opens no thought (the model may: the grammar lets it); off, the
    generation prompt closes an empty one, and the answer starts at once."""
    from transformers import AutoTokenizer

    from dflash_mlx.server.structured import reasoning_mode

    grammars_for(tmp_path, FAMILIES["gemma4"], GEMMA_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, enable_thinking=thinking, return_dict=True)
    assert reasoning_mode(tokenizer, prompt["input_ids"]) == mode
