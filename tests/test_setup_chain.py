"""The rollout chain's parts that run anywhere (tests/test_chain.py needs root): setup.sh installs the tools it needs
when it can, otherwise one line says what to install, and under CI=true that line fails the set-up instead of
skipping; the stand-ins take Harbor's hf-sandbox and opencode slots only while those tables have the expected shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_install_chain_tools(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """setup.sh's functions (not its main), then `install_chain_tools`, on a PATH without bubblewrap or apt-get."""
    functions = (ROOT / "setup.sh").read_text().replace('\nmain "$@"\n', "\n")
    script = functions + "\nif install_chain_tools; then echo tools-ready; fi\necho went-on\n"  # as main() calls it
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


def test_missing_chain_tools_are_named_once_and_skipped_outside_ci(tmp_path):
    out = run_install_chain_tools(tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["went-on"]  # no image build; the rest goes on
    assert out.stderr.count("\n") == 1 and "the rollout-chain tests will be skipped: install bubblewrap" in out.stderr


REGISTER = """
import sys
sys.path.insert(0, {chain!r})
import serve
from harbor.environments import factory
from harbor.models.environment_type import EnvironmentType
{tamper}
serve.register()
entry = factory._ENVIRONMENT_REGISTRY[EnvironmentType.HF_SANDBOX]
from harbor.agents.factory import AgentFactory
from harbor.models.agent.name import AgentName
print(entry.module, entry.class_name, AgentFactory._AGENT_MAP[AgentName.OPENCODE])
"""


def register(tamper: str = "") -> subprocess.CompletedProcess:
    code = REGISTER.format(chain=str(ROOT / "tests" / "chain"), tamper=tamper)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_chain_stand_ins_take_harbors_hf_sandbox_and_opencode_slots():
    out = register()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["chain.sandbox", "BubblewrapEnvironment", "chain.agent:PinnedOpenCode"]


def test_a_harbor_whose_private_tables_moved_is_refused_in_one_line():
    table = "factory._ENVIRONMENT_REGISTRY"
    moved = f"{table}[EnvironmentType.HF_SANDBOX] = {table}[EnvironmentType.E2B]"  # another provider in its slot
    out = register(moved)
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0
    assert "maps hf-sandbox to" in out.stderr and "the sandbox stand-in needs updating" in out.stderr
