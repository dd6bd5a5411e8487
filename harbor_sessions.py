"""The trainer's and the eval's Harbor sessions on openenv 0.10.0's public client: one session is one
`HarborEnv.run_rollout` call (sandbox, OpenCode through the capture proxy, the task's verifier), an openenv
`TrainableSession` as TRL 1.15's loop-owning worker requires. Usage: docs/training.md "Harbor sessions"."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, TrainingTrace, VerifyResult

import recipe

# Harbor's exception types (`result.exception_type`): an agent out of time, whose workspace the verifier still graded
# (trained as timed out, not dropped); a verifier that produced no reward (harbor/verifier/verifier.py,
# harbor/trial/errors.py): the rollout is whole, only its grade is missing (train_rollouts' "verifier").
AGENT_TIMEOUT_TYPES = ("AgentTimeoutError",)
VERIFIER_FAILURE_TYPES = ("AddTestsDirError", "VerifierOutputParseError", "DownloadVerifierDirError",
                          "RewardFileNotFoundError", "RewardFileEmptyError", "VerifierTimeoutError")


def choose_split(names: list[str], wanted: str) -> str:
    """The env server's split to use: the named one, else its only one."""
    if wanted in names or (not wanted and len(names) == 1):
        return wanted or names[0]
    what = f"has no split {wanted!r}" if wanted else "serves several splits"
    raise recipe.ConfigError(f"the env server {what} ({names}): name the one to use (EVAL_SPLIT for the eval, "
                             "TRAIN_SPLIT for training)")


class HarborRolloutSession(ResourceSession):
    """One rollout on the env server, run by `wait_for_completion()`; an eval's (`purpose="eval"`, `eval_sampling`)
    is made with (task_index, model) only."""

    def __init__(self, env_url: str, split: str, task_index: int, model: str = "", *, task_name: str = "",
                 instruction: str = "", llm_url: str = "", harness: str = "opencode", sandbox: str = recipe.SANDBOX,
                 agent_timeout_sec: float = recipe.AGENT_TIMEOUT_SEC, agent_step_limit: int = recipe.AGENT_CALL_LIMIT,
                 purpose: str = "train", sampling: dict[str, Any] | None = None,
                 eval_sampling: dict[str, Any] | None = None) -> None:
        if purpose == "train" and sampling is None:
            raise ValueError("a training rollout needs the trainer's sampling policy (TRL passes it to the factory)")
        self.env_url, self.split, self.task_index, self.task_name = env_url, split, task_index, task_name
        self.instruction = instruction
        self.call = {"harness": harness, "sandbox": sandbox, "llm_url": llm_url, "model": model,
                     "agent_timeout_sec": float(agent_timeout_sec), "agent_step_limit": int(agent_step_limit),
                     "purpose": purpose, "sampling": sampling, "eval_sampling": eval_sampling}
        self.result: Any = None  # the env server's HarborRolloutResult, once the rollout returned
        self.timing: dict[str, float] = {}  # the trial's phases in seconds (sandbox_lifecycle.trial_timing), at close
        self.error, self.timed_out, self._finished = "", False, False

    # -- ResourceSession: the agent owns its loop inside the sandbox ------------------------------------------------
    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.instruction}]

    def list_tools(self) -> list[Any]:
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(error="OpenCode owns its tool loop inside the sandbox; the session has no tools")

    # -- TrainableSession ---------------------------------------------------------------------------------------------
    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """Run the rollout: 0 when it ran (graded, or its verifier failed), 1 when the env server reports it failed
        (`error` says why). An agent out of time raises TimeoutError after the verifier graded it: TRL trains its
        turns, flagged timed out, with that reward. Harbor enforces the agent timeout, so `timeout_s` is unused."""
        from openenv.harbor.client import HarborEnv

        # One client per rollout: its MCP socket is not shareable.
        env = HarborEnv(base_url=self.env_url, message_timeout_s=recipe.ROLLOUT_CALL_LIMIT_S,
                        websocket_ping_timeout_s=recipe.ENV_PING_TIMEOUT_S)
        try:
            self.result = env.run_rollout(split=self.split, task_index=self.task_index,
                                          **{k: v for k, v in self.call.items() if v is not None})
        finally:
            env.close()
        if self.result.ok:
            return 0
        if self.result.exception_type in VERIFIER_FAILURE_TYPES:
            self.error = f"the verifier failed: {self.result.exception_type}: {self.result.error}"
            return 0  # the agent ran to its end; verify() says what is missing
        if self.result.exception_type in AGENT_TIMEOUT_TYPES:
            self.timed_out = True
            raise TimeoutError(f"agent timed out: {self.result.error or self.result.exception_type}")
        self.error = str(self.result.error or "the env server reported the rollout failed")
        return 1

    def fetch_training_trace(self) -> TrainingTrace:
        """The rollout's exact-token capture as TRL trains it (openenv's contract; raises ValueError if untrainable)."""
        from openenv.harbor.contract import to_training_trace

        return to_training_trace(self.result)  # TRL asks only after wait_for_completion() set the result

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        """The verifier's grade (None: none); a crashed verifier raises: unscorable for its grade, not the agent."""
        if self.result is not None and self.result.exception_type in VERIFIER_FAILURE_TYPES:
            raise RuntimeError(self.error)
        return VerifyResult(env_reward=recipe.graded_reward(self.result), done=True,
                            metrics={"task_name": self.task_name, "trial": self.trial_name})

    @property
    def trial_name(self) -> str:
        return str(getattr(self.result, "trial_name", "") or "")

    @property
    def trial_dir(self) -> Path | None:
        """This rollout's Harbor trial folder (result, agent and verifier logs): the env server shares our env."""
        from openenv.harbor.environment import _trials_dir

        return _trials_dir() / self.trial_name if self.trial_name else None

    def close(self) -> None:
        """Once, after the verdict: time the trial, remove its folder or keep a failed one's (sandbox_lifecycle)."""
        import sandbox_lifecycle

        if self._finished or self.result is None or self.trial_dir is None:
            return
        self._finished = True
        self.timing = sandbox_lifecycle.trial_timing(self.trial_dir)
        sandbox_lifecycle.finish_trial(self.trial_dir, failed=not (self.result.ok or self.timed_out),
                                       session_key=str(self.result.session_id or ""))


