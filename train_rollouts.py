"""Rollout-level failures: each one costs a rollout (unscorable, counted in the rollout ledger), only a systematic one
stops the job. `guarded()` wraps TRL's session factory; docs/training.md "Rollout failures" has the classes."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import recipe
import trajectories
from sandbox_lifecycle import SETUP_KEY, setup_seconds

# Per-rollout failure classes, in the order a rollout meets them (docs/training.md says what causes each).
FAILURE_CLASSES = ("create", "rollout", "upstream", "capture", "empty_trace", "verifier")
# openenv's capture proxy records this finding when the engine refused a prompt past its context (and stops the agent).
CONTEXT_FINDING = "context_budget_exhausted"
# How the proxy ended a rollout, as its log line counts it -> the ledger's count of rollouts so ended.
ENDS = {"budget_stops": "budget_stopped", "context_exhausted": "context_exhausted", "cut_turns": "cut"}


class RolloutFailure(RuntimeError):
    """One rollout failed for a reason outside the policy. Not a ValueError: TRL scores it unscorable."""


class SystematicRolloutFailure(BaseException):
    """Rollouts fail systematically: stop the job. A BaseException because TRL's `except Exception` around each
    session step would otherwise score it as one more unscorable rollout."""


class Ledger:
    """Counts every finished rollout by outcome (docs/training.md "Counts") and decides when failures are systematic;
    each rollout is also one line of recipe.ROLLOUT_LOG_NAME, and the last few go to recipe.TRAJECTORIES_NAME."""

    def __init__(self, path: str | Path, *, streak_limit: int = recipe.ROLLOUT_ABORT_STREAK,
                 window: int = recipe.ROLLOUT_WINDOW, max_unscorable: float = recipe.ROLLOUT_MAX_UNSCORABLE) -> None:
        self.path = Path(path)
        self.streak_limit, self.max_unscorable = streak_limit, max_unscorable
        self._lock = threading.Lock()
        self._recent: deque[str | None] = deque(maxlen=window)  # failure class, or None when scored
        self._streak: list[str] = []
        self.state: dict[str, Any] = {
            "schema": 1, "started": time.time(), "updated": time.time(), "rollouts": 0, "scored": 0,
            "timed_out": 0, **dict.fromkeys(ENDS.values(), 0), "forked": 0, "tool_calls": 0,
            "unscorable": dict.fromkeys(FAILURE_CLASSES, 0), "unscorable_total": 0, "streak": 0,
            "window": {"size": window, "unscorable": 0}, "last_error": None, "timing": {"count": 0, "max": {}},
            "stopped": None}
        self._sample: deque[dict[str, Any]] = deque(maxlen=recipe.TRAJECTORY_SAMPLE)
        recipe.write_json(self.path, self.state)  # its folder too, before the rollout log's first line

    def record(self, failure: str | None, error: str = "", *, timed_out: bool = False,
               timing: Mapping[str, float] | None = None, forked: bool = False, tool_calls: int = 0,
               ends: Mapping[str, int] | None = None, task: str | None = None, reward: float | None = None,
               trial: Path | None = None, trajectory: dict[str, Any] | None = None) -> None:
        """One finished rollout, `failure` its class (None = scored); raises SystematicRolloutFailure on a trip."""
        with self._lock:
            state = self.state
            if state["stopped"]:
                raise SystematicRolloutFailure(state["stopped"])
            state["rollouts"] += 1
            if timing:  # the slowest rollout's seconds per Harbor part, and its setup (every part but the agent's run)
                state["timing"]["count"] += 1
                setup = setup_seconds(timing)
                for key, seconds in [*timing.items(), *([(SETUP_KEY, setup)] if setup is not None else [])]:
                    state["timing"]["max"][key] = max(state["timing"]["max"].get(key, seconds), seconds)
            state["timed_out"] += timed_out
            ends = {**dict.fromkeys(ENDS, 0), **(ends or {})}
            for key, counter in ENDS.items():
                state[counter] += ends[key] > 0
            self._recent.append(failure)
            if failure is None:
                state["scored"] += 1
                state["forked"] += forked
                state["tool_calls"] += tool_calls
                self._streak.clear()
            else:
                state["unscorable"][failure] += 1
                state["unscorable_total"] += 1
                self._streak.append(failure)
                state["last_error"] = {"class": failure, "error": error[:500], "at": time.time()}
            failed = [c for c in self._recent if c is not None]
            state["streak"], state["window"]["unscorable"] = len(self._streak), len(failed)
            state["updated"] = time.time()
            outcome = failure or ("timed_out" if timed_out else "scored")
            with self.path.with_name(recipe.ROLLOUT_LOG_NAME).open("a") as log:
                log.write(json.dumps({"task": task, "outcome": outcome, "reward": reward, **ends, "error": error[:500],
                                      "trial": str(trial) if trial else None,
                                      "trial_kept": trial.exists() if trial else None, "at": state["updated"]}) + "\n")
            if trajectory is not None:
                self._sample.append({**trajectory, "outcome": outcome})
                recipe.write_json(self.path.with_name(recipe.TRAJECTORIES_NAME), list(self._sample))
            if len(self._streak) >= self.streak_limit:
                state["stopped"] = self._stop_line(f"{len(self._streak)} rollouts in a row were unscorable",
                                                   self._streak, failure, error)
            elif len(self._recent) == self._recent.maxlen and len(failed) > self.max_unscorable * len(self._recent):
                state["stopped"] = self._stop_line(
                    f"{len(failed)} of the last {len(self._recent)} rollouts were unscorable", failed, failure, error)
            recipe.write_json(self.path, state)
            if state["stopped"]:
                raise SystematicRolloutFailure(state["stopped"])

    @staticmethod
    def _stop_line(what: str, classes: list[str], failure: str | None, error: str) -> str:
        counts = ", ".join(f"{c} {n}" for c, n in Counter(classes).most_common())
        return (f"rollouts are failing systematically: {what} ({counts}); last: {failure}: {error[:300]} "
                "-- fix the env server, vLLM or the sandboxes, then relaunch (it resumes from the last checkpoint)")


class Capture(NamedTuple):
    """What TRL 1.15 makes of a trace: its rows, a fork, its tool calls, its turns cut at the output cap."""

    sequences: list[Any]
    forked: bool
    tool_calls: int
    cut_turns: int = 0


def _trl_capture(trace: Any) -> Capture:
    """What TRL 1.15 will make of this trace (same calls, same order as `_run_session`); raises where TRL would."""
    from trl.experimental.async_grpo.async_rollout_worker import _chain_to_sequences
    from trl.experimental.async_grpo.openenv_harness import _tool_call_counts_by_name, _turns_from_training_trace

    turns = _turns_from_training_trace(trace)
    entries = trace.to_trace_entries()
    # fork threshold 0: what TRL's loop-owning path uses with lossless capture (its default).
    sequences, tally = _chain_to_sequences(turns, "guard-check", 0)
    cut = sum((t.response.get("choices") or [{}])[0].get("finish_reason") == "length" for t in trace.turns)
    return Capture(sequences, tally["fork"] > 0, sum(_tool_call_counts_by_name(entries).values()), cut)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"  # all of it: the ledger's last_error and the rollout log keep the detail


def _text(prompt: Any) -> str:
    """A prompt's last message text (TRL's prompt is the row's message list), the key of the task-name map."""
    return str(prompt[-1].get("content", "")) if isinstance(prompt, list) and prompt else str(prompt)


