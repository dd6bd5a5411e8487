"""smoke_report.py: the plan and the cap that holds its worst case, and the go/no-go report (every field; GO; each
NO-GO cause) built from what a job leaves behind: stage records, train_log.json, rollouts.json, checkpoints on a Hub
double."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

import adapter_repo
import recipe
import smoke_report
from tests.hub_double import LocalHub

REPO = "you/LFM2.5-2.6B-opencode-lora-RL-smoke"
# A 6-step smoke checkpointed every 2 (recipe.SMOKE_SAVE_STEPS=2), the first start stopped at 2: its plan, as the
# report builder is given it.
EXPECT = {"steps": 6, "checkpoints": [2, 4, 6], "resume_at": 2, "eval": True}


# --- the plan ------------------------------------------------------------------------------------------------
def test_the_smoke_is_the_recipes_twenty_steps_with_checkpoints_a_stop_and_a_resume():
    plan = smoke_report.plan()
    assert plan["steps"] == recipe.SMOKE_STEPS == 20  # the recipe's "MAX_STEPS=20 gives a ~40-min smoke run"
    assert plan["checkpoints"] == [5, 10, 15, 20] and plan["resume_at"] == 5 == plan["save_steps"]
    # More steps than groups in flight: the rollout queue runs ahead of the trainer, as in the real run.
    assert plan["steps"] > recipe.MAX_INFLIGHT_ROLLOUTS // recipe.NUM_GENERATIONS
    # The typical smoke: the recipe's ~40 min of steps plus start-up, eval and report, far inside the cap.
    assert plan["total_s"] == recipe.SMOKE_START_UP_S + recipe.RECIPE_SMOKE_MINUTES * 60 < plan["cap_s"] / 3
    assert (plan["timeout"], plan["cap_s"]) == (recipe.SMOKE_TIMEOUT, 8 * 3600)
    # The stages stop before the cap, leaving the report its time; the eval-watch smoke job outlasts the cap.
    assert plan["deadline_s"] == plan["cap_s"] - recipe.SMOKE_REPORT_RESERVE_S
    assert plan["watch_cap_s"] == plan["cap_s"] + recipe.SMOKE_WATCH_EXTRA_S


def worst_case_s(steps: int) -> float:
    """The longest a smoke of `steps` can run before the job's own limits fail it: the derivation of
    recipe.SMOKE_TIMEOUT. Servers start within READY_TIMEOUT_S (training's, then the eval's); a trainer start within
    TRL's WORKER_START_LIMIT_S; TRL trains a group only when all its rollouts are done, so the groups in flight finish
    together in waves, each at the task API's timeout plus OpenEnv's rollout call limit; every push and read-back
    fails all but its last PUSH_RETRIES attempt (PUSH_BACKOFF_S doubled between). The rest, measured or generous:
    job start 15 min (a cold node pulls the image), install 10, tasks 10, a push's attempt 1."""
    p = smoke_report.plan(steps)
    wave = recipe.TASK_API_TIMEOUT_S + recipe.ROLLOUT_CALL_LIMIT_S
    in_flight = recipe.MAX_INFLIGHT_ROLLOUTS // recipe.NUM_GENERATIONS
    waves = -(-p["resume_at"] // in_flight) + -(-(steps - p["resume_at"]) // in_flight)
    eval_waves = -(-2 * p["eval_tasks"] // recipe.EVAL_CONCURRENCY)
    push = recipe.PUSH_RETRIES * 60 + sum(recipe.PUSH_BACKOFF_S * 2**i for i in range(recipe.PUSH_RETRIES - 1))
    pushes = len(p["checkpoints"]) + 2  # every checkpoint, the final adapter, the resume's read-back
    report = len(p["checkpoints"]) * 60 + 180  # the report reads every checkpoint back once, pushes itself
    return (900 + 600 + 600 + 2 * recipe.READY_TIMEOUT_S + 2 * recipe.WORKER_START_LIMIT_S + (waves + eval_waves) * wave
            + pushes * push + report)


def test_the_cap_holds_every_smokes_worst_case_with_a_tenth_to_spare_and_no_more():
    plan = smoke_report.plan()
    for steps in range(recipe.SMOKE_MIN_STEPS, recipe.SMOKE_STEPS + 1):
        worst = worst_case_s(steps)
        assert worst <= 0.9 * plan["cap_s"], (steps, worst)
        # Every stage before the report, counted from run_job.sh's own start, ends by the deadline.
        assert worst - 900 - len(smoke_report.plan(steps)["checkpoints"]) * 60 - 180 <= plan["deadline_s"], steps
    assert plan["cap_s"] - 1800 < worst_case_s(recipe.SMOKE_STEPS) / 0.9  # half an hour less would not hold it


@pytest.mark.parametrize(("steps", "checkpoints"), [(2, [1, 2]), (7, [3, 6, 7]), (10, [5, 10]), (20, [5, 10, 15, 20])])
def test_a_shorter_smoke_checkpoints_at_most_every_half_and_resumes_from_its_first(steps, checkpoints):
    plan = smoke_report.plan(steps)
    assert plan["checkpoints"] == checkpoints and plan["resume_at"] == checkpoints[0] < steps
    assert plan["timeout"] == smoke_report.plan()["timeout"]
    said, numbers = smoke_report.job_plan({"MAX_STEPS": str(steps)}).splitlines()  # what run_job.sh reads
    assert said.startswith(f"smoke plan: MAX_STEPS={steps} SAVE_STEPS={checkpoints[0]} EVAL_TASKS=4, checkpoints")
    assert numbers == f"{steps} {checkpoints[0]} 4 {plan['deadline_s']}"


def test_a_smoke_refuses_save_steps_or_eval_tasks_other_than_its_plans():
    """The cap holds the plan's checkpoints and eval subset, not others; the plan's own values pass."""
    assert smoke_report.job_plan({"MAX_STEPS": "7", "SAVE_STEPS": "3", "EVAL_TASKS": "4"}).startswith("smoke plan")
    with pytest.raises(recipe.ConfigError, match=r"runs its budgeted plan \(MAX_STEPS=7 SAVE_STEPS=3 EVAL_TASKS=4\)"):
        smoke_report.job_plan({"MAX_STEPS": "7", "SAVE_STEPS": "5"})


@pytest.mark.parametrize("steps", [0, 1, 21, 1000])
def test_a_smoke_of_another_length_is_one_clear_error(steps):
    fix = r"too few for a smoke run: use 2\.\.20 \(a checkpoint" if steps < 2 else r"use `launch.py train --max-steps"
    with pytest.raises(recipe.ConfigError, match=fix):
        smoke_report.plan(steps)


# --- the report ----------------------------------------------------------------------------------------------
def push_checkpoint(hub: LocalHub, tmp: Path, step: int, position: dict | None = None) -> None:
    folder = tmp / f"ckpt-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"x" * (100 + step))
    (folder / "adapter_config.json").write_text("{}")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    position = {"prompt_index": step, "model_version": step} if position is None else position
    (folder / recipe.ROLLOUT_STATE).write_text(json.dumps(position))
    adapter_repo.push_folder(hub, REPO, folder, adapter_repo.checkpoint_name(step), marker=True)


def simulated_steps(steps: int = 6, *, kl: float = 1.8e-4, scale: float = 1.0, seed: int = 0) -> list[dict]:
    """Per step, what TRL and train_metrics log for 8 one-sample rows of 50 to 400 tokens whose tokens' log-ratios are
    N(-kl, 2 kl): E[ratio] = 1 and TRL's k3 `kl` is about `kl` (the issue's healthy run: 1.8e-4); every ratio times
    `scale` for truncated sampling (top_p 0.99: 0.99)."""
    rng, out = random.Random(seed), []
    for _ in range(steps):
        rows = [[rng.gauss(-kl, (2 * kl) ** 0.5) + math.log(scale) for _ in range(n)]
                for n in (50, 400, 50, 400, 120, 50, 400, 200)]
        means = [statistics.fmean(math.exp(x) for x in row) for row in rows]
        out.append({"ratio": statistics.fmean(means), "ratio/sample_min": min(means), "ratio/sample_max": max(means),
                    "ratio/token_mean": sum(math.exp(x) for row in rows for x in row) / sum(map(len, rows)),
                    "kl": statistics.fmean(statistics.fmean(math.exp(x) - 1 - x for x in row) for row in rows)})
    return out


def train_log(steps: list[dict] | None = None, resumed_from: int | None = 2) -> dict:
    """train_log.json as RunLog writes it for a 2-start smoke run (steps 1-2, then 3-6), each step's policy metrics
    from `steps` (a healthy run's by default)."""
    logs = []
    for step, metrics in enumerate(steps or simulated_steps(), start=1):
        logs.append({"start": 0 if step <= 2 else 1, "step": step, "loss": 0.01, **metrics,
                     "perf/step_s": None if step in (1, 3) else 80.0 + step, "perf/weight_sync_s": 0.010 + step / 1000,
                     "rollout/fork_frac": 0.0,
                     "kl/fresh": 1.7e-4, "kl/old": 2.4e-4, "clip_ratio/fresh": 0.001, "clip_ratio/old": 0.004,
                     "clip_ratio/unbounded_total": 2.0, "lora/update_norm": 6e-3, "lora/b_norm": 0.002 * step,
                     "learning_rate": 1e-6, "group/zero_contrast_frac": 0.5 if step % 2 else 0.0,
                     "group/bonus_only_frac": 0.0, "sample/zero_advantage_frac": 0.5 if step % 2 else 0.0,
                     smoke_report.SAMPLES_KEY: 8.0, smoke_report.GROUPS_KEY: 1.0})
    logs.append({"start": 1, "step": 6, "train_runtime": 700.0})
    starts = [{"at": 1.0, "resumed_from": None, "global_step": 0, "max_steps": 6},
              {"at": 2.0, "resumed_from": resumed_from, "global_step": 2 if resumed_from else 0, "max_steps": 6}]
    return {"schema": 1, "starts": starts, "logs": logs}


LEDGER = {"schema": 1, "rollouts": 60, "scored": 57, "timed_out": 1, "budget_stopped": 2, "context_exhausted": 1,
          "cut": 4, "unscorable": {"create": 0, "rollout": 2, "upstream": 0, "capture": 0, "empty_trace": 1,
                                   "verifier": 0},
          "unscorable_total": 3, "stopped": None,
          "timing": {"count": 59, "max": {"sandbox_start_s": 31.5, "healthcheck_s": 40.0, "agent_setup_s": 12.0,
                                          "agent_run_s": 1490.0, "verifier_s": 9.0, "setup_s": 80.25}}}


def eval_doc(complete: bool = True) -> dict:
    cells = [{"side": side, "task_index": i, "reward": float(i % 2)} for side in ("base", "adapter") for i in range(4)]
    side = {"tasks": 4, "scored": 4, "correct": 2, "unscorable": 0, "pass_at_1": 0.5}
    return {"kind": "full", "complete": complete, "tasks": [{"index": i} for i in range(4)], "cells": cells,
            "summary": {"base": side, "adapter": side} if complete else None}


STAGES = [{"stage": name, "ok": True, "seconds": 10, "note": "done"}
          for name in ("preflight", "install", "tasks", "vllm", "train", "resume", "final-eval")]


@pytest.fixture
def hub(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    for step in (2, 4, 6):
        push_checkpoint(hub, tmp_path, step)
    return hub


def report_for(hub, tmp_path, *, log=None, ledger=LEDGER, stages=STAGES, doc=None):
    checkpoints = smoke_report.verify_checkpoints(hub, REPO, EXPECT["checkpoints"], tmp_path / "down")
    return smoke_report.build(stages, log if log is not None else train_log(), ledger, checkpoints,
                              doc if doc is not None else eval_doc(), EXPECT)


def test_a_healthy_run_is_go_and_reports_every_field(hub, tmp_path):
    report = report_for(hub, tmp_path)
    assert report["verdict"] == "GO" and report["reasons"] == [] and report["warnings"] == []
    assert set(report) == {"schema", "created", "expect", "stages", "training", "rollouts", "checkpoints", "resume",
                           "eval", "verdict", "reasons", "warnings"}
    assert report["stages"] == STAGES
    training = report["training"]
    assert training["steps_done"] == 6
    # Steps 2, 4, 5, 6: a start's first step has no predecessor to time it from.
    assert training["step_s"] == {"median": 84.5, "min": 82.0, "max": 86.0}
    steps = simulated_steps()
    # The per-row means of a healthy run leave the band the step's token-weighted mean keeps (issue 41, defect 2).
    assert training["ratio"] == {"min": min(s["ratio/sample_min"] for s in steps),
                                 "max": max(s["ratio/sample_max"] for s in steps)}
    assert training["ratio"]["min"] < 0.996 or training["ratio"]["max"] > 1.002, training["ratio"]
    assert training["ratio_band"] == [0.996, 1.002]  # the recipe's 0.998-1.0, bf16's 0.002 either side
    assert abs(training["ratio_token"]["median"] - 1) < 0.001
    assert training["kl"]["median"] == pytest.approx(1.8e-4, rel=0.2) and training["kl_ceiling"] == recipe.SMOKE_KL_MAX
    assert training["by_age"] == {"kl_fresh": 1.7e-4, "kl_old": 2.4e-4, "clip_ratio_fresh": 0.001,
                                  "clip_ratio_old": 0.004}
    assert (training["unbounded_tokens"], training["lora_b_norm"]) == (12, 0.012)
    assert training["lora_update"] == pytest.approx(6e-3)
    assert training["groups"] == {"zero_contrast": 0.25, "bonus_only": 0.0, "zero_advantage": 0.25}
    assert training["fork_frac"] == 0.0
    assert training["stale_frac"] == 0.0 and training["samples_trained"] == 48
    assert report["rollouts"] == {k: LEDGER[k] for k in ("rollouts", "scored", "timed_out", *smoke_report.ENDS,
                                                         "unscorable", "unscorable_total", "stopped", "timing")}
    assert [(c["step"], c["verified"], c["prompt_index"]) for c in report["checkpoints"]] == [
        (2, True, 2), (4, True, 4), (6, True, 6)]
    assert all(c["error"] is None for c in report["checkpoints"])
    assert report["resume"]["verified"] and report["resume"]["from"] == 2 and report["resume"]["consumed"] == 2
    assert report["eval"] == {"complete": True, "cells": 8, "tasks": 4,
                              "base": {"tasks": 4, "scored": 4, "correct": 2, "unscorable": 0, "pass_at_1": 0.5},
                              "adapter": {"tasks": 4, "scored": 4, "correct": 2, "unscorable": 0, "pass_at_1": 0.5}}
    screen = smoke_report.render(report)
    assert screen.splitlines()[1] == "SMOKE REPORT: GO" and len(screen.splitlines()) <= 30
    for text in ("steps 6/6", "57 scored", "48 samples, 0 dropped stale", "importance ratio, token-weighted: median "
                 f"step {training['ratio_token']['median']:.4f}", f"per-row means {training['ratio']['min']:.4f}-",
                 "(not judged)", f"kl median step {training['kl']['median']:.2g}", "ceiling 0.01",
                 "by age (fresh/old): kl 0.00017/0.00024, clipped 0.1%/0.4%; unbounded tokens 12",
                 "LoRA: update 0.006/step, |B| 0.012, learning rate 1e-06", "rows from zero-contrast groups 25.0%",
                 "rollouts ended by the call budget 2, the context 1, a cut at the output cap 4",
                 "2:ok, 4:ok, 6:ok", "pass@1 base 0.50",
                 f"setup of 59 rollouts: slowest 80 s (budget {recipe.ROLLOUT_SETUP_BUDGET_S} s); sandbox_start 32",
                 "healthcheck 40", "agent_setup 12", "verifier 9"):
        assert text in screen, text


def test_truncated_sampling_is_no_go_in_one_line_naming_its_numbers(hub, tmp_path):
    """top_p 0.99: every token's ratio is the nucleus's mass, ~0.99, whatever the policies' agreement."""
    steps = simulated_steps(scale=0.99)
    report = report_for(hub, tmp_path, log=train_log(steps))
    median = statistics.median(s["ratio/token_mean"] for s in steps)
    assert report["verdict"] == "NO-GO" and report["reasons"] == [
        f"token-weighted importance ratio {median:.4f} (median step; steps "
        f"{min(s['ratio/token_mean'] for s in steps):.4f}-{max(s['ratio/token_mean'] for s in steps):.4f}) outside "
        "0.9960-1.0020: vLLM samples from a truncated distribution (top_p, top_k or min_p; serve with "
        "--generation-config vllm)"]
    assert f"{median:.4f}".startswith("0.99")
    assert "NO-GO: token-weighted importance ratio" in smoke_report.render(report)


def test_a_kl_over_the_ceiling_is_no_go_in_one_line_naming_its_numbers(hub, tmp_path):
    """Trainer and vLLM disagree (per-token log-ratios ~0.2 apart): the mean ratio stays 1, TRL's kl does not."""
    steps = simulated_steps(kl=0.02)
    report = report_for(hub, tmp_path, log=train_log(steps))
    kls = [s["kl"] for s in steps]
    assert report["verdict"] == "NO-GO" and report["reasons"] == [
        f"kl {statistics.median(kls):.2g} (median step; max {max(kls):.2g}) over the 0.01 ceiling: trainer and vLLM "
        "disagree on the policy (weights after a sync, chat template, dtype)"], report["reasons"]


def test_without_the_token_weighted_ratio_no_step_is_judged_trained(hub, tmp_path):
    log = train_log()
    for entry in log["logs"]:
        entry.pop("ratio/token_mean", None)
    report = report_for(hub, tmp_path, log=log)
    assert report["verdict"] == "NO-GO" and report["reasons"] == [
        "no importance ratio or kl logged (ratio/token_mean, kl): no step trained"]


def test_a_mostly_zero_contrast_run_is_go_with_a_warning(hub, tmp_path):
    report = report_for(hub, tmp_path, log=log_with(**{"group/zero_contrast_frac": 0.75}))
    assert report["verdict"] == "GO" and report["warnings"] == [
        "75% of the trained rows came from zero-contrast groups (every reward equal: the step trains nothing from "
        "them): the tasks are too hard or too easy for the policy as it stands"]
    assert "  WARN: 75% of the trained rows came from zero-contrast groups" in smoke_report.render(report)


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
    assert stages == [{"stage": "preflight", "ok": True, "seconds": 10, "note": "ok"},
                      {"stage": "install", "ok": True, "seconds": 60, "note": "pinned stack"},
                      {"stage": "vllm", "ok": True, "seconds": 40, "note": "up"},
                      {"stage": "env-server", "ok": True, "seconds": 10, "note": "up"},
                      {"stage": "train", "ok": False, "seconds": 240, "note": "did not finish"}]
    report = report_for(hub, tmp_path, stages=stages)
    assert report["verdict"] == "NO-GO"
    assert "stage train failed after 240 s: did not finish" in report["reasons"]
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
    ({"ledger": {**LEDGER, "timing": {"count": 59, "max": {**LEDGER["timing"]["max"], "setup_s": 420.0}}}},
     f"slowest rollout setup 420 s is over the {recipe.ROLLOUT_SETUP_BUDGET_S} s"),
    ({"log": {"schema": 1, "starts": [], "logs": []}}, "0 of 6 steps done"),
])
def test_other_no_go_causes(hub, tmp_path, change, reason):
    report = report_for(hub, tmp_path, **change)
    assert report["verdict"] == "NO-GO" and any(reason in r for r in report["reasons"]), report["reasons"]


def test_report_command_prints_pushes_and_exits_by_verdict(hub, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / recipe.TRAIN_LOG_NAME).write_text(json.dumps(train_log()))
    (work / recipe.LEDGER_NAME).write_text(json.dumps(LEDGER))
    recipe.keep_ledger_aside(work)  # as run_job.sh does before the second trainer start
    (work / recipe.LEDGER_NAME).write_text(json.dumps({**LEDGER, "unscorable": {**LEDGER["unscorable"], "capture": 2},
                                                    "unscorable_total": 5, "stopped": None}))
    stages = tmp_path / "stages"
    stages.write_text("".join(f"start {s['stage']} 0\nend {s['stage']} 5 ok\n" for s in STAGES))
    monkeypatch.setenv("ADAPTER_REPO", REPO)
    monkeypatch.setenv("HF_TOKEN", "hf_test_placeholder")
    monkeypatch.setenv("MAX_STEPS", "6")  # run_job.sh exports the smoke's MAX_STEPS: the plan the report checks
    monkeypatch.setattr(recipe, "SMOKE_SAVE_STEPS", 2)
    rc = smoke_report.main(["report", "--work-dir", str(work), "--stages", str(stages)], make_api=lambda _: hub)
    out = capsys.readouterr().out
    pushed = json.loads((hub.root / REPO / smoke_report.REPORT_PATH).read_text())
    assert json.loads((work / smoke_report.REPORT_PATH).read_text()) == pushed
    assert "hf_test_placeholder" not in out and "SMOKE REPORT: NO-GO" in out
    assert rc == 1 and pushed["verdict"] == "NO-GO" and pushed["expect"] == EXPECT  # no eval results in the repo
    assert "final eval on the subset did not complete" in pushed["reasons"]
    assert [c["verified"] for c in pushed["checkpoints"]] == [True, True, True]
    assert pushed["rollouts"] == {
        "rollouts": 120, "scored": 114, "timed_out": 2, "unscorable_total": 8, "stopped": None,
        "budget_stopped": 4, "context_exhausted": 2, "cut": 8,  # both starts' counts summed, as every counter's
        "unscorable": {"create": 0, "rollout": 4, "upstream": 0, "capture": 2, "empty_trace": 2, "verifier": 0},
        "timing": {"count": 118, "max": LEDGER["timing"]["max"]}}
    assert pushed["resume"]["verified"] and pushed["training"]["steps_done"] == 6


def test_each_later_trainer_start_keeps_the_last_ledger_aside_under_the_next_number(tmp_path):
    """The work folder's rule (recipe.py): rollouts.start-1.json, -2, ... in start order, compared as numbers."""
    assert recipe.keep_ledger_aside(tmp_path) is None  # no start yet: nothing to keep
    for start in range(1, 12):
        (tmp_path / recipe.LEDGER_NAME).write_text(json.dumps({"start": start}))
        assert recipe.keep_ledger_aside(tmp_path) == tmp_path / f"rollouts.start-{start}.json"
        assert not (tmp_path / recipe.LEDGER_NAME).exists()
    (tmp_path / "rollouts.start-x.json").write_text("{}")  # not a start's ledger: never counted
    kept = recipe.kept_ledgers(tmp_path)
    assert [json.loads(p.read_text())["start"] for p in kept] == list(range(1, 12))
    (tmp_path / recipe.LEDGER_NAME).write_text("{}")
    assert recipe.keep_ledger_aside(tmp_path) == tmp_path / "rollouts.start-12.json"


def test_clear_empties_only_a_smoke_repo(hub, tmp_path):
    assert len(hub.list_repo_files(REPO)) == 15  # 3 checkpoints x (adapter, config, state, rollout state, marker)
    assert smoke_report.clear(hub, REPO) == 15
    assert hub.list_repo_files(REPO) == [adapter_repo.SMOKE_RUN_PATH]  # and this run, recorded for its watcher
    with pytest.raises(recipe.ConfigError, match="does not end with -smoke"):
        smoke_report.clear(hub, "you/LFM2.5-2.6B-opencode-lora-RL")


# --- a verdict that cannot lie ----------------------------------------------------------------------------------
def interleaved_ledger(rollouts: int, unscorable: int) -> dict:
    """train_rollouts' counts after `unscorable` of `rollouts` failed, interleaved with scored ones: no streak of
    ROLLOUT_ABORT_STREAK and a ROLLOUT_WINDOW that never fills, so the guard itself never stops the run."""
    ledger = {**LEDGER, "rollouts": rollouts, "scored": rollouts - unscorable, "unscorable_total": unscorable,
              "unscorable": {"create": unscorable - 10, "rollout": 0, "capture": 10, "empty_trace": 0,
                             "verifier": 0}}
    assert rollouts < recipe.ROLLOUT_WINDOW
    return ledger


def test_a_mostly_failing_pipeline_is_no_go_with_every_reason(hub, tmp_path):
    """The broken pipeline that used to say GO: 50 of 60 rollouts unscorable (interleaved), 1 of 4 eval cells
    scored per side."""
    side = {"tasks": 4, "scored": 1, "correct": 1, "unscorable": 3, "pass_at_1": 1.0}
    doc = {**eval_doc(), "summary": {"base": side, "adapter": side}}
    report = report_for(hub, tmp_path, ledger=interleaved_ledger(60, 50), doc=doc)
    assert report["verdict"] == "NO-GO"
    assert report["reasons"] == [
        "50 of 60 finished rollouts unscorable (83% > 10%): create 40, capture 10",
        "eval: 1 of 4 base cells scored (3 unscorable): a smoke eval scores every cell",
        "eval: 1 of 4 adapter cells scored (3 unscorable): a smoke eval scores every cell",
    ]
    screen = smoke_report.render(report)
    assert all(f"NO-GO: {reason}" in screen for reason in report["reasons"])


def test_unscorable_rollouts_at_the_limit_are_go_and_above_it_no_go(hub, tmp_path):
    limit = int(recipe.SMOKE_MAX_UNSCORABLE * 100)
    assert report_for(hub, tmp_path, ledger=interleaved_ledger(100, limit))["verdict"] == "GO"
    report = report_for(hub, tmp_path / "b", ledger=interleaved_ledger(100, limit + 1))
    assert report["reasons"] == [f"{limit + 1} of 100 finished rollouts unscorable ({limit + 1}% > {limit}%): "
                                 f"create {limit - 9}, capture 10"]


def log_with(**per_step: float) -> dict:
    log = train_log()
    for entry in log["logs"]:
        if "loss" in entry:
            entry.update(per_step)
    return log


@pytest.mark.parametrize(("change", "reason"), [
    # TRL dropped 1 sample per step as stale against 8 trained: 11 % > 5 %.
    ({"log": log_with(**{smoke_report.STALE_KEY: 1.0})},
     "TRL dropped 6 samples as stale against 48 trained (11% > 5%): finished sandbox work thrown away"),
    ({"log": log_with(**{"rollout/fork_frac": 0.5})}, "fork fraction 0.50 > 0.05: captured rollouts split"),
    ({"ledger": {**LEDGER, "timing": {"count": 57, "max": {**LEDGER["timing"]["max"], "setup_s": 301.0}}}},
     "slowest rollout setup 301 s is over the 300 s OpenEnv's call limit leaves beside the agent timeout"),
])
def test_each_pipeline_check_names_its_numbers(hub, tmp_path, change, reason):
    report = report_for(hub, tmp_path, **change)
    assert report["verdict"] == "NO-GO" and len(report["reasons"]) == 1, report["reasons"]
    assert report["reasons"][0].startswith(reason), report["reasons"]


def test_a_resume_position_behind_what_the_first_start_consumed_is_no_go(hub, tmp_path):
    """TRL's rollout_state.json at the stop's checkpoint must point past every group the first start trained or
    dropped; a position stuck at a group that never trained (issue 29) re-trains from there on a relaunch."""
    stuck = hub.root / REPO / "checkpoint-2" / recipe.ROLLOUT_STATE
    stuck.write_text(json.dumps({"prompt_index": 0, "model_version": 2}))  # same size: its marker still holds
    report = report_for(hub, tmp_path)
    assert report["reasons"] == ["resume position skips 0 groups (checkpoint-2's rollout_state.json), fewer than the "
                                 "2 the first start consumed: a relaunch would train them again"]
    # train_resume.py's form: group 0 was in flight at the stop (redone), groups 1 and 2 are skipped.
    push_checkpoint(hub, tmp_path / "again", 2, {"prompt_index": 0, "model_version": 2, recipe.CONSUMED_AHEAD: [1, 2]})
    assert report_for(hub, tmp_path / "b")["verdict"] == "GO"
    # Stale-dropped groups count as consumed too: 8 dropped samples in step 2 are one more group.
    log = train_log()
    log["logs"][1][smoke_report.STALE_KEY] = 8.0
    assert smoke_report.resume(log, 2)["consumed"] == 3


def test_an_unexpected_failure_of_the_report_ends_in_one_line(hub, tmp_path, monkeypatch, capsys):
    """Issue 26, item 11: every entry point ends a failure the same way (adapter_repo.run_cli): here a work folder
    that cannot be written (here a file where the job's WORK_DIR should be) used to end the report in a traceback."""
    monkeypatch.setenv("ADAPTER_REPO", REPO)
    monkeypatch.setenv("HF_TOKEN", "hf_test_placeholder")
    monkeypatch.delenv("DEBUG", raising=False)
    (tmp_path / "not-a-folder").write_text("")
    rc = smoke_report.main(["report", "--work-dir", str(tmp_path / "not-a-folder"), "--stages",
                            str(tmp_path / "stages")], make_api=lambda _: hub)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("smoke_report: unexpected FileExistsError: ") and "rerun with DEBUG=1" in err


def test_rollout_timing_merges_over_trainer_starts_as_the_slowest_of_each():
    first = {**LEDGER, "timing": {"count": 3, "max": {"sandbox_start_s": 50.0, "setup_s": 60.0}}}
    second = {**LEDGER, "timing": {"count": 2, "max": {"sandbox_start_s": 20.0, "verifier_s": 5.0, "setup_s": 70.0}}}
    unmeasured = {k: v for k, v in LEDGER.items() if k != "timing"}  # a ledger from before the timing was kept
    merged = smoke_report.merge_ledgers([first, second, unmeasured])
    assert merged["timing"] == {"count": 5, "max": {"sandbox_start_s": 50.0, "setup_s": 70.0, "verifier_s": 5.0}}


def test_a_run_whose_setup_was_not_measured_says_so(hub, tmp_path):
    """The rehearsal's scripted sessions start no sandbox: nothing to time, nothing to judge, and the screen says so."""
    report = report_for(hub, tmp_path, ledger={**LEDGER, "timing": {"count": 0, "max": {}}})
    assert report["verdict"] == "GO", report["reasons"]
    assert "setup per rollout: not measured" in smoke_report.render(report)
