"""The live server with several requests at once, through the official ``openai`` and
``anthropic`` SDKs: four concurrent streams, each answered as it is alone, and a fifth beyond
``--max-queue`` refused with a 503 and Retry-After."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import anthropic
import httpx
import openai
import pytest

from dflash_mlx import tiny
from tests.scripted import write_scripted_pair
from tests.test_server import start_server, stop_server

pytestmark = pytest.mark.slow  # two server processes, each loading a pair


def openai_stream(url, content, max_tokens):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def anthropic_stream(url, content, max_tokens):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    events = client.messages.create(model="tiny", max_tokens=max_tokens, stream=True,  # greedy: the server default
                                    messages=[{"role": "user", "content": content}])
    return "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")


def test_four_concurrent_streams_are_each_answered_as_alone(tmp_path):
    target, draft = tiny.write_pair(tmp_path)
    process, url = start_server(target, draft, "--max-concurrent", "4", "--model-name", "tiny", "--context-size", "2048")
    try:
        asks = [(openai_stream, "write a loop", 40), (anthropic_stream, "name three colours", 33),
                (openai_stream, "say hello", 25), (anthropic_stream, "count to five please", 48)]
        alone = [ask(url, content, n) for ask, content, n in asks]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda a: a[0](url, a[1], a[2]), asks))
        assert together == alone and all(alone)
        metrics = httpx.get(f"{url}/metrics").text
        assert "dflash_time_to_first_token_seconds_count" in metrics and "dflash_rows_per_pass" in metrics
    finally:
        stop_server(process)


def test_a_request_beyond_the_queue_gets_503_and_a_freed_slot_serves_the_next(tmp_path):
    target, draft = write_scripted_pair(tmp_path, "The quick brown fox", loop=True, max_position_embeddings=1 << 20)
    process, url = start_server(target, draft, "--max-concurrent", "4", "--max-queue", "0", "--max-tokens", str(1 << 20),
                                "--context-size", str(1 << 20), "--chat-template-args", '{"enable_thinking": false}')
    endless = [{"role": "user", "content": "go on forever"}]
    try:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
        streams = [oa.chat.completions.create(model="t", messages=endless, max_tokens=1 << 20, temperature=0, stream=True)
                   for _ in range(2)]
        streams += [an.messages.create(model="t", messages=endless, max_tokens=1 << 20, stream=True)
                    for _ in range(2)]
        for stream in streams:  # each of the four is running: it has sent something
            next(iter(stream))
        with pytest.raises(openai.APIStatusError) as refused:
            oa.chat.completions.create(model="t", messages=endless, max_tokens=5, temperature=0)
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"].isdigit()
        with pytest.raises(anthropic.APIStatusError) as refused:
            an.messages.create(model="t", messages=endless, max_tokens=5)
        assert refused.value.status_code == 503 and refused.value.body["error"]["type"] == "overloaded_error"
        streams[0].close()  # a client that leaves frees its slot at the next round, once the server sees it gone
        deadline, answer = time.monotonic() + 30, None
        while answer is None and time.monotonic() < deadline:
            try:
                answer = oa.chat.completions.create(model="t", messages=endless, max_tokens=5, temperature=0)
            except openai.APIStatusError as e:
                assert e.status_code == 503
                time.sleep(0.05)
        assert answer is not None and answer.choices[0].message.content
        for stream in streams[1:]:
            stream.close()
    finally:
        stop_server(process)


def sse_chat(url: str, body: dict, leave_after: Optional[int] = None):
    """A streamed chat answer read to its end (or left after ``leave_after`` chunks, the connection
    closed): its text, the error events it carried, and whether it ended with ``[DONE]``."""
    text, errors, chunks = "", [], 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, errors, True
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
                continue
            text += "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return text, errors, False
    return text, errors, False


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.parametrize("concurrency", ["4", "1"])
def test_sixteen_clients_with_three_leaving_are_each_answered_as_alone(tmp_path, concurrency):
    """16 streamed chats at once (4 of them seeded sampled), 3 clients leaving mid-answer (one of
    them the last submitted): no stream carries an error event, every finished answer is the same
    request's answer alone, and a second burst leaves the prefix cache as the first did (a
    history a cancel kept busy would make the second burst fork more)."""
    target, draft = tiny.write_pair(tmp_path, block_size=4)
    process, url = start_server(target, draft, "--max-concurrent", concurrency, "--context-size", "2048",
                                "--prompt-cache-gb", "1")
    bodies = [{"model": "tiny", "max_tokens": 40, "temperature": 0,
               "messages": [{"role": "user", "content": f"request {i}: " + "lorem ipsum " * (i % 5 + 1)}]}
              for i in range(16)]
    for i in (2, 7, 11, 13):
        bodies[i].update(temperature=0.8, seed=100 + i)
    leaving = {3: 3, 9: 2, 15: 3}
    try:
        alone = [sse_chat(url, body) for body in bodies]
        assert all(done and not errors for _, errors, done in alone)
        histories = []
        for burst in range(2):
            with ThreadPoolExecutor(16) as pool:
                together = list(pool.map(lambda i: sse_chat(url, bodies[i], leaving.get(i)), range(16)))
            for i, (text, errors, done) in enumerate(together):
                assert not errors, (i, errors)
                if i in leaving:
                    assert alone[i][0].startswith(text), i
                else:
                    assert done and text == alone[i][0], i
            deadline = time.time() + 30
            while metric(url, "dflash_queue_depth") and time.time() < deadline:  # the leavers' cancels land
                time.sleep(0.1)
            assert metric(url, "dflash_queue_depth") == metric(url, "dflash_active_sequences") == 0
            assert metric(url, "dflash_prompt_cache_bytes") <= 1 << 30
            histories.append(metric(url, "dflash_prompt_cache_histories"))
        assert histories[0] == histories[1], histories
    finally:
        stop_server(process)
