"""Test-only shims that let TRL 1.15's real AsyncGRPOTrainer construct (and train) on a CPU-only machine.

Four things in TRL assume the GPU job: the rollout worker refuses to exist without vLLM installed, the
trainer hard-codes the `kernels-community/flash-attn3` attention kernel, the MFU probe asks the NVIDIA
driver for the device name, and the fused LM head's log-probs run in a Triton kernel (needed only once
training steps run). `cpu_trainer_shims()` patches exactly those four names, where TRL looks them up, for
the duration of a `with` block (or the `cpu_shims` fixture); nothing in production imports this.
A fifth patch only saves time: the rollout child's 15 s grace at stop (`fast_worker_stop`).

    from tests.trl_cpu_shims import cpu_trainer_shims, NullWeightTransfer

    with cpu_trainer_shims():
        trainer = train_lora.build_trainer(settings, factory=..., weight_transfer=NullWeightTransfer(), api=hub)

`NullWeightTransfer` stands in for the NCCL link to vLLM (TRL's `WeightTransferProtocol`); it records what
it was sent so a test can check the stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
from trl.trainer import utils as trl_utils

FLASH_ATTN3 = "kernels-community/flash-attn3"
CPU_ATTENTION = "sdpa"
# What the tests let the rollout child take to leave after the stop event, instead of TRL's 15 s: on CPU its
# in-flight rollouts (up to 32 on one policy server) rarely finish in 15 s, so every stop waited out the
# full grace before TRL terminated the child anyway.
STOP_GRACE_S = 1.0


class TorchLogProbs:
    """Plain-torch stand-in for TRL's Triton `ChunkedLogProbFunction` (same arguments, same five outputs)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0,
              outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        logits = (hidden @ weight.t() + (0 if bias is None else bias)).float() * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits / temperature
        log_p = torch.log_softmax(logits, dim=-1)
        log_probs = log_p.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            sq = torch.logsumexp(2 * log_p, dim=-1) if "log_sum_sq_probs" in outputs else None
            mean = logits.mean(-1) if "mean_logits" in outputs else None
            top1 = logits.argmax(-1) == targets if "is_top1" in outputs else None
        return log_probs, entropy, sq, mean, top1


def fast_worker_stop(self: AsyncRolloutWorker) -> None:
    """TRL's `AsyncRolloutWorker.stop` with a `STOP_GRACE_S` join in place of 15 s: same steps, same order."""
    if self._process is None:
        return
    self._stop_event_mp.set()
    if self._process._popen is not None:
        self._process.join(timeout=STOP_GRACE_S)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
    self._process = None


@contextlib.contextmanager
def cpu_trainer_shims() -> Iterator[None]:
    """Patch TRL's vLLM check, flash-attn3 kernel, peak-FLOPs probe and Triton log-probs so it runs on CPU (and
    its worker's stop grace, to save time)."""
    real_create = async_grpo_trainer.create_model_from_path

    def create_on_cpu(model_id, *args, **kwargs):
        if kwargs.get("attn_implementation") == FLASH_ATTN3:
            kwargs["attn_implementation"] = CPU_ATTENTION
        return real_create(model_id, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(async_rollout_worker, "is_vllm_available", lambda *a, **k: True)
        patch.setattr(async_grpo_trainer, "create_model_from_path", create_on_cpu)
        patch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None)
        patch.setattr(trl_utils, "_ChunkedLogProbFunction", TorchLogProbs)
        patch.setattr(AsyncRolloutWorker, "stop", fast_worker_stop)
        yield


@pytest.fixture
def cpu_shims() -> Iterator[None]:
    """`cpu_trainer_shims()` as a fixture: `def test_x(cpu_shims): ...`."""
    with cpu_trainer_shims():
        yield


class NullWeightTransfer:
    """A WeightTransferProtocol that sends nowhere but remembers each sync's tensors (names, shapes, dtypes)."""

    def __init__(self) -> None:
        self.syncs: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] = []
        self.paused = False
        self.destroyed = False

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        self.paused = True

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.syncs.append({name: (tuple(t.shape), t.dtype) for name, t in iterator})

    def resume(self) -> None:
        self.paused = False

    def destroy(self) -> None:
        self.destroyed = True
