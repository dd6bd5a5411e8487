"""Real OpenCode rollouts through the real capture proxy, chained into training rows by TRL 1.15's own code.

Everything on the rollout path is the production code except the GPU engine: `serve_policy.sh` starts
tests/stubs/lfm2_vllm_double.py as its `VLLM` (vLLM's own request and tool-call code, the tiny LFM2 model, a
scripted policy), openenv 0.10.0's capture proxy registers a training session, the pinned OpenCode client runs
one task with the patched seam's provider block (a tool call, its result, a final message), and the proxy's
`TrainingTrace` goes through TRL's `_turns_from_training_trace` and `_chain_to_sequences` with the
`fork_threshold_tokens=0` that lossless capture sets. tests/test_chat_template.py and
benchmarks/fork_frac.py use it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from chain.sandbox import OFFLINE
from openenv.core.harness import TrainingTrace
from openenv.harbor import seams
from stubs.procs import free_ports, start, stop, wait_http
from tiny_lfm2 import save_tiny_model
from trl.experimental.async_grpo.async_rollout_worker import _chain_to_sequences
from trl.experimental.async_grpo.openenv_harness import _turns_from_training_trace

import recipe
import seam_patch

ROOT = Path(__file__).resolve().parents[1]
STUBS = Path(__file__).resolve().parent / "stubs"
_LOCAL_OPENCODE = ROOT / ".opencode" / "node_modules" / ".bin" / "opencode"
OPENCODE = os.environ.get("OPENCODE_BIN") or (str(_LOCAL_OPENCODE) if _LOCAL_OPENCODE.exists() else
                                              shutil.which("opencode"))
NO_OPENCODE = "the OpenCode CLI: `bash setup.sh` installs it under .opencode/; or set OPENCODE_BIN"
TASK = "How many rows does data.csv have?"
# What a trained LFM2.5 samples for the task, in the chat template's own format: a bash call, then the answer.
CANONICAL = ["<|tool_call_start|>[bash(command='wc -l data.csv', description='Count lines')]<|tool_call_end|>",
             "data.csv has 2 rows."]


def hub_template_stand_in() -> str:
    """The model repo's template as far as it is known here: the Hub cannot be reached, but the recipe says TRL
    does not recognize it and its lineage that it opens `<think>` in the generation prompt. TRL's LFM2.5 template
    with exactly that opening added."""
    from trl.chat_template_utils import lfm2_2_5_chat_template

    prompt = '{{- "<|im_start|>assistant\\n" -}}\n{%- endif -%}'
    assert lfm2_2_5_chat_template.count(prompt) == 1, "TRL's LFM2.5 template changed: update the stand-in"
    return lfm2_2_5_chat_template.replace(prompt, '{{- "<|im_start|>assistant\\n<think>" -}}\n{%- endif -%}')


def tiny_model_with_hub_template(path: Path) -> Path:
    """The tiny LFM2 model, its tokenizer carrying the stand-in for the model repo's own template."""
    from transformers import AutoTokenizer

    save_tiny_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = hub_template_stand_in()
    tokenizer.save_pretrained(path)
    return path


@dataclass
class Stack:
    policy_url: str
    capture_url: str
    log_dir: Path


