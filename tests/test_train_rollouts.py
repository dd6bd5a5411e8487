"""Rollout-level failures (issue 20) and the task-map race (issue 14, defect 7), through TRL 1.15's real rollout loop.

The worker comes from `train_lora.rollout_worker()` and its loop is built from the worker's pickled kwargs, as
TRL's spawned child builds it; each rollout runs through the real `_HarnessRolloutLoop._run_session`. Only the
sessions are stand-ins (`tests/fake_sessions.py`, each saying which real code it mirrors).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.state import PartialState
from datasets import Dataset
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

import recipe
import train_lora
import train_metrics
from tests.fake_sessions import (
    FAULTS,
    TASKS,
    FakeSessionFactory,
    FaultySessionFactory,
    PlannedSessionFactory,
)
from tests.tiny_lfm2 import save_tiny_model
from tests.trl_cpu_shims import cpu_trainer_shims

REPO = "me/LFM2.5-2.6B-opencode-lora-RL"
PROMPT = [{"role": "user", "content": TASKS[0]}]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer_and_settings(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    settings = train_lora.settings_from_env({"ADAPTER_REPO": REPO, "HF_TOKEN": "hf_x", "MODEL": str(model_dir),
                                             "DEVICE": "cpu"})
    return train_lora.load_tokenizer(settings), settings


@pytest.fixture
def make_loop(tokenizer_and_settings, tmp_path):
    """`make_loop(factory)` -> (TRL's rollout loop as its child builds it, the run's settings); torn down after."""
    tokenizer, base = tokenizer_and_settings
    settings = train_lora.Settings(**{**base.__dict__, "heartbeat_file": str(tmp_path / "heartbeat")})
    PartialState()  # what TRL's _child_main does before building the loop
    loops = []

    def make(factory):
        dataset = Dataset.from_list(functools.partial(FakeSessionFactory)().prompt_rows())
        with cpu_trainer_shims():
            worker = train_lora.rollout_worker(settings, tokenizer, dataset, factory)
        kwargs = pickle.loads(pickle.dumps(worker._loop_kwargs))  # what the spawned child receives
        loop = worker._loop_cls(**kwargs, rollout_buffer=queue.Queue(), model_version_value=SimpleNamespace(value=0),
                                heartbeat_value=SimpleNamespace(value=time.time()), failed_event=threading.Event(),
                                exception_info_queue=queue.Queue(maxsize=1), metrics_queue=queue.Queue())
        loops.append(loop)
        return loop, settings

    yield make
    for loop in loops:
        loop._session_pool.shutdown(wait=True)
        loop._tool_pool.shutdown(wait=True)
        loop._loop.close()


def ledger(settings) -> dict:
    """The counts the guard writes next to the heartbeat (docs/training.md: "Rollout failures")."""
    return json.loads(recipe.work_file(settings.heartbeat_file, recipe.LEDGER_NAME).read_text())


# --- one test per failure class --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_rollout_costs_that_rollout_only_and_is_counted(make_loop, fault):
    loop, settings = make_loop(functools.partial(FaultySessionFactory, fault=fault))
    (completion, completion_ids, sequences, tool_calls, tool_failures, reward), _ = loop._run_session(PROMPT, 0)
    if FAULTS[fault] is None:  # agent timeout: TRL trains the captured turns, flagged timed out
        assert sequences and reward is not None
        counts = ledger(settings)
        assert counts["rollouts"] == counts["scored"] == counts["timed_out"] == 1 and counts["unscorable_total"] == 0
        return
    # Unscorable: no reward, so TRL leaves it out of the group baseline (and trains nothing from it).
    assert reward is None and sequences == []
    counts = ledger(settings)
    assert counts["rollouts"] == 1
    assert counts["unscorable"][FAULTS[fault]] == 1 and counts["unscorable_total"] == 1 and counts["scored"] == 0
    assert counts["last_error"]["class"] == FAULTS[fault] and counts["last_error"]["error"]
    assert counts["stopped"] is None


def test_a_graded_rollout_whose_agent_exited_non_zero_is_trained_with_its_grade(make_loop):
    """Issue 29 defect 6, training side: wait_for_completion() returns 1 but Harbor graded the rollout; it counts."""
    loop, settings = make_loop(functools.partial(FaultySessionFactory, fault="agent_exit"))
    (_, _, sequences, _, _, reward), _ = loop._run_session(PROMPT, 0)
    assert sequences and reward == 0.0
    counts = ledger(settings)
    assert (counts["rollouts"], counts["scored"], counts["unscorable_total"]) == (1, 1, 0)


def test_a_scored_rollout_is_counted_and_ends_a_failure_streak(make_loop):
    loop, settings = make_loop(functools.partial(FakeSessionFactory))
    _, metrics = loop._run_session(PROMPT, 0)
    assert metrics is not None
    counts = ledger(settings)
    assert (counts["rollouts"], counts["scored"], counts["unscorable_total"], counts["streak"]) == (1, 1, 0, 0)


def test_each_finished_rollout_is_one_line_of_the_rollout_log_with_task_reward_outcome_and_trial(make_loop):
    """Beside the counts, rollout_log.jsonl says which rollout ended how (appended across starts): its task, reward,
    outcome (scored, timed_out, or its unscorable class), error, and its Harbor trial folder where it had one."""
    outcomes = []
    for factory in (functools.partial(FakeSessionFactory), functools.partial(FaultySessionFactory, fault="verifier"),
                    functools.partial(FaultySessionFactory, fault="timeout")):
        loop, settings = make_loop(factory)  # each a new start on the same heartbeat folder
        (*_, reward), _ = loop._run_session(PROMPT, 0)
        outcomes.append(reward)
    log = recipe.work_file(settings.heartbeat_file, recipe.ROLLOUT_LOG_NAME)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # `reward` is the verifier's grade (TRL's trained reward adds the tool bonus to a right answer's); the faulty
    # fakes grade every rollout 1.0.
    graded = [None if r is None else float(r >= recipe.CORRECT_REWARD) for r in outcomes]
    assert graded[1:] == [None, 1.0]
    assert [(r["task"], r["outcome"], r["reward"]) for r in lines] == [
        ("task-0", "scored", graded[0]), ("task-0", "verifier", None), ("task-0", "timed_out", 1.0)]
    assert "verifier" in lines[1]["error"] and lines[0]["error"] == ""
    assert all(r["trial"] is None and r["trial_kept"] is None for r in lines)  # the fakes run no Harbor trial


def test_systematic_failure_stops_the_worker_with_one_line_naming_class_and_error(make_loop):
    """Every session create fails (env server down): the real loop stops itself, no endless unscorable spin."""
    loop, settings = make_loop(functools.partial(FaultySessionFactory, fault="create"))

    def run() -> None:
        try:
            loop.run()
        except BaseException:  # noqa: BLE001 - the stop itself; its report is read off the loop below
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        stopped = loop._failed_event.wait(timeout=60)
    finally:
        with contextlib.suppress(RuntimeError):  # "Event loop is closed": the loop already stopped on its own
            loop._loop.call_soon_threadsafe(loop._stop_event.set)
        thread.join(timeout=30)
    assert stopped, "the rollout loop kept scoring failed rollouts as unscorable and never stopped"
    type_name, message, _ = loop._exception_info_queue.get_nowait()  # what the trainer's check_health raises
    assert type_name == "SystematicRolloutFailure"
    assert f"{recipe.ROLLOUT_ABORT_STREAK} rollouts in a row were unscorable (create " in message
    assert "last: create: ConnectionError: env server refused the session" in message and "\n" not in message
    counts = ledger(settings)
    assert counts["stopped"] == message and counts["unscorable"]["create"] >= recipe.ROLLOUT_ABORT_STREAK


def test_train_lora_main_ends_a_systematic_stop_with_that_one_line(tmp_path, monkeypatch, capsys):
    import train_rollouts

    heartbeat = tmp_path / "heartbeat"

    def failing_train(settings, **_):
        guard = train_rollouts.Ledger(recipe.work_file(settings.heartbeat_file, recipe.LEDGER_NAME))
        with pytest.raises(train_rollouts.SystematicRolloutFailure):
            for _ in range(recipe.ROLLOUT_ABORT_STREAK):
                guard.record("rollout", "exit code 1: sandbox failed to boot")
        raise RuntimeError("Rollout worker child has failed; see chained exception.")  # TRL's words

    monkeypatch.setattr(train_lora, "train", failing_train)
    monkeypatch.setattr(os, "environ", {"ADAPTER_REPO": REPO, "HF_TOKEN": "hf_x", "HEARTBEAT_FILE": str(heartbeat)})
    assert train_lora.main([]) == 1
    [last] = capsys.readouterr().err.strip().splitlines()  # the verdict alone (DEBUG=1 adds TRL's traceback)
    assert last.startswith("train_lora.py: rollouts are failing systematically: 32 rollouts in a row")
    assert "(rollout 32); last: rollout: exit code 1: sandbox failed to boot" in last


def test_guard_trips_on_a_failure_rate_over_the_window_too(tmp_path):
    import train_rollouts

    guard = train_rollouts.Ledger(tmp_path / "rollouts.json", streak_limit=1000, window=10, max_unscorable=0.5)
    for i in range(9):  # alternate: never a streak, 5 of 9 unscorable but the window is not full yet
        guard.record("capture" if i % 2 == 0 else None, "409 from the proxy")
    with pytest.raises(train_rollouts.SystematicRolloutFailure, match=r"6 of the last 10 rollouts were unscorable"):
        guard.record("capture", "409 from the proxy")
    assert json.loads((tmp_path / "rollouts.json").read_text())["stopped"].startswith("rollouts are failing")


# --- one rollout counter: the dashboard logs the ledger's growth per step -------------------------------------------
def logged_step(growth) -> dict:
    """What TRL logs for one optimizer step of the ledger's growth (train_metrics.StepObjective adds it to the step's
    metrics): each key reduced as TRL reduces it."""
    return {key: _reduce_metric(key, [value]) for key, value in growth.take().items()}


def quiet(**counts: float) -> dict:
    """A step's rollout counts: these, every other counter 0."""
    return {**dict.fromkeys(train_metrics.ROLLOUT_COUNTS, 0.0), **counts}


