"""Structured outputs with speculation on are the constrained target's own output.

Oracles, none of them the code under test: greedy is a plain loop written here (the target's full
forward over the whole sequence each step, its logits masked by a matcher of llguidance's own API
with its numpy bitmask helpers, argmax in numpy); sampling is the exact joint distribution of the
constrained target (the same matcher's masks, mlx-lm's own sampler distribution through
``tests.test_sampling.reference_probs``), checked by chi-square; batched is the request alone.
"""

from __future__ import annotations

import json
from typing import Dict, List, Literal, Optional, Sequence

import llguidance as llg
import mlx.core as mx
import numpy as np
import openai
import pytest
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
from pydantic import BaseModel, Field

from dflash_mlx.api import encode_prompt, load
from dflash_mlx.block_policy import FixedBlock
from dflash_mlx.decoder import Decoder
from dflash_mlx.grammar import GrammarError, Grammars
from dflash_mlx.loading import load_target
from dflash_mlx.sampling import Sampler
from tests.conftest import make_draft, make_hf_target
from tests.test_sampling import goodness_of_fit, reference_probs, resend

# Nested objects, enums, a bounded integer and a short string: every answer under it ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["def", "class", "import"]},
        "line": {"type": "integer", "minimum": 0, "maximum": 99},
        "where": {"type": "object", "properties": {"file": {"enum": ["a.py", "b.py"]}, "ok": {"type": "boolean"}},
                  "required": ["file", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "line", "where"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                               "required": ["city", "days"]}}}]  # bounded: every call ends


@pytest.fixture(scope="module")
def demo():
    return load("demo")


@pytest.fixture(scope="module")
def grammars(demo):
    model, tokenizer = demo
    return Grammars.for_tokenizer(tokenizer, model.target.args.vocab_size)


def prompt(tokenizer, text: str) -> mx.array:
    return encode_prompt(tokenizer, [{"role": "user", "content": text}])


def decode(decoder: Decoder, prompts: Sequence[mx.array], constraints, samplers, max_tokens: int, block: int = 8,
           stop_tokens=(), caches=None) -> List[List[int]]:
    """Each prompt's answer (up to its stop token), the sequences decoded together in one batch
    (``caches``: each one's target and draft caches holding what comes before its prompt)."""
    _, commits = decode_commits(decoder, prompts, constraints, samplers, max_tokens, stop_tokens, block, caches)
    return [cut([t for c in mine for t in c.tokens], max_tokens, stop_tokens) for mine in commits]


def cut(tokens: List[int], max_tokens: int, stop_tokens) -> List[int]:
    tokens = tokens[:max_tokens]
    for i, t in enumerate(tokens):
        if t in stop_tokens:
            return tokens[: i + 1]
    return tokens


def constrained_target_only(target, prompt_ids: mx.array, grammar: str, ll_tokenizer, max_tokens: int,
                            stop_tokens) -> List[int]:
    """The oracle: greedy decoding by the target's full forward, masked by llguidance's own matcher."""
    matcher = llg.LLMatcher(ll_tokenizer, grammar)
    bitmask = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    tokens: List[int] = []
    while len(tokens) < max_tokens:
        logits = np.array(target(mx.array(prompt_ids.tolist() + tokens)[None])[0, -1].astype(mx.float32))[None]
        fill_next_token_bitmask(matcher, bitmask)
        apply_token_bitmask_inplace(logits, bitmask)
        token = int(np.argmax(logits[0]))
        tokens.append(token)
        if token in stop_tokens:
            break
        assert matcher.consume_token(token), matcher.get_error()
    return tokens


def is_valid(value, schema) -> bool:
    """The part of JSON schema SCHEMA uses, checked here by hand."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema["required"]) <= value.keys() <= props.keys()
                and all(is_valid(value[k], props[k]) for k in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(kind)


def test_greedy_speculation_under_a_schema_is_constrained_target_only(demo, grammars):
    """Over several blocks (the answer is 40+ tokens at block 8), with the draft's refused picks
    replaced, the answer is token for token the oracle's, a JSON document valid under the schema,
    and the draft's proposals were accepted (speculation ran)."""
    model, tokenizer = demo
    constraint = grammars.json_schema(SCHEMA)
    stops = set(tokenizer.eos_token_ids)
    p = prompt(tokenizer, "Describe the function fibonacci as JSON.")
    want = constrained_target_only(model.target, p, constraint.grammar, grammars.tokenizer, 80, stops)
    decoder = Decoder(model.target, model.draft)
    got = decode(decoder, [p], [constraint], [Sampler()], 80, stop_tokens=stops)[0]
    assert got == want
    assert got[-1] in stops and len(got) > 16
    value = json.loads(tokenizer.decode(got[:-1]))
    assert is_valid(value, SCHEMA), value


