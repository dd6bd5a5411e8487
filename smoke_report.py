"""The smoke run's plan and its go/no-go report (docs/smoke.md: what it checks and why).

    python3 smoke_report.py plan                              # run_job.sh's smoke numbers for its MAX_STEPS
    python3 smoke_report.py clear                             # empty the -smoke repo (run_job.sh's preflight)
    python3 smoke_report.py report --work-dir W --stages F    # one screen, smoke_report.json pushed; 1 on NO-GO
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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import adapter_repo
import recipe
import sandbox_lifecycle

REPORT_PATH = "smoke_report.json"
SMOKE_SUFFIX = adapter_repo.SMOKE_SUFFIX
# TRL 1.15's per-step counts (async_grpo_trainer.py): stale-dropped samples, trained samples, trained groups.
STALE_KEY, SAMPLES_KEY, GROUPS_KEY = "sample/dropped_stale_total", "batch/samples_per_step", "batch/groups_per_step"
# train_rollouts' counts of rollouts the proxy ended (its ENDS, without importing the trainer's modules).
ENDS = ("budget_stopped", "context_exhausted", "cut")
SIDES = ("base", "adapter")  # the eval's


def duration(total_s: int) -> str:
    """Seconds as a Jobs timeout: whole hours as "8h", else minutes ("90m")."""
    return f"{total_s // 3600}h" if total_s % 3600 == 0 else f"{-(-total_s // 60)}m"


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


def checkpoint_steps(steps: int, save: int) -> list[int]:
    """The checkpoint-N a run pushes: every `save` steps, and the last step (the trainer always saves it)."""
    return sorted({*range(save, steps + 1, save), steps})


def plan(steps: int = recipe.SMOKE_STEPS) -> dict[str, Any]:
    """What a smoke of `steps` does, its typical time, its cap; stages stop at deadline_s, so the report lands."""
    steps = checked_steps(steps)
    save = max(1, min(recipe.SMOKE_SAVE_STEPS, steps // 2))  # at most half the run: the first start stops there
    cap = round(recipe.hours(recipe.SMOKE_TIMEOUT) * 3600)
    steps_s = steps * recipe.RECIPE_SMOKE_MINUTES * 60 // recipe.SMOKE_STEPS
    return {"steps": steps, "save_steps": save, "resume_at": save, "checkpoints": checkpoint_steps(steps, save),
            "eval_tasks": recipe.SMOKE_EVAL_TASKS, "total_s": recipe.SMOKE_START_UP_S + steps_s,
            "timeout": recipe.SMOKE_TIMEOUT, "cap_s": cap, "deadline_s": cap - recipe.SMOKE_REPORT_RESERVE_S,
            "watch_cap_s": cap + recipe.SMOKE_WATCH_EXTRA_S}


def job_plan(env: Mapping[str, str]) -> str:
    """The plan's line for the job log, then run_job.sh's numbers: MAX_STEPS SAVE_STEPS EVAL_TASKS deadline_s. A
    SAVE_STEPS or EVAL_TASKS other than the plan's is refused: the cap holds only the plan."""
    raw = env.get("MAX_STEPS", "").strip()
    p = plan(recipe.knob("MAX_STEPS", value=raw) if raw else recipe.SMOKE_STEPS)
    knobs = {"MAX_STEPS": p["steps"], "SAVE_STEPS": p["save_steps"], "EVAL_TASKS": p["eval_tasks"]}
    said = " ".join(f"{name}={value}" for name, value in knobs.items())
    if any(env.get(name, "").strip() not in ("", str(value)) for name, value in knobs.items()):
        raise recipe.ConfigError(f"MODE=smoke runs its budgeted plan ({said}): set only MAX_STEPS (at most the "
                                 "recipe's SMOKE_STEPS)")
    return (f"smoke plan: {said}, checkpoints {p['checkpoints']}, resume from checkpoint-{p['resume_at']}; typical "
            f"{duration(p['total_s'])}, timeout {p['timeout']}, stages stop at +{duration(p['deadline_s'])} so the "
            f"report always lands\n{' '.join(map(str, knobs.values()))} {p['deadline_s']}")