def test_each_step_logs_what_the_ledger_counted_since_the_previous_step(make_loop, tmp_path):
    """The guard's ledger is the one rollout counter. It is written in TRL's rollout child; the trainer reads the file
    each step (train_metrics.LedgerGrowth), so the dashboard shows the ledger's own numbers."""
    # Made before the rollout child starts, as train_metrics.attach makes it.
    growth = train_metrics.LedgerGrowth(recipe.work_file(tmp_path / "heartbeat", recipe.LEDGER_NAME))
    plan = ("scored", "forked", "timeout", "verifier", "create")
    loop, _ = make_loop(functools.partial(PlannedSessionFactory, plan=plan))
    results = [loop._run_session(PROMPT, 0)[0] for _ in range(3)]
    assert [len(sequences) for _, _, sequences, *_ in results] == [1, 2, 1]  # the forked rollout is two rows
    assert logged_step(growth) == quiet(**{
        "rollout/finished_total": 3.0, "rollout/timed_out_total": 1.0, "rollout/forked_total": 1.0,
        "rollout/tool_calls_mean": sum(r[3] for r in results) / 3})  # TRL's own count
    assert sum(r[3] for r in results) == 12  # 3 tool calls a turn; the forked rollout had two turns
    assert [loop._run_session(PROMPT, 0)[0][5] for _ in range(2)] == [None, None]
    # no rollout of this step ran to a reward: no tool-call mean
    assert logged_step(growth) == quiet(**{"rollout/finished_total": 2.0, "rollout/unscorable_total": 2.0})
    assert logged_step(growth) == quiet()  # every step has the keys


