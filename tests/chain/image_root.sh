# shellcheck shell=bash
# The rollout chain's sandbox image root (tests/test_chain.py), built by setup.sh, which sources this file (it uses
# setup.sh's `cannot`, `apt_install`, VENV and CHAIN_IMAGE): bubblewrap runs each sandbox, debootstrap builds the root.

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

# apt_mirror [APT_DIR]: the Debian mirror this machine's apt installs from (default /etc/apt; the root comes from there
# too): the first deb822 `URIs:` or one-line `deb [options] URI suite ...` entry naming a .../debian mirror, else nothing.
apt_mirror() {
  local dir="${1:-/etc/apt}" found
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
