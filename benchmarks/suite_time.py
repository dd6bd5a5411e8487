"""Where the README's test command spends its wall time: per module, and how busy the machine's cores were meanwhile.

Runs `.venv/bin/python -m pytest` (the README's command, pyproject.toml's xdist options) with a JUnit XML report,
samples the machine's CPU (/proc/stat) every few seconds, and prints a table: each module's summed test time and test
count, slowest first, then the busy share of all cores per tenth of the run. A run whose cores sit idle near its end
has one module running alone there (xdist keeps each module on one worker); a run busy throughout is bound by the
CPU its tests use, and only less work shortens it.

    .venv/bin/python benchmarks/suite_time.py                     # the whole suite, ~8 min on 2 cores
    .venv/bin/python benchmarks/suite_time.py -- tests/test_launch.py   # arguments after -- go to pytest
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_S = 2.0  # /proc/stat's counters move in 10 ms ticks: 2 s keeps each sample's busy share within 1%


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) ticks of all cores since boot, from /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def sample(stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """Appends (seconds since start, busy share of all cores) every SAMPLE_S until `stop` is set."""
    start, (busy0, total0) = time.monotonic(), cpu_ticks()
    while not stop.wait(SAMPLE_S):
        busy, total = cpu_ticks()
        samples.append((time.monotonic() - start, (busy - busy0) / max(total - total0, 1)))
        busy0, total0 = busy, total


def module_times(report: Path) -> list[tuple[str, float, int]]:
    """(module, summed test seconds, tests) per test module of a JUnit XML report, slowest first."""
    seconds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        seconds[module] += float(case.get("time") or 0)
        counts[module] += 1
    return [(module, total, counts[module]) for module, total in seconds.most_common()]


def tenths(samples: list[tuple[float, float]], wall: float) -> list[float]:
    """The mean busy share in each tenth of the run."""
    shares: list[list[float]] = [[] for _ in range(10)]
    for at, share in samples:
        shares[min(int(10 * at / wall), 9)].append(share)
    return [sum(s) / len(s) if s else 0.0 for s in shares]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", f"--junitxml={report}", *args.pytest_args]
        stop, samples = threading.Event(), []
        sampler = threading.Thread(target=sample, args=(stop, samples), daemon=True)
        started = time.monotonic()
        sampler.start()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - started
        stop.set()
        sampler.join()
        rows = module_times(report) if report.is_file() else []
    lines = done.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]  # pytest's short summary (-ra)
    print("\n".join([*failed, lines[-1]]) if lines else done.stderr[-2000:])
    print(f"\n{' '.join(['.venv/bin/python', '-m', 'pytest', *args.pytest_args])}: {wall:.0f} s wall\n")
    print("| module | test seconds | tests |\n|---|---|---|")
    for module, seconds, count in rows:
        print(f"| {module} | {seconds:.1f} | {count} |")
    print(f"| all | {sum(r[1] for r in rows):.1f} | {sum(r[2] for r in rows)} |")
    busy = tenths(samples, wall)
    print("\n| tenth of the run | " + " | ".join(str(n + 1) for n in range(10)) + " |")
    print("|---" * 11 + "|")
    print("| cores busy | " + " | ".join(f"{share:.0%}" for share in busy) + " |")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