def test_stream_generate_takes_a_constraint(demo, grammars):
    """The API's ``constraint=`` runs the request under the grammar through the driver: its tokens
    are the independent oracle's (constrained target-only decoding), at auto blocks."""
    from dflash_mlx.api import stream_generate

    model, tokenizer = demo
    constraint = grammars.json_schema(SCHEMA)
    p = prompt(tokenizer, "Describe the function push as JSON.")
    want = constrained_target_only(model.target, p, constraint.grammar, grammars.tokenizer, 60,
                                   set(tokenizer.eos_token_ids))
    got = [r.token for r in stream_generate(model, tokenizer, p, max_tokens=60, constraint=constraint)]
    assert got == want


def test_forced_tool_call_parses_with_the_familys_parser(demo, grammars):
    model, tokenizer = demo
    stops = set(tokenizer.eos_token_ids)
    constraint = grammars.tool_calls(TOOLS, name="get_weather", parallel=False)
    p = mx.array(tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                                               add_generation_prompt=True))
    got = decode(Decoder(model.target, model.draft), [p], [constraint], [Sampler()], 120, stop_tokens=stops)[0]
    assert got[-1] in stops, tokenizer.decode(got)
    text = tokenizer.decode(got[:-1])
    assert text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\n") and text.endswith("</tool_call>")
    call = tokenizer.tool_parser(text[len("<tool_call>"): -len("</tool_call>")].strip(), TOOLS)  # mlx-lm's parser
    assert call["name"] == "get_weather" and call["arguments"]["city"] in ("Paris", "Rome"), call
    assert 1 <= call["arguments"]["days"] <= 7, call


def test_a_batched_constrained_request_is_as_alone(demo, grammars):
    """Greedy and seeded sampling, a constrained request beside an unconstrained one."""
    model, tokenizer = demo
    stops = set(tokenizer.eos_token_ids)
    constraint = grammars.json_schema(SCHEMA)
    prompts = [prompt(tokenizer, "Describe class Stack as JSON."), prompt(tokenizer, "Write a function.")]
    for settings in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.95)):
        samplers = lambda: [Sampler(**settings).for_request(3), Sampler(**settings).for_request(4)]
        together = decode(Decoder(model.target, model.draft), prompts, [constraint, None], samplers(), 40,
                          stop_tokens=stops)
        alone = [decode(Decoder(model.target, model.draft), [p], [c], [s], 40, stop_tokens=stops)[0]
                 for p, c, s in zip(prompts, [constraint, None], samplers())]
        assert together == alone, settings


def decode_commits(decoder: Decoder, prompts, constraints, samplers, max_tokens: int, stop_tokens, block: int = 4,
                   caches=None):
    """Every commit of a batch decoded together (tokens and log-probs), and the sequences."""
    seqs, commits = [], []
    for p, c, s, (cache, draft_cache) in zip(prompts, constraints, samplers, caches or [(None, None)] * len(prompts)):
        start = decoder.start(p, s, FixedBlock(block), cache, draft_cache, max_tokens=max_tokens, stop_tokens=stop_tokens,
                              constraint=c)
        while True:
            try:
                next(start)
            except StopIteration as done:
                seq, commit = done.value
                break
        seqs.append(seq)
        commits.append([commit])
    while any(not s.done for s in seqs):
        live = [i for i, s in enumerate(seqs) if not s.done]
        for i, commit in zip(live, decoder.cycle([seqs[i] for i in live])):
            commits[i].append(commit)
    return seqs, commits