def read_stages(path: Path, now: float | None = None) -> list[dict[str, Any]]:
    """run_job.sh's step records ("start NAME EPOCH" / "end NAME EPOCH NOTE"): one started and never ended failed."""
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


def training(train_log: dict[str, Any] | None) -> dict[str, Any]:
    """What the steps in train_log.json say (TRL's metrics and train_metrics'; docs/training.md reads them)."""
    logs = [e for e in (train_log or {}).get("logs", []) if "loss" in e or "ratio" in e]
    low, high = _values(logs, "ratio/sample_min"), _values(logs, "ratio/sample_max")
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
        "fork_frac": mean("rollout/fork_frac"),
        "dropped_stale": dropped, "samples_trained": trained,
        "stale_frac": dropped / (dropped + trained) if dropped + trained else None,
    }


def resume(train_log: dict[str, Any] | None, at: int) -> dict[str, Any]:
    """Whether the last trainer start resumed from checkpoint-`at` (its state began at step `at`, its first step was
    `at` + 1), and the groups the first start used up by then, which the resume position must skip: trained or stale."""
    starts, logs = (train_log or {}).get("starts", []), (train_log or {}).get("logs", [])
    before = [e for e in logs if e.get("start") == 0 and int(e.get("step", 0)) <= at]
    used = int(sum(_values(before, GROUPS_KEY)) + sum(_values(before, STALE_KEY)) // recipe.NUM_GENERATIONS)
    if len(starts) < 2:
        return {"verified": False, "why": f"{len(starts)} trainer start(s) recorded, the smoke run makes 2"}
    last = starts[-1]
    first = min((int(e["step"]) for e in logs if e.get("start") == len(starts) - 1 and "loss" in e), default=None)
    ok = last.get("resumed_from") == at and last.get("global_step") == at and first == at + 1
    why = (f"resumed_from {last.get('resumed_from')}, state began at step {last.get('global_step')}, "
           f"first step trained {first}")
    return {"verified": ok, "from": last.get("resumed_from"), "why": why, "consumed": used}


def verify_checkpoints(api: Any, repo_id: str, steps: Iterable[int], work: Path) -> list[dict[str, Any]]:
    """Each checkpoint downloaded back from the Hub and checked against its marker (adapter_repo's verified download,
    the one resume uses), and its trainer state saying that step."""
    found = []
    for step in steps:
        entry: dict[str, Any] = {"step": step, "verified": False, "error": None, "prompt_index": None,
                                 "consumed_ahead": 0}
        try:
            local = adapter_repo.download_checkpoint(api, repo_id, step, work)
            said = json.loads((local / "trainer_state.json").read_text()).get("global_step")
            if position := recipe.read_json(local / recipe.ROLLOUT_STATE):  # where the next start begins
                entry.update(prompt_index=position.get("prompt_index"),
                             consumed_ahead=len(position.get(recipe.CONSUMED_AHEAD, [])))
            entry.update(verified=said == step, error=None if said == step else f"trainer_state.json says step {said}")
        except Exception as error:  # noqa: BLE001 - any failure to read it back is this checkpoint's finding
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        found.append(entry)
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
    slowest: dict[str, float] = {}  # each part's slowest over the starts
    for part, seconds in ((k, v) for t in timings for k, v in (t.get("max") or {}).items()):
        slowest[part] = max(slowest.get(part, seconds), seconds)
    total["timing"] = {"count": sum(t.get("count", 0) for t in timings), "max": slowest}
    total["stopped"] = next((d["stopped"] for d in ledgers if d.get("stopped")), None)
    return total


def limits(expect: dict[str, Any]) -> dict[str, Any]:
    """The verdict's limits: recipe.py's, unless `expect` names others (the CPU rehearsal's tiny random model and
    injected faults). The median step's token-weighted ratio band: the recipe's 0.998-1.0, bf16's tolerance beside."""
    tolerance = recipe.RATIO_TOLERANCE
    band = expect.get("ratio") or (recipe.RATIO_MIN - tolerance, recipe.RATIO_MAX + tolerance)
    return {"ratio": [float(b) for b in band], "kl": recipe.SMOKE_KL_MAX, "unscorable": recipe.SMOKE_MAX_UNSCORABLE,
            "stale": recipe.SMOKE_MAX_STALE, "fork": recipe.SMOKE_MAX_FORK, "setup_s": recipe.ROLLOUT_SETUP_BUDGET_S,
            **(expect.get("limits") or {})}


def assess(report: dict[str, Any], expect: dict[str, Any]) -> list[str]:
    """Every reason the run is NO-GO (empty = GO), each naming its numbers, in the job's order. `expect`: steps,
    checkpoints, resume_at (or None), eval (bool), and limits() of its own."""
    train, rollouts, bound = report["training"], report["rollouts"] or {}, limits(expect)
    reasons = [f"stage {s['stage']} failed after {s['seconds']} s: {s['note']}"
               for s in report["stages"] if not s["ok"]]
    if train["steps_done"] < expect["steps"]:
        reasons.append(f"{train['steps_done']} of {expect['steps']} steps done")
    # Trainer and vLLM hold one policy: truncated sampling moves the token-weighted ratio (nothing else can), a
    # disagreement moves TRL's kl (docs/smoke.md).
    ratio, kl, (low, high) = train["ratio_token"], train["kl"], bound["ratio"]
    if ratio is None or kl is None:
        reasons.append("no importance ratio or kl logged (ratio/token_mean, kl): no step trained")
    elif not low <= ratio["median"] <= high:
        reasons.append(f"token-weighted importance ratio {ratio['median']:.4f} (median step; steps {ratio['min']:.4f}-"
                       f"{ratio['max']:.4f}) outside {low:.4f}-{high:.4f}: vLLM samples from a truncated distribution "
                       "(top_p, top_k or min_p; serve with --generation-config vllm)")
    if ratio and kl and kl["median"] > bound["kl"]:
        reasons.append(f"kl {kl['median']:.2g} (median step; max {kl['max']:.2g}) over the {bound['kl']:g} ceiling: "
                       "trainer and vLLM disagree on the policy (weights after a sync, chat template, dtype)")
    reasons += [f"checkpoint-{c['step']} not readable back from the Hub: {c['error']}"
                for c in report["checkpoints"] if not c["verified"]]
    if at := expect.get("resume_at"):
        if not report["resume"]["verified"]:
            reasons.append(f"resume from checkpoint-{at} not verified: {report['resume']['why']}")
        # checkpoint-`at`'s rollout_state.json skips the groups below prompt_index and those in consumed_ahead
        entry = next((c for c in report["checkpoints"] if c["step"] == at), {})
        need = report["resume"].get("consumed") or 0
        if entry.get("prompt_index") is None:
            reasons.append(f"checkpoint-{at} has no {recipe.ROLLOUT_STATE} prompt_index: the resume position is "
                           "unknown")
        elif (skipped := entry["prompt_index"] + entry.get("consumed_ahead", 0)) < need:
            reasons.append(f"resume position skips {skipped} groups (checkpoint-{at}'s {recipe.ROLLOUT_STATE}), fewer "
                           f"than the {need} the first start consumed: a relaunch would train them again")
    if report["rollouts"] is None:
        reasons.append("no rollout counts (rollouts.json missing): the rollout worker never finished a rollout")
    elif rollouts.get("stopped"):
        reasons.append(f"rollout guard stopped the run: {rollouts['stopped']}")
    finished, lost = rollouts.get("rollouts") or 0, rollouts.get("unscorable_total") or 0
    if finished and lost / finished > bound["unscorable"]:
        classes = ", ".join(f"{c} {n}" for c, n in (rollouts.get("unscorable") or {}).items() if n)
        reasons.append(f"{lost} of {finished} finished rollouts unscorable ({lost / finished:.0%} > "
                       f"{bound['unscorable']:.0%}): {classes}")
    setup = ((rollouts.get("timing") or {}).get("max") or {}).get(sandbox_lifecycle.SETUP_KEY)
    if setup is not None and setup > bound["setup_s"]:
        reasons.append(f"slowest rollout setup {setup:.0f} s is over the {bound['setup_s']:.0f} s OpenEnv's call limit "
                       "leaves beside the agent timeout: an agent near its timeout loses its rollout "
                       "(ROLLOUT_SETUP_BUDGET_S in recipe.py)")
    if (stale := train["stale_frac"]) is not None and stale > bound["stale"]:
        reasons.append(f"TRL dropped {train['dropped_stale']:.0f} samples as stale against "
                       f"{train['samples_trained']:.0f} trained ({stale:.0%} > {bound['stale']:.0%}): finished "
                       "sandbox work thrown away (recipe.py MAX_STALENESS and the in-flight count)")
    if (fork := train["fork_frac"]) is not None and fork > bound["fork"]:
        reasons.append(f"fork fraction {fork:.2f} > {bound['fork']:.2f}: captured rollouts split into several "
                       "training rows, so a step trains part of a group")
    ev = report["eval"]
    if expect.get("eval") and (ev is None or not ev["complete"]):
        reasons.append("final eval on the subset did not complete")
    elif expect.get("eval"):
        for side in SIDES:
            scored, tasks, lost = (ev[side].get(k) or 0 for k in ("scored", "tasks", "unscorable"))
            if scored < tasks or lost:
                reasons.append(f"eval: {scored} of {tasks} {side} cells scored ({lost} unscorable): a smoke eval "
                               "scores every cell")
    return reasons


def build(stages: list[dict[str, Any]], train_log: dict[str, Any] | None, ledger: dict[str, Any] | None,
          checkpoints: list[dict[str, Any]], eval_doc: dict[str, Any] | None, expect: dict[str, Any]) -> dict[str, Any]:
    """The report document: every section, then the verdict and its reasons, and what a user should know before the
    long run but that does not stop it (a mostly zero-contrast run trains mostly nothing)."""
    bound, summary = limits(expect), (eval_doc or {}).get("summary") or {}
    report: dict[str, Any] = {
        "schema": 1, "created": time.time(), "expect": expect, "stages": stages,
        "training": {**training(train_log), "ratio_band": bound["ratio"], "kl_ceiling": bound["kl"]},
        "rollouts": None if ledger is None else {k: ledger.get(k) for k in (
            "rollouts", "scored", "timed_out", *ENDS, "unscorable", "unscorable_total", "timing", "stopped")},
        "checkpoints": checkpoints,
        "resume": resume(train_log, expect["resume_at"]) if expect.get("resume_at") else {"verified": None},
        "eval": {"complete": bool(eval_doc.get("complete")), "cells": len(eval_doc.get("cells", [])),
                 "tasks": len(eval_doc.get("tasks", [])), **{side: summary.get(side) or {} for side in SIDES}}
        if eval_doc else None,
    }
    reasons = assess(report, expect)
    flat = report["training"]["groups"]["zero_contrast"]
    warn = flat is not None and flat > recipe.SMOKE_ZERO_CONTRAST_WARN
    report.update(verdict="NO-GO" if reasons else "GO", reasons=reasons, warnings=[
        f"{flat:.0%} of the trained rows came from zero-contrast groups (every reward equal: the step trains nothing "
        "from them): the tasks are too hard or too easy for the policy as it stands"] if warn else [])
    return report


def render(report: dict[str, Any]) -> str:
    """One screen for the job log."""
    def num(value: Any, spec: str = ".0f") -> str:
        return "-" if value is None else format(value, spec)

    def pct(value: float | None) -> str:
        return num(value, ".1%")

    t, r = report["training"], report["rollouts"] or {}
    step_s, token, row, kl, age, groups = (t["step_s"] or {}, t["ratio_token"] or {}, t["ratio"] or {}, t["kl"] or {},
                                           t["by_age"], t["groups"])
    slowest = (r.get("timing") or {}).get("max") or {}
    parts = ", ".join(f"{key.removesuffix('_s')} {slowest[key]:.0f}" for key in sandbox_lifecycle.TIMING_PARTS
                      if key in slowest and key != sandbox_lifecycle.AGENT_PART)
    setup = (f"  setup of {r['timing'].get('count')} rollouts: slowest {slowest[sandbox_lifecycle.SETUP_KEY]:.0f} s "
             f"(budget {recipe.ROLLOUT_SETUP_BUDGET_S} s); {parts} s at most"
             if sandbox_lifecycle.SETUP_KEY in slowest else "  setup per rollout: not measured")
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
        f"  rollouts ended by the call budget {num(r.get('budget_stopped'))}, the context "
        f"{num(r.get('context_exhausted'))}, a cut at the output cap {num(r.get('cut'))}",
        setup,
        "  checkpoints " + ", ".join(f"{c['step']}:{'ok' if c['verified'] else 'FAIL'}" for c in report["checkpoints"])
        + "; resume " + (report["resume"].get("why") or "not part of this run"),
    ]
    ev = report["eval"]
    sides = ", ".join(f"{side} {num(ev[side].get('pass_at_1'), '.2f')} ({ev[side].get('scored')} scored)"
                      for side in SIDES) if ev else ""
    lines.append(f"  eval {ev['cells']} cells on {ev['tasks']} tasks; pass@1 {sides}" if ev else "  eval: no results")
    lines += [f"  WARN: {warning}" for warning in report["warnings"]]
    lines += [f"  NO-GO: {reason}" for reason in report["reasons"]] or ["  GO: every check passed"]
    return "\n".join([*lines, "=" * 78])


