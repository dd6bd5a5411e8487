"""Rollout-level failures: each one costs a rollout (unscorable, counted), only a systematic one stops the job.

TRL 1.15's HarnessRolloutWorker (`openenv_harness._run_session`) scores a rollout unscorable when the session's
`create()`, `wait_for_completion()` or `verify()` raises, but it turns a ValueError/TypeError/KeyError from
`fetch_training_trace()` (or from reconciling its turns) into CaptureContractError, which stops the rollout worker
and with it the run. It also ignores the exit code of `wait_for_completion()`: OpenEnv's HarborSession returns 1,
with `result.ok` False, for a rollout whose sandbox, agent or capture failed, and may still carry a reward. Such a
rollout fails here only when it has no grade (recipe.graded_reward, the eval's rule too): a graded one
(an agent that timed out or exited non-zero) trains with its grade, if its capture passes the checks below; one whose
model calls failed at the engine (recipe.upstream_errors) is unscorable, `upstream`: an outage is not a wrong answer.

`guarded(factory, ledger_file)` wraps the Harbor session factory TRL rebuilds in its rollout child. Its sessions
turn every per-rollout failure into an unscorable rollout of one class (FAILURE_CLASSES), count it in a JSON
ledger (recipe.LEDGER_NAME, in the job's work folder), and raise SystematicRolloutFailure, which TRL cannot
swallow, when recipe.ROLLOUT_ABORT_STREAK rollouts in a row or more than ROLLOUT_MAX_UNSCORABLE of the last
ROLLOUT_WINDOW failed. The ledger's mtime is also the rollout side's progress beat for the stall watchdog.

The ledger is the run's one rollout counter: the trainer (another process) logs its growth each step as the
dashboard's rollout counts (LedgerGrowth, through train_metrics.StepObjective); the heartbeat's log line and the
smoke report read it too.
"""

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
from sandbox_lifecycle import SETUP_KEY, TIMING_PARTS, setup_seconds

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


def read_ledger(path: str | Path) -> dict[str, Any] | None:
    """The ledger's last state, or None if the rollout worker has not written it yet."""
    return recipe.read_json(path)


