"""Each backend's sandbox lifetime and the shared E2B template (patched into the env server's Harbor by seam_patch.py),
each rollout's setup timing and its trial folder's cleanup (docs/sandboxes.md). Harbor is imported inside the
functions: smoke_report imports this module for its key names.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import re
import shutil
import sys
import threading
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import recipe

# Per-rollout parts, in the order a trial meets them; a part Harbor did not reach is absent from a timing.
TIMING_PARTS = ("sandbox_start_s", "healthcheck_s", "agent_setup_s", "agent_run_s", "verifier_s")
AGENT_PART = "agent_run_s"
SETUP_KEY = "setup_s"  # every part but the agent's own run: what ROLLOUT_SETUP_BUDGET_S budgets
IDLE_KWARG = "job_timeout"  # HFSandboxEnvironment's kwarg that becomes Sandbox.create(idle_timeout=...)
# Where each lifetime kwarg lands on Harbor's environment (what verify_lifetime reads back).
_LANDS_IN = {IDLE_KWARG: "_idle_timeout", "auto_stop_interval_mins": "_auto_stop_interval",
             "auto_delete_interval_mins": "_auto_delete_interval", "sandbox_timeout_secs": "_sandbox_timeout"}
_PATCHED = "_idle_timeout_patched"  # marks the wrapper: a second apply_idle_timeout() changes nothing


def lifetime_kwargs(sandbox: str) -> dict[str, int]:
    """Harbor's constructor kwargs that bound one trial's sandbox on `sandbox` (a recipe.SANDBOXES name)."""
    seconds = recipe.SANDBOX_IDLE_TIMEOUT_S
    return {"hf-sandbox": {IDLE_KWARG: seconds},  # -> Sandbox.create(idle_timeout=...)
            # -> CreateSandboxFrom*Params(auto_stop_interval=..., auto_delete_interval=0: deleted once stopped)
            "daytona": {"auto_stop_interval_mins": -(-seconds // 60), "auto_delete_interval_mins": 0},
            "e2b": {"sandbox_timeout_secs": seconds}}[sandbox]  # -> AsyncSandbox.create(timeout=...)


def template_name(image: str, cpus: float | None, memory_mb: int | None) -> str:
    """The E2B template alias of a prebuilt image at given resources: all a template is built from (Harbor builds
    `Template().from_image(image)` with them), so every task of the image can share it."""
    readable = re.sub(r"[^a-z0-9]+", "-", f"{image.rsplit('/', 1)[-1]}-{cpus}cpu-{memory_mb}mb".lower()).strip("-")
    return f"{readable[:48]}-{hashlib.sha256(f'{image}|{cpus}|{memory_mb}'.encode()).hexdigest()[:10]}"


class ShapeError(RuntimeError):
    """The installed Harbor or openenv is not the shape the env server's patches (here, seam_patch) were written for."""


def setup_seconds(timing: Mapping[str, float]) -> float | None:
    """The setup part of one rollout's timing (all parts but the agent's run), or None if it has none."""
    parts = [seconds for key, seconds in timing.items() if key != AGENT_PART]
    return sum(parts) if parts else None


# --- lifetimes: env server process ----------------------------------------------------------------------------------
# (event loop, template) -> the lock its check-and-build holds: the env server runs every rollout on one loop.
_TEMPLATE_LOCKS: dict[tuple[int, str], asyncio.Lock] = {}
_TEMPLATES_READY: set[str] = set()


def _share_template(environment: Any) -> None:
    """Point a prebuilt-image E2B trial at its image's template, checked and built under one lock per template: an
    alias exists once its build starts, so a rollout that only checked would start from a template still building."""
    config = environment.task_env_config
    name = template_name(config.docker_image, environment._effective_cpus, environment._effective_memory_mb)
    environment._template_name = name
    # Harbor's E2BEnvironment.start(): `if force_build or not await self._does_template_exist(): _create_template()`.
    exists, build = environment._does_template_exist, environment._create_template

    async def ready() -> bool:
        lock = _TEMPLATE_LOCKS.setdefault((id(asyncio.get_running_loop()), name), asyncio.Lock())
        async with lock:
            if name not in _TEMPLATES_READY and not await exists():
                await build()
            _TEMPLATES_READY.add(name)
        return True

    environment._does_template_exist = ready


