"""The job's install step in the vLLM image (common.sh): pip, which resolves only what it is asked to install, held to
vLLM's own ranges; then `pip check` judged."""

from __future__ import annotations

import re
import sys
from importlib import metadata

import recipe

# pip check's two report lines (pip/_internal/commands/check.py).
_CONFLICT = re.compile(r"^(?P<pkg>\S+) \S+ has requirement .+, but you have (?P<dep>\S+) \S+\.$")
_MISSING = re.compile(r"^(?P<pkg>\S+) \S+ requires (?P<dep>\S+?),? which is not installed\.$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def breaks(report: str) -> list[tuple[str, str, str]]:
    """(package, dependency, line) of each break in `pip check`'s output but recipe.PIP_CHECK_ACCEPTED's; a line pip
    never prints is a break of its own, ("?", "?")."""
    skip = {(_norm(pkg), _norm(dep)) for pkg, dep in recipe.PIP_CHECK_ACCEPTED}
    found = []
    for line in map(str.strip, report.splitlines()):
        if not line or line == "No broken requirements found." or line.startswith("WARNING:"):
            continue
        match = _CONFLICT.match(line) or _MISSING.match(line)
        pair = ("?", "?")
        if match:
            pair = (_norm(match["pkg"]), _norm(re.split(r"[<>=!~;\[ ]", match["dep"], maxsplit=1)[0]))
        if pair not in skip:
            found.append((*pair, line))
    return found


def vllm_constraints(transformers_pin: str, path: list[str] | None = None) -> list[str]:
    """The install step's constraints: vllm and torch as installed (in `path`, default this interpreter's), vLLM's
    requirements in its own ranges but the accepted breaks. An image without vllm==VLLM_VERSION exits here."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    path = sys.path if path is None else path
    vllm, torch = (next(iter(metadata.distributions(name=name, path=path)), None) for name in ("vllm", "torch"))
    if vllm is None or Version(vllm.version).base_version != recipe.VLLM_VERSION:
        found = f"vllm {vllm.version} is installed" if vllm else "vllm is not installed"
        sys.exit(f"{found}, the recipe needs vllm=={recipe.VLLM_VERSION}: run in the {recipe.VLLM_IMAGE} image")
    lines = [transformers_pin, f"vllm=={vllm.version}", *([f"torch=={torch.version}"] if torch else [])]
    skip = {"torch", "transformers", "vllm"} | {_norm(d) for p, d in recipe.PIP_CHECK_ACCEPTED if _norm(p) == "vllm"}
    for req in map(Requirement, vllm.requires or []):
        applies = req.marker is None or req.marker.evaluate({"extra": ""})
        if applies and _norm(req.name) not in skip and str(req.specifier):
            lines.append(f"{_norm(req.name)}{req.specifier}")
    return lines


def main(argv: list[str]) -> None:
    if argv[:1] == ["constraints"] and len(argv) == 2:
        print("\n".join(vllm_constraints(argv[1])))
    elif argv == ["pip-check"]:
        if left := breaks(sys.stdin.read()):
            package, dependency, line = left[0]
            sandbox = recipe.knob("SANDBOX")
            pins = f" or recipe.SANDBOXES[{sandbox!r}]" if recipe.SANDBOXES[sandbox]["requirements"] else ","
            sys.exit(f"the install step broke a requirement: {line} (pin it in recipe.JOB_REQUIREMENTS{pins} or list "
                     f"({package!r}, {dependency!r}) in recipe.PIP_CHECK_ACCEPTED with the evidence that our path "
                     "does not need it)")
    else:
        sys.exit("usage: python3 image_check.py constraints TRANSFORMERS_PIN | pip-check (pip check's report on stdin)")


if __name__ == "__main__":
    main(sys.argv[1:])
