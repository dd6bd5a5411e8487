"""Rollout pipeline benchmark: of the rollouts TRL 1.15 finishes, how many it trains and how many it drops as stale.

Runs the recipe's own trainer on CPU: train_lora.build_trainer (TRL's AsyncGRPOTrainer with the merge-free sync,
train_lora.rollout_worker, TRL's HarnessRolloutWorker with a spawned child, train_rollouts, RunLog) on the tiny
LFM2 of tests/tiny_lfm2.py. TRL's own code decides everything measured here: a group's policy version is stamped when
its first rollout is dispatched (`_generate_loop`), a group is queued once all 8 rollouts are done, the trainer drops
a sample more than `max_staleness` versions old (`RolloutQueueDataset`, counted as `sample/dropped_stale_total`),
and each optimizer step's sync bumps the version. Only the sandbox is scripted: each session waits a duration drawn
from a stated distribution, then hands TRL a one-turn capture. Time is simulated and compressed (--minute-s real
seconds per simulated minute, SimClock): it runs while the trainer waits for samples and for the recipe's step time
of each step's compute (35-50 s/step once the rollout queue saturates: RECIPE_STEP_S, midpoint), and stands still
while the trainer is busy beyond that, so a loaded CPU changes the run's wall time, not its numbers. A median
8-minute rollout lasts about 11 trainer steps, as in production.

    .venv/bin/python benchmarks/rollout_pipeline.py --quick     # the recipe's knobs, lognormal; <= 3 min on 2 cores
    .venv/bin/python benchmarks/rollout_pipeline.py             # the full table (every setting x distribution)
    .venv/bin/python benchmarks/rollout_pipeline.py --settings 32:4,32:16 --distributions lognormal

Per row: finished rollouts trained / dropped stale (TRL's counts, in samples; one sample per rollout unless the
capture forks, --fork-frac), the trainer's idle fraction once saturated (its simulated time blocked on TRL's queue,
ClockedQueue), sandbox-minutes per trained step (sandboxes in flight x minutes per step), steps per hour and hours
for 1,000 steps. "Saturated" is every step after the first (groups in flight + max_staleness): by then the version
has moved past the staleness bound and the first wave of dispatches has been trained or dropped. The step's 8
samples are trained as one micro-batch, not the recipe's 8 (one_microbatch_per_step says what that changes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: the tiny model gains nothing from more threads
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "rehearsal"), str(ROOT / "benchmarks")]

from openenv.core.harness import TrainingTrace, VerifyResult  # noqa: E402
from sessions import ScriptedAgentSession, ScriptedAgentSessionFactory  # noqa: E402
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

import recipe  # noqa: E402
from train_metrics import DROPPED_STALE  # noqa: E402

RECIPE_STEP_S = (35, 50)  # The recipe text's seconds per optimizer step once the rollout queue saturates.
STEP_S = sum(RECIPE_STEP_S) / 2
TARGET_STEPS = 1000  # "hours for 1,000 steps": the recipe's MAX_STEPS
ADAPTER_REPO = "bench/rollout-pipeline"
PLACEHOLDER_TOKEN = "hf_benchmark_placeholder"  # not a credential: train_lora requires HF_TOKEN, LocalHub ignores it
PROMPT_TOKENS, COMPLETION_TOKENS = 24, 8  # one short turn per rollout: the trainer's compute stays far below a step


# --- Rollout durations (simulated minutes) -----------------------------------------------------------------------
@dataclass(frozen=True)
class Distribution:
    name: str
    label: str
    draw: Callable[[random.Random], float]


def _lognormal(median: float, sigma: float, cap: float = math.inf) -> Callable[[random.Random], float]:
    return lambda rng: min(cap, median * math.exp(sigma * rng.gauss(0.0, 1.0)))


DISTRIBUTIONS = {d.name: d for d in (
    Distribution("constant", "constant 8 min", lambda rng: 8.0),
    Distribution("uniform", "uniform 8 min +-10%", lambda rng: rng.uniform(7.2, 8.8)),
    Distribution("lognormal", "lognormal median 8 min, sigma 0.6", _lognormal(8.0, 0.6)),
    Distribution("exponential", "exponential mean 6 min", lambda rng: rng.expovariate(1 / 6.0)),
    # OpenEnv's rollout call limit (recipe.ROLLOUT_CALL_LIMIT_S, 30 min) caps a rollout: a wide tail piles up there.
    Distribution("capped", "lognormal median 8 min, sigma 1.0, cap 30 min",
                 _lognormal(8.0, 1.0, recipe.ROLLOUT_CALL_LIMIT_S / 60)),
)}


# --- Simulated time ---------------------------------------------------------------------------------------------
class SimClock:
    """The simulation's clock, shared by the trainer (which drives it) and TRL's rollout child (sessions read it).

    Simulated time runs with real time while the trainer waits for samples and for `step_s` of each optimizer step's
    compute; it stands still whenever the trainer is busy beyond that (a slow step on a loaded CPU, the weight sync,
    logging). So every step costs exactly the stated step time, whatever the machine's load, and rollouts are timed
    against the same clock. State, in a file rewritten atomically: frozen seconds so far and the real time from which
    the clock is frozen (until the next update)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _read(self) -> tuple[float, float]:
        frozen, freeze_at = self.path.read_text().split()
        return float(frozen), float(freeze_at)

    def now(self) -> float:
        """Simulated seconds (real seconds, less the frozen ones) on the real-time scale."""
        frozen, freeze_at = self._read()
        real = time.time()
        return real - frozen - max(0.0, real - freeze_at)

    def run_until(self, freeze_at: float) -> float:
        """Trainer side: account the freeze so far, let the clock run until real time `freeze_at`; returns the
        simulated time of the change (so that no running instant goes unaccounted between a change and a read)."""
        frozen, old = self._read() if self.path.exists() else (0.0, time.time())
        real = time.time()
        frozen += max(0.0, real - old)
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text(f"{frozen!r} {max(freeze_at, real)!r}")
        os.replace(temp, self.path)
        return real - frozen

    def freeze(self) -> float:
        return self.run_until(time.time())

    def run(self) -> float:
        return self.run_until(math.inf)

    def sleep(self, seconds: float, interrupted: threading.Event) -> None:
        """Session side: wait `seconds` of simulated time (or until `interrupted`)."""
        end = self.now() + seconds
        while (left := end - self.now()) > 0:
            if interrupted.wait(max(left, 0.005)):
                return


