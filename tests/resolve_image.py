"""Regenerates tests/image_resolution.json and requirements-vllm.txt with pip's own resolver (needs PyPI).

    .venv/bin/python tests/resolve_image.py [--sandboxes]

1. The image: `pip install --dry-run --ignore-installed --report` of `vllm==recipe.VLLM_VERSION` (this
   machine is what the job runs on: CPython 3.12, Linux x86_64), i.e. the set vLLM's requirements resolve to.
2. That set is laid out as package metadata only (each `*.dist-info/METADATA` with its real Requires-Dist)
   in an empty venv, which is all pip reads to decide what is installed.
3. run_job.sh's install step is run against it, as the job runs it: `transformers --no-deps`, then
   `pip --python <that venv> install --dry-run --report -c <image_check.vllm_constraints> -r <the rest>`;
   what it would install is laid over the set.
4. `pip check` on the result: the breaks the job will see (tests/test_image_install.py replays this offline).
5. Each sandbox backend's pins (recipe.SANDBOXES: SANDBOX=daytona|e2b adds them to the install step's pip call),
   resolved the same way over the set step 3 leaves, recorded as what they add or change and their `pip check`;
   and once without the backend's own pins beyond Harbor's extra and the SDK (what they are for: the breaks
   without them).
   `--sandboxes` redoes only this step, over the recorded set (the image's answer moves with PyPI; this keeps
   the reviewed one).

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


def backend_lines(rest: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Per sandbox backend with pins of its own (recipe.SANDBOXES): step 3's lines plus them, and plus them without the
    pins that are neither Harbor's extra nor the SDK (what those pins are for)."""
    out = {}
    for sandbox, spec in recipe.SANDBOXES.items():
        if spec["requirements"]:
            lines = [line for line in spec["requirements"].splitlines() if line.split("#", 1)[0].strip()]
            bare = [line for line in lines
                    if norm(re.split(r"[\[<>=!~ ]", line, maxsplit=1)[0]) in ("harbor", norm(sandbox))]
            out[sandbox] = (rest + lines, rest + bare)
    return out


def resolve_backends(rest: list[str], after: dict[str, dict], constraints: list[str]) -> dict[str, dict]:
    """Step 5, for every backend: its pins installed the job's way (in the one pip call with the job's, the same
    constraints) over the packages the install step leaves (`after`), then `pip check`."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        python, site = fake_env(tmp / "job")
        (tmp / "constraints.txt").write_text("\n".join(constraints) + "\n")
        for sandbox, (with_lines, bare_lines) in backend_lines(rest).items():
            entry: dict = {"requirements_sha256": requirements_digest(recipe.SANDBOXES[sandbox]["requirements"])}
            variants = {"with": with_lines}
            if bare_lines != with_lines:  # the backend has pins of its own
                variants["without_pins"] = bare_lines
            for key, lines in variants.items():
                (tmp / "rest.txt").write_text("\n".join(lines) + "\n")
                args = ["-r", str(tmp / "rest.txt")]
                lay_out(site, after)
                step = resolve(["-c", str(tmp / "constraints.txt"), *args], python)
                lay_out(site, {**after, **step})
                changed = {n: p for n, p in step.items() if after.get(n, {}).get("version") != p["version"]}
                entry[key] = {"packages": dict(sorted(changed.items())), "pip_check": pip_check(python)}
            found[sandbox] = entry
    return found


def main() -> None:
    tf_pin = next(line.strip() for line in recipe.JOB_REQUIREMENTS.splitlines() if line.startswith("transformers=="))
    rest = [line for line in recipe.JOB_REQUIREMENTS.splitlines() if not line.startswith("transformers")]
    if sys.argv[1:] == ["--sandboxes"]:
        recorded = json.loads(RESOLUTION.read_text())
        recorded["sandboxes"] = resolve_backends(rest, recorded["after"], recorded["constraints"])
        RESOLUTION.write_text(json.dumps(recorded, indent=1) + "\n")
        report(recorded["sandboxes"])
        return
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
    sandboxes = resolve_backends(rest, after, constraints)
    changes = {name: [image.get(name, {}).get("version"), pkg["version"]] for name, pkg in sorted(after.items())
               if image.get(name, {}).get("version") != pkg["version"]}
    RESOLUTION.write_text(json.dumps({
        "vllm": recipe.VLLM_VERSION, "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "requirements_sha256": requirements_digest(), "constraints": constraints, "changes": changes,
        "pip_check": breaks, "image": {n: p["version"] for n, p in sorted(image.items())},
        "after": dict(sorted(after.items())), "sandboxes": sandboxes,
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
    report(sandboxes)


def report(sandboxes: dict[str, dict]) -> None:
    for sandbox, entry in sandboxes.items():
        for key, found in entry.items():
            if key != "requirements_sha256":
                print(f"SANDBOX={sandbox} ({key}): {len(found['packages'])} packages added or changed; pip check:",
                      *found["pip_check"], sep="\n  ")


if __name__ == "__main__":
    main()
