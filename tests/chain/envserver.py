"""The env server as the suite runs it: `openenv harbor serve` in its own process (tests/chain/serve.py, which
registers the stand-ins and goes through seam_patch.py as the job does), on loopback, over prepared tasks.

One home for what test_chain.py and rehearse.py --real-chain both start: the server's environment (the sandbox
stand-in's image, overlay and fault settings, the loopback data bucket, OpenCode's pinned version, openenv's trial
folder), its argv, the wait for /health, the stop, and the lazy unmount of overlays a killed server left mounted.
`missing()` and `require()` are the one rule for where the chain can run (root, bubblewrap, the image root).

`public=True` runs it as the job does instead: serve_env.sh (unchanged; tests/chain/site puts the stand-ins into the
env server it starts) with SPACE_HOST at a loopback TLS front that strips `Authorization` as the HF Jobs proxy does
(tls_front.py), so every sandbox reaches the capture proxy through https://$SPACE_HOST/capture, capture_gateway.py
and the x-api-key seam, trusting the front's CA through one more overlay layer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from stubs.procs import free_ports, wait_http

import recipe

ROOT = Path(__file__).resolve().parents[2]
IMAGE_ROOT = ROOT / ".chain-image" / "root"
# The policy double's context: large enough that none of OpenCode's requests is refused for length (the tiny model
# has no context limit of its own).
POLICY_MAX_MODEL_LEN = 262144
# The chain's tiny model learns BPE merges up to this many tokens (tiny_lfm2.tiny_tokenizer): OpenCode's ~26k-byte
# prompt becomes ~9k tokens instead of ~26k, which the trainer and the policy double pay for in every row and call.
CHAIN_VOCAB = 4096
# The capture proxy's cap on each model call's output (--max-output-tokens; the job's is recipe.MAX_TOKENS) where the
# engine samples a random tiny model: it almost never samples its end-of-turn token (1 in 4,096), so uncapped every call
# would run to recipe.MAX_TOKENS, about 40 s of CPU decoding per call (test_eval_watch_engine.py). The real-chain
# rehearsal and the learning run serve the agent policy instead, capped at agent_policy.MAX_REPLY_TOKENS.
RANDOM_MODEL_MAX_TOKENS = 48
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


def require(what: str = "the rollout chain", lacking: str | None = None) -> None:
    """At a test module's top: skip it where `what` cannot run (`lacking`, default missing()), and fail instead under
    CI=true."""
    import pytest

    lacking = missing() if lacking is None else lacking
    if lacking and os.environ.get("CI") == "true":
        pytest.fail(f"{what} cannot run: missing {lacking}", pytrace=False)
    if lacking:
        pytest.skip(f"{what} needs {lacking}", allow_module_level=True)


class EnvServer:
    """`openenv harbor serve` over `dataset` (a prepared split folder), its LLM at `llm_url`, its sandboxes'
    HF_ENDPOINT at `bucket_url`; its trials, overlays, home, log and fault table under `root`."""

    def __init__(self, root: Path, dataset: Path, llm_url: str, bucket_url: str, *, public: bool = False,
                 max_output_tokens: int = recipe.MAX_TOKENS) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.trials, self.sandboxes = self.root / "trials", self.root / "sandboxes"
        self.faults_file, self.log = self.root / "faults.json", self.root / "env_server.log"
        port, capture_port, public_port = free_ports(3)
        self.url = f"http://127.0.0.1:{port}"
        layers = [str(IMAGE_ROOT)]
        self.env = {**{k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "SPACE_HOST")},
                    "HOME": str(self.root / "home"), "ENABLE_WEB_INTERFACE": "false", "MAX_CONCURRENT_ENVS": "16",
                    "OPENENV_HARBOR_AGENT_VERSIONS": json.dumps({"opencode": recipe.OPENCODE_VERSION}),
                    "OPENENV_HARBOR_TRIALS_DIR": str(self.trials), "CHAIN_SANDBOX_DIR": str(self.sandboxes),
                    "CHAIN_HF_ENDPOINT": bucket_url, "CHAIN_FAULTS_FILE": str(self.faults_file),
                    "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # Harbor's LiteLLM would fetch its price list from GitHub
        self.front = None
        if public:
            from chain import tls_front

            self.host, self.address = f"job-chain--{public_port}.hf.jobs", tls_front.loopback_address()
            self.certs = tls_front.make_certs(self.root / "certs", self.host)
            layers.insert(0, str(tls_front.trust_layer(self.root / "trust-layer", IMAGE_ROOT, self.certs, self.host,
                                                       self.address)))
            self.front = tls_front.start(f"http://127.0.0.1:{public_port}", self.certs, self.address)
            self.gateway_url = f"http://127.0.0.1:{public_port}"
            # serve_env.sh's own inputs; the token is a placeholder its hf-sandbox check asks for (no Hub here).
            self.env |= {"DATASETS": str(dataset), "SPACE_HOST": self.host, "HF_TOKEN": "hf_chain_placeholder",
                         "POLICY_URL": llm_url, "ENV_PORT": str(port), "PUBLIC_PORT": str(public_port),
                         "PUBLIC_HOST": "127.0.0.1", "PYTHON": sys.executable,
                         "PYTHONPATH": str(ROOT / "tests" / "chain" / "site")}
            for name in ("SANDBOX", "JOB_ID", "HF_JOB_ID", "MAX_CONCURRENT_ENVS"):
                self.env.pop(name, None)
            self.argv = ["bash", str(ROOT / "serve_env.sh")]
        else:
            self.argv = [sys.executable, str(ROOT / "tests" / "chain" / "serve.py"), "serve", "--", "harbor", "serve",
                         "--llm-url", llm_url, "--model", recipe.SERVED_MODEL_NAME, "--host", "127.0.0.1",
                         "--port", str(port), "--capture-port", str(capture_port), "--expose", "direct",
                         "--max-output-tokens", str(max_output_tokens), "--dataset", str(dataset)]
        self.env["CHAIN_IMAGES"] = json.dumps({recipe.TASK_IMAGE: layers})
        self.process: subprocess.Popen | None = None

    def start(self, *, wait: bool = True) -> subprocess.Popen:
        """Start the server (first unmounting what an earlier, killed one left), by default until /health answers."""
        self.unmount_leftovers()
        self.root.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        if wait:
            self.wait()
        return self.process

    def wait(self) -> None:
        wait_http(f"{self.url}/health", self.process, timeout=HEALTH_TIMEOUT_S)
        if self.front is not None:
            wait_http(f"{self.gateway_url}/capture/health", self.process, timeout=HEALTH_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL the server and what it started (serve_env.sh's env server and gateway), as an OOM kill would."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.front is not None:
            self.front.shutdown()
            self.front = None
        self.unmount_leftovers()

    def unmount_leftovers(self) -> None:
        unmount_leftovers(self.sandboxes)


def unmount_leftovers(sandboxes: Path) -> None:
    """Lazily unmount the overlays of trials a killed server never stopped (a clean stop unmounts its own)."""
    for merged in Path(sandboxes).glob("*/merged"):
        subprocess.run(["umount", "-l", str(merged)], capture_output=True)