class ClockedQueue:
    """TRL's rollout queue as the trainer sees it, with the clock running only while the trainer blocks on it.

    Records each wait in simulated time, as (when it ended, how long): TRL's own `perf/rollout_wait_s` is real time
    and also holds the instants this wrapper itself takes, frozen, which on a loaded CPU is not negligible."""

    def __init__(self, queue: Any, clock: SimClock) -> None:
        self.queue, self.clock = queue, clock
        self.waits: list[tuple[float, float]] = []

    def get(self, timeout: float | None = None) -> Any:
        began = self.clock.run()
        try:
            return self.queue.get(timeout=timeout)
        finally:
            ended = self.clock.freeze()
            self.waits.append((ended, ended - began))

    def qsize(self) -> int:
        return self.queue.qsize()


# --- Scripted sandbox: waits its drawn duration, then hands back a one-turn capture -------------------------------
class TimedSession(ScriptedAgentSession):
    """A rollout that takes `seconds` of simulated time, then yields a capture TRL trains as one sample (two if
    `fork`)."""

    def __init__(self, *, task: dict[str, Any], seconds: float, clock: SimClock, fork: bool, reward: float,
                 sandbox_root: str) -> None:
        super().__init__(capture_url="", session_id="", task=task, timeout_s=seconds + 60, sandbox_root=sandbox_root)
        self.seconds, self.clock, self.fork, self.reward = seconds, clock, fork, reward

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        self.clock.sleep(self.seconds, self._ended)  # close() (TRL stopping the worker) ends it at once
        return 0

    def fetch_training_trace(self) -> TrainingTrace:
        prompt = [12 + (self.task["index"] * 7 + i) % 250 for i in range(PROMPT_TOKENS)]
        completion = [12 + i for i in range(COMPLETION_TOKENS - 1)] + [2]  # ends on <|im_end|>
        turns = [(prompt, completion)]
        if self.fork:  # the next request re-tokenizes the first answer differently: TRL forks a second row
            turns.append((prompt + [13] + completion[1:] + [14, 15], completion))
        return TrainingTrace.from_entries([
            {"prompt_token_ids": p, "completion_token_ids": c, "per_token_logps": [-1.0] * len(c),
             "loss_mask": [0] * len(p) + [1] * len(c), "metadata": {"node_id": f"{id(self)}-{n}"}}
            for n, (p, c) in enumerate(turns)])

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        return VerifyResult(env_reward=self.reward, done=True)

    def close(self) -> None:
        self.closed = True
        self._ended.set()
        shutil.rmtree(self.workdir, ignore_errors=True)


