"""Replay coding agents' sessions against ``dflash-mlx serve``, turn by turn: what the prefix cache reuses.

    python examples/agent_replay.py [--model scripted] [--turns 4] [--max-tokens 32]

Each session is a few turns in one agent's request shape, its head as recorded
(tests/fixtures/clients): Claude Code (Anthropic Messages: its system prompt, 12 tools and the
system reminders of its first user message), Codex (Responses: its developer messages and function
tools) and opencode's shape (chat completions with a system message and function tools; no
recording of it is at hand, so it carries Codex's instructions and tools, as a third head). The
first user message asks for a tool (the scripted pair then calls the agent's shell tool); a tool
call is answered with a tool result, an answer with a new user message, as the agent would.

One server, on a new ``--prompt-cache-dir``: Claude Code cold (its head never seen), a second
Claude Code session (warm: its head shared, its task not), then Codex and opencode alternating turn
by turn. Then the server is restarted on the same directory (RAM empty: the disk tier) and a third
Claude Code session and a second Codex one run. Per turn: prompt tokens, tokens reused (the API's
own cached-tokens field), time to first token (the server's ``dflash_last_time_to_first_token_seconds``,
submission to first token), decode tokens per second (the rest of the request's time), and
whether the reused tokens came from RAM or were loaded from disk (``dflash_prompt_cache_disk_hits_total``).
"""

import argparse
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "clients"
ASK = "run the scripted tool"  # what makes the scripted pair call the agent's shell tool (``scripted.ASK``)
FOLLOW_UPS = ["Thanks. Now explain what the output means.", "Good. What should we check next?",
              "One more: summarize the session in a sentence."]


def post(url: str, path: str, body: dict, timeout: float = 3600) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.split()[-1])
    raise KeyError(name)


def heads() -> dict:
    """The recorded heads: Claude Code's and Codex's first requests."""
    claude = json.loads((FIXTURES / "claude_toolsearch.json").read_text())["requests"][0]["body"]
    codex = json.loads((FIXTURES / "codex_image.json").read_text())["requests"][0]["body"]
    codex_tools = [t for t in codex["tools"] if t.get("type") == "function"]
    instructions = [i for i in codex["input"] if i.get("role") == "developer"]
    return {"claude": claude, "codex": {"input": instructions, "tools": codex_tools},
            "opencode": {"system": "\n\n".join(p["text"] for i in instructions for p in i["content"] if "text" in p),
                         "tools": [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                                      if k in t}} for t in codex_tools]}}


class Session:
    """One agent's conversation: the next request's body, and what the agent appends after a reply."""

    def __init__(self, agent: str, head: dict, task: str, max_tokens: int, model: str):
        self.agent, self.turn, self.follow = agent, 0, 0
        text = f"{task} Please {ASK}."
        if agent == "claude":
            first = copy.deepcopy(head["messages"][0])
            first["content"] = [p for p in first["content"] if p.get("type") == "text"][:-1] + [{"type": "text", "text": text}]
            self.path = "/v1/messages"
            self.body = {"model": model, "system": head["system"], "tools": head["tools"], "messages": [first],
                         "max_tokens": max_tokens, "temperature": 0}
        elif agent == "codex":
            self.path = "/v1/responses"
            self.body = {"model": model, "input": head["input"] + [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
                         "tools": head["tools"], "max_output_tokens": max_tokens, "temperature": 0, "store": False}
        else:
            self.path = "/v1/chat/completions"
            self.body = {"model": model, "messages": [{"role": "system", "content": head["system"]}, {"role": "user", "content": text}],
                         "tools": head["tools"], "max_tokens": max_tokens, "temperature": 0}

    def next_user(self) -> str:
        text = FOLLOW_UPS[self.follow % len(FOLLOW_UPS)]
        self.follow += 1
        return text

    def absorb(self, reply: dict) -> dict:
        """Append the reply and the agent's next message; return the turn's usage numbers."""
        self.turn += 1
        if self.agent == "claude":
            u = reply["usage"]
            calls = [b for b in reply["content"] if b["type"] == "tool_use"]
            self.body["messages"].append({"role": "assistant", "content": reply["content"]})
            nxt = ([{"type": "tool_result", "tool_use_id": c["id"], "content": "scripted-tool-output"} for c in calls]
                   or [{"type": "text", "text": self.next_user()}])
            self.body["messages"].append({"role": "user", "content": nxt})
            cached = u.get("cache_read_input_tokens", 0)
            return {"prompt": u["input_tokens"] + cached + u.get("cache_creation_input_tokens", 0), "cached": cached,
                    "completion": u["output_tokens"], "call": bool(calls)}
        if self.agent == "codex":
            u = reply["usage"]
            items = [i for i in reply["output"] if i["type"] in ("message", "function_call")]
            calls = [i for i in items if i["type"] == "function_call"]
            for i in items:
                if i["type"] == "function_call":
                    self.body["input"].append({k: i[k] for k in ("type", "call_id", "name", "arguments")})
                else:
                    self.body["input"].append({"role": "assistant", "content": [{"type": "output_text", "text": p.get("text", "")}
                                                                               for p in i["content"]]})
            self.body["input"] += ([{"type": "function_call_output", "call_id": c["call_id"], "output": "scripted-tool-output"}
                                    for c in calls] or [{"role": "user", "content": [{"type": "input_text", "text": self.next_user()}]}])
            return {"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"],
                    "completion": u["output_tokens"], "call": bool(calls)}
        u, message = reply["usage"], reply["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        self.body["messages"].append({k: message[k] for k in ("role", "content", "tool_calls", "reasoning_content") if message.get(k)})
        self.body["messages"] += ([{"role": "tool", "tool_call_id": c["id"], "content": "scripted-tool-output"} for c in calls]
                                  or [{"role": "user", "content": self.next_user()}])
        return {"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"],
                "completion": u["completion_tokens"], "call": bool(calls)}


