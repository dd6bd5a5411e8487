"""The recipe's knobs, in one place.

Every script imports its numbers from here (shell scripts read them with
`python3 recipe.py NAME`), so a knob is changed once and training, eval, launch
and the model card stay in agreement. Version pins live in requirements.txt and
are read from there, not retyped.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# --- Model -----------------------------------------------------------------
BASE_MODEL = "LiquidAI/LFM2.5-2.6B"
# The commit of the base model the recipe's lineage trained and evaluated; every load of its weights,
# tokenizer or config (trainer, vLLM, export) uses it, never the moving `main`.
BASE_MODEL_REVISION = "654f9463ce32b05d0429d76fe1f580b27d4c1ac0"
# Trainer keeps the frozen base in fp32: PEFT merges/unmerges in place every sync, and in bf16
# each cycle adds rounding drift to the frozen weights. vLLM serves bf16.
TRAINER_DTYPE = "float32"
SERVE_DTYPE = "bfloat16"
# Name the policy is served under; the capture proxy and OpenCode address it by this fixed name.
SERVED_MODEL_NAME = BASE_MODEL
# Name the eval server gives the adapter when it serves it as a LoRA next to the base model.
ADAPTER_SERVED_NAME = "opencode-lora"

# --- Images ----------------------------------------------------------------
# Top of trl 1.15's supported vLLM band; ships the lfm2 tool parser.
VLLM_IMAGE = "vllm/vllm-openai:v0.31.0"
VLLM_VERSION = "0.31.0"
# `pip check` breaks the job accepts after installing the training stack into that image, as (package,
# dependency), each with the evidence that our path does not need it (image_check.py enforces the rest;
# tests/image_resolution.json is pip's answer for the whole install step, tests/test_image_install.py checks it).
# - vllm needs mcp>=2,<3, but openenv 0.10 -> fastmcp>=3,<4 -> mcp<2 downgrades it: vLLM 0.31 imports mcp only
#   inside its MCP tool server (entrypoints/mcp/tool_server.py, lazily) and under TYPE_CHECKING; our serve flags
#   never start that server, and vllm.entrypoints.openai.api_server imports with the job's mcp (tested).
PIP_CHECK_ACCEPTED = (("vllm", "mcp"),)
# Every SmolDataEnvs task builds FROM this image; the hf-sandbox backend needs it named in task.toml.
TASK_IMAGE = "docker.io/savatar101/env-data-agent-train:base"

# --- OpenEnv (harbor_env comes from the repo, not the wheel) -----------------
OPENENV_GIT = "https://github.com/huggingface/OpenEnv.git"
# A commit whose envs/harbor_env HarborSession has fetch_training_trace() (TRL 1.15 requires it).
OPENENV_COMMIT = "86a180ede21e044f7929b9a7783ad83aa67d83a3"

# --- Data ------------------------------------------------------------------
TRAIN_DATASET = "FineEnvs/SmolDataEnvs-harbor-train"
TRAIN_REVISION = "4719635555de1666f374d847baebb500d368e493"
TEST_DATASET = "FineEnvs/SmolDataEnvs-harbor-test"
TEST_REVISION = "b130595b579fc6026ad5762925a9a3b40e72f5bb"
TRAIN_MEDIUM = 400
TRAIN_HARD = 600
TEST_TASKS = 250
# data/train.json and data/test.json are the lineage's own lists (data/README.md). `prepare_tasks.py freeze`
# selects lists for other revisions or task pools, in an order seeded by this.
FREEZE_SEED = 20260101
# SHA-256 of every task's tests/grader.py at the pinned revisions (the lineage's corrected, numeric-only
# grader); a task whose grader differs would score answers differently and is refused.
GRADER_SHA256 = "16f906e9248fa8b7e1141939e425e88e59d52d65e98e360bbacef3720a43629f"
# Task data is pulled into each sandbox from this public bucket by the task's healthcheck.
DATA_BUCKET = "AdithyaSK/jupyter-agent-kaggle-all"
# Harbor sandbox backend for every rollout (train and eval): HF Sandboxes, no third-party account.
SANDBOX = "hf-sandbox"
# Tasks shipped with 1 GB were OOM-killed (exit 137) and scored as wrong: 4 GB fixes it.
TASK_CPUS = 1
TASK_MEMORY_MB = 4096

# --- LoRA --------------------------------------------------------------------
LORA_R = 32
LORA_ALPHA = 64
LORA_DROPOUT = 0.0
# Attention q/k/v/out and FFN w1/w2/w3. "self_attn.out_proj", not "out_proj": PEFT matches by
# suffix and a bare "out_proj" also wraps every short-conv conv.out_proj (left out for portability).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "self_attn.out_proj", "w1", "w2", "w3")

# --- Sampling and budgets ----------------------------------------------------
# Full-vocabulary sampling: any truncation breaks trainer/vLLM logprob agreement.
TEMPERATURE = 1.0
TOP_P = 1.0
TOP_K = 0  # TRL config: 0 = disabled.
EVAL_TOP_K = -1  # OpenEnv's eval_sampling accepts -1 or >=1 only; -1 = disabled.
# Output cap per model call, identical in training and eval (a mismatch collapsed a published run).
MAX_TOKENS = 4096
# Model calls per rollout; the loop-owning default is 8, which silently truncates agents.
MAX_TOOL_CALLING_ITERATIONS = 32
# The capture proxy's per-rollout call cap counts OpenCode's auxiliary title-generation call too
# (one per `opencode run`), so the cap is the agent's budget plus that one call.
OPENCODE_AUX_CALLS = 1
AGENT_CALL_LIMIT = MAX_TOOL_CALLING_ITERATIONS + OPENCODE_AUX_CALLS
# vLLM context: the whole 32-turn agent conversation must fit (LFM2.5 context length).
MAX_MODEL_LEN = 32768
# Agent wall-clock limit per rollout. OpenEnv's client gives a rollout call 1800 s in all
# (_ROLLOUT_TIMEOUT_S), sandbox boot and grading included: stay well under it.
AGENT_TIMEOUT_SEC = 1500

# --- Optimisation ------------------------------------------------------------
LEARNING_RATE = 1e-6
MAX_STEPS = 1000
# Smoke run (launch.py smoke, run_job.sh MODE=smoke): every stage of the real job at small scale, inside
# SMOKE_TIMEOUT with a margin (smoke_report.plan prints it). 6 steps: more than the groups in flight
# (MAX_INFLIGHT_ROLLOUTS / NUM_GENERATIONS = 4), so the rollout queue runs ahead of the trainer as it will in the real
# run (its samples reach staleness 5, not MAX_STALENESS: no smoke run drops one); the stage budget decides the count.
SMOKE_STEPS = 6
NUM_GENERATIONS = 8  # One GRPO group of 8 rollouts = one task per step.
# Rollouts in flight and staleness were chosen with benchmarks/rollout_pipeline.py (TRL 1.15's own worker, stale drop
# and step loop; its table and command are in benchmarks/README.md): at least 95% of finished rollouts trained, then
# the most steps per hour for the sandboxes in flight. With ~8-minute rollouts and a 35-50 s step the sandboxes set
# the pace (the trainer waits 56-88% of the time), so steps per hour are the trained share x sandbox throughput.
# 32 sandboxes in flight (4 groups, one HF Sandbox each): the recipe's sandbox budget, kept, since fewer would only
# idle the trainer longer. Set explicitly (train_lora gives TRL's worker this number), not TRL's MAX_STALENESS x 8.
MAX_INFLIGHT_ROLLOUTS = 32
# A group's version is stamped when its first rollout starts and the group is trained only after its slowest rollout,
# while the other 3 groups in flight keep finishing, each one a step. At 4 (TRL's default, the recipe's first value)
# TRL dropped 31-55% of finished rollouts as stale (44% lognormal) and ran 10-21 steps/hour; at 8, 23-31% on the
# three spread-out distributions; at 12 and 16 the exponential one still lost 17% and 5% (9% with the recipe's own
# batching). 24 trained 100% of them on all five distributions, with the recipe's batching too, at 24 steps/hour on
# lognormal instead of 14 (41 h for 1,000 steps instead of 71).
# The importance ratio: each token's ratio is pi_trainer / pi_sampled, pi_sampled being the policy vLLM sampled it
# with, now up to 24 versions old (25 for a step's first sample: TRL checks it one fetch early). Under
# full-vocabulary sampling its expectation is exactly 1 at any staleness (E_q[p/q] = 1), so the step mean TRL logs as
# `ratio` and the band below (RATIO_MIN-RATIO_MAX, checked on it by smoke_report.ratio_band; the rehearsal's own band
# is for its random model) keep their meaning: staleness widens the per-token spread (clip_ratio/*,
# ratio/sample_min|max), which TRL's clipped objective bounds, not the mean.
MAX_STALENESS = 24
SAVE_STEPS = 100  # Checkpoint (and push) every 100 optimizer steps.

# --- Reward ------------------------------------------------------------------
# reward = CORRECT_REWARD * env_reward + TOOL_BONUS * max(0, (TOOL_BUDGET - tool_calls) / TOOL_BUDGET),
# the bonus only on correct answers (so it cannot reward giving up).
CORRECT_REWARD = 1.0
TOOL_BONUS = 0.1
TOOL_BUDGET = MAX_TOOL_CALLING_ITERATIONS

# --- Jobs, GPUs, ports -------------------------------------------------------
# launch.py's own environment: run_job(expose_public=...) exists only from this huggingface_hub on.
LAUNCHER_HUB_MIN = "2.1.1"
TRAIN_FLAVOR = "h200x2"
TRAIN_TIMEOUT = "72h"
SMOKE_TIMEOUT = "2h"
EVAL_FLAVOR = "h200"
EVAL_WATCH_TIMEOUT = "48h"
EVAL_TIMEOUT = "12h"
EVAL_WATCH_TASKS = 100  # Fixed test subset for the live learning curve.
MAX_IDLE_HOURS = 6.0  # Eval watcher stops after this long without a new checkpoint.
# An unscorable eval cell (infrastructure failure, not a wrong answer) is tried at most this often in all.
EVAL_CELL_ATTEMPTS = 3
EVAL_CONCURRENCY = 16  # Eval rollouts in flight at once (one HF Sandbox each).
EVAL_SEED = 20260102  # Seeds the watcher's fixed task subset and the bootstrap interval.
BOOTSTRAP_SAMPLES = 10000  # Paired-bootstrap resamples for the base-vs-adapter difference.
EVAL_POLL_SECONDS = 300  # Eval watcher polls the adapter repo this often.
EVAL_PUSH_EVERY = 10  # Evals push partial results every N cells, so a killed eval resumes on any machine.
# This many unscorable eval cells in a row means vLLM, the env server or the sandboxes are down: stop
# loudly (finished cells are kept, a rerun resumes) instead of recording a whole eval of failures.
EVAL_ABORT_STREAK = 32
# Eval jobs are single-GPU (h200); in the training job GPU 0 is free once training has ended.
EVAL_GPU = "0"
TRAINER_GPU = "0"
VLLM_GPU = "1"
# The only port exposed by the Job; serves nothing but /capture.
PUBLIC_PORT = 8000
ENV_PORT = 8001  # Env server task API, loopback only.
VLLM_PORT = 8100  # vLLM, loopback only: its dev endpoints are unauthenticated.
LOOPBACK = "127.0.0.1"
# Stall watchdog (run_job.sh). Progress = an optimizer step or, while the trainer waits for rollouts, a finished
# rollout (rollout_guard.refresh_heartbeat). Every rollout call ends, done or failed, within OpenEnv's Harbor client
# message timeout (openenv/harbor/client.py, 1800 s: sandbox boot, agent and grading); a session's create() and the
# task API time out after 120 s (HarborEnv's HTTP client); TRL fails the run itself if its rollout child is not up
# within 300 s (child_ready_timeout). Rollout slots are refilled at once, so on a healthy run the next rollout ends
# at most TASK_API_TIMEOUT_S + ROLLOUT_CALL_LIMIT_S after the previous one, and the first one at most
# WORKER_START_LIMIT_S + cold weight sync + that after training begins. STALL_MARGIN_S covers the cold sync (seconds
# over NVLink) and the watchdog's own poll. A trainer busy with a step beats when the step ends; a step plus its
# checkpoint push (PUSH_RETRIES attempts, 450 s of backoff in all) stays far inside the limit.
# (300 + 120 + 1800 + 180) s = 2400 s = 40 minutes: a healthy run always beats within it, a real stall fails the job.
ROLLOUT_CALL_LIMIT_S = 1800
TASK_API_TIMEOUT_S = 120
WORKER_START_LIMIT_S = 300
STALL_MARGIN_S = 180
STALL_MINUTES = -(-(WORKER_START_LIMIT_S + TASK_API_TIMEOUT_S + ROLLOUT_CALL_LIMIT_S + STALL_MARGIN_S) // 60)
# Rollout guard (rollout_guard.py): an infrastructure failure costs one rollout (unscorable, counted); these stop
# the job. A streak of one whole wave of in-flight rollouts (MAX_INFLIGHT_ROLLOUTS, 32): at even a 25% independent
# failure rate 32 in a row has probability 0.25**32 ~ 5e-20, so a streak
# means a shared cause (env server, vLLM, sandboxes or the capture path down), and it is seen within one wave.
ROLLOUT_ABORT_STREAK = MAX_INFLIGHT_ROLLOUTS
# Or an intermittent shared cause: more than half of the last 256 rollouts (32 groups, about 32 steps) unscorable.
# A healthy run loses a few percent; at 10% independent failures, 129+ of 256 has probability below 1e-40.
ROLLOUT_WINDOW = 256
ROLLOUT_MAX_UNSCORABLE = 0.5
WATCH_INTERVAL_S = 30  # Watchdog: seconds between its checks.
READY_TIMEOUT_S = 1800  # vLLM and the env server must answer their health check within this (model download).
# Env server sessions at once (OpenEnv's default is 4): every in-flight rollout holds one, and the
# ones past the cap fail with SessionCapacityError. Must exceed training and eval concurrency.
ENV_MAX_SESSIONS = 64
# OpenCode release the sandboxes install (Harbor's default floats); the x-api-key seam was checked on it.
OPENCODE_VERSION = "1.18.33"
PUSH_RETRIES = 5
# First wait between push attempts, doubled each retry (30+60+120+240 s rides out a Hub blip).
PUSH_BACKOFF_S = 30.0

# Trainer weight-sync modes (weight_sync.py): TRL's merge -> send -> unmerge, or the merge-free stream.
WEIGHT_SYNC_MODES = ("merge_free", "stock")
# --- Dashboard -----------------------------------------------------------------
# Where training and eval metrics go (env REPORT_TO per run): Trackio, TensorBoard (needs `pip install
# tensorboard`; the evals then log nothing to a dashboard) or none.
REPORTERS = ("trackio", "tensorboard", "none")
REPORT_TO = "trackio"
# Trackio dashboard Space, created private under the HF token's owner (env DASHBOARD_SPACE; "local" = no Space,
# Trackio logs on the machine only). Training, the eval watcher and the final eval all log to it.
DASHBOARD_SPACE = "lfm-opencode-lora-rl-dashboard"
# --- Smoke run -------------------------------------------------------------
# The smoke run checkpoints every SMOKE_SAVE_STEPS (steps 2, 4 and 6: three pushes read back from the Hub);
# its first trainer start stops right after checkpoint-SMOKE_SAVE_STEPS and a second start resumes from the Hub.
SMOKE_SAVE_STEPS = 2
# Held-out tasks of the smoke's final eval (base and adapter: 2 x 4 = 8 cells, one wave at EVAL_CONCURRENCY).
SMOKE_EVAL_TASKS = 4
# Tasks of the eval-watch smoke launch (launch.py eval-watch --smoke): one short wave per checkpoint. Its cap: the
# smoke job's, plus an hour for the waves after the smoke's final adapter lands (base, 3 checkpoints, final).
SMOKE_WATCH_TASKS = 2
SMOKE_WATCH_TIMEOUT = "3h"
# The importance ratio (trainer / vLLM probabilities, TRL's logged `ratio`) the recipe expects with full-vocabulary
# sampling and bf16 serving; a step outside it means trainer and vLLM disagree on the policy: NO-GO.
RATIO_MIN = 0.998
RATIO_MAX = 1.0
RATIO_TOLERANCE = 0.002  # bf16 rounding of the served logprobs either side of the band, on a per-step mean.

# Smoke stage budget, in seconds (typical durations; smoke_report.plan sums them against SMOKE_TIMEOUT).
# Job start: the image pull, `pip install huggingface_hub` and the bundle download happen before run_job.sh runs.
SMOKE_JOB_START_S = 300
# Install: apt git/curl + the pinned stack next to the image's torch and vLLM (~105 s for the whole stack with
# torch measured on a CPU machine; x3 for PyPI and the image's larger dependency set).
SMOKE_INSTALL_S = 300
# OpenEnv clone (blob-less, one commit), the seam check and 1,000 train task folders from the Hub.
SMOKE_PREPARE_S = 300
# vLLM: ~5 GB of bf16 weights downloaded, loaded and CUDA graphs captured; then the env server and the gateway.
SMOKE_SERVERS_S = 600
# A trainer start: fp32 model load, TRL's rollout child (TRL itself fails past WORKER_START_LIMIT_S) and the cold
# sync; on the second start also the verified download of the checkpoint (adapter + optimizer state, ~0.5 GB).
SMOKE_TRAINER_START_S = WORKER_START_LIMIT_S
# The first step of a run waits for one whole group of NUM_GENERATIONS rollouts (TRL trains a group only when all of
# it is done), and a rollout may legally run to OpenEnv's call limit (agent timeout AGENT_TIMEOUT_SEC plus sandbox
# boot and grading): the first start's first step is budgeted at that, a whole slow group.
SMOKE_SLOW_GROUP_S = TASK_API_TIMEOUT_S + ROLLOUT_CALL_LIMIT_S
# Any later step, the resumed start's first step included: the recipe's early step time (~90 s/step before the queue
# saturates) with a third more. A second slow group overruns this; the smoke deadline then stops the stage and the
# report says NO-GO within the cap (agents at the timeout twice in 6 steps would make the real run crawl too).
SMOKE_STEP_S = 120
# One checkpoint push (adapter + optimizer state, ~0.5 GB, one commit) or read-back (verified download).
SMOKE_PUSH_S = 60
# Final eval: vLLM restarted in LoRA mode (weights cached), the 250 test task folders, the env server, then one wave
# of 2 x SMOKE_EVAL_TASKS cells at the typical rollout time (a slow wave overruns: the deadline stops it, NO-GO).
SMOKE_EVAL_SERVERS_S = 300
SMOKE_EVAL_WAVE_S = 600
# The report: reads the Hub back, pushes smoke_report.json. Reserved at the end: every stage before it runs under a
# deadline of SMOKE_TIMEOUT minus this and the job start, so a report always lands before the platform kills the job.
SMOKE_REPORT_S = 180
# The plan must leave at least this share of SMOKE_TIMEOUT unbudgeted (tests/test_smoke_report.py checks it).
SMOKE_MIN_MARGIN = 0.10

# --- Checks shared by every entry point ----------------------------------------
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REQUIREMENTS = Path(__file__).with_name("requirements.txt")


class ConfigError(ValueError):
    """A bad input found before any GPU time is spent; the message says how to fix it."""


def require_repo_id(value: str | None, var: str) -> str:
    """Return `value` if it is an `owner/name` repo id; otherwise explain the expected form."""
    if not value:
        raise ConfigError(f"{var} is not set: set it to your repo id, e.g. {var}=you/LFM2.5-2.6B-opencode-lora-RL")
    if not _REPO_ID.match(value) or ".." in value or value.endswith((".", "-")):
        raise ConfigError(f"{var}={value!r} is not a valid repo id: use 'owner/name' (letters, digits, . _ -)")
    return value


def require_token(env: dict[str, str] | None = None) -> str:
    """Return HF_TOKEN from the environment, or explain how to provide it."""
    token = (env if env is not None else os.environ).get("HF_TOKEN", "").strip()
    if not token:
        raise ConfigError("HF_TOKEN is not set: pass it as a job secret (secrets={'HF_TOKEN': ...}) or export it")
    return token


# --- Environment knobs: one check each, shared by launch.py, the job scripts and the Python entry points ----
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def yes_no(raw: str, var: str) -> bool:
    """A yes/no setting in any case; anything else is refused, so a typo in DRY_RUN never launches a real run."""
    word = raw.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ConfigError(f"{var}={raw!r} is not a yes/no value: use {var}=1 (or true, yes, on) "
                      f"or {var}=0 (or false, no, off)")


def whole_number(raw: str, var: str, upper: int | None = None, why: str = "") -> int:
    """A whole number in 1..upper (no upper bound when upper is None)."""
    span = f"1..{upper}" if upper else "a whole number >= 1"
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a whole number: use {span}") from None
    if value < 1 or (upper is not None and value > upper):
        raise ConfigError(f"{var}={value} is out of range: use {span}" + (f" ({why})" if why else ""))
    return value


def positive_number(raw: str, var: str) -> float:
    """A number > 0 (minutes, hours, seconds)."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"{var}={raw!r} is not a positive number: use e.g. {var}=1.5")
    return value


