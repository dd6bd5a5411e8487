#!/usr/bin/env bash
# The HF Job entrypoint (vllm/vllm-openai image, h200x2): installs the pinned stack next to vLLM, checks the seam
# patch, prepares the tasks, starts vLLM (GPU 1) and the env server, trains the LoRA (GPU 0) under a stall watchdog,
# then runs the final base-vs-adapter eval. MODE=smoke is the smoke run (docs/smoke.md).
#
#   bash run_job.sh                                                     # inside the job (see README "Your path")
#   DRY_RUN=1 ADAPTER_REPO=you/x HF_TOKEN=x JOB_ID=abc bash run_job.sh  # print the plan, start nothing
# Environment: ADAPTER_REPO and HF_TOKEN (required); every other knob, its default and what it does: docs/jobs.md.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

declare -A PID=()
# launch NAME CMD...: start_bg, remembering NAME's pid for the watchdog.
launch() {
  start_bg "$@"
  dry_run || PID[$1]="${CHILD_PIDS[-1]}"
}

# recipe.py's knobs, and every environment knob checked by recipe.py's rules: a bad value stops the job before step 1.
read_knobs() {
  LOOPBACK="$(recipe LOOPBACK)"; TRAINER_GPU="$(recipe TRAINER_GPU)"; VLLM_GPU="$(recipe VLLM_GPU)"
  JOB_FLAVOR="$(recipe TRAIN_FLAVOR)"
  env_knobs MODE
  STEPS=7
  if [ "$MODE" = smoke ]; then  # the plan's line, then its MAX_STEPS SAVE_STEPS EVAL_TASKS deadline (others refused)
    STEPS=8
    SMOKE_PLAN="$("$PYTHON" "$HERE/smoke_report.py" plan 2>&1)" || die "$(tail -n 1 <<<"$SMOKE_PLAN")"
    read -r MAX_STEPS SAVE_STEPS EVAL_TASKS DEADLINE_S <<<"${SMOKE_PLAN##*$'\n'}"
    export MAX_STEPS SAVE_STEPS EVAL_TASKS
  fi
  job_knobs MAX_STEPS SAVE_STEPS RESUME WEIGHT_SYNC FINAL_EVAL STALL_MINUTES STALL_SECONDS WATCH_INTERVAL LEARNING_RATE \
    MAX_STALENESS
  WORK_DIR="${WORK_DIR:-/tmp/lfm-job}"; TASKS_DIR="$WORK_DIR/tasks"; OUTPUT_DIR="$WORK_DIR/output"
  HEARTBEAT_FILE="$WORK_DIR/$(recipe HEARTBEAT_NAME)"; STAGES_FILE=""
  VLLM_URL="http://$LOOPBACK:$POLICY_PORT"; ENV_URL="http://$LOOPBACK:$ENV_PORT"
}

# 0. Bad input stops the job here, with one line, before anything is installed or started.
preflight() {
  job_preflight "$TRAINER_GPU" "$VLLM_GPU"
  [ "$MODE" = train ] || smoke_preflight
  STEP_NOTE="MODE=$MODE ADAPTER_REPO=$ADAPTER_REPO MAX_STEPS=$MAX_STEPS SANDBOX=$SANDBOX public https://$PUBLIC_HOSTNAME"
}

# The smoke run's plan and deadline; its repo emptied (clear refuses one not named -smoke) and this run recorded in it
# before anything can read it. From here on the job ends with the go/no-go report, whatever happens.
smoke_preflight() {
  echo "${SMOKE_PLAN%%$'\n'*}"
  DEADLINE=$(( $(date +%s) + DEADLINE_S ))
  STAGES_FILE="$WORK_DIR/$(recipe STAGES_NAME)"
  dry_run || { mkdir -p "$WORK_DIR"; : >"$STAGES_FILE"; }
  record_stage start preflight  # this step began before the file existed
  do_cmd "$PYTHON" "$HERE/smoke_report.py" clear
  REPORT_HOOK=smoke_job_report
}

# The go/no-go report ($REPORT_HOOK, run at exit): one screen in the log, smoke_report.json pushed; 1 on NO-GO.
smoke_job_report() {
  do_cmd "$PYTHON" "$HERE/smoke_report.py" report --work-dir "$WORK_DIR" --stages "$STAGES_FILE"
}