@contextmanager
def rollout_stack(model_dir: Path, script: list[str], tmp: Path, *, pinned: bool = True) -> Iterator[Stack]:
    """serve_policy.sh (with the engine double as its vLLM) and the capture proxy in front of it, on loopback.

    `pinned=False` starts the engine double the way serve_policy.sh did before it pinned the template (the same
    argv without --chat-template: vLLM served the model folder's own template), for before/after measurements.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "script.json").write_text(json.dumps(script))
    policy_port, capture_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(PATH=f"{STUBS / 'bin'}:{env['PATH']}", PYTHON=sys.executable, REAL_PYTHON=sys.executable,
               LOG_DIR=str(tmp / "logs"), MODEL=str(model_dir), PORT=str(policy_port), GPU="1",
               VLLM=str(STUBS / "vllm_lfm2"), LFM2_DOUBLE_SCRIPT=str(tmp / "script.json"),
               LFM2_DOUBLE_LOG=str(tmp / "engine.jsonl"), OMP_NUM_THREADS="1")
    with open(tmp / "policy.log", "w") as policy_log, open(tmp / "capture.log", "w") as capture_log:
        command = ["bash", str(ROOT / "serve_policy.sh")] if pinned else [
            str(STUBS / "vllm_lfm2"), "serve", str(model_dir), "--served-model-name", recipe.SERVED_MODEL_NAME,
            "--port", str(policy_port), "--max-model-len", str(recipe.MAX_MODEL_LEN)]
        policy = start(command, env=env, log=policy_log)
        capture = None
        try:
            wait_http(f"http://127.0.0.1:{policy_port}/health", policy, timeout=300)
            capture = start([sys.executable, "-m", "openenv.core.harness.capture.server", "--llm-url",
                             f"http://127.0.0.1:{policy_port}", "--model", recipe.SERVED_MODEL_NAME, "--host",
                             "127.0.0.1", "--port", str(capture_port)], log=capture_log)
            wait_http(f"http://127.0.0.1:{capture_port}/health", capture, timeout=120)
            yield Stack(f"http://127.0.0.1:{policy_port}", f"http://127.0.0.1:{capture_port}", tmp / "logs")
        finally:
            if capture is not None:
                stop(capture)
            stop(policy)


def opencode_home(workdir: Path) -> Path:
    """The HOME (and XDG folders) `run_opencode` gives the OpenCode run in `workdir`: its own, beside it."""
    return workdir.parent / f"{workdir.name}-home"


def opencode_env(home: Path, config: Path) -> dict[str, str]:
    """An OpenCode run isolated from this machine's config and kept on loopback: its own HOME and XDG folders, its
    config file, the sandbox's OFFLINE switches."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".data"), "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".state"), "OPENCODE_CONFIG": str(config), **OFFLINE}


def run_opencode(stack: Stack, workdir: Path, instruction: str = TASK) -> TrainingTrace:
    """One OpenCode task through the proxy in a training session (the trainer's sampling); returns its trace.

    OpenCode runs as Harbor runs it (`run --format=json --dangerously-skip-permissions`), configured with the
    patched seam's provider block, isolated from this machine's config.
    """
    session = httpx.post(f"{stack.capture_url}/sessions", timeout=120,
                         json={"purpose": "train", "sampling": {"temperature": recipe.TEMPERATURE}})
    session.raise_for_status()
    session_id = session.json()["session_id"]
    unpatched = seams.SEAMS[seam_patch.HARNESS]
    try:  # the patched seam's provider block, without leaving the patch in this process
        seam_patch.apply()
        _model, kwargs, _env, _proc = seams.get(seam_patch.HARNESS).resolve(
            base_url=stack.capture_url, session=session_id, model=recipe.SERVED_MODEL_NAME)
    finally:
        seams.SEAMS[seam_patch.HARNESS] = unpatched
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "data.csv").write_text("a,b\n1,2\n3,4\n")
    home = opencode_home(workdir)
    home.mkdir(exist_ok=True)
    config = home / "opencode.json"
    config.write_text(json.dumps(kwargs["opencode_config"]))
    env = opencode_env(home, config)
    model = f"{seams.OPENCODE_PROVIDER}/{seams.agent_facing_model(recipe.SERVED_MODEL_NAME)}"
    done = subprocess.run([OPENCODE, f"--model={model}", "run", "--format=json", "--dangerously-skip-permissions",
                           "--", instruction], cwd=workdir, env=env, capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise RuntimeError(f"opencode exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    trace = httpx.get(f"{stack.capture_url}/sessions/{session_id}/trace_entries", timeout=60)
    trace.raise_for_status()
    return TrainingTrace.from_entries(trace.json()["entries"])


def chain(trace: TrainingTrace) -> tuple[list[Any], dict[str, float]]:
    """TRL 1.15's training rows for one rollout and its drift tally, as HarnessRolloutWorker builds them."""
    return _chain_to_sequences(_turns_from_training_trace(trace), "rollout", 0)


def first_divergence(trace: TrainingTrace, tokenizer: Any) -> str:
    """Where the first re-rendered prompt stops extending the previous prompt + completion, as text (for messages)."""
    held: list[int] = []
    for turn in trace.turns:
        prompt = list(turn.prompt_token_ids)
        if held:
            matched = next((i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b),
                           min(len(held), len(prompt)))
            if matched < len(held):
                return (f"sampled {tokenizer.decode(held[max(0, matched - 30):matched + 30])!r}, "
                        f"re-rendered {tokenizer.decode(prompt[max(0, matched - 30):matched + 30])!r}")
        held = prompt + list(turn.completion_token_ids)
    return "none"
