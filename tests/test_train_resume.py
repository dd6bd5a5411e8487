"""The resume position moves past every group already consumed (train_resume.py), on TRL 1.15's own pieces.

One start, as the trainer and its rollout child live it: group 0 is all unscorable (the child scores it to no
sample), group 1 is trained, group 3 arrives too old and is dropped as stale, group 4 finishes before group 2 (out of
order) and is trained, groups 2 and 5 are still in flight when checkpoint-1 is saved. TRL alone saves prompt_index 0
(the lowest group not trained), so a relaunch would redo groups 0-5; the relaunch must redo only 2 and 5.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import queue
from collections import defaultdict
from pathlib import Path

import pytest
from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, RolloutSample

import recipe
import train_lora
import train_resume
from tests.fake_sessions import FakeSessionFactory, fake_task_list
from tests.hub_double import LocalHub
from tests.tiny_lfm2 import save_tiny_model
from tests.trl_cpu_shims import NullWeightTransfer, cpu_trainer_shims

TASKS = tuple(f"Question {i}: what is the mean of column x{i}?" for i in range(10))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The production trainer from train_lora.build_trainer (tiny LFM2, fake sessions, nothing started)."""
    tmp = tmp_path_factory.mktemp("position")
    env = {"ADAPTER_REPO": "me/adapter", "HF_TOKEN": "hf_test", "DEVICE": "cpu", "MAX_STEPS": "10",
           "MODEL": str(save_tiny_model(tmp / "model")), "OUTPUT_DIR": str(tmp / "out"),
           "HEARTBEAT_FILE": str(tmp / "heartbeat"), "TASK_DATA": fake_task_list(tmp / "data", TASKS)}
    with pytest.MonkeyPatch.context() as patch, cpu_trainer_shims():
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield train_lora.build_trainer(train_lora.settings_from_env(env),
                                       factory=functools.partial(FakeSessionFactory, "http://env", tasks=TASKS),
                                       weight_transfer=NullWeightTransfer(), api=LocalHub(tmp / "hub"))


def child_loop(trainer, **kwargs) -> train_resume.PositionedRolloutLoop:
    """The rollout child's loop, built in this process from what the worker would send the spawned child."""
    ctx = multiprocessing.get_context("spawn")
    loop_kwargs = {**trainer.rollout_worker._loop_kwargs, **kwargs}
    return trainer.rollout_worker._loop_cls(**loop_kwargs, rollout_buffer=queue.Queue(),
                                            model_version_value=ctx.Value("i", 0), heartbeat_value=ctx.Value("d", 0.0),
                                            failed_event=ctx.Event(), exception_info_queue=queue.Queue(),
                                            metrics_queue=queue.Queue())


def unscorable_group(group_id: int) -> RolloutGroup:
    """A finished group whose every rollout TRL's harness loop turned into `_EMPTY_ROLLOUT` (no sequence, no reward)."""
    n = recipe.NUM_GENERATIONS
    return RolloutGroup(prompts=[[]] * n, reward_kwargs={}, completions=[[]] * n, completions_ids=[[]] * n,
                        completions_sequences=[[] for _ in range(n)], tool_call_counts=[0] * n,
                        tool_failure_counts=[0] * n, model_version=0, group_id=group_id, env_rewards=[],
                        rollout_rewards=[None] * n)


def sample(group_id: int, model_version: int) -> RolloutSample:
    return RolloutSample(prompt=[], completion=[], input_ids=[1, 2, 3], completion_mask=[0, 1, 1],
                         old_log_probs=[0.0, -1.0, -1.0], advantage=1.0, model_version=model_version,
                         group_id=group_id, metrics={})


