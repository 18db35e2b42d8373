#!/usr/bin/env bash
# Runs inside `docker build`, as root, before scripts/install.sh: makes any Debian or Ubuntu base
# (python:3.11-slim-bookworm, nvidia/cuda:...-ubuntu22.04, or a bare `debootstrap --variant=minbase`
# tree imported with `docker import`) ready for that script, which expects python3 with venv and
# headers and a trust store that can verify PyPI.
#
#   bash docker/prepare-base.sh CA_DIR [EXTRA_APT_PACKAGE ...]
#
# CA_DIR holds extra PEM certificates (*.crt, *.pem) to trust, e.g. a TLS-intercepting proxy's
# (docker/extra-ca-certificates/); empty is fine.
set -euo pipefail

ca_dir=${1:?usage: prepare-base.sh CA_DIR [EXTRA_APT_PACKAGE ...]}
shift
export DEBIAN_FRONTEND=noninteractive

say() { printf '[prepare-base] %s\n' "$*" >&2; }

apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then apt-get update -qq; apt_updated=1; fi
  say "apt-get install $*"
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- extra CA certificates, before anything is fetched over TLS -------------------------------------
# A bare debootstrap tree has no ca-certificates package; its apt sources are plain http, so this
# one package can come before the extra certificates are trusted. Images that users pull already
# have it, so there the certificates are in place before the first download of any kind.
command -v update-ca-certificates >/dev/null 2>&1 || apt_install ca-certificates
shopt -s nullglob
certs=("$ca_dir"/*.crt "$ca_dir"/*.pem)
if ((${#certs[@]})); then
  dest=/usr/local/share/ca-certificates/lms-launch-extra
  mkdir -p "$dest"
  for cert in "${certs[@]}"; do
    if ! grep -q -- '-----BEGIN CERTIFICATE-----' "$cert"; then
      say "error: $cert is not a PEM certificate (no BEGIN CERTIFICATE line); remove it or convert it with" \
          "'openssl x509 -inform der -in FILE -out FILE.crt'"
      exit 1
    fi
    name=$(basename "$cert")
    cp "$cert" "$dest/${name%.*}.crt" # update-ca-certificates reads only *.crt
  done
  # Its only stderr chatter is openssl rehash skipping the bundle file itself; real errors still show.
  update-ca-certificates 2>&1 >/dev/null | { grep -v 'skipping ca-certificates.crt' >&2 || true; }
  say "trusting ${#certs[@]} extra CA certificate(s) from $ca_dir"
else
  say "no extra CA certificates in $ca_dir (none needed without a TLS-intercepting proxy)"
fi

# --- what install.sh expects the system to provide ---------------------------------------------------
# python3 with venv (ensurepip) and headers; the official python images have all three in
# /usr/local, Debian and Ubuntu bases get them from apt. install.sh installs the compilers and Open MPI.
want=("$@")
if ! command -v python3 >/dev/null 2>&1 || ! python3 - <<'PY' >/dev/null 2>&1
import ensurepip, os, sysconfig, venv
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
PY
then
  want+=(python3 python3-venv python3-dev)
fi
missing=()
for pkg in "${want[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then apt_install "${missing[@]}"; fi
rm -rf /var/lib/apt/lists/*
say "ready: $(python3 --version 2>&1), $(ls /etc/ssl/certs/ca-certificates.crt)"
