#!/usr/bin/env bash
# vLLM serving the policy for rollouts (training) or for eval (LORA=1), in the foreground (exec): callers background it.
#
#   GPU=1 bash serve_policy.sh                    # training: the trainer streams weights in over NCCL
#   LORA=1 GPU=0 bash serve_policy.sh             # eval: base model + runtime-loaded LoRA adapters
#   DRY_RUN=1 bash serve_policy.sh                # print the command and its environment only
#
# Knobs (defaults: recipe.py; what each is, why the fixed flags are on: docs/jobs.md "The servers"): GPU, HOST, PORT,
# MODEL, REVISION, SERVED_NAME, MAX_MODEL_LEN, LORA, MAX_LORAS, LORA_MODULES, VLLM, CHAT_TEMPLATE, ALLOW_NON_LOOPBACK.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

main() {
  GPU="${GPU:-$(recipe VLLM_GPU)}"
  HOST="${HOST:-$(recipe LOOPBACK)}"
  PORT="${PORT:-$(recipe VLLM_PORT)}"
  CHAT_TEMPLATE="${CHAT_TEMPLATE:-$LOG_DIR/chat_template.jinja}"
  env_knobs LORA ALLOW_NON_LOOPBACK MAX_LORAS
  [ "$HOST" = "$(recipe LOOPBACK)" ] || [ "$ALLOW_NON_LOOPBACK" = "1" ] \
    || die "HOST=$HOST would expose vLLM's unauthenticated endpoints: bind $(recipe LOOPBACK), or set ALLOW_NON_LOOPBACK=1 on a private network"
  [ -n "${LORA_MODULES:-}" ] && [ "$LORA" != "1" ] && die "LORA_MODULES needs LORA=1"
  require_gpus "$GPU"
  port_free "$PORT"
  local revision="${REVISION:-$(recipe BASE_MODEL_REVISION)}"
  local -a env_vars=("CUDA_VISIBLE_DEVICES=$GPU") cmd=("${VLLM:-vllm}" serve "${MODEL:-$(recipe BASE_MODEL)}"
    --revision "$revision" --tokenizer-revision "$revision"
    --served-model-name "${SERVED_NAME:-$(recipe SERVED_MODEL_NAME)}" --host "$HOST" --port "$PORT"
    --dtype "$(recipe SERVE_DTYPE)" --max-model-len "${MAX_MODEL_LEN:-$(recipe MAX_MODEL_LEN)}"
    --generation-config vllm --return-tokens-as-token-ids --logprobs-mode processed_logprobs
    --enable-auto-tool-choice --tool-call-parser lfm2 --chat-template "$CHAT_TEMPLATE")
  if [ "$LORA" = "1" ]; then
    env_vars+=(VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
    cmd+=(--enable-lora --max-lora-rank "$(recipe LORA_R)" --max-loras "$MAX_LORAS")
    [ -z "${LORA_MODULES:-}" ] || cmd+=(--lora-modules "$LORA_MODULES")
  else
    env_vars+=(VLLM_SERVER_DEV_MODE=1) cmd+=(--weight-transfer-config '{"backend":"nccl"}')
  fi
  if dry_run; then
    echo "  write the chat template vLLM serves: $PYTHON chat_template.py $CHAT_TEMPLATE"
    show_cmd env "${env_vars[@]}" "${cmd[@]}"
    return 0
  fi
  "$PYTHON" "$HERE/chat_template.py" "$CHAT_TEMPLATE" || exit 1  # it printed why, in one line
  log "serve_policy: vLLM on GPU $GPU at http://$HOST:$PORT ($([ "$LORA" = "1" ] && echo LoRA eval || echo training) mode)"
  exec env "${env_vars[@]}" "${cmd[@]}"
}

main "$@"
