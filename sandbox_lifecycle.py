"""Sandbox lifecycle in production: each backend's sandbox lifetime, per-rollout setup timing, trial folder cleanup.

Lifetimes (env server side). OpenEnv 0.10.0 passes Harbor no environment kwargs (`build_trial_config`), and Harbor
0.25's defaults outlive or undercut a trial: an HF Sandbox idles out after 600 s (huggingface_hub 1.33 does not count
a running foreground command as activity, so an agent past 10 minutes loses it), a Daytona sandbox never stops
(`auto_stop_interval_mins=0`: one orphaned by a crashed env server bills until deleted by hand), an E2B one lives a
day. So `apply_idle_timeout()` wraps Harbor's `EnvironmentFactory.create_environment_from_config` in the env server's
process (seam_patch.py serve) to add `lifetime_kwargs(backend)` to every trial's `EnvironmentConfig.kwargs` (explicit
ones are kept; each trial's config.json records them): all bound a sandbox by recipe.SANDBOX_IDLE_TIMEOUT_S (the agent
timeout, the setup budget and a margin), and a stopped Daytona sandbox is deleted. E2B builds a template per task
(`{task}__{hash}`: 1,250 builds, the 8 rollouts of a group racing to build one); a prebuilt-image trial is pointed at
one template per image and resources instead (`template_name`), built once at a time per env server. Patched there,
not in OpenEnv: importing openenv.harbor.rollout takes seconds longer (gradio), and `seam_patch.py check` runs in
every job. `verify_lifetime(backend)` builds a trial's environment as Harbor does and says what it will ask for.

Timing and cleanup (trainer/eval side, after a rollout's trace is taken). `trial_timing(trial_dir)` reads Harbor's
own result file (TrialResult) and returns each setup part in seconds; `finish_trial(trial_dir, failed=...)` removes a
scored rollout's folder and keeps failed ones within recipe.FAILED_TRIALS_KEEP_MB.

Harbor and OpenEnv are imported inside the functions: the launcher's smoke_report imports this module for its key
names only.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import recipe

# Per-rollout parts, in the order a trial meets them; a part Harbor did not reach is absent from a timing.
TIMING_PARTS = ("sandbox_start_s", "healthcheck_s", "agent_setup_s", "agent_run_s", "verifier_s")
AGENT_PART = "agent_run_s"
# A rollout's setup: every part but the agent's own run (what ROLLOUT_SETUP_BUDGET_S budgets).
SETUP_KEY = "setup_s"
# Harbor's HFSandboxEnvironment constructor kwarg that becomes Sandbox.create(idle_timeout=...).
IDLE_KWARG = "job_timeout"
# Marks the wrapper so a second apply_idle_timeout() recognises it and changes nothing.
_PATCHED = "_idle_timeout_patched"


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


class LifecycleShapeError(RuntimeError):
    """The installed Harbor/OpenEnv/huggingface_hub are not the shape the idle-timeout patch was written against."""


def setup_seconds(timing: Mapping[str, float]) -> float | None:
    """The setup part of one rollout's timing (all parts but the agent's run), or None if it has none."""
    parts = [seconds for key, seconds in timing.items() if key != AGENT_PART]
    return sum(parts) if parts else None


# --- lifetimes: env server process ----------------------------------------------------------------------------------
def _check_shapes() -> None:
    """What the patch relies on, read off the installed packages; LifecycleShapeError otherwise."""
    import inspect

    from harbor.environments.factory import EnvironmentFactory, _load_environment_class
    from harbor.models.environment_type import EnvironmentType
    from huggingface_hub import Sandbox

    for sandbox in recipe.SANDBOXES:
        environment = _load_environment_class(EnvironmentType(sandbox))  # imports without the backend's SDK
        taken = inspect.signature(environment.__init__).parameters
        if missing := [kwarg for kwarg in lifetime_kwargs(sandbox) if kwarg not in taken]:
            raise LifecycleShapeError(f"harbor's {environment.__name__} no longer takes {missing[0]!r}: the lifetime "
                                      "patch needs updating for this harbor version")
        if sandbox == "e2b" and not all(callable(getattr(environment, name, None)) for name in _E2B_TEMPLATE):
            raise LifecycleShapeError(f"harbor's {environment.__name__} has no {' or '.join(_E2B_TEMPLATE)}: the "
                                      "shared-template patch needs updating for this harbor version")
    if "idle_timeout" not in inspect.signature(Sandbox.create).parameters:
        raise LifecycleShapeError("huggingface_hub's Sandbox.create no longer takes idle_timeout: the idle-timeout "
                                  "patch needs updating for this huggingface_hub version")
    if "config" not in inspect.signature(EnvironmentFactory.create_environment_from_config).parameters:
        raise LifecycleShapeError("harbor's EnvironmentFactory.create_environment_from_config no longer takes the "
                                  "trial's environment config: the lifetime patch needs updating")


# Harbor's E2BEnvironment.start(): `if force_build or not await self._does_template_exist(): self._create_template()`.
_E2B_TEMPLATE = ("_does_template_exist", "_create_template")
# (event loop, template) -> the lock its check-and-build holds: the env server runs every rollout on one loop.
_TEMPLATE_LOCKS: dict[tuple[int, str], asyncio.Lock] = {}
_TEMPLATES_READY: set[str] = set()


def _share_template(environment: Any) -> None:
    """Point a prebuilt-image E2B trial at its image's template, checked (and built if missing) under one lock per
    template: E2B's alias exists as soon as a build starts, so a rollout that only checked would create its sandbox
    from a template still building."""
    config = environment.task_env_config
    name = template_name(config.docker_image, environment._effective_cpus, environment._effective_memory_mb)
    environment._template_name = name
    exists, build = (getattr(environment, attribute) for attribute in _E2B_TEMPLATE)

    async def ready() -> bool:
        lock = _TEMPLATE_LOCKS.setdefault((id(asyncio.get_running_loop()), name), asyncio.Lock())
        async with lock:
            if name not in _TEMPLATES_READY and not await exists():
                await build()
            _TEMPLATES_READY.add(name)
        return True

    environment._does_template_exist = ready


def _with_idle_timeout(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Harbor's environment factory so a trial's config carries its backend's lifetime (lifetime_kwargs)."""
    from harbor.models.environment_type import EnvironmentType

    @functools.wraps(original)
    def create_environment_from_config(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        sandbox = config.type.value if config.type is not None and config.import_path is None else None
        if sandbox in recipe.SANDBOXES:
            # On the trial's own config, so its config.json (written after this) records what was asked for.
            config.kwargs = {**lifetime_kwargs(sandbox), **config.kwargs}
        environment = original(config, *args, **kwargs)
        if config.type == EnvironmentType.E2B and sandbox and environment.task_env_config.docker_image:
            _share_template(environment)
        return environment

    setattr(create_environment_from_config, _PATCHED, True)
    return create_environment_from_config


def verify_lifetime(sandbox: str = recipe.SANDBOX) -> str:
    """Build a `sandbox` environment through Harbor's factory as a trial does (nothing starts) and say what its start
    will ask the backend for; LifecycleShapeError if that is not the recipe's lifetime (the patch is not in effect).
    Daytona and E2B need their SDK installed here (the job's install step adds it)."""
    import tempfile

    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig
    from harbor.models.trial.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    with tempfile.TemporaryDirectory() as probe:
        try:
            environment = EnvironmentFactory.create_environment_from_config(
                config=EnvironmentConfig(type=EnvironmentType(sandbox)), environment_dir=Path(probe),
                environment_name="probe", session_id="probe__env", trial_paths=TrialPaths(Path(probe)),
                task_env_config=TaskEnvironmentConfig(docker_image=recipe.TASK_IMAGE, cpus=recipe.TASK_CPUS,
                                                      memory_mb=recipe.TASK_MEMORY_MB))
        except ImportError as error:  # Harbor's MissingExtraError: the backend's SDK is not installed
            raise LifecycleShapeError(f"SANDBOX={sandbox} needs its SDK ({str(error).splitlines()[0]}): pip install -r "
                                      f"{recipe.SANDBOXES[sandbox]['requirements']}") from None
    asked = {"hf-sandbox": lambda: {IDLE_KWARG: environment._idle_timeout},
             "daytona": lambda: {"auto_stop_interval_mins": environment._auto_stop_interval,
                                 "auto_delete_interval_mins": environment._auto_delete_interval},
             "e2b": lambda: {"sandbox_timeout_secs": environment._sandbox_timeout}}[sandbox]()
    if asked != lifetime_kwargs(sandbox):
        raise LifecycleShapeError(f"a {sandbox} trial would ask for {asked}, not {lifetime_kwargs(sandbox)}: the "
                                  "lifetime patch is not in effect")
    if sandbox == "daytona":
        return (f"{sandbox} trials ask for auto_stop_interval={asked['auto_stop_interval_mins']} min and "
                "auto_delete_interval=0 (deleted once stopped)")
    if sandbox == "e2b":
        if environment._template_name != template_name(recipe.TASK_IMAGE, recipe.TASK_CPUS, recipe.TASK_MEMORY_MB):
            raise LifecycleShapeError(f"an e2b trial would build template {environment._template_name}, one per task: "
                                      "the shared-template patch is not in effect")
        return (f"{sandbox} trials ask for timeout={asked['sandbox_timeout_secs']} s; every task of "
                f"{recipe.TASK_IMAGE} uses template {environment._template_name}")
    return f"{sandbox} trials ask for idle_timeout={asked[IDLE_KWARG]} s"


def apply_idle_timeout() -> bool:
    """Patch this process's Harbor so every trial gets its backend's lifetime; False if already done."""
    from harbor.environments.factory import EnvironmentFactory

    if getattr(EnvironmentFactory.create_environment_from_config, _PATCHED, False):
        return False
    _check_shapes()
    original = EnvironmentFactory.create_environment_from_config  # bound to the class
    EnvironmentFactory.create_environment_from_config = classmethod(_with_idle_timeout(original))
    verify_lifetime("hf-sandbox")  # the one backend whose SDK every install has
    return True


# --- timing and cleanup: client side, after the trace is taken ------------------------------------------------------
def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 3)


