"""Merge-free weight sync against TRL 1.15's own merge -> stream -> unmerge, on a tiny Lfm2 with real PEFT.

Only vLLM's end of the NCCL transfer cannot exist here: `RecordingTransfer` stands in for it and records what
TRL's `WeightTransferClient` would have been handed. Both sync paths are TRL's/our real methods, driven on a
trainer object that carries just the attributes the sync reads (building the whole trainer needs a vLLM server).
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import sys
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
    trainer._sync_plan = None
    trainer._fused = None  # what MergeFreeAsyncGRPOTrainer picks on a CPU device
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
        (torch.float32, None),  # the recipe: fp32 base, scaling 64/32 = 2 (one addmm per tensor)
        (torch.float32, 48),  # scaling 1.5: PEFT's get_delta_weight path
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
    assert train_weight_sync.trainer_class("stock") is AsyncGRPOTrainer
    assert issubclass(train_weight_sync.trainer_class("merge_free"), AsyncGRPOTrainer)
    with pytest.raises(recipe.ConfigError, match="unknown weight-sync mode 'merged'.*merge_free, stock"):
        train_weight_sync.trainer_class("merged")


def test_dora_and_lora_bias_refused_before_loading():
    config = lora_config()
    train_weight_sync.check_lora_config(config)
    config.use_dora = True
    with pytest.raises(recipe.ConfigError, match="DoRA.*WEIGHT_SYNC=stock"):
        train_weight_sync.check_lora_config(config)
    config = lora_config()
    config.lora_bias = True
    with pytest.raises(recipe.ConfigError, match="lora_bias"):
        train_weight_sync.check_lora_config(config)


def test_plan_takes_the_one_matmul_path_exactly_for_the_recipe_adapter():
    """The bit-exactness test above covers both merge paths only if the plan really splits them like this."""
    recipe_plan = train_weight_sync.sync_plan(peft_lfm2())
    wrapped = [e for e in recipe_plan if e.layer is not None]
    assert wrapped and all(e.fast is not None and e.fast[2] == 2.0 for e in wrapped)  # alpha 64 / r 32
    assert [e.name for e in recipe_plan] == [n for n, _ in _iter_vllm_named_params(peft_lfm2())]
    assert all(e.fast is None for e in train_weight_sync.sync_plan(peft_lfm2(lora_alpha=48)) if e.layer is not None)
    assert all(e.fast is None for e in train_weight_sync.sync_plan(peft_lfm2(torch.bfloat16)) if e.layer is not None)


def test_merge_free_refuses_an_already_merged_model():
    model = peft_lfm2()
    model.merge_adapter()
    with pytest.raises(RuntimeError, match="already merged"):
        list(train_weight_sync.merge_free_named_tensors(model, SENT))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: run on a GPU (benchmarks/LOG.md)")
def test_gpu_stream_is_bit_exact_for_a_consumer_that_switches_streams():
    """Each tensor is complete on whatever stream the consumer pulls it under, as vLLM's NCCL producer does.

    That producer calls `next` in its own thread under one of its own two streams, switching between its
    buffers; this consumer does the same at every tensor and reads each one (a clone, as its torch.cat would) on
    that stream. The LoRA tensors come from the fused kernel, checked first.
    """
    model = peft_lfm2().cuda()
    stock = stock_stream(model)
    base = snapshot(model)
    ready = torch.cuda.Event()
    ready.record()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    fused = train_weight_sync.fused_merge_for(torch.device("cuda"))
    list(train_weight_sync.merge_free_named_tensors(model, SENT, fused=fused))  # the one-time check
    assert fused.trusted and all(fused.trusted.values())  # so the consumer below gets the kernel's tensors
    iterator = train_weight_sync.merge_free_named_tensors(model, SENT, ready=ready, fused=fused)
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


# --- The fused merge-cast and its bit check -------------------------------------------------------------------------


class KernelDouble:
    """Stands in for the GPU-only Triton kernel on CPU: PEFT's arithmetic, counted, optionally wrong or broken."""

    def __init__(self, wrong_for: str | None = None, fail: bool = False) -> None:
        self.calls = 0
        self.wrong_for = wrong_for
        self.fail = fail
        self.current: str | None = None

    def __call__(self, weight, lora_a, lora_b, scaling, out):
        self.calls += 1
        if self.fail:
            raise RuntimeError("triton compile failed")
        torch.add(weight, lora_b @ lora_a, alpha=scaling, out=out)
        if self.wrong_for is not None and self.current == self.wrong_for:
            out.view(torch.int16)[0, 0] += 1  # one ulp off in one element
        return out