class GuardedSession:
    """One rollout through a wrapped session; classifies how it ended and records it when TRL closes it."""

    def __init__(self, inner: Any, ledger: Ledger, task: str | None = None) -> None:
        self.inner, self.ledger, self.task = inner, ledger, task
        self.reward: float | None = None
        self.failure: str | None = None
        self.error, self.timed_out = "", False
        self.capture: Capture | None = None  # set once the trace passed fetch_training_trace's checks
        self._phase = "new"  # -> "waiting" -> "ended" (the wait returned or raised) -> "recorded"; or -> "stopped"

    def __getattr__(self, name: str) -> Any:  # the rest of the session API (initial_messages, list_tools, result, ...)
        return getattr(self.__dict__.get("inner"), name)  # AttributeError, not recursion, before __init__

    def _fail(self, failure: str, error: str) -> RolloutFailure:
        if self.failure is None:
            self.failure, self.error = failure, error
        return RolloutFailure(f"{failure}: {error}")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """The inner wait; an ungraded non-zero exit or an exception other than TimeoutError fails the rollout."""
        self._phase = "waiting"
        try:
            code = self.inner.wait_for_completion(timeout_s)
        except TimeoutError as error:
            self.timed_out = True  # TRL trains the captured turns with timed_out flagged, unless the engine failed
            if why := self._upstream():
                raise self._fail("upstream", why) from error
            raise
        except Exception as error:
            raise self._fail("rollout", describe(error)) from error
        finally:
            if self._phase == "waiting":  # not "stopped": closed while it ran, the trainer is stopping
                self._phase = "ended"
        result = getattr(self.inner, "result", None)  # HarborSession keeps the server's verdict here
        if why := self._upstream():
            self._fail("upstream", why)
        elif code and recipe.graded_reward(result) is None:  # a graded non-zero exit trains with its grade
            reason = getattr(result, "error", None) or getattr(self.inner, "error", None) or ""
            self._fail("rollout", f"exit code {code}" + (f": {reason}" if reason else ""))
        return code

    def _upstream(self) -> str:
        """Why the engine, not the policy, decided this rollout ('' when none of its model calls failed there)."""
        count = recipe.upstream_errors(getattr(self.inner, "result", None))
        return f"{count} model call(s) failed at the engine (capture proxy upstream errors)" if count else ""

    def ends(self) -> dict[str, int]:
        """How the proxy ended the rollout (ENDS); openenv counts context stops among its budget stops."""
        result = getattr(self.inner, "result", None)
        context = sum(CONTEXT_FINDING in f for f in getattr(result, "findings", None) or [])
        stops = int(getattr(result, "budget_stop_count", 0) or 0)
        return {"budget_stops": max(0, stops - context), "context_exhausted": context,
                "cut_turns": self.capture.cut_turns if self.capture else 0}

    def fetch_training_trace(self) -> Any:
        """The inner trace, only if TRL can train on it: any capture failure becomes RolloutFailure (unscorable)."""
        if self.failure is not None:
            raise RolloutFailure(f"{self.failure}: {self.error}")
        try:
            trace = self.inner.fetch_training_trace()
            capture = _trl_capture(trace)
        except Exception as error:
            raise self._fail("capture", describe(error)) from error
        if not capture.sequences:
            raise self._fail("empty_trace", f"no trainable turn captured ({len(trace.turns)} turns)")
        self.capture = capture
        return trace

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> Any:
        """The inner verdict; a crash or a missing reward fails the rollout (TRL would train a reward-less rollout's
        turns at advantage 0, spending the step's sample slots on nothing)."""
        try:
            result = self.inner.verify(transcript, final_state)
        except Exception as error:
            raise self._fail("verifier", describe(error)) from error
        if result.env_reward is None:
            raise self._fail("verifier", "the verifier wrote no reward")
        self.reward = result.env_reward
        return result

    def close(self) -> None:
        """Close the inner session; the first close after the rollout ended records its outcome in the ledger."""
        if self._phase == "waiting":
            self._phase = "stopped"
        try:
            self.inner.close()  # a HarborSession times its trial here
        finally:
            if self._phase == "ended":
                self._phase = "recorded"
                capture = self.capture or Capture([], False, 0)
                result = getattr(self.inner, "result", None)
                self.ledger.record(self.failure, self.error, timed_out=self.timed_out,
                                   timing=getattr(self.inner, "timing", None), forked=capture.forked,
                                   tool_calls=capture.tool_calls, ends=self.ends(), task=self.task, reward=self.reward,
                                   trial=getattr(self.inner, "trial_dir", None),
                                   trajectory=None if result is None else trajectories.trajectory(
                                       result, task=self.task, reward=self.reward, tool_calls=capture.tool_calls))


