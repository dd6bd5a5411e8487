# shellcheck shell=bash
# Helpers sourced by run_job.sh, run_eval.sh, run_eval_watch.sh, serve_policy.sh and serve_env.sh:
# logging, recipe knobs, the job scripts' one preflight, background processes with log files, readiness waits, cleanup.

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The job's python3 (the image's); from a set-up checkout, its .venv (so dry runs work on any machine).
if [ -z "${PYTHON:-}" ] && [ -x "$HERE/.venv/bin/python" ]; then PYTHON="$HERE/.venv/bin/python"; fi
PYTHON="${PYTHON:-python3}"
LOG_DIR="${LOG_DIR:-/tmp/lfm-logs}"
declare -a CHILD_PIDS=()

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { printf '[%s] ERROR: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; exit 1; }

# Every knob of recipe.py (the single source of truth for numbers), read once when this file is sourced: one
# Python start per script instead of one per knob (a job start used to make dozens).
declare -A RECIPE_KNOBS=()
load_recipe() {
  local out line
  out="$("$PYTHON" "$HERE/recipe.py" --all 2>&1)" \
    || die "recipe.py did not answer${out:+ ($(tail -n 1 <<<"$out"))}: run from the bundle folder with python3 >= 3.12"
  while IFS= read -r line; do RECIPE_KNOBS["${line%%=*}"]="${line#*=}"; done <<<"$out"
}

# recipe NAME...: prints each knob, one per line, as `python3 recipe.py NAME...` does; an unknown name fails.
recipe() {
  local name
  for name in "$@"; do
    [[ -v "RECIPE_KNOBS[$name]" ]] || { printf 'recipe.py: unknown knob %s\n' "$name" >&2; return 1; }
    printf '%s\n' "${RECIPE_KNOBS[$name]}"
  done
}

# env_knobs NAME...: checks each knob with recipe.py's check (the one launch.py and the Python side run) and sets
# it to the checked value (flags become 1 or 0; unset or empty: the recipe default); a bad one stops here with its fix.
env_knobs() {
  local out line
  out="$("$PYTHON" "$HERE/recipe.py" --env "$@" 2>&1)" || die "$(tail -n 1 <<<"$out")"
  while IFS= read -r line; do printf -v "${line%%=*}" '%s' "${line#*=}"; done <<<"$out"
}

# True when DRY_RUN is set to a yes value (checked once, below, as every script sources this file): commands
# are printed, not run.
dry_run() { [ "$DRY_RUN" = "1" ]; }

# Prints a command with the environment assignments it runs under, shell-quoted.
show_cmd() { printf '  $'; printf ' %q' "$@"; printf '\n'; }

# start_bg NAME CMD...: runs CMD in its own process group, output to $LOG_DIR/NAME.log.
start_bg() {
  local name="$1"; shift
  if dry_run; then show_cmd "$@"; return 0; fi
  mkdir -p "$LOG_DIR"
  setsid "$@" >"$LOG_DIR/$name.log" 2>&1 &
  CHILD_PIDS+=("$!")
  log "started $name (pid $!, log $LOG_DIR/$name.log)"
}

# tail_log NAME: the last lines of a child's log, for failure reports.
tail_log() { [ -f "$LOG_DIR/$1.log" ] && tail -n "${2:-40}" "$LOG_DIR/$1.log" | sed "s/^/  $1| /" >&2 || true; }

# wait_http NAME URL TIMEOUT_S PID: waits until URL answers 2xx (polling every WAIT_POLL=2 s); fails early if PID dies.
wait_http() {
  local name="$1" url="$2" timeout="$3" pid="${4:-}" start=$SECONDS
  if dry_run; then echo "  wait for $name at $url (timeout ${timeout}s)"; return 0; fi
  until curl -fsS -o /dev/null --max-time 5 "$url" 2>/dev/null; do
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then tail_log "$name"; die "$name exited before it was ready"; fi
    if (( SECONDS - start > timeout )); then tail_log "$name"; die "$name not ready at $url after ${timeout}s"; fi
    sleep "${WAIT_POLL:-2}"
  done
  log "$name ready at $url ($(( SECONDS - start ))s)"
}

# port_free PORT: fails with a clear line if something already listens on PORT.
port_free() {
  dry_run && return 0
  if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then die "port $1 is already in use: stop what listens there or change the port"; fi
}

# children_alive: true while any child started with start_bg, or its process group, still has a member.
children_alive() {
  local pid
  for pid in "${CHILD_PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null || kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

# signal_children SIG: sends SIG to each child's group and to the child itself: a cleanup that comes right after
# start_bg can find the child before its setsid has made the group, and TERM to the group alone would miss it.
signal_children() {
  local pid
  for pid in "${CHILD_PIDS[@]}"; do kill "-$1" -- "-$pid" 2>/dev/null || true; kill "-$1" "$pid" 2>/dev/null || true; done
}

# cleanup: TERMs every child started with start_bg, waits up to 1 s (ten 0.1 s polls) for them to stop, then
# KILLs what is left. A script that started nothing (a refused input) exits at once.
cleanup() {
  local _
  signal_children TERM
  for _ in 1 2 3 4 5 6 7 8 9 10; do children_alive || return 0; sleep 0.1; done
  signal_children KILL
}

# require_gpus INDEX...: fails with one line if nvidia-smi does not list every given GPU index; the hint names
# JOB_FLAVOR, the flavor the calling job script needs (set by run_job.sh and run_eval.sh).
require_gpus() {
  dry_run && return 0
  local found idx
  found="$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' | paste -sd, -)" \
    || die "nvidia-smi failed: no NVIDIA GPU visible; run on a GPU job${JOB_FLAVOR:+ (flavor $JOB_FLAVOR)} with GPUs $*"
  for idx in "$@"; do
    [[ ",$found," == *",$idx,"* ]] \
      || die "GPU $idx not found (nvidia-smi lists: ${found:-none}): ${JOB_FLAVOR:+run on an $JOB_FLAVOR job or }change the GPU index"
  done
}

# require_sandbox_credentials: SANDBOX is a backend the job installs and its key is set (recipe.py's checks, the
# launcher's); the lines on what the backend's plan must allow (recipe.sandbox_notes) go to the log.
require_sandbox_credentials() {
  env_knobs SANDBOX
  py_check 'import recipe
try:
    recipe.sandbox_keys(sys.argv[2])
except recipe.ConfigError as exc:
    sys.exit(str(exc))
print(*(f"note: {note}" for note in recipe.sandbox_notes(sys.argv[2])), sep="\n", end="")' "$SANDBOX"
}

# Runs a command, or prints it under DRY_RUN=1.
do_cmd() { if dry_run; then show_cmd "$@"; else "$@"; fi; }

# step N NAME FUNCTION...: runs FUNCTION and prints one line with what it did ($STEP_NOTE) and how long it took.
# With STAGES_FILE set (the smoke run), it also records "start NAME EPOCH" / "end NAME EPOCH NOTE" for the report:
# a step that started and never ended is the one the job died in.
STEP_NOTE=""
step() {
  local n="$1" name="$2" t0=$SECONDS
  shift 2
  STEP_NOTE=""
  log "step $n/$STEPS $name"
  record_stage start "$name"
  "$@"
  record_stage end "$name" "${STEP_NOTE:-done}"
  log "step $n/$STEPS $name: ${STEP_NOTE:-done} ($(( SECONDS - t0 ))s)"
}

record_stage() {
  if [ -z "${STAGES_FILE:-}" ] || dry_run; then return 0; fi
  mkdir -p "$(dirname "$STAGES_FILE")"
  printf '%s %s %s %s\n' "$1" "$2" "$(date +%s)" "${3:-}" >>"$STAGES_FILE"
}

# py_check CODE ARGS...: runs python with the bundle importable; on failure dies with the last line it printed.
py_check() {
  local code="$1" out
  shift
  out="$("$PYTHON" -c "import sys; sys.path.insert(0, sys.argv[1]); $code" "$HERE" "$@" 2>&1)" \
    || die "$(tail -n 1 <<<"$out")"
  [ -z "$out" ] || printf '%s\n' "$out"
}

# require_repo_and_token: ADAPTER_REPO is owner/name and HF_TOKEN is set (recipe.py's checks and messages).
require_repo_and_token() {
  py_check 'import os, recipe
try:
    recipe.require_repo_id(os.environ.get("ADAPTER_REPO", "").strip(), "ADAPTER_REPO")
    recipe.require_token()
except recipe.ConfigError as exc:
    sys.exit(str(exc))'
}

# The knobs every job script (run_job.sh, run_eval.sh and so run_eval_watch.sh) checks before its step 0. run_job.sh's
# final eval is run_eval.sh in the training job's environment, so what the eval would refuse stops the training job
# before its hours of training, not after them; DEBUG is read by every Python step.
JOB_SCRIPT_KNOBS=(DEBUG READY_TIMEOUT POLICY_PORT ENV_PORT PUBLIC_PORT SANDBOX REPORT_TO DASHBOARD_SPACE EVAL_TASKS
  EVAL_CONCURRENCY)

# job_knobs NAME...: env_knobs on JOB_SCRIPT_KNOBS and the script's own knobs NAME... (one recipe.py call, the rules
# that join knobs included); SANDBOX exported for every step.
job_knobs() {
  env_knobs "${JOB_SCRIPT_KNOBS[@]}" "$@"
  export SANDBOX
}

# job_preflight GPU...: every job script's step 0 checks, each failure one line before anything is installed or
# started: ADAPTER_REPO and HF_TOKEN, the sandbox backend, the job's public host, the GPUs given, the three ports free.
job_preflight() {
  local port
  require_repo_and_token
  require_sandbox_credentials
  resolve_public_host
  require_gpus "$@"
  for port in "$POLICY_PORT" "$ENV_PORT" "$PUBLIC_PORT"; do port_free "$port"; done
}

# resolve_public_host: sets PUBLIC_HOSTNAME (the job's own host for PUBLIC_PORT, where sandboxes reach the
# capture proxy) and CAPTURE_URL, or dies naming the variables to set.
resolve_public_host() {
  local job_id="${JOB_ID:-${HF_JOB_ID:-}}"
  env_knobs SPACE_HOST
  if [ -n "$SPACE_HOST" ]; then
    PUBLIC_HOSTNAME="$SPACE_HOST"
  elif [ -n "$job_id" ]; then
    [[ "$job_id" =~ ^[A-Za-z0-9-]+$ ]] || die "JOB_ID=$job_id is not a job id (letters, digits, -)"
    PUBLIC_HOSTNAME="$job_id--$PUBLIC_PORT.hf.jobs"
  else
    die "cannot derive the job's public host: set SPACE_HOST=<job-id>--$PUBLIC_PORT.hf.jobs or JOB_ID=<job-id> (HF_JOB_ID is read too)"
  fi
  # shellcheck disable=SC2034  # read by the sourcing script
  CAPTURE_URL="https://$PUBLIC_HOSTNAME/capture"
}

# install_stack: the pinned stack next to vLLM's own (vllm and torch held at the image's versions, every
# requirement vLLM declares held in its range, transformers --no-deps), then every pin and vllm==VLLM_VERSION
# checked (versions printed on failure), `pip check` clean but for recipe.PIP_CHECK_ACCEPTED, and vLLM's API
# server importable: all before any GPU work.
install_stack() {
  local req="$WORK_DIR/requirements.txt" pins tf_pin
  # The job's pins and SANDBOX's (recipe.SANDBOXES: daytona|e2b add Harbor's extra), resolved in one pip call.
  pins="$("$PYTHON" "$HERE/recipe.py" --requirements "$SANDBOX")" || die "recipe.py did not print the job's pins"
  tf_pin="$(grep -E '^transformers==' <<<"$pins")" || die "recipe.py JOB_REQUIREMENTS has no transformers== pin"
  if dry_run; then
    echo "  write $req (recipe.py --requirements $SANDBOX): $(grep -vE '^(#|$)' <<<"$pins" | paste -sd' ')"
  else
    mkdir -p "$WORK_DIR"; printf '%s\n' "$pins" >"$req"
  fi
  local -a tools=()
  command -v git >/dev/null 2>&1 || tools+=(git)
  command -v curl >/dev/null 2>&1 || tools+=(curl)  # wait_http needs it
  if dry_run; then echo "  (only the missing ones of git, curl)"; tools=(git curl); fi
  if [ "${#tools[@]}" -gt 0 ]; then
    do_cmd apt-get update -qq
    do_cmd apt-get install -y -qq --no-install-recommends "${tools[@]}"
  fi
  if dry_run; then
    echo "  write $WORK_DIR/constraints.txt: $tf_pin, vllm and torch at the image's versions, vLLM's own requirement ranges"
  else
    py_check 'import image_check; open(sys.argv[2], "w").write("\n".join(image_check.vllm_constraints(sys.argv[3])) + "\n")' \
      "$WORK_DIR/constraints.txt" "$tf_pin"
    grep -vE '^transformers' "$req" >"$WORK_DIR/requirements-rest.txt"
  fi
  do_cmd "$PYTHON" -m pip install -q --no-deps "$tf_pin"
  do_cmd "$PYTHON" -m pip install -q -c "$WORK_DIR/constraints.txt" -r "$WORK_DIR/requirements-rest.txt"
  if dry_run; then
    STEP_NOTE="then check every pin and vllm==$(recipe VLLM_VERSION), pip check (less recipe.PIP_CHECK_ACCEPTED), import vllm.entrypoints.openai.api_server"
    return 0
  fi
  py_check 'from importlib import metadata
from packaging.version import InvalidVersion, Version
import recipe
def found(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"
def base(version):
    try:
        return Version(version).base_version
    except InvalidVersion:
        return version
names = [*recipe.pinned_versions(), "vllm", "torch"]
versions = ", ".join(f"{n} {found(n)}" for n in names)
vllm = found("vllm")
try:
    recipe.check_versions(tuple(recipe.pinned_versions()))
    if base(vllm) != recipe.VLLM_VERSION:
        raise recipe.ConfigError(f"vllm {vllm} is installed, the recipe needs vllm=={recipe.VLLM_VERSION} "
                                 f"(use the {recipe.VLLM_IMAGE} image)")
except recipe.ConfigError as exc:
    sys.exit(f"{exc}; versions found: {versions}")
print(f"  versions: {versions}")'
  local report
  report="$("$PYTHON" -m pip check 2>&1)" || true  # non-zero when it finds breaks: image_check.py judges them
  report="$(printf '%s\n' "$report" | "$PYTHON" "$HERE/image_check.py" pip-check 2>&1)" || die "$(tail -n 1 <<<"$report")"
  report="$("$PYTHON" -c 'import vllm.entrypoints.openai.api_server' 2>&1)" \
    || die "vLLM's API server does not import after the install step: $(tail -n 1 <<<"$report")"
  STEP_NOTE="pinned stack installed and checked; pip check clean but for recipe.PIP_CHECK_ACCEPTED; vLLM's API server imports"
}

# on_exit: the EXIT trap of a job script: kills every child process group, runs $REPORT_HOOK if the script set one
# (the smoke report: it runs whatever happened, and its failure fails the job), says the script failed if it did.
on_exit() {
  local rc=$? hook_rc=0
  trap - EXIT
  cleanup
  if [ -n "${REPORT_HOOK:-}" ]; then
    "$REPORT_HOOK" || hook_rc=$?
    [ "$rc" -ne 0 ] || rc="$hook_rc"
  fi
  if [ "$rc" -ne 0 ]; then log "$(basename "$0" .sh): FAILED (exit $rc)$([ ! -d "$LOG_DIR" ] || echo "; logs in $LOG_DIR")"; fi
  exit "$rc"
}

# begin_job READ_KNOBS: the start of a job script's main: on_exit on any exit (TERM/INT become exits, so it
# runs), then the script's knob reader, then a note when DRY_RUN=1 only prints the plan.
begin_job() {
  trap on_exit EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  "$1"
  if dry_run; then log "DRY_RUN=1: printing the plan; nothing is installed or started"; fi
}

load_recipe
env_knobs DRY_RUN