class TimedSessionFactory(ScriptedAgentSessionFactory):
    """The rehearsal's factory shape (prompt_rows, create), with sessions of drawn durations instead of agents."""

    def __init__(self, distribution: str, minute_s: float, clock_file: str, seed: int, fork_frac: float,
                 sandbox_root: str, num_tasks: int, sampling: dict[str, Any] | None = None) -> None:
        super().__init__("http://unused.invalid", num_tasks=num_tasks, sandbox_root=sandbox_root, sampling=sampling)
        self.distribution, self.minute_s, self.fork_frac = DISTRIBUTIONS[distribution], minute_s, fork_frac
        self.clock = SimClock(clock_file)
        self.rng = random.Random(seed)

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> TimedSession:
        instruction = task[-1]["content"] if isinstance(task, list) else str(task)
        found = next(t for t in self._tasks if t["instruction"] == instruction)
        with self._lock:
            minutes = self.distribution.draw(self.rng)
            fork = self.rng.random() < self.fork_frac
            reward = float(self.rng.random() < 0.5)
        return TimedSession(task=found, seconds=minutes * self.minute_s, clock=self.clock, fork=fork, reward=reward,
                            sandbox_root=self.sandbox_root)


# --- The trainer's clock --------------------------------------------------------------------------------------------
class StepClock(TrainerCallback):
    """Gives each optimizer step's compute exactly `step_s` of simulated time, before its weight sync (the version
    bump): a faster step sleeps out the rest, a slower one has the clock frozen past `step_s`. Stops training after
    `steps` steps or at the real-time `deadline`; records each step's simulated end."""

    def __init__(self, clock: SimClock, step_s: float, steps: int, deadline: float) -> None:
        self.clock, self.step_s, self.steps, self.deadline = clock, step_s, steps, deadline
        self.ends: list[float] = []
        self.computes: list[float] = []
        self.waits: list[tuple[float, float]] = []  # the trainer's waits for samples (ClockedQueue.waits)
        self.began = time.time()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        self.began = time.time()  # the step's samples are fetched: its compute starts
        self.clock.run_until(self.began + self.step_s)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        compute = time.time() - self.began
        self.computes.append(compute)
        if compute < self.step_s:
            time.sleep(self.step_s - compute)
        self.ends.append(self.clock.freeze())
        if state.global_step >= self.steps or time.time() > self.deadline:
            control.should_training_stop = True

    @property
    def over_budget(self) -> int:
        return sum(c > self.step_s for c in self.computes)


def insert_before_sync(trainer: Any, callback: TrainerCallback) -> None:
    """Put `callback` ahead of TRL's weight-sync callback, so the padded compute precedes the version bump."""
    from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback

    callbacks = trainer.callback_handler.callbacks
    index = next(i for i, c in enumerate(callbacks) if isinstance(c, StepIntervalCallback))
    callbacks.insert(index, callback)


