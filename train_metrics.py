"""What one optimizer step optimises and logs on top of TRL 1.15: StepObjective (the trainer's) and RecipeRolloutLoop
(the rollout child's); docs/training.md "Reading the dashboard" reads the metrics."""

from __future__ import annotations

import copy
import functools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerState, TrainingArguments
from transformers.integrations import TrackioCallback
from transformers.integrations.integration_utils import rewrite_logs
from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, RolloutSample
from trl.experimental.async_grpo.openenv_harness import _HarnessRolloutLoop

import dashboard
import recipe

FORKED_FRAC = "sample/forked_frac"
DROPPED_STALE = "sample/dropped_stale_total"  # TRL's counter of samples dropped as more than max_staleness old
ZERO_CONTRAST, BONUS_ONLY = "group/zero_contrast_frac", "group/bonus_only_frac"
ZERO_ADVANTAGE = "sample/zero_advantage_frac"
# A sample's policy version, carried from the rollout child to the loss (popped before TRL's collator logs metrics).
VERSION = "_policy_version"
# The dashboard's rollout counts (TRL sums a `total` over the logging window): metric -> the rollout ledger's counter.
ROLLOUT_COUNTS = {f"rollout/{name}_total": key for name, key in (
    ("finished", "rollouts"), ("unscorable", "unscorable_total"), ("timed_out", "timed_out"), ("forked", "forked"),
    ("budget_stopped", "budget_stopped"), ("context_exhausted", "context_exhausted"), ("cut", "cut"))}
TOOL_CALLS_MEAN = "rollout/tool_calls_mean"  # tool calls per scored rollout: a (calls, rollouts) rate, as TRL reduces


class RecipeRolloutLoop(_HarnessRolloutLoop):
    """TRL's harness loop; each sample it scores also carries its fork, its policy version and whether its group's
    scored rewards are all equal (no contrast) or differ only by the tool bonus (recipe.py's Reward note)."""

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        forked = [float(len(rows) > 1) for rows in group.completions_sequences for _ in rows]  # TRL's sample order
        scored = [r for r in group.rollout_rewards if r is not None]
        flat = len(set(scored)) <= 1
        flags = {ZERO_CONTRAST: float(flat),
                 BONUS_ONLY: float(not flat and len({r >= recipe.CORRECT_REWARD for r in scored}) == 1)}
        for sample, flag in zip(samples, forked, strict=True):
            sample.metrics.update({**flags, FORKED_FRAC: flag, ZERO_ADVANTAGE: float(sample.advantage == 0.0),
                                   VERSION: float(sample.model_version)})
        return samples


class LedgerGrowth:
    """The rollout ledger's growth since the last look, by dashboard metric: only this start's ledger counts, and a
    new ledger (a restarted child) from zero. A rollout is in it before its group is scored, so a step counts all."""

    def __init__(self, ledger_file: str | Path) -> None:
        self.path = Path(ledger_file)
        self.since = time.time()  # made before train() starts the rollout child, which begins the ledger
        self._last: dict[str, Any] = {}

    def take(self) -> dict[str, float | tuple[float, float]]:
        ledger = recipe.read_json(self.path)
        if not ledger or ledger.get("started", 0) < self.since:
            return {}
        last = self._last if self._last.get("started") == ledger["started"] else {}
        self._last = ledger
        grown = {key: ledger[key] - last.get(key, 0) for key in (*ROLLOUT_COUNTS.values(), "scored", "tool_calls")}
        counts: dict[str, float | tuple[float, float]] = {
            metric: float(grown[key]) for metric, key in ROLLOUT_COUNTS.items()}
        if grown["scored"]:
            counts[TOOL_CALLS_MEAN] = (float(grown["tool_calls"]), float(grown["scored"]))
        return counts


def _versioned(collate: Callable[[list[Any]], dict[str, Any]], examples: list[Any]) -> dict[str, Any]:
    """TRL's collator, plus each row's policy version (its oldest sample's) as a tensor that travels with the batch."""
    (rows,) = examples
    versions = [min(sample["metrics"].pop(VERSION, math.nan) for sample in row) for row in rows]
    return {**collate(examples), VERSION: torch.tensor(versions)}


