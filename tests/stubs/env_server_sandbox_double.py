"""`seam_patch.py` as serve_env.sh runs it, with huggingface_hub's Sandbox replaced by the refusing double.

    python3 tests/stubs/env_server_sandbox_double.py CALLS_FILE serve -- harbor serve ...

Every `Sandbox.create` call the env server's Harbor makes is appended to CALLS_FILE as one JSON line, so a test in
another process can read what reached it. Nothing else differs from the job's env server process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from harbor.environments import hf_sandbox  # noqa: E402
from hf_sandbox_double import RefusingSandbox  # noqa: E402

import seam_patch  # noqa: E402


class CallsFile(list):
    """The double's call list, also written line by line to a file."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def append(self, call: dict) -> None:
        super().append(call)
        with self.path.open("a") as out:
            out.write(json.dumps(call) + "\n")


if __name__ == "__main__":
    RefusingSandbox.calls = CallsFile(Path(sys.argv[1]))
    hf_sandbox.Sandbox = RefusingSandbox
    seam_patch.main(sys.argv[2:])