def clock_s(args: argparse.Namespace) -> float:
    """Real seconds of one padded trainer step."""
    return args.step_s / 60 * args.minute_s


# --- One run ----------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    inflight: int
    staleness: int
    distribution: str
    steps: int = 0  # steps in the saturated window
    trained: float = 0.0  # samples trained in the window
    dropped: float = 0.0  # samples dropped stale in the window (TRL's sample/dropped_stale_total)
    finished: float = 0.0  # rollouts finished over the whole run (train_metrics' rollout/finished_total)
    forked: float = 0.0  # of which their capture forked (rollout/forked_total)
    idle: float = math.nan
    minutes_per_step: float = math.nan
    over_budget: int = 0  # steps whose real compute exceeded the step time (the simulated clock froze meanwhile)
    compute_s: float = math.nan  # median real compute per step
    wall_s: float = 0.0

    @property
    def trained_frac(self) -> float:
        return self.trained / (self.trained + self.dropped) if self.trained + self.dropped else math.nan

    @property
    def steps_per_hour(self) -> float:
        return 60 / self.minutes_per_step

    def cells(self) -> list[str]:
        return [f"{self.inflight}", f"{self.staleness}", DISTRIBUTIONS[self.distribution].label,
                f"{self.trained_frac:.1%} / {1 - self.trained_frac:.1%}", f"{self.idle:.0%}",
                f"{self.inflight * self.minutes_per_step:.0f}", f"{self.steps_per_hour:.1f}",
                f"{TARGET_STEPS / self.steps_per_hour:.0f}", f"{self.steps}"]


HEADER = ["in flight", "max staleness", "rollout duration", "trained / dropped stale", "trainer idle",
          "sandbox-min per step", "steps/hour", f"hours for {TARGET_STEPS:,} steps", "steps measured"]


@contextlib.contextmanager
def recipe_knobs(inflight: int) -> Iterator[None]:
    """The recipe's in-flight knob for one run (train_lora reads it when it builds the config; staleness is the
    MAX_STALENESS environment knob)."""
    saved = recipe.MAX_INFLIGHT_ROLLOUTS
    recipe.MAX_INFLIGHT_ROLLOUTS = inflight
    try:
        yield
    finally:
        recipe.MAX_INFLIGHT_ROLLOUTS = saved


@contextlib.contextmanager
def one_microbatch_per_step(train_lora: Any) -> Iterator[None]:
    """The step's 8 samples in one micro-batch instead of the recipe's 8 of one sample each (--recipe-batching keeps
    the recipe's): the same samples per step and the same TRL batcher, with an eighth of the CPU per step.

    What it changes: accelerate's DataLoaderDispatcher (TRL's dataloader) fetches one micro-batch ahead, and TRL checks
    a sample's staleness when it pulls it. With one micro-batch per step, all 8 samples of the next step are checked
    while the current step is still to be trained, one version early; with the recipe's 8, only the first is. So this
    is one version more lenient for 7 of 8 samples: it can only understate the drops of the recipe's batching.
    """
    real = train_lora.conv_safe_batching
    batching = real()
    samples = batching["per_device_train_batch_size"] * batching["gradient_accumulation_steps"]
    train_lora.conv_safe_batching = lambda: {**batching, "per_device_train_batch_size": samples,
                                             "gradient_accumulation_steps": 1}
    try:
        yield
    finally:
        train_lora.conv_safe_batching = real


