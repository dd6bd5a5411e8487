"""Held-out eval: pass@1 of the base model vs a LoRA adapter on the test tasks, through the training harness.

    ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL CHECKPOINT=final python3 eval_adapter.py

Each cell (a task, a side) is one rollout on the training's env server and OpenCode, with the eval contract; one vLLM
serves the base model and the adapter (runtime LoRA). Results are pushed as they come, so a killed eval resumes. The
environment (run_eval.sh's), the contract, the retry and abort rules and the results schema: docs/evaluation.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx

import adapter_repo
import dashboard
import recipe


def served_name(checkpoint: str) -> str:
    """Name vLLM serves `checkpoint`'s LoRA under; unique per checkpoint so no stale weights are reused."""
    return f"{recipe.ADAPTER_SERVED_NAME}-{checkpoint}"


# --- vLLM's runtime LoRA endpoints ---------------------------------------------
class LoraServer:
    """Loads and unloads adapters in a running vLLM (`--enable-lora`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    @contextlib.contextmanager
    def serving(self, name: str, path: Path) -> Iterator[None]:
        """`path`'s adapter hot-loaded as model `name` for the block, unloaded however it ends (vLLM keeps a LoRA until
        told). Already loaded under that name is fine; so is an unload of one vLLM no longer has."""
        self._post("load", {"lora_name": name, "lora_path": str(path)}, done="has already been loaded")
        try:
            yield
        finally:
            self._post("unload", {"lora_name": name}, done="cannot be found")

    def _post(self, verb: str, body: dict[str, str], done: str) -> None:
        path = f"/v1/{verb}_lora_adapter"
        response = httpx.post(f"{self.base_url}{path}", json=body, timeout=self.timeout_s)
        if response.status_code != 200 and done not in response.text:  # vLLM's {"error": {"message": ...}}
            raise RuntimeError(f"vLLM refused {path} {body}: HTTP {response.status_code}: {response.text[:300]}")


# --- Rollouts ---------------------------------------------------------------------
def eval_sampling() -> dict[str, float | int]:
    """The explicit eval policy, validated by OpenEnv's own rule (it refuses top_k 0) before any rollout."""
    from openenv.core.harness.capture.sessions import evaluation_sampling

    return evaluation_sampling({"temperature": recipe.TEMPERATURE, "top_p": recipe.TOP_P, "top_k": recipe.EVAL_TOP_K})


SessionFactory = Callable[[int, str], Any]  # (task_index, served model name) -> a harbor_sessions rollout


def servers(sandbox: str) -> tuple[SessionFactory, list[dict[str, Any]], LoraServer]:
    """The entry points' servers (ENV_URL, VLLM_URL): eval rollouts on the env server's split (EVAL_SPLIT, else its
    only one) with the training's session client, that split's tasks [{index, task_name}], and vLLM's LoRA routes."""
    from harbor_sessions import HarborRolloutSession, HarborSessionFactory

    env_url = os.environ.get("ENV_URL", f"http://{recipe.LOOPBACK}:{recipe.ENV_PORT}").rstrip("/")
    vllm_url = os.environ.get("VLLM_URL", f"http://{recipe.LOOPBACK}:{recipe.VLLM_PORT}").rstrip("/")
    # Asked plainly first: OpenEnv's client, refused a connection, fails with an unrelated TypeError.
    httpx.get(f"{env_url}/health", timeout=30).raise_for_status()
    sessions = HarborSessionFactory(env_url, split=os.environ.get("EVAL_SPLIT", ""))
    tasks = [{"index": t["index"], "task_name": t["task_name"]} for t in sessions.tasks()]
    factory = functools.partial(HarborRolloutSession, env_url, sessions.split, llm_url=vllm_url, sandbox=sandbox,
                                purpose="eval", eval_sampling=eval_sampling())
    return factory, tasks, LoraServer(vllm_url)


# --- Cells -----------------------------------------------------------------------
def is_correct(reward: float) -> bool:
    """The verifier writes 1 for a correct answer and 0 otherwise."""
    return reward >= 1.0


