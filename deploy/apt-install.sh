#!/usr/bin/env bash
# Install Debian packages (the tools deploy/e2e.sh and the deployment tests need: prometheus,
# openssh-server, rsync, netcat-openbsd) without starting their services: the Debian packages of
# daemons start them on install (prometheus on :9090, sshd on :22), and nothing here wants that.
#   bash deploy/apt-install.sh prometheus openssh-server
# Already installed packages are skipped; exits non-zero if apt-get is missing or fails.
set -euo pipefail

missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
command -v apt-get >/dev/null || { echo "apt-get not found: install ${missing[*]} by hand" >&2; exit 2; }

# invoke-rc.d asks /usr/sbin/policy-rc.d whether a service may start; 101 means no.
policy=/usr/sbin/policy-rc.d
ours=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && ours=1
fi
trap '[ "$ours" = 1 ] && rm -f "$policy"' EXIT

echo "+ apt-get install ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing (a fresh machine) or stale: update once, then install.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
