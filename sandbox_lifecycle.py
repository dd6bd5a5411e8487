"""Sandbox lifecycle in production: the HF Sandbox idle timeout, per-rollout setup timing, and trial folder cleanup.

Idle timeout (env server side). Harbor 0.25's `HFSandboxEnvironment` turns its `job_timeout` constructor kwarg into
huggingface_hub's `Sandbox.create(idle_timeout=...)`, 600 s when unset; huggingface_hub 1.33 does not count a running
foreground command as activity, so an agent running past 10 minutes could lose its sandbox. OpenEnv 0.10.0 passes
Harbor no environment kwargs (`openenv.harbor.rollout.build_trial_config`), so `apply_idle_timeout()` wraps Harbor's
`EnvironmentFactory.create_environment_from_config` in the env server's process (seam_patch.py serve) to add
`job_timeout=recipe.SANDBOX_IDLE_TIMEOUT_S` to every hf-sandbox trial's `EnvironmentConfig.kwargs` (an explicit one
is kept); each trial's config.json records it. Patched there, not in OpenEnv: importing openenv.harbor.rollout takes
seconds longer (gradio), and `seam_patch.py check` runs in every job.

Timing and cleanup (trainer/eval side, after a rollout's trace is taken). `trial_timing(trial_dir)` reads Harbor's
own result file (TrialResult) and returns each setup part in seconds; `finish_trial(trial_dir, failed=...)` removes a
scored rollout's folder and keeps failed ones within recipe.FAILED_TRIALS_KEEP_MB.

Harbor and OpenEnv are imported inside the functions: the launcher's smoke_report imports this module for its key
names only.
"""

from __future__ import annotations

import functools
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


class LifecycleShapeError(RuntimeError):
    """The installed Harbor/OpenEnv/huggingface_hub are not the shape the idle-timeout patch was written against."""


def setup_seconds(timing: Mapping[str, float]) -> float | None:
    """The setup part of one rollout's timing (all parts but the agent's run), or None if it has none."""
    parts = [seconds for key, seconds in timing.items() if key != AGENT_PART]
    return sum(parts) if parts else None


# --- idle timeout: env server process ------------------------------------------------------------------------------
def _check_shapes() -> None:
    """What the patch relies on, read off the installed packages; LifecycleShapeError otherwise."""
    import inspect

    from harbor.environments import hf_sandbox
    from harbor.environments.factory import EnvironmentFactory
    from huggingface_hub import Sandbox

    if IDLE_KWARG not in inspect.signature(hf_sandbox.HFSandboxEnvironment.__init__).parameters:
        raise LifecycleShapeError(f"harbor's HFSandboxEnvironment no longer takes {IDLE_KWARG!r}: the idle-timeout "
                                  "patch needs updating for this harbor version")
    if "idle_timeout" not in inspect.signature(Sandbox.create).parameters:
        raise LifecycleShapeError("huggingface_hub's Sandbox.create no longer takes idle_timeout: the idle-timeout "
                                  "patch needs updating for this huggingface_hub version")
    if "config" not in inspect.signature(EnvironmentFactory.create_environment_from_config).parameters:
        raise LifecycleShapeError("harbor's EnvironmentFactory.create_environment_from_config no longer takes the "
                                  "trial's environment config: the idle-timeout patch needs updating")


def _with_idle_timeout(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Harbor's environment factory so an hf-sandbox trial's config carries the recipe's idle timeout."""
    from harbor.models.environment_type import EnvironmentType

    @functools.wraps(original)
    def create_environment_from_config(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if config.type == EnvironmentType.HF_SANDBOX and IDLE_KWARG not in config.kwargs:
            # On the trial's own config, so its config.json (written after this) records what was asked for.
            config.kwargs = {**config.kwargs, IDLE_KWARG: recipe.SANDBOX_IDLE_TIMEOUT_S}
        return original(config, *args, **kwargs)

    setattr(create_environment_from_config, _PATCHED, True)
    return create_environment_from_config


def verify_idle_timeout() -> int:
    """Build an hf-sandbox environment through Harbor's factory as a trial does (nothing starts); return the idle
    timeout its start() will pass to Sandbox.create, or LifecycleShapeError if it is not the recipe's."""
    import tempfile

    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig
    from harbor.models.trial.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    with tempfile.TemporaryDirectory() as probe:
        environment = EnvironmentFactory.create_environment_from_config(
            config=EnvironmentConfig(type=EnvironmentType.HF_SANDBOX), environment_dir=Path(probe),
            environment_name="probe", session_id="probe__env", trial_paths=TrialPaths(Path(probe)),
            task_env_config=TaskEnvironmentConfig(docker_image=recipe.TASK_IMAGE))
    seconds = getattr(environment, "_idle_timeout", None)
    if seconds != recipe.SANDBOX_IDLE_TIMEOUT_S:
        raise LifecycleShapeError(f"an {EnvironmentType.HF_SANDBOX.value} trial would ask for idle_timeout={seconds}, "
                                  f"not {recipe.SANDBOX_IDLE_TIMEOUT_S} s: the idle-timeout patch is not in effect")
    return seconds


def apply_idle_timeout() -> bool:
    """Patch this process's Harbor so every hf-sandbox trial gets the recipe's idle timeout; False if already done."""
    from harbor.environments.factory import EnvironmentFactory

    if getattr(EnvironmentFactory.create_environment_from_config, _PATCHED, False):
        return False
    _check_shapes()
    original = EnvironmentFactory.create_environment_from_config  # bound to the class
    EnvironmentFactory.create_environment_from_config = classmethod(_with_idle_timeout(original))
    verify_idle_timeout()
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
