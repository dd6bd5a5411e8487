#!/usr/bin/env bash
# The OpenEnv Harbor env server (task API + capture proxy) on loopback, and capture_gateway.py on the public port,
# which forwards only /capture/... to it. Runs in the foreground until the env server exits, or the gateway exits more
# often in a row than GATEWAY_RESTARTS (then stops the other and exits non-zero); callers background it.
#
#   DATASETS=/tmp/lfm-job/tasks/train SPACE_HOST=<job-id>--<PUBLIC_PORT>.hf.jobs bash serve_env.sh
#   DRY_RUN=1 ... bash serve_env.sh         # print both commands and their environment only
#
# Knobs (defaults from recipe.py; what each is: docs/jobs.md "The servers"): DATASETS and SPACE_HOST (required),
# POLICY_URL, MODEL, SANDBOX (and its key), ENV_HOST, ENV_PORT, PUBLIC_HOST, PUBLIC_PORT, MAX_CONCURRENT_ENVS,
# OPENCODE_VERSION, OPENENV_CAPTURE_ADMIN_KEY, GATEWAY_HEAD_TIMEOUT, GATEWAY_BODY_TIMEOUT, GATEWAY_IDLE_CONNECTIONS,
# GATEWAY_RESTARTS, ALLOW_NON_LOOPBACK.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Prints the env server's environment assignments, one per line (no secrets: those are inherited).
server_env() {
  echo "SPACE_HOST=$SPACE_HOST"
  echo "SANDBOX=$SANDBOX"
  echo "MAX_CONCURRENT_ENVS=${MAX_CONCURRENT_ENVS:-$(recipe ENV_MAX_SESSIONS)}"
  echo "OPENENV_HARBOR_AGENT_VERSIONS={\"opencode\": \"${OPENCODE_VERSION:-$(recipe OPENCODE_VERSION)}\"}"
  echo "ENABLE_WEB_INTERFACE=false"
}

# Prints the env server command, one argument per line.
server_cmd() {
  local dataset
  printf '%s\n' "$PYTHON" "$HERE/seam_patch.py" serve -- harbor serve \
    --llm-url "$POLICY_URL" --model "${MODEL:-$(recipe SERVED_MODEL_NAME)}" \
    --host "$ENV_HOST" --port "$ENV_PORT" --max-output-tokens "$(recipe MAX_TOKENS)"
  for dataset in $DATASETS; do printf '%s\n' --dataset "$dataset"; done
}

check_inputs() {
  [ -n "${DATASETS:-}" ] || die "DATASETS is not set: point it at the task folders prepare_tasks.py wrote"
  local dataset
  if ! dry_run; then
    for dataset in $DATASETS; do [ -d "$dataset" ] || die "DATASETS entry $dataset is not a folder: run prepare_tasks.py first"; done
  fi
  [ -n "${SPACE_HOST:-}" ] || die "SPACE_HOST is not set: set it to the public host of PUBLIC_PORT, e.g. <job-id>--$PUBLIC_PORT.hf.jobs"
  env_knobs SPACE_HOST ALLOW_NON_LOOPBACK GATEWAY_HEAD_TIMEOUT GATEWAY_BODY_TIMEOUT GATEWAY_IDLE_CONNECTIONS \
    GATEWAY_RESTARTS
  if [ "$ENV_HOST" != "$(recipe LOOPBACK)" ] && [ "$ALLOW_NON_LOOPBACK" != "1" ]; then
    die "ENV_HOST=$ENV_HOST would expose the env server's task API: bind $(recipe LOOPBACK), or set ALLOW_NON_LOOPBACK=1"
  fi
  [ "$ENV_PORT" != "$PUBLIC_PORT" ] || die "ENV_PORT and PUBLIC_PORT are both $ENV_PORT: the task API must not share the public port"
  require_sandbox_credentials
  port_free "$ENV_PORT"
  port_free "$PUBLIC_PORT"
}

main() {
  POLICY_URL="${POLICY_URL:-http://$(recipe LOOPBACK):$(recipe VLLM_PORT)}"
  ENV_HOST="${ENV_HOST:-$(recipe LOOPBACK)}"
  ENV_PORT="${ENV_PORT:-$(recipe ENV_PORT)}"
  PUBLIC_HOST="${PUBLIC_HOST:-0.0.0.0}"
  PUBLIC_PORT="${PUBLIC_PORT:-$(recipe PUBLIC_PORT)}"
  check_inputs
  local -a env_vars server gateway
  mapfile -t env_vars < <(server_env)
  mapfile -t server < <(server_cmd)
  gateway=("$PYTHON" "$HERE/capture_gateway.py" --listen-host "$PUBLIC_HOST" --listen-port "$PUBLIC_PORT"
           --upstream "http://$ENV_HOST:$ENV_PORT")
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