class HarborSessionFactory(ResourceSessionFactory[HarborRolloutSession]):
    """Training sessions for the tasks of one env-server split; also the task list (`tasks`, `prompt_rows`)."""

    _lock = threading.Lock()  # the class's, not an instance's: TRL pickles the factory into its spawned child

    def __init__(self, env_url: str, *, split: str = "", sampling: dict[str, Any] | None = None,
                 **session_kwargs: Any) -> None:
        """`session_kwargs`: HarborRolloutSession's keywords (llm_url, model, sandbox, ...), its defaults otherwise."""
        self.env_url, self.split = env_url.rstrip("/"), split
        self.sampling, self.session_kwargs = sampling, session_kwargs
        self._tasks: list[dict[str, Any]] = []

    def tasks(self) -> list[dict[str, Any]]:
        """[{index, task_name, instruction}] of the split, fetched once, locked: TRL's pool threads ask at once."""
        with self._lock:
            if not self._tasks:
                from openenv.harbor.client import HarborEnv

                with HarborEnv(base_url=self.env_url) as env:
                    self.split = choose_split([str(s.get("name", "")) for s in env.splits()], self.split)
                    refs = env.get_task_range(self.split, 0, env.num_tasks(self.split))
                self._tasks = [{"index": int(r.index), "task_name": r.task_name, "instruction": r.instruction}
                               for r in refs]
            return self._tasks

    def prompt_rows(self) -> list[dict[str, Any]]:
        """TRL's dataset rows: `create()` accepts exactly these prompts."""
        return [{"prompt": [{"role": "user", "content": t["instruction"]}], "task_name": t["task_name"],
                 "task_index": t["index"]} for t in self.tasks()]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborRolloutSession:
        """A training session for the task whose instruction is this prompt (TRL hands create() no task index)."""
        prompt = str(task[-1]["content"]).strip()
        found = next((t for t in self.tasks() if t["instruction"].strip() == prompt), None)
        if found is None:
            raise KeyError("this prompt matches no task on the env server: build the dataset from prompt_rows()")
        return HarborRolloutSession(self.env_url, split=self.split, task_index=found["index"],
                                    task_name=found["task_name"], instruction=found["instruction"],
                                    purpose="train", sampling=self.sampling, **self.session_kwargs)
