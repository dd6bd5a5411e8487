"""Merge-free weight sync for TRL 1.15's AsyncGRPOTrainer: stream bf16(W + s·B·A) per tensor, never merge the base;
bit-identical to TRL's merge -> send fp32 -> unmerge as vLLM stores it, with half the NCCL bytes (docs/training.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
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

logger = get_logger(__name__)


def send_dtype() -> torch.dtype:
    """The dtype vLLM serves, and so the stream's."""
    return getattr(torch, recipe.SERVE_DTYPE)


def check_lora_config(peft_config: PeftConfig | None) -> None:
    """Refuse adapters whose merge is more than W += s·B·A (DoRA, LoRA bias), before the model is loaded."""
    for option in ("use_dora", "lora_bias"):
        if getattr(peft_config, option, False):
            raise recipe.ConfigError(f"merge-free weight sync does not support {option}: set WEIGHT_SYNC=stock")


def _full(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor on `device` (FSDP2 shards are gathered), detached from autograd."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
    return full.to(device) if device is not None and full.device != device else full


def lora_layers_by_weight(model: torch.nn.Module) -> dict[int, LoraLayer]:
    """Map id(base weight) -> the LoRA layer that wraps it, so the stream knows which tensors get a delta."""
    return {id(m.get_base_layer().weight): m for m in model.modules() if isinstance(m, LoraLayer)}


def merged_weight(layer: LoraLayer, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cast(W + Σ get_delta_weight) over the active adapters, bit-equal to PEFT's merge (which rounds each sum to W's
    dtype) then the cast: the last sum is rounded once, into `dtype`, where W is fp32 or already `dtype`."""
    if not isinstance(layer, LoraLinear):
        raise recipe.ConfigError(f"{type(layer).__name__} LoRA layers are not streamable merge-free: WEIGHT_SYNC=stock")
    adapters = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
    out = weight
    for i, adapter in enumerate(adapters):
        delta = _full(layer.get_delta_weight(adapter), weight.device)
        final = i == len(adapters) - 1 and weight.dtype in (torch.float32, dtype)
        target = torch.empty(weight.shape, dtype=dtype if final else weight.dtype, device=weight.device)
        out = torch.add(out, delta, out=target)
        del delta
    return out.to(dtype)


def merge_free_named_tensors(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | None = None,
                             ready: torch.cuda.Event | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (vLLM name, tensor in `dtype`) for every weight vLLM receives, merged on the fly, one at a time. Each is
    made on the consumer's current stream when asked for (TRL's NCCL producer pulls in its own thread under vLLM's
    streams), so the wait on `ready` (the trainer's last optimizer step) is queued per tensor."""
    layers = lora_layers_by_weight(model) if is_peft_model(model) else {}
    for name, param in _iter_vllm_named_params(model):
        weight, layer = _full(param, device), layers.get(id(param))
        if layer is None:
            yield name, weight.to(dtype)
            continue
        if ready is not None and weight.device.type == "cuda":
            torch.cuda.current_stream(weight.device).wait_event(ready)
        yield name, merged_weight(layer, weight, dtype)


def send_manifest(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, list[Any]]:
    """The receive manifest for the merge-free stream: TRL's names and shapes, every dtype set to `dtype`."""
    shapes = {name: list(param.shape) for name, param in _iter_vllm_named_params(model)}
    return {"names": list(shapes), "dtype_names": [str(dtype).removeprefix("torch.")] * len(shapes),
            "shapes": list(shapes.values())}


class MergeFreeAsyncGRPOTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer whose merged-weight sync streams W + s·B·A per tensor instead of merge/send/unmerge."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_lora_config(kwargs.get("peft_config"))
        super().__init__(*args, **kwargs)
        self.sync_dtype = send_dtype()
        self._retarget_manifest()

    def _retarget_manifest(self) -> None:
        """Rebuild TRL's NCCL client with a manifest in the sent dtype: vLLM sizes its receive buffers from it, and
        TRL built it from the fp32 params. An injected weight_transfer (tests, custom backends) keeps its own."""
        if type(self.weight_transfer) is WeightTransferClient:
            self.weight_transfer = WeightTransferClient(
                vllm_client=self.vllm_client, weight_sync_timeout=self.args.weight_sync_timeout,
                weight_update_info=send_manifest(self.accelerator.unwrap_model(self.model), self.sync_dtype))

    def _merge_free_iter(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream, with an event on this thread's stream: TRL's NCCL producer consumes it in another thread."""
        device = self.accelerator.device
        ready = torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None
        return merge_free_named_tensors(self.accelerator.unwrap_model(self.model), self.sync_dtype, device, ready)

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        """TRL's merged sync (pause, barrier, send, barrier, resume, version bump) minus the merge and unmerge."""
        if self.accelerator.is_main_process and self.weight_transfer:
            self.weight_transfer.pause()
        t_pause = time.time()
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        logger.info(f"Weight sync (merge-free): streaming weights... (barrier took {t_barrier - t_pause:.1f}s)")
        if self.accelerator.is_main_process and self.weight_transfer:
            self.weight_transfer.send_weights(self._merge_free_iter())
        else:
            for _ in self._merge_free_iter():  # other ranks still join an FSDP2 model's full_tensor() collectives
                pass
        t_transfer = time.time()
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if self.weight_transfer:
                self.weight_transfer.resume()
            self.model_version += 1
            if self.rollout_worker:
                self.rollout_worker.update_model_version(self.model_version)
        return t_pause, t_barrier, t_transfer


# The trainer class per WEIGHT_SYNC mode (recipe.WEIGHT_SYNC_MODES; the knob refuses any other): "stock" is TRL's own.
TRAINERS: dict[str, type[AsyncGRPOTrainer]] = {"merge_free": MergeFreeAsyncGRPOTrainer, "stock": AsyncGRPOTrainer}
