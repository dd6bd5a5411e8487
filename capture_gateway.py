"""The job's one public port: forwards `/capture/...` to the env server on loopback, refuses the rest.

HF Jobs exposes recipe.PUBLIC_PORT at `https://<job-id>--<PUBLIC_PORT>.hf.jobs`. The sandboxes must reach the capture
proxy there, but nothing else in the job may be reachable: the env server's task API starts rollouts
on our token, and vLLM's dev endpoints (`/update_weights`, ...) have no authentication at all. So the
env server and vLLM bind 127.0.0.1, the capture app is mounted on the env server at `/capture`
(openenv does that when SPACE_HOST is set), and this process is the only listener on 0.0.0.0. It
forwards the agent's data plane (`/capture/<model API path>`) and answers 404 to everything else,
including the capture proxy's session-management routes (`/capture/sessions...`: the trainer's
control plane, used on loopback only). Paths that could be normalised into another route (`..`,
`//`, percent-escapes) are refused before anything is forwarded. Streaming replies pass through.

The port is public, so nothing is read from a request that carries no session key: the capture proxy's model routes
answer only a registered session (its key is the agent's API key), and a request with none is refused here (401)
before its body is read, except the two bodiless reads the capture app answers to anyone (`GET /capture/health`, the
readiness check, and `GET /capture/v1/models`). A body is read up to recipe.CAPTURE_MAX_BODY_BYTES (413 past it).

    python3 capture_gateway.py    # 0.0.0.0:<PUBLIC_PORT> -> http://127.0.0.1:<ENV_PORT>; serve_env.sh starts it
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import AsyncIterator, Mapping

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import recipe

PREFIX = "/capture"
# One segment of a forwardable path: no dots-only segments, no escapes, no empty segments.
_SEGMENT = re.compile(r"^[A-Za-z0-9_\-.:~@]+$")
_CONTROL_PLANE = {"sessions"}
# Routes the capture app answers without a session (openenv's capture server: /health and /v1/models), GET only.
_KEYLESS = {"health", "v1/models"}
# Connection-level headers that must not be relayed (RFC 9110 7.6.1), plus ones httpx/uvicorn recompute.
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
}


def forwardable(raw_path: str) -> bool:
    """Whether a request path is on the capture data plane and cannot be rewritten into another route."""
    if not raw_path.startswith(PREFIX + "/"):
        return False
    segments = raw_path[len(PREFIX) + 1 :].split("/")
    if any(not _SEGMENT.match(s) or set(s) == {"."} for s in segments):
        return False
    return segments[0] not in _CONTROL_PLANE


def _refused() -> JSONResponse:
    return JSONResponse({"error": f"not found: only {PREFIX}/ is served on this port"}, status_code=404)


def session_key(headers: Mapping[str, str]) -> str | None:
    """The capture session a request names, where the capture proxy looks for it: `Authorization: Bearer`, then
    `x-api-key` (what the seam patch makes OpenCode send: the Jobs proxy strips Authorization), then
    `x-goog-api-key` (openenv's capture/sessions.py extract_api_key; tests/test_servers.py holds the two equal)."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    return (headers.get("x-api-key", "").strip() or headers.get("x-goog-api-key", "").strip()) or None


class BodyTooLarge(Exception):
    """A request body past recipe.CAPTURE_MAX_BODY_BYTES."""


async def capped_body(request: Request, limit: int = recipe.CAPTURE_MAX_BODY_BYTES) -> bytes:
    """The request body, refused as soon as it is known to pass `limit` (by its Content-Length, or while reading)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(upstream: str) -> Starlette:
    """The gateway as an ASGI app forwarding allowed paths to `upstream` (the env server's root URL)."""
    # No read timeout (a MAX_TOKENS completion streams for minutes; the agent timeout bounds it) and no
    # pool cap (concurrency is bounded by the env server's session limit, not here).
    client = httpx.AsyncClient(
        base_url=upstream.rstrip("/"), timeout=httpx.Timeout(30.0, read=None), limits=httpx.Limits(max_connections=None)
    )

    async def forward(request: Request) -> Response:
        raw_path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1").split("?", 1)[0]
        if not forwardable(raw_path):
            return _refused()
        keyless = request.method in ("GET", "HEAD") and raw_path[len(PREFIX) + 1:] in _KEYLESS
        if not keyless and session_key(request.headers) is None:
            return JSONResponse({"error": "no capture session key: send the session as x-api-key (or Authorization: "
                                          "Bearer)"}, status_code=401)
        try:
            body = await capped_body(request)
        except BodyTooLarge:
            return JSONResponse({"error": f"request body over {recipe.CAPTURE_MAX_BODY_BYTES} bytes "
                                          "(recipe.CAPTURE_MAX_BODY_BYTES)"}, status_code=413)
        query = request.scope.get("query_string", b"").decode("latin-1")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        upstream_request = client.build_request(
            request.method, raw_path + (f"?{query}" if query else ""), headers=headers, content=body
        )
        try:
            reply = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"capture upstream unavailable: {type(exc).__name__}"}, status_code=502)
        headers_out = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_BY_HOP}
        done = BackgroundTask(reply.aclose)
        return StreamingResponse(reply.aiter_raw(), status_code=reply.status_code, headers=headers_out, background=done)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen-host", default=os.environ.get("GATEWAY_HOST", "0.0.0.0"))
    parser.add_argument("--listen-port", type=int, default=os.environ.get("GATEWAY_PORT", str(recipe.PUBLIC_PORT)))
    parser.add_argument(
        "--upstream",
        default=os.environ.get("GATEWAY_UPSTREAM", f"http://{recipe.LOOPBACK}:{recipe.ENV_PORT}"),
        help="the env server (capture mounted at /capture), on loopback",
    )
    args = parser.parse_args()
    uvicorn.run(create_app(args.upstream), host=args.listen_host, port=args.listen_port, log_level="warning")


if __name__ == "__main__":
    main()
