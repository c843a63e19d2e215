"""A local HTTP server answering the few Hugging Face Hub routes the Hub client uses to download a snapshot
(repo info by revision, and HEAD/GET of `resolve/COMMIT/FILE`), with one repository. It records each request's
path and Authorization header, so tests can check where the token went."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repo: str, files: dict[str, bytes], token: str, commit: str = "a" * 40) -> None:
        self.repo, self.files, self.token, self.commit = repo, files, token, commit
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)

    def info(self) -> dict[str, object]:
        return {"id": self.repo, "modelId": self.repo, "sha": self.commit, "private": True,
                "siblings": [{"rfilename": name} for name in sorted(self.files)]}

    def tree(self) -> list[dict[str, object]]:
        """`tree/REV?recursive=true`: every file (and each directory above one)."""
        dirs = sorted({name.rsplit("/", 1)[0] for name in self.files if "/" in name})
        return [{"type": "directory", "path": d, "oid": "0" * 40, "size": 0} for d in dirs] + [
            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for name, data in sorted(self.files.items())]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            auth = self.headers.get("Authorization")
            hub.requests.append((self.command, path, auth))
            if auth != f"Bearer {hub.token}":
                self.send_response(401)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                return
            api = f"/api/models/{hub.repo}/"
            if path.startswith(api + "revision/") or path.startswith(api + "tree/"):
                data = json.dumps(hub.info() if "/revision/" in path else hub.tree()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return
            prefix = f"/{hub.repo}/resolve/"
            if path.startswith(prefix):
                rest = path[len(prefix):]
                _, _, name = rest.partition("/")
                content = hub.files.get(name)
                if content is not None:
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", hub.commit)
                    self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                    self.send_header("Content-Length", str(len(content)))
                    self.end_headers()
                    if body:
                        self.wfile.write(content)
                    return
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()

        def do_GET(self) -> None:
            self._answer(True)

        def do_HEAD(self) -> None:
            self._answer(False)

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
