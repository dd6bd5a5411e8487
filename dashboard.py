"""Where a run's metrics go: Trackio project and run names, the private dashboard Space, or (never failing the run)
local logs and one line saying so; no Space gets the job's token (docs/training.md, Dashboard). Imports nothing heavy:
launch.py runs it in its own small environment."""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import recipe

SPACE_URL = "https://huggingface.co/spaces/{}"
_SPACE_NOT_PREPARED = "could not prepare Space"  # trackio 0.43.0's warning when it logs locally instead
_JOB_HOST = re.compile(r"^(?:https?://)?([A-Za-z0-9-]+?)--\d+\.hf\.jobs")


def space(env: Mapping[str, str]) -> str | None:
    """The dashboard Space: a name (Trackio puts it under the token's owner) or owner/name; None logs locally only."""
    value = recipe.knob("DASHBOARD_SPACE", env)
    return None if value == recipe.NO_SPACE else value


def space_id(name: str, owner: str) -> str:
    return name if "/" in name else f"{owner}/{name}"


def project(adapter_repo: str) -> str:
    """One Trackio project per adapter repo (the smoke run's `-smoke` repo gets its own)."""
    return adapter_repo.split("/")[-1]


def job_id(env: Mapping[str, str]) -> str:
    """This job's id (JOB_ID, HF_JOB_ID, or the one in SPACE_HOST <id>--<port>.hf.jobs); a UTC time outside a job."""
    explicit = env.get("JOB_ID", "").strip() or env.get("HF_JOB_ID", "").strip()
    host = _JOB_HOST.match(env.get("SPACE_HOST", "").strip())
    return explicit or (host.group(1) if host else time.strftime("%Y%m%d-%H%M%S", time.gmtime()))


def run_name(kind: str, env: Mapping[str, str]) -> str:
    """`train-<job id>`, `eval-watch-<job id>`, `eval-<job id>`: a relaunched job is a new run in the same project."""
    return f"{kind}-{job_id(env)}"


def _redacted(text: str, env: Mapping[str, str]) -> str:
    token = env.get("HF_TOKEN", "").strip()
    return (text.replace(token, "<redacted>") if token else text)[:300]


@contextlib.contextmanager
def _no_token_in_the_space() -> Iterator[None]:
    """While Trackio may create the Space (deploy.py calls `huggingface_hub.add_space_*`): its HF_TOKEN secret (the
    job's write token) and its MCP server are dropped, every other secret and variable goes through."""
    import huggingface_hub

    real = {name: getattr(huggingface_hub, name) for name in ("add_space_secret", "add_space_variable")}

    def guarded(add: Callable[..., None]) -> Callable[..., None]:
        def call(repo_id: str, key: str, *args: Any, **kwargs: Any) -> None:
            if key not in ("HF_TOKEN", "GRADIO_MCP_SERVER"):
                add(repo_id, key, *args, **kwargs)
        return call

    try:
        for name, add in real.items():
            setattr(huggingface_hub, name, guarded(add))
        yield
    finally:
        for name, function in real.items():
            setattr(huggingface_hub, name, function)


def init_run(project_name: str, name: str, space_id: str | None, env: Mapping[str, str],
             config: dict[str, Any] | None = None) -> str | None:
    """Start the Trackio run on the private Space, or locally when there is none or it fails (trackio.init warns then,
    and does not raise); print one line saying which; return the Space URL, or None (no URL goes into the card)."""
    import trackio
    from trackio.utils import TRACKIO_DIR

    why = "no dashboard Space (DASHBOARD_SPACE=local)"
    try:
        with warnings.catch_warnings(record=True) as caught, _no_token_in_the_space():
            warnings.simplefilter("always")
            trackio.init(project=project_name, name=name, space_id=space_id, private=True, resume="allow",
                         config=config)
    except Exception as error:  # noqa: BLE001 - offline, no rights, Hub down: log locally, never fail the run
        why = f"Space {space_id} unavailable ({_redacted(f'{type(error).__name__}: {error}', env)}): no dashboard"
        trackio.init(project=project_name, name=name, resume="allow", config=config)
    else:
        refused = next((str(w.message) for w in caught if _SPACE_NOT_PREPARED in str(w.message)), None)
        for w in caught:
            if str(w.message) != refused:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        space = trackio.context_vars.current_space_id.get()
        if space_id and refused is None:
            print(f"dashboard: {SPACE_URL.format(space)} (project {project_name}, run {name})", flush=True)
            return SPACE_URL.format(space)
        if refused:
            reason = _redacted(refused.split(": ", 1)[-1].split(". Logging will continue")[0], env)
            why = (f"Trackio could not create Space {space} ({reason}; give HF_TOKEN the right to create it, or set "
                   "DASHBOARD_SPACE=local): no dashboard")
    print(f"dashboard: {why}: metrics are logged locally to {TRACKIO_DIR}, lost when the job ends unless copied "
          f"(project {project_name}, run {name}; view with `trackio show --project {project_name}`)", flush=True)
    return None


class EvalDashboard:
    """Eval points for the adapter repo's Trackio project (REPORT_TO=trackio: evals log to no other dashboard), started
    at the first; a failure is said once and never stops the eval."""

    def __init__(self, adapter_repo: str, kind: str, env: Mapping[str, str]) -> None:
        self.run, self.env = (project(adapter_repo), run_name(kind, env), space(env)), dict(env)
        self.state = "new" if recipe.knob("REPORT_TO", env) == "trackio" else "off"

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.state not in ("new", "started"):
            return
        try:
            import trackio

            if self.state == "new":
                init_run(*self.run, self.env)
                self.state = "started"
            trackio.log(metrics, step=step)
        except Exception as error:  # noqa: BLE001 - the eval's own results files are what matter
            self.state = "broken"
            print(f"dashboard: eval logging stopped ({type(error).__name__}: {_redacted(str(error), self.env)}); "
                  "results still go to the adapter repo", flush=True)

    def finish(self) -> None:
        if self.state == "started":
            import trackio

            trackio.finish()

