"""A picklable stand-in for OpenEnv's HarborSessionFactory (no env server, sandbox or vLLM here).

`functools.partial(FakeSessionFactory, "http://env", tasks=...)` has the shape train_lora's
`session_factory()` returns: the parent calls it with no arguments for `prompt_rows()`, TRL's rollout
child calls it again with `sampling=` and opens one session per rollout. Each session satisfies
openenv's `TrainableSession` protocol and returns a validated `TrainingTrace` of one agent turn, so the
real HarnessRolloutWorker turns it into training samples exactly as it would a Harbor rollout.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from openenv.core.harness import VerifyResult
from openenv.core.harness.capture.upstream import training_sampling
from openenv.core.harness.training import TrainingTrace, TrainingTurn

import recipe

TASKS = ("Count the rows of train.csv.", "What is the mean of column x?", "Name the most common label.")
# Token ids inside the tiny test tokenizer's vocabulary (tests/tiny_lfm2.py).
PROMPT_IDS = (1, 3, 40, 41, 42, 43, 2)
COMPLETION_IDS = (50, 51, 52, 53, 2)


def write_task_list(folder: Path, names: list[str], split: str = "train") -> str:
    """`folder/<split>.json` listing `names` in that order, in prepare_tasks' row format; returns the folder (for
    TASK_DATA): the trainer serves the fake's tasks in the list's order and refuses tasks the list does not name."""
    rows = [{"name": name, "source": f"{name}.ipynb_qa_1", "notebook": f"{name}.ipynb", "difficulty": "medium",
             "instruction_sha256": hashlib.sha256(name.encode()).hexdigest()} for name in names]
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{split}.json").write_text(json.dumps(rows))
    return str(folder)


def fake_task_list(folder: Path, tasks: tuple[str, ...] = TASKS) -> str:
    """The list of FakeSessionFactory(tasks=...)'s task names, in its serving order."""
    return write_task_list(folder, [f"task-{i}" for i in range(len(tasks))])


class FakeSession:
    """One rollout: the agent 'ran', made `tool_calls` tool calls and was graded `env_reward`."""

    def __init__(self, instruction: str, sampling: dict[str, Any], env_reward: float | None, tool_calls: int,
                 over_budget: bool = False) -> None:
        self.instruction, self.sampling = instruction, sampling
        self.env_reward, self.tool_calls = env_reward, tool_calls
        self.over_budget = over_budget
        self.closed = threading.Event()

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        # Past the factory's budget the "agent" runs until the worker closes the session on stop. This keeps
        # the finished samples few: a rollout child with a backlog in its queue pipe cannot exit, and TRL
        # then waits out its 15 s join timeout at the end of every train().
        if self.over_budget:
            self.closed.wait()
            return 1
        return 0

    def fetch_training_trace(self) -> TrainingTrace:
        calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
                 for i in range(self.tool_calls)]
        turn = TrainingTurn(
            node_id="0",
            prompt_token_ids=list(PROMPT_IDS),
            completion_token_ids=list(COMPLETION_IDS),
            per_token_logps=[-1.0] * len(COMPLETION_IDS),
            loss_mask=[0] * len(PROMPT_IDS) + [1] * len(COMPLETION_IDS),
            request={"messages": [{"role": "user", "content": self.instruction}]},
            response={"choices": [{"message": {"role": "assistant", "content": "42", "tool_calls": calls}}]},
            metadata={"sampling_params": self.sampling},
        )
        return TrainingTrace(turns=[turn])

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        return VerifyResult(env_reward=self.env_reward, done=True)

    def close(self) -> None:
        self.closed.set()


class FakeSessionFactory:
    """Serves `tasks`; a rollout is correct when its episode id hashes even (so groups have reward contrast).

    `rollout_budget` caps how many rollouts finish (per process); later ones block until closed.
    """

    def __init__(self, server_url: str = "http://env.invalid", *, tasks: tuple[str, ...] = TASKS,
                 sampling: dict[str, Any] | None = None, tool_calls: int = 3, rollout_budget: int | None = None,
                 **harbor_kwargs: Any) -> None:
        self.server_url, self.tasks, self.tool_calls = server_url, tasks, tool_calls
        self.sampling = training_sampling(sampling) if sampling is not None else None
        self.rollout_budget, self.created = rollout_budget, 0
        self.harbor_kwargs = harbor_kwargs
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def prompt_rows(self) -> list[dict[str, Any]]:
        return [{"prompt": [{"role": "user", "content": t}], "task_name": f"task-{i}", "task_index": i}
                for i, t in enumerate(self.tasks)]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> FakeSession:
        instruction = task[-1]["content"] if isinstance(task, list) else str(task)
        if instruction not in self.tasks:
            raise KeyError("this prompt does not match any task on the server")
        correct = int(hashlib.sha1((episode_id or "").encode()).hexdigest(), 16) % 2 == 0
        with self._lock:
            self.created += 1
            over = self.rollout_budget is not None and self.created > self.rollout_budget
        return FakeSession(instruction, self.sampling or {}, 1.0 if correct else 0.0, self.tool_calls, over)