def one_of(raw: str, var: str, choices: tuple[str, ...]) -> str:
    """One of a fixed set of words."""
    if raw.strip() not in choices:
        raise ConfigError(f"{var}={raw!r} is not one of {', '.join(choices)}")
    return raw.strip()


def checkpoint_name(raw: str, var: str) -> str:
    """'final' (the adapter at the repo root) or 'checkpoint-N', the folder names the trainer pushes."""
    from adapter_repo import is_checkpoint  # the repo layout's own rule (adapter_repo imports this module)

    if not is_checkpoint(raw.strip()):
        raise ConfigError(f"{var}={raw!r} is not a checkpoint name: use 'final' or e.g. 'checkpoint-300'")
    return raw.strip()


def _stall_seconds(env: Mapping[str, str]) -> int:
    return math.ceil(knob("STALL_MINUTES", env) * 60)


def _step_or_off(raw: str, var: str) -> int:
    """0 (off) or a step number."""
    return 0 if raw.strip() == "0" else whole_number(raw, var)


_port = functools.partial(whole_number, upper=65535)
# name -> (default, or a function of the environment giving it; check(raw, name) -> value)
ENV_KNOBS: dict[str, tuple[Any, Callable[[str, str], Any]]] = {
    "DRY_RUN": (False, yes_no),
    "DEBUG": (False, yes_no),  # a failing script prints its traceback before its one-line message
    "RESUME": (True, yes_no),
    "FINAL_EVAL": (True, yes_no),
    "LORA": (False, yes_no),
    "ALLOW_NON_LOOPBACK": (False, yes_no),
    "MAX_STEPS": (MAX_STEPS, functools.partial(whole_number, upper=TRAIN_MEDIUM + TRAIN_HARD,
                                               why="one training task per step")),
    "SAVE_STEPS": (SAVE_STEPS, whole_number),
    "WEIGHT_SYNC": (WEIGHT_SYNC_MODES[0], functools.partial(one_of, choices=WEIGHT_SYNC_MODES)),
    "STALL_MINUTES": (STALL_MINUTES, positive_number),
    "STALL_SECONDS": (_stall_seconds, whole_number),
    "WATCH_INTERVAL": (WATCH_INTERVAL_S, positive_number),
    "READY_TIMEOUT": (READY_TIMEOUT_S, whole_number),
    "N_TASKS": (EVAL_WATCH_TASKS, functools.partial(whole_number, upper=TEST_TASKS, why="tasks in data/test.json")),
    "CHECKPOINT": ("final", checkpoint_name),
    "MAX_IDLE_HOURS": (MAX_IDLE_HOURS, positive_number),
    "EVAL_CONCURRENCY": (EVAL_CONCURRENCY, whole_number),
    "EVAL_MODE": ("full", functools.partial(one_of, choices=("full", "watch"))),
    "EVAL_TASKS": (TEST_TASKS, functools.partial(whole_number, upper=TEST_TASKS, why="tasks in data/test.json")),
    "MODE": ("train", functools.partial(one_of, choices=("train", "smoke"))),
    "STOP_AFTER_STEP": (0, _step_or_off),
    "MAX_LORAS": (1, whole_number),
    "POLICY_PORT": (VLLM_PORT, _port),
    "ENV_PORT": (ENV_PORT, _port),
    "PUBLIC_PORT": (PUBLIC_PORT, _port),
}


