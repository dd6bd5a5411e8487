"""Session-wide settings: Trackio logs into a throw-away folder and never to a Space or server; one torch thread
per process; gradio hidden in every Python of the suite (tests/site/sitecustomize.py says why); and the order
pytest-xdist hands the modules out in (`-n 3 --dist loadscope`, set in pyproject.toml).

Trackio reads TRACKIO_DIR once, when first imported (TRL imports it with its async GRPO trainer), so it is set
here, before any test module is collected; the rehearsal subprocesses inherit it (each xdist worker has its own).

Torch runs one intra-op thread per process (OMP_NUM_THREADS=1, inherited by every child the tests start): the
tiny models gain nothing from a second thread, and on a 2-core machine running three workers plus the rehearsal's
processes, OpenMP's spinning threads only fight each other (a rehearsal run took 170 s with the default, 94 s
with one thread).

`--dist loadscope` keeps each module on one worker, so its module-scoped set-ups (tiny models, the vLLM child
process, the built trainer) run once, as they do without xdist (tests/test_foundation.py checks it). Not
`loadgroup`: on pytest 9.2 it no longer groups anything (pytest-dev/pytest-xdist#1386). The slowest modules go
first (the order xdist hands scopes out, with `--no-loadscope-reorder`), so no worker starts one near the end.
Without xdist (`-n 0`) the same order holds and nothing else changes.
"""

from __future__ import annotations

import atexit
import os
import runpy
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="trackio-tests-")
atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
    os.environ.pop(name, None)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's start-up rule (tests/site/sitecustomize.py: gradio hidden), here and in every Python the tests start.
SITE = Path(__file__).resolve().parent / "site"
runpy.run_path(str(SITE / "sitecustomize.py"))
if str(SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # xdist's workers inherit it
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))

# Measured with benchmarks/suite_time.py on a 2-core machine (longest first, so no worker starts a long one near the
# end); the rest keep their collection order after these. run_job.sh's tests are three modules: as one (286 s, mostly
# waiting on the script's polls) it was the last module running, alone, for the suite's last two minutes.
SLOWEST_FIRST = ("test_rehearsal_chain", "test_rehearsal", "test_chain", "test_eval_watch_engine",
                 "test_chain_backends", "test_run_job_preflight", "test_run_job", "test_eval_adapter",
                 "test_run_job_smoke", "test_benchmark_tiny", "test_train_lora", "test_servers", "test_eval_watch",
                 "test_chat_template", "test_vllm_cpu", "test_agent_policy", "test_launch",
                 "test_sandbox_lifecycle", "test_benchmark_pipeline", "test_train_weight_sync")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: n for n, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))  # stable
