"""The rehearsal's sandbox + agent: a session factory shaped like OpenEnv's HarborSessionFactory.

Production: TRL's HarnessRolloutWorker asks a HarborSessionFactory for one session per rollout; the env server
registers it on the capture proxy, boots an HF Sandbox, OpenCode calls the model through the proxy with the
session id as `x-api-key`, the task's verifier grades the workspace, and the session hands back the proxy's
token-level training trace and the reward.

Here everything but the sandbox and the agent is real: each session is registered on the REAL OpenEnv capture
proxy (`POST /sessions` with the trainer's sampling policy, purpose "train"), a scripted two-call agent runs in a
temp dir and calls `/v1/chat/completions` through the proxy the way OpenCode does (streamed, tools attached,
session only in `x-api-key`, no `Authorization`), writes `answer.txt`, and a tiny verifier grades it. The trace
comes from the proxy's `/sessions/{id}/trace_entries`, exactly what it captured from vLLM.

The factory is rebuilt in TRL's spawned rollout process, so it holds plain data only (no clients).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, TrainingTrace, VerifyResult

import recipe

# Prompts are kept short: the tokenizer is byte-level and the server prefills every byte of them in bf16 on CPU.
SYSTEM_PROMPT = "Coding agent. Final answer goes in answer.txt."
WRITE_TOOL = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
# Output cap the scripted agent asks for: keeps a CPU rollout to a second or two (OpenCode asks for 32000).
AGENT_MAX_TOKENS = 6
# Rollout-level failures the rehearsal can inject (docs/training.md "Rollout failures"), each as it shows in production:
#   create            the env server refuses the session (create() raises)
#   sandbox           the sandbox never boots: no agent, no reward, exit code 1
#   opencode_install  OpenCode fails to install: no model call, the verifier grades an untouched workspace (0)
#   model_call        vLLM answers 400 (a prompt past its context) through the real proxy: nothing is captured
#   env_restart       the env server forgets the session mid-rollout (the proxy answers 401); the agent dies
#   capture           the rollout ran, but its capture is gone when the trainer asks (the proxy answers 404)
#   verifier          the verifier crashes and writes no reward
#   timeout           the agent makes one call, then outlives its timeout (TRL trains that turn, timed out)
FAULTS = ("create", "sandbox", "opencode_install", "model_call", "env_restart", "capture", "verifier", "timeout")


@functools.cache
def http() -> httpx.Client:
    """One HTTP client per process, shared by every session: building an httpx.Client loads the CA bundle (about
    50 ms of CPU), and a rollout made four of them, which cost a rehearsal about 20 s of CPU."""
    return httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


def instruction_id(instruction: str) -> str:
    """Task key from the instruction text, as HarborSessionFactory does (TRL forwards only the prompt)."""
    return hashlib.sha1(instruction.strip().encode()).hexdigest()


def make_tasks(count: int) -> list[dict[str, Any]]:
    """Tasks whose verifier a random model passes about half the time, so rewards vary within a group."""
    tasks = []
    for index in range(count):
        parity = ("even", "odd")[index % 2]
        tasks.append({"index": index, "task_name": f"rehearsal-{index:03d}", "parity": index % 2,
                      "instruction": f"Task {index}: reply with an {parity} digest."})
    return tasks


def passes(answer: bytes, task: dict[str, Any]) -> bool:
    """Whether the answer's SHA-1's first byte has the task's parity: half of all distinct answers, whatever the random
    model prefers. (Byte-length parity was not: on one machine the odd tasks' answers passed 25% of the time, so a
    group of 8 had no contrast in one run of 10.)"""
    return hashlib.sha1(answer).digest()[0] % 2 == task["parity"]


def grade(workdir: Path, task: dict[str, Any]) -> float:
    """The task's verifier: 1.0 when answer.txt exists and passes."""
    answer = workdir / "answer.txt"
    return 1.0 if answer.is_file() and passes(answer.read_bytes(), task) else 0.0


