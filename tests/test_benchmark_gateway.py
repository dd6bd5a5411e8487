"""benchmarks/gateway_abuse.py runs end to end (one second per abuse), so the script cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_abuse_benchmark_prints_a_row_per_abuse_with_the_sessions_calls():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gateway_abuse.py"), "--seconds", "1",
                          "--abuses", "baseline,keyless_models"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith(("| baseline", "| keyless"))]
    assert [row[0] for row in rows] == ["| baseline: nothing", "| keyless_models: 12 clients asking GET "
                                                               "/capture/v1/models with no key"]
    calls = [row[1].split(" / ") for row in rows]
    assert all(int(ok) > 0 and failed == "0" for ok, failed in calls), calls
    assert "401 x" in rows[1][-1]  # the keyless clients were refused
