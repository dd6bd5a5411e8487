"""eval_watch against the local Hub double and vLLM's LoRA endpoints (doubled): checkpoint discovery, hot-load
order, reused base cells, resume after a kill, two writers on one summary, idle stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hub_double import LocalHub
from huggingface_hub.errors import HfHubHTTPError
from test_eval_adapter import _run_eval_job, make_eval_job
from vllm_lora_double import EvalFactoryDouble, Killed, VllmLoraDouble, save_tiny_adapter

import adapter_repo
import dashboard
import eval_adapter as ea
import eval_watch as ew
import export_adapter
import recipe
import smoke_report
from adapter_repo import COMPLETE_MARKER, push_folder
from tests import offline

REPO = "you/LFM2.5-2.6B-opencode-lora-RL"
N_TASKS = 5
TASKS = [{"index": i, "task_name": f"task_{i}"} for i in range(12)]


def outcome(task, model):
    """Base solves even tasks; checkpoint-N solves tasks below N/50; one base cell never runs."""
    if model == recipe.SERVED_MODEL_NAME:
        return None if task == 11 else float(task % 2 == 0)
    step = 1000 if model.endswith("final") else int(model.rsplit("-", 1)[1])
    return float(task < step // 50)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return save_tiny_adapter(tmp_path_factory.mktemp("adapter"))


@pytest.fixture()
def hub(tmp_path):
    api = LocalHub(tmp_path / "hub")
    api.create_repo(REPO)
    return api


@pytest.fixture()
def vllm():
    with VllmLoraDouble(recipe.SERVED_MODEL_NAME) as server:
        yield server


@pytest.fixture(autouse=True)
def _push_often(monkeypatch):
    monkeypatch.setattr(recipe, "EVAL_PUSH_EVERY", 2)


class Clock:
    """Fake time for the poll loop; `on_sleep` callbacks let a test push new checkpoints between polls."""

    def __init__(self, *on_sleep):
        self.now, self.sleeps, self.on_sleep = 0.0, 0, list(on_sleep)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep:
            self.on_sleep.pop(0)()


def watcher(hub, vllm, factory, work, clock=None, **kwargs):
    clock = clock or Clock()
    return ew.Watcher(hub, REPO, factory, ea.LoraServer(vllm.url), TASKS, work, n_tasks=N_TASKS, concurrency=1,
                      poll_s=60, max_idle_s=kwargs.pop("max_idle_s", 3600), clock=clock, sleep=clock.sleep, **kwargs)


def repo_json(hub, path, repo=REPO):
    return json.loads((hub.root / repo / path).read_text())


# --- pure parts -----------------------------------------------------------------------------------
def test_discover_orders_by_step_and_ignores_half_uploaded():
    files = ["README.md"]
    for step in (1000, 200, 100):
        files += [f"checkpoint-{step}/adapter_model.safetensors", f"checkpoint-{step}/adapter_config.json",
                  f"checkpoint-{step}/{COMPLETE_MARKER}"]
    files += ["checkpoint-300/adapter_model.safetensors", "checkpoint-300/adapter_config.json"]  # marker not yet
    files += ["checkpoint-400/adapter_config.json", f"checkpoint-400/{COMPLETE_MARKER}"]  # weights missing
    assert adapter_repo.complete_checkpoints(files) == [100, 200, 1000]  # what Watcher.pending evaluates, in order


def test_choose_subset_is_fixed_and_seeded():
    subset = ea.choose_subset(250, 100)
    assert subset == ea.choose_subset(250, 100) == sorted(set(subset))
    assert len(subset) == 100 and all(0 <= i < 250 for i in subset)
    assert subset != ea.choose_subset(250, 100, seed=recipe.EVAL_SEED + 1)
    assert ea.choose_subset(10, 10) == list(range(10))


# --- the watcher ----------------------------------------------------------------------------------
def test_watcher_evaluates_checkpoints_in_order_and_stops_after_final(hub, vllm, adapter_dir, tmp_path):
    push_folder(hub, REPO, adapter_dir, "checkpoint-200", marker=True)
    push_folder(hub, REPO, adapter_dir, "checkpoint-100", marker=True)
    hub.upload_folder(repo_id=REPO, folder_path=adapter_dir, path_in_repo="checkpoint-300")  # half-uploaded
    clock = Clock(lambda: push_folder(hub, REPO, adapter_dir, "checkpoint-300", marker=True),
                  lambda: push_folder(hub, REPO, adapter_dir, ""))  # the training job's final adapter
    factory = EvalFactoryDouble(vllm.url, outcome)
    board = dashboard.EvalDashboard(REPO, "eval-watch", {"DASHBOARD_SPACE": "local", "JOB_ID": tmp_path.name})
    assert watcher(hub, vllm, factory, tmp_path / "w", clock, board=board).run() == "final"
    board.finish()

    models = [m for i, (_, m) in enumerate(factory.calls) if i == 0 or factory.calls[i - 1][1] != m]
    assert models == [recipe.SERVED_MODEL_NAME] + [f"opencode-lora-{c}" for c in
                                                   ("checkpoint-100", "checkpoint-200", "checkpoint-300", "final")]
    lora_calls = [(p.rsplit("/", 1)[1], b["lora_name"]) for m, p, b in vllm.requests if m == "POST"]
    expected = []
    for c in ("checkpoint-100", "checkpoint-200", "checkpoint-300", "final"):
        expected += [("load_lora_adapter", f"opencode-lora-{c}"), ("unload_lora_adapter", f"opencode-lora-{c}")]
    assert lora_calls == expected and vllm.loras == {}

    subset = repo_json(hub, adapter_repo.WATCH_BASE_PATH)["subset"]
    assert subset == ea.choose_subset(len(TASKS), N_TASKS)
    base_calls = [t for t, m in factory.calls if m == recipe.SERVED_MODEL_NAME]
    unscorable = 11 in subset
    assert len(base_calls) == N_TASKS + unscorable * (recipe.EVAL_CELL_ATTEMPTS - 1)
    assert clock.sleeps == 2
    summary = assert_summary_is_recount(hub)
    assert_trackio_curve(summary, f"eval-watch-{tmp_path.name}")


def assert_trackio_curve(summary, run):
    """The learning curve read back from Trackio's local storage: one point per checkpoint step, with the base line.

    The final adapter has checkpoint-300's step (it is that step's weights), so it adds no second point there.
    """
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs(dashboard.project(REPO), run)
    assert [row["step"] for row in rows] == [100, 200, 300]
    by_step = {r["step"]: r for r in summary["checkpoints"] if r["checkpoint"] != adapter_repo.FINAL}
    for row in rows:
        expected = by_step[row["step"]]
        assert row["eval/pass_at_1"] == expected["pass_at_1"]
        assert [row["eval/pass_at_1_ci95_low"], row["eval/pass_at_1_ci95_high"]] == expected["ci95"]
        assert row["eval/base_pass_at_1"] == summary["base"]["pass_at_1"]
        assert [row["eval/base_ci95_low"], row["eval/base_ci95_high"]] == summary["base"]["ci95"]


def assert_summary_is_recount(hub):
    """eval/summary.json's numbers equal a recount from the per-checkpoint files in the repo."""
    summary = repo_json(hub, adapter_repo.SUMMARY_PATH)
    base = ea.rewards(repo_json(hub, adapter_repo.WATCH_BASE_PATH)["cells"], "base")
    rows = summary["checkpoints"]
    names = adapter_repo.watched_checkpoints(hub.list_repo_files(REPO))
    assert {r["checkpoint"] for r in rows} == set(names)
    assert rows == sorted(rows, key=lambda r: (r["checkpoint"] == adapter_repo.FINAL, r["step"]))
    for row in rows:
        doc = repo_json(hub, adapter_repo.watch_results_path(row["checkpoint"]))
        cells = doc["cells"]
        assert len(cells) == len({c["task_index"] for c in cells}) == N_TASKS and doc["complete"]
        recount = ea.summarize(base, ea.rewards(cells, "adapter"))
        assert {k: row[k] for k in ("correct", "scored", "unscorable", "pass_at_1")} == {
            k: recount["adapter"][k] for k in ("correct", "scored", "unscorable", "pass_at_1")}
        assert row["paired"] == recount["paired"]
    assert summary["base"] == ea.summarize(base, {})["base"]
    return summary


