"""The rollout pipeline benchmark runs the recipe's trainer end to end on CPU (TRL's worker, drop rule and step loop,
train_lora.build_trainer's callbacks), so it cannot rot; and that run's train log and dashboard carry, on every
step, what the smoke report watches: TRL's stale-drop count and the share of trained samples from forked rollouts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import dashboard
import train_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """The benchmark as a module, imported by name so that TRL's spawned rollout child can unpickle its sessions."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import rollout_pipeline

        yield rollout_pipeline
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_every_logged_step_carries_the_stale_drop_count_and_the_fork_fraction(bench, tmp_path):
    """Two groups in flight at staleness 0: the second is one version old when it is pulled, so TRL drops it; every
    rollout forks into two rows, so a step of 8 samples trains 4 rollouts. Steps without a drop still say 0."""
    from tiny_lfm2 import save_tiny_model
    from trackio.sqlite_storage import SQLiteStorage

    args = bench.parse_args(["--settings", "16:0", "--distributions", "constant", "--steps", "3",
                             "--minute-s", "0.05", "--fork-frac", "1"])
    save_tiny_model(tmp_path / "model")
    logs, clock = bench.train_run(16, 0, "constant", args, tmp_path, report_to="trackio")

    steps = bench.warmup_steps(16, 0) + 3
    assert [entry["step"] for entry in logs] == list(range(1, steps + 1)) and len(clock.ends) == steps
    drops = [entry.get(train_metrics.DROPPED_STALE) for entry in logs]
    assert None not in drops, drops  # on every step, 0 where TRL dropped nothing
    assert 0.0 in drops and sum(drops) >= 8, drops  # step 1 trains fresh samples; stale ones are counted later
    assert [entry.get(train_metrics.FORKED_FRAC) for entry in logs] == [1.0] * steps
    assert all(entry["batch/samples_per_step"] == 8 for entry in logs)
    # TRL's own rate, forks per turn transition, on the steps whose window saw a rollout finish.
    assert {entry["rollout/fork_frac"] for entry in logs if "rollout/fork_frac" in entry} == {1.0}

    project = dashboard.project(bench.ADAPTER_REPO)
    (run,) = SQLiteStorage.get_runs(project)
    rows = [row for row in SQLiteStorage.get_logs(project, run) if "train/loss" in row]
    assert [row[f"train/{train_metrics.DROPPED_STALE}"] for row in rows] == drops
    assert [row[f"train/{train_metrics.FORKED_FRAC}"] for row in rows] == [1.0] * steps
