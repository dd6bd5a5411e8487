"""The recipe's knobs, in one place.

Every script imports its numbers from here (shell scripts read them with
`python3 recipe.py NAME`), so a knob is changed once and training, eval, launch
and the model card stay in agreement. The job's version pins are JOB_REQUIREMENTS below, a pip requirements
file's text, and each sandbox backend's are in SANDBOXES (`python3 recipe.py --requirements [SANDBOX]` prints them),
read from there, not retyped.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
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
# Harbor sandbox backend for every rollout (train and eval), env SANDBOX: HF Sandboxes by default (no third-party
# account: the HF token), or Daytona or E2B with their own key. Per backend: the keys Harbor's own preflight() asks for
# (any one tuple, all of it set; the job gets them as secrets), the SDK's own settings passed on when set, and the
# pins run_job.sh installs with JOB_REQUIREMENTS in its one pip call (`recipe.py --requirements SANDBOX`; each resolved
# beside vLLM 0.31's pins, `pip check` clean: tests/image_resolution.json). The SDKs at the releases the tests' doubles
# are typed against (tests/chain/*_double.py). Reference: docs/sandboxes.md.
SANDBOX = "hf-sandbox"
SANDBOXES: dict[str, dict[str, Any]] = {
    "hf-sandbox": {"keys": (("HF_TOKEN",),), "requirements": ""},
    "daytona": {"keys": (("DAYTONA_API_KEY",), ("DAYTONA_JWT_TOKEN", "DAYTONA_ORGANIZATION_ID")),
                "settings": ("DAYTONA_API_URL", "DAYTONA_TARGET"), "requirements": """harbor[daytona]
