"""setup.sh's part for the rollout chain (tests/test_chain.py): the tools it needs are installed when they can be;
otherwise one line says what to install, and under CI=true that line fails the set-up instead of skipping."""

from __future__ import annotations

import subprocess
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