def trial_timing(trial_dir: Path) -> dict[str, float]:
    """Seconds per part of one Harbor trial, from its result file; {} if Harbor wrote none (or it is unreadable).

    Harbor 0.25 times environment setup (the sandbox start), agent setup (OpenCode's install), agent execution and
    the verifier; the healthcheck (the task's data pull) runs between environment setup and agent setup, so it is
    that gap -- or, when the healthcheck itself failed, the time to the failure. One line per rollout goes to stderr:
    TRL's rollout child is a spawned process without logging set up, and its stderr reaches the job's log.
    """
    from harbor.environments.base import HealthcheckError
    from harbor.models.trial.paths import TrialPaths
    from harbor.models.trial.result import TrialResult
    from pydantic import ValidationError

    path = TrialPaths(Path(trial_dir)).result_path
    try:
        result = TrialResult.model_validate_json(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValidationError) as error:
        print(f"sandbox_lifecycle: {path} is not a Harbor trial result, no timing: {error}", file=sys.stderr,
              flush=True)
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
    try:
        for path in folder.rglob("*"):
            try:
                info = path.lstat()
            except OSError:
                continue
            total += 0 if stat.S_ISDIR(info.st_mode) else info.st_size
    except OSError:
        pass
    return total


def _finished_newest_first(trials: Path) -> list[Path]:
    """Trial folders under `trials` whose result file Harbor has written, the newest result first."""
    from harbor.models.trial.paths import TrialPaths

    dated = []
    for folder in trials.iterdir() if trials.is_dir() else ():
        try:
            dated.append((TrialPaths(folder).result_path.stat().st_mtime, folder))
        except OSError:  # not a folder, still running, or removed meanwhile
            continue
    return [folder for _mtime, folder in sorted(dated, reverse=True)]