def verify_lifetime(sandbox: str = recipe.SANDBOX) -> str:
    """Harbor's preflight for `sandbox` (SystemExit), then what a trial built through Harbor's factory (nothing starts)
    will ask the backend for; ShapeError if that is not the recipe's lifetime, or Harbor changed shape."""
    import tempfile

    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig
    from harbor.models.trial.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    if sandbox != recipe.SANDBOX:  # hf-sandbox's HF_TOKEN is the job's own first check
        EnvironmentFactory.run_preflight(EnvironmentType(sandbox))
    with tempfile.TemporaryDirectory() as probe:
        try:
            environment = EnvironmentFactory.create_environment_from_config(
                config=EnvironmentConfig(type=EnvironmentType(sandbox)), environment_dir=Path(probe),
                environment_name="probe", session_id="probe__env", trial_paths=TrialPaths(Path(probe)),
                task_env_config=TaskEnvironmentConfig(docker_image=recipe.TASK_IMAGE, cpus=recipe.TASK_CPUS,
                                                      memory_mb=recipe.TASK_MEMORY_MB))
            asked = {kwarg: getattr(environment, _LANDS_IN[kwarg]) for kwarg in lifetime_kwargs(sandbox)}
        except (AttributeError, TypeError) as error:
            raise ShapeError(f"harbor's {sandbox} environment changed shape ({error}): the lifetime patch "
                             "needs updating for this harbor version") from None
    if asked != lifetime_kwargs(sandbox):
        raise ShapeError(f"a {sandbox} trial would ask for {asked}, not {lifetime_kwargs(sandbox)}: the "
                         "lifetime patch is not in effect")
    if sandbox == "daytona":
        return (f"{sandbox} trials ask for auto_stop_interval={asked['auto_stop_interval_mins']} min and "
                "auto_delete_interval=0 (deleted once stopped)")
    if sandbox == "e2b":
        return (f"{sandbox} trials ask for timeout={asked['sandbox_timeout_secs']} s; every task of "
                f"{recipe.TASK_IMAGE} uses template {environment._template_name}")
    return f"{sandbox} trials ask for idle_timeout={asked[IDLE_KWARG]} s"


def apply_idle_timeout() -> bool:
    """Patch this process's Harbor environment factory so every trial's config carries its backend's lifetime
    (lifetime_kwargs) and a prebuilt-image E2B trial shares its template; False if already done."""
    from harbor.environments.factory import EnvironmentFactory

    original = EnvironmentFactory.create_environment_from_config  # bound to the class
    if getattr(original, _PATCHED, False):
        return False

    @functools.wraps(original)
    def create_environment_from_config(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        sandbox = config.type.value if config.type is not None and config.import_path is None else None
        if sandbox in recipe.SANDBOXES:
            # On the trial's own config: its config.json, written after this, records what was asked for.
            config.kwargs = {**lifetime_kwargs(sandbox), **config.kwargs}
        environment = original(config, *args, **kwargs)
        if sandbox == "e2b" and environment.task_env_config.docker_image:
            _share_template(environment)
        return environment

    setattr(create_environment_from_config, _PATCHED, True)
    EnvironmentFactory.create_environment_from_config = classmethod(create_environment_from_config)
    return True


# --- timing and cleanup: client side, after the trace is taken ------------------------------------------------------
def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 3)


