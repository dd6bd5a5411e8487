# shellcheck shell=bash
# Sourced by every job and server script: logging, recipe knobs, the job scripts' one preflight, the install step,
# background processes with log files, cleanup.

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The job's python3 (the image's); from a set-up checkout, its .venv (so dry runs work on any machine).
if [ -z "${PYTHON:-}" ] && [ -x "$HERE/.venv/bin/python" ]; then PYTHON="$HERE/.venv/bin/python"; fi
PYTHON="${PYTHON:-python3}"
LOG_DIR="${LOG_DIR:-/tmp/lfm-logs}"
declare -a CHILD_PIDS=()

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { printf '[%s] ERROR: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; exit 1; }

# Every knob of recipe.py, read once when this file is sourced (one Python start per script, not one per knob).
declare -A RECIPE_KNOBS=()
RECIPE_ALL="$("$PYTHON" "$HERE/recipe.py" --all 2>&1)" \
  || die "recipe.py did not answer${RECIPE_ALL:+ ($(tail -n 1 <<<"$RECIPE_ALL"))}: run from the bundle folder with python3 >= 3.12"
while IFS= read -r RECIPE_LINE; do RECIPE_KNOBS["${RECIPE_LINE%%=*}"]="${RECIPE_LINE#*=}"; done <<<"$RECIPE_ALL"

# recipe NAME...: prints each knob, one per line, as `python3 recipe.py NAME...` does; an unknown name fails.
recipe() {
  local name
  for name in "$@"; do
    [[ -v "RECIPE_KNOBS[$name]" ]] || { printf 'recipe.py: unknown knob %s\n' "$name" >&2; return 1; }
    printf '%s\n' "${RECIPE_KNOBS[$name]}"
  done
}

# env_knobs NAME...: sets each knob to its value as recipe.KNOBS checks it (flags 1 or 0); a bad one dies with its fix.
env_knobs() {
  local out line
  out="$("$PYTHON" "$HERE/recipe.py" --env "$@" 2>&1)" || die "$(tail -n 1 <<<"$out")"
  while IFS= read -r line; do printf -v "${line%%=*}" '%s' "${line#*=}"; done <<<"$out"
}

# py_check CODE ARGS...: runs python with the bundle importable; a failure dies with its last line (a ConfigError's).
py_check() {
  local code="$1" out
  shift
  out="$("$PYTHON" -c "import sys; sys.path.insert(0, sys.argv[1]); $code" "$HERE" "$@" 2>&1)" \
    || { out="$(tail -n 1 <<<"$out")"; die "${out#recipe.ConfigError: }"; }
}

dry_run() { [ "$DRY_RUN" = "1" ]; }
show_cmd() { printf '  $'; printf ' %q' "$@"; printf '\n'; }
# do_cmd CMD...: runs a command, or prints it under DRY_RUN=1.
do_cmd() { if dry_run; then show_cmd "$@"; else "$@"; fi; }

# start_bg NAME CMD...: runs CMD in its own process group, output to $LOG_DIR/NAME.log.
start_bg() {
  local name="$1"; shift
  if dry_run; then show_cmd "$@"; return 0; fi
  mkdir -p "$LOG_DIR"
  setsid "$@" >"$LOG_DIR/$name.log" 2>&1 &
  CHILD_PIDS+=("$!")
  log "started $name (pid $!, log $LOG_DIR/$name.log)"
}

# tail_log NAME [N]: the last lines of a child's log, for failure reports.
tail_log() { [ -f "$LOG_DIR/$1.log" ] || return 0; tail -n "${2:-40}" "$LOG_DIR/$1.log" | sed "s/^/  $1| /" >&2 || true; }

# http_ok URL: whether http://HOST:PORT/PATH (a server this script started) answers 2xx. Bash's own /dev/tcp, no proxy:
# curl may not be in the image, and a Python start per poll cost a tenth of a CPU-second.
http_ok() {
  local rest="${1#http://}"
  local hostport="${rest%%/*}" path="/${rest#*/}"
  [[ "$rest" == */* ]] || path=/
  ( exec 3<>"/dev/tcp/${hostport%:*}/${hostport##*:}" || exit 1
    printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$path" "$hostport" >&3
    read -r -t 5 _ status _ <&3 && [[ "$status" == 2[0-9][0-9] ]] ) 2>/dev/null
}

# wait_http NAME URL TIMEOUT_S PID: waits until URL answers 2xx (polling every WAIT_POLL=2 s); fails early if PID dies.
wait_http() {
  local name="$1" url="$2" timeout="$3" pid="${4:-}" start=$SECONDS
  if dry_run; then echo "  wait for $name at $url (timeout ${timeout}s)"; return 0; fi
  until http_ok "$url"; do
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

# cleanup: TERMs each child's group and the child (right after start_bg the group may not exist yet), waits up to 1 s
# for them to stop, then KILLs what is left (none started: no wait).
cleanup() {
  local pid _
  for pid in "${CHILD_PIDS[@]}"; do kill -TERM -- "-$pid" "$pid" 2>/dev/null || true; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do children_alive || return 0; sleep 0.1; done
  for pid in "${CHILD_PIDS[@]}"; do kill -KILL -- "-$pid" "$pid" 2>/dev/null || true; done
}

# require_gpus INDEX...: fails with one line if nvidia-smi (none: no GPU) does not list each GPU index.
require_gpus() {
  dry_run && return 0
  local found idx
  found="$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' | paste -sd, -)" || found=""
  for idx in "$@"; do
    [[ ",$found," == *",$idx,"* ]] \
      || die "GPU $idx not found (nvidia-smi lists: ${found:-none}): ${JOB_FLAVOR:+run on an $JOB_FLAVOR job or }change the GPU index"
  done
}

# record_stage start|end NAME [NOTE]: a line of STAGES_FILE (the smoke run's, which its preflight creates).
record_stage() { [ -z "${STAGES_FILE:-}" ] || dry_run || printf '%s %s %s %s\n' "$1" "$2" "$(date +%s)" "${3:-}" >>"$STAGES_FILE"; }

# step N NAME FUNCTION...: runs FUNCTION, then one line: what it did ($STEP_NOTE) and how long it took; with
# STAGES_FILE set (the smoke run), "start NAME EPOCH" / "end NAME EPOCH NOTE" lines for the report.
STEP_NOTE=""
step() {
  local n="$1" name="$2" t0=$SECONDS
  shift 2; STEP_NOTE=""
  log "step $n/$STEPS $name"
  record_stage start "$name"
  "$@"
  record_stage end "$name" "${STEP_NOTE:-done}"
  log "step $n/$STEPS $name: ${STEP_NOTE:-done} ($(( SECONDS - t0 ))s)"
}

# job_knobs NAME...: env_knobs on every job script's knobs (what run_eval.sh, run_job.sh's final eval, would refuse
# stops the training job before its hours of training) and NAME...; SANDBOX exported for every step.
job_knobs() {
  env_knobs DEBUG READY_TIMEOUT POLICY_PORT ENV_PORT PUBLIC_PORT SANDBOX REPORT_TO DASHBOARD_SPACE EVAL_TASKS \
    EVAL_CONCURRENCY "$@"
  export SANDBOX
}

# job_preflight GPU...: every job script's step 0, each failure one line before anything is installed or started:
# ADAPTER_REPO and HF_TOKEN, the sandbox backend, the job's public host, the GPUs given, the three ports free.
job_preflight() {
  local port job_id="${JOB_ID:-${HF_JOB_ID:-}}"
  py_check 'import os, recipe
recipe.require_repo_id(os.environ.get("ADAPTER_REPO", "").strip(), "ADAPTER_REPO")
recipe.require_token(); recipe.sandbox_keys(os.environ["SANDBOX"])'
  env_knobs SPACE_HOST  # where sandboxes reach PUBLIC_PORT: given, or the job's own public host
  [ -n "$SPACE_HOST$job_id" ] || die "cannot derive the job's public host: set SPACE_HOST=<job-id>--$PUBLIC_PORT.hf.jobs or JOB_ID=<job-id> (HF_JOB_ID is read too)"
  PUBLIC_HOSTNAME="${SPACE_HOST:-$job_id--$PUBLIC_PORT.hf.jobs}"
  # shellcheck disable=SC2034  # read by the sourcing script
  CAPTURE_URL="https://$PUBLIC_HOSTNAME/capture"
  require_gpus "$@"
  for port in "$POLICY_PORT" "$ENV_PORT" "$PUBLIC_PORT"; do port_free "$port"; done
}

# install_stack: the job's pins and SANDBOX's (recipe.py --requirements) in one pip call beside the image's vLLM, held
# by image_check.py's constraints (transformers in --no-deps); then `pip check` and vLLM's API server import.
install_stack() {
  local pins tf_pin report
  pins="$("$PYTHON" "$HERE/recipe.py" --requirements "$SANDBOX")"
  tf_pin="$(grep -E '^transformers==' <<<"$pins")"
  if dry_run; then
    echo "  install (recipe.py --requirements $SANDBOX): $(grep -vE '^(#|$)' <<<"$pins" | paste -sd' ')"
    echo "  held by image_check.py (an image without vllm==$(recipe VLLM_VERSION) is refused): $tf_pin, vllm and" \
      "torch at the image's versions, vLLM's own ranges; then pip check (less recipe.PIP_CHECK_ACCEPTED), import vLLM"
  else
    mkdir -p "$WORK_DIR"
    report="$("$PYTHON" "$HERE/image_check.py" constraints "$tf_pin" 2>&1)" || die "$(tail -n 1 <<<"$report")"
    printf '%s\n' "$report" >"$WORK_DIR/constraints.txt"
    grep -vE '^transformers' <<<"$pins" >"$WORK_DIR/requirements-rest.txt"
    STEP_NOTE="pinned stack installed, holding $(grep -E '^(vllm|torch)==' <<<"$report" | paste -sd' ')"
  fi
  do_cmd "$PYTHON" -m pip install -q --no-deps "$tf_pin"
  do_cmd "$PYTHON" -m pip install -q -c "$WORK_DIR/constraints.txt" -r "$WORK_DIR/requirements-rest.txt"
  dry_run && return 0
  report="$("$PYTHON" -m pip check 2>&1)" || true  # non-zero when it finds breaks: image_check.py judges them
  report="$(printf '%s\n' "$report" | "$PYTHON" "$HERE/image_check.py" pip-check 2>&1)" || die "$(tail -n 1 <<<"$report")"
  report="$("$PYTHON" -c 'import vllm.entrypoints.openai.api_server' 2>&1)" \
    || die "vLLM's API server does not import after the install step: $(tail -n 1 <<<"$report")"
  STEP_NOTE+="; pip check clean but for recipe.PIP_CHECK_ACCEPTED; vLLM's API server imports"
}

# on_exit: a job script's EXIT trap: stops every child, runs $REPORT_HOOK (the smoke report; its failure fails the job).
on_exit() {
  local rc=$? hook_rc=0
  trap - EXIT
  cleanup
  [ -z "${REPORT_HOOK:-}" ] || "$REPORT_HOOK" || hook_rc=$?
  [ "$rc" -ne 0 ] || rc="$hook_rc"
  if [ "$rc" -ne 0 ]; then log "$(basename "$0" .sh): FAILED (exit $rc)$([ ! -d "$LOG_DIR" ] || echo "; logs in $LOG_DIR")"; fi
  exit "$rc"
}

# begin_job READ_KNOBS: a job script's start: on_exit on any exit (TERM/INT become exits), then its knob reader.
begin_job() {
  trap on_exit EXIT
  trap 'exit 143' TERM; trap 'exit 130' INT
  "$1"
  if dry_run; then log "DRY_RUN=1: printing the plan; nothing is installed or started"; fi
}

env_knobs DRY_RUN