daytona==0.226.1
# daytona needs opentelemetry-instrumentation-aiohttp-client>=0.59b0, whose newest moves the OpenTelemetry family to
# 1.45.1 while the vLLM image has 1.45.2: without this pin `pip check` finds 5 breaks (tests/image_resolution.json).
opentelemetry-exporter-otlp==1.45.1
"""},
    "e2b": {"keys": (("E2B_API_KEY",),), "requirements": "harbor[e2b]\ne2b==2.63.0\n"},
}
# E2B's Hobby plan runs at most 20 sandboxes at once (and each for at most 1 h), fewer than the recipe's 32 rollouts
# in flight: creates past it are refused as rate-limited and the rollout is unscorable. Warned, not refused: the plan
# cannot be read off the key offline, and a Pro account runs the recipe as is.
E2B_HOBBY_CONCURRENCY = 20
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
# vLLM context: the whole 32-turn agent conversation must fit (LFM2.5 context length). vLLM reserves the MAX_TOKENS the
# proxy asks for, so a prompt over MAX_MODEL_LEN - MAX_TOKENS = 28,672 tokens is refused: the proxy ends the agent, the
# rollout is graded and trained as it stands (train_rollouts logs it as `context_exhausted`).
MAX_MODEL_LEN = 32768
# Agent wall-clock limit per rollout. OpenEnv's client gives a rollout call 1800 s in all
# (_ROLLOUT_TIMEOUT_S), sandbox boot and grading included: stay well under it.
AGENT_TIMEOUT_SEC = 1500

# --- Optimisation ------------------------------------------------------------
# The recipe's (env LEARNING_RATE). The lineage fine-tuned the full model at 3e-6; a LoRA update B @ A starts at zero,
# so a step moves the weights far less than a full fine-tune's at the same rate: LoRA is commonly run ~10x higher
# ("LoRA Without Regret", Schulman et al. 2025). docs/training.md: what to watch before raising it.
LEARNING_RATE = 1e-6
# What a step trains: NUM_GENERATIONS training rows (train_lora.conv_safe_batching), and TRL 1.15 counts rows, not
# rollouts. A rollout is one row while every turn's prompt extends the previous turn's tokens; a forked capture
# (rollout/fork_frac > 0) is several rows and an unscorable rollout none, so a step is exactly one task's group only
# at rollout/samples_per_rollout 1.0. chat_template.py removes the template's drift; what remains (vLLM's lfm2 parser
# strips text around a tool call and re-orders it, quotes the model did not write, non-canonical tokenizations)
# forks. So MAX_STEPS bounds rows: 1000 steps = 8000 rows = 1000 / samples_per_rollout groups (500 tasks at 2.0),
# the hours per step (step budget) are per 8 rows, and the card's step count is rows / 8, not tasks seen.
MAX_STEPS = 1000
# Smoke run (launch.py smoke, run_job.sh MODE=smoke): every stage of the real job at small scale. The recipe's own
# "MAX_STEPS=20 gives a ~40-min smoke run — do that first"; more than the groups in flight (MAX_INFLIGHT_ROLLOUTS /
# NUM_GENERATIONS = 4), so the rollout queue runs ahead of the trainer as it will in the real run (its samples stay far
# below MAX_STALENESS). A smaller MAX_STEPS may be asked for, down to SMOKE_MIN_STEPS (a checkpoint, a stop, a resume
# and a step after it); a larger one is refused (its cap: SMOKE_TIMEOUT).
SMOKE_STEPS = 20
SMOKE_MIN_STEPS = 2
NUM_GENERATIONS = 8  # One GRPO group: 8 rollouts of one task, one advantage baseline (a step: see MAX_STEPS).
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
# with, now up to 24 versions old (25 for a step's first sample: TRL checks it one fetch early). Its expectation under
# full-vocabulary sampling is 1 whatever the staleness (E_q[p/q] = 1), so no mean ratio can show staleness: what
# staleness costs shows as `kl/old` and `clip_ratio/old` against their `fresh` (rows at most STALENESS_SPLIT versions
# old, TRL's default max_staleness) and as `clip_ratio/unbounded_total` (train_metrics.py; docs/training.md says when
# to lower this: env MAX_STALENESS).
MAX_STALENESS = 24
STALENESS_SPLIT = 4
SAVE_STEPS = 100  # Checkpoint (and push) every 100 optimizer steps.
# At most this many checkpoints a run (SAVE_STEPS >= MAX_STEPS / 20): each is a push of the adapter and optimizer state
# (~0.5 GB, one commit) and an eval of EVAL_WATCH_TASKS tasks by the watcher; the recipe's run pushes 10.
MAX_CHECKPOINTS = 20

# --- Reward ------------------------------------------------------------------
# reward = CORRECT_REWARD * env_reward + TOOL_BONUS * max(0, (TOOL_BUDGET - tool_calls) / TOOL_BUDGET),
# the bonus only on correct answers (so it cannot reward giving up). TRL divides a group's rewards by their std, so the
# bonus is not small where it is the only contrast: in an all-correct group of 8 where one rollout makes one more tool
# call, that rollout's advantage is -2.6, as large as a lone right answer's +2.6 among wrong ones. That is the intended
# contrast of all-correct groups (fewer calls for the same answer); `group/bonus_only_frac` logs how often it is all.
CORRECT_REWARD = 1.0
TOOL_BONUS = 0.1
TOOL_BUDGET = MAX_TOOL_CALLING_ITERATIONS

# --- Jobs, GPUs, ports -------------------------------------------------------
# launch.py's own environment: run_job(expose_public=...) exists only from this huggingface_hub on.
LAUNCHER_HUB_MIN = "2.1.1"
TRAIN_FLAVOR = "h200x2"
TRAIN_TIMEOUT = "72h"
EVAL_FLAVOR = "h200"
EVAL_WATCH_TIMEOUT = "48h"
EVAL_TIMEOUT = "12h"
EVAL_WATCH_TASKS = 100  # Fixed test subset for the live learning curve.
# What a run costs, typical and worst, each from its source (launch.py --dry-run; README "What it costs"). The
# recipe's own figures: "h200x2 for ~10-25h (task-difficulty dependent) + thousands of cpu-basic sandbox-minutes" and
# "MAX_STEPS=20 gives a ~40-min smoke run". benchmarks/README.md's rollout-pipeline simulation (TRL's own worker at
# this recipe's 32 in flight and staleness 24, rollouts of 6-8 minutes typical): 27-47 h for 1,000 steps and 51-90
# sandbox-minutes a step; its median rollout, 8 minutes, is an eval cell's sandbox time. The worst cases are the caps.
RECIPE_TRAIN_HOURS = (10, 25)
RECIPE_SMOKE_MINUTES = 40
SIMULATED_TRAIN_HOURS = (27, 47)
SIMULATED_SANDBOX_MINUTES_PER_STEP = (51, 90)
TYPICAL_ROLLOUT_MINUTES = 8
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
PORT_KNOBS = ("POLICY_PORT", "ENV_PORT", "PUBLIC_PORT")  # The job's port knobs: vLLM, the env server, the gateway.
LOOPBACK = "127.0.0.1"
# Stall watchdog (run_job.sh). Progress = an optimizer step or, while the trainer waits for rollouts, a finished
# rollout (train_rollouts.refresh_heartbeat). Every rollout call ends, done or failed, within OpenEnv's Harbor client
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
# The least STALL_MINUTES may be (the recipe's own 30): one healthy rollout may take OpenEnv's whole call limit, and
# all 32 in flight at the start together, so a shorter limit fails a healthy run before its first finished rollout.
STALL_MINUTES_MIN = ROLLOUT_CALL_LIMIT_S // 60
# Sandbox lifecycle (sandbox_lifecycle.py). A rollout's time outside its agent run -- sandbox start, healthcheck (the
# task's data pull), OpenCode's install, verifier, log transfer -- is what OpenEnv's call limit leaves beside the agent
# timeout; sandbox_lifecycle.trial_timing measures each part per rollout into the ledger, so a smoke run shows whether
# real rollouts fit in it. (1800 - 1500) s = 300 s.
ROLLOUT_SETUP_BUDGET_S = ROLLOUT_CALL_LIMIT_S - AGENT_TIMEOUT_SEC
# Added to the idle timeout, so a trial that uses its whole call limit keeps its sandbox while the env server copies
# the logs back and stops it (Harbor's limits are asyncio timeouts in the env server; the sandbox does not see them).
SANDBOX_IDLE_MARGIN_S = 300
# HF Sandbox idle timeout, set by the env server (seam_patch.py serve). huggingface_hub 1.33 does not count a running
# foreground command as activity, and each phase of a trial is one such command (the agent's run alone may take
# AGENT_TIMEOUT_SEC), so the idle clock may see nothing for a whole trial: Harbor's default of 600 s would shut a
# sandbox down under any agent running past 10 minutes. It covers the agent timeout, the setup budget and the margin
# (a trial running past the call limit is lost to its client anyway); its cost is that a sandbox orphaned by a crashed
# env server lives this long before it shuts itself down.
# (1500 + 300 + 300) s = 2100 s = 35 minutes.
SANDBOX_IDLE_TIMEOUT_S = AGENT_TIMEOUT_SEC + ROLLOUT_SETUP_BUDGET_S + SANDBOX_IDLE_MARGIN_S
# Trial folders: OpenEnv writes one per rollout (2.7 MB on average by its own count, 35 GB for 13,187) and never removes
# them (~42 GB over a 16,000-rollout run). A scored rollout's folder is removed once its trace is taken; an unscorable
# one's is kept for diagnosis, newest first, up to this many MB of kept folders (about 750 at the average size).
# Disk budget of the trials folder: this plus the folders of the rollouts in flight (at most ENV_MAX_SESSIONS).
FAILED_TRIALS_KEEP_MB = 2048
# Rollout guard (train_rollouts.py): an infrastructure failure costs one rollout (unscorable, counted); these stop
# the job. A streak of one whole wave of in-flight rollouts (MAX_INFLIGHT_ROLLOUTS, 32): at even a 25% independent
# failure rate 32 in a row has probability 0.25**32 ~ 5e-20, so a streak
# means a shared cause (env server, vLLM, sandboxes or the capture path down), and it is seen within one wave.
ROLLOUT_ABORT_STREAK = MAX_INFLIGHT_ROLLOUTS
# Or an intermittent shared cause: more than half of the last 256 rollouts (32 groups, about 32 steps) unscorable.
# A healthy run loses a few percent; at 10% independent failures, 129+ of 256 has probability below 1e-40.
ROLLOUT_WINDOW = 256
ROLLOUT_MAX_UNSCORABLE = 0.5
WATCH_INTERVAL_S = 30  # Watchdog: seconds between its checks.
# The most WATCH_INTERVAL may be: the watchdog sees a dead vLLM or env server, a stall and the smoke deadline only
# at its checks, so at most 5 minutes of two idle GPUs pass before the job says so (and never more than STALL_SECONDS).
WATCH_INTERVAL_MAX_S = 300
READY_TIMEOUT_S = 1800  # vLLM and the env server must answer their health check within this (model download).
# Env server sessions at once (OpenEnv's default is 4): every in-flight rollout holds one, and the
# ones past the cap fail with SessionCapacityError. Must exceed training and eval concurrency.
ENV_MAX_SESSIONS = 64
# The public gateway's cap on one request body (capture_gateway.py reads a body before forwarding it). A request whose
# prompt fills MAX_MODEL_LEN (32,768 tokens, ~4 bytes a token of English or code) is ~130 KB of JSON, ~800 KB if every
# character were \u-escaped (6 bytes), plus OpenCode's system prompt and tool schemas (tens of KB): 8 MiB is 10x the
# largest request the model can take, and bounds what an unauthenticated caller can make the job hold in memory.
CAPTURE_MAX_BODY_BYTES = 8 * 1024 * 1024
# The rest of the gateway's limits for a public port (capture_gateway.py; what each stops: docs/jobs.md). A request
# head (request line and headers) up to 16 KiB: OpenCode 1.18.33's are ~460 bytes. A head must arrive within
# GATEWAY_HEAD_TIMEOUT_S of the connection or of the previous response, a body within GATEWAY_BODY_TIMEOUT_S of it.
GATEWAY_MAX_HEAD_BYTES = 16 * 1024
GATEWAY_HEAD_TIMEOUT_S = 15
GATEWAY_BODY_TIMEOUT_S = 60
# Connections not serving a live session (waiting for a head, idle between requests, refused): past this many the
# longest-waiting is closed. The job's own requests are never counted, so a flood cannot lock out its sessions.
GATEWAY_IDLE_CONNECTIONS = 256
# The live session keys are read from the capture proxy's session list at most this often (a made-up key waits for
# the next read): a flood of made-up keys costs the env server one read per interval, not one per key.
GATEWAY_SESSION_READ_S = 0.5
# A gateway that exits is restarted by serve_env.sh (the env server and the trainer go on), at most this many times
# in a row; a gateway that served GATEWAY_STABLE_S resets the count.
GATEWAY_RESTARTS = 5
GATEWAY_STABLE_S = 600
# Keepalive pong timeout of a rollout's MCP socket to the env server (openenv's client default is 20 s): the server's
# event loop stalls while Harbor sets a trial up, and a 20 s timeout dropped a whole rollout as
# "ConnectionClosedError: keepalive ping timeout" on a loaded 2-core machine. A rollout call still ends at
# ROLLOUT_CALL_LIMIT_S; a dead server is still seen within this.
ENV_PING_TIMEOUT_S = 300
# OpenCode release the sandboxes install (Harbor's default floats); the x-api-key seam was checked on it.
OPENCODE_VERSION = "1.18.33"
PUSH_RETRIES = 5
# First wait between push attempts, doubled each retry (30+60+120+240 s rides out a Hub blip).
PUSH_BACKOFF_S = 30.0
# --- Shared adapter repo: commit conflicts (adapter_repo.with_retries) ---------------------------------------
# Three writers commit to the adapter repo at once: the trainer's pushes, the watcher's results and the in-job final
# eval (about 50 pushes for 500 cells). The Hub refuses a commit that overlaps another one on the same repo with
# HTTP 409 "Another commit operation is in progress for this repository. Please try again later.", and
# huggingface_hub does not retry it. A commit's files are uploaded before its commit call, so the call that holds
# the repo takes seconds: first wait 5 s, doubled (5+10+20+40 s over PUSH_RETRIES attempts) outlasts a queue of them.
CONFLICT_BACKOFF_S = 5.0
# A compare-and-swap that lost (HTTP 412: another writer committed first), or a head read that still answers a head
# this writer saw superseded (repo_info can lag right after a commit): wait before reading the head again, first
# 2 s, doubled (2+4+8+16 s), instead of rebuilding at once against the same stale answer.
CAS_BACKOFF_S = 2.0

# Trainer weight-sync modes (train_weight_sync.py): TRL's merge -> send -> unmerge, or the merge-free stream.
WEIGHT_SYNC_MODES = ("merge_free", "stock")
# --- Dashboard -----------------------------------------------------------------
# Where training and eval metrics go (env REPORT_TO per run): Trackio or none. Not TensorBoard: the job installs no
# tensorboard (trackio is resolved beside vLLM, tensorboard is not), so it failed at trainer start, 15-25 min in.
REPORTERS = ("trackio", "none")
REPORT_TO = "trackio"
# Trackio dashboard Space, created private under the HF token's owner (env DASHBOARD_SPACE; "local" = no Space,
# Trackio logs on the machine only). Training, the eval watcher and the final eval all log to it.
DASHBOARD_SPACE = "lfm-opencode-lora-rl-dashboard"
NO_SPACE = "local"  # DASHBOARD_SPACE value: no Space, Trackio logs on the machine only
# --- Smoke run -------------------------------------------------------------
# The smoke run checkpoints every SMOKE_SAVE_STEPS (steps 5, 10, 15 and 20: four pushes read back from the Hub; fewer
# steps save every half of the run at most); its first trainer start stops right after its first checkpoint and a
# second start resumes from the Hub.
SMOKE_SAVE_STEPS = 5
# Held-out tasks of the smoke's final eval (base and adapter: 2 x 4 = 8 cells, one wave at EVAL_CONCURRENCY).
SMOKE_EVAL_TASKS = 4
# Tasks of the eval-watch smoke launch (launch.py eval-watch --smoke): one short wave per checkpoint. Its cap: the
# smoke job's, plus this for the waves after the smoke's final adapter lands (base, 4 checkpoints, final).
SMOKE_WATCH_TASKS = 2
SMOKE_WATCH_EXTRA_S = 3600
# The token-weighted mean importance ratio of a step (`ratio/token_mean`). Its expectation is 1 for any sampler that
# gives every token some probability (E_q[p/q] = 1), so staleness, a bf16 kernel gap or a stuck sync cannot move it;
# truncated sampling can (top_p 0.99 puts it at ~0.990): the smoke run's median step outside this band (widened by
# RATIO_TOLERANCE for bf16 serving) is NO-GO. Per-row means spread wider on a healthy run: reported, not judged.
RATIO_MIN = 0.998
RATIO_MAX = 1.0
RATIO_TOLERANCE = 0.002
# The ceiling on TRL's `kl` (k3: (r - 1) - log r, a mean of per-row means) for the smoke run's median step: trainer and
# vLLM disagree on the policy (weights, template, dtype). 55x a healthy bf16-served run's 1.8e-4 (issue 41); at 0.01
# the rms log-ratio is 0.14 = 0.7 eps, so a sixth of a Gaussian spread's tokens sit past TRL's clip. Truncation adds
# only ~5e-5 (top_p 0.99): the ratio band above catches that.
SMOKE_KL_MAX = 0.01
# The smoke report warns (does not fail) when more than this share of the trained rows came from zero-contrast groups:
# such a run mostly trains nothing (its tasks too hard or too easy for the policy).
SMOKE_ZERO_CONTRAST_WARN = 0.5

# The smoke job's cap, whatever its MAX_STEPS: the 20-step smoke's worst case, every stage at the longest the job's own
# limits let it run (servers READY_TIMEOUT_S, each wave of in-flight rollouts at the rollout call limit, every push
# through all PUSH_RETRIES; tests/test_smoke_report.py adds it up), plus a tenth, rounded up to half hours.
SMOKE_TIMEOUT = "8h"
# Its stages stop this long before the cap, so the report (checkpoints read back, smoke_report.json pushed) still
# lands: the platform's clock also counts the job's start before run_job.sh (a cold node pulling the image: 15 min).
SMOKE_REPORT_RESERVE_S = 1800
# A healthy smoke beside its steps (RECIPE_SMOKE_MINUTES for 20): job start, install, tasks and servers 25 min, two
# trainer starts 10, pushes and read-backs 6, the final eval 15, the report 7.
SMOKE_START_UP_S = 3780
# The verdict's limits (smoke_report.assess; each failed one is a NO-GO line naming its numbers):
# - unscorable rollouts: a healthy pipeline loses a few percent to sandboxes and the Hub; over a tenth of a smoke's
#   ~160 finished rollouts is a shared cause the 72-hour run would pay for at every step.
SMOKE_MAX_UNSCORABLE = 0.10
# - samples TRL dropped as stale (issue 29's pipeline goal: at least 95 % of finished rollouts trained).
SMOKE_MAX_STALE = 0.05
# - rollouts whose capture forked into more than one training row (a step then trains part of a group).
SMOKE_MAX_FORK = 0.05
# - per-rollout setup within ROLLOUT_SETUP_BUDGET_S, and every agent run SANDBOX_IDLE_MARGIN_S inside the sandbox's
#   idle timeout (SANDBOX_IDLE_TIMEOUT_S).

# --- Files every script writes ------------------------------------------------
# TRL 1.15's resume position in every checkpoint folder ({prompt_index, model_version}), and the key train_resume.py
# adds to it: the offsets past prompt_index of the groups already consumed, which a resumed start skips.
ROLLOUT_STATE = "rollout_state.json"
CONSUMED_AHEAD = "consumed_ahead"

# --- The job's work folder: what the trainer and run_job.sh leave there for the watchdog and the smoke report ------
# The folder has no setting of its own: the trainer is given HEARTBEAT_FILE (run_job.sh: $WORK_DIR/heartbeat; alone:
# $OUTPUT_DIR/heartbeat) and writes every other file beside it (work_file), so a HEARTBEAT_FILE set today still puts
# them all where it did, and the one path the watchdog reads cannot name another folder than the records'.
# `<step> <unix time>` after every optimizer step, re-dated to each finished rollout: the watchdog reads its mtime.
HEARTBEAT_NAME = "heartbeat"
# Every trainer start and every logged step's metrics (train_callbacks.RunLog): one file across a resume.
TRAIN_LOG_NAME = "train_log.json"
# The rollout counts of the trainer start running now (train_rollouts.Ledger): each start's rollout child begins anew.
LEDGER_NAME = "rollouts.json"
# One JSON line per finished rollout (train_rollouts.Ledger), beside the ledger and appended across starts: which task
# ended how, and where its Harbor trial folder is (kept only for a failed rollout): what the counts cannot say when
# diagnosing a run. ~300 bytes a rollout: ~5 MB for the recipe's ~16k rollouts. A line: task, outcome ("scored",
# "timed_out" or its unscorable class), reward (the verifier's grade; TRL's reward adds the tool bonus), budget_stops,
# context_exhausted, cut_turns (how the proxy ended it), error, trial, trial_kept, at.
ROLLOUT_LOG_NAME = "rollout_log.jsonl"
# The last finished rollouts' trajectories (trajectories.trajectory), rewritten by the rollout child after each one;
# each checkpoint push commits it as that checkpoint's sample. 8: one group's worth, ~100 KB each at most.
TRAJECTORIES_NAME = "trajectories.json"
TRAJECTORY_SAMPLE = 8
# A later trainer start in the same folder first keeps the last start's ledger aside under this glob, its * the start's
# number, 1, 2, ... in start order (keep_ledger_aside), so the smoke report sums every start's counts (kept_ledgers).
KEPT_LEDGER_GLOB = "rollouts.start-*.json"
_KEPT_LEDGER = re.compile(re.escape(KEPT_LEDGER_GLOB).replace(r"\*", "([1-9][0-9]*)"))
# The smoke job's stage records, one line per stage start and end (common.sh's step); the report's stage times.
STAGES_NAME = "stages"


def work_file(heartbeat_file: str | Path, name: str) -> Path:
    """The work folder's file `name`: in the heartbeat's folder."""
    return Path(heartbeat_file).with_name(name)


def kept_ledgers(folder: str | Path) -> list[Path]:
    """The earlier trainer starts' kept-aside ledgers in `folder`, in start order."""
    numbered = [(int(match.group(1)), path) for path in Path(folder).glob(KEPT_LEDGER_GLOB)
                if (match := _KEPT_LEDGER.fullmatch(path.name))]
    return [path for _, path in sorted(numbered)]


