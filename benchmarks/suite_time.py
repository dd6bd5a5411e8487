"""Where the README's test command spends its wall time: per module, and how busy the machine's cores were meanwhile.

Runs `.venv/bin/python -m pytest` (the README's command, pyproject.toml's xdist options) with a JUnit XML report,
samples the machine's CPU (/proc/stat) every few seconds, and prints a table: each module's summed test time and test
count, slowest first, then the busy share of all cores per tenth of the run. A run whose cores sit idle near its end
has one module running alone there (xdist keeps each module on one worker); a run busy throughout is bound by the
CPU its tests use, and only less work shortens it.

    .venv/bin/python benchmarks/suite_time.py                     # the whole suite, ~8 min on 2 cores
    .venv/bin/python benchmarks/suite_time.py -- tests/test_launch.py   # arguments after -- go to pytest
    .venv/bin/python benchmarks/suite_time.py --cpu test_chain test_vllm_cpu   # CPU-seconds per module

`--cpu` runs each named module alone (`-n 0`) and prints the CPU-seconds (user + system) of its pytest and of every
process it started, orphans included (this process is their child subreaper and reaps them): on a machine others
load, a module's CPU-seconds barely move while its wall time does, and the suite's wall on 2 idle cores is about
its modules' summed CPU-seconds / 1.9.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import resource
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


def children_cpu() -> float:
    """User + system CPU-seconds of every reaped child of this process (and theirs) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reap(timeout_s: float = 60.0) -> int:
    """Reaps the orphans this subreaper inherited as they exit; the count still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.5)
        except ChildProcessError:
            return 0
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and f"PPid:\t{os.getpid()}\n" in
               (p / "status").read_text(errors="replace"))


def module_cpu(modules: list[str], root: Path = ROOT) -> int:
    """Each module alone (`-n 0`): its wall and CPU-seconds, its pytest summary; a table, most CPU first."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
    rows, failed = [], 0
    for module in modules:
        before, started = children_cpu(), time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", f"tests/{module}.py"], cwd=root,
                              capture_output=True, text=True)
        wall, left = time.monotonic() - started, reap()
        rows.append((module, children_cpu() - before, wall, (done.stdout.strip().splitlines() or ["?"])[-1]))
        failed |= done.returncode
        print(f"{module}: {rows[-1][1]:.0f} CPU-s, {wall:.0f} s wall, {rows[-1][3]}"
              + (f", {left} processes left running" if left else ""), flush=True)
    print(f"\nload average at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}\n")
    print("| module | CPU-s | wall s | pytest |\n|---|---|---|---|")
    for module, cpu, wall, summary in sorted(rows, key=lambda row: -row[1]):
        print(f"| {module} | {cpu:.0f} | {wall:.0f} | {summary} |")
    print(f"| all | {sum(row[1] for row in rows):.0f} | | |")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", nargs="+", metavar="MODULE", help="CPU-seconds of each module run alone")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose tests/ --cpu runs")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if args.cpu:
        return module_cpu(args.cpu, args.root)
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
