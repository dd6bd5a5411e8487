"""Session-wide settings: Trackio logs into a throw-away folder and never to a Space or server; and the
groups pytest-xdist runs the suite in (`-n 2 --dist loadgroup`, set in pyproject.toml).

Trackio reads TRACKIO_DIR once, when first imported (TRL imports it with its async GRPO trainer), so it is set
here, before any test module is collected; the rehearsal subprocesses inherit it (each xdist worker has its own).

Each module is one xdist group by default, so its module-scoped set-ups (tiny models, the vLLM child process,
the built trainer) run once, as they do without xdist. The rehearsal runs (tests calling `run_rehearsal`) share
one group of their own: each keeps both cores busy, so two at once would only slow each other past their
timeouts; they run one after the other on one worker while the other worker takes the rest. A test may name
its own group with `@pytest.mark.xdist_group(...)`. The longest groups go first (the order xdist hands them
out, with `--no-loadscope-reorder`), so no worker starts one near the end. Without xdist (`-n 0`) the same
order holds and nothing else changes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="trackio-tests-")
atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
    os.environ.pop(name, None)

REHEARSAL_GROUP = "rehearsal-runs"
TRAIN_RUN_GROUP = "train-run"  # test_train_lora.py's real training run, apart from that module's quick tests
LONGEST_FIRST = (REHEARSAL_GROUP, TRAIN_RUN_GROUP)


def group_of(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker and marker.args else marker.kwargs.get("name", "") if marker else ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        function = getattr(item, "function", None)
        uses_rehearsal = function is not None and "run_rehearsal" in function.__code__.co_names
        item.add_marker(pytest.mark.xdist_group(REHEARSAL_GROUP if uses_rehearsal else item.module.__name__))
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item), len(rank)))  # stable: the rest keep their order
