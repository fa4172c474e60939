"""Several requests at once against `dflash-mlx serve`, at --max-concurrent 4 and 1.

    python examples/concurrent_requests.py [--model demo] [--requests 4] [--max-tokens 256] [--repeats 2]
                                           [--long-prompt 16000]

Starts the server twice per repeat (--max-concurrent 4, then 1, alternating), sends the bench's
`edit` prompts (in turn) all at once, greedy, and reports the wall time until the last answer, the
speedup of 4 over 1, and whether every answer equals the one its prompt gets alone (sent first,
by itself, to the same server). Each request has its own client, made and connected before the
clock starts (as an editor or agent keeps its client), and one short untimed burst of every client
at once goes first in both modes (a batch's first passes trace their shapes). With --long-prompt N it then measures how long an active stream
stalls while an N-word prompt arrives (sent at the stream's first token; the stream asks for 4x
--max-tokens so that it outlives some of the prefill): the largest gap between its tokens (the
prompt is prefilled one chunk per round of the batch), beside the same stream's largest gap next
to a short prompt.
"""

import argparse
import gc
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Tuple

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_mlx.bench import SUITES  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, concurrent: int, context: int = 0):
    port = free_port()
    extra = ["--context-size", str(context)] if context else []
    log = tempfile.NamedTemporaryFile(prefix="dflash-serve-", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", model, "--port", str(port),
                                "--max-concurrent", str(concurrent), *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(Path(log.name).read_text())


def connect(url: str) -> OpenAI:
    """A client, as an editor or agent keeps one: made (about 20 ms of CPU each, its SSL context)
    and connected before any clock starts, so that what is timed is the server."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    client.models.list()  # opens the connection (kept alive)
    return client


def ask(client: OpenAI, prompt: str, max_tokens: int, first: Optional[threading.Event] = None):
    """The answer's text and the arrival time of each of its chunks (``first`` is set at the first)."""
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    text, times = "", []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            times.append(time.perf_counter())
            if first is not None:
                first.set()
    return text, times


def at_once(clients, prompts, max_tokens: int):
    """Each prompt sent at once on its own client: the wall time until the last answer, and the answers."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        tic = time.perf_counter()
        answers = list(pool.map(lambda cp: ask(cp[0], cp[1], max_tokens)[0], zip(clients, prompts)))
    return time.perf_counter() - tic, answers


def stall(url: str, prompt: str, long_prompt: str, max_tokens: int) -> Tuple[float, float, float]:
    """The largest gap (s) between a stream's tokens while ``long_prompt`` comes in (sent at the
    stream's first token), the stream's duration and the long prompt's time to its answer: the
    gap speaks for the prefill only where the long prompt's answer came after the stream began."""
    started = threading.Event()
    streaming, arriving = connect(url), connect(url)
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(ask, streaming, prompt, max_tokens, started)
        started.wait()
        sent = time.perf_counter()
        long_answer = pool.submit(ask, arriving, long_prompt, 4)
        _, times = stream.result()
        long_times = long_answer.result()[1]
    answered = (long_times[0] if long_times else time.perf_counter()) - sent
    return max(b - a for a, b in zip(times, times[1:])), times[-1] - times[0], answered


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--long-prompt", type=int, default=0, help="words of a long prompt for the stall test")
    args = parser.parse_args()
    # This process imported dflash_mlx (for the prompts), and with it MLX and mlx-lm: a full
    # collection of that heap takes about 90 ms here, and one fell inside most timed windows
    # (either mode), stalling every client at once. An editor's client does not carry that heap:
    # freeze it, so that the clock measures the server.
    gc.freeze()
    prompts = [SUITES["edit"][i % len(SUITES["edit"])] for i in range(args.requests)]
    seconds = {4: [], 1: []}
    for repeat in range(args.repeats):
        for concurrent in (4, 1) if repeat % 2 == 0 else (1, 4):
            process, url = start(args.model, concurrent, 4 * args.long_prompt + 4096 if args.long_prompt else 0)
            try:
                clients = [connect(url) for _ in prompts]
                alone = [ask(clients[0], p, args.max_tokens)[0] for p in prompts[: len(SUITES["edit"])]]
                at_once(clients, prompts, 8)  # warm
                wall, answers = at_once(clients, prompts, args.max_tokens)
                same = all(a == alone[i % len(alone)] for i, a in enumerate(answers))
                seconds[concurrent].append(wall)
                print(f"--max-concurrent {concurrent}: {args.requests} requests at once in {wall:.2f} s; "
                      f"each answer as alone: {'yes' if same else 'NO'}", flush=True)
                if args.long_prompt and concurrent == 4 and repeat == 0:
                    long_prompt = " ".join(f"x{i % 97} = f(x{(i * 7) % 97})" for i in range(args.long_prompt // 4))
                    alone_gap, _, _ = stall(url, prompts[0], "hi", 4 * args.max_tokens)
                    gap, lasted, answered = stall(url, prompts[0], long_prompt, 4 * args.max_tokens)
                    print(f"largest gap between a stream's tokens: {gap * 1000:.0f} ms while a {args.long_prompt}-word "
                          f"prompt came in (the stream lasted {lasted:.2f} s, the long prompt's first token came "
                          f"{answered:.2f} s after it was sent), {alone_gap * 1000:.0f} ms beside a short one", flush=True)
            finally:
                process.terminate()
                process.wait(30)
    best = {c: sorted(v)[len(v) // 2] for c, v in seconds.items()}
    print(f"median: --max-concurrent 4 {best[4]:.2f} s, 1 {best[1]:.2f} s: {best[1] / best[4]:.2f}x")


if __name__ == "__main__":
    main()
