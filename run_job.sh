#!/usr/bin/env bash
# The HF Job entrypoint (vllm/vllm-openai image, h200x2): one job that installs the pinned stack next to
# vLLM, checks the Harbor session client, patches the OpenCode seam, prepares the tasks, starts vLLM (GPU 1) and the env
# server, trains the LoRA (GPU 0) under a stall watchdog, then runs the final base-vs-adapter eval.
#
#   bash run_job.sh                                               # inside the job (see README "Your path")
#   DRY_RUN=1 ADAPTER_REPO=you/x HF_TOKEN=x JOB_ID=abc bash run_job.sh   # print the plan, start nothing
#
# Environment (defaults from recipe.py):
#   ADAPTER_REPO             required: owner/name of the adapter repo checkpoints are pushed to.
#   HF_TOKEN                 required (job secret); never printed.
#   MAX_STEPS=<MAX_STEPS>    optimizer steps (<SMOKE_STEPS> = the recipe's ~40-minute smoke).  SAVE_STEPS=<SAVE_STEPS>
#   RESUME=1  WEIGHT_SYNC=merge_free  LEARNING_RATE=<LEARNING_RATE>  MAX_STALENESS=<MAX_STALENESS>   passed to
#                            train_lora.py.  Yes/no knobs take 1/true/yes/on or 0/false/no/off.
#   SANDBOX=<SANDBOX>        or daytona, e2b: its key as a job secret (docs/sandboxes.md).  REPORT_TO=<REPORT_TO>
#   DASHBOARD_SPACE=<DASHBOARD_SPACE>   the Trackio Space: a name, owner/name, or local (no Space).
#   SPACE_HOST | JOB_ID | HF_JOB_ID   the job's public host is SPACE_HOST, else <job-id>--<PUBLIC_PORT>.hf.jobs.
#   WORK_DIR=/tmp/lfm-job    tasks, trainer output and recipe.py's work-folder files: heartbeat, train_log.json,
#                            rollouts.json (a later trainer start keeps the earlier one's as rollouts.start-N.json).
#                            Logs: LOG_DIR=/tmp/lfm-logs.
#   STALL_MINUTES=<STALL_MINUTES> (or STALL_SECONDS)   no optimizer step and no finished rollout for this long
#                            fails the job (recipe.py states why a healthy run always beats within it).
#   WATCH_INTERVAL=<WATCH_INTERVAL_S>  seconds between watchdog checks.  READY_TIMEOUT=<READY_TIMEOUT_S>  server start-up limit (s).
#   POLICY_PORT=<VLLM_PORT>  ENV_PORT=<ENV_PORT>  PUBLIC_PORT=<PUBLIC_PORT>   (only PUBLIC_PORT is exposed)
#   FINAL_EVAL=1             0 skips the final eval (run_eval.sh) after training.
#   EVAL_CONCURRENCY=<EVAL_CONCURRENCY>   the final eval's rollouts in flight (checked here, before training).
#   DEBUG=0                  1: a failing Python step prints its traceback above its one line (the trainer always does).
#   MODE=train               smoke = the smoke run (launch.py smoke): into an -smoke repo it empties first,
#                            MAX_STEPS=<SMOKE_STEPS> or fewer, SAVE_STEPS and EVAL_TASKS the plan's (smoke_report.py
#                            plan --knobs --steps N); the trainer stops after the first checkpoint and a second start
#                            resumes from the Hub; the final eval on the plan's test subset; every stage under the
#                            plan's deadline (smoke_report.py plan), then the go/no-go report (smoke_report.json
#                            pushed; exit 1 on NO-GO) whatever happened.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

declare -A PID=()
# launch NAME CMD...: start_bg, remembering NAME's pid for the watchdog and stop_child.
launch() {
  start_bg "$@"
  dry_run || PID[$1]="${CHILD_PIDS[-1]}"
}

