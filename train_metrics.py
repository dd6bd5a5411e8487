"""The training metrics this recipe needs beyond TRL 1.15's own, and the fail-safe Trackio callback.

TRL already logs, per optimizer step: `reward`, `kl`, `entropy`, `ratio` (importance-ratio mean), clip ratios,
`perf/weight_sync_s`, `perf/step_s`, `sample/staleness_mean|max`, `sample/time_in_queue_s`, `rollout/fork_frac`,
`tools/call_frequency` (groups with tool calls only), and rollout traces when Trackio is the reporter. The rollout
counts (`rollout/finished_total`, `rollout/unscorable_total`, `rollout/timed_out_total`, `rollout/forked_total`,
`rollout/tool_calls_mean`) are the rollout guard's ledger (train_rollouts.LedgerGrowth), logged each step by
RolloutCounts. Added here:

- `ratio/sample_min`, `ratio/sample_max`: the range of the per-sample importance-ratio means of the step (one
  sample per training row, see train_lora.conv_safe_batching);
- `perf/weight_sync_fused_tensors` is logged by train_weight_sync.MergeFreeAsyncGRPOTrainer itself;
- `sample/forked_frac` (FORKED_FRAC): the share of the step's trained samples whose rollout forked;
- `sample/dropped_stale_total` on every step: TRL logs its count of samples dropped as too stale only on steps that
  dropped one (StaleDrops adds the zero), so a step without the key is never mistaken for a step without data.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import TrackioCallback
from transformers.integrations.integration_utils import rewrite_logs
from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, RolloutSample
from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker, _HarnessRolloutLoop

import dashboard
import train_rollouts

# Per sample: 1.0 if the rollout it came from forked into several training rows (lossless capture), else 0.0. TRL's
# collator averages per-sample metrics over each micro-batch, so the step's log holds the share of its trained samples
# that are parts of a forked rollout: on every step, unlike TRL's `rollout/fork_frac` (forks per turn transition of the
# rollouts that finished in the window, absent when none did).
FORKED_FRAC = "sample/forked_frac"


class RecipeRolloutLoop(_HarnessRolloutLoop):
    """TRL's harness loop; each sample it scores also says whether its rollout's capture forked (FORKED_FRAC)."""

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        forked = [float(len(rows) > 1) for rows in group.completions_sequences for _ in rows]  # TRL's sample order
        for sample, flag in zip(samples, forked, strict=True):
            sample.metrics[FORKED_FRAC] = flag
        return samples


class RecipeRolloutWorker(HarnessRolloutWorker):
    """HarnessRolloutWorker whose spawned loop marks forked samples (RecipeRolloutLoop)."""

    _loop_cls = RecipeRolloutLoop


class RatioRange(TrainerCallback):
    """Adds the step's min and max per-sample importance ratio next to TRL's mean, before the step is logged."""

    def __init__(self, sink: dict[str, list[Any]]) -> None:
        self.sink = sink  # the trainer's own metric sink (TRL reduces it in log(); `min`/`max` names are extrema)
        self.seen = 0

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        ratios = [r for r in self.sink.get("ratio", [])[self.seen:] if not math.isnan(r)]
        self.seen = len(self.sink.get("ratio", []))
        if ratios:
            self.sink["ratio/sample_min"].append(min(ratios))
            self.sink["ratio/sample_max"].append(max(ratios))

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        self.seen = 0  # TRL clears the sink right after this log


class RolloutCounts(TrainerCallback):
    """Adds, before each step is logged, what the rollout ledger counted since the previous step (LedgerGrowth)."""

    def __init__(self, sink: dict[str, list[Any]], ledger_file: str | Path) -> None:
        self.sink = sink  # the trainer's metric sink: `total` counters summed, the tool-call rate as (num, den)
        self.growth = train_rollouts.LedgerGrowth(ledger_file)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        for metric, value in self.growth.take().items():
            self.sink[metric].append(value)


# TRL 1.15's counter (RolloutQueueDataset): +1 per training sample (row) the trainer pulled and dropped for being more
# than max_staleness versions old; summed per logging window (`total` in the name), i.e. since the last step.
DROPPED_STALE = "sample/dropped_stale_total"


class StaleDrops(TrainerCallback):
    """Makes every step's log carry TRL's stale-drop count: a 0 added to the step's sum, which TRL then reduces."""

    def __init__(self, sink: dict[str, list[Any]]) -> None:
        self.sink = sink

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        self.sink[DROPPED_STALE].append(0.0)


class SafeTrackioCallback(TrackioCallback):
    """transformers' Trackio callback, started through dashboard.init_run (a Space failure falls back to local logs),
    logging each step at its optimizer step: a resumed run's new job and the eval watcher's points share the x axis.
    """

    url: str | None = None
    SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")

    def setup(self, args: TrainingArguments, state: TrainerState, model: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            config = copy.deepcopy(args.to_dict())
            self.url = dashboard.init_run(args.project, args.run_name, args.trackio_space_id, os.environ,
                                           config=config)
            self._space_id = self._trackio.context_vars.current_space_id.get()
        self._initialized = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
               logs: dict[str, float] | None = None, **_: Any) -> None:
        if not self._initialized:
            self.setup(args, state, model)
        if state.is_world_process_zero:
            scalars = rewrite_logs({k: v for k, v in (logs or {}).items() if k not in self.SUMMARY_KEYS})
            self._trackio.log({**scalars, "train/global_step": state.global_step}, step=state.global_step)


def attach(trainer: Any, ledger_file: str | Path) -> None:
    """Swap the trainer's Trackio callback for the fail-safe one; add the ratio range, the stale-drop count and the
    rollout counts (attached before train() starts the rollout child, which begins the ledger at `ledger_file`)."""
    if trainer.pop_callback(TrackioCallback) is not None:
        trainer.add_callback(SafeTrackioCallback())
    trainer.add_callback(RatioRange(trainer._metrics["train"]))
    trainer.add_callback(StaleDrops(trainer._metrics["train"]))
    trainer.add_callback(RolloutCounts(trainer._metrics["train"], ledger_file))


def dashboard_url(trainer: Any) -> str | None:
    """The dashboard Space the run logged to, if any (for the model card)."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, SafeTrackioCallback):
            return callback.url
    return None
