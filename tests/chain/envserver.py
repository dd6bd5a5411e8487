"""The env server as the suite runs it: `openenv harbor serve` in its own process (tests/chain/serve.py, which
registers the stand-ins and goes through seam_patch.py as the job does), on loopback, over prepared tasks.

One home for what test_chain.py and rehearse.py --real-chain both start: the server's environment (the sandbox
stand-in's image, overlay and fault settings, the loopback data bucket, OpenCode's pinned version, openenv's trial
folder), its argv, the wait for /health, the stop, and the lazy unmount of overlays a killed server left mounted.
`missing()` and `require()` are the one rule for where the chain can run (root, bubblewrap, the image root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from stubs.procs import free_port, wait_http

import recipe

ROOT = Path(__file__).resolve().parents[2]
IMAGE_ROOT = ROOT / ".chain-image" / "root"
# The policy double's context: large enough that none of OpenCode's requests is refused for length (the tiny model
# has no context limit of its own).
POLICY_MAX_MODEL_LEN = 262144
HEALTH_TIMEOUT_S = 180  # the server imports Harbor and openenv and loads the tasks: ~20 s idle, far more when loaded


def missing() -> str:
    """What the chain needs here and does not have ('' when all is there)."""
    if os.geteuid() != 0:
        return "root (overlay mounts)"
    if not shutil.which("bwrap"):
        return "bubblewrap (apt-get install bubblewrap, or bash setup.sh)"
    if not (IMAGE_ROOT / "usr" / "local" / "bin" / "opencode").exists():
        return "the sandbox image root (bash setup.sh builds .chain-image/root)"
    return ""


def require() -> None:
    """At a test module's top: skip it where the chain cannot run, and fail instead under CI=true."""
    import pytest

    lacking = missing()
    if lacking and os.environ.get("CI") == "true":
        pytest.fail(f"the rollout chain cannot run: missing {lacking}", pytrace=False)
    if lacking:
        pytest.skip(f"the rollout chain needs {lacking}", allow_module_level=True)


class EnvServer:
    """`openenv harbor serve` over `dataset` (a prepared split folder), its LLM at `llm_url`, its sandboxes'
    HF_ENDPOINT at `bucket_url`; its trials, overlays, home, log and fault table under `root`."""

    def __init__(self, root: Path, dataset: Path, llm_url: str, bucket_url: str) -> None:
        self.root = Path(root)
        self.trials, self.sandboxes = self.root / "trials", self.root / "sandboxes"
        self.faults_file, self.log = self.root / "faults.json", self.root / "env_server.log"
        port, capture_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**{k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "SPACE_HOST")},
                    "HOME": str(self.root / "home"), "ENABLE_WEB_INTERFACE": "false", "MAX_CONCURRENT_ENVS": "16",
                    "OPENENV_HARBOR_AGENT_VERSIONS": json.dumps({"opencode": recipe.OPENCODE_VERSION}),
                    "OPENENV_HARBOR_TRIALS_DIR": str(self.trials), "CHAIN_SANDBOX_DIR": str(self.sandboxes),
                    "CHAIN_IMAGES": json.dumps({recipe.TASK_IMAGE: [str(IMAGE_ROOT)]}), "CHAIN_HF_ENDPOINT": bucket_url,
                    "CHAIN_FAULTS_FILE": str(self.faults_file),
                    "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # Harbor's LiteLLM would fetch its price list from GitHub
        self.argv = [sys.executable, str(ROOT / "tests" / "chain" / "serve.py"), "serve", "--", "harbor", "serve",
                     "--llm-url", llm_url, "--model", recipe.SERVED_MODEL_NAME, "--host", "127.0.0.1",
                     "--port", str(port), "--capture-port", str(capture_port), "--expose", "direct",
                     "--max-output-tokens", str(recipe.MAX_TOKENS), "--dataset", str(dataset)]
        self.process: subprocess.Popen | None = None

    def start(self, *, wait: bool = True) -> subprocess.Popen:
        """Start the server (first unmounting what an earlier, killed one left), by default until /health answers."""
        self.unmount_leftovers()
        self.root.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        if wait:
            self.wait()
        return self.process

    def wait(self) -> None:
        wait_http(f"{self.url}/health", self.process, timeout=HEALTH_TIMEOUT_S)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.unmount_leftovers()

    def unmount_leftovers(self) -> None:
        unmount_leftovers(self.sandboxes)


def unmount_leftovers(sandboxes: Path) -> None:
    """Lazily unmount the overlays of trials a killed server never stopped (a clean stop unmounts its own)."""
    for merged in Path(sandboxes).glob("*/merged"):
        subprocess.run(["umount", "-l", str(merged)], capture_output=True)
