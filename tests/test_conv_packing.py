"""Conv-safe training rows: what TRL 1.15 actually feeds the model must not leak across samples.

TRL packs rollout samples into one row and passes only `position_ids`; LFM2's short-conv layers ignore
sequence boundaries there, so a packed sample's logits depend on the sample before it. The fix under test
is `train_lora.conv_safe_batching()`. Rows come from the real trainer's own dataloader (TRL's batcher and
collator), built by `train_lora.build_trainer`; each row is run through the trainer's tiny LFM2 model and
every sample's per-token logits are compared with that sample run alone.

Tolerance: 1e-5 absolute on fp32 logits (the same sample alone is the same arithmetic, so any real leak is
orders of magnitude larger: the unfixed packing below must differ by more than 100x that).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue

import pytest
import torch
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

import train_lora
from tests.fake_sessions import FakeSessionFactory, fake_task_list
from tests.tiny_lfm2 import LAYER_TYPES, save_tiny_model
from tests.trl_cpu_shims import NullWeightTransfer, cpu_trainer_shims

ATOL = 1e-5
LEAK = 100 * ATOL
# Larger than the default 0.02 so the random model's conv mixes strongly enough to measure.
INIT_STD = 0.1
LENGTHS = (23, 17, 31)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    env = {"ADAPTER_REPO": "me/adapter", "HF_TOKEN": "hf_test", "DEVICE": "cpu",
           "MODEL": str(save_tiny_model(root / "model", initializer_range=INIT_STD)), "OUTPUT_DIR": str(root / "out"),
           "TASK_DATA": fake_task_list(root / "data")}
    with pytest.MonkeyPatch.context() as patch, cpu_trainer_shims():
        # No network here: without this, transformers' hub-kernel lookup for the conv waits out a timeout.
        patch.setenv("HF_HUB_OFFLINE", "1")
        trainer = train_lora.build_trainer(
            train_lora.settings_from_env(env), factory=functools.partial(FakeSessionFactory),
            weight_transfer=NullWeightTransfer(), api=object())
        trainer.model.eval()
        trainer.vllm_client.server_timeout = 1  # A config that needs the vLLM server fails fast here.
        yield trainer


def samples() -> list[RolloutSample]:
    """Three rollout samples of different lengths with random token ids (the model is random too)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(20, 200, (n,), generator=generator).tolist()
        out.append(RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=[0] * 5 + [1] * (n - 5),
                                 old_log_probs=[0.0] * n, advantage=1.0, model_version=0, group_id=i, metrics={}))
    return out


def rows_from_trainer(trainer, args_overrides: dict[str, int]) -> list[dict[str, torch.Tensor]]:
    """Feed the samples through the trainer's real dataloader and return the batches it emits."""
    for key, value in args_overrides.items():
        setattr(trainer.args, key, value)
    # Twice: accelerate's dispatcher fetches one batch ahead, so the queue must not run dry after the third.
    for sample in samples() + samples():
        trainer.rollout_queue.put(sample)
    batches, seen = [], 0
    for batch in trainer.get_train_dataloader():
        batches.append(batch)
        seen += int((batch["position_ids"][batch["attention_mask"].bool()] == 0).sum())
        if seen == len(LENGTHS):
            break
    with contextlib.suppress(queue.Empty):  # Leave the queue empty for the next test.
        while True:
            trainer.rollout_queue.get(timeout=1)
    return batches


def worst_leak(model, batches) -> float:
    """Largest |logit difference| between a sample inside a training row and the same sample alone.

    `use_cache=False` as in TRL's training forward: with a cache, transformers skips the packed-sequence
    attention mask it otherwise derives from the position resets.
    """
    worst = 0.0
    with torch.no_grad():
        for batch in batches:
            keep = batch["attention_mask"].bool()
            ids, positions = batch["input_ids"][keep][None], batch["position_ids"][keep][None]
            row_logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
            starts = (positions[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for start, end in itertools.pairwise(starts):
                alone = model(input_ids=ids[:, start:end], use_cache=False).logits[0]
                worst = max(worst, (row_logits[start:end] - alone).abs().max().item())
    return worst


def test_trainer_rows_hold_one_sample_each_and_match_samples_alone(trainer):
    batches = rows_from_trainer(trainer, {})
    assert [int(b["attention_mask"].sum()) for b in batches] == list(LENGTHS)  # one sample per row, in order
    assert worst_leak(trainer.model, batches) <= ATOL


def test_packed_rows_without_the_fix_leak_through_the_conv_layers(trainer):
    # TRL's packing (several samples per row), i.e. the configuration conv_safe_batching() replaces.
    batches = rows_from_trainer(trainer, {"token_budget": 0, "per_device_train_batch_size": len(LENGTHS)})
    assert len(batches) == 1 and int(batches[0]["attention_mask"].sum()) == sum(LENGTHS)
    assert worst_leak(trainer.model, batches) > LEAK


def test_attention_alone_respects_packing_so_the_leak_is_the_conv():
    # Control: the same packed row through an attention-only LFM2 matches per sample, so position resets
    # are enough for attention and the leak above comes from the short-conv layers.
    from transformers import Lfm2ForCausalLM

    from tests.tiny_lfm2 import tiny_config, tiny_tokenizer

    torch.manual_seed(0)
    model = Lfm2ForCausalLM(tiny_config(len(tiny_tokenizer()), layer_types=["full_attention"] * len(LAYER_TYPES),
                                        attn_implementation="sdpa")).eval()
    ids = torch.cat([torch.tensor(s.input_ids) for s in samples()])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    batch = {"input_ids": ids, "position_ids": positions, "attention_mask": torch.ones_like(ids)}
    assert worst_leak(model, [batch]) <= ATOL


def test_conv_safe_batching_is_what_grpo_config_uses(trainer):
    fix = train_lora.conv_safe_batching()
    config = train_lora.grpo_config(train_lora.settings_from_env(
        {"ADAPTER_REPO": "me/adapter", "HF_TOKEN": "hf_test", "DEVICE": "cpu"}))
    assert {key: getattr(config, key) for key in fix} == fix
    # One GRPO group's worth of samples per optimizer step, as with TRL's default batch of 8.
    assert fix["per_device_train_batch_size"] * fix["gradient_accumulation_steps"] == config.num_generations
