"""train_metrics.py's step metrics and Trackio callback, on TRL 1.15's metric sink and reduction (the rehearsal runs
them live); the rollout counts are the ledger's, tested in test_train_rollouts.py."""

from __future__ import annotations

from collections import defaultdict

from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

import train_metrics


def test_ratio_range_covers_only_the_steps_own_samples():
    sink = defaultdict(list)
    callback = train_metrics.RatioRange(sink)
    sink["ratio"] += [1.0, 0.98, 1.03]
    callback.on_step_end(None, None, None)
    sink["ratio"] += [0.9, 1.1]  # a second step in the same logging window
    callback.on_step_end(None, None, None)
    assert (sink["ratio/sample_min"], sink["ratio/sample_max"]) == ([0.98, 0.9], [1.03, 1.1])
    assert (_reduce_metric("ratio/sample_min", sink["ratio/sample_min"]),
            _reduce_metric("ratio/sample_max", sink["ratio/sample_max"])) == (0.9, 1.1)
    callback.on_log(None, None, None)
    sink.clear()  # what TRL's log() does right after the callbacks
    sink["ratio"] += [1.2]
    callback.on_step_end(None, None, None)
    assert (sink["ratio/sample_min"], sink["ratio/sample_max"]) == ([1.2], [1.2])


def test_trackio_callback_logs_each_step_at_its_optimizer_step(tmp_path, capsys):
    """A resumed run is a new job (a new Trackio run): its points must land at the real steps, as the eval's do."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", project="callback-test",
                             run_name=f"train-{tmp_path.name}", trackio_space_id=None, use_cpu=True)
    state = TrainerState(global_step=201)
    callback = train_metrics.SafeTrackioCallback()
    callback.on_train_begin(args, state, TrainerControl())
    callback.on_log(args, state, TrainerControl(), logs={"loss": 0.5, "ratio/sample_min": 0.99})
    state.global_step = 202
    callback.on_log(args, state, TrainerControl(), logs={"loss": 0.25, "train_runtime": 9.0})
    trackio.finish()
    rows = SQLiteStorage.get_logs("callback-test", f"train-{tmp_path.name}")
    assert [(r["step"], r["train/global_step"], r["train/loss"]) for r in rows] == [(201, 201, 0.5), (202, 202, 0.25)]
    assert rows[0]["train/ratio/sample_min"] == 0.99 and "train_runtime" not in rows[1]
    assert callback.url is None and "dashboard: no dashboard Space" in capsys.readouterr().out
