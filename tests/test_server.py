"""`dflash-mlx serve` as editors use it: the real server process, the official openai client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_mlx import generate, tiny
from dflash_mlx.api import load
from tests import subprocess_env
from tests.scripted import write_scripted_pair

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the module's pair ships in generation_config.json (Qwen3.5 ships its sampling there): a
# request that gives no sampling fields is greedy.
GENERATION_CONFIG = {"temperature": 0.0, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = tiny.write_pair(tmp_path_factory.mktemp("serve"))
    (target / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return target, draft


def start_server(target, draft, *options):
    """``dflash-mlx serve`` on a free port, once /health answers: (process, url). Its output goes
    to a file (``server_log``), not a pipe that nobody reads: a full pipe would stall the server."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"dflash-serve-{port}-", suffix=".log")[1])
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dflash_mlx.cli", "serve", "-m", str(target), "-d", str(draft), "--port", str(port), *options],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
        )
    process.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    process.wait(10)
    raise RuntimeError(server_log(process))


def server_log(process) -> str:
    return process.log.read_text()


def stop_server(process) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:  # a server that does not stop (the test has failed): no orphan
        process.kill()
        process.wait(10)
        raise
    finally:
        process.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server(pair):
    target, draft = pair
    process, url = start_server(target, draft, "--api-key", KEY, "--context-size", "600", "--max-request-bytes", "200000",
                                "--model-name", "tiny", "--max-tokens", "100000")
    yield url
    stop_server(process)


ENDLESS_TOKENS = 1 << 20


@pytest.fixture(scope="module")
def endless_pair(tmp_path_factory):
    """A target whose answer never ends by itself (it repeats a line, under a context of 2**20
    tokens): only a cancellation stops it, however fast or slow the machine."""
    return write_scripted_pair(tmp_path_factory.mktemp("endless"), "The quick brown fox", loop=True,
                               max_position_embeddings=ENDLESS_TOKENS)


@pytest.fixture(scope="module")
def endless(endless_pair):
    """A server on the endless pair (thinking off for every request by --chat-template-args):
    (process, url)."""
    process, url = start_server(*endless_pair, "--max-tokens", str(ENDLESS_TOKENS), "--context-size", str(ENDLESS_TOKENS),
                                "--chat-template-args", '{"enable_thinking": false}')
    yield process, url
    stop_server(process)


# The endless pair answers its line after a generation prompt that ends a line: thinking on.
ENDLESS_BODY = {"model": "target", "messages": [{"role": "user", "content": "go on forever"}], "temperature": 0,
                "max_tokens": ENDLESS_TOKENS, "chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(pair):
    target, draft = pair
    return load(str(target), draft=str(draft))


def chat(client, content, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kwargs)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_the_context_limit_counts_the_answer(client, pair, local):
    """--context-size 600: a 590-token prompt leaves room for 10 tokens, whatever max_tokens asks;
    without --context-size the limit is the target's max_position_embeddings."""
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 400, 590)]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=500, temperature=0)
    assert reply.usage.completion_tokens <= 10 and reply.choices[0].finish_reason == "length"
    from dflash_mlx.server import model_context_length

    target, _ = pair
    assert model_context_length(local[0]) == json.loads((target / "config.json").read_text())["max_position_embeddings"]


def metric(server, name: str) -> float:
    metrics = httpx.get(f"{server}/metrics").text
    return float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name + "{")))


def cancelled_total(server) -> float:
    return metric(server, "dflash_requests_cancelled_total")


@contextmanager
def stopped_early(server):
    """The request dropped inside the block (on the endless server, whose answers never end by
    themselves) was cancelled: its generation stopped, and the model is free again."""
    cancelled_before = cancelled_total(server)
    tokens_before = metric(server, "dflash_cancelled_generated_tokens_total")
    yield
    deadline = time.time() + 60
    while cancelled_total(server) == cancelled_before and time.time() < deadline:
        time.sleep(0.05)
    assert cancelled_total(server) == cancelled_before + 1, "the server never saw the client leave"
    generated = metric(server, "dflash_cancelled_generated_tokens_total") - tokens_before
    assert 0 <= generated < ENDLESS_TOKENS
    assert httpx.get(f"{server}/health").json()["queue_depth"] == 0


