"""The smoke run's plan and its go/no-go report (docs/smoke.md: what it checks and why).

    python3 smoke_report.py plan [--steps N] [--deadline | --knobs]   # what run_job.sh and launch.py follow
    python3 smoke_report.py clear                             # empty the -smoke repo (run_job.sh's preflight)
    python3 smoke_report.py report --work-dir W --stages F    # one screen, smoke_report.json pushed; 1 on NO-GO

The report reads what the job left, never its log text: run_job.sh's stage records, train_log.json, the rollout
counts, the checkpoints downloaded back from the Hub, the eval results in the repo and the installed versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import adapter_repo
import recipe
import sandbox_lifecycle

REPORT_PATH = "smoke_report.json"
SMOKE_SUFFIX = adapter_repo.SMOKE_SUFFIX
# TRL 1.15's per-step counts since the previous logged step (async_grpo_trainer.py): stale-dropped samples, trained
# samples, trained groups.
STALE_KEY, SAMPLES_KEY, GROUPS_KEY = "sample/dropped_stale_total", "batch/samples_per_step", "batch/groups_per_step"
VERSIONED = ("vllm", "torch", "trl", "transformers", "peft", "openenv", "harbor")
# train_rollouts' counts of rollouts the proxy ended (its ENDS, without importing the trainer's modules).
ENDS = ("budget_stopped", "context_exhausted", "cut")


def duration(total_s: int) -> str:
    """Seconds as a Jobs timeout: whole hours as "8h", else minutes ("90m")."""
    return f"{total_s // 3600}h" if total_s % 3600 == 0 else f"{-(-total_s // 60)}m"


# --- The plan --------------------------------------------------------------------------------------------------------
def checked_steps(steps: int) -> int:
    """The smoke's MAX_STEPS: the recipe's SMOKE_STEPS or fewer, enough for a checkpoint, a resume and a step after."""
    span = f"{recipe.SMOKE_MIN_STEPS}..{recipe.SMOKE_STEPS}"
    if steps < recipe.SMOKE_MIN_STEPS:
        raise recipe.ConfigError(f"MAX_STEPS={steps} is too few for a smoke run: use {span} (a checkpoint, a stop, a "
                                 "resume and a step after it)")
    if steps > recipe.SMOKE_STEPS:
        raise recipe.ConfigError(
            f"a smoke run takes MAX_STEPS={span} (the recipe's smoke test is {recipe.SMOKE_STEPS}; its cap covers "
            f"that), not {steps}: use `launch.py train --max-steps {steps}` for a longer run")
    return steps


def save_steps_for(steps: int) -> int:
    """Checkpoint every SMOKE_SAVE_STEPS, at most every half of the run: the first start stops at the first one."""
    return max(1, min(recipe.SMOKE_SAVE_STEPS, steps // 2))


def checkpoint_steps(steps: int = recipe.SMOKE_STEPS, save_steps: int | None = None) -> list[int]:
    """The checkpoint-N the smoke run pushes: every save_steps, and the last step (the trainer always saves it)."""
    save = save_steps_for(steps) if save_steps is None else save_steps
    return sorted({*range(save, steps + 1, save), steps})


def plan(steps: int = recipe.SMOKE_STEPS) -> dict[str, Any]:
    """What a smoke of `steps` does, what it typically takes, and its cap (recipe.SMOKE_TIMEOUT, whatever the steps);
    run_job.sh's stages stop at deadline_s so the report always lands before the cap."""
    steps = checked_steps(steps)
    save = save_steps_for(steps)
    cap = round(recipe.hours(recipe.SMOKE_TIMEOUT) * 3600)
    steps_s = steps * recipe.RECIPE_SMOKE_MINUTES * 60 // recipe.SMOKE_STEPS
    return {"steps": steps, "save_steps": save, "resume_at": save, "checkpoints": checkpoint_steps(steps, save),
            "eval_tasks": recipe.SMOKE_EVAL_TASKS, "total_s": recipe.SMOKE_START_UP_S + steps_s,
            "timeout": recipe.SMOKE_TIMEOUT, "cap_s": cap, "deadline_s": cap - recipe.SMOKE_REPORT_RESERVE_S,
            "watch_cap_s": cap + recipe.SMOKE_WATCH_EXTRA_S}


