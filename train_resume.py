"""Where a relaunched trainer resumes in the task stream: after every group already consumed, redoing only the ones
that were in flight when the checkpoint was saved.

TRL 1.15 saves `rollout_state.json` `prompt_index = dataset_start_index + lowest group id not in _trained_groups`
(`AsyncGRPOTrainer._save_checkpoint`). A group whose 8 rollouts were all unscorable yields no sample, and a group the
trainer dropped as stale is never collated, so neither ever enters `_trained_groups`: every later checkpoint records
the first such group, and a relaunch re-trains everything after it (a group finishing out of order holds it back the
same way). Here a group counts as consumed when the trainer took any of its samples off the rollout queue (trained or
dropped as stale) or when the rollout child scored it to no sample at all; `rollout_state.json` then holds the
lowest group not consumed (`prompt_index`, which TRL's own resume reads) and, in CONSUMED_AHEAD, the offsets past it
of the groups already consumed, which the resumed rollout child skips.

The seam, each piece asserted against TRL 1.15's shape where it is used:
- PositionedRolloutLoop (the rollout child): `_repeat_iterator` hands out group ids as offsets from the start index,
  skipping CONSUMED_AHEAD; `_score_group` records a group that scored to no sample in a file the trainer reads.
- ResumePosition (mixed into the trainer class): wraps the rollout queue TRL's RolloutQueueDataset reads, to see every
  group it takes; rewrites `rollout_state.json` after TRL writes it; passes CONSUMED_AHEAD to the child on resume.
"""

from __future__ import annotations

import inspect
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

import recipe
from recipe import CONSUMED_AHEAD, ROLLOUT_STATE
from train_metrics import RecipeRolloutLoop, RecipeRolloutWorker

EMPTY_GROUPS_FILE = "empty_groups.json"  # in the output folder: groups of this start that scored to no sample


class SeamShapeError(RuntimeError):
    """The installed TRL is not the shape this resume fix was written against (TRL 1.15.0)."""


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise SeamShapeError(f"TRL's async GRPO no longer {what}: train_resume.py needs updating for this TRL")


def check_trl_shape() -> None:
    """The TRL 1.15 members this module overrides or reads, by name and signature."""
    _require(callable(getattr(_AsyncRolloutLoop, "_repeat_iterator", None)), "has _AsyncRolloutLoop._repeat_iterator")
    _require(inspect.iscoroutinefunction(getattr(_AsyncRolloutLoop, "_score_group", None)),
             "has an async _AsyncRolloutLoop._score_group")
    _require("dataset_start_index" in inspect.signature(_AsyncRolloutLoop.__init__).parameters,
             "takes _AsyncRolloutLoop(dataset_start_index=)")
    for name in ("_save_checkpoint", "_inner_training_loop", "get_train_dataloader"):
        _require(callable(getattr(AsyncGRPOTrainer, name, None)), f"has AsyncGRPOTrainer.{name}")


check_trl_shape()


def next_position(start: int, consumed: Iterable[int]) -> dict[str, Any]:
    """The resume position after the groups `consumed` (offsets from `start`, the prompt index this start began at):
    `prompt_index` of the lowest group not consumed, and CONSUMED_AHEAD, the consumed ones past it."""
    done = set(consumed)
    first = next(g for g in itertools.count() if g not in done)
    return {"prompt_index": start + first, CONSUMED_AHEAD: sorted(g - first for g in done if g > first)}