REDACTED = "<capture session key redacted>"


def _redact(folder: Path, secret: str) -> None:
    """Replace `secret` in every file under `folder` (Harbor writes the rollout's capture session key, OpenCode's API
    key, into config.json, result.json and lock.json): it is dead once the rollout ends, but a kept folder is shared."""
    for path in folder.rglob("*") if secret else ():
        try:
            if path.is_file() and not path.is_symlink() and secret.encode() in (data := path.read_bytes()):
                path.write_bytes(data.replace(secret.encode(), REDACTED.encode()))
        except OSError:
            continue


# Rollouts finish on several threads of TRL's rollout child; one prune at a time.
_PRUNE_LOCK = threading.Lock()


def finish_trial(trial_dir: Path, *, failed: bool, session_key: str = "") -> None:
    """Call once a rollout's trace and timing are taken: a scored rollout's trial folder is removed; a failed one's
    is kept, its `session_key` redacted, and the finished trials next to it are pruned to
    recipe.FAILED_TRIALS_KEEP_MB, newest kept first.

    Finished means Harbor wrote the trial's result file, so a trial still running is never touched; the prune also
    takes the folders of rollouts whose call was lost (their client never learnt the trial's name). A folder that is
    not a trial's (missing, or no config.json) changes nothing.
    """
    from harbor.models.trial.paths import TrialPaths

    trial_dir = Path(trial_dir)
    # Only a folder Harbor started a trial in (its config.json): `trials_dir / ""` is the whole trials folder.
    if not TrialPaths(trial_dir).config_path.is_file():
        return
    if not failed:
        shutil.rmtree(trial_dir, ignore_errors=True)
        return
    _redact(trial_dir, session_key)
    budget, kept = recipe.FAILED_TRIALS_KEEP_MB * 2**20, 0
    with _PRUNE_LOCK:
        for folder in _finished_newest_first(trial_dir.parent):
            size = _size_bytes(folder)
            if kept + size > budget:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                kept += size