def test_killed_watcher_resumes_mid_checkpoint_without_recomputing(hub, vllm, adapter_dir, tmp_path):
    push_folder(hub, REPO, adapter_dir, "checkpoint-100", marker=True)
    push_folder(hub, REPO, adapter_dir, "checkpoint-200", marker=True)
    push_folder(hub, REPO, adapter_dir, "")
    subset = ea.choose_subset(len(TASKS), N_TASKS)
    base_rollouts = N_TASKS + (11 in subset) * (recipe.EVAL_CELL_ATTEMPTS - 1)
    kill_at = base_rollouts + N_TASKS + 3  # base, all of checkpoint-100, then 3 cells into checkpoint-200
    killer = EvalFactoryDouble(vllm.url, outcome, kill_after=kill_at)
    with pytest.raises(Killed):
        watcher(hub, vllm, killer, tmp_path / "first").run()
    half = repo_json(hub, adapter_repo.watch_results_path("checkpoint-200"))
    assert len(half["cells"]) == 2 and not half["complete"]  # pushed every 2 cells; the 3rd was lost with the kill
    assert vllm.loras == {}

    factory = EvalFactoryDouble(vllm.url, outcome)
    assert watcher(hub, vllm, factory, tmp_path / "second").run() == "final"
    assert all(m != recipe.SERVED_MODEL_NAME for _, m in factory.calls)  # base cells reused from the repo
    assert all(m != "opencode-lora-checkpoint-100" for _, m in factory.calls)  # finished checkpoint skipped
    done_before = {c["task_index"] for c in half["cells"]}
    redone = [t for t, m in factory.calls if m == "opencode-lora-checkpoint-200"]
    assert sorted(redone) == sorted(set(subset) - done_before)
    assert len([1 for _, m in factory.calls if m == "opencode-lora-final"]) == N_TASKS
    summary = assert_summary_is_recount(hub)
    assert [r["checkpoint"] for r in summary["checkpoints"]] == ["checkpoint-100", "checkpoint-200", "final"]
    assert summary["final_evaluated"]

    third = EvalFactoryDouble(vllm.url, outcome)  # and a third start finds nothing left to do
    assert watcher(hub, vllm, third, tmp_path / "third").run() == "final" and third.calls == []


