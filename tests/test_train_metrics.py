"""train_metrics.py's step metrics and Trackio callback, on TRL 1.15's own trainer, metric sink and reduction (the
rehearsal runs them live); the rollout counts and the per-row group facts are tested in test_train_rollouts.py, the
token-level step in test_conv_packing.py."""

from __future__ import annotations

import pytest
import torch
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

import train_lora
import train_metrics
import train_metrics as tm
from tests.test_conv_packing import trainer  # noqa: F401 - the trainer train_lora.build_trainer builds, on CPU

# A step of 8 one-sample rows: 4 sampled by the current policy version, 4 by one 7 versions old (past
# recipe.STALENESS_SPLIT), advantages of both signs; in each row a few tokens at ratio 1.5 (outside TRL's clip).
LENGTHS = (12, 30, 9, 21, 16, 40, 11, 25)
ADVANTAGES = (1.2, -0.7, 0.4, -1.5, 0.9, -0.3, 1.1, -1.0)
NOW, OLD, PROMPT, FAR = 10, 3, 4, 1.5


def test_a_steps_ratio_kl_and_clip_are_trls_own_per_row_numbers_split_by_staleness(trainer):  # noqa: F811
    """Through TRL's own batcher, collator, loss and step-metrics flush: each row's `kl/*` and `clip_ratio/*` equal
    the `kl` and `clip_ratio/region_mean` TRL logs for that row, in the band of the row's age; `ratio/token_mean` is
    the token-weighted mean of every token's ratio; the unbounded tokens (A < 0, ratio > 1 + eps) are counted; the
    LoRA's update is the norm of what the optimizer step changed."""
    model, generator, sink = trainer.model, torch.Generator().manual_seed(2), trainer._metrics["train"]
    trainer.model_version, rows, ratios, unbounded = NOW, [], [], 0
    for i, (n, advantage) in enumerate(zip(LENGTHS, ADVANTAGES, strict=True)):
        ids = torch.randint(20, 200, (n,), generator=generator)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0, :-1].float(), -1)
        own = logp.gather(-1, ids[1:, None]).squeeze(-1)
        far = torch.zeros(n - 1, dtype=torch.bool)
        far[PROMPT + i % 3::5] = True  # a few completion tokens per row, sampled where vLLM thought them less likely
        ratio = torch.where(far, torch.tensor(FAR), torch.tensor(1.0))
        ratios.append(ratio[PROMPT - 1:])
        unbounded += int(far[PROMPT - 1:].sum()) if advantage < 0 else 0
        version = NOW if i < 4 else OLD
        rows.append(RolloutSample(prompt=[], completion=[], input_ids=ids.tolist(),
                                  completion_mask=[0] * PROMPT + [1] * (n - PROMPT),
                                  old_log_probs=[0.0, *(own - ratio.log()).tolist()], advantage=advantage,
                                  model_version=version, group_id=9, metrics={tm.VERSION: float(version)}))
    for key, value in train_lora.conv_safe_batching().items():
        setattr(trainer.args, key, value)
    for row in rows + rows[:1]:  # one more: accelerate's dispatcher fetches a batch ahead
        trainer.rollout_queue.put(row)
    sink.clear()
    loader = iter(trainer.get_train_dataloader())
    batches, items = trainer.get_batch_samples(loader, len(rows), trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(batches)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    trainer.create_optimizer()
    model.zero_grad()
    for batch in batches:
        trainer.training_step(model, batch, items)
    trainer.optimizer.step()
    moved = sum(float((p.detach() - b).pow(2).sum()) for p, b in
                zip([p for p in model.parameters() if p.requires_grad], before, strict=True)) ** 0.5
    trl_kl, trl_clip, trl_ratio = sink["kl"], sink["clip_ratio/region_mean"], sink["ratio"]
    for age, part in (("fresh", slice(0, 4)), ("old", slice(4, 8))):
        assert [k / n for k, n in sink[f"kl/{age}"]] == pytest.approx(trl_kl[part], rel=1e-5, abs=1e-9)
        assert [c / n for c, n in sink[f"clip_ratio/{age}"]] == pytest.approx(trl_clip[part], rel=1e-6)
    assert max(trl_clip) > 0 and max(trl_kl) > 1e-3  # the far tokens are there, in TRL's own numbers too
    assert (min(sink["ratio/sample_min"]), max(sink["ratio/sample_max"])) == pytest.approx(
        (min(trl_ratio), max(trl_ratio)), rel=1e-6)
    expected = torch.cat(ratios)
    step = {key: _reduce_metric(key, values) for key, values in sink.items()}
    assert step["ratio/token_mean"] == pytest.approx(float(expected.mean()), rel=1e-4)
    assert step["ratio/token_mean"] != pytest.approx(step["ratio"], rel=1e-4)  # TRL's is a mean of row means
    assert step["clip_ratio/unbounded_total"] == unbounded > 0
    trainer._log_step_metrics()  # what TRL runs at every optimizer step's end
    assert sink["lora/update_norm"] == [pytest.approx(moved, rel=1e-5)] and moved > 0
    assert sink["lora/b_norm"][0] > 0  # B started at zero: the optimizer step moved the adapter off the base
    assert sink[tm.DROPPED_STALE] == [0.0]  # every step carries the stale-drop count


def test_trackio_callback_logs_each_step_at_its_optimizer_step(tmp_path, capsys):
    """A resumed run is a new job (a new Trackio run): its points must land at the real steps, as the eval's do."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", project="callback-test",
                             run_name=f"train-{tmp_path.name}", trackio_space_id=None, use_cpu=True)
    state = TrainerState(global_step=201)
    callback = train_metrics.SafeTrackioCallback()
    callback.on_train_begin(args, state, TrainerControl())
    callback.on_log(args, state, TrainerControl(), logs={"loss": 0.5, "ratio/sample_min": 0.99})
    state.global_step = 202
    callback.on_log(args, state, TrainerControl(), logs={"loss": 0.25, "train_runtime": 9.0})
    trackio.finish()
    rows = SQLiteStorage.get_logs("callback-test", f"train-{tmp_path.name}")
    assert [(r["step"], r["train/global_step"], r["train/loss"]) for r in rows] == [(201, 201, 0.5), (202, 202, 0.25)]
    assert rows[0]["train/ratio/sample_min"] == 0.99 and "train_runtime" not in rows[1]
    assert callback.url is None and "dashboard: no dashboard Space" in capsys.readouterr().out