def knob(name: str, env: Mapping[str, str] | None = None, value: object = None) -> Any:
    """The checked value of knob `name`: `value` (a command-line flag) if given, else the environment's, else
    the default. Unset or empty means the default; a bad value raises ConfigError naming `name`."""
    env = os.environ if env is None else env
    default, check = ENV_KNOBS[name]
    raw = str(value if value is not None else env.get(name, "")).strip()
    if not raw:
        return default(env) if callable(default) else default
    return check(raw, name)


def shell_value(value: object) -> str:
    """How a checked knob is written back into an environment: flags as 1/0, 6.0 as 6."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def pinned_versions(path: Path = REQUIREMENTS) -> dict[str, str]:
    """Map distribution name -> version specifier, as pinned in requirements.txt."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*([<>=!~].*)$", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2).replace(" ", "")
    return pins


def check_versions(names: tuple[str, ...] = ("trl", "transformers"), path: Path = REQUIREMENTS) -> None:
    """Raise ConfigError if an installed package is outside the pinned version window."""
    from importlib import metadata  # here, not at the top: it was two thirds of every shell script's recipe.py call

    from packaging.specifiers import SpecifierSet

    pins = pinned_versions(path)
    for name in names:
        spec = pins[name]
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise ConfigError(f"{name} is not installed: pip install '{name}{spec}' (see requirements.txt)") from None
        if found not in SpecifierSet(spec):
            raise ConfigError(f"{name} {found} is installed, the recipe needs {name}{spec}: pip install '{name}{spec}'")