def train_run(inflight: int, staleness: int, distribution: str, args: argparse.Namespace, workdir: Path,
              report_to: str = "none") -> tuple[list[dict[str, Any]], StepClock]:
    """Train the recipe's trainer until `--steps` saturated steps are done (or --max-run-s); return the per-step
    entries of its train_log.json (what RunLog wrote, as the smoke report reads it) and the step clock."""
    from fake_sessions import write_task_list
    from hub_double import LocalHub
    from sessions import make_tasks
    from trl_cpu_shims import NullWeightTransfer, cpu_trainer_shims

    import train_lora

    started = time.monotonic()
    run_dir = Path(tempfile.mkdtemp(prefix=f"{inflight}-{staleness}-{distribution}-", dir=workdir))
    (run_dir / "sandboxes").mkdir()
    env = {"MODEL": str(workdir / "model"), "ADAPTER_REPO": ADAPTER_REPO, "HF_TOKEN": PLACEHOLDER_TOKEN,
           "MAX_STEPS": str(steps := recipe.TRAIN_MEDIUM + recipe.TRAIN_HARD), "SAVE_STEPS": str(steps),
           "OUTPUT_DIR": str(run_dir / "outputs"), "HEARTBEAT_FILE": str(run_dir / "heartbeat"), "DEVICE": "cpu",
           "REPORT_TO": report_to, "DASHBOARD_SPACE": "local", "JOB_ID": run_dir.name, "RESUME": "0",
           "MAX_STALENESS": str(staleness),
           # The trainer trains in its task list's order: the list of the tasks these sessions serve.
           "TASK_DATA": write_task_list(run_dir / "data", [t["task_name"] for t in make_tasks(args.tasks)])}
    settings = train_lora.settings_from_env(env)
    clock = SimClock(run_dir / "clock")
    clock.freeze()
    factory = functools.partial(TimedSessionFactory, distribution, args.minute_s, str(clock.path), args.seed,
                                args.fork_frac, str(run_dir / "sandboxes"), args.tasks)
    batching = contextlib.nullcontext() if args.recipe_batching else one_microbatch_per_step(train_lora)
    with recipe_knobs(inflight), cpu_trainer_shims(), batching:
        trainer = train_lora.build_trainer(settings, factory=factory, weight_transfer=NullWeightTransfer(),
                                           api=LocalHub(run_dir / "hub"))
        assert trainer.args.max_inflight_tasks == inflight and trainer.args.max_staleness == staleness
        steps = StepClock(clock, clock_s(args), warmup_steps(inflight, staleness) + args.steps,
                          time.time() + args.max_run_s - (time.monotonic() - started))
        insert_before_sync(trainer, steps)
        queue = ClockedQueue(trainer.rollout_queue, clock)
        trainer.rollout_queue = queue  # what get_train_dataloader hands TRL's RolloutQueueDataset
        trainer.train()
    steps.waits = queue.waits
    logs = json.loads(recipe.work_file(settings.heartbeat_file, recipe.TRAIN_LOG_NAME).read_text())["logs"]
    return [entry for entry in logs if "loss" in entry], steps


def warmup_steps(inflight: int, staleness: int) -> int:
    """Steps before the pipeline is saturated: the groups of the first wave, then the staleness bound."""
    return -(-inflight // recipe.NUM_GENERATIONS) + staleness


def run_one(inflight: int, staleness: int, distribution: str, args: argparse.Namespace, workdir: Path) -> Row:
    """One table row from TRL's own per-step log of one training run."""
    started = time.monotonic()
    logs, clock = train_run(inflight, staleness, distribution, args, workdir)
    warmup = warmup_steps(inflight, staleness)
    row = Row(inflight, staleness, distribution, over_budget=clock.over_budget,
              compute_s=statistics.median(clock.computes) if clock.computes else math.nan)
    row.finished = sum(entry.get("rollout/finished_total") or 0 for entry in logs)
    row.forked = sum(entry.get("rollout/forked_total") or 0 for entry in logs)
    window = [entry for entry in logs if entry["step"] > warmup]
    if window and len(clock.ends) > warmup:
        row.steps = len(window)
        row.trained = sum(entry["batch/samples_per_step"] for entry in window)
        row.dropped = sum(entry.get(DROPPED_STALE) or 0 for entry in window)
        start, end = clock.ends[warmup - 1], clock.ends[-1]
        row.idle = sum(waited for at, waited in clock.waits if start < at <= end) / (end - start)
        row.minutes_per_step = (end - start) / args.minute_s / row.steps
    row.wall_s = time.monotonic() - started
    return row


# --- Table ----------------------------------------------------------------------------------------------------------
def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def summary_line(row: Row) -> str:
    """The line --quick ends with (percentages of what TRL consumed, and of finished rollouts for forks)."""
    forked = row.forked / row.finished if row.finished else math.nan
    return (f"rollouts: trained {row.trained_frac:.1%} dropped_stale {1 - row.trained_frac:.1%} "
            f"forked {forked:.1%} trainer_idle {row.idle:.1%}")


def parse_settings(raw: str) -> list[tuple[int, int]]:
    """'32:4,32:16' -> [(32, 4), (32, 16)]: (rollouts in flight, max staleness)."""
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in raw.split(",") if item.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or p[0] < recipe.NUM_GENERATIONS or p[1] < 0 for p in pairs):
        raise SystemExit(f"--settings {raw!r}: use IN_FLIGHT:STALENESS pairs, e.g. 32:4,32:16 "
                         f"(in flight >= {recipe.NUM_GENERATIONS}, staleness >= 0)")
    return pairs  # type: ignore[return-value]


