"""A tiny stand-in for vLLM's OpenAI server: what the capture proxy needs and nothing more.

Serves `GET /health`, `GET /v1/models` and `POST /v1/chat/completions` answering with vLLM's
token-capture fields (`prompt_token_ids`, `choices[0].token_ids`,
`choices[0].logprobs.content[{token: "token_id:N", logprob}]`). Logprobs scale with temperature, as
processed logprobs do. Every chat request is appended to `REQUESTS` and every GET path to `GETS` (in-process
use) and, with `--log FILE`, chat requests to a JSON-lines file.

    python tests/stubs/upstream_double.py --host 127.0.0.1 --port 8100 --model org/model
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REQUESTS: list[dict] = []
GETS: list[str] = []


def completion(body: dict, model: str) -> dict:
    """A two-token answer whose logprobs depend on the temperature (processed, not raw)."""
    temperature = float(body.get("temperature") or 1.0) or 1.0
    sampled = [11, 12]
    return {
        "id": "chatcmpl-double",
        "object": "chat.completion",
        "model": model,
        "prompt_token_ids": [1, 2, 3, 4],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
                "token_ids": sampled,
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": -0.25 * (i + 1) / temperature, "top_logprobs": []}
                        for i, t in enumerate(sampled)
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }


def handler(model: str, log: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            GETS.append(self.path)
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            else:
                self._send(404, {"error": "not found", "path": self.path})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": "not found", "path": self.path})
                return
            REQUESTS.append(body)
            if log:
                with open(log, "a") as fh:
                    fh.write(json.dumps({"path": self.path, "headers": dict(self.headers), "body": body}) + "\n")
            self._send(200, completion(body, model))

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def start(host: str = "127.0.0.1", port: int = 0, model: str = "org/model", log: str | None = None):
    """Serve in a daemon thread; returns the server (its port is `server.server_address[1]`)."""
    server = ThreadingHTTPServer((host, port), handler(model, log))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="org/model")
    parser.add_argument("--log")
    args = parser.parse_args()
    ThreadingHTTPServer((args.host, args.port), handler(args.model, args.log)).serve_forever()
