"""What a live rollout session sees while keyless clients abuse the public port (issue 44).

serve_env.sh starts the real env server (openenv 0.10.0's Harbor server, capture proxy mounted at /capture) and the real
capture_gateway.py on loopback, in front of the vLLM double (tests/stubs/upstream_double.py); one registered session
makes chat calls through the gateway, a new connection each, back to back, while one abuse runs for --seconds. Per
abuse: the session's calls, failures and latency, the most memory the gateway and the env server held, and what the
abusers got back. `--bundle DIR` runs another copy of the bundle (e.g. main's: `git worktree add /tmp/main main`).

    .venv/bin/python benchmarks/gateway_abuse.py                       # every abuse, 20 s each (~3 min)
    .venv/bin/python benchmarks/gateway_abuse.py --bundle /tmp/main --abuses baseline,big_heads --seconds 5
    .venv/bin/python benchmarks/gateway_abuse.py --abuses baseline,connection_flood --nofile 256
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from stubs import upstream_double  # noqa: E402
from stubs.procs import free_ports, start, stop, wait_http  # noqa: E402
from test_servers import ADMIN, CHAT, children, serve_env_env  # noqa: E402

import recipe  # noqa: E402

Outcomes = collections.Counter


def status_of(sock: socket.socket) -> str:
    """What the server answered on `sock` (its status code), or how the connection ended."""
    try:
        data = sock.recv(65536)
        return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except TimeoutError:
        return "no answer"


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def request_loop(port: int, data: bytes, stop_at: float, seen: Outcomes) -> None:
    """Send `data` on a new connection, read the status, again until `stop_at`."""
    while time.monotonic() < stop_at:
        try:
            with connect(port) as sock:
                sock.sendall(data)
                seen[status_of(sock)] += 1
        except OSError as error:
            seen[type(error).__name__] += 1


def held_loop(port: int, first: bytes, then: bytes, every_s: float, stop_at: float, seen: Outcomes) -> None:
    """Send `first`, then `then` every `every_s` seconds, until the server closes (counted) or `stop_at`; again."""
    while time.monotonic() < stop_at:
        try:
            with connect(port) as sock:
                sock.sendall(first)
                while time.monotonic() < stop_at:
                    sock.sendall(then)
                    if select.select([sock], [], [], every_s)[0]:
                        seen[status_of(sock)] += 1
                        break
                else:
                    seen["held to the end"] += 1
        except OSError as error:
            seen[type(error).__name__] += 1


def flood_loop(port: int, count: int, stop_at: float, seen: Outcomes) -> None:
    """Hold `count` silent connections; each one the server closes is counted and opened again."""
    socks: list[socket.socket] = []
    while time.monotonic() < stop_at:
        while len(socks) < count:
            try:
                socks.append(connect(port))
            except OSError as error:
                seen[type(error).__name__] += 1
                break
        for sock in select.select(socks, [], [], 0.2)[0]:
            seen[status_of(sock)] += 1
            sock.close()
            socks.remove(sock)
    seen["held to the end"] += len(socks)
    for sock in socks:
        sock.close()


def head(method: str, path: str, key: str = "", length: int | None = None, end: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", "content-type: application/json"]
    lines += [f"x-api-key: {key}"] * bool(key) + [f"content-length: {length}"] * (length is not None)
    return ("\r\n".join(lines) + "\r\n" + ("\r\n" if end else "")).encode()


CHAT_PATH = "/capture/v1/chat/completions"
MB = 2**20


def abuses(port: int) -> dict[str, tuple[str, list[Callable[[float, Outcomes], None]]]]:
    """name -> (what it does, one callable per abusing thread: f(stop_at, outcomes))."""
    big = head("GET", "/capture/v1/models", end=False) + b"x-pad: " + b"a" * MB  # then 1 MB more a second
    count_tokens = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4 * MB}]}).encode()
    made_up = json.dumps({**CHAT, "pad": "x" * (8 * MB - 1000)}).encode()  # just under CAPTURE_MAX_BODY_BYTES
    return {
        "baseline": ("nothing", []),
        "big_heads": ("6 connections streaming an endless header, 1 MB a second (64 MB in a minute)",
                      [lambda t, s: held_loop(port, big, b"a" * MB, 1.0, t, s)] * 6),
        "slow_heads": ("40 heads dribbled a byte every 0.5 s, 10 bodies (of 1 MB) likewise",
                       [lambda t, s: held_loop(port, head("POST", CHAT_PATH, end=False), b"a", 0.5, t, s)] * 40
                       + [lambda t, s: held_loop(port, head("POST", CHAT_PATH, "s" + "0" * 24, MB), b"a", 0.5, t, s)]
                       * 10),
        "made_up_keys": ("12 clients posting 8 MB bodies under made-up keys",
                         [lambda t, s: request_loop(port, head("POST", CHAT_PATH, "junk", len(made_up)) + made_up,
                                                    t, s)] * 12),
        "count_tokens": ("12 clients posting 4 MB count_tokens bodies under the key 'junk'",
                         [lambda t, s: request_loop(port, head("POST", "/capture/v1/messages/count_tokens", "junk",
                                                               len(count_tokens)) + count_tokens, t, s)] * 12),
        "keyless_models": ("12 clients asking GET /capture/v1/models with no key",
                           [lambda t, s: request_loop(port, head("GET", "/capture/v1/models"), t, s)] * 12),
        "connection_flood": ("600 silent connections held open (reopened when closed)",
                             [lambda t, s: flood_loop(port, 600, t, s)]),
    }


def rss_mb(pid: int) -> float:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return 0.0


def run_abuse(serve: subprocess.Popen, port: int, session: str, seconds: float,
              abusers: list[Callable[[float, Outcomes], None]]) -> dict[str, object]:
    """Run `abusers` for `seconds` while the session calls in a loop and memory is sampled."""
    stop_at, seen, latencies, failures = time.monotonic() + seconds, Outcomes(), [], Outcomes()
    peak = {"gateway": 0.0, "env server": 0.0}
    threads = [threading.Thread(target=f, args=(stop_at, seen), daemon=True) for f in abusers]
    for thread in threads:
        thread.start()
    body = json.dumps(CHAT)
    while time.monotonic() < stop_at:
        for pid, cmd in children(serve.pid).items():
            name = "gateway" if "capture_gateway.py" in cmd else "env server" if "seam_patch.py" in cmd else ""
            if name:
                peak[name] = max(peak[name], rss_mb(pid))
        began = time.monotonic()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", CHAT_PATH, body=body, headers={"content-type": "application/json",
                                                                "x-api-key": session})
            status = conn.getresponse().status
            conn.close()
        except OSError as error:
            status = type(error).__name__
        if status == 200:
            latencies.append((time.monotonic() - began) * 1000)
        else:
            failures[str(status)] += 1
    for thread in threads:
        thread.join(timeout=30)
    return {"latencies": latencies, "failures": failures, "peak": peak, "seen": seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=ROOT, help="the bundle folder whose serve_env.sh runs")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each abuse runs")
    parser.add_argument("--abuses", default="", help="comma-separated names (default: all)")
    parser.add_argument("--nofile", type=int, default=0, help="the servers' open-file limit (default: inherited)")
    args = parser.parse_args()
    upstream = upstream_double.start(model=recipe.SERVED_MODEL_NAME)
    env_port, public_port = free_ports(2)
    tmp = Path(tempfile.mkdtemp(prefix="gateway_abuse-"))
    env = serve_env_env(tmp, upstream, env_port, public_port)
    table = abuses(public_port)
    names = args.abuses.split(",") if args.abuses else list(table)
    with (tmp / "serve_env.log").open("w") as log:
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile,) * 2)) if args.nofile else None
        serve = start(["bash", str(args.bundle / "serve_env.sh")], env=env, log=log, preexec_fn=limit)
        try:
            wait_http(f"http://127.0.0.1:{env_port}/health", serve, timeout=120)
            wait_http(f"http://127.0.0.1:{public_port}/capture/health", serve, timeout=60)
            conn = http.client.HTTPConnection("127.0.0.1", env_port, timeout=30)
            conn.request("POST", "/capture/sessions", body=json.dumps({"session_id": "bench-session"}),
                         headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"})
            assert conn.getresponse().status == 200
            print(f"bundle {args.bundle}, {args.seconds:g} s per abuse, open-file limit "
                  f"{args.nofile or resource.getrlimit(resource.RLIMIT_NOFILE)}, load average {os.getloadavg()[0]:.1f}")
            print("| abuse | legit calls ok / failed | p50 ms | p95 ms | max ms | gateway RSS max MB "
                  "| env server RSS max MB | what the abusers got |")
            print("|---|---|---|---|---|---|---|---|")
            for name in names:
                result = run_abuse(serve, public_port, "bench-session", args.seconds, table[name][1])
                lat = sorted(result["latencies"]) or [float("nan")]
                p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
                failed = sum(result["failures"].values())
                got = ", ".join(f"{k} x{v}" for k, v in result["seen"].most_common()) or "-"
                print(f"| {name}: {table[name][0]} | {len(result['latencies'])} / {failed}"
                      f"{' ' + dict(result['failures']).__repr__() if failed else ''} | {statistics.median(lat):.1f} "
                      f"| {p95:.1f} | {lat[-1]:.1f} | {result['peak']['gateway']:.0f} "
                      f"| {result['peak']['env server']:.0f} | {got} |", flush=True)
                if serve.poll() is not None:
                    print(f"serve_env.sh exited ({serve.returncode}): {(tmp / 'serve_env.log').read_text()[-500:]}")
                    break
        finally:
            stop(serve)
            upstream.shutdown()
    print(f"log: {tmp / 'serve_env.log'}")


if __name__ == "__main__":
    main()
