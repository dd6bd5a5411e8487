"""benchmarks/suite_time.py reads pytest's own JUnit XML report: each module's tests summed, slowest first, and the
machine's busy share per tenth of the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import suite_time  # noqa: E402


def test_each_modules_tests_are_summed_slowest_first_from_pytests_own_report(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\ndef test_a(): time.sleep(0.3)\ndef test_b(): time.sleep(.3)\n")
    (tmp_path / "test_quick.py").write_text("def test_c(): pass\n")
    report = tmp_path / "junit.xml"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
                         cwd=tmp_path, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    (slow, seconds, count), (quick, _, one) = suite_time.module_times(report)
    assert (slow, count, quick, one) == ("test_slow", 2, "test_quick", 1) and seconds >= 0.6


def test_the_busy_share_is_averaged_per_tenth_of_the_run():
    busy = suite_time.tenths([(0.5, 1.0), (0.9, 0.5), (9.5, 0.2)], wall=10.0)
    assert busy == [0.75, 0, 0, 0, 0, 0, 0, 0, 0, 0.2]


def test_cpu_counts_what_a_module_leaves_running_after_its_pytest_ends(tmp_path):
    """--cpu reaps the orphans a module leaves (a server it started and never waited for) and counts their CPU."""
    (tmp_path / "tests").mkdir()
    burn = "import time\\nend = time.process_time() + 3\\nwhile time.process_time() < end: pass"
    (tmp_path / "tests" / "test_orphan.py").write_text(
        "import subprocess, sys\n"
        f"def test_start(): subprocess.Popen([sys.executable, '-c', '{burn}'], start_new_session=True)\n")
    out = subprocess.run([sys.executable, str(Path(suite_time.__file__)), "--root", str(tmp_path), "--cpu",
                          "test_orphan"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| test_orphan |")]
    assert float(row.split("|")[2]) >= 3 and "1 passed" in row  # the orphan's 3 s of CPU, after pytest ended