class GuardedSessionFactory:
    """Built in TRL's rollout child from `guarded()`: the inner factory, the ledger, and the served tasks' names by
    prompt (TRL hands create() the prompt only), fetched before TRL's session pool starts."""

    def __init__(self, inner: Callable[..., Any], ledger_file: str, **kwargs: Any) -> None:
        self.inner = inner(**kwargs)
        self.ledger = Ledger(ledger_file)
        self.names = {_text(row["prompt"]): row.get("task_name") for row in self.inner.prompt_rows()}

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> GuardedSession:
        name = self.names.get(_text(task))
        try:
            session = self.inner.create(task, seed=seed, episode_id=episode_id)
        except Exception as error:
            self.ledger.record("create", describe(error), task=name)
            raise RolloutFailure(f"create: {describe(error)}") from error
        return GuardedSession(session, self.ledger, name)


def guarded(factory: Callable[..., Any], ledger_file: str | Path) -> Callable[..., GuardedSessionFactory]:
    """A picklable factory of guarded factories: what TRL's worker gets as `harness_session_factory`."""
    return functools.partial(GuardedSessionFactory, factory, str(ledger_file))


def refresh_heartbeat(heartbeat_file: str | Path, ledger_file: str | Path) -> None:
    """While the trainer waits for rollouts, date the heartbeat's mtime (run_job.sh's watchdog reads it) to the newest
    step or finished rollout; only a waiting trainer calls this, so one stuck elsewhere still goes stale."""
    heartbeat = Path(heartbeat_file)
    try:
        stepped = float(heartbeat.read_text().split()[1])
        finished = Path(ledger_file).stat().st_mtime
    except (OSError, IndexError, ValueError):
        return
    progress = min(max(stepped, finished), time.time())
    os.utime(heartbeat, (progress, progress))
