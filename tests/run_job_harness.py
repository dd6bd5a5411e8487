"""What the run_job.sh tests share: a bundle folder with the real scripts and fake trainer/task-prep/eval, stub
`vllm`/`nvidia-smi`/`python3 -m pip` on PATH, the environment to run it in, and the checks that nothing is left
running. The tests are split by what they prove (test_run_job*.py), so xdist can run them side by side: each
waits mostly on the script's own polls and timeouts, and one module of all of them ran alone at the suite's end."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from stubs.procs import free_port_knobs

import recipe

ROOT = Path(__file__).resolve().parents[1]
STUBS = Path(__file__).resolve().parent / "stubs"
REAL = ["run_job.sh", "common.sh", "recipe.py", "image_check.py", "serve_policy.sh", "chat_template.py", "serve_env.sh",
        "seam_patch.py", "capture_gateway.py", "train_rollouts.py", "trajectories.py", "adapter_repo.py",
        "sandbox_lifecycle.py"]
FAKES = {"train_lora.py": "fake_trainer.py", "prepare_tasks.py": "fake_prepare_tasks.py",
         "run_eval.sh": "fake_run_eval.sh", "smoke_report.py": "fake_smoke_report.py"}
SECRET = "hf_secret_token_value"


def make_job(tmp_path: Path) -> dict:
    """A bundle folder with the real scripts and fake trainer/prep/eval, plus the environment to run it."""
    app = tmp_path / "app"
    app.mkdir()
    for name in REAL:
        shutil.copy(ROOT / name, app / name)
    for name, fake in FAKES.items():
        shutil.copy(STUBS / fake, app / name)
    site = shared_site()
    startup_site(tmp_path / "startup", site)
    token = uuid.uuid4().hex
    ports = free_port_knobs()
    env = {k: v for k, v in os.environ.items()
           if k not in {"HF_TOKEN", "SANDBOX", "DAYTONA_API_KEY", "E2B_API_KEY", "SPACE_HOST", "JOB_ID", "HF_JOB_ID"}}
    env.update(
        PATH=f"{STUBS / 'bin'}:{env['PATH']}", PYTHON=str(STUBS / "bin" / "python3"), REAL_PYTHON=sys.executable,
        PYTHONPATH=str(tmp_path / "startup"), STUB_LOG=str(tmp_path / "stub.log"),
        LOG_DIR=str(tmp_path / "logs"), WORK_DIR=str(tmp_path / "work"),
        ADAPTER_REPO="you/LFM2.5-2.6B-opencode-lora-RL",
        HF_TOKEN=SECRET, JOB_ID="job123", MAX_STEPS="3", PUBLIC_HOST="127.0.0.1", WATCH_INTERVAL="0.2",
        WAIT_POLL="0.2", READY_TIMEOUT="30", STALL_SECONDS="30", STUB_POLICY_PORT=str(ports["POLICY_PORT"]),
        RUN_JOB_TEST_TOKEN=token, REAL_SMOKE_REPORT=str(ROOT / "smoke_report.py"),
        **{k: str(v) for k, v in ports.items()},
    )
    return {"app": app, "env": env, "tmp": tmp_path, "token": token, "ports": ports}


@functools.cache
def shared_site() -> Path:
    """The image's site folder with recipe.VLLM_VERSION's fake vLLM, one for this process's tests, which only read it:
    its Pythons then share one package map (tests/site/sitecustomize.py rule 2). A test that changes it takes
    own_site()."""
    site = Path(tempfile.mkdtemp(prefix="run-job-site-"))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    fake_vllm(site, recipe.VLLM_VERSION)
    return site


def own_site(job: dict, version: str = recipe.VLLM_VERSION) -> Path:
    """A site folder of this job's own, with `version`'s fake vLLM, for a test that changes what the image has."""
    site = job["tmp"] / "site"
    fake_vllm(site, version)
    shutil.rmtree(job["tmp"] / "startup")
    startup_site(job["tmp"] / "startup", site)
    return site


def fake_vllm(site: Path, version: str) -> None:
    """vLLM's package metadata (importlib.metadata reads it) and an importable empty `vllm.entrypoints.openai.
    api_server` stand in for the image's vLLM (tests/test_vllm_cpu.py imports the real one)."""
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   "Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0\nRequires-Dist: mcp<3,>=2\n")
    api = site / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True, exist_ok=True)
    for folder in (site / "vllm", site / "vllm" / "entrypoints", api):
        (folder / "__init__.py").touch()
    (api / "api_server.py").touch()


def startup_site(folder: Path, site: Path) -> None:
    """Makes `site` a site-packages folder read at interpreter start (its .pth files too), as the image's is."""
    folder.mkdir()
    suite_rule = Path(__file__).resolve().parent / "site" / "sitecustomize.py"  # the suite's start-up rule too
    (folder / "sitecustomize.py").write_text(f"import runpy, site\nsite.addsitedir({str(site)!r})\n"
                                             f"runpy.run_path({str(suite_rule)!r})\n")


def run_job(job, timeout: float = 90, **extra: str) -> subprocess.CompletedProcess:
    env = {**job["env"], **extra}
    out = subprocess.run(["bash", str(job["app"] / "run_job.sh")], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert SECRET not in out.stdout + out.stderr
    return out


def stub_log(job) -> list[str]:
    path = job["tmp"] / "stub.log"
    return path.read_text().splitlines() if path.exists() else []


def leftovers(token: str, command: str = "") -> list[int]:
    """Live processes (not zombies) carrying this test's token in their environment (and `command` in their argv); one
    that exits while it is read is not listed."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (f"RUN_JOB_TEST_TOKEN={token}".encode() in (proc / "environ").read_bytes()
                    and command.encode() in (proc / "cmdline").read_bytes()):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def assert_no_leftovers(token: str, wait_s: float = 5) -> None:
    deadline = time.monotonic() + wait_s
    while leftovers(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(token) == []


def index_of(lines: list[str], prefix: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(prefix))


# --- the plan --------------------------------------------------------------------------------------