def clear(api: Any, repo_id: str) -> int:
    """Delete an earlier smoke run's files (-smoke only), so this run's are its own; the same commit records this run
    (adapter_repo.SMOKE_RUN_PATH), the one a watcher adopts. Returns the number of files deleted."""
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
                 eval_doc if expect.get("eval") else None, expect)


def main(argv: list[str] | None = None, make_api: Callable[[str], Any] | None = None) -> int:
    """Entry point: a failure ends in one line on stderr (DEBUG=1 prints the traceback first), as in every script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="the smoke plan for MAX_STEPS (and SAVE_STEPS, EVAL_TASKS) of the environment")
    sub.add_parser("clear", help="empty the -smoke ADAPTER_REPO before a smoke run")
    rep = sub.add_parser("report", help="build, print and push the go/no-go report; exit 1 on NO-GO")
    rep.add_argument("--work-dir", type=Path, required=True, help="run_job.sh's WORK_DIR")
    rep.add_argument("--stages", type=Path, required=True, help="run_job.sh's stage records")
    args = parser.parse_args(argv)
    return adapter_repo.run_cli("smoke_report", lambda: command(args, make_api))


def command(args: argparse.Namespace, make_api: Callable[[str], Any] | None) -> None:
    """One subcommand; a failure (a NO-GO verdict too) raises, so main ends it in one line like every script."""
    if args.command == "plan":
        print(job_plan(os.environ))
        return
    from huggingface_hub import HfApi

    repo_id = recipe.require_repo_id(os.environ.get("ADAPTER_REPO", "").strip(), "ADAPTER_REPO")
    api = (make_api or (lambda token: HfApi(token=token)))(recipe.require_token())
    if args.command == "clear":
        print(f"smoke_report: cleared {clear(api, repo_id)} files of the previous smoke run from {repo_id}")
        return
    p = plan(int(os.environ.get("MAX_STEPS") or recipe.SMOKE_STEPS))  # run_job.sh exports the smoke's MAX_STEPS
    expect = {"steps": p["steps"], "checkpoints": p["checkpoints"], "resume_at": p["resume_at"], "eval": True}
    report = collect(api, repo_id, args.work_dir, read_stages(args.stages), expect)
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
