"""Run an entry point as a user would, with nothing to connect to: every failure must end in one stderr line.

"Offline" is a loopback port nothing listens on (HF_ENDPOINT, --env-url, ...): a connection there is refused at
once, as it is with no network, and nothing ever leaves the machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANARY = "hf_" + "OfflineCanaryToken0123456789abcdefXYZ"  # a fake, assembled so scanners skip it


def closed_url() -> str:
    """http://127.0.0.1:<port> where nothing listens (the port was free a moment ago and is closed again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def offline_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no stored login, the Hub at a closed port, temp folders under tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"),
            "HF_ENDPOINT": closed_url(), "HF_TOKEN": CANARY, "TMPDIR": str(tmp_path / "tmp"), **extra}


def run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python args...` from the checkout; the canary token never shows in what it prints."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert CANARY not in proc.stdout + proc.stderr
    return proc


def one_line(proc: subprocess.CompletedProcess[str], script: str) -> str:
    """The single stderr line a failed run printed, checked to be one line from `script` with a non-zero exit."""
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]