# Reads recipe.py's knobs and checks every environment knob (recipe.py's checks, as launch.py and train_lora.py
# run them): a bad value stops the job here, before step 1.
read_knobs() {
  local -a k
  mapfile -t k < <(recipe LOOPBACK TRAINER_GPU VLLM_GPU TRAIN_FLAVOR SMOKE_STEPS)
  [ "${#k[@]}" -eq 5 ] || die "recipe.py did not answer: run from the bundle folder with python3 >= 3.12"
  LOOPBACK="${k[0]}"; TRAINER_GPU="${k[1]}"; VLLM_GPU="${k[2]}"
  JOB_FLAVOR="${k[3]}"
  env_knobs MODE
  STEPS=9
  if [ "$MODE" = smoke ]; then  # the smoke plan's numbers for its MAX_STEPS unless set (preflight checks them)
    STEPS=10; export MAX_STEPS="${MAX_STEPS:-${k[4]}}"
    env_knobs MAX_STEPS
    SMOKE_PLAN="$("$PYTHON" "$HERE/smoke_report.py" plan --knobs --steps "$MAX_STEPS" 2>&1)" \
      || die "$(tail -n 1 <<<"$SMOKE_PLAN")"
    local plan_save="${SMOKE_PLAN#*SAVE_STEPS=}" plan_eval="${SMOKE_PLAN##*EVAL_TASKS=}"
    export SAVE_STEPS="${SAVE_STEPS:-${plan_save%% *}}" EVAL_TASKS="${EVAL_TASKS:-$plan_eval}"
  fi
  job_knobs MAX_STEPS SAVE_STEPS RESUME WEIGHT_SYNC FINAL_EVAL STALL_MINUTES STALL_SECONDS WATCH_INTERVAL LEARNING_RATE \
    MAX_STALENESS
  WORK_DIR="${WORK_DIR:-/tmp/lfm-job}"; TASKS_DIR="$WORK_DIR/tasks"; OUTPUT_DIR="$WORK_DIR/output"
  HEARTBEAT_FILE="$WORK_DIR/$(recipe HEARTBEAT_NAME)"; STAGES_FILE=""  # the trainer's records land beside it
  VLLM_URL="http://$LOOPBACK:$POLICY_PORT"; ENV_URL="http://$LOOPBACK:$ENV_PORT"
}

# Bad input stops the job here, with one line, before anything is installed or started.
preflight() {
  job_preflight "$TRAINER_GPU" "$VLLM_GPU"
  [ "$MODE" = train ] || smoke_preflight
  STEP_NOTE="MODE=$MODE ADAPTER_REPO=$ADAPTER_REPO MAX_STEPS=$MAX_STEPS SANDBOX=$SANDBOX public https://$PUBLIC_HOSTNAME"
}

# The smoke run's own checks and plan; from here on the job ends with the report, whatever happens.
smoke_preflight() {
  [[ "$ADAPTER_REPO" == *-smoke ]] \
    || die "MODE=smoke empties its repo first: ADAPTER_REPO=$ADAPTER_REPO must end with -smoke (launch.py smoke adds it)"
  [ "MAX_STEPS=$MAX_STEPS SAVE_STEPS=$SAVE_STEPS EVAL_TASKS=$EVAL_TASKS" = "$SMOKE_PLAN" ] \
    || die "MODE=smoke runs its budgeted plan ($SMOKE_PLAN): set only MAX_STEPS (at most the recipe's SMOKE_STEPS)"
  "$PYTHON" "$HERE/smoke_report.py" plan --steps "$MAX_STEPS"
  DEADLINE=$(( $(date +%s) + $("$PYTHON" "$HERE/smoke_report.py" plan --deadline --steps "$MAX_STEPS") ))
  STOP_AFTER_STEP="$SAVE_STEPS"
  STAGES_FILE="$WORK_DIR/$(recipe STAGES_NAME)"
  dry_run || { mkdir -p "$WORK_DIR"; : >"$STAGES_FILE"; }
  record_stage start preflight  # this step began before the file existed
  REPORT_HOOK=smoke_job_report
  # Emptied (and this run recorded in it) before anything can read the repo: a watcher adopts only this run's files.
  do_cmd "$PYTHON" "$HERE/smoke_report.py" clear
}

# The go/no-go report ($REPORT_HOOK, run at exit): one screen in the log, smoke_report.json pushed; 1 on NO-GO.
smoke_job_report() {
  local -a cmd=("$PYTHON" "$HERE/smoke_report.py" report --work-dir "$WORK_DIR" --stages "$STAGES_FILE")
  if dry_run; then
    echo "  at exit, whatever happened: the go/no-go report (smoke_report.json; the job fails on NO-GO)"
    show_cmd "${cmd[@]}"
    return 0
  fi
  log "smoke report: checkpoints read back from $ADAPTER_REPO, the job's own records in $WORK_DIR"
  "${cmd[@]}"
}

# 2. The session client (harbor_sessions.py, on the pinned openenv's public client) is one TRL 1.15 can train from.
check_sessions() {
  do_cmd "$PYTHON" "$HERE/harbor_sessions.py" check
  STEP_NOTE="Harbor sessions satisfy openenv's TrainableSession (no OpenEnv checkout needed)"
}

# 3. The x-api-key seam patch (applied for real inside the env server, which starts through seam_patch.py).
check_seam() {
  do_cmd "$PYTHON" "$HERE/seam_patch.py" check
  STEP_NOTE="opencode sends the capture session as x-api-key (the Jobs proxy strips Authorization)"
}

# 4. The pinned, hash-checked train tasks.
prepare_tasks() {
  do_cmd "$PYTHON" "$HERE/prepare_tasks.py" --out "$TASKS_DIR" --split train
  STEP_NOTE="train tasks in $TASKS_DIR/train"
}

