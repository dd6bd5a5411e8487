"""The trainer's callbacks: checkpoint push, heartbeat, run log, stop after step N (apart from train_lora.py, whose
--dry-run should not pay the ~8 s that importing transformers' TrainerCallback costs)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import adapter_repo
import recipe
import trajectories

logger = logging.getLogger("train_lora")


class CheckpointPusher(TrainerCallback):
    """Pushes each saved checkpoint-N/ to the adapter repo and, in the same commit, the work folder's records under
    logs/<job>/ and the rebuilt trajectory page: what a crashed or finished run leaves to read."""

    def __init__(self, api: Any, repo_id: str, work_dir: str | Path, job: str) -> None:
        self.api, self.repo_id, self.work, self.logs = api, repo_id, Path(work_dir), f"{adapter_repo.LOGS_DIR}/{job}"

    def records(self, folder: str) -> dict[str, Path | bytes]:
        """{repo path: file} of the work folder's records, this checkpoint's trajectory sample and the page."""
        names = [recipe.TRAIN_LOG_NAME, recipe.LEDGER_NAME, recipe.ROLLOUT_LOG_NAME]
        found = [self.work / n for n in names] + recipe.kept_ledgers(self.work)
        also: dict[str, Path | bytes] = {f"{self.logs}/{p.name}": p for p in found if p.is_file()}
        sample = recipe.read_json(self.work / recipe.TRAJECTORIES_NAME) or []
        also[f"{self.logs}/trajectories/{folder}.json"] = json.dumps(sample, indent=1).encode()
        try:  # the page reads the repo: a failed read costs the page this time, never the checkpoint
            docs = trajectories.repo_docs(self.api, self.repo_id)
            docs["samples"][folder] = sample
            docs["train_logs"][self.logs.rsplit("/", 1)[-1]] = recipe.read_json(self.work / recipe.TRAIN_LOG_NAME)
            also[trajectories.PAGE_PATH] = trajectories.page(self.repo_id, docs).encode()
        except Exception as error:  # noqa: BLE001
            logger.warning("%s not rebuilt (%s); the next push rebuilds it", trajectories.PAGE_PATH,
                           adapter_repo.describe(error))
        return also

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = adapter_repo.checkpoint_name(state.global_step)
        adapter_repo.push_folder(self.api, self.repo_id, Path(args.output_dir) / folder, folder, marker=True,
                                 also=self.records(folder))


class Heartbeat(TrainerCallback):
    """Rewrites `<step> <time>` after every optimizer step (run_job.sh's watchdog fails the job when it goes stale)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        recipe.write_atomic(self.path, f"{state.global_step} {time.time():.0f}\n")  # refresh_heartbeat reads it

    on_train_begin = on_step_end


class RunLog(TrainerCallback):
    """Appends each trainer start and logged step to train_log.json across starts (schema: docs/training.md)."""

    def __init__(self, path: str | Path, resumed_from: int | None) -> None:
        self.path, self.resumed_from = Path(path), resumed_from

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        doc = recipe.read_json(self.path) or {"schema": 1, "starts": [], "logs": []}
        change(doc)
        recipe.write_json(self.path, doc)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        start = {"at": time.time(), "resumed_from": self.resumed_from, "global_step": state.global_step,
                 "max_steps": state.max_steps}
        self._update(lambda doc: doc["starts"].append(start))

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **_: Any) -> None:
        if logs:
            self._update(lambda doc: doc["logs"].append({"start": len(doc["starts"]) - 1, "step": state.global_step,
                                                         **logs}))


class StopAfterStep(TrainerCallback):
    """Ends training once step N is saved and pushed: the smoke's first start, which a second resumes from the Hub."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True
