"""Live learning curve: evaluate every checkpoint of a running training job as soon as it is pushed.

    ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL N_TASKS=100 python3 eval_watch.py

Each complete checkpoint-N/ is hot-loaded into the running vLLM, evaluated on a fixed seeded subset of the test tasks
and unloaded; eval/summary.json and trajectories.html are recounted after each. All state is in the repo, so a
restarted watcher resumes. The environment (run_eval.sh's), when it stops and the files it writes: docs/evaluation.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import adapter_repo
import dashboard
import eval_adapter as ea
import recipe
import trajectories

logger = logging.getLogger("eval_watch")


class RunReplaced(BaseException):  # noqa: N818 - a signal, not an error
    """The smoke run watched was cleared by a later one: start over on that one. A BaseException, so that no push
    retry or per-cell handler (`except Exception`) takes it for a failure."""


def live_run(marker: dict[str, Any] | None, now: float) -> bool:
    """A smoke run that can still be running: recorded by its clear, not reported, and within its job's cap."""
    return bool(marker) and not marker.get("finished") and now < float(marker.get("expires_at", 0))


def build_summary(base_doc: dict[str, Any], docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The rolling summary, recounted from the per-checkpoint files (never incremented, never double-counted)."""
    base = ea.rewards(ea.current_cells(base_doc), "base")
    rows = []
    for name, doc in docs.items():
        s = ea.summarize(base, ea.rewards(ea.current_cells(doc), "adapter"))
        rows.append({"checkpoint": name, "step": int(doc["step"]), "complete": bool(doc.get("complete")),
                     **s["adapter"], "paired": s["paired"]})
    rows.sort(key=lambda r: (r["checkpoint"] == adapter_repo.FINAL, r["step"]))
    subset = base_doc.get("subset", [])
    return {"schema": 1, "base_model": recipe.BASE_MODEL, "dataset": recipe.TEST_DATASET,
            "dataset_revision": recipe.TEST_REVISION, "subset": subset, "n_tasks": len(subset),
            "base": ea.side_stats(base) if base else None, "checkpoints": rows,
            "final_evaluated": any(r["checkpoint"] == adapter_repo.FINAL and r["complete"] for r in rows)}


class Watcher:
    """Evaluates each new checkpoint of `repo_id` on a fixed subset; all state lives in the repo."""

    def __init__(self, api: Any, repo_id: str, factory: ea.SessionFactory, lora: ea.LoraServer,
                 tasks: list[dict[str, Any]], work: Path, n_tasks: int = recipe.EVAL_WATCH_TASKS,
                 concurrency: int = recipe.EVAL_CONCURRENCY, poll_s: float = recipe.EVAL_POLL_SECONDS,
                 max_idle_s: float = recipe.MAX_IDLE_HOURS * 3600,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 board: dashboard.EvalDashboard | None = None) -> None:
        self.api, self.repo_id, self.factory, self.lora = api, repo_id, factory, lora
        self.tasks, self.work, self.root_work, self.n_tasks = tasks, work, work, n_tasks
        self.concurrency, self.poll_s, self.max_idle_s = concurrency, poll_s, max_idle_s
        self.clock, self.sleep, self.board = clock, sleep, board
        self.logged_steps: set[int] = set()
        self.smoke = repo_id.endswith(adapter_repo.SMOKE_SUFFIX)
        self.run_id: str | None = None  # the smoke run watched
        self.job: str | None = None  # the training job last seen running on the repo ("" once the Jobs API failed)

    def read(self, path: str, revision: str | None = None) -> dict[str, Any] | None:
        return adapter_repo.read_json(self.api, self.repo_id, path, revision=revision)

    def run_and_push(self, path_in_repo: str, doc: dict[str, Any], jobs: list[ea.Job], **adapter: Any) -> None:
        ea.run_and_push(self.api, self.repo_id, path_in_repo, doc, self.work, self.factory, jobs, self.concurrency,
                        check=self.check_run, **adapter)

    def ensure_base(self) -> list[dict[str, Any]]:
        """The subset (the one the repo records: a restart must not change it) and its base cells, computed once."""
        stored = self.read(adapter_repo.WATCH_BASE_PATH) or {}
        subset = stored.get("subset") or ea.choose_subset(len(self.tasks), self.n_tasks)
        if len(subset) != self.n_tasks:
            raise recipe.ConfigError(f"{adapter_repo.WATCH_BASE_PATH} in {self.repo_id} records {len(subset)} tasks "
                                     f"but N_TASKS={self.n_tasks}: use N_TASKS={len(subset)} or a new adapter repo")
        by_index = {int(t["index"]): t for t in self.tasks}
        tasks = [by_index[i] for i in subset]
        doc = {"schema": 1, "kind": "watch-base", "base_model": recipe.BASE_MODEL,
               "weights": {"base": ea.BASE_WEIGHTS}, "subset": subset, "complete": False,
               "sampling": {**ea.eval_sampling(), "max_tokens": recipe.MAX_TOKENS}}
        logger.info("base model on %d tasks", len(tasks))
        self.run_and_push(adapter_repo.WATCH_BASE_PATH, doc, [("base", recipe.SERVED_MODEL_NAME, t) for t in tasks])
        return tasks

    def evaluate(self, name: str, step: int, revision: str, tasks: list[dict[str, Any]]) -> None:
        """Hot-load `name`, evaluate the cells its weights still lack, unload it, commit its results."""
        adapter = adapter_repo.download_adapter(self.api, self.repo_id, name, self.work / "adapters" / name,
                                                revision=revision)
        doc = {"schema": 1, "kind": "watch", "checkpoint": name, "step": step, "adapter_revision": revision,
               "weights": {"adapter": ea.adapter_weights(adapter)}, "subset": [t["index"] for t in tasks],
               "complete": False}
        model = ea.served_name(name)
        logger.info("evaluating %s (step %d) as %s", name, step, model)
        self.run_and_push(adapter_repo.watch_results_path(name), doc, [("adapter", model, t) for t in tasks],
                          adapter=self.lora.serving(model, adapter))

    def publish_summary(self) -> dict[str, Any]:
        """eval/summary.json recounted from the per-checkpoint files, and the trajectory page's curve, in one commit."""
        out: dict[str, Any] = {}

        def build(head: str) -> dict[str, bytes]:
            self.check_run(head)
            files = self.api.list_repo_files(self.repo_id, revision=head)
            docs = {name: self.read(path, head) for name, path in adapter_repo.watched_checkpoints(files).items()}
            out["summary"] = build_summary(self.read(adapter_repo.WATCH_BASE_PATH, head) or {}, docs)
            page = trajectories.repo_docs(self.api, self.repo_id, revision=head) | {"summary": out["summary"]}
            return {adapter_repo.SUMMARY_PATH: json.dumps(out["summary"], indent=1, sort_keys=True).encode(),
                    trajectories.PAGE_PATH: trajectories.page(self.repo_id, page).encode()}

        adapter_repo.commit_cas(self.api, self.repo_id, build, "eval: summary + trajectories.html")
        self.log_curve(out["summary"])
        return out["summary"]

    def log_curve(self, summary: dict[str, Any]) -> None:
        """Each fully evaluated checkpoint's pass@1 and the base line at its training step, once per step (the final
        adapter has the last checkpoint's step: it adds a point only when no checkpoint-N had it)."""
        if self.board is None:
            return
        base = summary.get("base") or {}
        for row in summary["checkpoints"]:
            if not row["complete"] or row["pass_at_1"] is None or row["step"] in self.logged_steps:
                continue
            point = {"eval/pass_at_1": row["pass_at_1"], "eval/pass_at_1_ci95_low": row["ci95"][0],
                     "eval/pass_at_1_ci95_high": row["ci95"][1], "eval/scored": row["scored"],
                     "eval/unscorable": row["unscorable"]}
            if base.get("pass_at_1") is not None:
                point |= {"eval/base_pass_at_1": base["pass_at_1"], "eval/base_ci95_low": base["ci95"][0],
                          "eval/base_ci95_high": base["ci95"][1]}
            self.board.log(point, step=row["step"])
            self.logged_steps.add(row["step"])

    def pending(self, head: str) -> tuple[list[tuple[int, str]], bool]:
        """Complete checkpoints (step, name) still to evaluate, in step order with the final adapter last (half-uploaded
        ones are left for a later poll); and whether the final adapter's results are already complete."""
        files = self.api.list_repo_files(self.repo_id, revision=head)
        found = [(step, adapter_repo.checkpoint_name(step)) for step in adapter_repo.complete_checkpoints(files)]
        if adapter_repo.checkpoint_complete(files, adapter_repo.FINAL):
            found.append((found[-1][0] if found else 0, adapter_repo.FINAL))
        todo, final_done = [], False
        for step, name in found:
            path = adapter_repo.watch_results_path(name)
            if path in files and (self.read(path, head) or {}).get("complete"):
                final_done |= name == adapter_repo.FINAL
            else:
                todo.append((step, name))
        return todo, final_done

    # -- the smoke run watched -----------------------------------------------------------------
    def adopt_run(self) -> str | None:
        """The live smoke run the repo's clear recorded, waited for up to max_idle_s (None: none came); its work files
        go to a folder of its own, so nothing of an earlier run is merged in."""
        since = self.clock()
        while True:
            marker = self.read(adapter_repo.SMOKE_RUN_PATH)
            if live_run(marker, time.time()):
                self.work = self.root_work / marker["run"]
                logger.info("watching smoke run %s of %s", marker["run"], self.repo_id)
                return marker["run"]
            if self.clock() - since > self.max_idle_s:
                return None
            logger.info("no live smoke run in %s (%s): waiting for the next smoke job's clear", self.repo_id,
                        "its last run finished or ran out of time" if marker else "none recorded yet")
            self.sleep(self.poll_s)

    def check_run(self, head: str) -> None:
        """On a smoke repo: raise RunReplaced unless the run watched is still the repo's at `head`."""
        if not self.smoke:
            return
        run = (self.read(adapter_repo.SMOKE_RUN_PATH, head) or {}).get("run")
        if run != self.run_id:
            raise RunReplaced(f"smoke run {self.run_id} of {self.repo_id} was cleared by run {run}: starting over")

    def run_end(self) -> str | None:
        """Why the run watched has ended without its final adapter, or None while it may still push: its smoke report
        is in (or its job's cap has passed), or no training job runs on the repo any more after one did."""
        if self.smoke:
            marker = self.read(adapter_repo.SMOKE_RUN_PATH) or {}
            if marker.get("run") == self.run_id and not live_run(marker, time.time()):
                return f"smoke run {self.run_id} " + (
                    "finished (smoke_report.json has its verdict)" if marker.get("finished") else "ran out of time")
        if self.job == "":
            return None
        try:
            jobs = adapter_repo.live_jobs(self.api, self.repo_id, adapter_repo.TRAIN_SCRIPT)
            if jobs or self.job is None:  # none seen yet: it may start later (MAX_IDLE_HOURS bounds the wait)
                self.job = jobs[0].id if jobs else None
                return None
            status = self.api.inspect_job(job_id=self.job).status
        except Exception as error:  # noqa: BLE001 - e.g. a token without Jobs access: the idle limit still stops it
            logger.warning("cannot read the training job's state (%s): stopping only at the final adapter or after "
                           "MAX_IDLE_HOURS", adapter_repo.describe(error)[:200])
            self.job = ""
            return None
        return (f"training job {self.job} ended ({status.stage}{f': {status.message}' if status.message else ''}) and "
                f"none runs on {self.repo_id} now; relaunch it (it resumes) and this watcher (its results are kept)")

    def run(self) -> str:
        """Watch until the final adapter is evaluated ("final"), the run ended without it ("ended"), or nothing new
        came for max_idle_s ("idle"); first wait up to max_idle_s for the training job to create the repo."""
        since = self.clock()
        while not self.api.repo_exists(self.repo_id):
            if self.clock() - since >= self.max_idle_s:
                raise recipe.ConfigError(f"ADAPTER_REPO={self.repo_id} not found after {self.max_idle_s / 3600:.1f} h: "
                                         "check the name, and that HF_TOKEN can read it")
            logger.info("%s not found (yet): waiting for the training job to create it", self.repo_id)
            self.sleep(self.poll_s)
        while True:
            try:
                return self._watch()
            except RunReplaced as replaced:
                logger.info("%s", replaced)

    def _watch(self) -> str:
        if self.smoke:
            self.run_id = self.adopt_run()
            if self.run_id is None:
                logger.info("no smoke run for %.1f h: stopping", self.max_idle_s / 3600)
                return "idle"
        tasks = self.ensure_base()
        last_new = self.clock()
        while True:
            ended = self.run_end()  # before the head: what the run pushed before its end is evaluated first
            head = self.api.repo_info(self.repo_id).sha
            self.check_run(head)
            todo, final_done = self.pending(head)
            for step, name in todo:
                self.evaluate(name, step, head, tasks)
                last_new = self.clock()
            if todo or not self.api.file_exists(self.repo_id, adapter_repo.SUMMARY_PATH):
                self.publish_summary()
            if final_done or any(name == adapter_repo.FINAL for _, name in todo):
                logger.info("final adapter evaluated: done")
                return "final"
            if ended:
                logger.info("%s: stopping", ended)
                return "ended"
            if self.clock() - last_new > self.max_idle_s:
                logger.info("no new checkpoint for %.1f h: stopping", self.max_idle_s / 3600)
                return "idle"
            self.sleep(self.poll_s)


def main() -> None:
    """Watch mode: every checkpoint on N_TASKS test tasks until the run ends (Watcher.run)."""
    n_tasks, concurrency, max_idle_h = (recipe.knob(k) for k in ("N_TASKS", "EVAL_CONCURRENCY", "MAX_IDLE_HOURS"))
    with ea.job("eval-watch") as (api, repo_id, factory, tasks, lora, work, board):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        watcher = Watcher(api, repo_id, factory, lora, tasks, work, n_tasks=n_tasks, max_idle_s=max_idle_h * 3600,
                          concurrency=concurrency, board=board)
        print(f"eval_watch: stopped ({watcher.run()})")


if __name__ == "__main__":
    raise SystemExit(adapter_repo.run_cli("eval_watch", main, usage=__doc__))