def test_masks_computed_ahead_change_nothing(demo, grammars):
    """Masks computed on the worker (each block's first while the draft's pass runs, its last while
    the verify pass is queued; two constrained sequences side by side, one free) give the serial
    path's (``overlap=False``) tokens and log-probs bit for bit, greedy and sampled; and the worker
    did compute them. The oracle test above runs the overlapped path against llguidance alone."""
    model, tokenizer = demo
    stops = set(tokenizer.eos_token_ids)
    serial = Grammars.for_tokenizer(tokenizer, model.target.args.vocab_size, overlap=False)
    assert grammars.pool is not None and serial.pool is None
    prompts = [prompt(tokenizer, "Describe class Stack as JSON."),
               prompt(tokenizer, "Describe the function main as JSON."),
               prompt(tokenizer, "Write a function.")]
    for settings in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.95)):
        runs = []
        for g in (grammars, serial):
            constraint = g.json_schema(SCHEMA)
            runs.append(decode_commits(Decoder(model.target, model.draft), prompts, [constraint, constraint, None],
                                       [Sampler(**settings).for_request(i) for i in range(3)], 40, stops))
        (ahead, ahead_commits), (serial_seqs, serial_commits) = runs
        assert all(s.constraint.ahead_seconds > 0 for s in ahead[:2]), "no mask was computed ahead"
        assert all(s.constraint.ahead_seconds == 0 for s in serial_seqs[:2])
        for a, b in zip(ahead_commits, serial_commits):
            assert [c.tokens for c in a] == [c.tokens for c in b], settings
            assert all(np.array_equal(np.array(x.logprobs.astype(mx.float32)), np.array(y.logprobs.astype(mx.float32)))
                       for x, y in zip(a, b)), settings
        assert sum(c.accepted for c in ahead_commits[0]) > 0  # the grammar's walk ran over drafted blocks


# ---- sampling: chi-square against the constrained target's exact distribution --------------------

V = 8
TOKENS = [b'"', b"a", b"b", b"ab", b"c", b"x", b"<eos>", b"<mask>"]  # 6: end of answer, 7: the draft's mask
EOS = 6
SAMPLES = 1216  # a multiple of the 16 decoded together


class TinyTokenizer:
    """An 8-token vocabulary for llguidance (the chi-square needs a joint over few cells)."""

    eos_token_id, bos_token_id, tokens, special_token_ids = EOS, None, TOKENS, [EOS, 7]

    def __call__(self, data) -> List[int]:
        data = data.encode() if isinstance(data, str) else data
        return [TOKENS.index(bytes([b])) for b in data]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    path = make_hf_target(tmp_path_factory.mktemp("structured_target"), vocab_size=V, seed=11)
    target, config = load_target(path)
    draft = make_draft(tmp_path_factory.mktemp("structured_draft"), target, config, block_size=4, seed=12)
    ll = llg.LLTokenizer(llg.TokenizerWrapper(TinyTokenizer()))
    return target, draft, Grammars(ll, V, [EOS])


def exact_constrained_joint(target, prompt_ids, grammar, ll, sampler) -> np.ndarray:
    """P(t1, t2) when the constrained target samples t0, t1, t2: llguidance's masks, mlx-lm's filters."""
    joint = np.zeros((V, V))

    def row(history):
        matcher = llg.LLMatcher(ll, grammar)
        assert matcher.consume_tokens(history)
        bitmask = allocate_token_bitmask(1, V)
        fill_next_token_bitmask(matcher, bitmask)
        logits = np.array(target(mx.array(prompt_ids + history)[None])[0, -1].astype(mx.float32))[None]
        apply_token_bitmask_inplace(logits, bitmask)
        return reference_probs(sampler, logits[0])

    p0 = row([])
    for a in np.nonzero(p0)[0]:
        p1 = row([int(a)]) if a != EOS else np.eye(V)[EOS]
        for b in np.nonzero(p1)[0]:
            p2 = row([int(a), int(b)]) if EOS not in (a, b) else np.eye(V)[EOS]
            joint[b] += p0[a] * p1[b] * p2
    return joint


@pytest.mark.slow  # chi-square over a thousand sampled answers
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=2)],
                         ids=["plain", "filtered"])
def test_sampled_speculation_follows_the_constrained_target(tiny_pair, settings):
    target, draft, grammars = tiny_pair
    # A JSON string of a, b, ab and c, at most 4 characters: the mask changes at every position.
    constraint = grammars.json_schema({"type": "string", "pattern": "^[abc]*$", "maxLength": 4})
    prompt_ids = [1, 5, 2, 4, 3]
    sampler = Sampler(**settings)
    decoder = Decoder(target, draft)
    counts = np.zeros((V, V))
    width = 16  # samples decoded together (each as alone: its own generator)
    caches = resend(target, draft, mx.array(prompt_ids))  # each answer resends the prompt: bit for bit from scratch
    for first in range(0, SAMPLES, width):
        answers = decode(decoder, [mx.array(prompt_ids[-1:])] * width, [constraint] * width,
                         [sampler.for_request(first + i) for i in range(width)], 3, block=4, stop_tokens={EOS},
                         caches=[caches() for _ in range(width)])
        for tokens in answers:
            tokens += [EOS] * (3 - len(tokens))
            counts[tokens[1], tokens[2]] += 1
    expected = exact_constrained_joint(target, prompt_ids, constraint.grammar, grammars.tokenizer, sampler)
    pvalue = goodness_of_fit(counts, expected)
    assert pvalue > 1e-3, f"constrained speculative samples do not follow the constrained target (p={pvalue:.2g})"