class Ledger:
    """Counts every finished rollout by outcome and decides when failures are systematic (thread-safe).

    Rewritten atomically on every finished rollout: {schema, started, updated, rollouts, scored, timed_out,
    budget_stopped, context_exhausted, cut, forked, tool_calls, unscorable: {class: n}, unscorable_total, streak,
    window: {size, unscorable}, last_error: {class, error, at}, timing, stopped}. `stopped` is the one line the job
    stops with, else null. `timed_out`, `budget_stopped` (the proxy ended the agent at its call budget),
    `context_exhausted` (its prompt outgrew the context) and `cut` (a completion hit the output cap) count every
    rollout so ended, scored or not; `forked` (its capture trains as several rows) and `tool_calls` (their sum) count
    the scored rollouts only, the ones TRL trains.

    `timing` = {"count": n, "max": {part: s, "setup_s": s}} over the rollouts recorded with a non-empty `timing`
    (sandbox_lifecycle.trial_timing of their Harbor trial): for each part of sandbox_lifecycle.TIMING_PARTS the
    slowest rollout's seconds, and for `setup_s` the slowest rollout's setup, the sum of its parts but `agent_run_s`
    (what recipe.ROLLOUT_SETUP_BUDGET_S budgets). A part no rollout reached is absent.
    """

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
        self.log_path = self.path.with_name(recipe.ROLLOUT_LOG_NAME)
        self._sample: deque[dict[str, Any]] = deque(maxlen=recipe.TRAJECTORY_SAMPLE)  # the last ones, for reading
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def record(self, failure: str | None, error: str = "", *, timed_out: bool = False,
               timing: Mapping[str, float] | None = None, forked: bool = False, tool_calls: int = 0,
               ends: Mapping[str, int] | None = None, task: str | None = None, reward: float | None = None,
               trial: Path | None = None, trajectory: dict[str, Any] | None = None) -> None:
        """One finished rollout: `failure` is its class (None = scored), `timing` its Harbor parts in seconds
        (sandbox_lifecycle.trial_timing), `forked` and `tool_calls` what its capture trains as (Capture), `ends` how
        the proxy ended it (GuardedSession.ends); `task`, `reward` and its Harbor `trial` folder go to its log line
        only, its `trajectory` (trajectories.trajectory) to the sample of the last ones (recipe.TRAJECTORIES_NAME).
        Raises SystematicRolloutFailure on a trip, ValueError for a timing part not in TIMING_PARTS (a caller's bug,
        refused before anything is counted)."""
        unknown = sorted(set(timing or ()) - set(TIMING_PARTS))
        if unknown:
            raise ValueError(f"timing parts {unknown} are not among {TIMING_PARTS}")
        with self._lock:
            state = self.state
            if state["stopped"]:
                raise SystematicRolloutFailure(state["stopped"])
            state["rollouts"] += 1
            if timing:
                self._add_timing(timing)
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
            self._log({"task": task, "outcome": outcome, "reward": reward, **ends, "error": error[:500],
                       "trial": str(trial) if trial else None, "trial_kept": trial.exists() if trial else None,
                       "at": state["updated"]})
            if trajectory is not None:
                self._sample.append({**trajectory, "outcome": outcome})
                recipe.write_json(self.path.with_name(recipe.TRAJECTORIES_NAME), list(self._sample))
            if len(self._streak) >= self.streak_limit:
                state["stopped"] = self._stop_line(f"{len(self._streak)} rollouts in a row were unscorable",
                                                   self._streak, failure, error)
            elif len(self._recent) == self._recent.maxlen and len(failed) > self.max_unscorable * len(self._recent):
                state["stopped"] = self._stop_line(
                    f"{len(failed)} of the last {len(self._recent)} rollouts were unscorable", failed, failure, error)
            self._write()
            if state["stopped"]:
                raise SystematicRolloutFailure(state["stopped"])

    def _add_timing(self, timing: Mapping[str, float]) -> None:
        aggregate = self.state["timing"]
        aggregate["count"] += 1
        setup = setup_seconds(timing)
        for key, seconds in [*timing.items(), *([(SETUP_KEY, setup)] if setup is not None else [])]:
            aggregate["max"][key] = max(aggregate["max"].get(key, seconds), seconds)

    @staticmethod
    def _stop_line(what: str, classes: list[str], failure: str | None, error: str) -> str:
        counts = ", ".join(f"{c} {n}" for c, n in Counter(classes).most_common())
        return (f"rollouts are failing systematically: {what} ({counts}); last: {failure}: {error[:300]} "
                "-- fix the env server, vLLM or the sandboxes, then relaunch (it resumes from the last checkpoint)")

    def _write(self) -> None:
        recipe.write_json(self.path, self.state)

    def _log(self, line: dict[str, Any]) -> None:
        with self.log_path.open("a") as log:
            log.write(json.dumps(line) + "\n")


class Capture(NamedTuple):
    """What TRL 1.15 trains a rollout's trace as: its rows, whether it forked, its tool calls (TRL's own counts), and
    its turns the engine cut at the output cap (finish_reason "length")."""

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


