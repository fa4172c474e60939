"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub uses to download.

Serves folders as repos on 127.0.0.1 (point HF_ENDPOINT at ``url``): repo info, recursive tree
listing, HEAD/GET on ``resolve`` with ranges, and the Hub's error codes. ``break_after`` makes a
file's download stop mid-body, like a dropped connection.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Optional
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self):
        self.repos: Dict[str, Path] = {}
        self.break_after: Dict[tuple, int] = {}  # (repo, file) -> bytes sent before the connection drops
        self.break_once: Dict[tuple, int] = {}  # the same, for the first transfer of the file only
        self.requests: list = []
        self.ranges: list = []  # (path, Range header) of every request that carried one
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, folder: Path) -> None:
        self.repos[repo_id] = folder

    def commit(self, repo_id: str) -> str:
        digest = hashlib.sha1()
        for f in sorted(self._files(repo_id)):
            digest.update(f.encode() + (self.repos[repo_id] / f).read_bytes())
        return digest.hexdigest()

    def _files(self, repo_id: str):
        root = self.repos[repo_id]
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: Optional[dict] = None, head=False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, data):
                self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

            def _error(self, code: str, message: str, head=False):
                body = json.dumps({"error": message}).encode()
                self._send(404, body, {"X-Error-Code": code, "X-Error-Message": message}, head=head)

            def _repo(self, parts):
                for n in (2, 1):
                    repo_id = "/".join(parts[:n])
                    if repo_id in hub.repos:
                        return repo_id, parts[n:]
                return None, parts

            def do_GET(self):
                self._dispatch(head=False)

            def do_HEAD(self):
                self._dispatch(head=True)

            def _dispatch(self, head: bool):
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                parts = [p for p in path.split("/") if p]
                if parts[:2] == ["api", "models"]:
                    repo_id, rest = self._repo(parts[2:])
                    if repo_id is None:
                        return self._error("RepoNotFound", "Repository not found", head)
                    commit = hub.commit(repo_id)
                    if rest[:1] == ["tree"]:
                        entries = []
                        for f in sorted(hub._files(repo_id)):
                            data = (hub.repos[repo_id] / f).read_bytes()
                            entry = {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                            if f.endswith(".safetensors"):
                                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
                            entries.append(entry)
                        return self._json(entries)
                    siblings = [{"rfilename": f} for f in sorted(hub._files(repo_id))]
                    return self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings, "private": False})
                repo_id, rest = self._repo(parts)
                if repo_id is None or rest[:1] != ["resolve"] or len(rest) < 3:
                    return self._error("RepoNotFound", "Repository not found", head)
                filename = "/".join(rest[2:])
                file = hub.repos[repo_id] / filename
                if not file.is_file():
                    return self._error("EntryNotFound", f"{filename} does not exist", head)
                data = file.read_bytes()
                commit = hub.commit(repo_id)
                headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"', "Accept-Ranges": "bytes"}
                if filename.endswith(".safetensors"):
                    headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
                    headers["X-Linked-Size"] = str(len(data))
                start = 0
                ranged = self.headers.get("Range")
                if ranged:
                    hub.ranges.append((path, ranged))
                if ranged and ranged.startswith("bytes="):
                    start = int(ranged[6:].split("-")[0] or 0)
                body = data[start:]
                status = 206 if start else 200
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                limit = hub.break_after.get((repo_id, filename))
                if limit is None and not head:
                    limit = hub.break_once.pop((repo_id, filename), None)
                if head or limit is None:
                    return self._send(status, body, headers, head)
                # Announce the whole body, send part of it, drop the connection.
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:limit])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)

        return Handler
