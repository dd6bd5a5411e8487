#!/usr/bin/env bash
# Eval job (HF Job, vllm/vllm-openai image, flavor h200, expose_public=[PUBLIC_PORT]; also run_job.sh's final eval):
# vLLM in LoRA mode and the env server on the held-out test tasks, then eval_adapter.py (base vs one adapter) or, with
# EVAL_MODE=watch (run_eval_watch.sh), eval_watch.py (each checkpoint as it is pushed).
#
#   ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL CHECKPOINT=checkpoint-500 bash run_eval.sh
#   DRY_RUN=1 ADAPTER_REPO=you/x HF_TOKEN=x JOB_ID=abc bash run_eval.sh     # print the plan, start nothing
# Environment: ADAPTER_REPO and HF_TOKEN (required); every other knob, its default and what it does: docs/evaluation.md.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

STEPS=5

# recipe.py's knobs, and every environment knob checked (recipe.py's checks): a bad value stops the job before step 1.
read_knobs() {
  LOOPBACK="$(recipe LOOPBACK)"; GPU="${GPU:-$(recipe EVAL_GPU)}"; JOB_FLAVOR="$(recipe EVAL_FLAVOR)"
  job_knobs EVAL_MODE CHECKPOINT N_TASKS MAX_IDLE_HOURS
  WORK_DIR="${WORK_DIR:-/tmp/lfm-eval}"; TASKS_DIR="$WORK_DIR/tasks"
  VLLM_URL="http://$LOOPBACK:$POLICY_PORT"; ENV_URL="http://$LOOPBACK:$ENV_PORT"
}

preflight() {
  local what="checkpoint=$CHECKPOINT"
  job_preflight "$GPU"
  [ "$EVAL_MODE" = full ] || what="n_tasks=$N_TASKS max_idle_hours=$MAX_IDLE_HOURS"
  log "preflight: ADAPTER_REPO=$ADAPTER_REPO mode=$EVAL_MODE $what SANDBOX=$SANDBOX public https://$PUBLIC_HOSTNAME"
}

# The pinned stack, unless run_job.sh installed it before training.
ensure_stack() {
  local check='import openenv.harbor.client, recipe; recipe.check_versions(tuple(recipe.pinned_versions()))'
  if ! dry_run && (cd "$HERE" && "$PYTHON" -c "$check") 2>/dev/null; then STEP_NOTE="pinned stack already installed"
  else install_stack; fi
}

start_policy() {
  local -a vars=(GPU="$GPU" HOST="$LOOPBACK" PORT="$POLICY_PORT" LORA=1)
  start_bg eval_vllm env "${vars[@]}" bash "$HERE/serve_policy.sh"
  dry_run && env "${vars[@]}" bash "$HERE/serve_policy.sh"
  wait_http eval_vllm "$VLLM_URL/health" "$READY_TIMEOUT" "$(dry_run || echo "${CHILD_PIDS[-1]}")"
}

# The env server on the test tasks (loopback); its capture proxy public through the gateway, for the sandboxes.
start_env_server() {
  local -a vars=(DATASETS="$TASKS_DIR/test" SPACE_HOST="$PUBLIC_HOSTNAME" POLICY_URL="$VLLM_URL"
    ENV_HOST="$LOOPBACK" ENV_PORT="$ENV_PORT" PUBLIC_PORT="$PUBLIC_PORT")
  local pid
  start_bg eval_env_server env "${vars[@]}" bash "$HERE/serve_env.sh"
  dry_run && env "${vars[@]}" bash "$HERE/serve_env.sh"
  pid="$(dry_run || echo "${CHILD_PIDS[-1]}")"
  wait_http eval_env_server "$ENV_URL/health" "$READY_TIMEOUT" "$pid"
  wait_http eval_env_server "http://127.0.0.1:$PUBLIC_PORT/capture/health" "$READY_TIMEOUT" "$pid"
}

run_eval() {
  local -a vars=(ADAPTER_REPO="$ADAPTER_REPO" ENV_URL="$ENV_URL" VLLM_URL="$VLLM_URL" SANDBOX="$SANDBOX"
    EVAL_WORK_DIR="$WORK_DIR/eval" EVAL_CONCURRENCY="$EVAL_CONCURRENCY")
  if [ "$EVAL_MODE" = watch ]; then
    do_cmd env "${vars[@]}" N_TASKS="$N_TASKS" MAX_IDLE_HOURS="$MAX_IDLE_HOURS" "$PYTHON" "$HERE/eval_watch.py"
  else
    do_cmd env "${vars[@]}" EVAL_TASKS="$EVAL_TASKS" CHECKPOINT="$CHECKPOINT" "$PYTHON" "$HERE/eval_adapter.py"
  fi
}

main() {
  begin_job read_knobs
  step 0 preflight preflight
  step 1 install ensure_stack
  step 2 tasks do_cmd "$PYTHON" "$HERE/prepare_tasks.py" --out "$TASKS_DIR" --split test
  step 3 vllm start_policy
  step 4 env-server start_env_server
  step 5 "eval ($EVAL_MODE)" run_eval
  log "run_eval: done"
}

main "$@"
