"""smoke_report.py: the stage budget fits SMOKE_TIMEOUT, and the go/no-go report (every field; GO; each NO-GO cause)
built from what a job leaves behind: stage records, train_log.json, rollouts.json, checkpoints on a Hub double."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import adapter_repo
import recipe
import smoke_report
from tests.hub_double import LocalHub

REPO = "you/LFM2.5-2.6B-opencode-lora-RL-smoke"
EXPECT = {"steps": 6, "checkpoints": [2, 4, 6], "resume_at": 2, "eval": True}
VERSIONS = {"vllm": "0.31.0", "torch": "2.13.0", "trl": "1.15.0", "transformers": "5.17.0", "peft": "0.21.2",
            "openenv": "0.10.0", "harbor": "0.25.0", "openenv_commit": recipe.OPENENV_COMMIT,
            "fetch_training_trace": True}


# --- the plan ------------------------------------------------------------------------------------------------
def test_the_plan_fits_the_cap_with_its_margin():
    plan = smoke_report.plan()
    assert plan["cap_s"] == smoke_report.seconds(recipe.SMOKE_TIMEOUT) == 7200
    assert plan["total_s"] == sum(s["budget_s"] for s in plan["stages"])
    assert plan["margin_s"] == plan["cap_s"] - plan["total_s"]
    assert plan["margin_s"] >= recipe.SMOKE_MIN_MARGIN * plan["cap_s"], smoke_report.render_plan(plan)
    # Every stage of the real job is budgeted, in run order.
    assert [s["stage"] for s in plan["stages"]] == ["job-start", "install", "prepare", "servers", "train", "resume",
                                                    "final-eval", "report"]
    # The report (checkpoints read back, report pushed) always has its reserved time before the platform's kill.
    report = plan["stages"][-1]["budget_s"]
    assert report == len(plan["checkpoints"]) * recipe.SMOKE_PUSH_S + recipe.SMOKE_REPORT_S
    assert plan["deadline_s"] + recipe.SMOKE_JOB_START_S + report == plan["cap_s"]


def test_the_first_step_is_budgeted_as_a_whole_slow_group():
    """TRL trains a group only when all 8 rollouts are done, and one may run to OpenEnv's rollout call limit."""
    train = next(s for s in smoke_report.plan()["stages"] if s["stage"] == "train")
    assert train["budget_s"] >= recipe.WORKER_START_LIMIT_S + recipe.ROLLOUT_CALL_LIMIT_S > recipe.AGENT_TIMEOUT_SEC


def test_the_plan_is_computed_from_the_recipe_and_a_grown_stage_breaks_it(monkeypatch):
    margin = smoke_report.plan()["margin_s"]
    monkeypatch.setattr(recipe, "SMOKE_STEP_S", recipe.SMOKE_STEP_S + margin)  # every step but the slow first
    grown = smoke_report.plan()
    assert grown["margin_s"] == margin - (recipe.SMOKE_STEPS - 1) * margin < 0


def test_the_smoke_pushes_at_least_two_checkpoints_and_resumes_from_one_before_the_end():
    plan = smoke_report.plan()
    assert plan["checkpoints"] == smoke_report.checkpoint_steps() == [2, 4, 6]
    assert len(plan["checkpoints"]) >= 2 and plan["resume_at"] in plan["checkpoints"]
    assert plan["resume_at"] < plan["steps"] and plan["steps"] > recipe.MAX_INFLIGHT_ROLLOUTS // recipe.NUM_GENERATIONS
    assert smoke_report.checkpoint_steps(7, 3) == [3, 6, 7]


@pytest.mark.parametrize(("text", "value"), [("2h", 7200), ("90m", 5400), ("7200", 7200), ("45s", 45)])
def test_durations(text, value):
    assert smoke_report.seconds(text) == value


def test_a_bad_duration_is_one_clear_error():
    with pytest.raises(recipe.ConfigError, match="not a duration"):
        smoke_report.seconds("two hours")


