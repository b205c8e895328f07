"""A tiny local model hub on 127.0.0.1 for the tests: the Hugging Face hub's URL layout, enough
for the real huggingface-hub client (model info API, resolve URLs with the headers it checks,
HEAD, ranged GETs), with an access log and injectable faults. Nothing of huggingface-hub is
mocked: tests point ``HF_ENDPOINT`` at it (in a subprocess, since huggingface-hub reads it at
import)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Hit:
    method: str
    path: str
    range: str | None
    status: int
    sent: int  # body bytes sent


@dataclass
class Hub:
    repos: dict = field(default_factory=dict)  # repo id -> {filename: bytes}
    log: list = field(default_factory=list)
    fail: dict = field(default_factory=dict)  # path suffix -> HTTP status to answer (every time)
    cut: dict = field(default_factory=dict)  # (repo, filename) -> bytes to send, then drop the connection (once)
    stall: dict = field(default_factory=dict)  # (repo, filename) -> bytes to send, then hang until released (once)
    released: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def add_folder(self, repo: str, folder: Path) -> None:
        self.repos[repo] = {
            str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
        }

    def sha(self, repo: str) -> str:
        return hashlib.sha1(repo.encode() + "\0".join(sorted(self.repos[repo])).encode()).hexdigest()

    def weight_hits(self) -> list[Hit]:
        return [h for h in self.log if h.path.endswith(".safetensors") and h.method == "GET"]


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet; the Hub keeps its own log
            pass

        def do_HEAD(self):
            self._serve(head=True)

        def do_GET(self):
            self._serve(head=False)

        def _send(
            self,
            status: int,
            body: bytes,
            headers: dict | None = None,
            head: bool = False,
            limit: int | None = None,
            hang: bool = False,
        ) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            sent = 0
            if not head:
                out = body if limit is None else body[:limit]
                self.wfile.write(out)
                sent = len(out)
                if limit is not None:  # a dropped or stalled transfer
                    self.wfile.flush()
                    hub.log.append(Hit(self.command, self.path, self.headers.get("range"), status, sent))
                    if hang:  # the client is interrupted meanwhile
                        hub.released.wait(120)
                    self.close_connection = True
                    return
            hub.log.append(Hit(self.command, self.path, self.headers.get("range"), status, sent))

        def _error(self, status: int, code: str, head: bool) -> None:
            body = json.dumps({"error": code}).encode()
            self._send(
                status, body, {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"}, head
            )

        def _serve(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            for suffix, status in hub.fail.items():
                if path.endswith(suffix):
                    return self._send(status, b'{"error": "injected"}', {"Content-Type": "application/json"}, head)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                repo = m.group(1)
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound", head)
                files = hub.repos[repo]
                info = {
                    "id": repo,
                    "modelId": repo,
                    "sha": hub.sha(repo),
                    "private": False,
                    "disabled": False,
                    "gated": False,
                    "tags": [],
                    "downloads": 0,
                    "likes": 0,
                    "siblings": [{"rfilename": n, "size": len(b)} for n, b in files.items()],
                }
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+(?:/(.*))?", path)
            if m:  # the file listing snapshot_download reads (one page, recursive)
                repo, under = m.group(1), (m.group(2) or "").strip("/")
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound", head)
                tree = [
                    {
                        "type": "file",
                        "path": n,
                        "size": len(b),
                        "oid": _etag(n, b),
                        **({"lfs": {"oid": _etag(n, b), "size": len(b), "pointerSize": 134}} if _lfs(n) else {}),
                    }
                    for n, b in hub.repos[repo].items()
                    if n.startswith(under)
                ]
                return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._error(404, "NotFound", head)
            repo, _, name = m.groups()
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound", head)
            if name not in hub.repos[repo]:
                return self._error(404, "EntryNotFound", head)
            data = hub.repos[repo][name]
            headers = {
                "ETag": f'"{_etag(name, data)}"',
                "X-Repo-Commit": hub.sha(repo),
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            status, body = 200, data
            rng = self.headers.get("range")
            if rng:
                a, _, b = rng.removeprefix("bytes=").partition("-")
                start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
                body, status = data[start : end + 1], 206
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            limit, hang = None, False
            if not head and not rng and (repo, name) in hub.cut:
                limit = hub.cut.pop((repo, name))
            elif not head and not rng and (repo, name) in hub.stall:
                limit, hang = hub.stall.pop((repo, name)), True
            self._send(status, body, headers, head, limit, hang)

    return Handler


def _lfs(name: str) -> bool:
    return name.endswith(".safetensors")


def _etag(name: str, data: bytes) -> str:
    """As the hub: the sha256 of an LFS file (weights), a git-style sha1 of any other file."""
    return hashlib.sha256(data).hexdigest() if _lfs(name) else hashlib.sha1(data).hexdigest()


def start(hub: Hub):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server