def _text(prompt: Any) -> str:
    """A prompt's last message text (TRL's prompt is the row's message list), the key of the task-name map."""
    return str(prompt[-1].get("content", "")) if isinstance(prompt, list) and prompt else str(prompt)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class GuardedSession:
    """One rollout through a wrapped session; classifies how it ended and records it when TRL closes it."""

    def __init__(self, inner: Any, ledger: Ledger, task: str | None = None) -> None:
        self.inner, self.ledger, self.task = inner, ledger, task
        self.reward: float | None = None
        self.failure: str | None = None
        self.error = ""
        self.timed_out = False
        self.capture: Capture | None = None  # set once the trace passed fetch_training_trace's checks
        self._waited = False  # wait_for_completion() returned or raised: the rollout ran to an end
        self._waiting = False
        self._stopped_early = False  # closed while still running: the trainer is stopping, not a failure
        self._recorded = False

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)  # anything else the inner session offers (HarborSession.result, ...)

    def _fail(self, failure: str, error: str) -> RolloutFailure:
        if self.failure is None:
            self.failure, self.error = failure, error
        return RolloutFailure(f"{failure}: {error}")

    def initial_messages(self) -> list[dict[str, Any]]:
        return self.inner.initial_messages()

    def list_tools(self) -> list[Any]:
        return self.inner.list_tools()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        return self.inner.call_tool(name, arguments)

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """The inner wait; an ungraded non-zero exit or an exception other than TimeoutError fails the rollout."""
        self._waiting = True
        try:
            code = self.inner.wait_for_completion() if timeout_s is None else self.inner.wait_for_completion(timeout_s)
        except TimeoutError as error:
            self.timed_out = True  # TRL trains the captured turns with timed_out flagged, unless the engine failed
            if self._upstream():
                raise self._fail("upstream", self._upstream()) from error
            raise
        except Exception as error:
            raise self._fail("rollout", _describe(error)) from error
        finally:
            self._waiting, self._waited = False, True
        result = getattr(self.inner, "result", None)  # HarborSession keeps the server's verdict here
        # Graded (a timed-out or non-zero agent exit): trained with its grade. Not graded: the rollout failed.
        if self._upstream():
            self._fail("upstream", self._upstream())
        elif code and recipe.graded_reward(result) is None:
            reason = getattr(result, "error", None) or getattr(self.inner, "error", None) or ""
            self._fail("rollout", f"exit code {code}" + (f": {reason}" if reason else ""))
        return code

    def _upstream(self) -> str:
        """Why the engine, not the policy, decided this rollout ('' when none of its model calls failed there)."""
        count = recipe.upstream_errors(getattr(self.inner, "result", None))
        return f"{count} model call(s) failed at the engine (capture proxy upstream errors)" if count else ""

    def ends(self) -> dict[str, int]:
        """How the proxy ended the rollout (ENDS): call-budget stops (openenv counts context stops among them), context
        stops, and completions cut at the output cap."""
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
            raise self._fail("capture", _describe(error)) from error
        if not capture.sequences:
            raise self._fail("empty_trace", f"no trainable turn captured ({len(trace.turns)} turns)")
        self.capture = capture
        return trace

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> Any:
        """The inner verdict; a crash or a missing reward fails the rollout.

        Raised rather than returned as None: TRL would still train a no-reward rollout's turns at advantage 0,
        spending a step's sample slots on nothing.
        """
        try:
            result = self.inner.verify(transcript, final_state)
        except Exception as error:
            raise self._fail("verifier", _describe(error)) from error
        if result.env_reward is None:
            raise self._fail("verifier", "the verifier wrote no reward")
        self.reward = result.env_reward
        return result

    def close(self) -> None:
        """Close the inner session; the first close after the rollout ended records its outcome in the ledger."""
        if self._waiting:
            self._stopped_early = True
        try:
            self.inner.close()
        finally:
            if self._waited and not self._stopped_early and not self._recorded:
                self._recorded = True
                # The inner session times its trial when it closes (harbor_sessions; scripted sessions do not).
                capture = self.capture or Capture([], False, 0)
                result = getattr(self.inner, "result", None)  # HarborSession's: the capture and Harbor's verdict
                self.ledger.record(self.failure, self.error, timed_out=self.timed_out,
                                   timing=getattr(self.inner, "timing", None), forked=capture.forked,
                                   tool_calls=capture.tool_calls, ends=self.ends(), task=self.task, reward=self.reward,
                                   trial=getattr(self.inner, "trial_dir", None),
                                   trajectory=None if result is None else trajectories.trajectory(
                                       result, task=self.task, reward=self.reward, tool_calls=capture.tool_calls))