def next_kept_ledger(folder: str | Path) -> Path:
    """The name the running start's ledger is kept aside under when the next trainer start begins."""
    kept = kept_ledgers(folder)
    last = int(_KEPT_LEDGER.fullmatch(kept[-1].name).group(1)) if kept else 0
    return Path(folder) / KEPT_LEDGER_GLOB.replace("*", str(last + 1))


def keep_ledger_aside(folder: str | Path) -> Path | None:
    """Before a later trainer start: move the last start's ledger to its kept-aside name; None if it has none."""
    ledger = Path(folder) / LEDGER_NAME
    if not ledger.is_file():
        return None
    return ledger.replace(next_kept_ledger(folder))


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` so that a reader sees the old file or the new one, never half of one, and two writers in one
    folder never share a temporary name (the job's heartbeat folder has several)."""
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


# --- Rewards: the rule the training sessions, the rollout guard and the eval share ---------
def graded_reward(result: Any) -> float | None:
    """The grade a finished rollout earned the policy, or None when it has none (unscorable: infrastructure).

    Harbor still grades a rollout whose agent timed out or exited non-zero, and OpenEnv then marks it `ok=False`
    (openenv/harbor/rollout.py, from Harbor's exception_info): that grade is what the policy did, so it counts. No
    reward (the verifier never ran or wrote none), or no agent turn reaching the model (the agent never started
    or the proxy refused it: the verifier graded an untouched workspace) is no grade, nor is a rollout whose model
    calls failed at the engine (upstream_errors: an outage is not the policy's answer). `result` is OpenEnv's
    HarborRolloutResult (read by attribute, so this module needs no openenv).
    """
    reward = getattr(result, "reward", None)
    turns = getattr(result, "turns", None) or []
    if reward is None or upstream_errors(result) or not any(t.role == "agent" and not t.discarded for t in turns):
        return None
    return float(reward)


# openenv 0.10's capture proxy counts a rollout's model calls that failed at the engine (a 5xx, a reset: it answers
# the agent 502) but its result does not carry the count: the env server adds it as this finding (seam_patch.py).
UPSTREAM_FINDING = "[WARN] upstream_errors: "


def upstream_errors(result: Any) -> int:
    """How many of a rollout's model calls failed at the engine (UPSTREAM_FINDING in its findings; 0 if none)."""
    found = [f for f in getattr(result, "findings", None) or [] if f.startswith(UPSTREAM_FINDING)]
    return int(found[0][len(UPSTREAM_FINDING):].split()[0]) if found else 0


# --- The job's pins ------------------------------------------------------------------
# The requirements file the jobs install (run_job.sh writes it out with `recipe.py --requirements`; setup.sh too). Kept
# here, not in a requirements.txt: the recipe's own upload, `hf upload ... --include "*.py" --include "*.sh" --include
# "*.md" --include "data/*.json"`, takes no *.txt, and the job must run from what it uploads.
JOB_REQUIREMENTS = """# Runtime stack for the training/eval job. run_job.sh installs these next to vLLM 0.31's own stack
# inside the vllm/vllm-openai:v0.31.0 image (transformers with --no-deps there). Every pin is part of
# one version window that must hold at once (see README "Versions"):
#
# trl 1.15.0 exactly: 1.16 adds tree packing and refuses Lfm2ForCausalLM ("has ['conv'] layers");
# 1.15.0 is the first with HarnessRolloutWorker.
trl[peft]==1.15.0
# openenv 0.10.0: capture proxy + harness protocol TRL 1.15 was written against.
openenv==0.10.0
# harbor >=0.24 has EnvironmentType.HF_SANDBOX; 0.26 needs fastmcp>=4 which conflicts with openenv 0.10's fastmcp<4.
harbor[hf-sandbox]>=0.24,<0.26
# transformers 5.17: vLLM 0.31 needs <5.18, kernels 0.16 works only on 5.15-5.17, TRL's add_response_schema needs
# >=5.13.
transformers==5.17.0
peft==0.21.2
# transformers 5.17 requires huggingface_hub<2.0 (the launcher, which needs >=2.1.1, runs in its own env).
huggingface_hub>=1.31,<2.0
# trl 1.15 loads kernels-community/flash-attn3; kernels 0.16 is the release matching transformers 5.15-5.17.
kernels==0.16.0
# prepare_tasks.py rewrites task.toml (docker_image, cpus, memory_mb) with a real TOML writer; 1.2.0 is what openenv
# already pulls in.
tomli-w==1.2.0
# eval_watch.py draws eval/learning_curve.png on the eval-watch job; neither this stack nor vLLM 0.31's brings it.
matplotlib==3.11.2
# Training and eval dashboard (REPORT_TO=trackio). Adds only httptools and uvloop to this stack, and resolves
# together with vllm==0.31.0's own requirements (pip --dry-run, 2026-12-01).
trackio==0.43.0
"""