FULL_SETTINGS = "32:4,32:8,32:12,32:16,32:24"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the recipe's knobs on the lognormal case only")
    parser.add_argument("--settings", default=None, help=f"IN_FLIGHT:STALENESS pairs (default {FULL_SETTINGS})")
    parser.add_argument("--distributions", default=",".join(DISTRIBUTIONS), help="comma-separated, of: "
                        + ", ".join(DISTRIBUTIONS))
    parser.add_argument("--steps", type=int, default=None, help="saturated steps to measure per row (default 30)")
    parser.add_argument("--minute-s", type=float, default=0.1, help="real seconds per simulated minute")
    parser.add_argument("--step-s", type=float, default=STEP_S, help="trainer seconds per step, simulated")
    parser.add_argument("--fork-frac", type=float, default=0.0, help="share of rollouts whose capture forks")
    parser.add_argument("--tasks", type=int, default=64, help="distinct tasks (prompts) in the dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe-batching", action="store_true", help="the recipe's 8 micro-batches of one sample "
                        "per step (slower; see one_microbatch_per_step)")
    parser.add_argument("--max-run-s", type=float, default=300.0, help="wall-clock cap per row")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    unknown = [d for d in args.distributions.split(",") if d not in DISTRIBUTIONS]
    if unknown:
        parser.error(f"unknown distribution {unknown[0]!r}: use {', '.join(DISTRIBUTIONS)}")
    if args.quick:
        args.settings = args.settings or f"{recipe.MAX_INFLIGHT_ROLLOUTS}:{recipe.MAX_STALENESS}"
        args.distributions = "lognormal"
        args.max_run_s = min(args.max_run_s, 150.0)
    args.settings = parse_settings(args.settings or FULL_SETTINGS)
    args.steps = args.steps or 30
    return args


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tiny_lfm2 import save_tiny_model

    started = time.monotonic()
    print(f"rollout_pipeline: trainer step {args.step_s:.1f} s simulated, 1 simulated minute = {args.minute_s} s, "
          f"{args.steps} saturated steps per row; load average {load_average()}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rollout-pipeline-") as tmp:
        workdir = Path(tmp)
        save_tiny_model(workdir / "model")
        for inflight, staleness in args.settings:
            for distribution in args.distributions.split(","):
                row = run_one(inflight, staleness, distribution, args, workdir)
                rows.append(row)
                print(f"  {' | '.join(row.cells())} | {row.wall_s:.0f} s wall; compute {row.compute_s:.2f} s/step "
                      f"(median), {row.over_budget} longer than the step's {clock_s(args):.2f} s", flush=True)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps([{**vars(r), "trained_frac": r.trained_frac} for r in rows], indent=1))
    over = sum(r.over_budget for r in rows)
    print(f"rollout_pipeline: {len(rows)} rows in {time.monotonic() - started:.0f} s; load average {load_average()}; "
          f"{over} steps computed longer than the step time (the simulated clock stood still meanwhile)")
    if args.quick:
        print(summary_line(rows[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