# --- the report ----------------------------------------------------------------------------------------------
def push_checkpoint(hub: LocalHub, tmp: Path, step: int) -> None:
    folder = tmp / f"ckpt-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"x" * (100 + step))
    (folder / "adapter_config.json").write_text("{}")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    adapter_repo.push_folder(hub, REPO, folder, adapter_repo.checkpoint_name(step), marker=True)


def train_log(ratios: list[float] | None = None, resumed_from: int | None = 2) -> dict:
    """train_log.json as RunLog writes it for a 2-start smoke run (steps 1-2, then 3-6)."""
    ratios = ratios or [0.999, 0.9995, 1.0, 0.9985, 0.999, 1.0]
    logs = []
    for step, ratio in enumerate(ratios, start=1):
        logs.append({"start": 0 if step <= 2 else 1, "step": step, "loss": 0.01, "ratio": 0.9995,
                     "ratio/sample_min": ratio, "ratio/sample_max": min(ratio + 0.0005, 1.08),
                     "perf/step_s": None if step in (1, 3) else 80.0 + step, "perf/weight_sync_s": 0.010 + step / 1000,
                     "perf/weight_sync_fused_tensors": 0.0 if step == 1 else 266.0, "rollout/fork_frac": 0.0})
    logs.append({"start": 1, "step": 6, "train_runtime": 700.0})
    starts = [{"at": 1.0, "resumed_from": None, "global_step": 0, "max_steps": 6},
              {"at": 2.0, "resumed_from": resumed_from, "global_step": 2 if resumed_from else 0, "max_steps": 6}]
    return {"schema": 1, "starts": starts, "logs": logs}


LEDGER = {"schema": 1, "rollouts": 60, "scored": 57, "timed_out": 1,
          "unscorable": {"create": 0, "rollout": 2, "capture": 0, "empty_trace": 1, "verifier": 0},
          "unscorable_total": 3, "stopped": None}


def eval_doc(complete: bool = True) -> dict:
    cells = [{"side": side, "task_index": i, "reward": float(i % 2)} for side in ("base", "adapter") for i in range(4)]
    side = {"tasks": 4, "scored": 4, "correct": 2, "unscorable": 0, "pass_at_1": 0.5}
    return {"kind": "full", "complete": complete, "tasks": [{"index": i} for i in range(4)], "cells": cells,
            "summary": {"base": side, "adapter": side} if complete else None}


STAGES = [{"stage": name, "ok": True, "seconds": 10, "note": "done"}
          for name in ("install", "prepare", "servers", "train", "resume", "final-eval")]