# py_step NOTE SCRIPT ARG...: one of the bundle's Python checks or preparations (steps 2-3), NOTE once it is done.
py_step() {
  do_cmd "$PYTHON" "$HERE/$2" "${@:3}"
  STEP_NOTE="$1"
}

# 4. vLLM on its GPU, loopback only.
start_policy() {
  local -a vars=(GPU="$VLLM_GPU" HOST="$LOOPBACK" PORT="$POLICY_PORT" LORA=0)
  launch vllm env "${vars[@]}" bash "$HERE/serve_policy.sh"
  dry_run && env "${vars[@]}" bash "$HERE/serve_policy.sh"
  wait_http vllm "$VLLM_URL/health" "$READY_TIMEOUT" "${PID[vllm]:-}"
  STEP_NOTE="vLLM on GPU $VLLM_GPU at $VLLM_URL"
}

# 5. Env server on loopback, capture public at https://<public host>/capture through the gateway.
start_env_server() {
  local -a vars=(DATASETS="$TASKS_DIR/train" SPACE_HOST="$PUBLIC_HOSTNAME" POLICY_URL="$VLLM_URL"
    ENV_HOST="$LOOPBACK" ENV_PORT="$ENV_PORT" PUBLIC_PORT="$PUBLIC_PORT")
  launch env_server env "${vars[@]}" bash "$HERE/serve_env.sh"
  dry_run && env "${vars[@]}" bash "$HERE/serve_env.sh"
  wait_http env_server "$ENV_URL/health" "$READY_TIMEOUT" "${PID[env_server]:-}"
  wait_http env_server "http://127.0.0.1:$PUBLIC_PORT/capture/health" "$READY_TIMEOUT" "${PID[env_server]:-}"
  STEP_NOTE="env server at $ENV_URL, capture public at $CAPTURE_URL"
}

# 6. The trainer, supervised until it exits. The smoke run stops it after its first checkpoint (STOP_AFTER_STEP).
train() {
  if [ "$MODE" = smoke ]; then
    run_trainer trainer "$OUTPUT_DIR" STOP_AFTER_STEP="$SAVE_STEPS"
    STEP_NOTE="trainer stopped after checkpoint-$SAVE_STEPS (pushed)"
  else
    run_trainer trainer "$OUTPUT_DIR"
    STEP_NOTE="trainer finished $MAX_STEPS steps"
  fi
}

# 7 (smoke). A second start, as a relaunched job: resumes from that checkpoint on the Hub into an empty folder; the
#    first start's rollout counts kept aside (recipe.keep_ledger_aside), where smoke_report.py reads them.
resume_training() {
  if dry_run; then echo "  keep the first start's rollout counts aside: $WORK_DIR/$(recipe KEPT_LEDGER_GLOB)"; else
    py_check 'import recipe; recipe.keep_ledger_aside(sys.argv[2])' "$WORK_DIR"
  fi
  run_trainer trainer-resume "$OUTPUT_DIR-resume"
  STEP_NOTE="second trainer start finished $MAX_STEPS steps (resumed from the Hub: the report checks it)"
}

# run_trainer NAME OUTPUT_DIR [VAR=VALUE...]: the trainer on its GPU under the watchdog (and the smoke deadline).
# DEBUG=1: a crash hours in keeps its traceback in the log, above the one-line reason supervise() quotes.
run_trainer() {
  local name="$1" output="$2"
  shift 2
  local -a vars=(CUDA_VISIBLE_DEVICES="$TRAINER_GPU" ADAPTER_REPO="$ADAPTER_REPO" MAX_STEPS="$MAX_STEPS"
    SAVE_STEPS="$SAVE_STEPS" VLLM_URL="$VLLM_URL" ENV_URL="$ENV_URL" OUTPUT_DIR="$output"
    HEARTBEAT_FILE="$HEARTBEAT_FILE" RESUME="$RESUME" WEIGHT_SYNC="$WEIGHT_SYNC"
    LEARNING_RATE="$LEARNING_RATE" MAX_STALENESS="$MAX_STALENESS" SANDBOX="$SANDBOX" DEBUG=1 "$@")
  dry_run || { mkdir -p "$WORK_DIR"; touch "$HEARTBEAT_FILE"; }  # the stall clock starts with this start
  launch "$name" env "${vars[@]}" "$PYTHON" "$HERE/train_lora.py"
  if dry_run; then
    echo "  watchdog: every ${WATCH_INTERVAL}s check vllm, env_server, $name and the heartbeat ($HEARTBEAT_FILE):" \
      "no optimizer step and no finished rollout for ${STALL_SECONDS}s fails the job${DEADLINE:+, as does the smoke deadline}"
    return 0
  fi
  supervise "$name"
}