def run_cell(factory: SessionFactory, task_index: int, model: str) -> dict[str, Any]:
    """One attempt at one cell. Its failure is an unscorable cell whose error starts with its class (docs/training.md
    "Rollout failures"), never an exception that ends the eval."""
    start, session, error = time.monotonic(), None, ""
    try:
        session = factory(task_index, model)
        session.wait_for_completion()
    except Exception as exc:  # noqa: BLE001 - one failed rollout is one unscorable cell
        error = f"{'create' if session is None else 'rollout'}: {type(exc).__name__}: {exc}"
    finally:  # an agent that timed out raised, yet Harbor graded it: its result counts (graded_reward)
        result = getattr(session, "result", None)
        if session is not None:
            session.close()
    reward = recipe.graded_reward(result)
    scored = reward is not None
    turns = [t for t in getattr(result, "turns", None) or [] if t.role == "agent" and not t.discarded]
    not_ok = scored and not getattr(result, "ok", False)  # graded, though the env server marked it failed
    return {"reward": reward, "correct": is_correct(reward) if scored else None, "unscorable": not scored,
            "tool_calls": sum(len(t.tool_calls) for t in turns), "model_calls": int(getattr(result, "n_turns", 0) or 0),
            "error": None if scored else (error or _cell_error(session, result)),
            "rollout_error": (str(getattr(result, "error", "") or "")[:300] or None) if not_ok else None,
            "duration_s": round(time.monotonic() - start, 3)}


def _cell_error(session: Any, result: Any) -> str:
    if result is None:
        return "rollout: " + str(getattr(session, "error", "") or "rollout call failed")[:300]
    if count := recipe.upstream_errors(result):
        return f"upstream: {count} model call(s) failed at the engine"
    if not getattr(result, "ok", False):
        return "rollout: " + str(getattr(result, "error", "") or "the env server reported the rollout failed")[:300]
    if result.reward is not None:
        return "rollout: no agent turn reached the model (the verifier graded an untouched workspace)"
    return "verifier: no reward (verifier did not grade)"


# --- Which weights a cell scored ----------------------------------------------------------
BASE_WEIGHTS = f"{recipe.BASE_MODEL}@{recipe.BASE_MODEL_REVISION}"


def adapter_weights(adapter_dir: Path) -> str:
    """The adapter's identity: sha256 of its files. Not the repo commit: that moves with every push (the eval's own
    included) while the weights stay, and a rewritten `final` keeps its name with other weights."""
    digest = hashlib.sha256()
    for name in adapter_repo.ADAPTER_FILES:  # a LoRA's files: tens of MB
        digest.update(f"{name}\0".encode() + (adapter_dir / name).read_bytes())
    return f"sha256:{digest.hexdigest()}"


