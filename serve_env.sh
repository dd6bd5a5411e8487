#!/usr/bin/env bash
# The OpenEnv Harbor env server (task API + capture proxy) on loopback, and capture_gateway.py on the public port,
# which forwards only /capture/... to it; in the foreground (callers background it) until either stops for good.
#
#   DATASETS=/tmp/lfm-job/tasks/train SPACE_HOST=<job-id>--<PUBLIC_PORT>.hf.jobs bash serve_env.sh
#   DRY_RUN=1 ... bash serve_env.sh         # print both commands and their environment only
#
# Environment: DATASETS and SPACE_HOST (required); every other knob and its default: docs/jobs.md "The servers".
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

check_inputs() {
  env_knobs SPACE_HOST ALLOW_NON_LOOPBACK ENV_PORT PUBLIC_PORT GATEWAY_HEAD_TIMEOUT GATEWAY_BODY_TIMEOUT \
    GATEWAY_IDLE_CONNECTIONS GATEWAY_RESTARTS SANDBOX
  [ -n "${DATASETS:-}" ] || die "DATASETS is not set: point it at the task folders prepare_tasks.py wrote"
  local dataset
  for dataset in $DATASETS; do dry_run || [ -d "$dataset" ] || die "DATASETS entry $dataset is not a folder: run prepare_tasks.py first"; done
  [ -n "$SPACE_HOST" ] || die "SPACE_HOST is not set: set it to the public host of PUBLIC_PORT, e.g. <job-id>--$PUBLIC_PORT.hf.jobs"
  [ "$ENV_HOST" = "$(recipe LOOPBACK)" ] || [ "$ALLOW_NON_LOOPBACK" = "1" ] \
    || die "ENV_HOST=$ENV_HOST would expose the env server's task API: bind $(recipe LOOPBACK), or set ALLOW_NON_LOOPBACK=1"
  py_check 'import recipe; recipe.sandbox_keys(sys.argv[2])' "$SANDBOX"  # its key set (the launcher checks it too)
  port_free "$ENV_PORT"
  port_free "$PUBLIC_PORT"
}

main() {
  POLICY_URL="${POLICY_URL:-http://$(recipe LOOPBACK):$(recipe VLLM_PORT)}"
  ENV_HOST="${ENV_HOST:-$(recipe LOOPBACK)}"
  check_inputs
  local dataset
  # The env server's environment (no secrets: those are inherited) and command, and the gateway's.
  local -a env_vars=("SPACE_HOST=$SPACE_HOST" "SANDBOX=$SANDBOX"
    "MAX_CONCURRENT_ENVS=${MAX_CONCURRENT_ENVS:-$(recipe ENV_MAX_SESSIONS)}"
    "OPENENV_HARBOR_AGENT_VERSIONS={\"opencode\": \"${OPENCODE_VERSION:-$(recipe OPENCODE_VERSION)}\"}"
    ENABLE_WEB_INTERFACE=false)
  local -a server=("$PYTHON" "$HERE/seam_patch.py" serve -- harbor serve
    --llm-url "$POLICY_URL" --model "${MODEL:-$(recipe SERVED_MODEL_NAME)}"
    --host "$ENV_HOST" --port "$ENV_PORT" --max-output-tokens "$(recipe MAX_TOKENS)")
  for dataset in $DATASETS; do server+=(--dataset "$dataset"); done
  local -a gateway=("$PYTHON" "$HERE/capture_gateway.py" --listen-host "${PUBLIC_HOST:-0.0.0.0}"
    --listen-port "$PUBLIC_PORT" --upstream "http://$ENV_HOST:$ENV_PORT")
  if dry_run; then
    show_cmd env "${env_vars[@]}" "${server[@]}"
    show_cmd "${gateway[@]}"
    return 0
  fi
  log "serve_env: env server at http://$ENV_HOST:$ENV_PORT, capture public at https://$SPACE_HOST/capture via :$PUBLIC_PORT"
  OPENENV_CAPTURE_ADMIN_KEY="${OPENENV_CAPTURE_ADMIN_KEY:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
  export OPENENV_CAPTURE_ADMIN_KEY
  env "${env_vars[@]}" "${server[@]}" &
  local server_pid=$! gateway_pid="" rc started restarts=0
  trap 'kill -TERM "$server_pid" "$gateway_pid" 2>/dev/null || true' EXIT
  trap 'exit 143' TERM INT
  while true; do
    "${gateway[@]}" &
    gateway_pid=$! started=$SECONDS rc=0
    wait -n "$server_pid" "$gateway_pid" || rc=$?
    kill -0 "$server_pid" 2>/dev/null || die "env server exited (status $rc)"
    (( SECONDS - started < $(recipe GATEWAY_STABLE_S) )) || restarts=0
    (( ++restarts <= GATEWAY_RESTARTS )) || die "capture gateway exited (status $rc) after $GATEWAY_RESTARTS restarts in a row (GATEWAY_RESTARTS)"
    log "serve_env: capture gateway exited (status $rc); restarting it ($restarts of $GATEWAY_RESTARTS in a row)"
    sleep 1
  done
}

main "$@"