class PositionedRolloutLoop(RecipeRolloutLoop):
    """The recipe's rollout loop (train_metrics), resuming after every consumed group and reporting empty ones."""

    def __init__(self, *, consumed_ahead: Iterable[int] = (), empty_groups_file: str = "",
                 dataset_start_index: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset_start_index=dataset_start_index, **kwargs)
        self._start, self._skip = dataset_start_index, frozenset(consumed_ahead)
        self._empty_file = Path(empty_groups_file) if empty_groups_file else None
        self._empty: set[int] = set()

    def _repeat_iterator(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """TRL's stream (the dataset from the start index, wrapping around, each row `num_generations` times), with
        group id = offset from the start index, so `start + group id` is the row; consumed offsets are skipped."""
        size = len(self.dataset)
        for offset in itertools.count():
            if offset in self._skip:
                continue
            row = self.dataset[(self._start + offset) % size]
            for _ in range(self.num_generations):
                yield offset, row

    async def _score_group(self, group: Any) -> list[Any]:
        samples = await super()._score_group(group)
        if not samples and self._empty_file is not None:  # every rollout unscorable: the trainer never sees it
            self._empty.add(group.group_id)
            recipe.write_json(self._empty_file, sorted(self._empty))
        return samples


class PositionedRolloutWorker(RecipeRolloutWorker):
    """RecipeRolloutWorker whose spawned loop is PositionedRolloutLoop."""

    _loop_cls = PositionedRolloutLoop


class _RecordingQueue:
    """The rollout queue as TRL's RolloutQueueDataset reads it (`get(timeout=)`, `qsize()`), noting each sample's group
    as it is taken: whatever the dataset then does with it (train it or drop it as stale), the group is consumed."""

    def __init__(self, queue: Any, taken: set[int]) -> None:
        self.queue, self.taken = queue, taken

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self.queue.get(*args, **kwargs)
        self.taken.add(sample.group_id)
        return sample

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class ResumePosition:
    """Mixed in before an AsyncGRPOTrainer class (see `positioned`): saves and resumes the position described above."""

    _taken: set[int]  # this start's groups the trainer took off the rollout queue

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._taken, self._skipped = set(), frozenset()  # a dataloader built before training starts has a set too
        super().__init__(*args, **kwargs)
    _skipped: frozenset[int]  # CONSUMED_AHEAD of the checkpoint this start resumed from
    _empty_file: Path  # where this start's rollout child lists the groups that scored to no sample

    def _positioned_worker(self) -> bool:
        worker = getattr(self, "rollout_worker", None)
        if not isinstance(worker, AsyncRolloutWorker):
            return False
        _require(isinstance(worker._loop_kwargs, dict) and "dataset_start_index" in worker._loop_kwargs,
                 "keeps the worker's dataset_start_index in _loop_kwargs")
        if not issubclass(worker._loop_cls, PositionedRolloutLoop):
            raise TypeError(f"{type(worker).__name__} runs {worker._loop_cls.__name__}; the resume position needs "
                            "train_resume.PositionedRolloutLoop (use PositionedRolloutWorker)")
        return True

    def begin_start(self, resume_from_checkpoint: str | None) -> None:
        """Before TRL's own resume reads `prompt_index`: forget the last start's groups, read CONSUMED_AHEAD from
        the checkpoint, and pass it and a fresh empty-groups file to the rollout child (started on train begin)."""
        self._taken, self._skipped = set(), frozenset()
        self._empty_file = Path(self.args.output_dir) / EMPTY_GROUPS_FILE
        if not self._positioned_worker():
            return
        state_file = Path(resume_from_checkpoint) / ROLLOUT_STATE if resume_from_checkpoint else None
        if state_file is not None and state_file.is_file():
            self._skipped = frozenset(json.loads(state_file.read_text()).get(CONSUMED_AHEAD, []))
        self._empty_file.parent.mkdir(parents=True, exist_ok=True)
        recipe.write_json(self._empty_file, [])  # a file left by an earlier start would name another start's groups
        self.rollout_worker._loop_kwargs.update(consumed_ahead=sorted(self._skipped),
                                                empty_groups_file=str(self._empty_file))

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        self.begin_start(kwargs.get("resume_from_checkpoint"))
        return super()._inner_training_loop(*args, **kwargs)

    def get_train_dataloader(self) -> Any:
        if self.rollout_queue is not None and not isinstance(self.rollout_queue, _RecordingQueue):
            self.rollout_queue = _RecordingQueue(self.rollout_queue, self._taken)
        loader = super().get_train_dataloader()
        if self.rollout_queue is not None:
            _require(self._rollout_dataset.queue is self.rollout_queue,
                     "reads its samples from trainer.rollout_queue in RolloutQueueDataset")
        return loader

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if not (self.accelerator.is_main_process and self._positioned_worker()):
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        state_file = folder / ROLLOUT_STATE
        _require(state_file.is_file(), f"writes {ROLLOUT_STATE} into each checkpoint")
        state = json.loads(state_file.read_text())
        _require("prompt_index" in state, f"saves prompt_index in {ROLLOUT_STATE}")
        empty = self._empty_file
        consumed = self._taken | self._skipped | set(json.loads(empty.read_text()) if empty.is_file() else [])
        start = self.rollout_worker._loop_kwargs["dataset_start_index"]
        recipe.write_json(state_file, {**state, **next_position(start, consumed)})


_CLASSES: dict[tuple[type, type], type] = {}


def mixed(mixin: type, trainer_cls: type[AsyncGRPOTrainer]) -> type[AsyncGRPOTrainer]:
    """`trainer_cls` with `mixin` mixed in before it (same name, one class per pair)."""
    if (mixin, trainer_cls) not in _CLASSES:
        _CLASSES[mixin, trainer_cls] = type(trainer_cls.__name__, (mixin, trainer_cls),
                                            {"__module__": trainer_cls.__module__, "__doc__": trainer_cls.__doc__})
    return _CLASSES[mixin, trainer_cls]


def positioned(trainer_cls: type[AsyncGRPOTrainer]) -> type[AsyncGRPOTrainer]:
    """`trainer_cls` with ResumePosition mixed in."""
    return mixed(ResumePosition, trainer_cls)
