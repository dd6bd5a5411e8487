"""Merge-free weight sync against TRL 1.15's own merge -> stream -> unmerge, on a tiny Lfm2 with real PEFT.

Only vLLM's end of the NCCL transfer cannot exist here: `RecordingTransfer` stands in for it and records what
TRL's `WeightTransferClient` would have been handed. Both sync paths are TRL's/our real methods, driven on a
trainer object that carries just the attributes the sync reads (building the whole trainer needs a vLLM server).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import defaultdict

import pytest
import torch
from accelerate import Accelerator
from peft import get_peft_model
from tiny_lfm2 import tiny_model
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, _iter_vllm_named_params

import recipe
import train_weight_sync
from train_lora import lora_config

SENT = getattr(torch, recipe.SERVE_DTYPE)


class RecordingTransfer:
    """Stands in for vLLM's receiving side: records calls and a copy of each streamed tensor in the sent dtype."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls: list[str] = []
        self.sent: list[tuple[str, torch.Tensor]] = []
        self.raw_dtypes: list[torch.dtype] = []
        self.fail_after = fail_after

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def send_weights(self, iterator) -> None:
        self.calls.append("send")
        for i, (name, tensor) in enumerate(iterator):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("NCCL broke")
            self.raw_dtypes.append(tensor.dtype)
            # What vLLM ends up holding: its bf16 parameter, copied (round-to-nearest-even) from what was sent.
            self.sent.append((name, tensor.to(SENT, copy=True)))


class RecordingWorker:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def update_model_version(self, version: int) -> None:
        self.versions.append(version)


def peft_lfm2(dtype: torch.dtype = torch.float32, lora_alpha: int | None = None):
    """A tiny Lfm2 under the recipe's LoRA, with B drawn nonzero so the merge really changes the weights."""
    model, _ = tiny_model(seed=0)
    config = lora_config()
    if lora_alpha is not None:
        config.lora_alpha = lora_alpha
    model = get_peft_model(model.to(dtype), config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def trainer_for(cls: type[AsyncGRPOTrainer], model, transfer=None, worker=None):
    """A trainer of `cls` holding only what `_sync_weight` reads (model, accelerator, transfer, worker, metrics)."""
    trainer = object.__new__(cls)
    trainer.accelerator = Accelerator(cpu=True)
    trainer.model = model
    trainer.weight_transfer = transfer if transfer is not None else RecordingTransfer()
    trainer.rollout_worker = worker if worker is not None else RecordingWorker()
    trainer.model_version = 0
    trainer._lora_sync = False
    trainer._metrics = defaultdict(lambda: defaultdict(list))
    trainer.sync_dtype = train_weight_sync.send_dtype()
    return trainer


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def assert_bit_identical(before: dict[str, torch.Tensor], model) -> None:
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor.view(torch.uint8), after[name].detach().view(torch.uint8)), name


@pytest.mark.parametrize(
    ("dtype", "lora_alpha"),
    [
        (torch.float32, None),  # the recipe: fp32 base, scaling 64/32 = 2
        (torch.float32, 48),  # scaling 1.5: not a power of two, so `(B @ A) * s` rounds
        (torch.bfloat16, None),  # bf16 base: the in-place merge rounds to bf16 first; so must we
    ],
)
def test_merge_free_stream_equals_stock_merge_bit_for_bit(dtype, lora_alpha):
    model = peft_lfm2(dtype, lora_alpha)
    base = snapshot(model)

    free = trainer_for(train_weight_sync.MergeFreeAsyncGRPOTrainer, model)
    free._sync_weight()
    assert_bit_identical(base, model)  # merge-free never writes the base (nor the adapter)

    stock = trainer_for(AsyncGRPOTrainer, model)
    stock._sync_weight()  # TRL's own merge_adapter -> _streaming_iter -> unmerge_adapter

    free_sent, stock_sent = free.weight_transfer.sent, stock.weight_transfer.sent
    assert [n for n, _ in free_sent] == [n for n, _ in stock_sent]  # same names, same order
    assert [n for n, _ in free_sent] == [n for n, _ in _iter_vllm_named_params(model)]
    assert all(d == SENT for d in free.weight_transfer.raw_dtypes)  # sent as bf16, not cast later
    for (name, mine), (_, theirs) in zip(free_sent, stock_sent, strict=True):
        assert mine.shape == theirs.shape, name
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name
    # Non-vacuous: the adapter moved the served weights of every LoRA-wrapped linear.
    wrapped = {n.replace(".base_layer", "").removeprefix("base_model.model.") for n in base if ".base_layer." in n}
    assert len(wrapped) == 4 * 2 + 3 * 6  # q/k/v/out on 2 attention layers, w1/w2/w3 on 6 layers; no conv
    for name, tensor in free_sent:
        if name in wrapped:
            unmerged = base["base_model.model." + name.replace(".weight", ".base_layer.weight")].to(SENT)
            assert not torch.equal(tensor, unmerged), name


def test_stream_names_never_include_adapter_or_conv_wrappers():
    model = peft_lfm2()
    names = [n for n, _ in train_weight_sync.merge_free_named_tensors(model, SENT)]
    assert not [n for n in names if "lora_" in n or "base_layer" in n or n.startswith("base_model")]
    assert "model.layers.0.conv.out_proj.weight" in names  # conv projections are streamed plain, not wrapped


def test_sync_keeps_trl_pause_resume_version_and_metrics():
    model = peft_lfm2()
    worker = RecordingWorker()
    trainer = trainer_for(train_weight_sync.MergeFreeAsyncGRPOTrainer, model, worker=worker)
    trainer._sync_weight()
    trainer._sync_weight()
    assert trainer.weight_transfer.calls == ["pause", "send", "resume"] * 2
    assert trainer.model_version == 2 and worker.versions == [1, 2]
    assert len(trainer._metrics["train"]["perf/weight_sync_s"]) == 2
    assert len(trainer._metrics["train"]["perf/weight_sync_transfer_s"]) == 2


