"""One client's two runs against one `serve`, inside a private network namespace (tests/test_agents.py
starts this under `unshare -n` with only loopback up): the scripted pair (`--model scripted`'s), the
server on 127.0.0.1, then `dflash-mlx agent CLIENT --base-url ...` with a plain prompt and with one
that makes the model call the client's shell tool, the client's own state under a fresh HOME.
The client talks to the server through a recording proxy: every request's method, path, size,
fields, tools and status, whatever the server logs.

    python -m tests.agent_run CLIENT BIN_DIR OUT_DIR

writes OUT_DIR/results.json: each run's exit code, output and seconds, and the server's log.
With AGENT_RUN_SERVER_SRC set, the server runs from that source tree instead (how docs/server.md
shows what the clients met on an earlier server)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from dflash_mlx import agents, scripted
from tests.agent_clients import RUNS

def shape(body: bytes) -> dict:
    """What a request carried, distilled: its fields, tools by type, turns, and the values that matter."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    out = {"fields": sorted(data)}
    tools = data.get("tools") or []
    kinds: dict = {}
    for tool in tools:
        kind = tool.get("type") or "custom"
        kinds[kind] = kinds.get(kind, 0) + 1
    if tools:
        out["tools"] = kinds
    turns = data.get("messages") if "messages" in data else data.get("input")
    if isinstance(turns, list):
        out["turns"] = [t.get("role") or t.get("type") for t in turns if isinstance(t, dict)]
    for key in ("model", "max_tokens", "max_output_tokens", "thinking", "reasoning", "stream"):
        if key in data:
            out[key] = data[key]
    return out


def recording_proxy(upstream: str, requests: list) -> Starlette:
    """Forwards everything to ``upstream``, streaming, and records each exchange in ``requests``."""
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def forward(request: Request):
        body = await request.body()
        record = {"method": request.method, "path": request.url.path, "bytes": len(body), **shape(body)}
        requests.append(record)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        upstream_request = client.build_request(request.method, request.url.path, params=request.query_params,
                                                headers=headers, content=body)
        response = await client.send(upstream_request, stream=True)
        record["status"] = response.status_code
        passed = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "transfer-encoding",
                                                                                  "content-encoding", "connection")}

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=response.status_code, headers=passed)

    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(client: str, bin_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # What `--model scripted` serves: one pair for every client (the call follows the request's tools).
    target, draft = scripted.write_pair(out / "pair", agents.scripted_script())
    port, proxy_port = free_port(), free_port()
    url, proxy_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{proxy_port}"
    requests: list = []
    proxy = uvicorn.Server(uvicorn.Config(recording_proxy(url, requests), host="127.0.0.1", port=proxy_port,
                                          log_level="warning"))
    threading.Thread(target=proxy.run, daemon=True).start()
    home, work = out / "home", out / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(home), "DFLASH_MLX_HOME": str(out / "dflash-mlx-home"),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = open(out / "server.log", "w")
    server_env = {**env, "PYTHONPATH": os.environ["AGENT_RUN_SERVER_SRC"]} if os.environ.get("AGENT_RUN_SERVER_SRC") else env
    server = subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli", "serve", "-m", str(target), "-d", str(draft),
                               "--model-name", "scripted", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              env=server_env, cwd=work)
    results = {}
    try:
        deadline = time.time() + 120
        while time.time() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for name, args in RUNS[client].items():
            started = time.time()
            try:
                done = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "agent", client, "--base-url", proxy_url, "--", *args],
                                      cwd=work, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
                results[name] = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            except subprocess.TimeoutExpired as e:
                text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
                results[name] = {"rc": "timeout", "stdout": text[0], "stderr": text[1]}
            results[name]["seconds"] = round(time.time() - started, 1)
            results[name]["requests"], requests[:] = list(requests), []
    finally:
        proxy.should_exit = True
        server.terminate()
        server.wait(15)
        log.close()
    results["server_log"] = (out / "server.log").read_text()
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
