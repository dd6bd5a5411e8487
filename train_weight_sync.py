"""Merge-free weight sync for TRL 1.15's AsyncGRPOTrainer: stream `cast(W + s·B·A)` per tensor, never merge.

TRL's merged sync (vLLM started without `--enable-lora`) does three passes over the frozen base every
optimizer step: `merge_adapter()` writes W += s·B·A into the base weights, the stream sends every weight in
the trainer's dtype, and `unmerge_adapter()` subtracts the delta again. The merge-free trainer instead builds,
one tensor at a time, exactly what vLLM must hold and sends that:

    cast(W + scaling·(B @ A))   for every LoRA-wrapped weight (PEFT's `get_delta_weight` arithmetic),
    cast(W)                     for every other weight,

under the same names and in the same order as TRL's `_iter_vllm_named_params`, and never writes the base.

Sent dtype: `recipe.SERVE_DTYPE` (bf16), not the trainer's fp32. vLLM serves bf16 and rounds whatever it
receives into its bf16 parameters with the same round-to-nearest-even as `Tensor.to`, so the served weights are
bit-identical either way, and sending bf16 halves the bytes on NCCL. The manifest vLLM sizes its receive buffers
from (`weight_update_info["dtype_names"]`) is therefore rebuilt to say bfloat16; see `send_manifest`.

On a GPU with Triton, a LoRA-wrapped weight is merged by one fused kernel (`merge_cast`): it reads W, computes
B @ A in registers and writes the sent copy, so the fp32 product never goes through memory (for LFM2-2.6B on
an H200, 6.2 ms of GPU time per sync vs 12.8 ms with cuBLAS's product; benchmarks/LOG.md). Its bits are not taken
on faith:
`FusedMerge` checks each tensor once against cuBLAS's path, on this GPU, and uses the kernel only where they match.

Extra memory is one tensor at a time: for a LoRA-wrapped weight its bf16 result (plus, on cuBLAS's path and in
the one-time check, an fp32 B@A temp: 6 bytes/element; the largest, an FFN weight of LFM2-2.6B, 22M elements =
132 MB), for a plain weight its bf16 copy (2 bytes/element; the tied 65536x2048 embedding, 268 MB), each freed
once the consumer moves on.

Usage, in train_lora.py:

    trainer = train_weight_sync.trainer_class(args.weight_sync)(model=..., peft_config=lora_config(), ...)

with `--weight-sync {merge_free,stock}` (env WEIGHT_SYNC); "stock" is TRL's own class, unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.logging import get_logger
from accelerate.utils import is_peft_model
from peft import PeftConfig
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch.distributed.tensor import DTensor
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, _iter_vllm_named_params
from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

import recipe

try:  # Triton ships with CUDA builds of torch; without it the stream keeps cuBLAS's product (same bits, slower)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

logger = get_logger(__name__)
# The same "train_weight_sync" logger without accelerate's main-process filter: each rank checks the kernel on its
# own GPU.
rank_logger = logging.getLogger(__name__)

SYNC_MODES = recipe.WEIGHT_SYNC_MODES


def send_dtype() -> torch.dtype:
    """The dtype vLLM serves, which is the dtype the merge-free stream sends."""
    return getattr(torch, recipe.SERVE_DTYPE)


def check_lora_config(peft_config: PeftConfig | None) -> None:
    """Refuse adapters whose merge is more than W += s·B·A (DoRA, LoRA bias), before the model is loaded."""
    if peft_config is None:
        return
    if getattr(peft_config, "use_dora", False):
        raise recipe.ConfigError("merge-free weight sync does not support DoRA: set WEIGHT_SYNC=stock")
    if getattr(peft_config, "lora_bias", False):
        raise recipe.ConfigError("merge-free weight sync does not support lora_bias: set WEIGHT_SYNC=stock")


def _full(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor on `device` (FSDP2 shards are gathered), detached from autograd."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
    return full.to(device) if device is not None and full.device != device else full


def _is_power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


def lora_layers_by_weight(model: torch.nn.Module) -> dict[int, LoraLayer]:
    """Map id(base weight) -> the LoRA layer that wraps it, so the stream knows which tensors get a delta."""
    return {id(m.get_base_layer().weight): m for m in model.modules() if isinstance(m, LoraLayer)}


def add_into(base: torch.Tensor, delta: torch.Tensor, alpha: float, out: torch.Tensor) -> torch.Tensor:
    """out <- base + alpha·delta, summed in the inputs' dtype (fp32) and rounded to out's dtype once, on the store.

    One pass: reads W and the B@A temp, writes the sent copy (10 bytes/element). A Triton kernel for the same
    step ran ~10% faster per kernel on the H200 but only 2-5% on the whole sync (benchmarks/LOG.md): not worth a
    kernel CI cannot run, so the benchmark keeps it as a variant.
    """
    return torch.add(base, delta, alpha=alpha, out=out)


AddInto = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor], torch.Tensor]


def cublas_merged(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, out: torch.Tensor,
    add: AddInto = add_into,
) -> torch.Tensor:
    """out <- cast(W + scaling·(B @ A)) with the matmul PEFT's get_delta_weight makes; `* s` rides in the add.

    Exact for a power-of-two scaling (see fast_merge): the reference the fused kernel is checked against.
    """
    return add(weight, torch.mm(lora_b, lora_a), scaling, out)


def merged_weight(layer: LoraLayer, weight: torch.Tensor, dtype: torch.dtype, add: AddInto = add_into) -> torch.Tensor:
    """Return cast(W + Σ get_delta_weight) over the active adapters, bit-equal to PEFT merge-then-cast.

    The general path (several adapters, a scaling that is not a power of two, non-fp32 adapters, FSDP2 shards):
    PEFT's own delta, added out of place. `W += delta` computes in the promoted dtype and rounds to W's dtype
    per adapter, so a sum that is not the last, or whose base is neither fp32 nor the sent dtype, is rounded
    to W's dtype first; the last one is rounded once, straight into the sent dtype.
    """
    if not isinstance(layer, LoraLinear):
        raise recipe.ConfigError(f"{type(layer).__name__} LoRA layers are not streamable merge-free: WEIGHT_SYNC=stock")
    if layer.merged:
        raise RuntimeError("LoRA layer is already merged: merge-free sync expects unmerged weights")
    adapters = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
    out = weight
    for i, adapter in enumerate(adapters):
        if adapter in layer.lora_variant or layer.lora_bias.get(adapter, False):
            raise recipe.ConfigError(f"adapter {adapter!r} is DoRA/biased: merge-free sync cannot stream it")
        delta = _full(layer.get_delta_weight(adapter), weight.device)
        final = i == len(adapters) - 1 and weight.dtype in (torch.float32, dtype)
        target = torch.empty(weight.shape, dtype=dtype if final else weight.dtype, device=weight.device)
        out = add(out, delta, 1.0, target) if final else torch.add(out, delta, out=target)
        del delta
    return out.to(dtype)


if triton is not None:

    @triton.jit
    def _merge_cast_kernel(  # noqa: ANN202
        w_ptr, b_ptr, a_ptr, out_ptr, rows, cols, scaling,  # noqa: ANN001
        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: ANN001
    ):
        """One tile of out = cast(W + scaling·(B @ A)): B @ A in fp32 FMAs (no TF32), never written to memory."""
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, RANK)
        b = tl.load(b_ptr + r[:, None] * RANK + k[None, :], mask=r[:, None] < rows, other=0.0)
        a = tl.load(a_ptr + k[:, None] * cols + c[None, :], mask=c[None, :] < cols, other=0.0)
        product = tl.dot(b, a, input_precision="ieee")
        offsets = r[:, None].to(tl.int64) * cols + c[None, :]
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        total = tl.load(w_ptr + offsets, mask=mask, other=0.0) + product * scaling
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


# 64x64 tiles, 4 warps: the fastest of six tile shapes tried on the H200 for every LFM2-2.6B weight shape.
MERGE_CAST_TILE = (64, 64, 4)


def merge_cast(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, out: torch.Tensor
) -> torch.Tensor:
    """out <- cast(W + scaling·(B @ A)) in one pass: reads W (4 B/element), writes out (2 B/element)."""
    if weight.is_cuda and weight.device.index != torch.cuda.current_device():
        # Triton launches on the thread's current device; TRL's NCCL producer thread may not be on W's.
        with torch.cuda.device(weight.device):
            return merge_cast(weight, lora_a, lora_b, scaling, out)
    block_m, block_n, warps = MERGE_CAST_TILE
    rows, cols = weight.shape
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _merge_cast_kernel[grid](
        weight, lora_b, lora_a, out, rows, cols, scaling,
        RANK=lora_a.shape[0], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return out


def fits_merge_cast(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `merge_cast` takes these tensors: contiguous fp32 inputs, a 16-bit output, a rank of 16..128, 2^k."""
    rank = lora_a.shape[0]
    return (
        all(t.dtype == torch.float32 and t.is_contiguous() for t in (weight, lora_a, lora_b))
        and out.dtype in (torch.bfloat16, torch.float16)
        and out.is_contiguous()
        and 16 <= rank <= 128
        and rank & (rank - 1) == 0
    )


