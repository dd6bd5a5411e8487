"""The recipe's knobs, in one place: every script reads its numbers here (shell scripts through `python3 recipe.py`),
so training, eval, launch and the model card agree. Each value has a one-line reason (the derivations: docs/recipe.md);
KNOBS declares every environment knob, checked alike by launch.py, the job scripts and the Python entry points."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --- Model -------------------------------------------------------------------------------------------------------
BASE_MODEL = "LiquidAI/LFM2.5-2.6B"
BASE_MODEL_REVISION = "654f9463ce32b05d0429d76fe1f580b27d4c1ac0"  # the lineage's commit: every load pins it
TRAINER_DTYPE = "float32"  # a bf16 base drifts with every in-place merge/unmerge
SERVE_DTYPE = "bfloat16"
SERVED_MODEL_NAME = BASE_MODEL  # the fixed name the capture proxy and OpenCode address the policy by
ADAPTER_SERVED_NAME = "opencode-lora"  # the adapter's name beside the base model on the eval server

# --- Images ------------------------------------------------------------------------------------------------------
VLLM_IMAGE = "vllm/vllm-openai:v0.31.0"  # top of trl 1.15's vLLM band; ships the lfm2 tool parser
VLLM_VERSION = "0.31.0"
PIP_CHECK_ACCEPTED = (("vllm", "mcp"),)  # pip check's (package, dependency) breaks let pass: docs/recipe.md says why
TASK_IMAGE = "docker.io/savatar101/env-data-agent-train:base"  # every task builds FROM it; hf-sandbox needs it named

# --- Data --------------------------------------------------------------------------------------------------------
TRAIN_DATASET = "FineEnvs/SmolDataEnvs-harbor-train"
TRAIN_REVISION = "4719635555de1666f374d847baebb500d368e493"
TEST_DATASET = "FineEnvs/SmolDataEnvs-harbor-test"
TEST_REVISION = "b130595b579fc6026ad5762925a9a3b40e72f5bb"
TRAIN_MEDIUM = 400
TRAIN_HARD = 600
TEST_TASKS = 250
# Every task's tests/grader.py (the lineage's numeric-only grader): a task whose grader differs is refused.
GRADER_SHA256 = "16f906e9248fa8b7e1141939e425e88e59d52d65e98e360bbacef3720a43629f"
# Harbor's backend (env SANDBOX): its key sets (any one, in full), SDK settings and pins (docs/sandboxes.md).
SANDBOX = "hf-sandbox"
SANDBOXES: dict[str, dict[str, Any]] = {
    "hf-sandbox": {"keys": (("HF_TOKEN",),), "requirements": ""},
    # opentelemetry: the vLLM image's family; daytona's newest instrumentation would move it (5 pip check breaks)
    "daytona": {"keys": (("DAYTONA_API_KEY",), ("DAYTONA_JWT_TOKEN", "DAYTONA_ORGANIZATION_ID")),
                "settings": ("DAYTONA_API_URL", "DAYTONA_TARGET"),
                "requirements": "harbor[daytona]\ndaytona==0.226.1\nopentelemetry-exporter-otlp==1.45.1\n"},
    "e2b": {"keys": (("E2B_API_KEY",),), "requirements": "harbor[e2b]\ne2b==2.63.0\n"},
}
E2B_HOBBY_CONCURRENCY = 20  # E2B Hobby's sandboxes at once, under MAX_INFLIGHT_ROLLOUTS: warned (not visible offline)
TASK_CPUS = 1
TASK_MEMORY_MB = 4096  # at 1 GB tasks were OOM-killed and scored as wrong

# --- LoRA --------------------------------------------------------------------------------------------------------
LORA_R = 32
LORA_ALPHA = 64
LORA_DROPOUT = 0.0
# "self_attn.out_proj": PEFT matches suffixes, and a bare "out_proj" also wraps every short-conv conv.out_proj.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "self_attn.out_proj", "w1", "w2", "w3")

# --- Sampling and budgets ----------------------------------------------------------------------------------------
# Full-vocabulary sampling: any truncation breaks trainer/vLLM logprob agreement.
TEMPERATURE = 1.0
TOP_P = 1.0
TOP_K = 0  # TRL config: 0 = disabled.
EVAL_TOP_K = -1  # OpenEnv's eval_sampling accepts -1 or >=1 only; -1 = disabled.
MAX_TOKENS = 4096  # per model call, training and eval alike (a mismatch collapsed a published run)
MAX_TOOL_CALLING_ITERATIONS = 32  # model calls per rollout; the loop-owning default of 8 truncates agents
OPENCODE_AUX_CALLS = 1  # OpenCode's title call per `opencode run`, which the proxy's call cap counts too
AGENT_CALL_LIMIT = MAX_TOOL_CALLING_ITERATIONS + OPENCODE_AUX_CALLS
MAX_MODEL_LEN = 32768  # LFM2.5's context; a longer conversation ends its agent (`context_exhausted`)
AGENT_TIMEOUT_SEC = 1500  # under OpenEnv's 1800 s per rollout call, which sandbox boot and grading share

# --- Optimisation ------------------------------------------------------------------------------------------------
LEARNING_RATE = 1e-6  # env LEARNING_RATE; docs/training.md: what to watch before raising it
MAX_STEPS = 1000  # steps of NUM_GENERATIONS rows; a forked rollout is several rows (docs/recipe.md)
SMOKE_STEPS = 20  # the recipe's "~40-min smoke run", more than the 4 groups in flight; a larger one is refused
SMOKE_MIN_STEPS = 2  # a checkpoint, a stop, a resume and a step after it
NUM_GENERATIONS = 8  # one GRPO group: 8 rollouts of one task, one advantage baseline
MAX_INFLIGHT_ROLLOUTS = 32  # the recipe's sandbox budget (4 groups); fewer only idle the trainer longer
MAX_STALENESS = 24  # env MAX_STALENESS; 4 dropped 31-55% of finished rollouts as stale, 24 none (docs/recipe.md)
STALENESS_SPLIT = 4  # rows at most this stale are `fresh` in the kl and clip metrics (TRL's default max_staleness)
SAVE_STEPS = 100  # checkpoint (and push) every 100 optimizer steps
MAX_CHECKPOINTS = 20  # a run's most: each is a ~0.5 GB push and an eval by the watcher

# --- Reward ------------------------------------------------------------------------------------------------------
# reward = CORRECT_REWARD * grade + TOOL_BONUS * max(0, (TOOL_BUDGET - tool_calls) / TOOL_BUDGET), the bonus on correct
# answers only, so it cannot reward giving up (its weight in an all-correct group: docs/training.md).
CORRECT_REWARD = 1.0
TOOL_BONUS = 0.1
TOOL_BUDGET = MAX_TOOL_CALLING_ITERATIONS

# --- Jobs, GPUs, ports -------------------------------------------------------------------------------------------
LAUNCHER_HUB_MIN = "2.1.1"  # run_job(expose_public=...) exists from this huggingface_hub on
TRAIN_FLAVOR = "h200x2"
TRAIN_TIMEOUT = "72h"
EVAL_FLAVOR = "h200"
EVAL_WATCH_TIMEOUT = "48h"
EVAL_TIMEOUT = "12h"
EVAL_WATCH_TASKS = 100  # the live learning curve's fixed test subset
# What a run costs (launch.py's cost lines): the recipe's figures and the pipeline simulation's (docs/recipe.md).
RECIPE_TRAIN_HOURS = (10, 25)
RECIPE_SMOKE_MINUTES = 40
SIMULATED_TRAIN_HOURS = (27, 47)
SIMULATED_SANDBOX_MINUTES_PER_STEP = (51, 90)
TYPICAL_ROLLOUT_MINUTES = 8
MAX_IDLE_HOURS = 6.0  # the eval watcher stops after this long without a new checkpoint
EVAL_CELL_ATTEMPTS = 3  # tries of an unscorable eval cell (an infrastructure failure, not a wrong answer)
EVAL_CONCURRENCY = 16  # eval rollouts in flight (one sandbox each)
EVAL_SEED = 20260102  # seeds the watcher's fixed task subset and the bootstrap interval
BOOTSTRAP_SAMPLES = 10000  # paired-bootstrap resamples for the base-vs-adapter difference
EVAL_POLL_SECONDS = 300  # the eval watcher polls the adapter repo this often
EVAL_PUSH_EVERY = 10  # cells between partial pushes, so a killed eval resumes on any machine
EVAL_ABORT_STREAK = 32  # unscorable cells in a row: a server is down; stop loudly (a rerun resumes)
EVAL_GPU = "0"  # eval jobs have one GPU; in the training job GPU 0 is free once training has ended
TRAINER_GPU = "0"
VLLM_GPU = "1"
PUBLIC_PORT = 8000  # the only port the job exposes; serves nothing but /capture
ENV_PORT = 8001  # the env server's task API, loopback only
VLLM_PORT = 8100  # loopback only: vLLM's dev endpoints are unauthenticated
PORT_KNOBS = ("POLICY_PORT", "ENV_PORT", "PUBLIC_PORT")  # the job's port knobs: vLLM, the env server, the gateway
LOOPBACK = "127.0.0.1"
# Stall watchdog (run_job.sh): TRL's, Harbor's and OpenEnv's own limits plus a margin, 40 minutes (docs/recipe.md).
ROLLOUT_CALL_LIMIT_S = 1800  # OpenEnv's Harbor client: one rollout call, sandbox boot to grade
TASK_API_TIMEOUT_S = 120  # a session's create() and the task API (HarborEnv's HTTP client)
WORKER_START_LIMIT_S = 300  # TRL fails a rollout child not up by then (child_ready_timeout)
STALL_MARGIN_S = 180  # the cold weight sync and the watchdog's own poll
STALL_MINUTES = -(-(WORKER_START_LIMIT_S + TASK_API_TIMEOUT_S + ROLLOUT_CALL_LIMIT_S + STALL_MARGIN_S) // 60)
STALL_MINUTES_MIN = ROLLOUT_CALL_LIMIT_S // 60  # one healthy rollout may take the whole call limit
ROLLOUT_SETUP_BUDGET_S = ROLLOUT_CALL_LIMIT_S - AGENT_TIMEOUT_SEC  # a rollout's time outside its agent run
SANDBOX_IDLE_MARGIN_S = 300  # a trial at its call limit keeps its sandbox while the env server copies the logs back
# HF Sandbox idle timeout (35 min): a running command is no activity to it, so a whole trial may look idle.
SANDBOX_IDLE_TIMEOUT_S = AGENT_TIMEOUT_SEC + ROLLOUT_SETUP_BUDGET_S + SANDBOX_IDLE_MARGIN_S
FAILED_TRIALS_KEEP_MB = 2048  # unscorable rollouts' trial folders kept, newest first (scored ones are removed)
# Rollout guard (train_rollouts.py): a wave of unscorable rollouts in a row, or half a window, stops the job.
ROLLOUT_ABORT_STREAK = MAX_INFLIGHT_ROLLOUTS
ROLLOUT_WINDOW = 256
ROLLOUT_MAX_UNSCORABLE = 0.5
WATCH_INTERVAL_S = 30  # seconds between the watchdog's checks
WATCH_INTERVAL_MAX_S = 300  # the watchdog sees a stall or a dead server only at its checks
READY_TIMEOUT_S = 1800  # vLLM and the env server answer their health check within this (model download)
ENV_MAX_SESSIONS = 64  # the env server's sessions (OpenEnv's default 4); above every rollout count in flight
# The public gateway's limits (capture_gateway.py; what each stops: docs/jobs.md).
CAPTURE_MAX_BODY_BYTES = 8 * 1024 * 1024  # 10x the largest request the model's context can take
GATEWAY_MAX_HEAD_BYTES = 16 * 1024  # OpenCode 1.18.33's request heads are ~460 bytes
GATEWAY_HEAD_TIMEOUT_S = 15
GATEWAY_BODY_TIMEOUT_S = 60
GATEWAY_IDLE_CONNECTIONS = 256  # past this many idle connections the longest-waiting is closed (no live session)
GATEWAY_SESSION_READ_S = 0.5  # the live session keys are read at most this often, however many made-up keys arrive
GATEWAY_RESTARTS = 5  # serve_env.sh restarts an exited gateway this often in a row...
GATEWAY_STABLE_S = 600  # ...and a gateway that served this long resets the count
ENV_PING_TIMEOUT_S = 300  # a rollout's keepalive to the env server; OpenEnv's 20 s dropped rollouts on a loaded server
OPENCODE_VERSION = "1.18.33"  # the sandboxes' OpenCode (Harbor's default floats); the x-api-key seam is checked on it
# Hub writes (adapter_repo.with_retries): attempts, and the first wait of each kind, doubled each retry.
PUSH_RETRIES = 5
PUSH_BACKOFF_S = 30.0  # a failed push: 30+60+120+240 s rides out a Hub blip
CONFLICT_BACKOFF_S = 5.0  # HTTP 409, another writer's commit in progress (three writers share the repo)
WEIGHT_SYNC_MODES = ("merge_free", "stock")  # train_weight_sync.py's stream, or TRL's merge -> send -> unmerge
REPORTERS = ("trackio", "none")  # the job installs no tensorboard (it failed at trainer start)
REPORT_TO = "trackio"
DASHBOARD_SPACE = "lfm-opencode-lora-rl-dashboard"  # private, under the token's owner (env DASHBOARD_SPACE)
NO_SPACE = "local"  # DASHBOARD_SPACE value: no Space, Trackio logs on the machine only

# --- Smoke run ---------------------------------------------------------------------------------------------------
SMOKE_SAVE_STEPS = 5  # the first start stops after the first push, the second resumes from the Hub
SMOKE_EVAL_TASKS = 4  # the final eval's held-out tasks: 2 x 4 cells, one wave
SMOKE_WATCH_TASKS = 2  # eval-watch --smoke: one short wave per checkpoint...
SMOKE_WATCH_EXTRA_S = 3600  # ...its cap the smoke job's plus this, for the waves after the final adapter lands
SMOKE_TIMEOUT = "8h"  # the 20-step smoke's worst case plus a tenth (tests/test_smoke_report.py adds it up)
SMOKE_REPORT_RESERVE_S = 1800  # its stages stop this long before the cap, so that the report still lands
SMOKE_START_UP_S = 3780  # a healthy smoke beside its steps: start, install, servers, pushes, final eval, report
# The verdict's limits (smoke_report.assess; each failed one is a NO-GO line; why each: docs/recipe.md). The median
# step's token-weighted importance ratio: truncated sampling moves it, staleness cannot; widened for bf16 serving.
RATIO_MIN = 0.998
RATIO_MAX = 1.0
RATIO_TOLERANCE = 0.002
SMOKE_KL_MAX = 0.01  # TRL's kl for the median step: 55x a healthy run's
SMOKE_ZERO_CONTRAST_WARN = 0.5  # warned: most rows from zero-contrast groups train nothing
SMOKE_MAX_UNSCORABLE = 0.10  # over a tenth of ~160 rollouts is a shared cause the 72-hour run would pay for
SMOKE_MAX_STALE = 0.05  # samples TRL dropped as stale (the pipeline's goal: 95 % of finished rollouts trained)
SMOKE_MAX_FORK = 0.05  # rollouts whose capture forked into several training rows

# --- The job's work folder: beside the trainer's HEARTBEAT_FILE, read by the watchdog and the smoke report --------
ROLLOUT_STATE = "rollout_state.json"  # TRL 1.15's resume position in every checkpoint folder
CONSUMED_AHEAD = "consumed_ahead"  # train_resume.py's key in it: groups consumed past prompt_index, skipped on resume
HEARTBEAT_NAME = "heartbeat"  # `<step> <unix time>` per step, re-dated per finished rollout; the watchdog reads mtime
TRAIN_LOG_NAME = "train_log.json"  # every trainer start and every logged step's metrics, across a resume
LEDGER_NAME = "rollouts.json"  # the rollout counts of the trainer start running now
ROLLOUT_LOG_NAME = "rollout_log.jsonl"  # one line per finished rollout, across starts (fields: docs/training.md)
TRAJECTORIES_NAME = "trajectories.json"  # the last TRAJECTORY_SAMPLE trajectories; each push commits them
TRAJECTORY_SAMPLE = 8
KEPT_LEDGER_GLOB = "rollouts.start-*.json"  # the earlier starts' ledgers, * their number in start order
STAGES_NAME = "stages"  # the smoke job's stage starts and ends (common.sh's step)


def work_file(heartbeat_file: str | Path, name: str) -> Path:
    """The work folder's file `name`: in the heartbeat's folder."""
    return Path(heartbeat_file).with_name(name)


def kept_ledgers(folder: str | Path) -> list[Path]:
    """The earlier trainer starts' kept-aside ledgers in `folder`, in start order."""
    numbered = {path.name.split("-")[-1].removesuffix(".json"): path for path in Path(folder).glob(KEPT_LEDGER_GLOB)}
    return [numbered[n] for n in sorted(filter(str.isdigit, numbered), key=int)]