def card_of(hub, tmp_path) -> str:
    """The model card export_adapter.py writes for the final adapter from the repo as it is now."""
    out = tmp_path / "export"
    rc = export_adapter.main(["--source", REPO, "--target", "alice/card-check", "--local-dir", str(out)],
                             env={}, make_api=lambda token: hub, stored_token=lambda: None)
    assert rc == 0
    return (out / "adapter" / "README.md").read_text()


def final_row(hub) -> dict:
    rows = repo_json(hub, adapter_repo.SUMMARY_PATH)["checkpoints"]
    [row] = [r for r in rows if r["checkpoint"] == adapter_repo.FINAL]
    return row


def full_eval(hub, vllm, tmp_path) -> tuple[dict, EvalFactoryDouble]:
    factory = EvalFactoryDouble(vllm.url, outcome)
    doc = ea.evaluate(hub, REPO, adapter_repo.FINAL, factory, TASKS, ea.LoraServer(vllm.url), tmp_path / "full",
                      concurrency=1)
    return doc, factory


def assert_card_has_the_full_eval(card: str, full: dict) -> None:
    base = full["summary"]["base"]
    assert "## Evaluation" in card and f"({base['correct']}/{base['scored']})" in card
    assert base["tasks"] == len(TASKS)


def test_full_eval_then_watcher_each_keep_their_own_file(hub, vllm, adapter_dir, tmp_path):
    """Defect 3, watcher last: its final point comes from its own subset and the card keeps the full eval."""
    push_folder(hub, REPO, adapter_dir, "checkpoint-100", marker=True)
    push_folder(hub, REPO, adapter_dir, "")
    full, _ = full_eval(hub, vllm, tmp_path)
    factory = EvalFactoryDouble(vllm.url, outcome)
    assert watcher(hub, vllm, factory, tmp_path / "w").run() == "final"
    assert len([1 for _, m in factory.calls if m == "opencode-lora-final"]) == N_TASKS  # evaluated, not skipped
    row = final_row(hub)
    assert row["complete"] and row["scored"] + row["unscorable"] == N_TASKS
    assert repo_json(hub, adapter_repo.full_results_path(adapter_repo.FINAL)) == full
    assert_card_has_the_full_eval(card_of(hub, tmp_path), full)