def logged(process, pattern: str, timeout: float = 10.0) -> str:
    """The server's log line matching ``pattern`` (written once the answer has gone out)."""
    import re

    deadline = time.time() + timeout
    while True:
        found = [line for line in server_log(process).splitlines() if re.search(pattern, line)]
        if found or time.time() > deadline:
            assert found, f"no log line matches {pattern!r}:\n{server_log(process)[-3000:]}"
            return found[-1]
        time.sleep(0.05)


def test_a_dropped_non_streaming_request_frees_the_model(endless):
    """The client gives up on a non-streaming answer that would never end: the server sees the
    disconnect and stops the generation; the request's log line says it was cancelled."""
    process, url = endless
    with stopped_early(url), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=ENDLESS_BODY, timeout=0.5)
    line = logged(process, r"POST /v1/chat/completions 200 .* finish=cancelled")
    assert "protocol=openai.chat model=target" in line and "generated_tokens=" in line


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
def test_ctrl_c_stops_the_server_during_a_generation(endless_pair, stream):
    """SIGINT while an answer that never ends by itself is being generated: the client is told
    (503) and the server exits within seconds, cleanly. Before, the exit aborted in MLX (a
    finished worker thread's compile cache freed while the interpreter finalized: ``terminate
    called``, status -6)."""
    import signal
    import threading

    process, url = start_server(*endless_pair, "--max-tokens", str(ENDLESS_TOKENS), "--context-size", str(ENDLESS_TOKENS))
    answers = []
    try:
        body = {**ENDLESS_BODY, "stream": stream}

        def ask():
            try:
                answers.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60))
            except httpx.HTTPError as e:
                answers.append(e)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        while httpx.get(f"{url}/health").json()["queue_depth"] == 0:
            time.sleep(0.05)
        start = time.time()
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
        log = server_log(process)
        assert "still running" not in log, log  # the engine's stop gave up waiting: the generation went on
        assert time.time() - start < 15, f"the server took {time.time() - start:.1f} s to exit"
        assert process.returncode == 0, f"exit status {process.returncode}:\n{log}"  # Ctrl-C is how a server stops
        assert "terminate called" not in log and "Traceback" not in log, log
        asking.join(10)
        answer = answers[0]
        if stream:
            assert answer.status_code == 200 and "the server is shutting down" in answer.text, answer.text[-500:]
        else:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["message"] == "the server is shutting down"
    finally:
        if process.poll() is None:
            process.kill()
        process.log.unlink(missing_ok=True)


def test_greedy_chat_equals_dflash_generate(client, local):
    model, tokenizer = local
    reply = chat(client, "def fibonacci(n):", max_tokens=24)
    expected = generate(model, tokenizer, [{"role": "user", "content": "def fibonacci(n):"}], max_tokens=24, block_tokens=4)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens <= 24 and reply.choices[0].finish_reason in ("length", "stop")


def test_a_request_without_sampling_fields_follows_generation_config(client, server, local):
    """The pair's generation_config.json says temperature 0: a request that gives no sampling
    field is greedy, its text the target's own (no draft); the Responses object reports the
    defaults it was sampled with (generation_config's top_p)."""
    model, tokenizer = local
    messages = [{"role": "user", "content": "class Queue:"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)  # the SDK sends no temperature
    assert reply.choices[0].message.content == generate(model, tokenizer, messages, max_tokens=24, use_draft=False)
    response = httpx.post(f"{server}/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "input": "hi", "max_output_tokens": 2}).json()
    assert (response["temperature"], response["top_p"]) == (0.0, 0.95)


def test_sampling_defaults_request_then_flags_then_generation_config(tmp_path):
    from dflash_mlx.server.engine import sampling_defaults

    assert sampling_defaults(tmp_path) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}  # mlx_lm.server's
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 5, "do_sample": True}))  # min_p 5: refused, left out
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    flags = {"temperature": 0.0, "top_p": None, "top_k": 4, "min_p": None}  # serve --temp 0 --top-k 4
    assert sampling_defaults(tmp_path, flags) == {"temperature": 0.0, "top_p": 0.95, "top_k": 4, "min_p": 0.0}