def current_cells(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells of the weights `doc` is about; other weights' cells stay in the file, never counted or reused."""
    weights = doc.get("weights") or {}
    return [c for c in doc.get("cells", []) if c.get("weights", "") == weights.get(c["side"], "")]


def is_final(cell: dict[str, Any] | None) -> bool:
    """A cell needs no more attempts: it was scored, or it stayed unscorable EVAL_CELL_ATTEMPTS times."""
    return cell is not None and (not cell["unscorable"] or cell["attempts"] >= recipe.EVAL_CELL_ATTEMPTS)


def merge_cells(*lists: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Union of cell lists, one record per (side, task, weights), sorted: never double-counts a cell. Of two records
    of one cell, scored beats unscorable, then more attempts."""
    merged: dict[tuple[str, int, str], dict[str, Any]] = {}
    for cells in lists:
        for cell in cells:
            key = (cell["side"], int(cell["task_index"]), cell.get("weights", ""))
            merged[key] = max(merged.get(key, cell), cell, key=lambda c: (not c["unscorable"], c["attempts"]))
    return [merged[k] for k in sorted(merged)]


class ResultsFile:
    """A results document rewritten atomically after every cell (a kill leaves the last good copy); one thread."""

    def __init__(self, path: Path, doc: dict[str, Any]) -> None:
        self.path, self.doc = path, doc
        self.doc.setdefault("cells", [])

    def cells(self) -> dict[tuple[str, int], dict[str, Any]]:
        """(side, task) -> cell, of this document's weights only: what a run may reuse."""
        return {(c["side"], int(c["task_index"])): c for c in current_cells(self.doc)}

    def record(self, cell: dict[str, Any]) -> None:
        self.doc["cells"] = merge_cells(self.doc["cells"], [cell])
        self.save()

    def save(self) -> None:
        recipe.write_json(self.path, self.doc, indent=1, sort_keys=True)


Job = tuple[str, str, dict[str, Any]]  # (side, served model name, task {index, task_name})


class InfrastructureDown(adapter_repo.Failure):
    """Too many unscorable cells in a row: the servers, not the model, are failing."""


def pending_jobs(jobs: list[Job], results: ResultsFile) -> list[Job]:
    done = results.cells()
    return [j for j in jobs if not is_final(done.get((j[0], int(j[2]["index"]))))]


def run_cells(factory: SessionFactory, jobs: list[Job], results: ResultsFile, concurrency: int,
              push: Callable[[], None] = lambda: None) -> None:
    """Every job whose cell is not final, `concurrency` at once, an unscorable one requeued until final; `push` every
    EVAL_PUSH_EVERY attempts and, at EVAL_ABORT_STREAK unscorable ones in a row, once more before InfrastructureDown."""
    queue, concurrency = deque(pending_jobs(jobs, results)), max(1, concurrency)
    running: dict[Future[dict[str, Any]], Job] = {}
    streak = recorded = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        while queue or running:
            while queue and len(running) < concurrency:
                job = queue.popleft()
                running[pool.submit(run_cell, factory, int(job[2]["index"]), job[1])] = job
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                side, _, task = job = running.pop(future)
                previous = results.cells().get((side, int(task["index"])))
                cell = {"side": side, "task_index": int(task["index"]), "task_name": task.get("task_name", ""),
                        "weights": (results.doc.get("weights") or {}).get(side, ""),
                        "attempts": (previous["attempts"] if previous else 0) + 1, **future.result()}
                results.record(cell)
                recorded, streak = recorded + 1, streak + 1 if cell["unscorable"] else 0
                if recorded % recipe.EVAL_PUSH_EVERY == 0 or streak >= recipe.EVAL_ABORT_STREAK:
                    push()
                if streak >= recipe.EVAL_ABORT_STREAK:
                    raise InfrastructureDown(
                        f"{streak} eval cells in a row were unscorable (last: {cell['error']}): vLLM, the env "
                        "server or the sandboxes are failing; fix them and rerun: finished cells are kept")
                if not is_final(cell):
                    queue.append(job)


def rewards(cells: Iterable[dict[str, Any]], side: str) -> dict[str, float | None]:
    """{task: reward or None (unscorable)} for one side, the input `summarize` takes."""
    return {str(c["task_index"]): c["reward"] for c in cells if c["side"] == side}


def choose_subset(n_total: int, n: int, seed: int = recipe.EVAL_SEED) -> list[int]:
    """A fixed, seeded choice of n of n_total task indices (all when n == n_total); n's knob checks its range."""
    return sorted(random.Random(seed).sample(range(n_total), n))


# --- Summary ---------------------------------------------------------------------
def wilson_ci(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a pass rate (sane at 0 and n, unlike the normal approximation)."""
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def side_stats(cells: dict[str, float | None]) -> dict[str, Any]:
    """pass@1 over scored tasks, with the counts it is made of and its own 95% interval."""
    scored = [r for r in cells.values() if r is not None]
    correct = sum(is_correct(r) for r in scored)
    return {"tasks": len(cells), "scored": len(scored), "correct": correct, "unscorable": len(cells) - len(scored),
            "pass_at_1": correct / len(scored) if scored else None,
            "ci95": list(wilson_ci(correct, len(scored))) if scored else None}


def mcnemar_exact_p(only_base: int, only_adapter: int) -> float:
    """Two-sided exact McNemar (sign test on discordant pairs): P(a split this uneven | no effect)."""
    n = only_base + only_adapter
    tail = sum(math.comb(n, k) for k in range(min(only_base, only_adapter) + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap_ci(diffs: list[int], samples: int = recipe.BOOTSTRAP_SAMPLES, seed: int = recipe.EVAL_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile paired-bootstrap interval for mean(diffs), seeded so a rerun prints the same numbers."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(samples))
    return means[int((1 - level) / 2 * (samples - 1))], means[int((1 + level) / 2 * (samples - 1))]


def summarize(base: dict[str, float | None], adapter: dict[str, float | None]) -> dict[str, Any]:
    """pass@1 per side, agreement over tasks scored on both sides, and the paired difference with its CI; `base`/
    `adapter`: task -> reward, None for an unscorable cell (never wrong: out of the denominators)."""
    paired = sorted(t for t in base.keys() & adapter.keys() if base[t] is not None and adapter[t] is not None)
    agree = {"both": 0, "only_base": 0, "only_adapter": 0, "neither": 0}
    diffs = []
    for task in paired:
        b, a = is_correct(base[task]), is_correct(adapter[task])
        agree["both" if a and b else "only_base" if b else "only_adapter" if a else "neither"] += 1
        diffs.append(int(a) - int(b))
    paired_stats = {"tasks": len(paired), **agree, "difference": sum(diffs) / len(diffs) if diffs else None,
                    "ci95": list(bootstrap_ci(diffs)) if diffs else None,
                    "mcnemar_p": mcnemar_exact_p(agree["only_base"], agree["only_adapter"]),
                    "bootstrap": {"samples": recipe.BOOTSTRAP_SAMPLES, "seed": recipe.EVAL_SEED}}
    return {"base": side_stats(base), "adapter": side_stats(adapter), "paired": paired_stats}


# --- Hub ---------------------------------------------------------------------------
def push_results(api: Any, repo_id: str, path_in_repo: str, results: ResultsFile,
                 check: Callable[[str], None] | None = None) -> None:
    """Push a results document, merging in cells another writer pushed meanwhile (nothing is lost). `check(head)` may
    refuse the head it would commit on (raise): eval_watch's check that its smoke run is the repo's."""

    def build(head: str) -> dict[str, bytes]:
        if check is not None:
            check(head)
        remote = adapter_repo.read_json(api, repo_id, path_in_repo, revision=head) or {}
        results.doc["cells"] = merge_cells(remote.get("cells", []), results.doc["cells"])
        return {path_in_repo: json.dumps(results.doc, indent=1, sort_keys=True).encode()}

    adapter_repo.commit_cas(api, repo_id, build, f"eval: {path_in_repo}")


def run_and_push(api: Any, repo_id: str, path_in_repo: str, doc: dict[str, Any], work: Path, factory: SessionFactory,
                 jobs: list[Job], concurrency: int, *, adapter: contextlib.AbstractContextManager | None = None,
                 check: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The one eval loop of both entry points (evaluate here, eval_watch.Watcher): `doc`'s results resumed from `work`
    and the repo, the cells `jobs` still lack run inside `adapter` (LoraServer.serving), a full eval's "summary"
    recounted, the file marked complete and pushed, unless it already was for these weights (nothing loaded)."""
    local = work / path_in_repo
    cells = json.loads(local.read_text()).get("cells", []) if local.exists() else []
    remote = adapter_repo.read_json(api, repo_id, path_in_repo) or {}
    complete = bool(remote.get("complete")) and (remote.get("weights") or {}) == (doc.get("weights") or {})
    results = ResultsFile(local, {**doc, "cells": merge_cells(cells, remote.get("cells", [])), "complete": complete})
    results.save()
    push = functools.partial(push_results, api, repo_id, path_in_repo, results, check)
    idle = not pending_jobs(jobs, results)
    if not idle:
        with adapter or contextlib.nullcontext():
            run_cells(factory, jobs, results, concurrency, push)
    if "summary" in results.doc:
        cells = current_cells(results.doc)
        results.doc["summary"] = summarize(rewards(cells, "base"), rewards(cells, "adapter"))
    if not (idle and results.doc.get("complete")):
        results.doc["complete"] = True
        results.save()
        push()
    return results.doc


# --- Entry point ---------------------------------------------------------------------
def evaluate(api: Any, repo_id: str, checkpoint: str, factory: SessionFactory, tasks: list[dict[str, Any]],
             lora: LoraServer, work: Path, concurrency: int = recipe.EVAL_CONCURRENCY,
             board: dashboard.EvalDashboard | None = None) -> dict[str, Any]:
    """Base vs `checkpoint` on `tasks`, resumable, pushed to its full-eval file (and its summary to `board`)."""
    revision = adapter_repo.head_holding(api, repo_id, checkpoint)
    adapter_dir = adapter_repo.download_adapter(api, repo_id, checkpoint, work / "adapter", revision=revision)
    path_in_repo = adapter_repo.full_results_path(checkpoint)
    doc = {"schema": 1, "kind": "full", "base_model": recipe.BASE_MODEL, "adapter_repo": repo_id,
           "checkpoint": checkpoint, "adapter_revision": revision, "dataset": recipe.TEST_DATASET,
           "weights": {"base": BASE_WEIGHTS, "adapter": adapter_weights(adapter_dir)},
           "dataset_revision": recipe.TEST_REVISION, "tasks": tasks, "complete": False, "summary": None,
           "sampling": {**eval_sampling(), "max_tokens": recipe.MAX_TOKENS,
                        "max_tool_calling_iterations": recipe.MAX_TOOL_CALLING_ITERATIONS}}
    name = served_name(checkpoint)
    jobs = [(side, model, t) for t in tasks for side, model in (("base", recipe.SERVED_MODEL_NAME), ("adapter", name))]
    doc = run_and_push(api, repo_id, path_in_repo, doc, work, factory, jobs, concurrency,
                       adapter=lora.serving(name, adapter_dir))
    if board is not None:
        board.log(summary_metrics(doc["summary"]))
    return doc


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The final eval's summary as flat dashboard metrics (`final_eval/...`); absent numbers are left out."""
    paired = summary["paired"]
    values = {"paired_tasks": paired["tasks"], "difference": paired["difference"], "mcnemar_p": paired["mcnemar_p"],
              **{f"{side}_{key}": summary[side][key] for side in ("base", "adapter")
                 for key in ("pass_at_1", "scored", "unscorable")}}
    for name, interval in (("difference", paired["ci95"]), ("base", summary["base"]["ci95"]),
                           ("adapter", summary["adapter"]["ci95"])):
        values |= dict(zip((f"{name}_ci95_low", f"{name}_ci95_high"), interval or (), strict=False))
    return {f"final_eval/{key}": float(value) for key, value in values.items() if value is not None}


@contextlib.contextmanager
def job(kind: str) -> Iterator[tuple[Any, str, SessionFactory, list[dict[str, Any]], LoraServer, Path,
                                      dashboard.EvalDashboard]]:
    """Both entry points' start, from run_eval.sh's environment: the Hub client and repo, the servers on the test
    tasks, the work folder and the `kind` dashboard (finished however the block ends)."""
    from huggingface_hub import HfApi

    repo_id = recipe.require_repo_id(os.environ.get("ADAPTER_REPO"), "ADAPTER_REPO")
    api = HfApi(token=recipe.require_token())
    factory, tasks, lora = servers(recipe.knob("SANDBOX"))
    if len(tasks) != recipe.TEST_TASKS:
        raise recipe.ConfigError(f"the env server's split has {len(tasks)} tasks, the test split {recipe.TEST_TASKS}: "
                                 "serve the test tasks (run_eval.sh does) or set EVAL_SPLIT")
    board = dashboard.EvalDashboard(repo_id, kind, os.environ)
    try:
        yield api, repo_id, factory, tasks, lora, Path(os.environ.get("EVAL_WORK_DIR", "eval-work")), board
    finally:
        board.finish()


def main() -> None:
    """The full eval: base vs CHECKPOINT on EVAL_TASKS of the test tasks (all, or the smoke run's seeded subset)."""
    checkpoint, n_tasks, concurrency = (recipe.knob(k) for k in ("CHECKPOINT", "EVAL_TASKS", "EVAL_CONCURRENCY"))
    with job("eval") as (api, repo_id, factory, tasks, lora, work, board):
        doc = evaluate(api, repo_id, checkpoint, factory, [tasks[i] for i in choose_subset(len(tasks), n_tasks)],
                       lora, work, concurrency, board)
    print(json.dumps(doc["summary"], indent=1))


if __name__ == "__main__":
    raise SystemExit(adapter_repo.run_cli("eval_adapter", main, usage=__doc__))