def test_watcher_then_full_eval_each_keep_their_own_file(hub, vllm, adapter_dir, tmp_path):
    """Defect 3, full eval last: it runs every task itself (no subset cells adopted), the curve is unchanged."""
    push_folder(hub, REPO, adapter_dir, "")
    w = watcher(hub, vllm, EvalFactoryDouble(vllm.url, outcome), tmp_path / "w")
    assert w.run() == "final"
    before = final_row(hub)
    full, factory = full_eval(hub, vllm, tmp_path)
    assert len(factory.calls) == 2 * len(TASKS) + recipe.EVAL_CELL_ATTEMPTS - 1  # base task 11 never scores
    assert w.publish_summary() and final_row(hub) == before
    assert_card_has_the_full_eval(card_of(hub, tmp_path), full)


class RacingHub(LocalHub):
    """The first summary commit loses a race: another watcher commits a checkpoint's results just before it."""

    def __init__(self, root, interleave):
        super().__init__(root)
        self.interleave, self.refused = interleave, 0

    def create_commit(self, repo_id, operations, **kwargs):
        if self.interleave and any(op.path_in_repo == adapter_repo.SUMMARY_PATH for op in operations):
            interleave, self.interleave = self.interleave, None
            interleave()
        try:
            return super().create_commit(repo_id, operations, **kwargs)
        except HfHubHTTPError as exc:
            self.refused += exc.response.status_code == 412  # LocalHub's compare-and-swap, as the Hub answers
            raise


def test_two_watchers_cannot_corrupt_the_summary(vllm, adapter_dir, tmp_path):
    def other_watcher():
        doc = {"checkpoint": "checkpoint-900", "step": 900, "complete": True,
               "cells": [{"side": "adapter", "task_index": i, "reward": 1.0, "unscorable": False, "attempts": 1}
                         for i in ea.choose_subset(len(TASKS), N_TASKS)]}
        LocalHub.upload_file(hub, path_or_fileobj=json.dumps(doc).encode(),
                             path_in_repo=adapter_repo.watch_results_path("checkpoint-900"), repo_id=REPO)

    hub = RacingHub(tmp_path / "hub", other_watcher)
    hub.create_repo(REPO)
    push_folder(hub, REPO, adapter_dir, "checkpoint-100", marker=True)
    push_folder(hub, REPO, adapter_dir, "")
    assert watcher(hub, vllm, EvalFactoryDouble(vllm.url, outcome), tmp_path / "w").run() == "final"
    assert hub.refused == 1  # the stale summary was refused by the compare-and-swap, then rebuilt
    summary = assert_summary_is_recount(hub)
    assert [r["checkpoint"] for r in summary["checkpoints"]] == ["checkpoint-100", "checkpoint-900", "final"]
    assert summary["checkpoints"][1]["pass_at_1"] == 1.0


def test_concurrent_cell_pushes_merge_instead_of_overwriting(hub, tmp_path):
    path = adapter_repo.watch_results_path("checkpoint-100")
    mine = ea.ResultsFile(tmp_path / "a.json", {"cells": [
        {"side": "adapter", "task_index": 1, "reward": 1.0, "unscorable": False, "attempts": 1}]})
    theirs = {"cells": [{"side": "adapter", "task_index": 2, "reward": 0.0, "unscorable": False, "attempts": 1},
                        {"side": "adapter", "task_index": 1, "reward": None, "unscorable": True, "attempts": 1}]}
    hub.upload_file(path_or_fileobj=json.dumps(theirs).encode(), path_in_repo=path, repo_id=REPO)
    ea.push_results(hub, REPO, path, mine)
    cells = repo_json(hub, path)["cells"]
    assert [(c["task_index"], c["reward"]) for c in cells] == [(1, 1.0), (2, 0.0)]