@pytest.fixture
def hub(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    for step in (2, 4, 6):
        push_checkpoint(hub, tmp_path, step)
    return hub


def report_for(hub, tmp_path, *, log=None, ledger=LEDGER, stages=STAGES, versions=VERSIONS, doc=None):
    checkpoints = smoke_report.verify_checkpoints(hub, REPO, EXPECT["checkpoints"], tmp_path / "down")
    return smoke_report.build(stages, log if log is not None else train_log(), ledger, checkpoints,
                              doc if doc is not None else eval_doc(), versions, EXPECT, hub.list_repo_files(REPO))


def test_a_healthy_run_is_go_and_reports_every_field(hub, tmp_path):
    report = report_for(hub, tmp_path)
    assert report["verdict"] == "GO" and report["reasons"] == []
    assert set(report) == {"schema", "created", "expect", "stages", "training", "rollouts", "checkpoints", "resume",
                           "eval", "watcher", "versions", "verdict", "reasons"}
    assert report["stages"][3] == {"stage": "train", "ok": True, "seconds": 10, "note": "done",
                                   "budget_s": next(s["budget_s"] for s in smoke_report.plan()["stages"]
                                                    if s["stage"] == "train")}
    training = report["training"]
    assert training["steps_done"] == 6
    assert training["step_s"] == {"median": 84.5, "max": 86.0}  # steps 2, 4, 5, 6 (a start's first has no predecessor)
    assert training["ratio"] == {"min": 0.9985, "max": 1.0005}
    assert training["ratio_band"] == [0.996, 1.002]  # the recipe's 0.998-1.0, bf16's 0.002 either side
    assert training["sync_ms"]["max"] == pytest.approx(16.0) and training["sync_ms"]["median"] == pytest.approx(13.5)
    assert training["fused_tensors"] == 266
    assert training["fork_frac"] == 0.0 and training["fork_frac_logged"]
    assert report["rollouts"] == {k: LEDGER[k] for k in ("rollouts", "scored", "timed_out", "unscorable",
                                                         "unscorable_total", "stopped")}
    assert [(c["step"], c["verified"], c["files"]) for c in report["checkpoints"]] == [(2, True, 4), (4, True, 4),
                                                                                      (6, True, 4)]
    assert all(c["bytes"] > 0 and c["error"] is None for c in report["checkpoints"])
    assert report["resume"]["verified"] and report["resume"]["from"] == 2
    assert report["eval"] == {"complete": True, "cells": 8, "tasks": 4,
                              "base": {"tasks": 4, "scored": 4, "correct": 2, "unscorable": 0, "pass_at_1": 0.5},
                              "adapter": {"tasks": 4, "scored": 4, "correct": 2, "unscorable": 0, "pass_at_1": 0.5}}
    assert report["versions"] == VERSIONS
    assert report["watcher"] == {"evaluated": [], "summary": False}
    screen = smoke_report.render(report)
    assert screen.splitlines()[1] == "SMOKE REPORT: GO" and len(screen.splitlines()) <= 30
    for text in ("steps 6/6", "57 scored", "importance ratio 0.9985-1.0005", "fused tensors 266", "2:ok, 4:ok, 6:ok",
                 "pass@1 base 0.50", "vllm 0.31.0", f"OpenEnv {recipe.OPENENV_COMMIT}", "fetch_training_trace present"):
        assert text in screen, text


@pytest.mark.parametrize("ratios", [[0.999, 0.95, 1.0, 1.0, 1.0, 1.0], [0.999, 1.0, 1.0, 1.0, 1.0, 1.08]])
def test_an_importance_ratio_outside_the_band_is_no_go(hub, tmp_path, ratios):
    """The per-sample range decides, even where the step's mean `ratio` (0.9995 here) looks fine."""
    report = report_for(hub, tmp_path, log=train_log(ratios))
    assert report["verdict"] == "NO-GO"
    assert len(report["reasons"]) == 1 and report["reasons"][0].startswith("importance ratio ")
    assert "NO-GO: importance ratio" in smoke_report.render(report)


def test_without_the_per_sample_range_the_step_mean_ratio_is_checked(hub, tmp_path):
    log = train_log()
    for entry in log["logs"]:
        entry.pop("ratio/sample_min", None), entry.pop("ratio/sample_max", None)
    log["logs"][3]["ratio"] = 1.01
    report = report_for(hub, tmp_path, log=log)
    assert report["training"]["ratio"] == {"min": 0.9995, "max": 1.01} and report["verdict"] == "NO-GO"


def test_a_checkpoint_not_readable_back_is_no_go(hub, tmp_path):
    (hub.root / REPO / "checkpoint-4" / "adapter_model.safetensors").write_bytes(b"truncated")  # size != marker
    report = report_for(hub, tmp_path)
    assert report["verdict"] == "NO-GO"
    [bad] = [c for c in report["checkpoints"] if not c["verified"]]
    assert bad["step"] == 4 and "does not match its marker" in bad["error"]
    assert report["reasons"] == [f"checkpoint-4 not readable back from the Hub: {bad['error']}"]


def test_a_checkpoint_never_pushed_is_no_go(hub, tmp_path):
    (hub.root / REPO / "checkpoint-6" / adapter_repo.COMPLETE_MARKER).unlink()
    report = report_for(hub, tmp_path)
    assert report["verdict"] == "NO-GO" and report["reasons"][0].startswith("checkpoint-6 not readable back")


def test_a_failed_stage_is_no_go_with_its_time(hub, tmp_path):
    records = tmp_path / "stages"
    records.write_text("start preflight 90\nend preflight 100 ok\nstart install 100\nend install 160 pinned stack\n"
                       "start vllm 160\nend vllm 200 up\nstart env-server 200\nend env-server 210 up\n"
                       "start train 210\n")
    stages = smoke_report.read_stages(records, now=450)
    assert stages == [{"stage": "install", "ok": True, "seconds": 70, "note": "pinned stack"},
                      {"stage": "servers", "ok": True, "seconds": 50, "note": "up"},
                      {"stage": "train", "ok": False, "seconds": 240, "note": "train: did not finish"}]
    report = report_for(hub, tmp_path, stages=stages)
    assert report["verdict"] == "NO-GO"
    assert "stage train failed after 240 s: train: did not finish" in report["reasons"]
    assert "FAIL train" in smoke_report.render(report)


def test_a_restart_instead_of_a_resume_is_no_go(hub, tmp_path):
    report = report_for(hub, tmp_path, log=train_log(resumed_from=None))
    assert report["verdict"] == "NO-GO" and not report["resume"]["verified"]
    assert report["reasons"] == ["resume from checkpoint-2 not verified: resumed_from None, state began at step 0, "
                                 "first step trained 3"]


@pytest.mark.parametrize(("change", "reason"), [
    ({"doc": {"kind": "full", "complete": False, "cells": []}}, "final eval on the subset did not complete"),
    ({"ledger": {**LEDGER, "stopped": "rollouts are failing systematically"}}, "rollout guard stopped the run"),
    ({"ledger": None}, "no rollout counts"),
    ({"versions": {**VERSIONS, "fetch_training_trace": False}}, "no fetch_training_trace()"),
    ({"log": {"schema": 1, "starts": [], "logs": []}}, "0 of 6 steps done"),
])
def test_other_no_go_causes(hub, tmp_path, change, reason):
    report = report_for(hub, tmp_path, **change)
    assert report["verdict"] == "NO-GO" and any(reason in r for r in report["reasons"]), report["reasons"]


def test_report_command_prints_pushes_and_exits_by_verdict(hub, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train_log.json").write_text(json.dumps(train_log()))
    (work / "rollouts.first-start.json").write_text(json.dumps(LEDGER))  # run_job.sh keeps the first start's counts
    (work / "rollouts.json").write_text(json.dumps({**LEDGER, "unscorable": {**LEDGER["unscorable"], "capture": 2},
                                                    "unscorable_total": 5, "stopped": None}))
    stages = tmp_path / "stages"
    stages.write_text("".join(f"start {s['stage']} 0\nend {s['stage']} 5 ok\n" for s in STAGES))
    monkeypatch.setenv("ADAPTER_REPO", REPO)
    monkeypatch.setenv("HF_TOKEN", "hf_test_placeholder")
    rc = smoke_report.main(["report", "--work-dir", str(work), "--stages", str(stages)], make_api=lambda _: hub)
    out = capsys.readouterr().out
    pushed = json.loads((hub.root / REPO / smoke_report.REPORT_PATH).read_text())
    assert json.loads((work / smoke_report.REPORT_PATH).read_text()) == pushed
    assert "hf_test_placeholder" not in out and "SMOKE REPORT: NO-GO" in out
    assert rc == 1 and pushed["verdict"] == "NO-GO"  # no eval results in the repo, and this bundle has no harbor_env
    assert "final eval on the subset did not complete" in pushed["reasons"]
    assert [c["verified"] for c in pushed["checkpoints"]] == [True, True, True]
    assert pushed["rollouts"] == {
        "rollouts": 120, "scored": 114, "timed_out": 2, "unscorable_total": 8, "stopped": None,
        "unscorable": {"create": 0, "rollout": 4, "capture": 2, "empty_trace": 2, "verifier": 0}}
    assert pushed["resume"]["verified"] and pushed["training"]["steps_done"] == 6


def test_clear_empties_only_a_smoke_repo(hub, tmp_path):
    assert len(hub.list_repo_files(REPO)) == 12  # 3 checkpoints x (adapter, config, state, marker)
    assert smoke_report.clear(hub, REPO) == 12
    assert hub.list_repo_files(REPO) == []
    with pytest.raises(recipe.ConfigError, match="does not end with -smoke"):
        smoke_report.clear(hub, "you/LFM2.5-2.6B-opencode-lora-RL")