def test_the_default_context_limit_follows_the_memory(local, pair):
    """Without --context-size: the longest context whose caches (doctor's estimate) fit beside the
    weights and the prefix caches' budget, capped by the target's own limit; a prompt that
    leaves no room is refused with the numbers."""
    from dflash_mlx import device
    from dflash_mlx.doctor import estimate_memory
    from dflash_mlx.server import Engine
    from dflash_mlx.server.engine import ContextFull, memory_context_limit

    model, tokenizer = local
    target, draft = pair

    def need(context):
        return sum(estimate_memory(target, draft, None, context, draft_dtype=device.draft_activation_dtype()).values())

    reserve = 1 << 20
    engine = Engine(model, tokenizer, "tiny", memory_bytes=need(1000) + reserve, prompt_cache_bytes=reserve)
    limit = engine.context_limit
    assert need(limit) <= need(1000) < need(limit + 1) and limit >= 1000
    assert "memory" in engine.context_source
    with pytest.raises(ContextFull, match=rf"prompt has {limit} tokens; the context limit is {limit} "):
        engine.answer_budget(limit, 16)
    assert engine.answer_budget(limit - 5, 16) == 5  # an answer that does not fit stops at the limit
    assert memory_context_limit(model, memory_bytes=1 << 50, upper=4096) == 4096  # the target's own limit caps it
    assert memory_context_limit(model, memory_bytes=need(1) - 1, upper=4096) == 0
    assert Engine(model, tokenizer, "tiny", memory_bytes=1 << 50).context_limit == 4096  # max_position_embeddings


