"""run_job.sh MODE=smoke (tests/run_job_harness.py): the plan, its bad input, two trainer starts, the subset
eval, and the go/no-go report whatever happened."""

from __future__ import annotations

import json
import shlex

import pytest
from run_job_harness import assert_no_leftovers, make_job, run_job, stub_log

import recipe
import smoke_report


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path)


SMOKE_REPO = "you/LFM2.5-2.6B-opencode-lora-RL-smoke"
SMOKE = {"MODE": "smoke", "ADAPTER_REPO": SMOKE_REPO, "MAX_STEPS": str(recipe.SMOKE_STEPS),
         "SAVE_STEPS": str(recipe.SMOKE_SAVE_STEPS), "EVAL_TASKS": str(recipe.SMOKE_EVAL_TASKS)}


def test_smoke_dry_run_prints_the_plan_two_trainer_starts_the_subset_eval_and_the_report(job):
    out = run_job(job, DRY_RUN="1", STUB_GPUS="none", **SMOKE)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    plan = smoke_report.job_plan({})  # printed by the preflight: the real plan, with the job's cap
    assert plan.splitlines()[0] in lines and "MAX_STEPS=20 SAVE_STEPS=5 EVAL_TASKS=4" in plan
    commands = [shlex.split(line[4:]) for line in lines if line.startswith("  $ ")]
    clear = next(i for i, line in enumerate(lines) if line.endswith("smoke_report.py clear"))
    trainers = [i for i, line in enumerate(lines) if line.startswith("  $ env CUDA_VISIBLE_DEVICES=0")]
    starts = [c for c in commands if c[-1].endswith("train_lora.py")]
    assert len(starts) == 2 and clear < trainers[0] < trainers[1]
    install = next(i for i, line in enumerate(lines) if line.endswith("] step 1/8 install"))
    assert clear < install  # emptied before anything can read the repo (issue 26 item 4)
    first, second = starts
    assert "STOP_AFTER_STEP=5" in first and not any(a.startswith("STOP_AFTER_STEP") for a in second)
    for start in starts:
        assert {"MAX_STEPS=20", "SAVE_STEPS=5", "RESUME=1"} <= set(start)
    work = job["tmp"] / "work"
    assert f"OUTPUT_DIR={work}/output" in first and f"OUTPUT_DIR={work}/output-resume" in second
    for n, name in enumerate(["preflight", "install", "seam-patch", "tasks", "vllm", "env-server", "train",
                              "resume", "final-eval"]):
        assert any(line.endswith(f"] step {n}/8 {name}") for line in lines), name
    evaluation = next(c for c in commands if c[-1].endswith("run_eval.sh"))
    assert "EVAL_TASKS=4" in evaluation and "CHECKPOINT=final" in evaluation
    assert evaluation[evaluation.index("timeout") + 1].endswith("s")  # what the smoke deadline leaves
    assert lines[-1].endswith(f"smoke_report.py report --work-dir {work} --stages {work}/{recipe.STAGES_NAME}")
    assert stub_log(job) == []


@pytest.mark.parametrize(("extra", "message"), [
    ({"MAX_STEPS": "21"}, "a smoke run takes MAX_STEPS=2..20"),
    ({"MAX_STEPS": "7", "SAVE_STEPS": "5"},
     "MODE=smoke runs its budgeted plan (MAX_STEPS=7 SAVE_STEPS=3 EVAL_TASKS=4)"),
    ({"MODE": "quick"}, "MODE='quick' is not one of train, smoke"),
])
def test_smoke_bad_input_stops_at_once(job, extra, message):
    out = run_job(job, timeout=30, **{**SMOKE, **extra})
    assert out.returncode != 0
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert stub_log(job) == []


def test_a_shorter_smoke_takes_its_plans_checkpoints(job):
    """MAX_STEPS below the recipe's 20: the plan's save steps for it (the first start stops at its first checkpoint)."""
    out = run_job(job, DRY_RUN="1", STUB_GPUS="none", MODE="smoke", ADAPTER_REPO=SMOKE_REPO, MAX_STEPS="7")
    assert out.returncode == 0, out.stderr
    starts = [shlex.split(line[4:]) for line in out.stdout.splitlines() if line.endswith("train_lora.py")]
    assert len(starts) == 2 and "STOP_AFTER_STEP=3" in starts[0]
    assert all({"MAX_STEPS=7", "SAVE_STEPS=3"} <= set(start) for start in starts)


def test_smoke_run_stops_resumes_evaluates_the_subset_and_reports(job):
    out = run_job(job, **SMOKE)
    assert out.returncode == 0, out.stdout + out.stderr
    log = stub_log(job)
    kinds = [line.split()[0] for line in log]
    assert kinds == ["smoke_report", "pip", "pip", "pip", "prepare_tasks", "vllm", "env_server", "trainer", "trainer",
                     "run_eval", "smoke_report"], log
    assert log[0] == f"smoke_report clear ADAPTER_REPO={SMOKE_REPO}"  # the preflight's last act
    assert "STOP_AFTER_STEP=5" in log[7] and "STOP_AFTER_STEP=None" in log[8]
    assert "EVAL_TASKS=4 training_vllm=down" in log[9]
    steps = ["preflight", "install", "seam-patch", "tasks", "vllm", "env-server", "train", "resume", "final-eval"]
    assert log[10] == "smoke_report report " + " ".join(f"{kind}:{name}" for name in steps for kind in ("start", "end"))
    assert "SMOKE REPORT: GO" in out.stdout
    assert_no_leftovers(job["token"])


def test_the_second_trainer_start_keeps_the_first_starts_rollout_counts_where_the_report_reads_them(job):
    """Each start's rollout child begins a new ledger: run_job.sh keeps the first one aside under recipe.py's rule,
    the one smoke_report.py reads every start's counts by."""
    out = run_job(job, **SMOKE)
    assert out.returncode == 0, out.stdout + out.stderr
    work = job["tmp"] / "work"
    [kept] = recipe.kept_ledgers(work)
    assert json.loads(kept.read_text()) == {"output_dir": f"{work}/output"}
    assert json.loads((work / recipe.LEDGER_NAME).read_text()) == {"output_dir": f"{work}/output-resume"}


def test_smoke_no_go_fails_the_job(job):
    out = run_job(job, STUB_REPORT="NO-GO", **SMOKE)
    assert out.returncode != 0 and "SMOKE REPORT: NO-GO" in out.stdout
    assert "run_job: FAILED" in out.stdout


def test_smoke_stage_past_the_deadline_is_stopped_and_still_reported(job):
    out = run_job(job, STUB_TRAIN="stall", STALL_SECONDS="60", STUB_DEADLINE="3", STUB_REPORT="NO-GO", **SMOKE)
    assert out.returncode != 0
    assert "smoke deadline reached: trainer ran past the plan's budget" in out.stderr
    report = stub_log(job)[-1]
    assert report.startswith("smoke_report report ") and report.endswith("start:train")  # died in train: failed
    assert not any(line.startswith("run_eval") for line in stub_log(job))
    assert_no_leftovers(job["token"])


# --- failures end the job, loudly, with nothing left running ------------------------------------------


