"""Stand-in for `openenv harbor serve` in run_job.sh tests: answers /health and /capture/health on --port, and the
capture proxy's session list (none) to its admin key, as the gateway reads it.

STUB_ENV=crash exits 4 at once; STUB_ENV=die_after exits 5 after STUB_ENV_SECONDS (default 1.5 s).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        admin = self.headers.get("authorization") == f"Bearer {os.environ.get('OPENENV_CAPTURE_ADMIN_KEY')}"
        if self.path == "/capture/sessions":
            self.send_response(200 if admin else 401)
            self.end_headers()
            self.wfile.write(b'{"sessions": []}' if admin else b"{}")
            return
        ok = self.path in ("/health", "/capture/health")
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}' if ok else b"{}")

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    args = sys.argv[1:]
    host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
    with open(os.environ.get("STUB_LOG", os.devnull), "a") as log:
        log.write(f"env_server SPACE_HOST={os.environ.get('SPACE_HOST')} ARGS={' '.join(args)}\n")
    mode = os.environ.get("STUB_ENV", "")
    if mode == "crash":
        print("fake env server: simulated start-up failure", flush=True)
        sys.exit(4)
    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if mode == "die_after":
        time.sleep(float(os.environ.get("STUB_ENV_SECONDS", "1.5")))
        print("fake env server: simulated crash while serving", flush=True)
        sys.exit(5)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