# --- Checks shared by every entry point ----------------------------------------


class ConfigError(ValueError):
    """A bad input found before any GPU time is spent; the message says how to fix it."""


def require_repo_id(value: str | None, var: str, example: str = "you/LFM2.5-2.6B-opencode-lora-RL") -> str:
    """Return `value` if it is an `owner/name` repo id the Hub accepts; otherwise explain the expected form.

    The character rules are huggingface_hub's own `validate_repo_id` (no `--`, `..` or `.git` end, ...), never a copy:
    a rule of ours that the Hub did not share let `you/x--y` launch jobs that failed 20-30 min in. Every caller has
    huggingface_hub: the launcher and the training stack depend on it, and the job installs it before run_job.sh
    starts (launch.job_command; the vLLM image ships it too). Only the `owner/` part is the recipe's own rule.
    """
    if not value:
        raise ConfigError(f"{var} is not set: set it to your repo id, e.g. {var}={example}")
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        raise ConfigError(f"{var} cannot be checked: huggingface_hub is not installed; pip install "
                          f"'huggingface_hub{pinned_versions()['huggingface-hub']}'") from None
    why = ""
    try:
        validate_repo_id(value)
    except HFValidationError as error:
        why = f" (the Hub's rule: {str(error).rstrip('.')})"
    else:
        if value.count("/") == 1:
            return value
    raise ConfigError(f"{var}={value!r} is not a valid repo id{why}: use 'owner/name', e.g. {example}")


