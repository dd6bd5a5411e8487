"""An HF Sandbox stand-in for Harbor: bubblewrap over a per-trial overlayfs on a read-only task image root.

Registered in the env server's own process in place of Harbor's `hf-sandbox` environment (tests/chain/serve.py), so
every client keeps sending `sandbox="hf-sandbox"` and Harbor's real Trial drives it: start, healthcheck, agent setup
and run, verifier, log download. Per trial the image's layers are the overlay's lower dirs and a fresh upper dir
takes every write; each exec is `bwrap --bind <merged> / ... /bin/bash -c CMD` with a clean environment (the task's
and the call's variables only). It needs root (the mount), starts in about 0.1 s, shares the host network (the
loopback capture proxy and data bucket are reachable, as the Hub and the job's public URL are from a real sandbox)
and enforces no cpu/memory limits.

The image root is built by setup.sh (.chain-image/root). CHAIN_IMAGES (JSON: image name -> [layer dirs, top first])
says which images exist; a task naming any other image fails to start, as a sandbox whose image cannot be pulled
does. CHAIN_SANDBOX_DIR holds the trials' overlays; CHAIN_HF_ENDPOINT, when set, is every exec's HF_ENDPOINT.
CHAIN_FAULTS_FILE (JSON, read at each start: task name -> {"start": message} or {"layers": [dirs]}) makes a task's
sandbox fail to start, or lays extra layers over its image (an image that differs from the one built); for the SDK
doubles, {"create": {"status": S, "times": N}} makes the task's first N creates answer HTTP status S.

`Box` is one such sandbox (mount, exec, files, close); the Daytona and E2B SDK doubles (daytona_double.py,
e2b_double.py) run their sandboxes in it too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.environment_type import EnvironmentType

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# This machine reaches the package registries only, where a real sandbox has the internet, and the suite's traffic
# stays on loopback: OpenCode is kept from the network calls it would otherwise make (models.dev, its own updates,
# share links, LSP downloads), and the npm registry it fetches its config folder's packages from at every start
# (@opencode-ai/plugin and four more; it runs on without them) is a closed loopback port.
OFFLINE = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1",
           "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "npm_config_registry": "http://127.0.0.1:9/"}


def images() -> dict[str, list[str]]:
    return json.loads(os.environ.get("CHAIN_IMAGES", "{}"))


def fault_of(trial: str) -> tuple[str, dict[str, Any]]:
    """The fault table's task whose name is in `trial` ("<task> <session>") and its fault; ("", {}) if none."""
    path = Path(os.environ.get("CHAIN_FAULTS_FILE", "/nonexistent"))
    table = json.loads(path.read_text()) if path.is_file() else {}
    return next(((task, fault) for task, fault in table.items() if task in trial), ("", {}))


def faults(trial: str) -> dict[str, Any]:
    return fault_of(trial)[1]


_REFUSED: dict[str, int] = {}


def refused_create(trial: str) -> int | None:
    """The HTTP status a sandbox API answers this create with ({"create": {"status": S, "times": N}}: the task's
    first N creates; every one without "times"), or None: the SDK doubles' rate limits and outages."""
    task, fault = fault_of(trial)
    refusal = fault.get("create")
    if refusal is None or _REFUSED.get(task, 0) >= refusal.get("times", float("inf")):
        return None
    _REFUSED[task] = _REFUSED.get(task, 0) + 1
    return refusal["status"]


def record(backend: str, **fields: Any) -> None:
    """One JSON line to CHAIN_SDK_CALLS, when set: what an SDK double was asked (the test reads it back)."""
    if path := os.environ.get("CHAIN_SDK_CALLS"):
        with open(path, "a") as calls:
            calls.write(json.dumps({"backend": backend, **fields}) + "\n")


