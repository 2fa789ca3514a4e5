#!/usr/bin/env bash
# Idempotent environment set-up used by `make demo` / `make test`:
#   1. the Debian data packages (real datasets found at run time, never downloaded by the code); vlpe is pure
#      Python, and DeepSpeed's CPU op build uses the gcc / g++ that the Python base image ships;
#   2. .venv with the pinned Python packages and an editable install of the library (vlpe);
#   3. the checkout root on .venv's import path (<site-packages>/vlpe-checkout.pth, scripts/link_checkout.py),
#      so the harness (models, data, train; eval/ and benchmarks/ scripts) imports from the checkout.
# A stamp file makes the second run of step 2 a no-op (seconds); step 3 runs every time, so an existing .venv
# (from an older checkout, or moved with the checkout) is brought up to date. VENV=<dir> sets another venv.
# `scripts/setup.sh python` (`make setup`) does steps 2-3 alone, without root: the library, the harness and
# fine-tuning (train/vlm.py with model.hf_model) need no Debian package. Without make or bash, the same by pip:
#   python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/pip install --no-deps -e . \
#     && .venv/bin/python scripts/link_checkout.py
# No argument (`make demo`, `make test`): step 1 too, after the .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
case "$MODE" in all | python) ;; *) echo "usage: scripts/setup.sh [python]" >&2; exit 2 ;; esac

no_root() {
  echo "[setup] the Debian data packages$missing are not installed and $1; ask an administrator to run" \
       "'apt-get install$missing'. The .venv is ready: the library, the harness and fine-tuning need none of" \
       "them (make setup sets up the .venv alone)" >&2
  exit 1
}

install_data() {
DEB_PACKAGES="dataset-fashion-mnist libcgal-demo opencv-doc"
missing=""
for p in $DEB_PACKAGES; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "[setup] installing Debian packages:$missing"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=""; fi
  if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then no_root "this user is not root and has no sudo"; fi
  $SUDO apt-get update -qq || no_root "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing \
    || no_root "apt-get install failed"
fi
}

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
[ "$MODE" = python ] || install_data  # after the .venv: only the data packages need root
"$VENV/bin/python" scripts/link_checkout.py