def require_token(env: dict[str, str] | None = None) -> str:
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


def sandbox_notes(sandbox: str) -> list[str]:
    """What a backend's account must allow that the key does not show (one line each)."""
    if sandbox != "e2b":
        return []
    return [f"E2B's Hobby plan runs at most {E2B_HOBBY_CONCURRENCY} sandboxes at once, and this job keeps "
            f"{MAX_INFLIGHT_ROLLOUTS} rollouts in flight: on Hobby the creates past {E2B_HOBBY_CONCURRENCY} fail as "
            "rate-limited (unscorable rollouts, and a streak stops the job); use a plan that allows "
            f"{MAX_INFLIGHT_ROLLOUTS} (docs/sandboxes.md)"]


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


def whole_number(raw: str, var: str, upper: int | None = None, why: str = "", lower: int = 1) -> int:
    """A whole number in lower..upper (no upper bound when upper is None)."""
    span = f"{lower}..{upper}" if upper else f"a whole number >= {lower}"
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a whole number: use {span}") from None
    if value < lower or (upper is not None and value > upper):
        raise ConfigError(f"{var}={value} is out of range: use {span}" + (f" ({why})" if why else ""))
    return value


def positive_number(raw: str, var: str, lower: float = 0, upper: float = math.inf, why: str = "") -> float:
    """A number > 0 (minutes, hours, seconds), within lower..upper when given."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"{var}={raw!r} is not a positive number: use e.g. {var}=1.5")
    if not lower <= value <= upper:
        span = f"{lower:g}..{upper:g}" if lower else f"at most {upper:g}"
        raise ConfigError(f"{var}={value:g} is out of range: use {span}" + (f" ({why})" if why else ""))
    return value


def hours(timeout: str) -> float:
    """A Jobs timeout ("72h", "90m") in hours."""
    return int(timeout[:-1]) / (1 if timeout.endswith("h") else 60)


def space_name(raw: str, var: str) -> str:
    """A dashboard Space: a name (Trackio puts it under the token's owner), owner/name, or NO_SPACE."""
    value = raw.strip()
    if value != NO_SPACE:
        try:
            require_repo_id(value if "/" in value else f"owner/{value}", var)
        except ConfigError:
            raise ConfigError(f"{var}={value!r} is not a Space name: use a name (it goes under the token's owner), "
                              f"owner/name, or {NO_SPACE} (no Space)") from None
    return value


def one_of(raw: str, var: str, choices: tuple[str, ...]) -> str:
    """One of a fixed set of words."""
    if raw.strip() not in choices:
        raise ConfigError(f"{var}={raw!r} is not one of {', '.join(choices)}")
    return raw.strip()


# The names the trainer pushes under: "final" (the adapter at the repo root) or checkpoint-N, N >= 1. The rule lives
# here, below every script, so that the knob check and the repo layout (adapter_repo) share it without a cycle.
CHECKPOINT_PREFIX = "checkpoint-"
FINAL = "final"
CHECKPOINT_PATTERN = rf"{FINAL}|{CHECKPOINT_PREFIX}[1-9][0-9]*"


def is_checkpoint(name: str) -> bool:
    """Whether `name` is one the trainer pushes: "final" or checkpoint-N."""
    return re.fullmatch(CHECKPOINT_PATTERN, name) is not None


def checkpoint_arg(raw: str, var: str) -> str:
    """A CHECKPOINT knob: 'final' or 'checkpoint-N'."""
    if not is_checkpoint(raw.strip()):
        raise ConfigError(f"{var}={raw!r} is not a checkpoint name: use 'final' or e.g. 'checkpoint-300'")
    return raw.strip()


def _stall_seconds(env: Mapping[str, str]) -> int:
    return math.ceil(knob("STALL_MINUTES", env) * 60)


def _step_or_off(raw: str, var: str) -> int:
    """0 (off) or a step number."""
    return 0 if raw.strip() == "0" else whole_number(raw, var)


def _offered(raw: str, var: str, choices: tuple[str, ...], why: str) -> str:
    """One of `choices`; anything else is refused with why it is not offered."""
    if raw.strip() not in choices:
        raise ConfigError(f"{var}={raw.strip()!r} is not offered ({why}): use {var}={choices[0]}"
                          + (f" (or {', '.join(choices[1:])})" if choices[1:] else ""))
    return raw.strip()


_HOST_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def host_name(raw: str, var: str) -> str:
    """A bare host name (an https:// or http:// prefix and a trailing / are dropped): where sandboxes reach /capture."""
    host = raw.strip().removeprefix("https://").removeprefix("http://").removesuffix("/")
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in host.split(".")):
        raise ConfigError(f"{var}={raw.strip()!r} is not a host name: use the job's public host, e.g. "
                          f"{var}=<job-id>--{PUBLIC_PORT}.hf.jobs (no path, no port)")
    return host


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
    "LEARNING_RATE": (LEARNING_RATE, positive_number),
    "MAX_STALENESS": (MAX_STALENESS, functools.partial(whole_number, lower=0)),  # 0: the current version's only
    "WEIGHT_SYNC": (WEIGHT_SYNC_MODES[0], functools.partial(one_of, choices=WEIGHT_SYNC_MODES)),
    "STALL_MINUTES": (STALL_MINUTES, functools.partial(
        positive_number, lower=STALL_MINUTES_MIN, upper=hours(TRAIN_TIMEOUT) * 60,
        why=f"a healthy rollout may take {ROLLOUT_CALL_LIMIT_S} s; past the job's {TRAIN_TIMEOUT} it never fires")),
    "STALL_SECONDS": (_stall_seconds, whole_number),
    "WATCH_INTERVAL": (WATCH_INTERVAL_S, positive_number),
    "READY_TIMEOUT": (READY_TIMEOUT_S, whole_number),
    "N_TASKS": (EVAL_WATCH_TASKS, functools.partial(whole_number, upper=TEST_TASKS, why="tasks in data/test.json")),
    "CHECKPOINT": (FINAL, checkpoint_arg),
    "MAX_IDLE_HOURS": (MAX_IDLE_HOURS, functools.partial(
        positive_number, upper=hours(EVAL_WATCH_TIMEOUT), why=f"the eval-watch job's {EVAL_WATCH_TIMEOUT} cap")),
    "EVAL_CONCURRENCY": (EVAL_CONCURRENCY, functools.partial(
        whole_number, upper=ENV_MAX_SESSIONS, why="the env server's ENV_MAX_SESSIONS; rollouts past it would fail")),
    "EVAL_MODE": ("full", functools.partial(one_of, choices=("full", "watch"))),
    "EVAL_TASKS": (TEST_TASKS, functools.partial(whole_number, upper=TEST_TASKS, why="tasks in data/test.json")),
    "MODE": ("train", functools.partial(one_of, choices=("train", "smoke"))),
    "STOP_AFTER_STEP": (0, _step_or_off),
    "MAX_LORAS": (1, whole_number),
    "POLICY_PORT": (VLLM_PORT, _port),
    "ENV_PORT": (ENV_PORT, _port),
    "PUBLIC_PORT": (PUBLIC_PORT, _port),
    "GATEWAY_HEAD_TIMEOUT": (GATEWAY_HEAD_TIMEOUT_S, positive_number),
    "GATEWAY_BODY_TIMEOUT": (GATEWAY_BODY_TIMEOUT_S, positive_number),
    "GATEWAY_IDLE_CONNECTIONS": (GATEWAY_IDLE_CONNECTIONS, whole_number),
    "GATEWAY_RESTARTS": (GATEWAY_RESTARTS, whole_number),
    "SPACE_HOST": ("", host_name),  # unset: run_job.sh / run_eval.sh derive it from JOB_ID
    "DASHBOARD_SPACE": (DASHBOARD_SPACE, space_name),
    "REPORT_TO": (REPORT_TO, functools.partial(_offered, choices=REPORTERS,
                                               why="the job installs Trackio and no other dashboard")),
    "SANDBOX": (SANDBOX, functools.partial(_offered, choices=tuple(SANDBOXES),
                                           why="the job installs and checks only these Harbor backends")),
}


