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


# --- The step's objective: token-level over the step's rows (issue 41, defect 1) -------------------------------------
# One GRPO group of rows as different in length as a failed 8,000-token trace and a 150-token answer are, each with
# its own advantage (both signs, as a group's are).
STEP_LENGTHS = (9, 61, 14, 40, 7, 33, 22, 50)
STEP_ADVANTAGES = (1.5, -0.5, 1.0, -1.0, 0.7, -1.2, 0.3, -0.8)
PROMPT = 5


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def reference_grads(model, group: list[RolloutSample], per_token: bool) -> dict[str, torch.Tensor]:
    """The gradient of the group's GRPO loss with every sample run alone (no conv leak), written out here: at ratio 1
    (old log-probs are the model's own) the loss is -A * ratio per completion token, summed, then divided by all of
    the group's completion tokens (`per_token`, the recipe's objective) or, per sample, by its own tokens and the
    group size (what TRL does with one sample per micro-batch)."""
    model.zero_grad()
    total = sum(sum(s.completion_mask) for s in group)
    for sample in group:
        ids = torch.tensor([sample.input_ids])
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
        token_logp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        mask = torch.tensor(sample.completion_mask[1:], dtype=torch.float32)
        ratio = torch.exp(token_logp - torch.tensor(sample.old_log_probs[1:]))
        summed = (-sample.advantage * ratio * mask).sum()
        (summed / total if per_token else summed / mask.sum() / len(group)).backward()
    return lora_grads(model)


def test_a_step_is_one_token_weighted_batch_of_its_one_sample_rows(trainer):
    """The step's gradient through TRL's own batcher, collator and loss (train_lora.conv_safe_batching rows, the
    trainer's get_batch_samples and training_step as transformers' loop calls them) equals the gradient of the same
    samples as one token-weighted batch, each run alone."""
    for key, value in train_lora.conv_safe_batching().items():  # the recipe's batching (a test above packs rows)
        setattr(trainer.args, key, value)
    model, generator = trainer.model, torch.Generator().manual_seed(1)
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    saved = {n: p.detach().clone() for n, p in lora_b.items()}
    with torch.no_grad():  # B starts at zero, which would leave every lora_A gradient zero: move it
        for p in lora_b.values():
            p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    group = []
    for n, advantage in zip(STEP_LENGTHS, STEP_ADVANTAGES, strict=True):
        ids = torch.randint(20, 200, (n,), generator=generator)
        with torch.no_grad():  # the behaviour log-probs are the model's own: every ratio is 1, nothing is clipped
            logp = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0, :-1].float(), -1)
        old = [0.0, *logp.gather(-1, ids[1:, None]).squeeze(-1).tolist()]
        group.append(RolloutSample(prompt=[], completion=[], input_ids=ids.tolist(),
                                   completion_mask=[0] * PROMPT + [1] * (n - PROMPT), old_log_probs=old,
                                   advantage=advantage, model_version=0, group_id=7, metrics={}))
    for sample in group + group[:1]:  # one more: accelerate's dispatcher fetches a batch ahead
        trainer.rollout_queue.put(sample)
    steps = trainer.args.gradient_accumulation_steps
    batches, items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), steps, trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(batches)  # as transformers' loop sets it
    assert [int(b["attention_mask"].sum()) for b in batches] == list(STEP_LENGTHS)  # one sample per row
    model.zero_grad()
    try:
        for batch in batches:
            trainer.training_step(model, batch, items)
        step = lora_grads(model)
        token_level = reference_grads(model, group, per_token=True)
        per_sample = reference_grads(model, group, per_token=False)
    finally:
        model.zero_grad()
        model.eval()
        with torch.no_grad():
            for n, p in lora_b.items():
                p.copy_(saved[n])
        with contextlib.suppress(queue.Empty):
            while True:
                trainer.rollout_queue.get(timeout=1)
    def gap(a: dict, b: dict) -> float:  # the largest relative difference of any LoRA tensor's gradient
        return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)

    assert gap(per_sample, token_level) > 0.1  # the two objectives differ here: the equality below says which
    assert gap(step, token_level) < 1e-4, (gap(step, token_level), gap(step, per_sample))


def test_conv_safe_batching_is_what_grpo_config_uses(trainer):
    fix = train_lora.conv_safe_batching()
    config = train_lora.grpo_config(train_lora.settings_from_env(
        {"ADAPTER_REPO": "me/adapter", "HF_TOKEN": "hf_test", "DEVICE": "cpu"}))
    assert {key: getattr(config, key) for key in fix} == fix
    # One GRPO group's worth of samples per optimizer step, as with TRL's default batch of 8.
    assert fix["per_device_train_batch_size"] * fix["gradient_accumulation_steps"] == config.num_generations
