"""Where a relaunched trainer resumes in the task stream: after every group already consumed (taken off the rollout
queue, or scored to no sample), redoing only the ones in flight at the save (docs/training.md "Resume position")."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

import recipe
from recipe import CONSUMED_AHEAD, ROLLOUT_STATE
from train_metrics import RecipeRolloutLoop


class PositionedRolloutLoop(RecipeRolloutLoop):
    """The recipe's rollout loop, resuming after every consumed group and reporting the ones that scored to nothing."""

    def __init__(self, *, consumed_ahead: Iterable[int] = (), empty_groups_file: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._start, self._skip = kwargs.get("dataset_start_index", 0), frozenset(consumed_ahead)
        self._empty_file = Path(empty_groups_file) if empty_groups_file else None
        self._empty: set[int] = set()

    def _repeat_iterator(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """TRL's stream, each group's id its row's offset from the start index; consumed offsets are skipped."""
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


class _RecordingQueue:
    """The rollout queue as TRL's RolloutQueueDataset reads it, noting each sample's group as it is taken: whether the
    dataset then trains it or drops it as stale, the group is consumed."""

    def __init__(self, queue: Any, taken: set[int]) -> None:
        self.queue, self.taken = queue, taken

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self.queue.get(*args, **kwargs)
        self.taken.add(sample.group_id)
        return sample

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class ResumePosition:
    """Mixed in before an AsyncGRPOTrainer class (train_lora.trainer_class): saves and resumes the position above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._taken: set[int] = set()  # this start's groups the trainer took off the rollout queue
        self._skipped: frozenset[int] = frozenset()  # CONSUMED_AHEAD of the checkpoint this start resumed from
        super().__init__(*args, **kwargs)

    def begin_start(self, resume_from_checkpoint: str | None) -> None:
        """Before TRL's own resume reads `prompt_index`: forget the last start's groups, read CONSUMED_AHEAD from
        the checkpoint, and pass it and a fresh empty-groups file to the rollout child (started on train begin)."""
        self._taken, self._skipped = set(), frozenset()
        self._empty_file = Path(self.args.output_dir) / "empty_groups.json"  # this start's groups scored to nothing
        if not isinstance(self.rollout_worker, AsyncRolloutWorker):  # TRL's own test: a worker with a position
            return
        saved = recipe.read_json(Path(resume_from_checkpoint) / ROLLOUT_STATE) if resume_from_checkpoint else None
        self._skipped = frozenset((saved or {}).get(CONSUMED_AHEAD, []))
        recipe.write_json(self._empty_file, [])  # a file left by an earlier start would name another start's groups
        self.rollout_worker._loop_kwargs.update(consumed_ahead=sorted(self._skipped),
                                                empty_groups_file=str(self._empty_file))

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        self.begin_start(kwargs.get("resume_from_checkpoint"))
        return super()._inner_training_loop(*args, **kwargs)

    def get_train_dataloader(self) -> Any:
        if self.rollout_queue is not None and not isinstance(self.rollout_queue, _RecordingQueue):
            self.rollout_queue = _RecordingQueue(self.rollout_queue, self._taken)
        return super().get_train_dataloader()

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """TRL's checkpoint, then its `rollout_state.json` rewritten with this start's consumed groups (offsets from the
        prompt index it began at): `prompt_index` of the lowest group not consumed, CONSUMED_AHEAD those past it."""
        super()._save_checkpoint(model, trial)
        if not (self.accelerator.is_main_process and isinstance(self.rollout_worker, AsyncRolloutWorker)):
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        consumed = self._taken | self._skipped | set(recipe.read_json(self._empty_file) or [])
        first = next(g for g in itertools.count() if g not in consumed)
        recipe.write_json(folder / ROLLOUT_STATE, {
            **json.loads((folder / ROLLOUT_STATE).read_text()),
            "prompt_index": self.rollout_worker._loop_kwargs["dataset_start_index"] + first,
            CONSUMED_AHEAD: sorted(g - first for g in consumed if g > first)})