def trial_timing(trial_dir: Path) -> dict[str, float]:
    """Seconds per part of one Harbor trial from its result file ({} without one), also said on stderr (TRL's rollout
    child has no logging). Harbor does not time the healthcheck: it is the gap before agent setup, or to its failure."""
    from harbor.environments.base import HealthcheckError
    from harbor.models.trial.paths import TrialPaths
    from harbor.models.trial.result import TrialResult
    from pydantic import ValidationError

    path = TrialPaths(Path(trial_dir)).result_path
    try:
        result = TrialResult.model_validate_json(path.read_text())
    except (OSError, ValidationError) as error:  # a trial Harbor wrote no result for, or an unreadable one
        print(f"sandbox_lifecycle: no timing from {path}: {error}", file=sys.stderr, flush=True)
        return {}
    environment, agent_setup = result.environment_setup, result.agent_setup
    spans: dict[str, float | None] = {}
    if environment is not None:
        spans["sandbox_start_s"] = _seconds(environment.started_at, environment.finished_at)
        if agent_setup is not None:
            spans["healthcheck_s"] = _seconds(environment.finished_at, agent_setup.started_at)
        elif result.exception_info is not None and result.exception_info.exception_type == HealthcheckError.__name__:
            spans["healthcheck_s"] = _seconds(environment.finished_at, result.exception_info.occurred_at)
    for key, span in (("agent_setup_s", agent_setup), ("agent_run_s", result.agent_execution),
                      ("verifier_s", result.verifier)):
        if span is not None:
            spans[key] = _seconds(span.started_at, span.finished_at)
    timing = {key: spans[key] for key in TIMING_PARTS if spans.get(key) is not None}
    parts = " ".join(f"{key}={seconds:g}" for key, seconds in timing.items())
    print(f"sandbox_lifecycle: trial {result.trial_name}: {parts or 'no part reached'}", file=sys.stderr, flush=True)
    return timing


def _size_bytes(folder: Path) -> int:
    """Bytes of the files under `folder`; files removed meanwhile (another rollout's cleanup) count as nothing."""
    total = 0
    for root, _folders, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


REDACTED = "<capture session key redacted>"
_PRUNE_LOCK = threading.Lock()  # rollouts finish on several threads of TRL's rollout child: one prune at a time


def _redact(folder: Path, secret: str) -> None:
    """Replace `secret` in every file under `folder` (Harbor writes the rollout's capture session key, OpenCode's API
    key, into config.json, result.json and lock.json): it is dead once the rollout ends, but a kept folder is shared."""
    for path in folder.rglob("*") if secret else ():
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink() and secret.encode() in (data := path.read_bytes()):
                path.write_bytes(data.replace(secret.encode(), REDACTED.encode()))


def finish_trial(trial_dir: Path, *, failed: bool, session_key: str = "") -> None:
    """Once a rollout's trace and timing are taken: remove a scored one's trial folder; keep a failed one's, redacted,
    and prune the finished trials beside it (never a running one) to recipe.FAILED_TRIALS_KEEP_MB, newest first."""
    from harbor.models.trial.paths import TrialPaths

    paths = TrialPaths(Path(trial_dir))
    # Only a folder Harbor started a trial in (its config.json): `trials_dir / ""` is the whole trials folder.
    if not paths.config_path.is_file():
        return
    if not failed:
        shutil.rmtree(paths.trial_dir, ignore_errors=True)
        return
    _redact(paths.trial_dir, session_key)
    budget, kept, finished = recipe.FAILED_TRIALS_KEEP_MB * 2**20, 0, []
    with _PRUNE_LOCK:
        for result in paths.trial_dir.parent.glob(f"*/{paths.result_path.name}"):  # never a running trial's folder
            with contextlib.suppress(OSError):  # removed meanwhile by another rollout's cleanup
                finished.append((result.stat().st_mtime, result.parent))
        for _mtime, folder in sorted(finished, reverse=True):
            size = _size_bytes(folder)
            if kept + size > budget:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                kept += size
