"""Helpers for tests that start real servers: free loopback ports, readiness waits, clean shutdown."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A port nothing listens on right now (127.0.0.1)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nothing listens on right now (127.0.0.1): all are held open while they are picked, so
    the kernel cannot hand one out twice, as it may to two free_port() calls in a row."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def free_port_knobs() -> dict[str, int]:
    """A distinct free port for each of the job's port knobs (recipe.PORT_KNOBS), as a test gives a job script."""
    import recipe

    return dict(zip(recipe.PORT_KNOBS, free_ports(len(recipe.PORT_KNOBS)), strict=True))


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    """Wait until `url` answers (any HTTP status); fail early if `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else "(see its log file)"
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{out}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def start(cmd: list[str], env: dict[str, str] | None = None, log=None, **kwargs) -> subprocess.Popen:
    """Start `cmd` in its own process group; output to the open file `log`, else captured as text."""
    return subprocess.Popen(
        cmd, env={**os.environ, **(env or {})}, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, **kwargs,
    )


def stop(proc: subprocess.Popen) -> None:
    """Terminate the process group of `proc`, escalating to SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        except ProcessLookupError:
            pass


def run_apart(script: Path, workdir: Path, *extra: str, env: dict[str, str],
              timeout: float) -> subprocess.CompletedProcess:
    """Run `script --workdir WORKDIR EXTRA...` (for a test) in its own process group with `env` added and JOB_ID named
    after the workdir's parent, and reap the whole group whatever happens: a run killed on purpose leaves no process
    behind. Its output, captured."""
    process = subprocess.Popen([sys.executable, str(script), "--workdir", str(workdir), *extra], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "JOB_ID": workdir.parent.name, **env})
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out)

