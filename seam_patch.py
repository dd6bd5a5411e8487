"""The env server's in-process patches (no installed file is edited): OpenCode also sends its capture session as
`x-api-key` (the HF Jobs proxy strips `Authorization`), an eval's OpenCode gets the training rollouts' tools (openenv
turns off delegation, questions and web fetch for training only: an eval scored a prompt training never saw), each
trial gets its backend's sandbox lifetime and Harbor's preflight (sandbox_lifecycle), each rollout's result counts
its model calls that failed at the engine.

    python3 seam_patch.py check                                  # patch and check, one line each
    python3 seam_patch.py serve -- harbor serve --llm-url ...    # the same, then run `openenv ...`
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from openenv.harbor import seams

import recipe
import sandbox_lifecycle
from sandbox_lifecycle import ShapeError

HARNESS = "opencode"
HEADER = "x-api-key"
_PATCHED = "_x_api_key_patched"  # marks a wrapper: a second apply changes nothing


def _patched(seam: seams.Seam) -> Any:
    """Wrap the seam's kwargs builder: provider options also carry the session as x-api-key, tools are training's."""
    original, tools = seam.kwargs, seam.training_kwargs["opencode_config"]["tools"]

    def kwargs(base_url: str, session: str, model: str) -> dict[str, Any]:
        config = original(base_url, session, model)
        options = config["opencode_config"]["provider"][seams.OPENCODE_PROVIDER]["options"]
        options["headers"] = {**(options.get("headers") or {}), HEADER: session}
        config["opencode_config"]["tools"] = {**config["opencode_config"].get("tools", {}), **tools}
        return config

    setattr(kwargs, _PATCHED, True)
    return kwargs


def _with_upstream_errors(export: Any) -> Any:
    """Wrap run_rollout's capture export so a rollout's findings also count its calls that failed at the engine."""

    def export_session(session: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        document = export(session, *args, **kwargs)
        if errors := int(getattr(session, "upstream_errors", 0)):
            note = f"{recipe.UPSTREAM_FINDING}{errors} model call(s) failed at the engine"
            document["validation"] = [*document.get("validation", []), note]
        return document

    setattr(export_session, _PATCHED, True)
    return export_session


def calls_export_session(source: str) -> bool:
    """Whether a rollout module imports or defines `export_session` at its top and calls it by that name: then what
    `serve` wraps is what run_rollout calls."""
    tree = ast.parse(source)
    bound = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    bound |= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    return "export_session" in bound and any(
        isinstance(node, ast.Call) and getattr(node.func, "id", None) == "export_session" for node in ast.walk(tree))


def wrap_export(action: str) -> None:
    """`serve`: wrap run_rollout's capture export. `check` reads the module instead: importing it imports openenv.core
    and gradio (4 of 5 CPU-s), in run_job.sh's step before vLLM starts, for a process that then exits."""
    if action == "check":
        spec = importlib.util.find_spec("openenv.harbor.rollout")
        if spec is None or not spec.origin or not calls_export_session(Path(spec.origin).read_text(encoding="utf-8")):
            raise ShapeError("openenv.harbor.rollout does not call a module-level export_session: the upstream-error "
                             "count has nothing to wrap")
        return
    from openenv.harbor import rollout

    if not getattr(rollout.export_session, _PATCHED, False):
        rollout.export_session = _with_upstream_errors(rollout.export_session)


def apply() -> None:
    """Patch the opencode seam in this process (once), then resolve it as a rollout does."""
    try:
        if not getattr(seams.SEAMS[HARNESS].kwargs, _PATCHED, False):
            seams.SEAMS[HARNESS] = replace(seams.SEAMS[HARNESS], kwargs=_patched(seams.SEAMS[HARNESS]))
        _model, kwargs, _env, _proc = seams.get(HARNESS).resolve(
            base_url="https://example.invalid/capture", session="probe-session", model="org/model")
        options = kwargs["opencode_config"]["provider"][seams.OPENCODE_PROVIDER]["options"]
        sent = options["apiKey"], options["headers"][HEADER]
    except (KeyError, TypeError) as error:
        raise ShapeError(f"openenv's {HARNESS} seam is not the shape the x-api-key patch expects (its "
                         f"opencode_config.provider.{seams.OPENCODE_PROVIDER}.options; missing: {error})") from None
    if sent != ("probe-session", "probe-session"):
        raise ShapeError(f"the {HARNESS} seam does not send the session as apiKey and {HEADER}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["check", "serve"])
    parser.add_argument("openenv_args", nargs=argparse.REMAINDER, help="after `--`: arguments for `openenv`")
    args = parser.parse_args(argv)
    try:
        sandbox = recipe.knob("SANDBOX")
        apply()
        sandbox_lifecycle.apply_idle_timeout()
        lifetime = sandbox_lifecycle.verify_lifetime(sandbox)
        wrap_export(args.action)
    except (ShapeError, recipe.ConfigError) as exc:
        sys.exit(f"seam_patch: {exc}")
    except ImportError:  # Harbor's, several lines naming an extra without our pins
        sys.exit(f"seam_patch: SANDBOX={sandbox} needs its SDK: pip install -r <(python3 recipe.py --requirements "
                 f"{sandbox})")
    except SystemExit as exc:
        sys.exit(f"seam_patch: Harbor's {sandbox} preflight: {exc.code}")
    print(f"seam_patch: {HARNESS} seam sends the capture session as apiKey and {HEADER}", flush=True)
    print(f"seam_patch: an eval's {HARNESS} gets the training rollouts' tools", flush=True)
    print(f"seam_patch: {lifetime}", flush=True)
    print("seam_patch: each rollout's result counts its model calls that failed at the engine", flush=True)
    if args.action == "serve":
        rest = args.openenv_args[1:] if args.openenv_args[:1] == ["--"] else args.openenv_args
        from openenv.cli.__main__ import main as openenv_main

        sys.argv = ["openenv", *rest]
        openenv_main()


if __name__ == "__main__":
    main()