def render_plan(p: dict[str, Any]) -> str:
    """The plan as the job and `launch.py smoke --dry-run` print it."""
    return (f"smoke plan: MAX_STEPS={p['steps']}, checkpoints {p['checkpoints']}, resume from checkpoint-"
            f"{p['resume_at']}, eval on {p['eval_tasks']} test tasks; typical {duration(p['total_s'])}, timeout "
            f"{p['timeout']}, stages stop at +{duration(p['deadline_s'])} so the report always lands")


def plan_knobs(steps: int) -> str:
    """The job environment a smoke of `steps` runs with (run_job.sh's smoke preflight compares its own to it)."""
    p = plan(steps)
    return f"MAX_STEPS={p['steps']} SAVE_STEPS={p['save_steps']} EVAL_TASKS={p['eval_tasks']}"


def expect_smoke(steps: int = recipe.SMOKE_STEPS) -> dict[str, Any]:
    """What a smoke job must have done (its plan)."""
    p = plan(steps)
    return {"steps": p["steps"], "checkpoints": p["checkpoints"], "resume_at": p["resume_at"], "eval": True}


# --- What the job left behind ----------------------------------------------------------------------------------
def read_stages(path: Path, now: float | None = None) -> list[dict[str, Any]]:
    """run_job.sh's step records ("start NAME EPOCH" / "end NAME EPOCH NOTE"): a step started and never ended failed
    (the job died in it, or the smoke deadline stopped it)."""
    end = time.time() if now is None else now
    started: dict[str, float] = {}
    stages: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        kind, name, epoch, *note = line.split(" ", 3)
        if kind == "start":
            started[name] = float(epoch)
            stages[name] = {"stage": name, "ok": False, "seconds": round(end - started[name]), "note": "did not finish"}
        elif kind == "end" and name in started:
            stages[name].update(ok=True, seconds=round(float(epoch) - started[name]), note=" ".join(note))
    return list(stages.values())


def _values(logs: list[dict[str, Any]], key: str) -> list[float]:
    return [float(e[key]) for e in logs if isinstance(e.get(key), (int, float)) and e[key] == e[key]]


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def ratio_band(expect: dict[str, Any]) -> tuple[float, float]:
    """The band a run's median step token-weighted ratio must stay in: the recipe's 0.998-1.0 with bf16's tolerance
    either side, unless `expect` names another (the CPU rehearsal's tiny random model is not the real one)."""
    tolerance = recipe.RATIO_TOLERANCE
    low, high = expect.get("ratio") or (recipe.RATIO_MIN - tolerance, recipe.RATIO_MAX + tolerance)
    return float(low), float(high)


def training(train_log: dict[str, Any] | None) -> dict[str, Any]:
    """What the steps in train_log.json say (TRL's metrics and train_metrics'): the importance ratio (token-weighted
    per step, judged; per-row extremes, reported), TRL's `kl`, the staleness split, the LoRA's movement, the groups'
    contrast, the pipeline's stale drops and forks, step and sync times."""
    logs = [e for e in (train_log or {}).get("logs", []) if "loss" in e or "ratio" in e]
    low, high = _values(logs, "ratio/sample_min"), _values(logs, "ratio/sample_max")
    sync_ms = [v * 1000 for v in _values(logs, "perf/weight_sync_s")]
    fork = _values(logs, "rollout/fork_frac")
    dropped, trained = sum(_values(logs, STALE_KEY)), sum(_values(logs, SAMPLES_KEY))

    def mean(key: str) -> float | None:
        return statistics.fmean(v) if (v := _values(logs, key)) else None

    def last(key: str) -> float | None:
        return (_values(logs, key) or [None])[-1]

    return {
        "steps_done": max((int(e["step"]) for e in logs), default=0),
        "step_s": _spread(_values(logs, "perf/step_s")),
        "ratio_token": _spread(_values(logs, "ratio/token_mean")),
        "ratio": {"min": min(low), "max": max(high)} if low and high else None,
        "kl": _spread(_values(logs, "kl")),
        "by_age": {f"{kind}_{age}": mean(f"{kind}/{age}") for kind in ("kl", "clip_ratio") for age in ("fresh", "old")},
        "unbounded_tokens": sum(_values(logs, "clip_ratio/unbounded_total")),
        "lora_update": mean("lora/update_norm"), "lora_b_norm": last("lora/b_norm"),
        "learning_rate": last("learning_rate"),
        "groups": {"zero_contrast": mean("group/zero_contrast_frac"), "bonus_only": mean("group/bonus_only_frac"),
                   "zero_advantage": mean("sample/zero_advantage_frac")},
        "sync_ms": _spread(sync_ms),
        "fork_frac": statistics.fmean(fork) if fork else None,
        "dropped_stale": dropped, "samples_trained": trained,
        "stale_frac": dropped / (dropped + trained) if dropped + trained else None,
    }