def test_a_timed_out_rollout_whose_verifier_wrote_no_reward_shows_as_timed_out_and_unscorable(make_loop, tmp_path):
    """The agent hit its time limit, then the verifier wrote no reward: the dashboard counts it under both, as the
    ledger (and so the smoke report) does. The old loop-side count saw only timed-out rollouts that were scored."""
    growth = train_metrics.LedgerGrowth(recipe.work_file(tmp_path / "heartbeat", recipe.LEDGER_NAME))
    loop, settings = make_loop(functools.partial(PlannedSessionFactory, plan=("timeout_verifier",)))
    assert loop._run_session(PROMPT, 0)[0][5] is None
    assert (ledger(settings)["timed_out"], ledger(settings)["unscorable"]["verifier"]) == (1, 1)
    assert logged_step(growth) == quiet(**{"rollout/finished_total": 1.0, "rollout/unscorable_total": 1.0,
                                           "rollout/timed_out_total": 1.0})


def test_how_the_proxy_ended_a_rollout_is_in_its_log_line_the_ledger_and_the_steps_counts(make_loop, tmp_path):
    """Issue 41 defect 4: a graded rollout the proxy ended at its call budget, whose prompt outgrew the context and one
    of whose completions was cut at the output cap (openenv's result: budget_stop_count, which counts the context stop
    too, and the context_budget_exhausted finding; the captured response's finish_reason) trains as graded, and says
    so; a rollout that ended on its own says none of it."""
    growth = train_metrics.LedgerGrowth(recipe.work_file(tmp_path / "heartbeat", recipe.LEDGER_NAME))
    loop, settings = make_loop(functools.partial(PlannedSessionFactory, plan=("ended", "scored")))
    assert [loop._run_session(PROMPT, 0)[0][5] is not None for _ in range(2)] == [True, True]  # both trained
    log = recipe.work_file(settings.heartbeat_file, recipe.ROLLOUT_LOG_NAME)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["outcome"], line["budget_stops"], line["context_exhausted"], line["cut_turns"]) for line in lines] \
        == [("scored", 2, 1, 1), ("scored", 0, 0, 0)]
    counts = ledger(settings)
    assert (counts["scored"], counts["budget_stopped"], counts["context_exhausted"], counts["cut"]) == (2, 1, 1, 1)
    step = logged_step(growth)
    assert (step["rollout/budget_stopped_total"], step["rollout/context_exhausted_total"], step["rollout/cut_total"]) \
        == (1.0, 1.0, 1.0)