# supervise NAME: returns when the trainer NAME exits 0; fails the job (on_exit stops every child) when it fails,
# stalls or passes the smoke deadline, or when a server exits.
supervise() {
  local trainer="$1" name now beat age rc
  while true; do
    for name in vllm env_server "$trainer"; do  # any exit but the trainer's with status 0 fails the job
      kill -0 "${PID[$name]}" 2>/dev/null && continue
      rc=0; wait "${PID[$name]}" || rc=$?
      [ "$name" != "$trainer" ] || [ "$rc" -ne 0 ] || return 0
      tail_log "$name"; die "$name exited (status $rc) while training: $(tail -n 1 "$LOG_DIR/$name.log" 2>/dev/null)"
    done
    printf -v now '%(%s)T' -1  # no $(...) in $((...)): a SIGTERM landing there broke bash 5.2's TERM trap (exit 2)
    beat=$(stat -c %Y "$HEARTBEAT_FILE" 2>/dev/null) || beat=0  # a deleted file counts as stale
    age=$(( now - beat ))
    if [ -n "${DEADLINE:-}" ] && (( now >= DEADLINE )); then
      tail_log "$trainer"; die "smoke deadline reached: $trainer ran past the plan's budget (smoke_report.py plan); stopped it for the report"
    elif (( age > STALL_SECONDS )); then
      tail_log "$trainer"; die "trainer stalled: no optimizer step and no finished rollout for ${age}s (limit ${STALL_SECONDS}s); killed it. Relaunch to resume from the last pushed checkpoint"
    fi
    sleep "$WATCH_INTERVAL" & wait $!  # interruptible, so a TERM is handled at once
  done
}

# 7 (8 in a smoke). Final eval: the training servers make way (GPU and ports) for run_eval.sh's LoRA-mode vLLM and env server.
#    It runs in its own process group (killed on exit) under EVAL_TIMEOUT, or what the smoke deadline leaves.
final_eval() {
  if [ "$FINAL_EVAL" != "1" ]; then STEP_NOTE="skipped (FINAL_EVAL=0)"; return 0; fi
  local limit rc=0
  limit="$(recipe EVAL_TIMEOUT)"
  local -a vars=(ADAPTER_REPO="$ADAPTER_REPO" EVAL_MODE=full CHECKPOINT=final SPACE_HOST="$PUBLIC_HOSTNAME"
    LOG_DIR="$LOG_DIR/final-eval")
  if [ "$MODE" = smoke ]; then
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
  cleanup; wait  # every child so far (vllm, env_server), until gone: their GPU and ports free
  setsid "${cmd[@]}" &
  CHILD_PIDS+=("$!")
  wait "$!" || rc=$?
  [ "$rc" -ne 124 ] || die "final eval did not finish within $limit (EVAL_TIMEOUT, or the smoke deadline)"
  [ "$rc" -eq 0 ] || die "final eval failed (status $rc); the trained adapter is already in $ADAPTER_REPO"
  STEP_NOTE="eval/final_results.json pushed to $ADAPTER_REPO"
}

main() {
  begin_job read_knobs
  step 0 preflight preflight
  step 1 install install_stack
  step 2 seam-patch py_step "opencode sends the capture session as x-api-key (the Jobs proxy strips Authorization)" \
    seam_patch.py check
  step 3 tasks py_step "train tasks in $TASKS_DIR/train" prepare_tasks.py --out "$TASKS_DIR" --split train
  step 4 vllm start_policy
  step 5 env-server start_env_server
  step 6 train train
  if [ "$MODE" = smoke ]; then
    step 7 resume resume_training
    step 8 final-eval final_eval
  else
    step 7 final-eval final_eval
  fi
  log "run_job: done"
}

main "$@"