def test_cors_follows_allowed_origins(local):
    from fastapi.testclient import TestClient

    from dflash_mlx.server import create_app

    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    anyone = TestClient(create_app(*local, "tiny"))  # the default, as mlx_lm.server: '*'
    r = anyone.options("/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    only = TestClient(create_app(*local, "tiny", allowed_origins=["https://app.example"]))
    r = only.options("/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = only.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in r.headers
    r = only.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_openai_message_forms(client, server, local):
    """developer is system for the template; content given as text parts is their concatenation;
    other parts are refused, naming their type. Compared with the target alone."""
    model, tokenizer = local
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Answer in "}, {"type": "text", "text": "Python."}]},
             {"role": "user", "content": [{"type": "text", "text": "def fib"}, {"type": "text", "text": "onacci(n):"}]}]
    plain = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "def fibonacci(n):"}]
    reply = client.chat.completions.create(model="tiny", messages=parts, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == generate(model, tokenizer, plain, max_tokens=16, use_draft=False)
    as_system = client.chat.completions.create(model="tiny", messages=plain, max_tokens=16, temperature=0)
    assert reply.usage.prompt_tokens == as_system.usage.prompt_tokens == len(
        tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
    error = refused.value.body
    assert "'image_url'" in error["message"] and error["param"] == "messages[0].content[1]"


def test_chat_template_args_apply_under_the_requests_own(endless, endless_pair):
    """--chat-template-args '{"enable_thinking": false}' reaches every protocol's template; a
    request's chat_template_kwargs win."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    _, url = endless
    tokenizer = load_tokenizer(endless_pair[0])
    messages = [{"role": "user", "content": "hello"}]

    def tokens(thinking):
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=thinking))

    assert tokens(False) != tokens(True)
    body = {"model": "target", "messages": messages, "max_tokens": 1}
    usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == tokens(False)
    body["chat_template_kwargs"] = {"enable_thinking": True}
    usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == tokens(True)
    counted = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "target", "messages": messages}).json()
    assert counted["input_tokens"] == tokens(False)


def test_every_request_leaves_a_log_line(endless):
    process, url = endless
    body = {**ENDLESS_BODY, "max_tokens": 3}
    for _ in range(2):  # the second reuses the first's prompt from the prefix cache
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    logged(process, r"INFO - POST /v1/chat/completions 200 \d+\.\d+s protocol=openai.chat model=target "
                    r"prompt_tokens=\d+ reused_tokens=[1-9]\d* generated_tokens=3 finish=length$")
    # Any model name is served (docs/server.md): the line names the one asked for.
    assert httpx.post(f"{url}/v1/chat/completions", json={**body, "model": "gpt-4"}).status_code == 200
    logged(process, r"INFO - POST /v1/chat/completions 200 \d+\.\d+s protocol=openai.chat model=gpt-4 ")
    refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "n": 2})
    assert refused.status_code == 400
    logged(process, r"WARNING - POST /v1/chat/completions 400 \d+\.\d+s protocol=openai.chat model=target "
                    r"prompt_tokens=- reused_tokens=- generated_tokens=- finish=-$")
    assert httpx.post(f"{url}/v1/messages", json={"model": "target"}).status_code == 400  # no messages: refused
    logged(process, r"WARNING - POST /v1/messages 400 .* protocol=anthropic.messages model=- ")


def test_metrics_show_the_block_sizes_in_use(client, server):
    """The server runs the default, auto; /metrics counts its cycles per block size."""
    chat(client, "def fibonacci(n):", max_tokens=24)
    lines = [l for l in httpx.get(f"{server}/metrics").text.splitlines() if l.startswith("dflash_cycles_total{")]
    sizes = {int(l.split('block_tokens="')[1].split('"')[0]): int(l.split()[-1]) for l in lines}
    assert sizes and set(sizes) <= set(range(1, 17)) and sum(sizes.values()) >= 1
    values = {l.split("{")[0]: float(l.split()[-1]) for l in httpx.get(f"{server}/metrics").text.splitlines()
              if l.startswith("dflash_auto_")}
    assert 0 <= values["dflash_auto_probe_seconds_total"] <= values["dflash_auto_cycle_seconds_total"]
    assert values["dflash_auto_cycle_seconds_total"] > 0


def test_metrics_account_for_the_prompt_cache(client, server):
    chat(client, "def fibonacci(n):", max_tokens=4)
    values = {l.split("{")[0]: float(l.split()[-1]) for l in httpx.get(f"{server}/metrics").text.splitlines()
              if l.startswith("dflash_prompt_cache")}
    assert values["dflash_prompt_cache_bytes"] > 0 and values["dflash_prompt_cache_histories"] >= 1
    assert values["dflash_prompt_cache_budget_bytes"] == 4e9  # the --prompt-cache-gb default


def test_streaming_chat_matches_non_streaming(client):
    whole = chat(client, "class Stack:", max_tokens=20).choices[0].message.content
    chunks = list(chat(client, "class Stack:", max_tokens=20, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-2].choices[0].finish_reason in ("length", "stop")


def test_completions_with_suffix_fill_in_the_middle(client, local):
    model, tokenizer = local
    reply = client.completions.create(model="tiny", prompt="def add(a, b):\n", suffix="\n    return c", max_tokens=12, temperature=0)
    fim = "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c<|fim_middle|>"
    assert reply.choices[0].text == generate(model, tokenizer, fim, max_tokens=12, block_tokens=4)
    plain = client.completions.create(model="tiny", prompt="def add(a, b):\n", max_tokens=12, temperature=0)
    assert plain.usage.prompt_tokens < reply.usage.prompt_tokens


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tools_are_rendered_and_calls_parsed(client, local):
    with_tools = chat(client, "weather in Paris?", tools=TOOLS)
    without = chat(client, "weather in Paris?")
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the tool schema is in the prompt
    # The parser the server applies to the model's output (mlx-lm's qwen3_coder parser).
    from dflash_mlx.server.openai import _Reply

    _, tokenizer = local
    output = "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    content, calls = _Reply("chat.completion", "tiny", tokenizer, TOOLS)._tool_calls(output)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}


def test_stop_and_seed(client):
    full = chat(client, "The quick", max_tokens=30).choices[0].message.content
    stop = full[8:11]
    stopped = chat(client, "The quick", max_tokens=30, stop=[stop])
    assert stopped.choices[0].message.content == full[: full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    a = chat(client, "def", temperature=0.9, top_p=0.95, seed=7, max_tokens=20).choices[0].message.content
    b = chat(client, "def", temperature=0.9, top_p=0.95, seed=7, max_tokens=20).choices[0].message.content
    assert a == b
    others = {chat(client, "def", temperature=0.9, top_p=0.95, seed=s, max_tokens=20).choices[0].message.content for s in (8, 9)}
    assert len(others | {a}) > 1  # the seed reaches the sampler: not greedy, not one fixed draw


def test_eight_concurrent_clients(client):
    prompts = [f"question {i}" for i in range(8)]
    expected = {p: chat(client, p).choices[0].message.content for p in prompts}

    def worker(p):
        return [chat(client, p).choices[0].message.content for _ in range(3)]

    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(prompts, pool.map(worker, prompts)))
    assert all(answers == [expected[p]] * 3 for p, answers in results.items())


def test_a_dropped_stream_frees_the_model(endless):
    """A client leaves in the middle of a streamed answer that would never end: only the
    cancellation can stop it."""
    process, url = endless
    with stopped_early(url), httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json={**ENDLESS_BODY, "stream": True}) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
        # The connection is closed here, mid-stream.
    body = {**ENDLESS_BODY, "max_tokens": 1}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 1


def test_prefix_cache_is_lossless(client):
    context = " ".join(f"line {i}: value = compute({i})" for i in range(12))
    cold = chat(client, context + " first question", max_tokens=16)
    warm = chat(client, context + " first question", max_tokens=16)
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1


def test_bad_requests_get_openai_errors(server, client):
    url = f"{server}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    good = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    cases = [
        (dict(content=b"{not json"), 400, "malformed JSON"),
        (dict(json={**good, "max_tokens": "many"}), 400, "max_tokens"),
        (dict(json={**good, "messages": "hello"}), 400, "messages"),
        (dict(json={**good, "n": 2}), 400, "only n=1"),
        (dict(json={**good, "messages": [{"role": "user", "content": "word " * 700}]}), 400, "maximum context length is 600 tokens"),
        (dict(content=b"x" * 300000), 413, "larger than"),
    ]
    for kwargs, status, message in cases:
        r = httpx.post(url, headers={**auth, "content-type": "application/json"}, **kwargs)
        assert r.status_code == status, (kwargs, r.text)
        assert message in r.json()["error"]["message"]
    # A chunked body (no Content-Length) is counted as it streams in.
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"x" * 10000
        yield b'"}]}'

    r = httpx.post(url, headers={**auth, "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, headers=headers, json=good)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0).models.list()


anything = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 12) | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "other"]) | anything,
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]) | anything, "content": st.text(max_size=30) | anything}), max_size=3) | anything,
        "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 600), max_size=5) | anything,
        "suffix": st.text(max_size=10) | anything,
        "max_tokens": st.integers(-2, 6) | anything,
        "temperature": st.floats(-1, 3) | anything,
        "top_p": st.floats(-1, 2) | anything,
        "top_k": st.integers(-2, 50) | anything,
        "stop": st.text(max_size=4) | anything,
        "stream": st.booleans() | anything,
        "seed": anything,
        "n": st.integers(0, 3) | anything,
        "tools": anything,
        # Anthropic's Messages fields
        "system": st.text(max_size=20) | anything,
        "stop_sequences": st.lists(st.text(max_size=4), max_size=2) | anything,
        "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"]) | anything}) | anything,
        "tool_choice": anything,
        # OpenAI's Responses fields
        "input": st.text(max_size=20) | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "other"]) | anything},
            optional={"role": st.sampled_from(["user", "assistant", "developer", "tool"]) | anything, "content": anything,
                      "call_id": anything, "name": anything, "arguments": st.text(max_size=10) | anything, "output": anything}),
            max_size=3) | anything,
        "instructions": st.text(max_size=10) | anything,
        "max_output_tokens": st.integers(-1, 6) | anything,
        "reasoning": anything,
    },
)
anthropic_content = st.text(max_size=20) | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]) | anything},
    optional={"text": st.text(max_size=10) | anything, "id": anything, "name": anything, "input": anything,
              "tool_use_id": anything, "content": anything, "thinking": anything}), max_size=3)
anthropic_fields = fields | st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 6),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": anthropic_content}),
                          min_size=1, max_size=3)},
    optional={"stream": st.booleans(), "system": st.text(max_size=10), "temperature": st.floats(0, 1)},
)


def stream_errors(response) -> list:
    """The error events of a streamed answer, read to its end (an answer that fails after its
    headers is still a 200): OpenAI's ``data: {"error": ...}``, the Responses and Messages APIs'
    ``error`` events."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return []
    errors = []
    for line in response.text.splitlines():
        if line.startswith("event: error"):
            errors.append(line)
        elif line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            if event.get("error") is not None:
                errors.append(event)
    return errors


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=fields, endpoint=st.sampled_from(["chat/completions", "completions", "responses"]))
def test_fuzzed_requests_never_get_a_server_error(server, body, endpoint):
    r = httpx.post(f"{server}/v1/{endpoint}", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) >= {"message", "type"}
    assert not stream_errors(r), (body, r.text)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=anthropic_fields, endpoint=st.sampled_from(["messages", "messages/count_tokens"]))
