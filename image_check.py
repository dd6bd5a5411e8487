"""The job's install step in the vLLM image: what to hold, and whether vLLM survived it (run by common.sh).

pip resolves only what it is asked to install, so without constraints it would move packages vLLM needs out of
vLLM's own ranges; `pip check` then judges the result, less the breaks recipe.PIP_CHECK_ACCEPTED lists.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from typing import NamedTuple

import recipe

# pip check's two report lines (pip/_internal/commands/check.py).
_CONFLICT = re.compile(r"^(?P<pkg>\S+) \S+ has requirement .+, but you have (?P<dep>\S+) \S+\.$")
_MISSING = re.compile(r"^(?P<pkg>\S+) \S+ requires (?P<dep>\S+?),? which is not installed\.$")


class Break(NamedTuple):
    """One broken requirement: `package` needs `dependency` and does not have a fitting version."""

    package: str
    dependency: str
    line: str


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pip_check(report: str) -> list[Break]:
    """The broken requirements in `pip check`'s output; an unknown non-empty line is a break of its own."""
    breaks = []
    for line in map(str.strip, report.splitlines()):
        if not line or line == "No broken requirements found." or line.startswith("WARNING:"):
            continue
        match = _CONFLICT.match(line) or _MISSING.match(line)
        if match is None:
            breaks.append(Break("?", "?", line))
        else:
            dep = re.split(r"[<>=!~;\[ ]", match["dep"], maxsplit=1)[0]
            breaks.append(Break(_norm(match["pkg"]), _norm(dep), line))
    return breaks


def unaccepted(breaks: list[Break]) -> list[Break]:
    """The breaks not listed (with their evidence) in recipe.PIP_CHECK_ACCEPTED."""
    accepted = {(_norm(pkg), _norm(dep)) for pkg, dep in recipe.PIP_CHECK_ACCEPTED}
    return [b for b in breaks if (b.package, b.dependency) not in accepted]


def _installed(name: str, path: list[str] | None = None) -> metadata.Distribution | None:
    return next(iter(metadata.distributions(name=name, path=path if path is not None else sys.path)), None)


def vllm_constraints(transformers_pin: str, path: list[str] | None = None) -> list[str]:
    """Constraint lines for the install step: vllm and torch at the installed versions, every requirement vLLM
    declares in its own range (less the accepted breaks); `path` is where to look (default: this interpreter's). An
    image without vllm==VLLM_VERSION (a local build suffix allowed) exits here, before anything is installed."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    vllm = _installed("vllm", path)
    if vllm is None or Version(vllm.version).base_version != recipe.VLLM_VERSION:
        found = f"vllm {vllm.version} is installed" if vllm else "vllm is not installed"
        sys.exit(f"{found}, the recipe needs vllm=={recipe.VLLM_VERSION}: run in the {recipe.VLLM_IMAGE} image")
    lines = [transformers_pin, f"vllm=={vllm.version}"]
    if (torch := _installed("torch", path)) is not None:
        lines.append(f"torch=={torch.version}")
    skip = {"torch", "transformers", "vllm"} | {_norm(d) for p, d in recipe.PIP_CHECK_ACCEPTED if _norm(p) == "vllm"}
    for req in map(Requirement, vllm.requires or []):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _norm(req.name) not in skip and str(req.specifier):
            lines.append(f"{_norm(req.name)}{req.specifier}")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["constraints"] and len(argv) == 2:
        print("\n".join(vllm_constraints(argv[1])))
    elif argv == ["pip-check"]:
        if left := unaccepted(parse_pip_check(sys.stdin.read())):
            sys.exit(f"the install step broke a requirement: {left[0].line} (pin it in recipe.JOB_REQUIREMENTS, or "
                     f"list ({left[0].package!r}, {left[0].dependency!r}) in recipe.PIP_CHECK_ACCEPTED with the "
                     "evidence that our path does not need it)")
    else:
        sys.exit("usage: python3 image_check.py constraints TRANSFORMERS_PIN | pip-check (pip check's "
                 "report on stdin)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
