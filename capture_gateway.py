"""The job's one public port (serve_env.sh starts it): forwards `/capture/<model API path>` calls under a live
session's key to the env server on loopback, 404 to all else. What each limit stops: docs/jobs.md "Ports"."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

import recipe

PREFIX = "/capture"
_SEGMENT = re.compile(r"^[A-Za-z0-9_\-.:~@]+$")
# RFC 9110 7.6.1's connection-level headers, plus the ones httpx and uvicorn recompute.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length"}
_OWN = "gateway.own"  # the ASGI scope extension a live session's request calls to take its connection off the idle list


def forwardable(raw_path: str) -> bool:
    """Whether a path is on the capture data plane and cannot be normalised into another route (`..`, `//`, `%`)."""
    segments = raw_path.removeprefix(PREFIX + "/").split("/")
    return (raw_path.startswith(PREFIX + "/") and all(_SEGMENT.match(s) and set(s) != {"."} for s in segments)
            and segments[0] != "sessions")  # the capture proxy's control plane (the trainer's, on loopback)


def _refused(status: int, error: str) -> JSONResponse:
    """A refusal that also closes the connection: a body the client may still be sending is never read."""
    return JSONResponse({"error": error}, status_code=status, headers={"connection": "close"})


def session_key(headers: Mapping[str, str]) -> str | None:
    """The session key where the capture proxy's extract_api_key looks (importing openenv costs seconds a restart)."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    return (headers.get("x-api-key", "").strip() or headers.get("x-goog-api-key", "").strip()) or None


class LiveSessions:
    """The capture proxy's live session ids (its admin route `GET /capture/sessions`), read at most once per
    recipe.GATEWAY_SESSION_READ_S however many made-up keys arrive; an unknown key waits for a read begun after it."""

    def __init__(self, client: httpx.AsyncClient, admin_key: str) -> None:
        self.client, self.headers = client, {"authorization": f"Bearer {admin_key}"}
        self.ids: frozenset[str] = frozenset()
        self.began, self.ok = -float("inf"), False
        self.lock = asyncio.Lock()

    async def read(self, since: float) -> bool:
        """Make sure a read began at or after `since` (time.monotonic); whether the capture proxy answered it."""
        async with self.lock:
            if self.began < since:
                await asyncio.sleep(self.began + recipe.GATEWAY_SESSION_READ_S - time.monotonic())
                self.began = time.monotonic()
                try:
                    # The trainer's patience: the env server's loop stalls while Harbor sets a trial up.
                    reply = await self.client.get(f"{PREFIX}/sessions", headers=self.headers,
                                                  timeout=recipe.TASK_API_TIMEOUT_S)
                    self.ids = frozenset(s["session_id"] for s in reply.raise_for_status().json()["sessions"])
                    self.ok = True
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    self.ok = False
        return self.ok


