#!/usr/bin/env bash
# Idempotent environment set-up used by `make demo` / `make test`:
#   1. the Debian data packages (real datasets found at run time, never downloaded by the code) and the C / C++
#      compilers (vlpe/native.py builds the CPU kernels of the library; DeepSpeed builds its CPU ops);
#   2. .venv with the pinned Python packages and an editable install of the library (vlpe);
#   3. the checkout root on .venv's import path (<site-packages>/vlpe-checkout.pth, scripts/link_checkout.py),
#      so the harness (models, data, train; eval/ and benchmarks/ scripts) imports from the checkout.
# A stamp file makes the second run of step 2 a no-op (seconds); step 3 runs every time, so an existing .venv
# (from an older checkout, or moved with the checkout) is brought up to date. VENV=<dir> sets another venv.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES="dataset-fashion-mnist libcgal-demo opencv-doc gcc g++"
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

VENV=${VENV:-.venv}
STAMP="$VENV/.vlpe-installed"
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  PY=${PYTHON:-python3}
  "$PY" -c 'import sys; assert sys.version_info >= (3, 11), "vlpe needs Python >= 3.11"'
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  echo "[setup] installing Python packages into $VENV (first run: ~2 minutes)"
  "$VENV/bin/python" -m pip install -q -r requirements.txt
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "$want" > "$STAMP"
fi
"$VENV/bin/python" scripts/link_checkout.py
