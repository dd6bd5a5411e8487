"""run_job.sh's install step against the vLLM image, offline: tests/image_resolution.json is pip's own answer
(tests/resolve_image.py, with PyPI) for the image's packages and what the install step changes, for each sandbox
backend too (SANDBOX=daytona|e2b adds its pins, recipe.SANDBOXES); here the result is laid out again as package metadata
and real `pip check` runs on it, so the breaks the job will see, the job-side filter (image_check.py) and
recipe.PIP_CHECK_ACCEPTED are checked against each other."""

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


def test_pip_check_after_install_shows_only_accepted_breaks(resolution, after_install, monkeypatch):
    python, _ = after_install
    lines = pip_check(python)
    assert lines == resolution["pip_check"]
    assert image_check.breaks("\n".join(lines)) == []
    # No stale entry: every accepted break really happens.
    accepted = set(recipe.PIP_CHECK_ACCEPTED)
    monkeypatch.setattr(recipe, "PIP_CHECK_ACCEPTED", ())
    assert {(pkg, dep) for pkg, dep, _ in image_check.breaks("\n".join(lines))} == accepted


def test_job_filter_names_an_unlisted_break(resolution, after_install, monkeypatch):
    python, _ = after_install
    report = "\n".join(pip_check(python))
    out = subprocess.run([sys.executable, str(ROOT / "image_check.py"), "pip-check"], input=report,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    monkeypatch.setattr(recipe, "PIP_CHECK_ACCEPTED", ())
    assert [(pkg, dep) for pkg, dep, _ in image_check.breaks(report)] == [("vllm", "mcp")]
    with pytest.raises(SystemExit, match=r"the install step broke a requirement: vllm 0\.31\.0 has requirement mcp"):
        monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(report))
        image_check.main(["pip-check"])


def test_vllms_ranges_hold_every_package_vllm_names(resolution):
    """Every package vLLM declares keeps a version inside vLLM's range after the install, except accepted ones."""
    vllm_ranges_hold(resolution, resolution["after"])


def vllm_ranges_hold(resolution: dict, packages: dict[str, dict]) -> None:
    from packaging.requirements import Requirement

    accepted = {dep for pkg, dep in recipe.PIP_CHECK_ACCEPTED if pkg == "vllm"}
    after = {n: p["version"] for n, p in packages.items()}
    for text in resolution["after"]["vllm"]["requires_dist"]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = image_check._norm(req.name)
        if name in accepted:
            assert after[name] not in req.specifier  # the break is real, and listed
        else:
            assert after[name] in req.specifier, f"{name} {after[name]} outside vLLM's {req.specifier}"


# --- SANDBOX=daytona|e2b: the backend's pins in the same pip call -----------------------------------------------------
BACKENDS = [sandbox for sandbox, spec in recipe.SANDBOXES.items() if spec["requirements"]]


def backend_install(resolution: dict, sandbox: str, variant: str, folder: Path) -> tuple[dict, list[str]]:
    """The job's packages after the install step with the backend's pins (`variant`), and real `pip check` on them."""
    packages = {**resolution["after"], **resolution["sandboxes"][sandbox][variant]["packages"]}
    python, site = fake_env(folder)
    lay_out(site, packages)
    return packages, pip_check(python)


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_a_backends_install_is_resolved_for_its_pins(resolution, sandbox):
    entry = resolution["sandboxes"][sandbox]
    pins = recipe.SANDBOXES[sandbox]["requirements"]
    assert entry["requirements_sha256"] == requirements_digest(pins), \
        f"recipe.SANDBOXES[{sandbox!r}]'s pins changed: run .venv/bin/python tests/resolve_image.py --sandboxes"
    pinned = recipe.pinned_versions(pins)[sandbox]  # the SDK release tests/chain's doubles are typed against
    assert entry["with"]["packages"][sandbox]["version"] == pinned.removeprefix("==")
    assert "harbor" not in entry["with"]["packages"]  # the extra adds the SDK, Harbor stays the stack's


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_a_backends_install_breaks_nothing_but_the_accepted(resolution, sandbox, tmp_path):
    packages, lines = backend_install(resolution, sandbox, "with", tmp_path / "env")
    assert lines == resolution["sandboxes"][sandbox]["with"]["pip_check"]
    assert image_check.breaks("\n".join(lines)) == []
    vllm_ranges_hold(resolution, packages)


def test_without_its_opentelemetry_pin_daytona_breaks_the_images_opentelemetry(resolution, tmp_path):
    """What the daytona pins' OpenTelemetry pin is for: daytona's aiohttp instrumentation moves part of the
    OpenTelemetry family to 1.45.1 under the image's 1.45.2 exporters, and the job's pip-check filter would stop the
    job."""
    _, lines = backend_install(resolution, "daytona", "without_pins", tmp_path / "env")
    left = image_check.breaks("\n".join(lines))
    assert len(left) == 5 and all(pkg.startswith("opentelemetry-") for pkg, _, _ in left), lines
    assert "opentelemetry-exporter-otlp" in recipe.pinned_versions(recipe.SANDBOXES["daytona"]["requirements"])


@pytest.mark.parametrize(("line", "expected"), [
    ("vllm 0.31.0 has requirement mcp<3.0.0,>=2.0.0, but you have mcp 1.30.0.", ("vllm", "mcp")),
    ("vllm 0.31.0 requires llguidance, which is not installed.", ("vllm", "llguidance")),
    ("Foo_Bar 1.0 has requirement baz.qux[x]>=2, but you have baz-qux 1.0.", ("foo-bar", "baz-qux")),
    ("something pip never printed", ("?", "?")),
])
def test_parse_pip_check_lines(line, expected, monkeypatch):
    monkeypatch.setattr(recipe, "PIP_CHECK_ACCEPTED", ())
    assert image_check.breaks(f"{line}\n") == [(*expected, line)]


def test_tests_run_the_jobs_torch(resolution):
    """requirements-dev.txt pins the torch vLLM pins in the image, and this venv has it."""
    import torch
    from packaging.version import Version

    assert Version(torch.__version__).base_version == resolution["image"]["torch"] == resolution["after"]["torch"][
        "version"], "pin requirements-dev.txt's torch to the image's and rerun bash setup.sh"


def test_clean_pip_check_has_no_breaks():
    assert image_check.breaks("No broken requirements found.\n") == []


@pytest.mark.parametrize(("sandbox", "pins"), [("hf-sandbox", "recipe.JOB_REQUIREMENTS,"),
                                               ("daytona", "recipe.JOB_REQUIREMENTS or recipe.SANDBOXES['daytona']")])
def test_a_break_names_the_pins_the_install_step_installed(sandbox, pins):
    """The install step installs JOB_REQUIREMENTS and SANDBOX's own pins: a break's fix names both when both went in."""
    report = "vllm 0.31.0 has requirement fastapi<0.137.0,>=0.133.0, but you have fastapi 0.165.0.\n"
    out = subprocess.run([sys.executable, str(ROOT / "image_check.py"), "pip-check"], input=report, text=True,
                         capture_output=True, env={"PATH": "/usr/bin:/bin", "SANDBOX": sandbox}, timeout=60)
    assert out.returncode != 0 and f"(pin it in {pins} or list ('vllm', 'fastapi')" in out.stderr, out.stderr