class GuardedSessionFactory:
    """Built in TRL's rollout child from `guarded()`: the inner factory with its task map warmed, plus the ledger."""

    def __init__(self, inner: Callable[..., Any], ledger_file: str, **kwargs: Any) -> None:
        self.inner = inner(**kwargs)
        # Warm the inner factory's task map here, before TRL starts its session pool: HarborSessionFactory fills
        # it lazily inside create(), unlocked, and threads racing there get KeyError (issue 14, defect 7).
        warm = getattr(self.inner, "tasks", None)
        if callable(warm):
            warm()
        self.ledger = Ledger(ledger_file)
        self._names: dict[str, str] | None = None

    def prompt_rows(self) -> list[dict[str, Any]]:
        return self.inner.prompt_rows()

    def task_name(self, task: Any) -> str | None:
        """The served task a prompt is (TRL hands create() the prompt only), for the rollout log."""
        if self._names is None:
            self._names = {_text(row["prompt"]): row.get("task_name") for row in self.prompt_rows()}
        return self._names.get(_text(task))

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> GuardedSession:
        name = None
        try:
            name = self.task_name(task)
            session = self.inner.create(task, seed=seed, episode_id=episode_id)
        except Exception as error:
            self.ledger.record("create", _describe(error), task=name)
            raise RolloutFailure(f"create: {_describe(error)}") from error
        return GuardedSession(session, self.ledger, name)


def guarded(factory: Callable[..., Any], ledger_file: str | Path) -> Callable[..., GuardedSessionFactory]:
    """A picklable factory of guarded factories: what TRL's worker gets as `harness_session_factory`."""
    return functools.partial(GuardedSessionFactory, factory, str(ledger_file))


def refresh_heartbeat(heartbeat_file: str | Path, ledger_file: str | Path) -> None:
    """While the trainer waits for rollouts: date the heartbeat to the newest progress, step or finished rollout.

    The heartbeat's text keeps the last optimizer step and its time (written by train_callbacks.Heartbeat); only its
    mtime moves, which is what run_job.sh's watchdog reads. Only a trainer that is waiting calls this, so a
    trainer stuck elsewhere still goes stale while rollouts keep finishing.
    """
    heartbeat = Path(heartbeat_file)
    try:
        stepped = float(heartbeat.read_text().split()[1])
        finished = Path(ledger_file).stat().st_mtime
    except (OSError, IndexError, ValueError):
        return
    progress = min(max(stepped, finished), time.time())
    os.utime(heartbeat, (progress, progress))


# The dashboard's rollout counts (TRL sums a `total` over the logging window): metric -> the ledger's counter.
ROLLOUT_COUNTS = {"rollout/finished_total": "rollouts", "rollout/unscorable_total": "unscorable_total",
                  "rollout/timed_out_total": "timed_out", "rollout/forked_total": "forked",
                  **{f"rollout/{counter}_total": counter for counter in ENDS.values()}}
TOOL_CALLS_MEAN = "rollout/tool_calls_mean"  # tool calls per scored rollout: a (calls, rollouts) rate, as TRL reduces


class LedgerGrowth:
    """What the ledger counted since the last look, as the dashboard logs it (read in the trainer's process).

    The ledger is written by the rollout child, a separate process, so this reads its file: each look returns the
    ledger's growth since the previous one. A rollout is in the ledger before its samples can reach the trainer (TRL
    closes the session, which records it, before the group is scored), so a step's look counts every rollout the
    step trains. Only this start's ledger counts (`started` at or after this object was made: a file an earlier
    start left is not this run's), and a new ledger (a restarted child) is counted from zero.
    """

    def __init__(self, ledger_file: str | Path) -> None:
        self.path = Path(ledger_file)
        self.since = time.time()  # made before train() starts the rollout child, which begins the ledger
        self._last: dict[str, Any] = {}

    def take(self) -> dict[str, float | tuple[float, float]]:
        """The ledger's growth since the last call, by dashboard metric; {} while this start has no ledger."""
        ledger = read_ledger(self.path)
        if not ledger or ledger.get("started", 0) < self.since:
            return {}
        last = self._last if self._last.get("started") == ledger["started"] else {}
        self._last = ledger
        grown = {key: ledger[key] - last.get(key, 0) for key in (*ROLLOUT_COUNTS.values(), "scored", "tool_calls")}
        counts: dict[str, float | tuple[float, float]] = {
            metric: float(grown[key]) for metric, key in ROLLOUT_COUNTS.items()}
        if grown["scored"]:
            counts[TOOL_CALLS_MEAN] = (float(grown["tool_calls"]), float(grown["scored"]))
        return counts