def test_the_dashboard_counts_only_this_starts_ledger_and_a_restarted_ledger_from_zero(tmp_path):
    """A ledger an earlier start left in place is not this run's; a rollout child restarted in the same start begins
    a new ledger (its own `started`), counted from zero, not subtracted from the last one."""
    import train_rollouts

    path = tmp_path / "rollouts.json"
    train_rollouts.Ledger(path).record(None)
    time.sleep(0.01)
    growth = train_metrics.LedgerGrowth(path)
    assert logged_step(growth) == {}
    current = train_rollouts.Ledger(path)
    current.record(None)
    current.record("capture", "ValueError: fatal validation finding")
    assert logged_step(growth)["rollout/finished_total"] == 2.0
    time.sleep(0.01)
    train_rollouts.Ledger(path).record(None)
    assert logged_step(growth)["rollout/finished_total"] == 1.0


# --- issue 41, items 5 and 8: what a group's rewards give the step, through TRL's own scoring ------------------------
def scored_group(loop, outcomes: list[tuple[float, int]]) -> list:
    """One GRPO group scored by the recipe's loop (TRL's _score_group, then train_metrics' flags): each rollout run
    through TRL's _run_session with its grade and tool calls, so its reward is train_lora.reward's."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup

    from tests.fake_sessions import FakeSession

    def session(grade: float, calls: int) -> FakeSession:
        return FakeSession(TASKS[0], loop._factory.inner.sampling or {}, grade, calls)

    runs = []
    for grade, calls in outcomes:
        loop._factory.inner.create = lambda *_, grade=grade, calls=calls, **__: session(grade, calls)
        runs.append(loop._run_session(PROMPT, 0)[0])
    group = RolloutGroup(prompts=[PROMPT] * len(runs), reward_kwargs={}, completions=[r[0] for r in runs],
                         completions_ids=[r[1] for r in runs], completions_sequences=[r[2] for r in runs],
                         tool_call_counts=[r[3] for r in runs], tool_failure_counts=[r[4] for r in runs],
                         model_version=3, group_id=0, env_rewards=[None] * len(runs),
                         rollout_rewards=[r[5] for r in runs])
    return loop._loop.run_until_complete(loop._score_group(group))


def test_a_groups_contrast_shows_per_row_and_the_tool_bonus_alone_is_as_strong_as_a_right_answer(make_loop):
    import train_metrics as tm

    loop, _ = make_loop(functools.partial(FakeSessionFactory))
    n = recipe.NUM_GENERATIONS
    # All right, one rollout with one more tool call: the bonus is the only contrast, and std-normalised it is -2.6.
    bonus = scored_group(loop, [(1.0, 3)] * (n - 1) + [(1.0, 4)])
    assert {(s.metrics[tm.BONUS_ONLY], s.metrics[tm.ZERO_CONTRAST]) for s in bonus} == {(1.0, 0.0)}
    assert bonus[-1].advantage == pytest.approx(-(n - 1) ** 0.5, rel=1e-4)  # -2.65 at 8
    # One right answer among wrong ones: +2.6, as large.
    lone = scored_group(loop, [(0.0, 3)] * (n - 1) + [(1.0, 3)])
    assert lone[-1].advantage == pytest.approx((n - 1) ** 0.5, rel=1e-4)
    assert {(s.metrics[tm.BONUS_ONLY], s.metrics[tm.ZERO_CONTRAST]) for s in lone} == {(0.0, 0.0)}
    # All wrong: no contrast, advantage 0 on every row (the step trains nothing from it).
    flat = scored_group(loop, [(0.0, 3)] * n)
    assert {(s.metrics[tm.ZERO_CONTRAST], s.metrics[tm.ZERO_ADVANTAGE], s.advantage) for s in flat} == {(1.0, 1.0, 0)}
    assert {s.metrics[tm.VERSION] for s in flat} == {3.0}  # the group's policy version, for the loss's staleness split


# --- issue 14, defect 4: while the trainer waits for rollouts, a finished rollout is progress ----------------------
def test_waiting_trainer_dates_its_heartbeat_to_the_last_finished_rollout(tokenizer_and_settings, tmp_path):
    tokenizer, base = tokenizer_and_settings
    settings = train_lora.Settings(**{**base.__dict__, "heartbeat_file": str(tmp_path / "heartbeat")})
    dataset = Dataset.from_list(FakeSessionFactory().prompt_rows())
    with cpu_trainer_shims():
        worker = train_lora.rollout_worker(settings, tokenizer, dataset, functools.partial(FakeSessionFactory))
    worker._heartbeat_value.value = time.time()  # the rollout child is alive
    heartbeat, ledger_file = Path(settings.heartbeat_file), tmp_path / "rollouts.json"
    began = time.time() - 1000  # training began 1000 s ago; no optimizer step since
    heartbeat.write_text(f"0 {began:.0f}\n")
    os.utime(heartbeat, (began, began))
    ledger_file.write_text("{}")
    os.utime(ledger_file, (time.time() - 10,) * 2)  # a rollout finished 10 s ago

    worker.check_health(300.0)  # TRL calls this every 5 s while the trainer waits for samples
    assert abs(heartbeat.stat().st_mtime - (time.time() - 10)) < 2

    os.utime(ledger_file, (began - 500,) * 2)  # no rollout has finished since before training began
    worker.check_health(300.0)
    assert abs(heartbeat.stat().st_mtime - began) < 2  # still stale: the watchdog may fire
    assert heartbeat.read_text().split()[0] == "0"  # the text still says the last optimizer step


# --- the same guard on the eval path ------------------------------------------------------------------------------
class CrashingEvalSession:
    """A rollout whose call raises (harbor_sessions lets a client error through, e.g. a connection reset)."""

    result = None

    def wait_for_completion(self) -> int:
        raise ConnectionResetError("env server connection reset mid-rollout")

    def close(self) -> None:
        pass


def test_an_eval_rollout_that_raises_is_one_unscorable_cell_and_an_outage_still_stops(tmp_path, monkeypatch):
    import eval_adapter as ea

    def factory(task_index: int, model: str) -> CrashingEvalSession:
        if task_index == 0:
            raise ConnectionError("env server refused the session")
        return CrashingEvalSession()

    jobs = [("base", recipe.SERVED_MODEL_NAME, {"index": i, "task_name": f"t{i}"}) for i in range(3)]
    monkeypatch.setattr(recipe, "EVAL_ABORT_STREAK", 3 * recipe.EVAL_CELL_ATTEMPTS)
    results = ea.ResultsFile(tmp_path / "r.json", {})
    with pytest.raises(ea.InfrastructureDown, match=r"in a row were unscorable \(last: rollout: ConnectionResetError"):
        ea.run_cells(factory, jobs, results, concurrency=1)
    cells = {c["task_index"]: c for c in results.doc["cells"]}
    assert cells[0]["unscorable"] and cells[0]["error"].startswith("create: ConnectionError: env server refused")
    assert cells[1]["unscorable"] and cells[1]["error"].startswith("rollout: ConnectionResetError")
