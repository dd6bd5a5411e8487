#!/usr/bin/env bash
# One-time local set-up: find a Python >= 3.12 (Harbor needs it), create .venv, install the pinned
# stack plus test tools, the OpenCode client and vLLM's code for the CPU tests. Usage: bash setup.sh
set -euo pipefail

VENV="${VENV:-.venv}"

# Prints the first interpreter that really is Python >= 3.12 (pyenv shims may exist yet refuse to run).
find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      command -v "$candidate" || echo "$candidate"
      return 0
    fi
  done
  echo "setup.sh: no Python >= 3.12 found; install one or set PYTHON=/path/to/python3.12" >&2
  return 1
}

# The real OpenCode client (the harness the sandboxes run), for the x-api-key seam test; pinned by recipe.py.
install_opencode() {
  local version
  version="$("$VENV/bin/python" recipe.py OPENCODE_VERSION)"
  command -v npm >/dev/null || { echo "setup.sh: npm not found; install Node.js >= 20 for the OpenCode client" >&2; return 1; }
  if grep -qs "\"version\": \"$version\"" .opencode/node_modules/opencode-ai/package.json; then return 0; fi
  npm install --silent --no-audit --no-fund --prefix .opencode "opencode-ai@$version"
}

# vLLM's own Python code, with the versions of its requirements the job will have (requirements-vllm.txt,
# GPU-only wheels left out), in .vllm/ beside the venv: the tests run vLLM's parser and LoRA loader from it on
# CPU (PYTHONPATH=.vllm), without touching the training venv. Reinstalled only when that file changes.
install_vllm_code() {
  local stamp=".vllm/requirements-vllm.txt"
  if cmp -s requirements-vllm.txt "$stamp"; then return 0; fi
  rm -rf .vllm
  "$VENV/bin/python" -m pip install -q --no-deps --target .vllm -r requirements-vllm.txt
  cp requirements-vllm.txt "$stamp"
}

main() {
  cd "$(dirname "$0")"
  local python
  python="$(find_python)"
  echo "setup.sh: using $python ($("$python" --version 2>&1))"
  [ -x "$VENV/bin/python" ] || "$python" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r requirements-dev.txt
  "$VENV/bin/python" -m pip check || echo "setup.sh: pip check reported the conflicts above" >&2
  install_opencode
  install_vllm_code
  echo "setup.sh: ready. Run the tests with: .venv/bin/python -m pytest"
}

main "$@"