# --- a smoke run's watcher (issue 26 item 4) --------------------------------------------------------------------------
SMOKE = REPO + smoke_report.SMOKE_SUFFIX


def smoke_watcher(hub, vllm, factory, work, clock):
    return ew.Watcher(hub, SMOKE, factory, ea.LoraServer(vllm.url), TASKS, work, n_tasks=N_TASKS, concurrency=1,
                      poll_s=60, max_idle_s=3600, clock=clock, sleep=clock.sleep)


def smoke_run(hub, adapter_dir, tmp_path, vllm):
    """A whole earlier smoke run with its watcher: cleared, checkpoint-2 and final pushed and watched, reported."""
    hub.create_repo(SMOKE)
    smoke_report.clear(hub, SMOKE)
    push_folder(hub, SMOKE, adapter_dir, "checkpoint-2", marker=True)
    push_folder(hub, SMOKE, adapter_dir, "")
    first = EvalFactoryDouble(vllm.url, outcome)
    assert smoke_watcher(hub, vllm, first, tmp_path / "first", Clock()).run() == "final" and first.calls


def test_a_smoke_watcher_started_before_a_reruns_clear_adopts_only_the_rerun(hub, vllm, adapter_dir, tmp_path):
    """The previous smoke run's complete eval/watch/* files are there when the watcher starts; the re-run's clear comes
    later. The watcher waits for it and evaluates the re-run's own checkpoints, not 0 rollouts and "final"."""
    smoke_run(hub, adapter_dir, tmp_path, vllm)
    smoke_report.push(hub, SMOKE, {"verdict": "GO"})
    rewritten = save_tiny_adapter(tmp_path / "rerun", seed=1)
    clock = Clock(lambda: smoke_report.clear(hub, SMOKE),
                  lambda: push_folder(hub, SMOKE, rewritten, "checkpoint-2", marker=True),
                  lambda: push_folder(hub, SMOKE, rewritten, ""))
    factory = EvalFactoryDouble(vllm.url, outcome)
    assert smoke_watcher(hub, vllm, factory, tmp_path / "second", clock).run() == "final"
    models = [m for _, m in factory.calls]
    assert [m for i, m in enumerate(models) if i == 0 or models[i - 1] != m] == [
        recipe.SERVED_MODEL_NAME, "opencode-lora-checkpoint-2", "opencode-lora-final"]
    assert models.count("opencode-lora-final") == N_TASKS
    for path in (adapter_repo.WATCH_BASE_PATH, adapter_repo.watch_results_path("checkpoint-2")):
        assert repo_json(hub, path, SMOKE)["complete"]
    assert repo_json(hub, adapter_repo.SUMMARY_PATH, SMOKE)["final_evaluated"]


def test_a_smoke_watcher_whose_run_is_cleared_under_it_starts_over_on_the_new_run(hub, vllm, adapter_dir, tmp_path):
    """The watcher adopted a live smoke run and stored its base cells; then a re-run's clear deleted
    eval/watch/base.json under it. It starts over on the new run: the base cells are there at the end."""
    hub.create_repo(SMOKE)
    smoke_report.clear(hub, SMOKE)  # the run the watcher adopts
    clock = Clock(lambda: smoke_report.clear(hub, SMOKE),  # a re-run's clear, after the base cells were pushed
                  lambda: push_folder(hub, SMOKE, adapter_dir, "checkpoint-2", marker=True),
                  lambda: push_folder(hub, SMOKE, adapter_dir, ""))
    factory = EvalFactoryDouble(vllm.url, outcome)
    assert smoke_watcher(hub, vllm, factory, tmp_path / "w", clock).run() == "final"
    base = repo_json(hub, adapter_repo.WATCH_BASE_PATH, SMOKE)
    assert base["complete"] and len({c["task_index"] for c in base["cells"]}) == N_TASKS
    assert repo_json(hub, adapter_repo.SUMMARY_PATH, SMOKE)["base"]["tasks"] == N_TASKS
    base_calls = [m for _, m in factory.calls if m == recipe.SERVED_MODEL_NAME]
    retries = (11 in base["subset"]) * (recipe.EVAL_CELL_ATTEMPTS - 1)
    assert len(base_calls) == 2 * (N_TASKS + retries)  # the first run's base cells, then the new run's