def same_bits(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal calls -0.0 == 0.0; vLLM would hold different bits)."""
    return first.shape == second.shape and torch.equal(first.view(torch.int16), second.view(torch.int16))


MergeCast = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor], torch.Tensor]


class FusedMerge:
    """The fused merge-cast, trusted per tensor only once it matched cuBLAS's path bit for bit on this GPU.

    PEFT's merge takes cuBLAS's fp32 B @ A. On the H200 Triton's fp32 `tl.dot` gave the same bits for every
    LFM2-2.6B shape (both behave as one FMA per rank, in rank order), but nothing guarantees that on another GPU
    or library version. So the first sync that finds a tensor's B nonzero computes both, sends cuBLAS's, and
    keeps the kernel for that tensor only if the bits matched. A kernel that fails to compile or launch turns
    the fused path off; the sync goes on with cuBLAS.
    """

    def __init__(self, kernel: MergeCast = merge_cast) -> None:
        self.kernel = kernel
        self.trusted: dict[str, bool] = {}
        self.broken = False
        self.used = 0  # tensors the kernel has merged and sent so far (the one-time checks not counted)

    def merged(
        self, name: str, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
        out: torch.Tensor, add: AddInto = add_into,
    ) -> torch.Tensor:
        """cast(W + scaling·(B @ A)) into `out`: by the kernel once trusted for `name`, else by cuBLAS + `add`."""
        if self.trusted.get(name) and not self.broken:
            self.used += 1
            return self.kernel(weight, lora_a, lora_b, scaling, out)
        result = cublas_merged(weight, lora_a, lora_b, scaling, out, add)
        if name not in self.trusted and not self.broken and fits_merge_cast(weight, lora_a, lora_b, out):
            if bool(lora_b.any()):  # while B = 0 both give cast(W): nothing would be checked
                self.trusted[name] = self._matches(name, weight, lora_a, lora_b, scaling, result)
        return result

    def _matches(
        self, name: str, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
        expected: torch.Tensor,
    ) -> bool:
        try:
            candidate = self.kernel(weight, lora_a, lora_b, scaling, torch.empty_like(expected))
        except Exception as error:  # any kernel failure must leave the sync on cuBLAS, not crash the run
            self.broken = True
            rank_logger.warning(f"Weight sync: fused merge kernel failed ({error!r}); staying on cuBLAS's path")
            return False
        if same_bits(candidate, expected):
            return True
        first_mismatch = all(self.trusted.values())
        if first_mismatch:
            rank_logger.warning(f"Weight sync: fused merge differs from cuBLAS on {name}; such tensors use cuBLAS")
        return False

    def summary(self) -> str:
        """How many checked tensors run on the kernel, for the log."""
        trusted = sum(self.trusted.values())
        state = "off (kernel failed)" if self.broken else f"{trusted}/{len(self.trusted)} checked tensors fused"
        return f"fused merge: {state}"


def fused_merge_for(device: torch.device) -> FusedMerge | None:
    """A FusedMerge on a CUDA device with Triton installed, else None (cuBLAS's path everywhere)."""
    return FusedMerge() if device.type == "cuda" and triton is not None else None


@dataclass(frozen=True)
class PlanEntry:
    """One streamed tensor: its vLLM name, the base parameter, and how to merge it."""

    name: str
    param: torch.Tensor
    layer: LoraLayer | None = None
    # (lora_A, lora_B, scaling) when the whole merge is one fp32 B @ A with a power-of-two scaling.
    fast: tuple[torch.Tensor, torch.Tensor, float] | None = None


def fast_merge(layer: LoraLayer, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) if this layer's merge is exactly `W + s·(B @ A)` in fp32 with s a power of two, else None.

    PEFT computes `(B @ A) * s`. For s = 2^k the product scales exactly, so `s` can ride in the add's alpha
    (even as a fused multiply-add) and the `* s` pass, a full read and write of an fp32 temp, is skipped.
    """
    if not isinstance(layer, LoraLinear) or layer.fan_in_fan_out:
        return None
    adapters = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
    if len(adapters) != 1 or adapters[0] in layer.lora_variant or layer.lora_bias.get(adapters[0], False):
        return None
    adapter = adapters[0]
    lora_a, lora_b, scaling = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter]
    tensors = (param, lora_a, lora_b)
    if any(isinstance(t, DTensor) or t.dtype != torch.float32 for t in tensors) or not _is_power_of_two(scaling):
        return None
    return lora_a, lora_b, scaling


def sync_plan(model: torch.nn.Module) -> list[PlanEntry]:
    """Every tensor vLLM receives, in TRL's stream order, with its merge resolved.

    Names, parameters and the active adapter are fixed for the life of training (TRL captures the adapter at
    init), and walking ~1,500 named parameters with TRL's name clean-up costs ~9 ms of CPU on LFM2-2.6B, so
    the trainer builds this once. Per sync only the tensors' current values are read.
    """
    layers = lora_layers_by_weight(model) if is_peft_model(model) else {}
    plan = []
    for name, param in _iter_vllm_named_params(model):
        layer = layers.get(id(param))
        plan.append(PlanEntry(name, param, layer, fast_merge(layer, param) if layer is not None else None))
    return plan


def _after(ready: torch.cuda.Event | None, device: torch.device) -> None:
    """Queue the current stream's next adapter reads after `ready`, an event on the trainer's stream.

    TRL's NCCL producer pulls this stream in its own thread, under a non-blocking stream of vLLM's that is not
    ordered after the optimizer step queued on the trainer's stream; it switches streams between its buffers, so
    the wait is queued per tensor, on the stream current at the time.
    """
    if ready is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(ready)


def merge_free_named_tensors(
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device | None = None,
    plan: list[PlanEntry] | None = None,
    add: AddInto = add_into,
    ready: torch.cuda.Event | None = None,
    fused: FusedMerge | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (vLLM name, tensor in `dtype`) for every weight vLLM receives, merged on the fly, one at a time.

    Each tensor is made on the consumer's current stream at the time it asks for it, so it is complete for the
    consumer in stream order; `ready` orders the adapter reads after the trainer's last optimizer step. With
    `fused`, one-matmul merges go through its checked kernel; without, through cuBLAS's B @ A and `add`.
    """
    for entry in plan if plan is not None else sync_plan(model):
        weight = _full(entry.param, device)
        if entry.fast is not None and not entry.layer.merged:
            lora_a, lora_b, scaling = entry.fast
            lora_a, lora_b = lora_a.detach().to(weight.device), lora_b.detach().to(weight.device)
            _after(ready, weight.device)
            out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
            if fused is not None:
                yield entry.name, fused.merged(entry.name, weight, lora_a, lora_b, scaling, out, add)
            else:
                yield entry.name, cublas_merged(weight, lora_a, lora_b, scaling, out, add)
            del out
        elif entry.layer is not None:
            _after(ready, weight.device)
            yield entry.name, merged_weight(entry.layer, weight, dtype, add)
        else:
            yield entry.name, weight.to(dtype)


def send_manifest(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, list[Any]]:
    """The receive manifest for the merge-free stream: TRL's names and shapes, every dtype set to `dtype`."""
    names, shapes = [], []
    for name, param in _iter_vllm_named_params(model):
        names.append(name)
        shapes.append(list(param.shape))
    return {"names": names, "dtype_names": [str(dtype).removeprefix("torch.")] * len(names), "shapes": shapes}


class MergeFreeAsyncGRPOTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer whose merged-weight sync streams W + s·B·A per tensor instead of merge/send/unmerge."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_lora_config(kwargs.get("peft_config"))
        super().__init__(*args, **kwargs)
        self.sync_dtype = send_dtype()
        self._sync_plan: list[PlanEntry] | None = None
        self._fused = fused_merge_for(self.accelerator.device)
        self._retarget_manifest()

    def _retarget_manifest(self) -> None:
        """Rebuild TRL's NCCL client with a manifest in the sent dtype (TRL built it from the fp32 params).

        vLLM sizes its receive buffers from the manifest, so it must describe the bf16 stream. An injected
        weight_transfer (tests, custom backends) owns its own manifest and is left alone.
        """
        if type(self.weight_transfer) is WeightTransferClient:
            self.weight_transfer = WeightTransferClient(
                vllm_client=self.vllm_client,
                weight_update_info=send_manifest(self.accelerator.unwrap_model(self.model), self.sync_dtype),
                weight_sync_timeout=self.args.weight_sync_timeout,
            )

    def _merge_free_iter(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream, with an event on this thread's stream: TRL's NCCL producer consumes it in another thread."""
        model = self.accelerator.unwrap_model(self.model)
        if self._sync_plan is None:
            self._sync_plan = sync_plan(model)
        device = self.accelerator.device
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return merge_free_named_tensors(model, self.sync_dtype, device, self._sync_plan, ready=ready, fused=self._fused)

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        """TRL's merged sync (pause, barrier, send, barrier, resume, version bump) minus the merge and unmerge."""
        if self.accelerator.is_main_process and self.weight_transfer:
            self.weight_transfer.pause()
        t_pause = time.time()
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        logger.info(f"Weight sync (merge-free): streaming weights... (barrier took {t_barrier - t_pause:.1f}s)")
        checked = len(self._fused.trusted) if self._fused is not None else 0
        used = self._fused.used if self._fused is not None else 0
        if self.accelerator.is_main_process and self.weight_transfer:
            self.weight_transfer.send_weights(self._merge_free_iter())
        else:
            # Other ranks still join the per-tensor full_tensor() collectives of an FSDP2 model.
            for _ in self._merge_free_iter():
                pass
        t_transfer = time.time()
        if self._fused is not None and len(self._fused.trusted) != checked:
            logger.info(f"Weight sync (merge-free): {self._fused.summary()}")
        # Next to TRL's perf/weight_sync_s: tensors this sync sent through the checked fused kernel (0: cuBLAS's path).
        fused = self._fused.used - used if self._fused is not None else 0
        self._metrics["train"]["perf/weight_sync_fused_tensors"].append(float(fused))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if self.weight_transfer:
                self.weight_transfer.resume()
            self.model_version += 1
            if self.rollout_worker:
                self.rollout_worker.update_model_version(self.model_version)
        return t_pause, t_barrier, t_transfer


def trainer_class(mode: str) -> type[AsyncGRPOTrainer]:
    """The trainer class for a weight-sync mode: "merge_free" (default) or "stock" (TRL's own, unchanged)."""
    if mode == "stock":
        return AsyncGRPOTrainer
    if mode == "merge_free":
        return MergeFreeAsyncGRPOTrainer
    raise recipe.ConfigError(f"unknown weight-sync mode {mode!r}: use one of {', '.join(SYNC_MODES)}")