def test_fuzzed_messages_requests_never_get_a_server_error(server, body, endpoint):
    r = httpx.post(f"{server}/v1/{endpoint}", headers={"x-api-key": KEY}, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert r.json()["type"] == "error" and set(r.json()["error"]) >= {"message", "type"}
    assert not stream_errors(r), (body, r.text)


def test_openapi_schema_and_survival(server):
    schema = httpx.get(f"{server}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/v1/messages/count_tokens",
            "/v1/responses"} <= set(schema["paths"])
    assert httpx.get(f"{server}/health").json()["status"] == "ok"  # nothing above killed the process


def test_editor_examples_work_against_the_server(server):
    import yaml

    done = subprocess.run(
        [sys.executable, "examples/editors/openai_sdk.py", f"{server}/v1", KEY], cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "prompt tokens from cache]" in done.stdout
    env = {**os.environ, "BASE": server, "KEY": KEY}
    curl = subprocess.run(["bash", "examples/editors/curl.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert curl.returncode == 0, curl.stderr
    assert "data: [DONE]" in curl.stdout and '"text_completion"' in curl.stdout and "dflash_tokens_per_cycle" in curl.stdout
    continue_config = yaml.safe_load((ROOT / "examples/editors/continue-config.yaml").read_text())
    assert {m["apiBase"] for m in continue_config["models"]} == {"http://127.0.0.1:8080/v1"}
    zed = (ROOT / "examples/editors/zed-settings.json").read_text()
    zed = json.loads("\n".join(line for line in zed.splitlines() if not line.lstrip().startswith("//")))
    assert zed["language_models"]["openai_compatible"]["dflash-mlx"]["api_url"] == "http://127.0.0.1:8080/v1"


def test_two_alternating_clients_both_reuse_their_caches(client):
    """A chat client and an autocomplete client take turns: neither wipes the other's cache."""
    conversation = " ".join(f"chat line {i}: note {i * 3}" for i in range(10))
    source = [int(t) for t in np.random.default_rng(5).integers(3, 400, 120)]
    for round in range(3):
        reply = chat(client, conversation, max_tokens=4)
        completion = client.completions.create(model="tiny", prompt=source, max_tokens=4, temperature=0)
        if round:  # each resends its own context: all but the last prompt token comes from its history
            assert reply.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens - 1
            assert completion.usage.prompt_tokens_details.cached_tokens == len(source) - 1