# --- the watcher stops once the run it watches has ended (issue 43, item 1) ------------------------------------------
def start_job(hub, mode, repo):
    """A training (or smoke) job on `repo`, started as launch.py starts it; returns its id."""
    import launch

    spec = launch.job_spec(mode, "you/code", "0" * 40, {"ADAPTER_REPO": repo}, {"HF_TOKEN": "x"})
    return hub.run_job(**spec, token="x").id


def at_minutes(**events):
    """Clock callbacks for a 60 s poll: events["m30"] runs in the sleep that ends at minute 30."""
    return [events.get(f"m{minute}", lambda: None) for minute in range(1, 24 * 60)]


def test_a_smoke_watcher_stops_within_one_poll_of_its_runs_report(hub, vllm, adapter_dir, tmp_path, caplog):
    """Issue 43 (1): the smoke run fails half an hour in (its report, NO-GO, marks it finished); the watcher, launched
    with the smoke's 8 h idle limit, evaluates what the run pushed and stops at its next poll, saying why."""
    hub.create_repo(SMOKE)
    job = start_job(hub, "smoke", SMOKE)
    smoke_report.clear(hub, SMOKE)
    push_folder(hub, SMOKE, adapter_dir, "checkpoint-2", marker=True)

    def fail() -> None:
        smoke_report.push(hub, SMOKE, {"verdict": "NO-GO"})
        hub.end_job(job, "ERROR")

    clock = Clock(*at_minutes(m30=fail))
    caplog.set_level("INFO", logger="eval_watch")
    w = ew.Watcher(hub, SMOKE, EvalFactoryDouble(vllm.url, outcome), ea.LoraServer(vllm.url), TASKS, tmp_path / "w",
                   n_tasks=N_TASKS, concurrency=1, poll_s=60, max_idle_s=8 * 3600, clock=clock, sleep=clock.sleep)
    assert w.run() == "ended" and clock.now <= 30 * 60 + 60
    assert repo_json(hub, adapter_repo.watch_results_path("checkpoint-2"), SMOKE)["complete"]
    assert any("finished" in r.message and "stopping" in r.message for r in caplog.records)


@pytest.mark.parametrize("mode", ["smoke", "train"])
def test_a_watcher_stops_within_one_poll_of_its_training_job_crashing(hub, vllm, adapter_dir, tmp_path, caplog, mode):
    """Issue 43 (1): the training job dies without a word (no report, no final adapter): the platform ends it (its
    own watchdog fails a stalled trainer, STALL_MINUTES). A relaunch that is running by the next poll keeps the
    watcher on; once no training job runs on the repo, it stops at the next poll, naming the job."""
    repo = SMOKE if mode == "smoke" else REPO
    hub.create_repo(repo, exist_ok=True)
    first = start_job(hub, mode, repo)
    if mode == "smoke":
        smoke_report.clear(hub, repo)
    push_folder(hub, repo, adapter_dir, "checkpoint-2", marker=True)
    later: list[str] = []

    def relaunch() -> None:
        hub.end_job(first, "ERROR")
        later.append(start_job(hub, mode, repo))

    clock = Clock(*at_minutes(m10=relaunch if mode == "train" else lambda: hub.end_job(first, "ERROR"),
                              m60=lambda: hub.end_job(later[0], "ERROR") if later else None))
    caplog.set_level("INFO", logger="eval_watch")
    w = ew.Watcher(hub, repo, EvalFactoryDouble(vllm.url, outcome), ea.LoraServer(vllm.url), TASKS, tmp_path / "w",
                   n_tasks=N_TASKS, concurrency=1, poll_s=60, max_idle_s=8 * 3600, clock=clock, sleep=clock.sleep)
    assert w.run() == "ended"
    ended = later[0] if later else first
    assert clock.now <= (60 if later else 10) * 60 + 60
    assert any(ended in r.message and "ERROR" in r.message for r in caplog.records)