def keep_ledger_aside(folder: str | Path) -> Path | None:
    """Before a later trainer start: move the last start's ledger aside, numbered after the kept ones; None if none."""
    ledger = Path(folder) / LEDGER_NAME
    if not ledger.is_file():
        return None
    last = max((int(path.name.split("-")[-1].removesuffix(".json")) for path in kept_ledgers(folder)), default=0)
    return ledger.replace(Path(folder) / KEPT_LEDGER_GLOB.replace("*", str(last + 1)))


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` so that a reader sees the old file or the new one, never half, under a temporary name of its own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False) as tmp:
        tmp.write(text)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp.name, path)


def write_json(path: str | Path, doc: Any, *, indent: int | None = None, sort_keys: bool = False) -> None:
    """`doc` as JSON, written atomically (write_atomic)."""
    write_atomic(path, json.dumps(doc, indent=indent, sort_keys=sort_keys))


def read_json(path: str | Path) -> Any:
    """The JSON document at `path`, or None while it does not exist yet (or is not JSON)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


# --- Rewards: the rule the training sessions, the rollout guard and the eval share --------------------------------
def graded_reward(result: Any) -> float | None:
    """The grade a finished rollout earned (an agent timeout's too), or None: no reward, no agent turn reaching the
    model, or a call failed at the engine (docs/recipe.md). `result`: OpenEnv's HarborRolloutResult, by attribute."""
    reward = getattr(result, "reward", None)
    turns = getattr(result, "turns", None) or []
    if reward is None or upstream_errors(result) or not any(t.role == "agent" and not t.discarded for t in turns):
        return None
    return float(reward)


UPSTREAM_FINDING = "[WARN] upstream_errors: "  # the env server's finding (seam_patch.py): the proxy's failed calls


def upstream_errors(result: Any) -> int:
    """How many of a rollout's model calls failed at the engine (UPSTREAM_FINDING in its findings; 0 if none)."""
    found = [f for f in getattr(result, "findings", None) or [] if f.startswith(UPSTREAM_FINDING)]
    return int(found[0][len(UPSTREAM_FINDING):].split()[0]) if found else 0


# The names the trainer pushes under (the CHECKPOINT knob's rule and adapter_repo's layout): final or checkpoint-N.
CHECKPOINT_PREFIX = "checkpoint-"
FINAL = "final"
CHECKPOINT_PATTERN = rf"{FINAL}|{CHECKPOINT_PREFIX}[1-9][0-9]*"


# --- The job's pins (run_job.sh and setup.sh install them with `recipe.py --requirements`) ------------------------
JOB_REQUIREMENTS = """# The job's stack beside vLLM 0.31's own in its image: one version window that must hold at once.
# trl 1.15.0 exactly: the first with HarnessRolloutWorker; 1.16 refuses Lfm2ForCausalLM ("has ['conv'] layers").
trl[peft]==1.15.0
# openenv 0.10.0: the capture proxy and harness protocol TRL 1.15 was written against.
openenv==0.10.0
# harbor >=0.24 has EnvironmentType.HF_SANDBOX; 0.26 needs fastmcp>=4, which conflicts with openenv 0.10's fastmcp<4.
harbor[hf-sandbox]>=0.24,<0.26
# transformers 5.17: vLLM 0.31 needs <5.18, kernels 0.16 works on 5.15-5.17, TRL's add_response_schema needs >=5.13.
transformers==5.17.0
peft==0.21.2
# transformers 5.17 needs huggingface_hub<2.0 (the launcher, which needs >=2.1.1, runs in its own env).
huggingface_hub>=1.31,<2.0
# trl 1.15 loads kernels-community/flash-attn3; kernels 0.16 is the release matching transformers 5.15-5.17.
kernels==0.16.0
# prepare_tasks.py rewrites task.toml with a real TOML writer; 1.2.0 is what openenv already pulls in.
tomli-w==1.2.0
# the training and eval dashboard (REPORT_TO=trackio); resolves beside vllm==0.31.0's own requirements.
trackio==0.43.0
"""


def pinned_versions(text: str = JOB_REQUIREMENTS) -> dict[str, str]:
    """Map distribution name -> version specifier, as pinned in JOB_REQUIREMENTS."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*([<>=!~].*)$", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2).replace(" ", "")
    return pins


def requirements(*sandboxes: str) -> str:
    """JOB_REQUIREMENTS and each named backend's pins: one text, so that one pip call resolves them together."""
    return JOB_REQUIREMENTS + "".join(f"# SANDBOX={name}\n{SANDBOXES[name]['requirements']}" for name in sandboxes
                                      if SANDBOXES[name]["requirements"])


# --- Checks shared by every entry point ---------------------------------------------------------------------------
class ConfigError(ValueError):
    """A bad input found before any GPU time is spent; the message says how to fix it."""


def check_versions(names: tuple[str, ...] = ("trl", "transformers"), text: str = JOB_REQUIREMENTS) -> None:
    """Raise ConfigError if an installed package is outside the pinned version window."""
    from importlib import metadata  # here, not at the top: it was two thirds of every shell script's recipe.py call

    from packaging.specifiers import SpecifierSet

    pins = pinned_versions(text)
    for name in names:
        spec = pins[name]
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise ConfigError(f"{name} is not installed: pip install '{name}{spec}' "
                              "(recipe.JOB_REQUIREMENTS)") from None
        if found not in SpecifierSet(spec):
            raise ConfigError(f"{name} {found} is installed, the recipe needs {name}{spec}: pip install '{name}{spec}'")


def require_repo_id(value: str | None, var: str, example: str = "you/LFM2.5-2.6B-opencode-lora-RL") -> str:
    """`value` if it is an `owner/name` repo id the Hub accepts (huggingface_hub's own rule, never a copy)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not value:
        raise ConfigError(f"{var} is not set: set it to your repo id, e.g. {var}={example}")
    try:
        validate_repo_id(value)
        if value.count("/") == 1:
            return value
        why = ""
    except HFValidationError as error:
        why = f" (the Hub's rule: {str(error).rstrip('.')})"
    raise ConfigError(f"{var}={value!r} is not a valid repo id{why}: use 'owner/name', e.g. {example}")


def require_token(env: Mapping[str, str] | None = None) -> str:
    """Return HF_TOKEN from the environment, or explain how to provide it."""
    token = (env if env is not None else os.environ).get("HF_TOKEN", "").strip()
    if not token:
        raise ConfigError("HF_TOKEN is not set: pass it as a job secret (secrets={'HF_TOKEN': ...}) or export it")
    return token


def sandbox_keys(sandbox: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The key variables `sandbox` needs, from `env`: the first of its key sets that is set in full (Harbor's
    preflight rule), as the secrets a job is given; ConfigError naming them when none is."""
    env = os.environ if env is None else env
    sets = SANDBOXES[sandbox]["keys"]
    for names in sets:
        if all(env.get(name, "").strip() for name in names):
            return {name: env[name].strip() for name in names}
    wanted = " (or ".join(" and ".join(names) for names in sets) + ")" * (len(sets) - 1)
    raise ConfigError(f"SANDBOX={sandbox} needs {wanted}: set it (launch.py passes it to the job as a secret)")


# What SANDBOX=e2b's account must allow that its key does not show: said by launch.py, not refused.
E2B_NOTE = (f"E2B's Hobby plan runs at most {E2B_HOBBY_CONCURRENCY} sandboxes at once, and this job keeps "
            f"{MAX_INFLIGHT_ROLLOUTS} rollouts in flight: on Hobby the creates past {E2B_HOBBY_CONCURRENCY} fail as "
            f"rate-limited (unscorable rollouts, and a streak stops the job); use a plan that allows "
            f"{MAX_INFLIGHT_ROLLOUTS} (docs/sandboxes.md)")


# --- Environment knobs --------------------------------------------------------------------------------------------
def hours(timeout: str) -> float:
    """A Jobs timeout ("72h", "90m") in hours."""
    return int(timeout[:-1]) / (1 if timeout.endswith("h") else 60)


def checkpoint_arg(raw: str, var: str) -> str:
    """A CHECKPOINT knob: 'final' or 'checkpoint-N'."""
    if not re.fullmatch(CHECKPOINT_PATTERN, raw.strip()):
        raise ConfigError(f"{var}={raw!r} is not a checkpoint name: use 'final' or e.g. 'checkpoint-300'")
    return raw.strip()


def space_name(raw: str, var: str) -> str:
    """A dashboard Space: a name (Trackio puts it under the token's owner), owner/name, or NO_SPACE."""
    if raw != NO_SPACE:
        try:
            require_repo_id(raw if "/" in raw else f"owner/{raw}", var)
        except ConfigError:
            raise ConfigError(f"{var}={raw!r} is not a Space name: use a name (it goes under the token's owner), "
                              f"owner/name, or {NO_SPACE} (no Space)") from None
    return raw


def host_name(raw: str, var: str) -> str:
    """A bare host name (an https:// or http:// prefix and a trailing / are dropped): where sandboxes reach /capture."""
    host = raw.removeprefix("https://").removeprefix("http://").removesuffix("/")
    label = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    if len(host) > 253 or not all(re.fullmatch(label, part) for part in host.split(".")):
        raise ConfigError(f"{var}={raw!r} is not a host name: use the job's public host, e.g. "
                          f"{var}=<job-id>--{PUBLIC_PORT}.hf.jobs (no path, no port)")
    return host


@dataclass(frozen=True)
class Knob:
    """An environment knob: default, type, range and the range's reason. `kind`: bool (yes/no words), int (whole, >= lo,
    default 1), float (> lo, default 0), the tuple of words offered, or a parser(raw, name); a default or bound may be
    a function of the environment. `excludes`: a knob it may not be set beside; `unlike`: knobs it may not equal."""

    default: Any
    kind: Any
    lo: Any = None
    hi: Any = None
    why: str = ""
    excludes: str = ""
    unlike: tuple[str, ...] = ()


KNOBS: dict[str, Knob] = {
    "DRY_RUN": Knob(False, bool),
    "DEBUG": Knob(False, bool),  # a failing script prints its traceback above its one line
    "RESUME": Knob(True, bool),
    "FINAL_EVAL": Knob(True, bool),
    "LORA": Knob(False, bool),
    "ALLOW_NON_LOOPBACK": Knob(False, bool),
    "MODE": Knob("train", ("train", "smoke")),
    "MAX_STEPS": Knob(MAX_STEPS, int, hi=TRAIN_MEDIUM + TRAIN_HARD, why="one training task per step"),
    "SAVE_STEPS": Knob(SAVE_STEPS, int, lo=lambda env: -(-knob("MAX_STEPS", env) // MAX_CHECKPOINTS),
                       hi=lambda env: knob("MAX_STEPS", env),
                       why=f"a checkpoint before MAX_STEPS, and at most {MAX_CHECKPOINTS} in a run: each is a ~0.5 GB "
                           "push and an eval by the watcher"),
    "LEARNING_RATE": Knob(LEARNING_RATE, float),
    "MAX_STALENESS": Knob(MAX_STALENESS, int, lo=0),  # 0: samples of the current version only
    "WEIGHT_SYNC": Knob(WEIGHT_SYNC_MODES[0], WEIGHT_SYNC_MODES),
    "STALL_MINUTES": Knob(STALL_MINUTES, float, lo=STALL_MINUTES_MIN, hi=hours(TRAIN_TIMEOUT) * 60,
                          why=f"a healthy rollout may take {ROLLOUT_CALL_LIMIT_S} s; past the job's {TRAIN_TIMEOUT} "
                              "it never fires"),
    "STALL_SECONDS": Knob(lambda env: math.ceil(knob("STALL_MINUTES", env) * 60), int, excludes="STALL_MINUTES"),
    "WATCH_INTERVAL": Knob(lambda env: min(WATCH_INTERVAL_S, knob("STALL_SECONDS", env)), float,
                           hi=lambda env: min(WATCH_INTERVAL_MAX_S, knob("STALL_SECONDS", env)),
                           why="the watchdog sees a stall or a dead server only at its checks"),
    "READY_TIMEOUT": Knob(READY_TIMEOUT_S, int),
    "STOP_AFTER_STEP": Knob(0, int, lo=0),  # 0: off
    "N_TASKS": Knob(EVAL_WATCH_TASKS, int, hi=TEST_TASKS, why="tasks in data/test.json"),
    "EVAL_TASKS": Knob(TEST_TASKS, int, hi=TEST_TASKS, why="tasks in data/test.json"),
    "EVAL_MODE": Knob("full", ("full", "watch")),
    "CHECKPOINT": Knob(FINAL, checkpoint_arg),
    "MAX_IDLE_HOURS": Knob(MAX_IDLE_HOURS, float, hi=hours(EVAL_WATCH_TIMEOUT),
                           why=f"the eval-watch job's {EVAL_WATCH_TIMEOUT} cap"),
    "EVAL_CONCURRENCY": Knob(EVAL_CONCURRENCY, int, hi=ENV_MAX_SESSIONS,
                             why="the env server's ENV_MAX_SESSIONS; rollouts past it would fail"),
    "MAX_LORAS": Knob(1, int),
    **{name: Knob(port, int, hi=65535, unlike=PORT_KNOBS)
       for name, port in zip(PORT_KNOBS, (VLLM_PORT, ENV_PORT, PUBLIC_PORT), strict=True)},
    "GATEWAY_HEAD_TIMEOUT": Knob(GATEWAY_HEAD_TIMEOUT_S, float),
    "GATEWAY_BODY_TIMEOUT": Knob(GATEWAY_BODY_TIMEOUT_S, float),
    "GATEWAY_IDLE_CONNECTIONS": Knob(GATEWAY_IDLE_CONNECTIONS, int),
    "GATEWAY_RESTARTS": Knob(GATEWAY_RESTARTS, int, lo=0),  # 0: no restart
    "SPACE_HOST": Knob("", host_name),  # unset: the job scripts derive it from JOB_ID
    "DASHBOARD_SPACE": Knob(DASHBOARD_SPACE, space_name),
    "REPORT_TO": Knob(REPORT_TO, REPORTERS, why="the job installs Trackio and no other dashboard"),
    "SANDBOX": Knob(SANDBOX, tuple(SANDBOXES), why="the job installs and checks only these Harbor backends"),
}
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def knob(name: str, env: Mapping[str, str] | None = None, value: object = None) -> Any:
    """The checked value of knob `name`: `value` (a command-line flag) if given, else the environment's, else the
    default. Unset or empty means the default; a bad value raises ConfigError naming `name` and the fix."""
    env = os.environ if env is None else env
    spec = KNOBS[name]
    raw = str(value if value is not None else env.get(name, "")).strip()
    if not raw:
        return spec.default(env) if callable(spec.default) else spec.default
    if spec.excludes and (other := env.get(spec.excludes, "").strip()):
        raise ConfigError(f"{name}={raw} and {spec.excludes}={other} are both set, and {name} would win: set only one")
    checked = _parse(name, raw, env)
    for other in spec.unlike:
        theirs = env.get(other, "").strip()
        if other != name and checked == (_parse(other, theirs, env) if theirs else KNOBS[other].default):
            raise ConfigError(f"{name} and {other} are both {checked}: give each of {', '.join(spec.unlike)} its own")
    return checked


def _parse(name: str, raw: str, env: Mapping[str, str]) -> Any:
    """`raw` as knob `name`'s type, within its range (the rules of Knob)."""
    spec = KNOBS[name]
    why = f" ({spec.why})" if spec.why else ""
    if spec.kind is bool:
        if raw.lower() not in _YES + _NO:
            raise ConfigError(f"{name}={raw!r} is not a yes/no value: use {name}=1 (or true, yes, on) "
                              f"or {name}=0 (or false, no, off)")
        return raw.lower() in _YES
    if isinstance(spec.kind, tuple):
        if raw not in spec.kind:
            fix = (f"is not offered{why}: use {name}={spec.kind[0]} (or {', '.join(spec.kind[1:])})" if why
                   else f"is not one of {', '.join(spec.kind)}")
            raise ConfigError(f"{name}={raw!r} {fix}")
        return raw
    if spec.kind not in (int, float):
        return spec.kind(raw, name)
    whole = spec.kind is int
    lo, hi = (bound(env) if callable(bound) else bound for bound in (spec.lo, spec.hi))
    lo, hi = (int(whole) if lo is None else lo), (math.inf if hi is None else hi)
    span = ((f"{lo}..{hi}" if hi < math.inf else f"a whole number >= {lo}") if whole
            else f"{lo:g}..{hi:g}" if lo else f"at most {hi:g}")
    try:
        value = spec.kind(raw)
    except ValueError:
        value = math.nan
    if whole and math.isnan(value):
        raise ConfigError(f"{name}={raw!r} is not a whole number: use {span}")
    if not whole and not 0 < value < math.inf:
        raise ConfigError(f"{name}={raw!r} is not a positive number: use e.g. {name}=1.5")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value if whole else format(value, 'g')} is out of range: use {span}{why}")
    return value


def shell_value(value: object) -> str:
    """How a checked knob is written back into an environment: flags as 1/0, 6.0 as 6."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shell_knobs() -> dict[str, str]:
    """Every knob a shell script may read (upper-case scalars and tuples), as text: tuples comma-joined."""
    return {name: ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            for name, value in globals().items()
            if name.isupper() and not name.startswith("_") and isinstance(value, (str, int, float, tuple))
            and "\n" not in str(value)}


def main(argv: list[str]) -> None:
    """usage: python3 recipe.py NAME...        each knob's value, one per line (shell scripts read them so)
       python3 recipe.py --all          NAME=value of every knob
       python3 recipe.py --env NAME...  environment knobs, each checked (a bad one exits with its fix)
       python3 recipe.py --requirements [SANDBOX...]  the job's pip requirements (JOB_REQUIREMENTS and the backends')"""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{main.__doc__}\n\n{__doc__.strip()}", file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    try:
        if argv[0] == "--requirements":
            print(requirements(*(knob("SANDBOX", value=name) for name in argv[1:])), end="")
        elif argv[0] == "--env":
            print("\n".join(f"{name}={shell_value(knob(name))}" for name in argv[1:]))
        elif argv == ["--all"]:  # NAME=value per line: common.sh reads every knob in one Python start
            print("\n".join(f"{name}={value}" for name, value in _shell_knobs().items()))
        else:
            known = _shell_knobs()
            if unknown := [name for name in argv if name not in known]:
                sys.exit(f"recipe.py: unknown knob {unknown[0]!r}")
            print("\n".join(known[name] for name in argv))
    except ConfigError as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