class CountingAdd:
    """train_weight_sync.add_into, counted: how many tensors took cuBLAS's path."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, base, delta, alpha, out):
        self.calls += 1
        return train_weight_sync.add_into(base, delta, alpha, out)


def stock_stream(model) -> list[tuple[str, torch.Tensor]]:
    model.merge_adapter()
    try:
        return [(n, p.detach().to(SENT)) for n, p in _iter_vllm_named_params(model)]
    finally:
        model.unmerge_adapter()


def fused_stream(model, fused, add) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) for n, t in train_weight_sync.merge_free_named_tensors(model, SENT, fused=fused, add=add)]


def named_fused_stream(model, fused, add, kernel: KernelDouble) -> list[tuple[str, torch.Tensor]]:
    """Like fused_stream, but tells the kernel double which tensor it is computing."""
    plan = train_weight_sync.sync_plan(model)
    sent = []
    iterator = train_weight_sync.merge_free_named_tensors(model, SENT, plan=plan, fused=fused, add=add)
    for entry in plan:
        kernel.current = entry.name
        name, tensor = next(iterator)
        assert name == entry.name
        sent.append((name, tensor.clone()))
    assert next(iterator, None) is None
    return sent


def assert_same_stream(mine, theirs) -> None:
    assert [n for n, _ in mine] == [n for n, _ in theirs]
    for (name, a), (_, b) in zip(mine, theirs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def zero_lora_b(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.zero_()


def test_fused_kernel_is_used_only_after_matching_cublas_with_a_nonzero_b():
    model = peft_lfm2()
    trained_b = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    wrapped = [e.name for e in train_weight_sync.sync_plan(model) if e.fast is not None]
    kernel, add = KernelDouble(), CountingAdd()
    fused = train_weight_sync.FusedMerge(kernel)

    zero_lora_b(model)  # as PEFT initialises it: every merge is a no-op, so nothing can be checked yet
    assert_same_stream(fused_stream(model, fused, add), stock_stream(model))
    assert (kernel.calls, add.calls, fused.trusted) == (0, len(wrapped), {})

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in trained_b:
                param.copy_(trained_b[name])
    checked = fused_stream(model, fused, add)  # the check: both paths run, cuBLAS's bits are sent
    assert (kernel.calls, add.calls) == (len(wrapped), 2 * len(wrapped))
    assert fused.trusted == dict.fromkeys(wrapped, True)
    assert_same_stream(checked, stock_stream(model))

    trusted = fused_stream(model, fused, add)  # trusted: the kernel alone, cuBLAS's path not taken
    assert (kernel.calls, add.calls) == (2 * len(wrapped), 2 * len(wrapped))
    assert_same_stream(trusted, stock_stream(model))
    assert fused.summary() == f"fused merge: {len(wrapped)}/{len(wrapped)} checked tensors fused"


def test_trainer_sync_checks_then_uses_the_fused_kernel_and_logs_it(caplog):
    """MergeFreeAsyncGRPOTrainer's own sync with a FusedMerge: bit-exact every time, one log line when checked."""
    model = peft_lfm2()
    stock = trainer_for(AsyncGRPOTrainer, model)
    stock._sync_weight()
    free = trainer_for(train_weight_sync.MergeFreeAsyncGRPOTrainer, model)
    kernel = KernelDouble()
    free._fused = train_weight_sync.FusedMerge(kernel)
    wrapped = sum(e.fast is not None for e in train_weight_sync.sync_plan(model))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            free._sync_weight()
    assert kernel.calls == 3 * wrapped  # checked in the first sync, then the only path
    # The first sync checks (and sends cuBLAS's bits), the next two send the kernel's: logged per sync.
    assert free._metrics["train"]["perf/weight_sync_fused_tensors"] == [0.0, float(wrapped), float(wrapped)]
    summaries = [r.getMessage() for r in caplog.records if "checked tensors fused" in r.getMessage()]
    assert [m.removeprefix("[RANK 0] ") for m in summaries] == [
        f"Weight sync (merge-free): fused merge: {wrapped}/{wrapped} checked tensors fused"
    ]
    sent = free.weight_transfer.sent
    assert len(sent) == 3 * len(stock.weight_transfer.sent)
    for k in range(3):
        assert_same_stream(sent[k * len(sent) // 3 : (k + 1) * len(sent) // 3], stock.weight_transfer.sent)


def test_fused_kernel_that_differs_by_one_ulp_is_never_sent(caplog):
    model = peft_lfm2()
    wrapped = [e.name for e in train_weight_sync.sync_plan(model) if e.fast is not None]
    odd = wrapped[3]
    kernel = KernelDouble(wrong_for=odd)
    fused = train_weight_sync.FusedMerge(kernel)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert_same_stream(named_fused_stream(model, fused, CountingAdd(), kernel), stock_stream(model))
    assert fused.trusted[odd] is False
    assert all(fused.trusted[name] for name in wrapped if name != odd)
    assert kernel.calls == len(wrapped) + 2 * (len(wrapped) - 1)  # the odd one is never asked again
    assert [r.getMessage() for r in caplog.records if "differs" in r.getMessage()] == [
        f"Weight sync: fused merge differs from cuBLAS on {odd}; such tensors use cuBLAS"
    ]


def test_fused_kernel_failure_leaves_the_sync_on_cublas(caplog):
    model = peft_lfm2()
    kernel, add = KernelDouble(fail=True), CountingAdd()
    fused = train_weight_sync.FusedMerge(kernel)
    with caplog.at_level(logging.WARNING):
        assert_same_stream(fused_stream(model, fused, add), stock_stream(model))
        assert_same_stream(fused_stream(model, fused, add), stock_stream(model))
    assert kernel.calls == 1 and fused.broken
    assert fused.summary() == "fused merge: off (kernel failed)"
    assert any("fused merge kernel failed" in r.getMessage() for r in caplog.records)


def test_fused_kernel_takes_only_what_it_was_checked_for():
    weight, lora_a, lora_b = torch.zeros(64, 48), torch.zeros(32, 48), torch.zeros(64, 32)
    out = torch.empty(64, 48, dtype=torch.bfloat16)
    assert train_weight_sync.fits_merge_cast(weight, lora_a, lora_b, out)
    assert not train_weight_sync.fits_merge_cast(weight, torch.zeros(8, 48), torch.zeros(64, 8), out)  # rank < 16
    assert not train_weight_sync.fits_merge_cast(weight, torch.zeros(24, 48), torch.zeros(64, 24), out)  # not 2^k
    assert not train_weight_sync.fits_merge_cast(weight.bfloat16(), lora_a, lora_b, out)
    assert not train_weight_sync.fits_merge_cast(weight.t(), lora_a.t().contiguous().t(), lora_b, out.t())
    assert not train_weight_sync.fits_merge_cast(weight, lora_a, lora_b, torch.empty(64, 48))  # fp32 out: not a cast
    assert train_weight_sync.fused_merge_for(torch.device("cpu")) is None


def interpreted_weight_sync(monkeypatch) -> object:
    """A second copy of weight_sync whose kernel Triton's interpreter runs: `triton.jit` reads TRITON_INTERPRET
    when the module defines the kernel, and the copy reuses this process's imports (a fresh one costs 15 s)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("weight_sync_interpreted", train_weight_sync.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(train_weight_sync.triton is None, reason="Triton is not installed")
def test_real_kernel_in_the_triton_interpreter_merges_every_element(monkeypatch):
    """The real `merge_cast` on CPU through Triton's interpreter: tiles, masks, tails and strides.

    The interpreter rounds to bf16 by truncation and sums with numpy, so this checks the indexing to bf16
    precision (an element from the wrong row, column or rank is off by O(1)); bit-equality with cuBLAS is the
    GPU test below and FusedMerge's check at run time.
    """
    interpreted = interpreted_weight_sync(monkeypatch)
    assert type(interpreted._merge_cast_kernel).__name__ == "InterpretedFunction"
    gen = torch.Generator().manual_seed(0)
    for rows, cols, rank in [(100, 70, 16), (130, 200, 32), (64, 64, 32), (1, 65, 64)]:
        w = torch.randn(rows, cols, generator=gen)
        a = torch.randn(rank, cols, generator=gen) / cols**0.5
        b = torch.randn(rows, rank, generator=gen)
        out = interpreted.merge_cast(w, a, b, 2.0, torch.full((rows, cols), float("nan"), dtype=torch.bfloat16))
        expected = w + 2.0 * (b @ a)
        error = (out.float() - expected).abs() / expected.abs().clamp_min(1e-3)
        # within one bf16 ulp: every element, no NaN left unwritten
        assert float(error.nan_to_num(nan=float("inf")).max()) < 2**-7, (rows, cols, rank)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernel: run on a GPU (benchmarks/LOG.md)")
def test_gpu_fused_kernel_equals_cublas_and_stock_bit_for_bit():
    model = peft_lfm2().cuda()
    stock = stock_stream(model)
    fused = train_weight_sync.fused_merge_for(torch.device("cuda"))
    add = CountingAdd()
    for _ in range(2):  # first: the check (cuBLAS's bits sent); then: the kernel's own bits
        assert_same_stream(fused_stream(model, fused, add), stock)
    wrapped = [e.name for e in train_weight_sync.sync_plan(model) if e.fast is not None]
    assert fused.trusted == dict.fromkeys(wrapped, True) and not fused.broken
    assert add.calls == len(wrapped)  # the second sync never touched cuBLAS's path
