"""The official openai client against `dflash-mlx serve` (default http://127.0.0.1:8080/v1).

    python examples/editors/openai_sdk.py [BASE_URL] [API_KEY]
"""

import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1",
                api_key=sys.argv[2] if len(sys.argv) > 2 else "none")
model = client.models.list().data[0].id

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Write a Python function that reverses a linked list."}],
    max_tokens=256,
    temperature=0.6,
    top_p=0.95,
    seed=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens, {chunk.usage.prompt_tokens_details.cached_tokens} prompt tokens from cache]")

tools = [{"type": "function", "function": {"name": "run_tests", "description": "Run the project's tests",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Run the tests in tests/unit."}], tools=tools, max_tokens=128
)
print(reply.choices[0].message.tool_calls or reply.choices[0].message.content)