class FaultySession(FakeSession):
    """A FakeSession that fails the way a real rollout can (`fault`, one of FAULTS).

    `sandbox` mirrors OpenEnv's HarborSession (envs/harbor_env/harness.py at 2ce2fa7 and 98c9532): a failed
    rollout makes `wait_for_completion()` return 1 with `result.ok` False and `result.error` set, never raise,
    and `verify()` still forwards `result.reward`, which a capture-failed rollout may carry (openenv 0.10.0
    harbor/rollout.py: "One such rollout even carried reward=1.0"). `capture` raises what openenv 0.10.0's
    `harbor/contract.py::to_training_trace` raises for a capture with a fatal validation finding. `agent_exit` is a
    graded rollout whose agent exited non-zero: exit 1, `ok` False, its reward and agent turn kept. `upstream` is that
    rollout when its later model calls failed at the engine (the issue 41 outage: the env server's finding, seam_patch),
    `upstream_timeout` the same agent retrying until its timeout. `ended` is a graded rollout the proxy ended: its call
    budget (openenv counts a context stop among its budget stops too), the engine refusing a prompt past its context,
    and one completion cut at the output cap.
    """

    def __init__(self, fault: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault = fault
        self.result = SimpleNamespace(ok=fault != "sandbox", error="sandbox failed to boot", reward=1.0)
        if fault in ("agent_exit", "upstream", "upstream_timeout", "ended"):  # OpenEnv 0.10.0 run_rollout's results
            from openenv.harbor.models import HarborRolloutResult, HarborTurn

            findings = {"upstream": [f"{recipe.UPSTREAM_FINDING}3 model call(s) failed at the engine"],
                        "ended": ["[WARN] context_budget_exhausted: upstream HTTP 400: maximum context length is "
                                  "32768 tokens"]}
            findings["upstream_timeout"] = findings["upstream"]
            self.result = HarborRolloutResult(ok=False, reward=0.0, error="opencode exited with code 1",
                                              exception_type="NonZeroAgentExitCodeError", turns=[HarborTurn(turn=0)],
                                              findings=findings.get(fault, []),
                                              budget_stop_count=3 if fault == "ended" else 0)

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        if self.fault == "agent_crash":
            raise ConnectionResetError("env server connection reset mid-rollout")
        if self.fault in ("timeout", "timeout_verifier", "upstream_timeout"):
            raise TimeoutError("agent did not finish within its timeout")
        return 1 if self.fault in ("sandbox", "agent_exit", "upstream", "ended") else 0

    def fetch_training_trace(self) -> TrainingTrace:
        if self.fault == "capture":
            raise ValueError("cannot train a capture with fatal validation findings")
        if self.fault == "empty_trace":
            return TrainingTrace(turns=[])
        trace = super().fetch_training_trace()
        if self.fault == "ended":  # the engine cut the completion at the output cap (vLLM: finish_reason "length")
            trace.turns[0].response["choices"][0]["finish_reason"] = "length"
        return trace

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        if self.fault in ("verifier", "timeout_verifier"):
            return VerifyResult(env_reward=None, done=True)
        if self.fault == "empty_trace":
            return VerifyResult(env_reward=0.0, done=True)  # the verifier graded an untouched workspace
        return VerifyResult(env_reward=self.result.reward, done=True)


# How each fault shows, and the train_rollouts class it must be counted under (None: scored). Beyond these,
# "timeout_verifier": an agent that timed out, then a verifier that wrote no reward (timed out and unscorable).
FAULTS = {"create": "create", "sandbox": "rollout", "agent_crash": "rollout", "capture": "capture",
          "empty_trace": "empty_trace", "verifier": "verifier", "timeout": None, "upstream": "upstream",
          "upstream_timeout": "upstream"}


class FaultySessionFactory(FakeSessionFactory):
    """FakeSessionFactory whose every rollout fails with `fault` (`create` fails in create())."""

    def __init__(self, server_url: str = "http://env.invalid", *, fault: str, **kwargs: Any) -> None:
        super().__init__(server_url, **kwargs)
        self.fault = fault

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> FakeSession:
        if self.fault == "create":
            raise ConnectionError("env server refused the session: SessionCapacityError")
        instruction = task[-1]["content"] if isinstance(task, list) else str(task)
        return FaultySession(self.fault, instruction, self.sampling or {}, 1.0, self.tool_calls)


class ForkingSession(FakeSession):
    """A rollout whose second turn's prompt does not extend the first turn's prompt and completion (as when a
    template renders history differently): TRL's lossless capture trains it as two rows, a fork."""

    def fetch_training_trace(self) -> TrainingTrace:
        first = super().fetch_training_trace().turns[0]
        prompt = [*PROMPT_IDS[:-1], 44, 2]
        second = TrainingTurn(**{**first.model_dump(), "node_id": "1", "prompt_token_ids": prompt,
                                 "loss_mask": [0] * len(prompt) + [1] * len(COMPLETION_IDS)})
        return TrainingTrace(turns=[first, second])


class PlannedSessionFactory(FaultySessionFactory):
    """Its n-th rollout goes as `plan[n]`: "scored", "forked", or a FAULTS name (several sessions, one factory, so
    one ledger)."""

    def __init__(self, server_url: str = "http://env.invalid", *, plan: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(server_url, fault="", **kwargs)
        self.plan = plan

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> FakeSession:
        with self._lock:
            self.fault = self.plan[self.created]
            self.created += 1
        instruction = task[-1]["content"] if isinstance(task, list) else str(task)
        if self.fault in ("scored", "forked"):
            session_class = FakeSession if self.fault == "scored" else ForkingSession
            return session_class(instruction, self.sampling or {}, 1.0, self.tool_calls)
        return super().create(task, seed=seed, episode_id=episode_id)