async def capped_body(request: Request, limit: int = recipe.CAPTURE_MAX_BODY_BYTES) -> bytes | None:
    """The request body, or None as soon as it is known to pass `limit` (by its Content-Length, or while reading)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def create_app(upstream: str, admin_key: str, body_timeout_s: float = recipe.GATEWAY_BODY_TIMEOUT_S) -> Starlette:
    """The gateway as an ASGI app forwarding allowed paths to `upstream` (the env server's root URL)."""
    # No read timeout (a completion streams for minutes; the agent timeout bounds it), no pool cap (the env server's
    # session limit bounds concurrency).
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(30.0, read=None),
                               limits=httpx.Limits(max_connections=None))
    sessions = LiveSessions(client, admin_key)

    async def forward(request: Request) -> Response:
        raw_path, query = request.scope["raw_path"].decode("latin-1"), request.scope["query_string"].decode("latin-1")
        if not forwardable(raw_path):
            return _refused(404, f"not found: only {PREFIX}/ is served on this port")
        # h11 stops a head past the cap while it arrives; one that arrived whole in a single read is stopped here.
        head = len(raw_path) + len(query) + sum(len(k) + len(v) + 4 for k, v in request.scope["headers"])
        if head > recipe.GATEWAY_MAX_HEAD_BYTES:
            return _refused(431, f"request head over {recipe.GATEWAY_MAX_HEAD_BYTES} bytes")
        if request.method in ("GET", "HEAD") and raw_path == f"{PREFIX}/health":
            up = await sessions.read(time.monotonic() - recipe.GATEWAY_SESSION_READ_S)
            return JSONResponse({"status": "ok" if up else "capture proxy unavailable"}, status_code=200 if up else 503)
        key = session_key(request.headers)
        if key is None:
            return _refused(401, "no capture session key: send the session as x-api-key (or Authorization: Bearer)")
        if key not in sessions.ids and not (await sessions.read(time.monotonic()) and key in sessions.ids):
            return _refused(401, "unknown capture session key")
        request.scope.get("extensions", {}).get(_OWN, lambda: None)()
        try:
            async with asyncio.timeout(body_timeout_s):
                body = await capped_body(request)
        except TimeoutError:
            return _refused(408, f"request body not received within {body_timeout_s:g} s")
        if body is None:
            return _refused(413, f"request body over {recipe.CAPTURE_MAX_BODY_BYTES} bytes (CAPTURE_MAX_BODY_BYTES)")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        target = raw_path + (f"?{query}" if query else "")
        upstream_request = client.build_request(request.method, target, headers=headers, content=body)
        try:
            reply = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"capture upstream unavailable: {type(exc).__name__}"}, status_code=502)
        headers_out = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_BY_HOP}
        done = BackgroundTask(reply.aclose)
        return StreamingResponse(reply.aiter_raw(), status_code=reply.status_code, headers=headers_out, background=done)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


class Connection(H11Protocol):
    """uvicorn's h11 protocol (h11 caps the head, httptools does not) plus a deadline on every head and a cap on idle
    connections, the longest-idle closed past it (uvicorn's limit_concurrency would refuse the job's own sessions)."""

    idle: ClassVar[dict[Connection, None]] = {}  # oldest first
    limit: ClassVar[int] = recipe.GATEWAY_IDLE_CONNECTIONS
    head_timeout_s: ClassVar[float] = recipe.GATEWAY_HEAD_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # noqa: ANN401 - asyncio's own signature
        super().connection_made(transport)
        self._await_head()
        while len(self.idle) > self.limit:
            oldest = next(iter(self.idle))
            oldest._release()
            oldest.transport.close()

    def _await_head(self) -> None:
        self.idle.pop(self, None)  # back in as the newest
        self.idle[self] = None
        self._deadline = self.loop.call_later(self.head_timeout_s, self.transport.close)

    def _release(self) -> None:
        self.idle.pop(self, None)
        self._deadline.cancel()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a head arrived in time; a live session's request may claim the connection
            self._deadline.cancel()
            self.cycle.scope.setdefault("extensions", {})[_OWN] = lambda: self.idle.pop(self, None)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():  # kept alive: it waits for its next head
            self._await_head()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        super().connection_lost(exc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen-host", required=True)
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the env server's root URL, on loopback")
    args = parser.parse_args()
    # serve_env.sh checked these knobs and set the admin key; idle connections get at most a quarter of the open files.
    Connection.head_timeout_s = recipe.knob("GATEWAY_HEAD_TIMEOUT")
    Connection.limit = min(recipe.knob("GATEWAY_IDLE_CONNECTIONS"), resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
    app = create_app(args.upstream, os.environ["OPENENV_CAPTURE_ADMIN_KEY"], recipe.knob("GATEWAY_BODY_TIMEOUT"))
    uvicorn.run(app, host=args.listen_host, port=args.listen_port,
                http=Connection, h11_max_incomplete_event_size=recipe.GATEWAY_MAX_HEAD_BYTES, ws="none",
                log_level="error")  # not a warning per malformed request: a public port gets them by the thousand


if __name__ == "__main__":
    main()
