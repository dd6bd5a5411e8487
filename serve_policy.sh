#!/usr/bin/env bash
# vLLM serving the policy (LiquidAI/LFM2.5-2.6B) for rollouts (training) or for eval (LORA=1).
# Runs in the foreground (exec); callers background it, e.g. `start_bg vllm bash serve_policy.sh`.
#
#   GPU=1 bash serve_policy.sh                    # training: the trainer streams weights in over NCCL
#   LORA=1 GPU=0 bash serve_policy.sh             # eval: base model + runtime-loaded LoRA adapters
#   DRY_RUN=1 bash serve_policy.sh                # print the command and its environment only
#
# Environment (defaults from recipe.py):
#   GPU=<VLLM_GPU>           CUDA device vLLM runs on (must be listed by nvidia-smi).
#   HOST=<LOOPBACK>          bind address. Anything else needs ALLOW_NON_LOOPBACK=1: with VLLM_SERVER_DEV_MODE
#                            the weight-update endpoints have no authentication.
#   PORT=<VLLM_PORT>         port (must be free).
#   MODEL=<BASE_MODEL>  REVISION=<BASE_MODEL_REVISION> (weights, config and tokenizer: --revision and
#   --tokenizer-revision)  SERVED_NAME=<SERVED_MODEL_NAME>
#   MAX_MODEL_LEN=<MAX_MODEL_LEN>   context for a whole agent conversation (MAX_TOOL_CALLING_ITERATIONS calls).
#   LORA=0                   1 = eval mode: --enable-lora --max-lora-rank <LORA_R> --max-loras $MAX_LORAS and
#                            VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (/v1/load_lora_adapter); no weight transfer.
#                            0 = training mode: --weight-transfer-config '{"backend":"nccl"}' + VLLM_SERVER_DEV_MODE=1.
#   Yes/no knobs (LORA, ALLOW_NON_LOOPBACK, DRY_RUN) take 1/true/yes/on or 0/false/no/off, any case.
#   MAX_LORAS=1              adapters resident at once in LoRA mode.
#   LORA_MODULES=            LoRA mode only: "name=path_or_repo" adapters to load at start (--lora-modules).
#   VLLM=vllm                the vllm executable.
#   CHAT_TEMPLATE=$LOG_DIR/chat_template.jinja   where chat_template.py writes the template vLLM is given.
# Always on: --return-tokens-as-token-ids --logprobs-mode processed_logprobs (token-faithful capture),
# --enable-auto-tool-choice --tool-call-parser lfm2 (OpenCode always sends tool_choice="auto"; without them
# every call is a 400), --generation-config vllm (the model's generation_config cannot narrow sampling),
# --chat-template (chat_template.py's checked template, the trainer's too: the model repo's own opens <think> in
# the generation prompt, which forked every rollout into one training row per turn).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Prints the vLLM command line, one argument per line (read into an array by the caller).
vllm_args() {
  local model="${MODEL:-$(recipe BASE_MODEL)}" revision="${REVISION:-$(recipe BASE_MODEL_REVISION)}"
  printf '%s\n' "${VLLM:-vllm}" serve "$model" \
    --revision "$revision" --tokenizer-revision "$revision" \
    --served-model-name "${SERVED_NAME:-$(recipe SERVED_MODEL_NAME)}" \
    --host "$HOST" --port "$PORT" \
    --dtype "$(recipe SERVE_DTYPE)" \
    --max-model-len "${MAX_MODEL_LEN:-$(recipe MAX_MODEL_LEN)}" \
    --generation-config vllm \
    --return-tokens-as-token-ids \
    --logprobs-mode processed_logprobs \
    --enable-auto-tool-choice --tool-call-parser lfm2 \
    --chat-template "$CHAT_TEMPLATE"
  if [ "$LORA" = "1" ]; then
    printf '%s\n' --enable-lora --max-lora-rank "$(recipe LORA_R)" --max-loras "$MAX_LORAS"
    [ -z "${LORA_MODULES:-}" ] || printf '%s\n' --lora-modules "$LORA_MODULES"
  else
    printf '%s\n' --weight-transfer-config '{"backend":"nccl"}'
  fi
}

# Prints the environment assignments vLLM runs under, one per line.
vllm_env() {
  echo "CUDA_VISIBLE_DEVICES=$GPU"
  if [ "$LORA" = "1" ]; then echo "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"; else echo "VLLM_SERVER_DEV_MODE=1"; fi
}

main() {
  GPU="${GPU:-$(recipe VLLM_GPU)}"
  HOST="${HOST:-$(recipe LOOPBACK)}"
  PORT="${PORT:-$(recipe VLLM_PORT)}"
  CHAT_TEMPLATE="${CHAT_TEMPLATE:-$LOG_DIR/chat_template.jinja}"
  env_knobs LORA ALLOW_NON_LOOPBACK MAX_LORAS
  if [ "$HOST" != "$(recipe LOOPBACK)" ] && [ "$ALLOW_NON_LOOPBACK" != "1" ]; then
    die "HOST=$HOST would expose vLLM's unauthenticated endpoints: bind $(recipe LOOPBACK), or set ALLOW_NON_LOOPBACK=1 on a private network"
  fi
  [ -n "${LORA_MODULES:-}" ] && [ "$LORA" != "1" ] && die "LORA_MODULES needs LORA=1"
  require_gpus "$GPU"
  port_free "$PORT"
  local -a env_vars cmd
  mapfile -t env_vars < <(vllm_env)
  mapfile -t cmd < <(vllm_args)
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
