#!/usr/bin/env bash
# Idempotent environment set-up used by `make demo` / `make test`:
#   1. the Debian data packages (real datasets found at run time, never downloaded by the code);
#   2. .venv with the pinned Python packages and an editable install of vlpe, models and data.
# A stamp file makes the second run a no-op (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES="dataset-fashion-mnist libcgal-demo opencv-doc"
missing=""
for p in $DEB_PACKAGES; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "[setup] installing Debian packages:$missing"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=""; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

STAMP=.venv/.vlpe-installed
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "vlpe needs Python >= 3.11"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
echo "[setup] installing Python packages into .venv (first run: ~2 minutes)"
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
echo "$want" > "$STAMP"
