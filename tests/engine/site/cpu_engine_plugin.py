"""Test-only: what vLLM 0.31's own engine needs to serve the tiny LFM2 on a CPU, and the CPU stand-in for NCCL.

A vLLM general plugin (entry point `vllm.general_plugins` in the dist-info beside this file): vLLM calls `register()`
in each of its processes (API server, engine core, worker) before it builds the model, and only where this folder
is on PYTHONPATH, which only the suite's engine (tests/engine) puts there. A plugin, rather than a sitecustomize
rule, because it is vLLM's own extension point: it runs exactly in vLLM's processes and at vLLM's chosen moment.

1. `torch.cpu._is_avx512_bf16_supported()` answers False. On a CPU with AVX512-BF16, vLLM prepacks every short-conv
   weight with `causal_conv1d_weight_pack`, a kernel that takes width 4 only, and LFM2's conv width
   (`conv_L_cache`) is 3; answering False keeps vLLM on its generic CPU conv path at the model's real width. AMX
   answers False too: every AMX CPU has AVX512-BF16, and vLLM loads its AVX512 kernel library for a CPU without it,
   which lacks the AMX kernels vLLM would then call for small bf16 linear layers (seen on a Sapphire Rapids-class
   machine: `_C` has no `convert_weight_packed`).
2. NCCL weight transfer, on gloo. `transport()` replaces, in vLLM's `nccl_common` and `packed_tensor` modules, only
   what needs a GPU: the communicator (`stateless_init_process_group` builds a `GlooCommunicator` on vLLM's own
   `StatelessProcessGroup` rendezvous instead of a `PyNcclCommunicator`), the CUDA streams the packed broadcast
   double-buffers on, and `torch.accelerator`'s device index. Everything above stays vLLM's and TRL's own code:
   `NCCLWeightTransferEngine` behind `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
   `/finish_weight_update`, `trainer_init`, the packed producer and consumer (packing, unpacking, buffer
   boundaries) and the model's `load_weights` with the layerwise reload. The trainer's process applies the same
   `transport()` (tests/engine.cpu_transport), so TRL's `WeightTransferClient` drives both ends unchanged.
3. The engine core is forked, not spawned. vLLM's CPU platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` in its
   `check_and_update_config`; `fork_engine_core()` sets it back to vLLM's default, `fork`, which vLLM uses to start
   the engine core on a GPU. The spawned core imported vLLM again: a start took 23-25 CPU-s and 23-24 s to ready,
   forked 16.5-17 CPU-s and 16 s (benchmarks/LOG.md).
"""

from __future__ import annotations

import datetime
import os
import types
from typing import Any


class GlooCommunicator:
    """Stands in for vLLM's `PyNcclCommunicator` (same constructor, same `broadcast`), over a gloo group made on
    the rendezvous's own TCP store, bound to loopback."""

    def __init__(self, group: Any, device: Any = None, library_path: str | None = None) -> None:
        import torch.distributed as dist

        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=600)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("weight-transfer", group.store), group.rank,
                                          group.world_size, options)

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        self.gloo.broadcast(tensor, src).wait()


def gloo_init_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                            device: Any) -> GlooCommunicator:
    """`nccl_common.stateless_init_process_group`, with the gloo communicator in place of NCCL's."""
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    return GlooCommunicator(group, device)


class CpuStream:
    """A CUDA stream's part in the packed broadcast (`synchronize`); gloo's broadcast is already synchronous."""

    def synchronize(self) -> None:
        pass


def cpu_streams(device_index: int, num_buffers: int) -> tuple[CpuStream, ...]:
    return tuple(CpuStream() for _ in range(num_buffers))


def cpu_torch() -> types.ModuleType:
    """torch, whose `accelerator.current_device_index()` answers 0: the real one raises without a GPU driver."""
    import torch

    class CpuTorch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    module = CpuTorch("torch")
    module.accelerator = types.SimpleNamespace(current_device_index=lambda: 0)
    return module


def transport() -> None:
    """Put the gloo communicator, CPU streams and device index into vLLM's NCCL weight-transfer modules."""
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    nccl_common.stateless_init_process_group = gloo_init_process_group
    nccl_common.torch = packed_tensor.torch = cpu_torch()
    packed_tensor._get_streams = cpu_streams


def register() -> None:
    import torch

    torch.cpu._is_avx512_bf16_supported = torch.cpu._is_amx_tile_supported = lambda: False
    transport()
    fork_engine_core()


def fork_engine_core() -> None:
    """After vLLM's CPU platform has chosen `spawn` for the engine core, choose its default again: `fork`."""
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.check_and_update_config

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        configure(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