def test_uncompilable_schemas_name_the_part(grammars):
    with pytest.raises(GrammarError, match=r"(?s)response_format.*look-around"):
        grammars.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}},
                             param="response_format")
    with pytest.raises(GrammarError, match="strin"):
        grammars.json_schema({"type": "strin"})
    with pytest.raises(GrammarError, match="no tool named 'nope'"):
        grammars.tool_calls(TOOLS, name="nope")


# ---- through the server: the three APIs, the official clients ---------------------------------------

class Where(BaseModel):
    file: Literal["a.py", "b.py"]
    ok: bool


class Item(BaseModel):
    kind: Literal["def", "class", "import"]
    line: int = Field(ge=0, le=99)
    where: Where


BAD = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}


@pytest.fixture(scope="module")
def app(demo):
    from fastapi.testclient import TestClient

    from dflash_mlx.server.app import create_app

    model, tokenizer = demo
    with TestClient(create_app(model, tokenizer, "demo", max_tokens_default=120)) as client:
        yield client


def chat(app, **body):
    return app.post("/v1/chat/completions", json={"model": "demo", "messages": [{"role": "user", "content": "Describe fibonacci."}],
                                                  "max_tokens": 120, **body})


def test_chat_completions_response_format(app):
    answer = chat(app, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}).json()
    assert is_valid(json.loads(answer["choices"][0]["message"]["content"]), SCHEMA), answer
    answer = chat(app, response_format={"type": "json_object"}).json()
    assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict), answer


def test_the_openai_sdks_parse_with_a_pydantic_model(app):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=app)
    completion = client.chat.completions.parse(model="demo", messages=[{"role": "user", "content": "fibonacci"}],
                                               response_format=Item, max_tokens=120)
    item = completion.choices[0].message.parsed
    assert isinstance(item, Item) and item.where.file in ("a.py", "b.py")


def test_responses_text_format(app):
    body = {"model": "demo", "input": "Describe fibonacci.", "max_output_tokens": 120,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}}
    answer = app.post("/v1/responses", json=body).json()
    text = "".join(c["text"] for item in answer["output"] if item["type"] == "message" for c in item["content"])
    assert is_valid(json.loads(text), SCHEMA), answer


@pytest.mark.parametrize("where", ["output_config", "output_format"])
def test_messages_output_format(app, where):
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = {"model": "demo", "max_tokens": 120, "messages": [{"role": "user", "content": "Describe fibonacci."}],
            **({"output_config": {"format": fmt}} if where == "output_config" else {"output_format": fmt})}
    answer = app.post("/v1/messages", json=body).json()
    text = "".join(b["text"] for b in answer["content"] if b["type"] == "text")
    assert is_valid(json.loads(text), SCHEMA), answer


def test_forced_tool_choice_on_every_route(app):
    named = chat(app, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False).json()
    calls = named["choices"][0]["message"].get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] == ["get_weather"], named
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    answer = app.post("/v1/responses", json={"model": "demo", "input": "Weather?", "tools": tools, "tool_choice": "required",
                                             "max_output_tokens": 120}).json()
    assert [i["name"] for i in answer["output"] if i["type"] == "function_call"][:1] == ["get_weather"], answer
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    answer = app.post("/v1/messages", json={"model": "demo", "max_tokens": 120, "tools": tools,
                                            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                            "messages": [{"role": "user", "content": "Weather?"}]}).json()
    assert [b["name"] for b in answer["content"] if b["type"] == "tool_use"] == ["get_weather"], answer


def test_an_uncompilable_schema_is_a_400_naming_the_part(app):
    cases = [("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}],
                                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
              "response_format"),
             ("/v1/responses", {"model": "demo", "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD}}},
              "text.format"),
             ("/v1/messages", {"model": "demo", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                               "output_config": {"format": {"type": "json_schema", "schema": BAD}}}, "output_config.format")]
    for route, body, part in cases:
        answer = app.post(route, json=body)
        assert answer.status_code == 400, (route, answer.text)
        assert part in answer.text and "look-around" in answer.text, (route, answer.text)
    answer = chat(app, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert answer.status_code == 400 and "nope" in answer.text, answer.text