def test_a_watcher_whose_head_read_lags_evaluates_each_checkpoint_at_a_commit_that_holds_its_weights(hub, vllm,
                                                                                                    tmp_path):
    """FACTS "Hub commits": repo_info can answer a head older than the latest push. Safe as it is: the watcher lists
    the checkpoints and downloads them at that one head, an immutable commit, so it never asks for a checkpoint the
    head lacks nor gets other weights under a checkpoint's name; a later poll, reading a newer head, finds the rest."""
    pushed = {name: save_tiny_adapter(tmp_path / name, seed=seed)
              for seed, name in enumerate(["checkpoint-100", "checkpoint-200", adapter_repo.FINAL])}
    push_folder(hub, REPO, pushed["checkpoint-100"], "checkpoint-100", marker=True)
    assert watcher(hub, vllm, EvalFactoryDouble(vllm.url, outcome), tmp_path / "w1", max_idle_s=0).run() == "idle"
    hub.stale_reads = 2  # the head reads after the final push answer the commit holding checkpoint-200 only
    push_folder(hub, REPO, pushed["checkpoint-200"], "checkpoint-200", marker=True)
    push_folder(hub, REPO, pushed[adapter_repo.FINAL], "")

    factory = EvalFactoryDouble(vllm.url, outcome)
    assert watcher(hub, vllm, factory, tmp_path / "w2").run() == "final"
    assert [m for _, m in factory.calls] == ["opencode-lora-checkpoint-200"] * N_TASKS + [
        "opencode-lora-final"] * N_TASKS
    for name, folder in pushed.items():
        doc = repo_json(hub, adapter_repo.watch_results_path(name))
        assert doc["complete"] and doc["weights"]["adapter"] == ea.adapter_weights(folder)
        assert adapter_repo.checkpoint_complete(hub.list_repo_files(REPO, revision=doc["adapter_revision"]), name)
    lagged = repo_json(hub, adapter_repo.watch_results_path("checkpoint-200"))["adapter_revision"]
    assert not adapter_repo.checkpoint_complete(hub.list_repo_files(REPO, revision=lagged), adapter_repo.FINAL)


def test_idle_watcher_stops_after_max_idle_hours(hub, vllm, tmp_path):
    clock = Clock()
    factory = EvalFactoryDouble(vllm.url, outcome)
    assert watcher(hub, vllm, factory, tmp_path / "w", clock, max_idle_s=600).run() == "idle"
    assert clock.sleeps == 11 and clock.now == 660  # polls at 0, 60, ..., 600 are within the idle limit
    assert repo_json(hub, adapter_repo.SUMMARY_PATH)["checkpoints"] == []


def test_restart_with_a_different_n_tasks_is_refused(hub, vllm, tmp_path):
    watcher(hub, vllm, EvalFactoryDouble(vllm.url, outcome), tmp_path / "w", max_idle_s=0).run()
    w = ew.Watcher(hub, REPO, EvalFactoryDouble(vllm.url, outcome), ea.LoraServer(vllm.url), TASKS, tmp_path / "x",
                   n_tasks=N_TASKS + 1, concurrency=1)
    with pytest.raises(recipe.ConfigError, match=f"use N_TASKS={N_TASKS}"):
        w.run()