# 5. vLLM on its GPU, loopback only.
start_policy() {
  local -a vars=(GPU="$VLLM_GPU" HOST="$LOOPBACK" PORT="$POLICY_PORT" LORA=0)
  launch vllm env "${vars[@]}" bash "$HERE/serve_policy.sh"
  dry_run && env "${vars[@]}" bash "$HERE/serve_policy.sh"
  wait_http vllm "$VLLM_URL/health" "$READY_TIMEOUT" "${PID[vllm]:-}"
  STEP_NOTE="vLLM on GPU $VLLM_GPU at $VLLM_URL"
}

# 6. Env server on loopback, capture public at https://<public host>/capture through the gateway.
start_env_server() {
  local -a vars=(DATASETS="$TASKS_DIR/train" SPACE_HOST="$PUBLIC_HOSTNAME" POLICY_URL="$VLLM_URL"
    ENV_HOST="$LOOPBACK" ENV_PORT="$ENV_PORT" PUBLIC_PORT="$PUBLIC_PORT")
  launch env_server env "${vars[@]}" bash "$HERE/serve_env.sh"
  dry_run && env "${vars[@]}" bash "$HERE/serve_env.sh"
  wait_http env_server "$ENV_URL/health" "$READY_TIMEOUT" "${PID[env_server]:-}"
  wait_http env_server "http://127.0.0.1:$PUBLIC_PORT/capture/health" "$READY_TIMEOUT" "${PID[env_server]:-}"
  STEP_NOTE="env server at $ENV_URL, capture public at $CAPTURE_URL"
}

# 7. The watchdog's terms; it runs in supervise() while the trainer does.
arm_watchdog() {
  dry_run || mkdir -p "$WORK_DIR"
  dry_run || touch "$HEARTBEAT_FILE"
  STEP_NOTE="no optimizer step and no finished rollout for ${STALL_SECONDS}s ($HEARTBEAT_FILE) fails the job; so does any server exiting"
}

# 8. The trainer on its GPU, supervised until it exits. The smoke run (its repo emptied by the preflight) stops the
#    trainer after its first checkpoint (STOP_AFTER_STEP), which step 9 resumes from the Hub.
train() {
  if [ "$MODE" = smoke ]; then
    run_trainer trainer "$OUTPUT_DIR" STOP_AFTER_STEP="$STOP_AFTER_STEP"
    STEP_NOTE="trainer stopped after checkpoint-$STOP_AFTER_STEP (pushed)"
  else
    run_trainer trainer "$OUTPUT_DIR"
    STEP_NOTE="trainer finished $MAX_STEPS steps"
  fi
}

# 9 (smoke). A second trainer start, as a relaunched job: resumes from checkpoint-STOP_AFTER_STEP on the Hub (into
#    an empty output folder, so nothing local helps). The first start's rollout counts are kept aside for the report
#    (recipe.keep_ledger_aside: the work folder's naming rule, the one smoke_report.py reads them by).
resume_training() {
  if dry_run; then echo "  keep the first start's rollout counts aside: $WORK_DIR/$(recipe KEPT_LEDGER_GLOB)"; else
    py_check 'import recipe; recipe.keep_ledger_aside(sys.argv[2])' "$WORK_DIR"
  fi
  run_trainer trainer-resume "$OUTPUT_DIR-resume"
  STEP_NOTE="second trainer start finished $MAX_STEPS steps (resumed from the Hub: the report checks it)"
}

# run_trainer NAME OUTPUT_DIR [VAR=VALUE...]: the trainer on its GPU under the watchdog (and the smoke deadline).
# DEBUG=1: a crash hours in leaves its traceback in the trainer's log (a rerun to see it would cost the run); the
# last line is still the one-line reason supervise() quotes.
run_trainer() {
  local name="$1" output="$2"
  shift 2
  local -a vars=(CUDA_VISIBLE_DEVICES="$TRAINER_GPU" ADAPTER_REPO="$ADAPTER_REPO" MAX_STEPS="$MAX_STEPS"
    SAVE_STEPS="$SAVE_STEPS" VLLM_URL="$VLLM_URL" ENV_URL="$ENV_URL" CAPTURE_URL="$CAPTURE_URL"
    OUTPUT_DIR="$output" HEARTBEAT_FILE="$HEARTBEAT_FILE" RESUME="$RESUME" WEIGHT_SYNC="$WEIGHT_SYNC"
    LEARNING_RATE="$LEARNING_RATE" MAX_STALENESS="$MAX_STALENESS" SANDBOX="$SANDBOX" DEBUG=1 "$@")
  launch "$name" env "${vars[@]}" "$PYTHON" "$HERE/train_lora.py"
  if dry_run; then
    echo "  watchdog: every ${WATCH_INTERVAL}s check vllm, env_server, $name and the heartbeat age" \
      "${DEADLINE:+(and the smoke deadline)}"
    return 0
  fi
  supervise "$name"
}

