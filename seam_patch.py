"""The env server's in-process patches, applied before it starts: OpenCode also sends its capture session as
`x-api-key` (the HF Jobs proxy strips `Authorization`), every trial gets its backend's sandbox lifetime
(sandbox_lifecycle), daytona/e2b pass Harbor's own preflight, and each rollout's result counts its model calls that
failed at the engine (openenv 0.10 leaves them out: recipe.UPSTREAM_FINDING). No installed file is edited.

    python3 seam_patch.py check                                  # apply + verify, one line each
    python3 seam_patch.py serve -- harbor serve --llm-url ...    # apply, verify, run `openenv ...`
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from openenv.harbor import seams

import recipe
import sandbox_lifecycle

HARNESS = "opencode"
HEADER = "x-api-key"
_PATCHED = "_x_api_key_patched"  # marks a wrapper: a second apply changes nothing


class SeamShapeError(RuntimeError):
    """The installed openenv's opencode seam is not the shape this patch was written against."""


def _provider_options(config: dict[str, Any]) -> dict[str, Any]:
    try:
        return config["opencode_config"]["provider"][seams.OPENCODE_PROVIDER]["options"]
    except (KeyError, TypeError):
        raise SeamShapeError(f"openenv's {HARNESS} seam no longer returns opencode_config.provider."
                             f"{seams.OPENCODE_PROVIDER}.options: the x-api-key patch needs updating") from None


def _with_header(original: Any) -> Any:
    """Wrap the seam's kwargs builder so its provider options also carry the session as x-api-key."""

    def kwargs(base_url: str, session: str, model: str) -> dict[str, Any]:
        config = original(base_url, session, model)
        options = _provider_options(config)
        options["headers"] = {**(options.get("headers") or {}), HEADER: session}
        return config

    setattr(kwargs, _PATCHED, True)
    return kwargs


def apply() -> bool:
    """Patch the opencode seam in this process and resolve it as a rollout does; False if already done."""
    seam = seams.SEAMS.get(HARNESS)
    if seam is None:
        raise SeamShapeError(f"openenv.harbor.seams has no {HARNESS!r} seam; cannot patch it")
    if getattr(seam.kwargs, _PATCHED, False):
        return False
    seams.SEAMS[HARNESS] = replace(seam, kwargs=_with_header(seam.kwargs))
    probe = "probe-session"
    _model, kwargs, _agent_env, _proc_env = seams.get(HARNESS).resolve(
        base_url="https://example.invalid/capture", session=probe, model="org/model")
    options = _provider_options(kwargs)
    if options.get("apiKey") != probe or options["headers"].get(HEADER) != probe:
        raise SeamShapeError(f"the {HARNESS} seam does not carry the session as both apiKey and {HEADER}")
    return True


def _with_upstream_errors(export: Any) -> Any:
    """Wrap the export run_rollout takes a finished rollout's capture with, so its findings (which run_rollout copies
    into the result) also say how many of its model calls failed at the engine."""

    def export_session(session: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        document = export(session, *args, **kwargs)
        if errors := int(getattr(session, "upstream_errors", 0)):
            note = f"{recipe.UPSTREAM_FINDING}{errors} model call(s) failed at the engine"
            document["validation"] = [*document.get("validation", []), note]
        return document

    setattr(export_session, _PATCHED, True)
    return export_session


def apply_upstream_report() -> bool:
    """Patch openenv.harbor.rollout's export_session in this process; False if already done."""
    from openenv.harbor import rollout

    if getattr(rollout.export_session, _PATCHED, False):
        return False
    rollout.export_session = _with_upstream_errors(rollout.export_session)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["check", "serve"])
    parser.add_argument("openenv_args", nargs=argparse.REMAINDER, help="after `--`: arguments for `openenv`")
    args = parser.parse_args(argv)
    try:
        sandbox = recipe.knob("SANDBOX")
        apply()
        sandbox_lifecycle.apply_idle_timeout()
        if sandbox != recipe.SANDBOX:  # hf-sandbox's HF_TOKEN is the job's own first check
            from harbor.environments.factory import EnvironmentFactory
            from harbor.models.environment_type import EnvironmentType

            EnvironmentFactory.run_preflight(EnvironmentType(sandbox))  # SystemExit with Harbor's line
        lifetime = sandbox_lifecycle.verify_lifetime(sandbox)
        apply_upstream_report()
    except (SeamShapeError, sandbox_lifecycle.LifecycleShapeError, recipe.ConfigError) as exc:
        sys.exit(f"seam_patch: {exc}")
    except SystemExit as exc:
        sys.exit(f"seam_patch: Harbor's {sandbox} preflight: {exc.code}")
    print(f"seam_patch: {HARNESS} seam sends the capture session as apiKey and {HEADER}", flush=True)
    print(f"seam_patch: {lifetime}", flush=True)
    print("seam_patch: each rollout's result counts its model calls that failed at the engine", flush=True)
    if args.action == "serve":
        rest = args.openenv_args[1:] if args.openenv_args[:1] == ["--"] else args.openenv_args
        from openenv.cli.__main__ import main as openenv_main

        sys.argv = ["openenv", *rest]
        openenv_main()


if __name__ == "__main__":
    main()
