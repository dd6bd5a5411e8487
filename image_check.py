"""The job's install step against the vLLM image: what to hold, and whether vLLM survived it.

`run_job.sh` installs the training stack into the `vllm/vllm-openai` image. pip resolves only what it is
asked to install, so without help it would move packages vLLM needs out of vLLM's own ranges. Hence:

    vllm_constraints(TRANSFORMERS_PIN)   (common.sh writes them to the install step's constraints file)
        vllm and torch at the installed versions, plus every requirement vLLM declares (its own specifier),
        except the breaks recipe.PIP_CHECK_ACCEPTED lists: pip must stay inside vLLM's ranges or fail.
    python3 -m pip check | python3 image_check.py pip-check
        exits 1 with one line naming the first package vLLM (or anything else) now finds broken, unless the
        break is in recipe.PIP_CHECK_ACCEPTED.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import metadata

import recipe

# pip check's two report lines (pip/_internal/commands/check.py).
_CONFLICT = re.compile(r"^(?P<pkg>\S+) \S+ has requirement .+, but you have (?P<dep>\S+) \S+\.$")
_MISSING = re.compile(r"^(?P<pkg>\S+) \S+ requires (?P<dep>\S+?),? which is not installed\.$")


@dataclass(frozen=True)
class Break:
    """One broken requirement: `package` needs `dependency` and does not have a fitting version."""

    package: str
    dependency: str
    line: str


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pip_check(report: str) -> list[Break]:
    """The broken requirements in `pip check`'s output; an unknown non-empty line is a break of its own."""
    breaks = []
    for line in report.splitlines():
        line = line.strip()
        if not line or line == "No broken requirements found." or line.startswith("WARNING:"):
            continue
        match = _CONFLICT.match(line) or _MISSING.match(line)
        if match is None:
            breaks.append(Break("?", "?", line))
            continue
        dep = re.split(r"[<>=!~;\[ ]", match["dep"], maxsplit=1)[0]
        breaks.append(Break(_norm(match["pkg"]), _norm(dep), line))
    return breaks


def unaccepted(breaks: list[Break]) -> list[Break]:
    """The breaks not listed (with their evidence) in recipe.PIP_CHECK_ACCEPTED."""
    accepted = {(_norm(pkg), _norm(dep)) for pkg, dep in recipe.PIP_CHECK_ACCEPTED}
    return [b for b in breaks if (b.package, b.dependency) not in accepted]


def _installed(name: str, path: list[str] | None) -> metadata.Distribution | None:
    return next(iter(metadata.distributions(name=name, path=path if path is not None else sys.path)), None)


def vllm_constraints(transformers_pin: str, path: list[str] | None = None) -> list[str]:
    """Constraint lines that keep the install step inside vLLM's declared requirements (see module doc);
    `path` is where to look for the installed packages (default: this interpreter's)."""
    from packaging.requirements import Requirement

    vllm = _installed("vllm", path)
    if vllm is None:
        sys.exit(f"vllm is not installed: run in the {recipe.VLLM_IMAGE} image")
    lines = [transformers_pin, f"vllm=={vllm.version}"]
    torch = _installed("torch", path)
    if torch is not None:
        lines.append(f"torch=={torch.version}")
    skip = {_norm(dep) for pkg, dep in recipe.PIP_CHECK_ACCEPTED if _norm(pkg) == "vllm"}
    skip |= {"torch", "transformers", "vllm"}
    for text in vllm.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _norm(req.name) not in skip and str(req.specifier):
            lines.append(f"{_norm(req.name)}{req.specifier}")
    return lines


def main(argv: list[str]) -> int:
    if argv == ["pip-check"]:
        left = unaccepted(parse_pip_check(sys.stdin.read()))
        if left:
            sys.exit(f"the install step broke a requirement: {left[0].line} (pin it in recipe.JOB_REQUIREMENTS, or "
                     f"list ({left[0].package!r}, {left[0].dependency!r}) in recipe.PIP_CHECK_ACCEPTED with the "
                     "evidence that our path does not need it)")
        return 0
    sys.exit("usage: python3 -m pip check | python3 image_check.py pip-check")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
