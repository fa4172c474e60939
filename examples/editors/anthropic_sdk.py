"""Anthropic's SDK against `dflash-mlx serve`: a streamed answer, then a tool round trip.

    python examples/editors/anthropic_sdk.py [BASE_URL] [API_KEY] [MODEL]
"""

import sys

import anthropic

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
key = sys.argv[2] if len(sys.argv) > 2 else "none"
model = sys.argv[3] if len(sys.argv) > 3 else "qwopus"
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)

with client.messages.stream(model=model, max_tokens=64, messages=[{"role": "user", "content": "Say hello."}]) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()

tools = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
reply = client.messages.create(model=model, max_tokens=128, messages=messages, tools=tools)
print("stop_reason:", reply.stop_reason)
for block in reply.content:
    if block.type == "tool_use":
        messages += [{"role": "assistant", "content": reply.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18C, sunny"}]}]
        answer = client.messages.create(model=model, max_tokens=64, messages=messages, tools=tools)
        print("after the tool:", answer.stop_reason, answer.usage.cache_read_input_tokens, "prompt tokens from the cache")
