#!/usr/bin/env bash
# Stand-in for run_eval.sh in run_job.sh tests: records its environment and whether the training vLLM's
# port is still answering (it must not be: run_job.sh stops it first).
set -euo pipefail
state=down
curl -fsS -o /dev/null --max-time 2 "http://127.0.0.1:${STUB_POLICY_PORT}/health" 2>/dev/null && state=up
echo "run_eval ADAPTER_REPO=$ADAPTER_REPO CHECKPOINT=$CHECKPOINT SPACE_HOST=$SPACE_HOST EVAL_TASKS=${EVAL_TASKS:-} training_vllm=$state" >>"$STUB_LOG"
[ "${STUB_EVAL:-}" != "fail" ] || { echo "fake run_eval: simulated failure" >&2; exit 6; }
