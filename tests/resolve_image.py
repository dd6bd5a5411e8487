"""Regenerates tests/image_resolution.json and requirements-vllm.txt with pip's own resolver (needs PyPI).

    .venv/bin/python tests/resolve_image.py

1. The image: `pip install --dry-run --ignore-installed --report` of `vllm==recipe.VLLM_VERSION` (this
   machine is what the job runs on: CPython 3.12, Linux x86_64), i.e. the set vLLM's requirements resolve to.
2. That set is laid out as package metadata only (each `*.dist-info/METADATA` with its real Requires-Dist)
   in an empty venv, which is all pip reads to decide what is installed.
3. run_job.sh's install step is run against it, as the job runs it: `transformers --no-deps`, then
   `pip --python <that venv> install --dry-run --report -c <image_check.vllm_constraints> -r <the rest>`;
   what it would install is laid over the set.
4. `pip check` on the result: the breaks the job will see (tests/test_image_install.py replays this offline).

requirements-vllm.txt is the image's packages at their versions after the install step, less the GPU-only
wheels: what setup.sh installs into .vllm/ so the tests can run vLLM's own Python code on CPU with the
versions the job will have (the training stack comes from .venv).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import image_check  # noqa: E402
import recipe  # noqa: E402

RESOLUTION = ROOT / "tests" / "image_resolution.json"
TIER_REQUIREMENTS = ROOT / "requirements-vllm.txt"
# Wheels that only work with a GPU (CUDA libraries, kernels, torch and its CUDA siblings): not in the CPU tier,
# which runs on the dev venv's torch.
GPU_ONLY = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|torch-c-dlpack-ext|triton|nvidia-.*|cuda-.*"
                      r"|flashinfer-python|tilelang|humming-kernels|quack-kernels|tokenspeed-.*|nccl.*|pynvvideocodec"
                      r"|fastsafetensors|instanttensor|z3-solver|nvtx|ninja|numba|llvmlite)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_digest(text: str = recipe.JOB_REQUIREMENTS) -> str:
    """What the resolution depends on in this repo: the pins the job installs (their lines, comments left out)."""
    pins = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return hashlib.sha256("\n".join(pin for pin in pins if pin).encode()).hexdigest()


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def resolve(args: list[str], python: Path | None = None) -> dict[str, dict]:
    """pip's dry-run answer: name -> {name, version, requires_dist}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        target = ["--python", str(python)] if python else []
        out = pip(*target, "install", "-q", "--dry-run", "--report", str(report), *args)
        if out.returncode != 0:
            sys.exit(f"pip could not resolve {args}:\n{out.stderr}")
        items = json.loads(report.read_text())["install"]
    return {norm(i["metadata"]["name"]): {"name": i["metadata"]["name"], "version": i["metadata"]["version"],
                                          "requires_dist": i["metadata"].get("requires_dist", [])} for i in items}


def lay_out(site: Path, packages: dict[str, dict]) -> None:
    """Package metadata only, as pip and importlib.metadata read it."""
    for old in site.glob("*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for pkg in packages.values():
        dist = site / f"{pkg['name'].replace('-', '_')}-{pkg['version']}.dist-info"
        dist.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {pkg['name']}", f"Version: {pkg['version']}"]
        lines += [f"Requires-Dist: {req}" for req in pkg["requires_dist"]]
        (dist / "METADATA").write_text("\n".join(lines) + "\n")


def fake_env(folder: Path) -> tuple[Path, Path]:
    """An empty venv (no pip): its interpreter and site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


def pip_check(python: Path) -> list[str]:
    out = pip("--python", str(python), "check")
    return sorted(line for line in out.stdout.splitlines() if line.strip() and not line.startswith("No broken"))


def main() -> None:
    tf_pin = next(line.strip() for line in recipe.JOB_REQUIREMENTS.splitlines() if line.startswith("transformers=="))
    rest = [line for line in recipe.JOB_REQUIREMENTS.splitlines() if not line.startswith("transformers")]
    image = resolve(["--ignore-installed", f"vllm=={recipe.VLLM_VERSION}"])
    with tempfile.TemporaryDirectory() as tmp:
        python, site = fake_env(Path(tmp) / "image")
        after = dict(image)
        tf = resolve(["--ignore-installed", "--no-deps", tf_pin])
        after.update(tf)
        lay_out(site, after)
        constraints = image_check.vllm_constraints(tf_pin, path=[str(site)])
        (Path(tmp) / "constraints.txt").write_text("\n".join(constraints) + "\n")
        (Path(tmp) / "rest.txt").write_text("\n".join(rest) + "\n")
        step2 = resolve(["-c", str(Path(tmp) / "constraints.txt"), "-r", str(Path(tmp) / "rest.txt")], python)
        after.update(step2)
        lay_out(site, after)
        breaks = pip_check(python)
    changes = {name: [image.get(name, {}).get("version"), pkg["version"]] for name, pkg in sorted(after.items())
               if image.get(name, {}).get("version") != pkg["version"]}
    RESOLUTION.write_text(json.dumps({
        "vllm": recipe.VLLM_VERSION, "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "requirements_sha256": requirements_digest(), "constraints": constraints, "changes": changes,
        "pip_check": breaks, "image": {n: p["version"] for n, p in sorted(image.items())},
        "after": dict(sorted(after.items())),
    }, indent=1) + "\n")
    tier = sorted(f"{p['name']}=={p['version']}" for n, p in after.items() if n in image and not GPU_ONLY.match(n))
    TIER_REQUIREMENTS.write_text(
        "# The image's packages (vLLM and its requirements) at their versions after run_job.sh's install step, less\n"
        "# the GPU-only wheels: setup.sh installs these (--no-deps) into .vllm/ for the tests that run vLLM's own\n"
        "# code on CPU.\n"
        "# Generated by tests/resolve_image.py; do not edit by hand.\n" + "\n".join(tier) + "\n")
    print(f"image: {len(image)} packages; the install step changes {len(changes)}: "
          + ", ".join(f"{n} {a}->{b}" for n, (a, b) in changes.items()))
    print("pip check:", *breaks, sep="\n  ")


if __name__ == "__main__":
    main()
