"""Stand-in for smoke_report.py in run_job.sh tests (the real one reads the Hub): records each call.

plan: the real smoke_report.py's (REAL_SMOKE_REPORT, pure arithmetic on recipe.py), its deadline STUB_DEADLINE seconds
(default 600). clear: recorded. report: records the stage records run_job.sh wrote, prints STUB_REPORT's verdict and
exits 0 for GO (default), 1 for NO-GO.
"""

import os
import subprocess
import sys
from pathlib import Path

args = sys.argv[1:]
if args[0] == "plan":
    real = subprocess.run([sys.executable, os.environ["REAL_SMOKE_REPORT"], *args], capture_output=True, text=True)
    if real.returncode:
        sys.exit(f"{real.stdout}{real.stderr}".rstrip())
    said, numbers = real.stdout.splitlines()
    print(said, numbers.rsplit(" ", 1)[0] + " " + os.environ.get("STUB_DEADLINE", "600"), sep="\n")
    sys.exit(0)
with open(os.environ["STUB_LOG"], "a") as log:
    if args[0] == "report":
        stages = Path(args[args.index("--stages") + 1]).read_text().splitlines()
        log.write(f"smoke_report report {' '.join(line.split()[0] + ':' + line.split()[1] for line in stages)}\n")
    elif args[0] == "clear":
        log.write(f"smoke_report clear ADAPTER_REPO={os.environ.get('ADAPTER_REPO')}\n")
if args[0] == "report":
    verdict = os.environ.get("STUB_REPORT", "GO")
    print(f"SMOKE REPORT: {verdict}")
    sys.exit(0 if verdict == "GO" else 1)