def _print_env_knobs(names: list[str]) -> None:
    """`recipe.py --env NAME...`: NAME=value per line, each checked; a bad one exits with its one-line fix."""
    unknown = [name for name in names if name not in ENV_KNOBS]
    if unknown:
        sys.exit(f"recipe.py: unknown environment knob {unknown[0]!r}")
    try:
        lines = [f"{name}={shell_value(knob(name))}" for name in names]
    except ConfigError as exc:
        sys.exit(str(exc))
    print("\n".join(lines))


def _shell_knobs() -> dict[str, str]:
    """Every knob a shell script may read (upper-case scalars and tuples), as text: tuples comma-joined."""
    return {name: ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            for name, value in globals().items()
            if name.isupper() and not name.startswith("_") and isinstance(value, (str, int, float, tuple))}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--env"]:
        _print_env_knobs(sys.argv[2:])
        sys.exit(0)
    shell_knobs = _shell_knobs()
    if sys.argv[1:] == ["--all"]:  # NAME=value per line: common.sh reads every knob in one Python start
        print("\n".join(f"{name}={value}" for name, value in shell_knobs.items()))
        sys.exit(0)
    # `python3 recipe.py NAME [NAME ...]` prints each knob, one per line (for shell scripts).
    for name in sys.argv[1:]:
        if name not in shell_knobs:
            sys.exit(f"recipe.py: unknown knob {name!r}")
        print(shell_knobs[name])
