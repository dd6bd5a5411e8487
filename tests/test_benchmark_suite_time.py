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
