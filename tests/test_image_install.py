"""run_job.sh's install step against the vLLM image, offline: tests/image_resolution.json is pip's own answer
(tests/resolve_image.py, with PyPI) for the image's packages and what the install step changes; here the
result is laid out again as package metadata and real `pip check` runs on it, so the breaks the job will see,
the job-side filter (image_check.py) and recipe.PIP_CHECK_ACCEPTED are checked against each other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from resolve_image import RESOLUTION, fake_env, lay_out, pip_check, requirements_digest

import image_check
import recipe

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "regenerate it: .venv/bin/python tests/resolve_image.py (needs PyPI), then review the diff"


@pytest.fixture(scope="module")
def resolution() -> dict:
    return json.loads(RESOLUTION.read_text())


@pytest.fixture(scope="module")
def after_install(resolution, tmp_path_factory) -> tuple[Path, Path]:
    """A venv holding (as metadata) exactly the packages the job has after its install step."""
    python, site = fake_env(tmp_path_factory.mktemp("job") / "env")
    lay_out(site, resolution["after"])
    return python, site


def test_resolution_is_for_this_recipe(resolution):
    assert resolution["vllm"] == recipe.VLLM_VERSION, REGENERATE
    assert resolution["requirements_sha256"] == requirements_digest(), f"recipe.JOB_REQUIREMENTS changed: {REGENERATE}"
    assert resolution["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_constraints_are_what_the_job_computes(resolution, tmp_path):
    """The resolution used today's image_check.vllm_constraints (read off the image's vLLM metadata)."""
    python, site = fake_env(tmp_path / "image")
    lay_out(site, {n: {"name": n, "version": v, "requires_dist": resolution["after"].get(n, {}).get("requires_dist",
                                                                                                  [])}
                   for n, v in resolution["image"].items()})
    tf_pin = resolution["constraints"][0]
    assert image_check.vllm_constraints(tf_pin, path=[str(site)]) == resolution["constraints"], REGENERATE
    assert f"vllm=={recipe.VLLM_VERSION}" in resolution["constraints"]
    assert not any(c.startswith("mcp") for c in resolution["constraints"])  # the accepted break is not held


def test_pip_check_after_install_shows_only_accepted_breaks(resolution, after_install):
    python, _ = after_install
    lines = pip_check(python)
    assert lines == resolution["pip_check"]
    breaks = image_check.parse_pip_check("\n".join(lines))
    assert image_check.unaccepted(breaks) == []
    # No stale entry: every accepted break really happens.
    assert {(b.package, b.dependency) for b in breaks} == set(recipe.PIP_CHECK_ACCEPTED)


def test_job_filter_names_an_unlisted_break(resolution, after_install, monkeypatch):
    python, _ = after_install
    report = "\n".join(pip_check(python))
    out = subprocess.run([sys.executable, str(ROOT / "image_check.py"), "pip-check"], input=report,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    monkeypatch.setattr(recipe, "PIP_CHECK_ACCEPTED", ())
    left = image_check.unaccepted(image_check.parse_pip_check(report))
    assert [(b.package, b.dependency) for b in left] == [("vllm", "mcp")]
    with pytest.raises(SystemExit, match=r"the install step broke a requirement: vllm 0\.31\.0 has requirement mcp"):
        monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(report))
        image_check.main(["pip-check"])


def test_vllms_ranges_hold_every_package_vllm_names(resolution):
    """Every package vLLM declares keeps a version inside vLLM's range after the install, except accepted ones."""
    from packaging.requirements import Requirement

    accepted = {dep for pkg, dep in recipe.PIP_CHECK_ACCEPTED if pkg == "vllm"}
    after = {n: p["version"] for n, p in resolution["after"].items()}
    for text in resolution["after"]["vllm"]["requires_dist"]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = image_check._norm(req.name)
        if name in accepted:
            assert after[name] not in req.specifier  # the break is real, and listed
        else:
            assert after[name] in req.specifier, f"{name} {after[name]} outside vLLM's {req.specifier}"


@pytest.mark.parametrize(("line", "expected"), [
    ("vllm 0.31.0 has requirement mcp<3.0.0,>=2.0.0, but you have mcp 1.30.0.", ("vllm", "mcp")),
    ("vllm 0.31.0 requires llguidance, which is not installed.", ("vllm", "llguidance")),
    ("Foo_Bar 1.0 has requirement baz.qux[x]>=2, but you have baz-qux 1.0.", ("foo-bar", "baz-qux")),
    ("something pip never printed", ("?", "?")),
])
def test_parse_pip_check_lines(line, expected):
    (found,) = image_check.parse_pip_check(f"{line}\n")
    assert (found.package, found.dependency) == expected and found.line == line


def test_tests_run_the_jobs_torch(resolution):
    """requirements-dev.txt pins the torch vLLM pins in the image, and this venv has it."""
    import torch
    from packaging.version import Version

    assert Version(torch.__version__).base_version == resolution["image"]["torch"] == resolution["after"]["torch"][
        "version"], "pin requirements-dev.txt's torch to the image's and rerun bash setup.sh"


def test_clean_pip_check_has_no_breaks():
    assert image_check.parse_pip_check("No broken requirements found.\n") == []