def test_a_relaunch_starts_after_every_consumed_group_and_redoes_only_those_in_flight(trainer, tmp_path):
    assert type(trainer).__name__ == "MergeFreeAsyncGRPOTrainer" and isinstance(trainer, train_resume.ResumePosition)
    worker = trainer.rollout_worker
    assert worker._loop_cls is train_resume.PositionedRolloutLoop

    # First start, from scratch: the child's loop hands out groups 0, 1, 2, ... in the list's order.
    trainer.begin_start(None)
    first = child_loop(trainer)
    stream = first._repeat_iterator()
    dispatched = [next(stream) for _ in range(3 * recipe.NUM_GENERATIONS)]
    assert [g for g, _ in dispatched[::recipe.NUM_GENERATIONS]] == [0, 1, 2]
    assert [row["task_name"] for _, row in dispatched[::recipe.NUM_GENERATIONS]] == ["task-0", "task-1", "task-2"]

    # Group 0 scores to no sample (all unscorable): only the child knows, and it says so in its file.
    assert asyncio.run(first._score_group(unscorable_group(0))) == []
    assert json.loads(Path(worker._loop_kwargs["empty_groups_file"]).read_text()) == [0]

    # The trainer takes groups 1, 3 (stale: 6 versions old at version 6) and 4 off the queue, through TRL's own
    # RolloutQueueDataset reading the trainer's (recording) queue; 2 and 5 are still in flight.
    rollouts = queue.Queue()
    for group_id, version in ((1, 5), (3, 0), (4, 6)):
        rollouts.put(sample(group_id, version))
    recording = train_resume._RecordingQueue(rollouts, trainer._taken)
    dataset = RolloutQueueDataset(recording, model_version_fn=lambda: 6, check_health_fn=lambda _: None,
                                  stale_after_s=60, metrics=defaultdict(list), max_staleness=4)
    delivered = iter(dataset)
    assert [next(delivered)["group_id"] for _ in range(2)] == [1, 4]  # 3 was dropped as stale on the way

    # Checkpoint-1: TRL writes rollout_state.json, then the position is rewritten.
    trainer.args.output_dir = str(tmp_path / "out")
    trainer.state.global_step = 1
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    trainer._save_checkpoint(trainer.model, trial=None)
    state = json.loads((tmp_path / "out" / "checkpoint-1" / "rollout_state.json").read_text())
    assert state == {"prompt_index": 2, "consumed_ahead": [1, 2], "model_version": trainer.model_version}

    # The relaunch: TRL's resume starts the child at prompt_index; it skips 3 and 4 and redoes 2 and 5 only.
    trainer.begin_start(str(tmp_path / "out" / "checkpoint-1"))
    worker._loop_kwargs["dataset_start_index"] = state["prompt_index"]  # what TRL's _inner_training_loop does
    assert worker._loop_kwargs["consumed_ahead"] == [1, 2]
    assert json.loads(Path(worker._loop_kwargs["empty_groups_file"]).read_text()) == []  # the last start's is gone
    resumed = child_loop(trainer)
    stream = resumed._repeat_iterator()
    groups = [next(stream) for _ in range(5 * recipe.NUM_GENERATIONS)][::recipe.NUM_GENERATIONS]
    assert [row["task_name"] for _, row in groups] == ["task-2", "task-5", "task-6", "task-7", "task-8"]
    assert [g for g, _ in groups] == [0, 3, 4, 5, 6]  # group id = offset from prompt_index, as TRL counts it

    # The relaunch's own checkpoint keeps the skipped groups consumed: with 2 and 5 done, it moves on to 6.
    trainer._taken.update({0, 3})
    trainer.state.global_step = 2
    trainer._save_checkpoint(trainer.model, trial=None)
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "rollout_state.json").read_text())
    assert (state["prompt_index"], state["consumed_ahead"]) == (2 + 4, [])


def test_the_position_wraps_around_the_list_like_trls_stream(trainer):
    """Past the last task the stream starts the list again (TRL's repeat iterator), skipping nothing twice."""
    loop = child_loop(trainer, dataset_start_index=len(TASKS) - 1, consumed_ahead=[1])
    stream = loop._repeat_iterator()
    groups = [next(stream) for _ in range(3 * recipe.NUM_GENERATIONS)][::recipe.NUM_GENERATIONS]
    assert [(g, row["task_name"]) for g, row in groups] == [(0, "task-9"), (2, "task-1"), (3, "task-2")]