# supervise NAME: returns when the trainer NAME exits 0; dies when it fails, stalls, passes the smoke deadline, or a
# server exits.
supervise() {
  local trainer="$1" name age rc
  while true; do
    for name in vllm env_server; do
      if ! kill -0 "${PID[$name]}" 2>/dev/null; then
        rc=0; wait "${PID[$name]}" || rc=$?
        tail_log "$name"; die "$name exited (status $rc) while training: see the log tail above"
      fi
    done
    if ! kill -0 "${PID[$trainer]}" 2>/dev/null; then
      rc=0; wait "${PID[$trainer]}" || rc=$?
      [ "$rc" -eq 0 ] && return 0
      tail_log "$trainer"; die "trainer exited with status $rc: $(tail -n 1 "$LOG_DIR/$trainer.log" 2>/dev/null)"
    fi
    if [ -n "${DEADLINE:-}" ] && (( $(date +%s) >= DEADLINE )); then
      stop_child "$trainer"
      tail_log "$trainer"
      die "smoke deadline reached: $trainer ran past the plan's budget (smoke_report.py plan); stopped it for the report"
    fi
    age=$(( $(date +%s) - $(stat -c %Y "$HEARTBEAT_FILE" 2>/dev/null || echo 0) ))  # a deleted file counts as stale
    if (( age > STALL_SECONDS )); then
      stop_child "$trainer"
      tail_log "$trainer"
      die "trainer stalled: no optimizer step and no finished rollout for ${age}s (limit ${STALL_SECONDS}s); killed it. Relaunch to resume from the last pushed checkpoint"
    fi
    sleep "$WATCH_INTERVAL" & wait $! # interruptible, so a TERM is handled at once
  done
}

# stop_child NAME: ends a start_bg child's whole process group (TERM, then KILL after 30 s).
stop_child() {
  local pid="${PID[$1]:-}" i
  [ -n "$pid" ] || return 0
  kill -TERM -- "-$pid" 2>/dev/null || true
  for i in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  [ "$i" -lt 60 ] || kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  kill -KILL -- "-$pid" 2>/dev/null || true
}

# 9. Final eval: the training servers make way (GPU and ports) for run_eval.sh's LoRA-mode vLLM and env server.
#    Its output goes to the job log; it runs in its own process group (killed on exit) under EVAL_TIMEOUT.
final_eval() {
  if [ "$FINAL_EVAL" != "1" ]; then STEP_NOTE="skipped (FINAL_EVAL=0)"; return 0; fi
  local limit pid rc=0
  limit="$(recipe EVAL_TIMEOUT)"
  local -a vars=(ADAPTER_REPO="$ADAPTER_REPO" EVAL_MODE=full CHECKPOINT=final SPACE_HOST="$PUBLIC_HOSTNAME"
    LOG_DIR="$LOG_DIR/final-eval")
  if [ "$MODE" = smoke ]; then  # the subset, within what the smoke deadline leaves
    vars+=(EVAL_TASKS="$EVAL_TASKS")
    limit="$(( DEADLINE - $(date +%s) ))s"
    [ "${limit%s}" -gt 0 ] || die "smoke deadline reached before the final eval"
  fi
  local -a cmd=(env "${vars[@]}" timeout "$limit" bash "$HERE/run_eval.sh")
  if dry_run; then
    echo "  stop vllm and env_server (frees GPU $VLLM_GPU and ports $POLICY_PORT $ENV_PORT $PUBLIC_PORT)"
    show_cmd "${cmd[@]}"
    return 0
  fi
  stop_child vllm
  stop_child env_server
  setsid "${cmd[@]}" &
  pid=$!
  CHILD_PIDS+=("$pid")
  wait "$pid" || rc=$?
  [ "$rc" -ne 124 ] || die "final eval did not finish within $limit (EVAL_TIMEOUT, or the smoke deadline)"
  [ "$rc" -eq 0 ] || die "final eval failed (status $rc); the trained adapter is already in $ADAPTER_REPO"
  STEP_NOTE="eval/final_results.json pushed to $ADAPTER_REPO"
}

main() {
  begin_job read_knobs
  step 0 preflight preflight
  step 1 install install_stack
  step 2 openenv check_sessions
  step 3 seam-patch check_seam
  step 4 tasks prepare_tasks
  step 5 vllm start_policy
  step 6 env-server start_env_server
  step 7 watchdog arm_watchdog
  step 8 train train
  if [ "$MODE" = smoke ]; then
    step 9 resume resume_training
    step 10 final-eval final_eval
  else
    step 9 final-eval final_eval
  fi
  log "run_job: done"
}

main "$@"