class Box:
    """One sandbox: a fresh overlay over the image's layers, every command in it run by bubblewrap; `env` is every
    command's base environment (the sandbox's own variables)."""

    def __init__(self, image: str, trial: str, env: dict[str, str] | None = None) -> None:
        layers = images().get(image)
        if not layers:
            raise RuntimeError(f"sandbox image {image!r} not found (this machine has {sorted(images())})")
        fault = faults(trial)
        if "start" in fault:
            raise RuntimeError(f"sandbox failed to start: {fault['start']}")
        layers = [*fault.get("layers", []), *layers]
        base = Path(os.environ.get("CHAIN_SANDBOX_DIR") or tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{trial.split()[-1][:40]}-", dir=base))
        self.root = self.dir / "merged"
        for name in ("upper", "work", "merged"):
            (self.dir / name).mkdir()
        options = f"lowerdir={':'.join(layers)},upperdir={self.dir / 'upper'},workdir={self.dir / 'work'}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(self.root)], check=True,
                       capture_output=True)
        self.env = {"PATH": PATH, "HOME": "/root", **OFFLINE, **(env or {})}
        if os.environ.get("CHAIN_HF_ENDPOINT"):
            self.env["HF_ENDPOINT"] = os.environ["CHAIN_HF_ENDPOINT"]
        self.processes: set[asyncio.subprocess.Process] = set()

    @classmethod
    async def open(cls, image: str, trial: str, env: dict[str, str] | None = None) -> Box:
        return await asyncio.to_thread(cls, image, trial, env)

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    async def spawn(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None
                    ) -> asyncio.subprocess.Process:
        """`bash -c command` in the sandbox, its output piped; it runs until it ends or the sandbox closes."""
        argv = ["bwrap", "--bind", str(self.root), "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--clearenv", "--chdir", cwd or "/"]
        for key, value in {**self.env, **(env or {})}.items():
            argv += ["--setenv", key, str(value)]
        proc = await asyncio.create_subprocess_exec(*argv, "/bin/bash", "-c", command, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, start_new_session=True)
        self.processes.add(proc)
        return proc

    async def run(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None) -> tuple[int, str, str]:
        """Run to its end (or `timeout`, then TimeoutError): exit code, stdout, stderr."""
        proc = await self.spawn(command, cwd, env)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout or None)
        except BaseException:  # a timeout, or Harbor cancelling the agent at its timeout: nothing may outlive it
            kill(proc)
            await proc.wait()
            raise
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def close(self) -> None:
        for proc in self.processes:
            kill(proc)
        await asyncio.to_thread(subprocess.run, ["umount", "-l", str(self.root)], capture_output=True)
        await asyncio.to_thread(shutil.rmtree, self.dir, True)


def kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class BubblewrapEnvironment(BaseEnvironment):
    """Harbor's BaseEnvironment over bubblewrap; one overlay per trial, removed when the trial stops.

    It takes hf-sandbox's own options (HFSandboxEnvironment's keyword arguments) and keeps the idle timeout as that
    class does, parsed by Harbor's own `_parse_idle_timeout`: the env server's idle-timeout patch (sandbox_lifecycle)
    hands every hf-sandbox trial `job_timeout`, and checks the timeout it would ask Sandbox.create for. Nothing here
    idles out: a bubblewrap sandbox lives as long as its trial.
    """

    def __init__(self, *args: Any, flavor: str = "cpu-basic", job_timeout: str | int | float | None = None,
                 forward_hf_token: bool = False, **kwargs: Any) -> None:
        from harbor.environments.hf_sandbox import _parse_idle_timeout

        self._idle_timeout = _parse_idle_timeout(job_timeout)
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> EnvironmentType:
        return EnvironmentType.HF_SANDBOX

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities()

    def _validate_definition(self) -> None:
        if not self.task_env_config.docker_image:
            raise ValueError("the sandbox needs a prebuilt image: set [environment].docker_image in task.toml")

    async def start(self, force_build: bool) -> None:
        trial = f"{self.environment_name} {self.session_id}"
        self._box = await Box.open(self.task_env_config.docker_image or "", trial)
        if workdir := self.task_env_config.workdir:
            self._path(workdir).mkdir(parents=True, exist_ok=True)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        if getattr(self, "_box", None) is not None:
            await self._box.close()
            self._box = None

    def _path(self, inside: str) -> Path:
        return self._box.path(inside)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        code, out, err = await self._box.run(command, cwd or self.task_env_config.workdir, self._merge_env(env),
                                             timeout_sec)
        return ExecResult(stdout=out, stderr=err, return_code=code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shutil.copy, source_path, target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await asyncio.to_thread(shutil.copytree, source_dir, self._path(target_dir), dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shutil.copy, self._path(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await asyncio.to_thread(shutil.copytree, self._path(source_dir), target_dir, dirs_exist_ok=True)
