#!/usr/bin/env bash
# Live learning curve (HF Job, flavor h200), launched next to training: run_eval.sh in watch mode (eval_watch.py), as
# its own script so that the launcher tells its jobs from a full eval's. Environment: run_eval.sh's.
#
#   ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL N_TASKS=100 bash run_eval_watch.sh
#   DRY_RUN=1 ADAPTER_REPO=you/x HF_TOKEN=x JOB_ID=abc bash run_eval_watch.sh    # print the plan only
set -euo pipefail
EVAL_MODE=watch exec bash "$(dirname "${BASH_SOURCE[0]}")/run_eval.sh" "$@"
