"""Every top-level script imports only what the job installs: recipe.JOB_REQUIREMENTS and its dependencies.

The jobs install recipe.JOB_REQUIREMENTS (never requirements-dev.txt) into the vLLM image, so a module that only the
dev requirements bring imports fine here and crashes on the job. This walks the installed metadata from those pins
(extras and markers included) and checks every import of every script against it.
"""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import recipe

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("*.py"))
# Provided on the job by something other than pip and recipe.JOB_REQUIREMENTS.
OUTSIDE = {
    "vllm": "the vllm/vllm-openai image the jobs run in",
}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in `path`, lazy ones inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def requirement_lines(text: str) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def runtime_closure(text: str = recipe.JOB_REQUIREMENTS) -> set[str]:
    """Canonical names of the distributions the job's pins bring in, as installed here."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonicalize_name(r.name), frozenset(r.extras)) for r in requirement_lines(text)]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def test_every_script_import_comes_from_the_runtime_requirements():
    local = {p.stem for p in SCRIPTS}
    closure = runtime_closure()
    providers = metadata.packages_distributions()
    missing = {}
    for script in SCRIPTS:
        for module in sorted(imported_modules(script) - local - set(sys.stdlib_module_names) - set(OUTSIDE)):
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            if not dists & closure:
                missing.setdefault(script.name, []).append(f"{module} ({', '.join(sorted(dists)) or 'not installed'})")
    assert not missing, f"imported but not brought by recipe.JOB_REQUIREMENTS: {missing}"


def test_the_check_sees_dev_only_packages():
    """The closure is not everything installed: pytest and ruff (requirements-dev.txt only) are outside it."""
    closure = runtime_closure()
    assert {"trl", "peft", "torch", "httpx"} <= closure
    assert not {"pytest", "ruff"} & closure
