"""A stand-in for the HF Jobs proxy in front of the public port: forwards every request but drops the
`Authorization` header (what the real proxy was seen to do). Records which headers it dropped, and what it forwarded
with the status the upstream answered.

Plain HTTP on a free loopback port by default; given an `ssl.SSLContext` and an address it is the job's public host
as a sandbox sees it (`https://<host>/...` on port 443, tests/chain/tls_front.py), TLS terminated here."""

from __future__ import annotations

import json
import socket
import socketserver
import ssl
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DROPPED: list[str] = []
FORWARDED: list[tuple[str, str, dict[str, str], int]] = []  # (method, path, the headers sent on, the status answered)


def start(upstream: str, *, address: tuple[str, int] = ("127.0.0.1", 0), tls: ssl.SSLContext | None = None,
          refuse: Callable[[str, str, bytes | None], tuple[int, str] | None] | None = None):
    """Serve on `address` (a free 127.0.0.1 port unless given), over TLS with `tls`, in a daemon thread; returns the
    server. `refuse(method, path, body)` may answer a request itself instead, with (status, message) as vLLM's error
    body (an engine failing some calls), unrecorded."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0)) or None
            if refuse and (refused := refuse(self.command, self.path, body)):
                status, message = refused
                data = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": status}}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            headers = {}
            for key, value in self.headers.items():
                if key.lower() == "authorization":
                    DROPPED.append(value)
                elif key.lower() not in ("host", "content-length", "connection"):
                    headers[key] = value
            request = urllib.request.Request(upstream + self.path, data=body, headers=headers, method=self.command)
            try:
                reply = urllib.request.urlopen(request, timeout=60)
            except urllib.error.HTTPError as err:
                reply = err
            data = reply.read()
            status = reply.status if hasattr(reply, "status") else reply.code
            FORWARDED.append((self.command, self.path, {k.lower(): v for k, v in headers.items()}, status))
            self.send_response(status)
            for key, value in reply.headers.items():
                if key.lower() not in ("transfer-encoding", "content-length", "connection", "date", "server"):
                    self.send_header(key, value)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _forward  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def server_bind(self) -> None:
            """http.server's bind without its lookup of the address's name (socket.getfqdn): for the public host's
            127/8 address, which no hosts file names, that is a DNS query off loopback."""
            socketserver.TCPServer.server_bind(self)
            self.server_name, self.server_port = self.server_address[:2]

        def get_request(self) -> tuple[socket.socket, object]:
            """The accepted connection, TLS-wrapped when asked; the handshake runs in the request's own thread."""
            sock, peer = super().get_request()
            if tls is None:
                return sock, peer
            return tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), peer

        def handle_error(self, request: object, client_address: object) -> None:
            if not isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):  # a client refusing our CA: quiet
                super().handle_error(request, client_address)

    server = Server(address, Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
