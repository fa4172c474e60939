"""Time to first token for a repeated long prompt, cold and with the server's prefix cache.

    dflash-mlx serve ... --port 8080 &
    python examples/server_ttft.py [BASE_URL] [PROMPT_WORDS]

The first request fills the cache (cold: the whole prompt is prefilled); the second sends the
same context with a different question, as an editor does (warm: only the new part is).
"""

import sys
import time

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
words = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
client = OpenAI(base_url=base, api_key="none", max_retries=0)
model = client.models.list().data[0].id
context = " ".join(f"x{i % 97} = f(x{(i * 7) % 97})" for i in range(words // 4))


def first_token(question: str):
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"{context}\n\n{question}"}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    ttft, usage = None, None
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        usage = chunk.usage or usage
    return ttft, usage


for label, question in (("cold", "What does line 3 compute?"), ("cached", "What does line 5 compute?")):
    ttft, usage = first_token(question)
    print(f"{label:>6}: time to first token {ttft * 1000:7.1f} ms, prompt {usage.prompt_tokens} tokens, "
          f"{usage.prompt_tokens_details.cached_tokens} from cache")