def run_turn(url: str, session: Session) -> dict:
    loads = metric(url, "dflash_prompt_cache_disk_hits_total")
    started = time.perf_counter()
    reply = post(url, session.path, session.body)
    seconds = time.perf_counter() - started
    ttft = metric(url, "dflash_last_time_to_first_token_seconds")
    row = session.absorb(reply)
    row["disk"] = metric(url, "dflash_prompt_cache_disk_hits_total") > loads
    decode = seconds - ttft
    row.update(agent=session.agent, turn=session.turn, ttft=ttft,
               tps=(row["completion"] - 1) / decode if row["completion"] > 1 and decode > 0 else float("nan"))
    return row


class Server:
    """``dflash-mlx serve`` on a free loopback port; stopped with SIGINT (queued disk writes finish)."""

    def __init__(self, args, directory: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w", prefix="agent-replay-", suffix=".log", delete=False)
        argv = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", args.model, "--port", str(self.port),
                "--prompt-cache-dir", directory, "--log-level", "WARNING"]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.3)
        else:
            raise RuntimeError(f"the server did not start: see {self.log.name}")
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as answer:
            self.model = json.loads(answer.read())["data"][0]["id"]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(600)
        self.log.close()
        os.unlink(self.log.name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="scripted", help="What to serve (serve's --model): scripted, demo, a folder.")
    parser.add_argument("--turns", type=int, default=4, help="Turns per session.")
    parser.add_argument("--max-tokens", type=int, default=32, help="Answer tokens per turn at most.")
    parser.add_argument("--dir", default=None, help="The disk tier's folder (default: a new temporary one).")
    args = parser.parse_args()
    recorded = heads()
    rows = []
    with tempfile.TemporaryDirectory() as temp:
        directory = args.dir or temp
        server = Server(args, directory)
        phases = [("cold", [Session("claude", recorded["claude"], "Fix the failing test in parser.py.", args.max_tokens, server.model)]),
                  ("warm", [Session("claude", recorded["claude"], "Add a --verbose flag to the CLI.", args.max_tokens, server.model)]),
                  ("alternating", [Session("codex", recorded["codex"], "Rename the config module.", args.max_tokens, server.model),
                                   Session("opencode", recorded["opencode"], "Write a README section.", args.max_tokens, server.model)])]
        for restart in (False, True):
            if restart:
                server.stop()
                server = Server(args, directory)
                phases = [("restart", [Session("claude", recorded["claude"], "Profile the slow import.", args.max_tokens, server.model)]),
                          ("restart", [Session("codex", recorded["codex"], "Bump the version.", args.max_tokens, server.model)])]
            for phase, sessions in phases:
                for _ in range(args.turns):
                    for session in sessions:  # alternating: one turn each in turn
                        rows.append(dict(run_turn(server.url, session), phase=phase))
        server.stop()
    print(f"model {args.model}, {args.turns} turns a session, at most {args.max_tokens} answer tokens a turn")
    print("| phase | agent | turn | prompt tokens | reused | from | recomputed | time to first token | tokens/s | tool call |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['agent']} | {r['turn']} | {r['prompt']} | {r['cached']} | "
              f"{('disk' if r['disk'] else 'RAM') if r['cached'] else ''} | {r['prompt'] - r['cached']} | "
              f"{r['ttft'] * 1000:.0f} ms | {r['tps']:.1f} | {'yes' if r['call'] else ''} |")


if __name__ == "__main__":
    main()