# --- Knobs that are each fine alone but fail together: checked wherever one of them is (recipe.py --env, launch.py)
def _save_within_run(env: Mapping[str, str]) -> None:
    if env.get("SAVE_STEPS", "").strip() and knob("SAVE_STEPS", env) > (steps := knob("MAX_STEPS", env)):
        raise ConfigError(f"SAVE_STEPS={knob('SAVE_STEPS', env)} is more than MAX_STEPS={steps}: the run would push no "
                          f"checkpoint before its end (nothing to resume or watch); use SAVE_STEPS={steps} or less")


def _few_checkpoints(env: Mapping[str, str]) -> None:
    if env.get("SAVE_STEPS", "").strip() and (
            pushes := (steps := knob("MAX_STEPS", env)) // (save := knob("SAVE_STEPS", env))) > MAX_CHECKPOINTS:
        raise ConfigError(f"SAVE_STEPS={save} would push {pushes} checkpoints in MAX_STEPS={steps} (each ~0.5 GB of "
                          f"adapter and optimizer state, and an eval by the watcher): use SAVE_STEPS="
                          f"{-(-steps // MAX_CHECKPOINTS)} or more (at most {MAX_CHECKPOINTS} checkpoints a run)")


def _one_stall_limit(env: Mapping[str, str]) -> None:
    if env.get("STALL_SECONDS", "").strip() and env.get("STALL_MINUTES", "").strip():
        raise ConfigError(f"STALL_SECONDS={env['STALL_SECONDS'].strip()} and STALL_MINUTES="
                          f"{env['STALL_MINUTES'].strip()} are both set, and STALL_SECONDS would win: set only one")


def _watch_often_enough(env: Mapping[str, str]) -> None:
    limit = min(WATCH_INTERVAL_MAX_S, knob("STALL_SECONDS", env))
    if (interval := knob("WATCH_INTERVAL", env)) > limit:
        raise ConfigError(f"WATCH_INTERVAL={interval:g} is too long: the watchdog sees a stall or a dead server only "
                          f"at its checks; use at most {limit:g} (seconds)")


def _ports_distinct(env: Mapping[str, str]) -> None:
    ports: dict[int, str] = {}
    for name in PORT_KNOBS:
        port = knob(name, env)
        if port in ports:
            raise ConfigError(f"{ports[port]} and {name} are both {port}: give vLLM, the env server and the public "
                              "gateway a port each")
        ports[port] = name


KNOB_RULES: tuple[tuple[tuple[str, ...], Callable[[Mapping[str, str]], None]], ...] = (
    (("SAVE_STEPS", "MAX_STEPS"), _save_within_run),
    (("SAVE_STEPS", "MAX_STEPS"), _few_checkpoints),
    (("STALL_SECONDS", "STALL_MINUTES"), _one_stall_limit),
    (("WATCH_INTERVAL", "STALL_SECONDS", "STALL_MINUTES"), _watch_often_enough),
    (PORT_KNOBS, _ports_distinct),
)


def check_together(env: Mapping[str, str], names: Iterable[str]) -> None:
    """Run every rule of KNOB_RULES that involves one of `names`, on the knobs' values in `env` (defaults if unset)."""
    wanted = set(names)
    for involved, rule in KNOB_RULES:
        if wanted.intersection(involved):
            rule(env)


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


def pinned_versions(text: str = JOB_REQUIREMENTS) -> dict[str, str]:
    """Map distribution name -> version specifier, as pinned in JOB_REQUIREMENTS."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*([<>=!~].*)$", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2).replace(" ", "")
    return pins


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


def _print_env_knobs(names: list[str]) -> None:
    """`recipe.py --env NAME...`: NAME=value per line, each checked; a bad one exits with its one-line fix."""
    unknown = [name for name in names if name not in ENV_KNOBS]
    if unknown:
        sys.exit(f"recipe.py: unknown environment knob {unknown[0]!r}")
    try:
        lines = [f"{name}={shell_value(knob(name))}" for name in names]
        check_together(os.environ, names)
    except ConfigError as exc:
        sys.exit(str(exc))
    print("\n".join(lines))


def _shell_knobs() -> dict[str, str]:
    """Every knob a shell script may read (upper-case scalars and tuples), as text: tuples comma-joined."""
    return {name: ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            for name, value in globals().items()
            if name.isupper() and not name.startswith("_") and isinstance(value, (str, int, float, tuple))
            and "\n" not in str(value)}


def requirements(*sandboxes: str) -> str:
    """The pip requirements a job installs: JOB_REQUIREMENTS and the pins of each named backend, one text, so one pip
    call resolves them together (Harbor's range in JOB_REQUIREMENTS holds for the backend's extra too)."""
    return JOB_REQUIREMENTS + "".join(f"# SANDBOX={name}\n{SANDBOXES[name]['requirements']}" for name in sandboxes
                                      if SANDBOXES[name]["requirements"])


USAGE = """usage: python3 recipe.py NAME...        each knob's value, one per line (shell scripts read them so)
       python3 recipe.py --all          NAME=value of every knob
       python3 recipe.py --env NAME...  environment knobs, each checked (a bad one exits with its fix)
       python3 recipe.py --requirements [SANDBOX...]  the job's pip requirements (JOB_REQUIREMENTS and the backends')"""

if __name__ == "__main__":
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.strip()}", file=sys.stdout if sys.argv[1:] else sys.stderr)
        sys.exit(0 if sys.argv[1:] else 2)
    if sys.argv[1:2] == ["--requirements"]:
        if unknown := [name for name in sys.argv[2:] if name not in SANDBOXES]:
            sys.exit(f"recipe.py: unknown sandbox backend {unknown[0]!r}: use {'|'.join(SANDBOXES)}")
        print(requirements(*sys.argv[2:]), end="")
        sys.exit(0)
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