def resume(train_log: dict[str, Any] | None, at: int) -> dict[str, Any]:
    """Whether the last trainer start resumed from checkpoint-`at` rather than restarting: its state began at step
    `at` and the first step it logged was `at` + 1."""
    starts = (train_log or {}).get("starts", [])
    if len(starts) < 2:
        return {"verified": False, "why": f"{len(starts)} trainer start(s) recorded, the smoke run makes 2"}
    last = starts[-1]
    own = [int(e["step"]) for e in train_log["logs"] if e.get("start") == len(starts) - 1 and "loss" in e]
    first = min(own, default=None)
    ok = last.get("resumed_from") == at and last.get("global_step") == at and first == at + 1
    why = (f"resumed_from {last.get('resumed_from')}, state began at step {last.get('global_step')}, "
           f"first step trained {first}")
    return {"verified": ok, "from": last.get("resumed_from"), "why": why, "consumed": consumed(train_log, at)}


def consumed(train_log: dict[str, Any] | None, at: int) -> int:
    """Groups the first start used up by its step `at`, at least: the ones it trained and the ones TRL dropped as
    stale (whole groups of NUM_GENERATIONS samples). A resume must start past all of them."""
    logs = [e for e in (train_log or {}).get("logs", []) if e.get("start") == 0 and int(e.get("step", 0)) <= at]
    return int(sum(_values(logs, GROUPS_KEY)) + sum(_values(logs, STALE_KEY)) // recipe.NUM_GENERATIONS)


def verify_checkpoints(api: Any, repo_id: str, steps: Iterable[int], work: Path) -> list[dict[str, Any]]:
    """Each checkpoint downloaded back from the Hub and checked against its marker (adapter_repo's verified download,
    the one resume uses), and its trainer state saying that step."""
    found = []
    for step in steps:
        entry: dict[str, Any] = {"step": step, "verified": False, "files": 0, "bytes": 0, "error": None,
                                 "prompt_index": None, "consumed_ahead": 0}
        try:
            local = adapter_repo.download_checkpoint(api, repo_id, step, work)
            files = [p for p in local.rglob("*") if p.is_file()]
            state = json.loads((local / "trainer_state.json").read_text())
            entry.update(files=len(files), bytes=sum(p.stat().st_size for p in files))
            if position := recipe.read_json(local / recipe.ROLLOUT_STATE):  # where the next start begins
                entry["prompt_index"] = position.get("prompt_index")
                entry["consumed_ahead"] = len(position.get(recipe.CONSUMED_AHEAD, []))
            if state.get("global_step") != step:
                entry["error"] = f"trainer_state.json says step {state.get('global_step')}"
            else:
                entry["verified"] = True
        except Exception as error:  # noqa: BLE001 - any failure to read it back is this checkpoint's finding
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        found.append(entry)
    return found


def evaluation(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """Cells and pass@1 of each side from eval_adapter's results document (None if it never landed)."""
    if not doc:
        return None
    summary = doc.get("summary") or {}
    sides = {side: {k: (summary.get(side) or {}).get(k) for k in ("tasks", "scored", "correct", "unscorable",
                                                                    "pass_at_1")} for side in ("base", "adapter")}
    return {"complete": bool(doc.get("complete")), "cells": len(doc.get("cells", [])),
            "tasks": len(doc.get("tasks", [])), **sides}


def versions() -> dict[str, str | None]:
    """The installed stack, kept with the verdict after the job's image is gone."""
    found: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def merge_ledgers(ledgers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """train_rollouts' counts summed over trainer starts (each start's rollout child begins a new ledger)."""
    if not ledgers:
        return None
    total: dict[str, Any] = {k: sum(d.get(k) or 0 for d in ledgers)
                             for k in ("rollouts", "scored", "timed_out", *ENDS, "unscorable_total")}
    classes = dict.fromkeys(c for d in ledgers for c in d.get("unscorable") or {})  # the guard's, in its order
    total["unscorable"] = {c: sum((d.get("unscorable") or {}).get(c, 0) for d in ledgers) for c in classes}
    timings = [d.get("timing") or {} for d in ledgers]
    total["timing"] = {"count": sum(t.get("count", 0) for t in timings), "max": {}}
    for timing in timings:
        for key, seconds in (timing.get("max") or {}).items():
            total["timing"]["max"][key] = max(total["timing"]["max"].get(key, seconds), seconds)
    total["stopped"] = next((d["stopped"] for d in ledgers if d.get("stopped")), None)
    return total


# --- The verdict -----------------------------------------------------------------------------------------------
def limits(expect: dict[str, Any]) -> dict[str, float]:
    """The verdict's limits: recipe.py's, unless `expect` names others (the rehearsal injects faults on purpose)."""
    return {"unscorable": recipe.SMOKE_MAX_UNSCORABLE, "stale": recipe.SMOKE_MAX_STALE, "fork": recipe.SMOKE_MAX_FORK,
            "setup_s": recipe.ROLLOUT_SETUP_BUDGET_S, "kl": recipe.SMOKE_KL_MAX, **(expect.get("limits") or {})}


def assess(report: dict[str, Any], expect: dict[str, Any]) -> list[str]:
    """Every reason the run is NO-GO (empty = GO). `expect`: steps, checkpoints, resume_at (or None), eval (bool)."""
    reasons = [f"stage {s['stage']} failed after {s['seconds']} s: {s['note']}"
               for s in report["stages"] if not s["ok"]]
    train, bounds = report["training"], limits(expect)
    if train["steps_done"] < expect["steps"]:
        reasons.append(f"{train['steps_done']} of {expect['steps']} steps done")
    reasons += policy_reasons(train, expect)
    reasons += [f"checkpoint-{c['step']} not readable back from the Hub: {c['error']}"
                for c in report["checkpoints"] if not c["verified"]]
    if expect.get("resume_at"):
        if not report["resume"]["verified"]:
            reasons.append(f"resume from checkpoint-{expect['resume_at']} not verified: {report['resume']['why']}")
        reasons += resume_position(report, expect["resume_at"])
    reasons += rollout_reasons(report["rollouts"], bounds, expect.get("sandbox", True))
    reasons += pipeline_reasons(train, bounds)
    if expect.get("eval"):
        ev = report["eval"]
        if ev is None or not ev["complete"]:
            reasons.append("final eval on the subset did not complete")
        else:
            for side in ("base", "adapter"):
                cells = ev[side]
                if (cells["scored"] or 0) < (cells["tasks"] or 0) or cells["unscorable"]:
                    reasons.append(f"eval: {cells['scored'] or 0} of {cells['tasks'] or 0} {side} cells scored "
                                   f"({cells['unscorable'] or 0} unscorable): a smoke eval scores every cell")
    return reasons


def policy_reasons(train: dict[str, Any], expect: dict[str, Any]) -> list[str]:
    """Whether trainer and vLLM hold the same policy: the median step's token-weighted ratio in its band (truncated
    sampling moves it, nothing else can: recipe.RATIO_MIN) and its `kl` under the ceiling (recipe.SMOKE_KL_MAX)."""
    ratio, kl, (low, high), ceiling = train["ratio_token"], train["kl"], ratio_band(expect), limits(expect)["kl"]
    if ratio is None or kl is None:
        return ["no importance ratio or kl logged (ratio/token_mean, kl): no step trained"]
    reasons = []
    if not low <= ratio["median"] <= high:
        reasons.append(f"token-weighted importance ratio {ratio['median']:.4f} (median step; steps {ratio['min']:.4f}-"
                       f"{ratio['max']:.4f}) outside {low:.4f}-{high:.4f}: vLLM samples from a truncated distribution "
                       "(top_p, top_k or min_p; serve with --generation-config vllm)")
    if kl["median"] > ceiling:
        reasons.append(f"kl {kl['median']:.2g} (median step; max {kl['max']:.2g}) over the {ceiling:g} ceiling: "
                       "trainer and vLLM disagree on the policy (weights after a sync, chat template, dtype)")
    return reasons


def resume_position(report: dict[str, Any], at: int) -> list[str]:
    """The second start must begin past every group the first consumed: checkpoint-`at`'s rollout_state.json skips the
    groups below its prompt_index and those in its consumed_ahead (train_resume.py)."""
    entry = next((c for c in report["checkpoints"] if c["step"] == at), None)
    index = entry and entry.get("prompt_index")
    need = report["resume"].get("consumed") or 0
    if index is None:
        return [f"checkpoint-{at} has no {recipe.ROLLOUT_STATE} prompt_index: the resume position is unknown"]
    if (skipped := index + entry.get("consumed_ahead", 0)) < need:
        return [f"resume position skips {skipped} groups (checkpoint-{at}'s {recipe.ROLLOUT_STATE}), fewer than the "
                f"{need} the first start consumed: a relaunch would train them again"]
    return []


def rollout_reasons(rollouts: dict[str, Any] | None, limit: dict[str, float], sandbox: bool) -> list[str]:
    """The rollout side: the guard's stop, scored rollouts, unscorable share by class, per-rollout setup time."""
    if rollouts is None:
        return ["no rollout counts (rollouts.json missing): the rollout worker never finished a rollout"]
    reasons = []
    if rollouts.get("stopped"):
        reasons.append(f"rollout guard stopped the run: {rollouts['stopped']}")
    finished, lost = rollouts.get("rollouts") or 0, rollouts.get("unscorable_total") or 0
    if not rollouts.get("scored"):
        reasons.append("no rollout was scored")
    if finished and lost / finished > limit["unscorable"]:
        classes = ", ".join(f"{c} {n}" for c, n in (rollouts.get("unscorable") or {}).items() if n)
        reasons.append(f"{lost} of {finished} finished rollouts unscorable ({lost / finished:.0%} > "
                       f"{limit['unscorable']:.0%}): {classes}")
    timing = rollouts.get("timing") or {}
    slowest = timing.get("max") or {}
    if not timing.get("count") or sandbox_lifecycle.SETUP_KEY not in slowest:
        if sandbox:
            reasons.append("per-rollout setup time not measured (no timing in rollouts.json): sandbox start, data "
                           "pull, agent install and verifier are unchecked")
        return reasons
    if (setup := slowest[sandbox_lifecycle.SETUP_KEY]) > limit["setup_s"]:
        reasons.append(f"slowest rollout setup {setup:.0f} s is over the {limit['setup_s']:.0f} s OpenEnv's call limit "
                       "leaves beside the agent timeout: an agent near its timeout loses its rollout "
                       "(ROLLOUT_SETUP_BUDGET_S in recipe.py)")
    agent = slowest.get(sandbox_lifecycle.AGENT_PART)
    if agent is not None and agent > recipe.SANDBOX_IDLE_TIMEOUT_S - recipe.SANDBOX_IDLE_MARGIN_S:
        reasons.append(f"slowest agent run {agent:.0f} s is within {recipe.SANDBOX_IDLE_MARGIN_S} s of the sandbox's "
                       f"{recipe.SANDBOX_IDLE_TIMEOUT_S} s idle timeout: its sandbox may shut down under it")
    return reasons


def pipeline_reasons(train: dict[str, Any], limit: dict[str, float]) -> list[str]:
    """What the trainer learns from: TRL's stale drops and the capture's forks within their limits, both logged."""
    reasons = []
    if train["stale_frac"] is None:
        reasons.append(f"no trained samples logged ({SAMPLES_KEY}): the stale-drop share is unknown")
    elif train["stale_frac"] > limit["stale"]:
        reasons.append(f"TRL dropped {train['dropped_stale']:.0f} samples as stale against "
                       f"{train['samples_trained']:.0f} trained ({train['stale_frac']:.0%} > {limit['stale']:.0%}): "
                       "finished sandbox work thrown away (recipe.py MAX_STALENESS and the in-flight count)")
    if train["fork_frac"] is None:
        reasons.append("rollout/fork_frac not logged: whether a step trains whole groups is unknown")
    elif train["fork_frac"] > limit["fork"]:
        reasons.append(f"fork fraction {train['fork_frac']:.2f} > {limit['fork']:.2f}: captured rollouts split into "
                       "several training rows, so a step trains part of a group")
    return reasons


def warnings(train: dict[str, Any]) -> list[str]:
    """What a user should know before the long run but that does not stop it."""
    flat = train["groups"]["zero_contrast"]
    if flat is not None and flat > recipe.SMOKE_ZERO_CONTRAST_WARN:
        return [f"{flat:.0%} of the trained rows came from zero-contrast groups (every reward equal: the step trains "
                "nothing from them): the tasks are too hard or too easy for the policy as it stands"]
    return []


def build(stages: list[dict[str, Any]], train_log: dict[str, Any] | None, ledger: dict[str, Any] | None,
          checkpoints: list[dict[str, Any]], eval_doc: dict[str, Any] | None, found_versions: dict[str, Any],
          expect: dict[str, Any]) -> dict[str, Any]:
    """The report document: every section, then the verdict and its reasons."""
    report: dict[str, Any] = {
        "schema": 1, "created": time.time(), "expect": expect, "stages": stages,
        "training": {**training(train_log), "ratio_band": list(ratio_band(expect)), "kl_ceiling": limits(expect)["kl"]},
        "rollouts": None if ledger is None else {k: ledger.get(k) for k in (
            "rollouts", "scored", "timed_out", *ENDS, "unscorable", "unscorable_total", "timing", "stopped")},
        "checkpoints": checkpoints,
        "resume": resume(train_log, expect["resume_at"]) if expect.get("resume_at") else {"verified": None},
        "eval": evaluation(eval_doc),
        "versions": found_versions,
    }
    reasons = assess(report, expect)
    report["verdict"], report["reasons"] = ("NO-GO" if reasons else "GO"), reasons
    report["warnings"] = warnings(report["training"])
    return report


# --- The screen ------------------------------------------------------------------------------------------------------
def render(report: dict[str, Any]) -> str:
    """One screen for the job log."""
    def num(value: Any, spec: str = ".0f") -> str:
        return "-" if value is None else format(value, spec)

    def pct(value: float | None) -> str:
        return num(value, ".1%")

    t, r = report["training"], report["rollouts"] or {}
    step_s, sync, token, row, kl, age, groups = (t["step_s"] or {}, t["sync_ms"] or {}, t["ratio_token"] or {},
                                                 t["ratio"] or {}, t["kl"] or {}, t["by_age"], t["groups"])
    lines = ["=" * 78, f"SMOKE REPORT: {report['verdict']}", "-" * 78]
    lines += [f"  {'ok  ' if s['ok'] else 'FAIL'} {s['stage']:<11} {s['seconds']:>5} s  {s['note'][:55]}"
              for s in report["stages"]]
    lines += [
        f"  steps {t['steps_done']}/{report['expect']['steps']}; step time median {num(step_s.get('median'), '.1f')} s,"
        f" max {num(step_s.get('max'), '.1f')} s",
        f"  rollouts {num(r.get('rollouts'))} finished, {num(r.get('scored'))} scored, {num(r.get('timed_out'))} timed "
        f"out, {num(r.get('unscorable_total'))} unscorable {json.dumps(r.get('unscorable'))}",
        f"  trained {num(t['samples_trained'])} samples, {num(t['dropped_stale'])} dropped stale (stale "
        f"{pct(t['stale_frac'])}); fork_frac {'not logged' if t['fork_frac'] is None else num(t['fork_frac'], '.3f')}",
        f"  importance ratio, token-weighted: median step {num(token.get('median'), '.4f')} (steps "
        f"{num(token.get('min'), '.4f')}-{num(token.get('max'), '.4f')}; band {t['ratio_band'][0]:.4f}-"
        f"{t['ratio_band'][1]:.4f}); per-row means {num(row.get('min'), '.4f')}-{num(row.get('max'), '.4f')} "
        "(not judged)",
        f"  kl median step {num(kl.get('median'), '.2g')}, max {num(kl.get('max'), '.2g')} (ceiling "
        f"{t['kl_ceiling']:g}); by age (fresh/old): kl {num(age['kl_fresh'], '.2g')}/{num(age['kl_old'], '.2g')}, "
        f"clipped {pct(age['clip_ratio_fresh'])}/{pct(age['clip_ratio_old'])}; unbounded tokens "
        f"{num(t['unbounded_tokens'])}",
        f"  LoRA: update {num(t['lora_update'], '.2g')}/step, |B| {num(t['lora_b_norm'], '.2g')}, learning rate "
        f"{num(t['learning_rate'], 'g')}; rows from zero-contrast groups {pct(groups['zero_contrast'])}, zero "
        f"advantage {pct(groups['zero_advantage'])}, bonus-only contrast {pct(groups['bonus_only'])}",
        f"  sync median {num(sync.get('median'), '.1f')} ms, max {num(sync.get('max'), '.1f')} ms; rollouts ended by "
        f"the call budget {num(r.get('budget_stopped'))}, the context {num(r.get('context_exhausted'))}, a cut at the "
        f"output cap {num(r.get('cut'))}",
        setup_line(r.get("timing")),
        "  checkpoints " + ", ".join(f"{c['step']}:{'ok' if c['verified'] else 'FAIL'}" for c in report["checkpoints"])
        + "; resume " + (report["resume"].get("why") or "not part of this run"),
    ]
    ev = report["eval"]
    sides = ", ".join(f"{side} {num(ev[side]['pass_at_1'], '.2f')} ({ev[side]['scored']} scored)"
                      for side in ("base", "adapter")) if ev else ""
    lines.append(f"  eval {ev['cells']} cells on {ev['tasks']} tasks; pass@1 {sides}" if ev else "  eval: no results")
    lines.append("  " + ", ".join(f"{k} {v or '-'}" for k, v in report["versions"].items()))
    lines += [f"  WARN: {warning}" for warning in report["warnings"]]
    lines += [f"  NO-GO: {reason}" for reason in report["reasons"]] or ["  GO: every check passed"]
    return "\n".join([*lines, "=" * 78])


def setup_line(timing: dict[str, Any] | None) -> str:
    """The rollouts' setup (train_rollouts' timing): the slowest whole setup against its budget, the slowest parts."""
    slowest = (timing or {}).get("max") or {}
    if not (timing or {}).get("count") or sandbox_lifecycle.SETUP_KEY not in slowest:
        return "  setup per rollout: not measured"
    parts = ", ".join(f"{key.removesuffix('_s')} {slowest[key]:.0f}" for key in sandbox_lifecycle.TIMING_PARTS
                      if key in slowest and key != sandbox_lifecycle.AGENT_PART)
    return (f"  setup of {timing['count']} rollouts: slowest {slowest[sandbox_lifecycle.SETUP_KEY]:.0f} s (budget "
            f"{recipe.ROLLOUT_SETUP_BUDGET_S} s); {parts} s at most")


# --- The Hub ---------------------------------------------------------------------------------------------------------
def clear(api: Any, repo_id: str) -> int:
    """Delete an earlier smoke run's files, so this run's checkpoints, resume and eval are its own (-smoke only).

    The same commit records this run (adapter_repo.SMOKE_RUN_PATH: a fresh id, the job, until when it can run), so a
    watcher adopts only this run's files and starts over if a later run's clear replaces it. Returns the files deleted.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    if not repo_id.endswith(SMOKE_SUFFIX):
        raise recipe.ConfigError(f"ADAPTER_REPO={repo_id} does not end with {SMOKE_SUFFIX}: a smoke run empties its "
                                 f"repo first, so it runs only on one (launch.py smoke adds {SMOKE_SUFFIX})")
    api.create_repo(repo_id, private=True, exist_ok=True)
    now = time.time()
    run = {"run": uuid.uuid4().hex, "job": os.environ.get("JOB_ID") or os.environ.get("HF_JOB_ID"),
           "cleared_at": now, "expires_at": now + plan()["cap_s"], "finished": False}
    marker = CommitOperationAdd(path_in_repo=adapter_repo.SMOKE_RUN_PATH, path_or_fileobj=json.dumps(run).encode())
    message = f"smoke: clear the previous smoke run; this is run {run['run']}"

    def attempt() -> int:  # on top of the head it listed: a file pushed meanwhile (a watcher's) cannot survive it
        head = api.repo_info(repo_id).sha
        stale = [f for f in api.list_repo_files(repo_id, revision=head)
                 if f not in (".gitattributes", adapter_repo.SMOKE_RUN_PATH)]
        api.create_commit(repo_id, [CommitOperationDelete(path_in_repo=f) for f in stale] + [marker],
                          commit_message=message, parent_commit=head)
        return len(stale)

    return adapter_repo.with_retries(f"commit {message!r} to {repo_id}", attempt)


def push(api: Any, repo_id: str, report: dict[str, Any]) -> None:
    """smoke_report.json at the repo root, and the run marked finished in the same commit (a watcher started later
    waits for the next run instead of adopting this one's files)."""
    data = json.dumps(report, indent=1, sort_keys=True).encode()

    def files(head: str) -> dict[str, bytes]:
        run = adapter_repo.read_json(api, repo_id, adapter_repo.SMOKE_RUN_PATH, revision=head)
        finished = {adapter_repo.SMOKE_RUN_PATH: json.dumps({**run, "finished": True}).encode()} if run else {}
        return {REPORT_PATH: data, **finished}

    adapter_repo.commit_cas(api, repo_id, files, f"smoke: {REPORT_PATH} ({report['verdict']})")


def collect(api: Any, repo_id: str, work_dir: Path, stages: list[dict[str, Any]], expect: dict[str, Any]
            ) -> dict[str, Any]:
    """Everything the job left in `work_dir` (recipe.py's work-folder files: rollout counts, train log) and the repo."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = verify_checkpoints(api, repo_id, expect["checkpoints"], Path(tmp))
    try:
        eval_doc = adapter_repo.read_json(api, repo_id, adapter_repo.full_results_path(adapter_repo.FINAL))
    except Exception:  # noqa: BLE001 - an unreadable repo shows as failed checkpoints and no eval
        eval_doc = None
    paths = [*recipe.kept_ledgers(work_dir), work_dir / recipe.LEDGER_NAME]  # the earlier starts', then the last's
    ledgers = [d for d in map(recipe.read_json, paths) if d]
    return build(stages, recipe.read_json(work_dir / recipe.TRAIN_LOG_NAME), merge_ledgers(ledgers), checkpoints,
                 eval_doc if expect.get("eval") else None, versions(), expect)


def main(argv: list[str] | None = None, make_api: Callable[[str], Any] | None = None) -> int:
    """Entry point: a failure ends in one line on stderr (DEBUG=1 prints the traceback first), as in every script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("plan", help="print the smoke plan")
    show.add_argument("--deadline", action="store_true", help="print only the seconds run_job.sh's stages may take")
    show.add_argument("--knobs", action="store_true", help="print only the plan's MAX_STEPS, SAVE_STEPS, EVAL_TASKS")
    show.add_argument("--steps", type=int, default=recipe.SMOKE_STEPS,
                      help=f"the smoke's MAX_STEPS ({recipe.SMOKE_MIN_STEPS}..{recipe.SMOKE_STEPS})")
    sub.add_parser("clear", help="empty the -smoke ADAPTER_REPO before a smoke run")
    rep = sub.add_parser("report", help="build, print and push the go/no-go report; exit 1 on NO-GO")
    rep.add_argument("--work-dir", type=Path, required=True, help="run_job.sh's WORK_DIR")
    rep.add_argument("--stages", type=Path, required=True, help="run_job.sh's stage records")
    args = parser.parse_args(argv)
    return adapter_repo.run_cli("smoke_report", lambda: command(args, make_api))


def command(args: argparse.Namespace, make_api: Callable[[str], Any] | None) -> None:
    """One subcommand; a failure (a NO-GO verdict too) raises, so main ends it in one line like every script."""
    if args.command == "plan":
        p = plan(args.steps)
        print(p["deadline_s"] if args.deadline else plan_knobs(args.steps) if args.knobs else render_plan(p))
        return
    repo_id = recipe.require_repo_id(os.environ.get("ADAPTER_REPO", "").strip(), "ADAPTER_REPO")
    token = recipe.require_token()
    if make_api is None:
        from huggingface_hub import HfApi

        def make_api(tok: str) -> Any:
            return HfApi(token=tok)

    api = make_api(token)
    if args.command == "clear":
        print(f"smoke_report: cleared {clear(api, repo_id)} files of the previous smoke run from {repo_id}")
        return
    steps = int(os.environ.get("MAX_STEPS") or recipe.SMOKE_STEPS)  # run_job.sh exports the smoke's MAX_STEPS
    report = collect(api, repo_id, args.work_dir, read_stages(args.stages), expect_smoke(steps))
    recipe.write_json(args.work_dir / REPORT_PATH, report, indent=1, sort_keys=True)
    print(render(report), flush=True)
    try:
        push(api, repo_id, report)
        print(f"smoke_report: {REPORT_PATH} pushed to {repo_id}")
    except adapter_repo.PushError as error:
        raise adapter_repo.Failure(f"{error}; the report is in {args.work_dir / REPORT_PATH}") from error
    if report["verdict"] != "GO":
        raise adapter_repo.Failure(f"NO-GO: see the report above ({REPORT_PATH} in {repo_id})")


if __name__ == "__main__":
    sys.exit(main())