def chat_streamed(capture_url: str, session_id: str, messages: list[dict[str, Any]], timeout_s: float) -> str:
    """One model call as OpenCode makes it through the Jobs proxy: SSE, tools, key only in x-api-key."""
    body = {"model": "intercepted", "messages": messages, "tools": [WRITE_TOOL], "tool_choice": "auto",
            "max_tokens": AGENT_MAX_TOKENS, "stream": True}
    text = []
    with http().stream("POST", f"{capture_url}/v1/chat/completions", json=body, headers={"x-api-key": session_id},
                       timeout=timeout_s) as response:
        if response.status_code != 200:
            raise RuntimeError(f"capture proxy answered {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data:"):]).get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def run_agent(capture_url: str, session_id: str, instruction: str, workdir: Path, timeout_s: float,
              fault: str = "", drafted: threading.Event | None = None) -> None:
    """Two model calls (draft, then final answer) with a file write in between, like a minimal coding agent."""
    if fault == "model_call":  # a prompt past the served context: vLLM's 400, passed on by the proxy
        instruction += " x" * recipe.MAX_MODEL_LEN
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": instruction}]
    draft = chat_streamed(capture_url, session_id, messages, timeout_s)
    (workdir / "draft.txt").write_text(draft)
    if drafted is not None:
        drafted.set()
    if fault == "timeout":
        threading.Event().wait()  # the agent hangs after its first call (a daemon thread, left to the process)
    if fault == "env_restart":
        http().delete(f"{capture_url}/sessions/{session_id}", timeout=30)
    messages += [{"role": "assistant", "content": draft},
                 {"role": "user", "content": f"draft.txt saved ({len(draft.encode())} bytes). Final answer?"}]
    (workdir / "answer.txt").write_text(chat_streamed(capture_url, session_id, messages, timeout_s))


class ScriptedAgentSession(ResourceSession):
    """One rollout: a capture session, a temp workspace, the scripted agent, the verifier's reward."""

    def __init__(self, *, capture_url: str, session_id: str, task: dict[str, Any], timeout_s: float,
                 sandbox_root: str | None = None, fault: str = "") -> None:
        self.fault = fault
        self._drafted = threading.Event()
        self.capture_url = capture_url
        self.session_id = session_id
        self.task = task
        self.timeout_s = timeout_s
        self.workdir = Path(tempfile.mkdtemp(prefix="sandbox-", dir=sandbox_root))
        self.reward: float | None = None
        self.finished = False  # the agent ran to its end (whatever the verifier then says)
        self.closed = False
        self._ended = threading.Event()  # set when the agent finishes or the session is closed

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.task["instruction"]}]

    def list_tools(self) -> list[Tool]:
        return []  # the agent owns its loop, as OpenCode does in the sandbox

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(error="the scripted agent owns its own tool loop")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """Run the agent and grade the workspace: 0 when the agent finished, 1 if it failed or was closed.

        The agent runs on its own daemon thread so that close() (TRL closes live sessions when it stops)
        returns this call at once instead of waiting for the agent's in-flight model call.
        """
        if self.fault == "sandbox":
            return 1
        agent = threading.Thread(target=self._run_agent, daemon=True)
        agent.start()
        if self.fault == "timeout":
            self._drafted.wait(timeout_s or self.timeout_s)
            self.reward = grade(self.workdir, self.task)  # the verifier grades what the stopped agent left
            raise TimeoutError("agent did not finish within its timeout (injected)")
        if not self._ended.wait(timeout_s or self.timeout_s):
            raise TimeoutError(f"agent did not finish within {timeout_s or self.timeout_s:.0f} s")
        return 0 if self.finished else 1

    def _run_agent(self) -> None:
        try:
            if self.fault != "opencode_install":
                run_agent(self.capture_url, self.session_id, self.task["instruction"], self.workdir, self.timeout_s,
                          self.fault, self._drafted)
            if self.fault == "capture":
                http().delete(f"{self.capture_url}/sessions/{self.session_id}", timeout=30)
            self.finished = not self.closed
            if self.finished and self.fault != "verifier":
                self.reward = grade(self.workdir, self.task)
        except (httpx.HTTPError, RuntimeError, OSError):
            pass  # an agent that crashed leaves no answer: unscorable, like a failed sandbox
        finally:
            self._ended.set()

    def fetch_training_trace(self) -> TrainingTrace:
        """The proxy's validated capture of this rollout's agent calls (engine tokens, logprobs, masks).

        Empty once the session is closed (the trainer stopping mid-rollout): nothing captured survives.
        A refusal by the proxy (409: the capture breaks the training contract; 404: it lost the session) raises
        ValueError, which bare TRL turns into a CaptureContractError that stops training; train_rollouts makes
        it one unscorable rollout.
        """
        response = http().get(f"{self.capture_url}/sessions/{self.session_id}/trace_entries", timeout=60)
        if self.closed:
            return TrainingTrace(turns=[])
        if response.status_code != 200:
            raise ValueError(f"capture proxy refused the trace ({response.status_code}): {response.text[:300]}")
        return TrainingTrace.from_entries(response.json()["entries"])

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        return VerifyResult(env_reward=self.reward, done=True)

    def close(self) -> None:
        self.closed = True
        self._ended.set()
        http().delete(f"{self.capture_url}/sessions/{self.session_id}", timeout=30)
        shutil.rmtree(self.workdir, ignore_errors=True)