class StepObjective:
    """Mixed in before an AsyncGRPOTrainer class (train_lora.trainer_class): the token-level step and its metrics."""

    _growth: LedgerGrowth | None = None  # set by attach()
    _lora_before: list[torch.Tensor] | None = None

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        base = getattr(loader, "base_dataloader", loader)  # accelerate's dispatcher wraps a new loader
        base.collate_fn = functools.partial(_versioned, base.collate_fn)
        return loader

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """Each micro-batch's `global_n_tokens` is the step's mean per micro-batch, so TRL divides the summed token
        loss by the step's tokens (else a 150-token answer's tokens would weigh 50x an 8,000-token trace's)."""
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batches:
            mean = sum(float(b["global_n_tokens"][0]) for b in batches) / len(batches)
            for batch in batches:
                batch["global_n_tokens"] = torch.full_like(batch["global_n_tokens"], mean)
        self._lora_before = [p.detach().clone() for p in self._lora()]
        return batches, items

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        version, seen = inputs.pop(VERSION, None), []  # TRL's forward outputs: the per-token log-probs
        hook = model.register_forward_hook(lambda _module, _args, outputs: seen.append(outputs))
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()
        with torch.no_grad():
            self._row_stats(inputs, seen[-1].log_probs[0].float(), version)
        return loss

    def _row_stats(self, inputs: dict[str, Any], log_probs: torch.Tensor, version: torch.Tensor | None) -> None:
        """This row's ratio, kl and clip counts, as TRL computes them (its loss strips the padding the same way)."""
        keep = inputs["attention_mask"][0].bool()
        mask = inputs["completion_mask"][0][keep][1:].bool()
        log_ratio = (log_probs - inputs["old_log_probs"][0][keep][1:])[mask]
        advantage, ratio, n = inputs["advantages"][0][keep][1:][mask], log_ratio.exp(), float(mask.sum())
        if not n:
            return
        sink, high = self._metrics["train"], ratio > 1 + self.epsilon_high
        clipped = ((ratio < 1 - self.epsilon_low) & (advantage < 0)) | (high & (advantage > 0))
        sink["ratio/token_mean"].append((float(ratio.sum()), n))
        sink["ratio/sample_min"].append(float(ratio.mean()))
        sink["ratio/sample_max"].append(float(ratio.mean()))
        sink["clip_ratio/unbounded_total"].append(float((high & (advantage < 0)).sum()))
        if version is not None and not math.isnan(float(version[0])):
            age = "fresh" if self.model_version - float(version[0]) <= recipe.STALENESS_SPLIT else "old"
            sink[f"kl/{age}"].append((float((ratio - 1 - log_ratio).sum()), n))
            sink[f"clip_ratio/{age}"].append((float(clipped.sum()), n))

    def _lora(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _log_step_metrics(self) -> None:
        super()._log_step_metrics()
        sink = self._metrics["train"]
        sink[DROPPED_STALE].append(0.0)  # a 0 added to TRL's sum, so every step carries the count
        for metric, value in (self._growth.take() if self._growth else {}).items():
            sink[metric].append(value)
        if self._lora_before is not None:
            moved = sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(self._lora(), self._lora_before,
                                                                                 strict=True))
            sink["lora/update_norm"].append(math.sqrt(moved))
            sink["lora/b_norm"].append(math.sqrt(sum(float(p.detach().pow(2).sum())
                                                     for n, p in self.model.named_parameters() if "lora_B" in n)))
            self._lora_before = None


class SafeTrackioCallback(TrackioCallback):
    """transformers' Trackio callback, started through dashboard.init_run (a Space failure falls back to local logs),
    logging each step at its optimizer step: a resumed run's new job and the eval watcher's points share the x axis."""

    url: str | None = None
    SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")

    def setup(self, args: TrainingArguments, state: TrainerState, model: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.url = dashboard.init_run(args.project, args.run_name, args.trackio_space_id, os.environ,
                                          config=copy.deepcopy(args.to_dict()))
            self._space_id = self._trackio.context_vars.current_space_id.get()
        self._initialized = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: Any, model: Any = None,
               logs: dict[str, float] | None = None, **_: Any) -> None:
        if not self._initialized:
            self.setup(args, state, model)
        if state.is_world_process_zero:
            scalars = rewrite_logs({k: v for k, v in (logs or {}).items() if k not in self.SUMMARY_KEYS})
            self._trackio.log({**scalars, "train/global_step": state.global_step}, step=state.global_step)


def attach(trainer: Any, ledger_file: str | Path) -> None:
    """Swap in the fail-safe Trackio callback; count the ledger's growth per step (from before the child starts)."""
    if trainer.pop_callback(TrackioCallback) is not None:
        trainer.add_callback(SafeTrackioCallback())
    trainer._growth = LedgerGrowth(ledger_file)


def dashboard_url(trainer: Any) -> str | None:
    """The dashboard Space the run logged to, if any (for the model card)."""
    return next((c.url for c in trainer.callback_handler.callbacks if isinstance(c, SafeTrackioCallback)), None)