def test_failed_send_raises_leaves_base_intact_and_version_unbumped():
    model = peft_lfm2()
    base = snapshot(model)
    worker = RecordingWorker()
    trainer = trainer_for(train_weight_sync.MergeFreeAsyncGRPOTrainer, model, RecordingTransfer(fail_after=3), worker)
    with pytest.raises(RuntimeError, match="NCCL broke"):
        trainer._sync_weight()
    assert_bit_identical(base, model)
    assert trainer.weight_transfer.calls == ["pause", "send"]  # like TRL: no resume, no version bump
    assert trainer.model_version == 0 and worker.versions == []


def test_manifest_describes_the_stream_in_the_sent_dtype():
    model = peft_lfm2()
    manifest = train_weight_sync.send_manifest(model, SENT)
    stream = list(train_weight_sync.merge_free_named_tensors(model, SENT))
    assert manifest["names"] == [n for n, _ in stream]
    assert manifest["shapes"] == [list(t.shape) for _, t in stream]
    assert manifest["dtype_names"] == [str(t.dtype).removeprefix("torch.") for _, t in stream]
    assert set(manifest["dtype_names"]) == {recipe.SERVE_DTYPE}


def test_init_retargets_trl_client_manifest(monkeypatch):
    """TRL's client was built from fp32 params; the merge-free trainer swaps in one whose manifest says bf16."""

    class FakeClient:  # stands in for WeightTransferClient, which needs vLLM installed
        def __init__(self, vllm_client, weight_update_info, weight_sync_timeout):
            self.info = weight_update_info
            self.timeout = weight_sync_timeout

    monkeypatch.setattr(train_weight_sync, "WeightTransferClient", FakeClient)
    model = peft_lfm2()
    trainer = trainer_for(train_weight_sync.MergeFreeAsyncGRPOTrainer, model, transfer=FakeClient(None, {}, 7))
    trainer.vllm_client = None
    trainer.args = type("Args", (), {"weight_sync_timeout": 7})()
    trainer._retarget_manifest()
    assert trainer.weight_transfer.info == train_weight_sync.send_manifest(model, SENT)
    assert trainer.weight_transfer.timeout == 7
    injected = RecordingTransfer()
    trainer.weight_transfer = injected
    trainer._retarget_manifest()
    assert trainer.weight_transfer is injected  # an injected backend owns its manifest


def test_stream_holds_one_tensor_at_a_time():
    """Bounded memory: once the consumer drops a merged tensor, the stream keeps no reference to it.

    Checked without gc.collect(): a tensor that only a reference cycle still holds is freed at the next
    collection, not when it is dropped, so on a GPU it would still occupy memory during the sync.
    """
    model = peft_lfm2()
    wrapped = dict(train_weight_sync.lora_layers_by_weight(model))
    params = dict(_iter_vllm_named_params(model))
    previous = None
    checked = 0
    for name, tensor in train_weight_sync.merge_free_named_tensors(model, SENT):
        if previous is not None:
            assert previous() is None, "the stream kept a reference to an earlier tensor"
            checked += 1
        previous = weakref.ref(tensor) if id(params[name]) in wrapped else None
        del tensor
    assert checked == len(wrapped)


def test_trainer_class_modes():
    assert set(train_weight_sync.TRAINERS) == set(recipe.WEIGHT_SYNC_MODES)
    assert train_weight_sync.TRAINERS["stock"] is AsyncGRPOTrainer
    assert issubclass(train_weight_sync.TRAINERS["merge_free"], AsyncGRPOTrainer)


def test_dora_and_lora_bias_refused_before_loading():
    config = lora_config()
    train_weight_sync.check_lora_config(config)
    config.use_dora = True
    with pytest.raises(recipe.ConfigError, match="use_dora: set WEIGHT_SYNC=stock"):
        train_weight_sync.check_lora_config(config)
    config = lora_config()
    config.lora_bias = True
    with pytest.raises(recipe.ConfigError, match="lora_bias"):
        train_weight_sync.check_lora_config(config)


def stock_stream(model) -> list[tuple[str, torch.Tensor]]:
    model.merge_adapter()
    try:
        return [(n, p.detach().to(SENT)) for n, p in _iter_vllm_named_params(model)]
    finally:
        model.unmerge_adapter()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: run on a GPU (benchmarks/LOG.md)")
def test_gpu_stream_is_bit_exact_for_a_consumer_that_switches_streams():
    """Each tensor is complete on whatever stream the consumer pulls it under, as vLLM's NCCL producer does.

    That producer calls `next` in its own thread under one of its own two streams, switching between its
    buffers; this consumer does the same at every tensor and reads each one (a clone, as its torch.cat would) on
    that stream.
    """
    model = peft_lfm2().cuda()
    stock = stock_stream(model)
    base = snapshot(model)
    ready = torch.cuda.Event()
    ready.record()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    iterator = train_weight_sync.merge_free_named_tensors(model, SENT, ready=ready)
    sent = []

    def consume() -> None:  # in its own thread, as TRL's NCCL producer pulls the stream
        for k in itertools.count():
            with torch.cuda.stream(streams[k % 2]):
                item = next(iterator, None)
                if item is None:
                    break
                sent.append((item[0], item[1].clone()))

    consumer = threading.Thread(target=consume)
    consumer.start()
    consumer.join()
    torch.cuda.synchronize()
    assert [n for n, _ in sent] == [n for n, _ in stock]
    for (name, mine), (_, theirs) in zip(sent, stock, strict=True):
        assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16)), name
    assert_bit_identical(base, model)