class ScriptedAgentSessionFactory(ResourceSessionFactory[ScriptedAgentSession]):
    """HarborSessionFactory's shape (`prompt_rows`, `create`) over local tasks and the real capture proxy."""

    def __init__(self, server_url: str, *, llm_url: str = "", model: str = "", num_tasks: int = 4,
                 agent_timeout_sec: float = 120.0, agent_step_limit: int = 0, sandbox_root: str | None = None,
                 sampling: dict[str, Any] | None = None, faults: tuple[str, ...] = ()) -> None:
        self.faults = faults  # the n-th session this factory creates gets faults[n], if any (see FAULTS)
        self._created = 0
        self._lock = threading.Lock()
        self.server_url = server_url.rstrip("/")  # the capture proxy stands in for the env server
        self.sandbox_root = sandbox_root  # where workspaces go (a killed run leaves them there, not in /tmp)
        self.llm_url = llm_url
        self.model = model
        self.agent_timeout_sec = agent_timeout_sec
        self.agent_step_limit = agent_step_limit
        self.sampling = sampling
        self._tasks = make_tasks(num_tasks)
        self._by_instruction = {instruction_id(t["instruction"]): t for t in self._tasks}

    def prompt_rows(self) -> list[dict[str, Any]]:
        return [{"prompt": [{"role": "user", "content": t["instruction"]}], "task_name": t["task_name"],
                 "task_index": t["index"]} for t in self._tasks]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> ScriptedAgentSession:
        instruction = task[-1]["content"] if isinstance(task, list) else str(task)
        found = self._by_instruction.get(instruction_id(instruction))
        if found is None:
            raise KeyError("this prompt does not match any task: build the dataset from prompt_rows()")
        with self._lock:
            fault = self.faults[self._created] if self._created < len(self.faults) else ""
            self._created += 1
        if fault == "create":
            raise httpx.ConnectError("env server refused the session (injected)")
        payload: dict[str, Any] = {"purpose": "train" if self.sampling else "auto",
                                   "max_model_calls": self.agent_step_limit}
        if self.sampling:
            payload["sampling"] = self.sampling
        if self.llm_url:
            payload.update(llm_url=self.llm_url, model=self.model)
        response = http().post(f"{self.server_url}/sessions", json=payload, timeout=120)
        response.raise_for_status()
        return ScriptedAgentSession(capture_url=self.server_url, session_id=response.json()["session_id"],
                                    task=found, timeout_s=self.agent_timeout_sec, sandbox_root=self.sandbox_root,
                                    fault=fault)
