"""The task data bucket on loopback: what the image's /opt/pull_bucket.py (tests/chain/pull_bucket.py) lists and
downloads during each task's healthcheck. `files` maps a bucket prefix to {file name: bytes}."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Bucket:
    def __init__(self, bucket: str, files: dict[str, dict[str, bytes]]) -> None:
        self.bucket, self.files = bucket, files
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = owner.answer(urllib.parse.unquote(self.path))
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(body or b"not found")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> bytes | None:
        head = f"/buckets/{self.bucket}/"
        if not path.startswith(head):
            return None
        kind, _, rest = path[len(head):].partition("/")
        if kind == "tree" and rest in self.files:
            return json.dumps(sorted(self.files[rest])).encode()
        prefix, _, name = rest.rpartition("/")
        if kind == "resolve" and name in self.files.get(prefix, {}):
            return self.files[prefix][name]
        return None

    def stop(self) -> None:
        self.server.shutdown()