def test_run_eval_watch_dry_run_prints_the_watch_plan():
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DRY_RUN": "1", "ADAPTER_REPO": REPO,
           "HF_TOKEN": "hf_SECRETSECRET", "SPACE_HOST": "https://abc--8000.hf.jobs/", "N_TASKS": "40"}
    result = subprocess.run(["bash", str(root / "run_eval_watch.sh")], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--enable-lora" in result.stdout and "SPACE_HOST=abc--8000.hf.jobs " in result.stdout
    assert f"N_TASKS=40 MAX_IDLE_HOURS={recipe.MAX_IDLE_HOURS:g} {sys.executable} {root}/eval_watch.py" in result.stdout
    assert "hf_SECRETSECRET" not in result.stdout + result.stderr
    preflight = next(line for line in result.stdout.splitlines() if "] preflight: " in line)
    assert f"mode=watch n_tasks=40 max_idle_hours={recipe.MAX_IDLE_HOURS:g} " in preflight
    assert "checkpoint=" not in preflight  # the watcher evaluates every checkpoint, not `final`
    bad = subprocess.run(["bash", str(root / "run_eval_watch.sh")], env={**env, "N_TASKS": "0"}, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "N_TASKS=0 is out of range: use 1..250" in bad.stderr


def test_watcher_waits_for_the_training_job_to_create_the_repo(vllm, tmp_path):
    hub = LocalHub(tmp_path / "hub")
    clock = Clock(lambda: None, lambda: hub.create_repo(REPO))  # the trainer starts a little later than the watcher
    factory = EvalFactoryDouble(vllm.url, outcome)
    assert watcher(hub, vllm, factory, tmp_path / "w", clock, max_idle_s=120).run() == "idle"
    assert clock.sleeps == 2 + 3 and factory.calls  # two polls for the repo, then its base cells and an idle stop
    other = ew.Watcher(hub, "you/other", factory, ea.LoraServer(vllm.url), TASKS, tmp_path / "x", max_idle_s=120,
                       poll_s=60, clock=clock, sleep=clock.sleep)
    with pytest.raises(recipe.ConfigError, match="you/other not found after 0.0 h"):
        other.run()


def test_run_eval_watch_runs_the_watcher_and_a_failed_eval_fails_the_job(tmp_path):
    result, log = _run_eval_job(make_eval_job(tmp_path), "run_eval_watch.sh", N_TASKS="7", STUB_EVAL_RC="3")
    assert result.returncode != 0 and "run_eval: FAILED" in result.stdout
    assert any(line.startswith("eval eval_watch.py ") and " N_TASKS=7 " in line and line.endswith(
        "vllm_up=True env_up=True") for line in log)


@pytest.mark.parametrize(("script", "env", "line"), [
    ("eval_watch.py", {"ADAPTER_REPO": REPO}, "eval_watch: HF_TOKEN is not set"),
    ("eval_adapter.py", {"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "CHECKPOINT": "step-5"},
     "eval_adapter: CHECKPOINT='step-5' is not a checkpoint name"),
    ("eval_watch.py", {"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "N_TASKS": "abc"},
     "eval_watch: N_TASKS='abc' is not a whole number"),
    ("eval_watch.py", {"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "MAX_IDLE_HOURS": "six"},
     "eval_watch: MAX_IDLE_HOURS='six' is not a positive number"),
    ("eval_adapter.py", {"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "EVAL_CONCURRENCY": "x"},
     "eval_adapter: EVAL_CONCURRENCY='x' is not a whole number"),
    # Issue 26: the job installs only harbor[hf-sandbox]; another backend failed at every sandbox creation.
    ("eval_adapter.py", {"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "SANDBOX": "modal"},
     "eval_adapter: SANDBOX='modal' is not offered"),
    ("eval_watch.py", {"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "SANDBOX": "hf_sandbox"},
     "eval_watch: SANDBOX='hf_sandbox' is not offered"),
])
def test_entry_points_refuse_bad_input_with_one_line(script, env, line):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    base = {k: v for k, v in os.environ.items() if k not in {"HF_TOKEN", "ADAPTER_REPO", "CHECKPOINT"}}
    result = subprocess.run([sys.executable, str(root / script)], env={**base, **env}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stderr.startswith(line) and len(result.stderr.splitlines()) == 1


def test_offline_watcher_is_one_line(tmp_path):
    env = offline.offline_env(tmp_path, ADAPTER_REPO=REPO, ENV_URL=offline.closed_url())
    proc = offline.run(["eval_watch.py"], env)
    line = offline.one_line(proc, "eval_watch")  # the env server is asked first, then the Hub
    assert line.startswith(f"eval_watch: could not reach {env['ENV_URL']}/health (ConnectError")
    assert line.endswith("start it or fix the URL, and rerun") and proc.stdout == ""
