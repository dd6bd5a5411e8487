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
sandbox fail to start, or lays extra layers over its image (an image that differs from the one built).
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
# This machine reaches the package registries only, where a real sandbox has the internet: OpenCode is kept from the
# network calls it would otherwise wait on (models.dev, its own updates, share links, LSP downloads).
OFFLINE = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1",
           "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"}


def images() -> dict[str, list[str]]:
    return json.loads(os.environ.get("CHAIN_IMAGES", "{}"))


def faults(trial: str) -> dict[str, object]:
    path = Path(os.environ.get("CHAIN_FAULTS_FILE", "/nonexistent"))
    table = json.loads(path.read_text()) if path.is_file() else {}
    return next((fault for task, fault in table.items() if task in trial), {})


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
        image = self.task_env_config.docker_image or ""
        layers = images().get(image)
        if not layers:
            raise RuntimeError(f"sandbox image {image!r} not found (this machine has {sorted(images())})")
        fault = faults(f"{self.environment_name} {self.session_id}")
        if "start" in fault:
            raise RuntimeError(f"sandbox failed to start: {fault['start']}")
        layers = [*fault.get("layers", []), *layers]
        base = Path(os.environ.get("CHAIN_SANDBOX_DIR") or tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.session_id[:40]}-", dir=base))
        self._root = self._dir / "merged"
        for name in ("upper", "work", "merged"):
            (self._dir / name).mkdir()
        options = f"lowerdir={':'.join(layers)},upperdir={self._dir / 'upper'},workdir={self._dir / 'work'}"
        await asyncio.to_thread(subprocess.run, ["mount", "-t", "overlay", "overlay", "-o", options, str(self._root)],
                                check=True, capture_output=True)
        if workdir := self.task_env_config.workdir:
            self._path(workdir).mkdir(parents=True, exist_ok=True)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        folder = getattr(self, "_dir", None)
        if folder is None:
            return
        await asyncio.to_thread(subprocess.run, ["umount", "-l", str(self._root)], capture_output=True)
        await asyncio.to_thread(shutil.rmtree, folder, True)
        self._dir = None

    def _path(self, inside: str) -> Path:
        return self._root / inside.lstrip("/")

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        variables = {"PATH": PATH, "HOME": "/root", **OFFLINE}
        if os.environ.get("CHAIN_HF_ENDPOINT"):
            variables["HF_ENDPOINT"] = os.environ["CHAIN_HF_ENDPOINT"]
        variables.update(self._merge_env(env) or {})
        argv = ["bwrap", "--bind", str(self._root), "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--clearenv",
                "--chdir", cwd or self.task_env_config.workdir or "/"]
        for key, value in variables.items():
            argv += ["--setenv", key, str(value)]
        proc = await asyncio.create_subprocess_exec(*argv, "/bin/bash", "-c", command, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except BaseException:  # a timeout, or Harbor cancelling the agent at its timeout: nothing may outlive it
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                          return_code=proc.returncode)

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
