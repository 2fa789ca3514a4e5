#!/usr/bin/env bash
# Optional second environment for lmms-eval (Video-MME, LongVideoBench, MLVU ...): `make lmms-setup`.
#   .venv-lmms reads every package of .venv (torch, transformers, vlpe and the checkout) through one .pth file
#   (site.addsitedir of .venv's site-packages), and holds only what requirements-lmms.txt adds on top: lmms-eval
#   0.7.3 and its tree, with av<16 shadowing .venv's av 18.1.0 (lmms-eval pins av<16). .venv itself is unchanged.
# A stamp file makes a second run a no-op. VENV=<dir> / BASE_VENV=<dir> choose other folders.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=${BASE_VENV:-.venv}
VENV=${VENV:-.venv-lmms}
[ -x "$BASE/bin/python" ] || { echo "[lmms-setup] $BASE is missing: run 'make setup' first" >&2; exit 1; }
STAMP="$VENV/.vlpe-lmms-installed"
want="$(cat requirements-lmms.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$BASE/bin/python" -m venv "$VENV"  # the same interpreter as .venv
base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# appended after .venv-lmms's own site-packages, with .venv's .pth files (editable vlpe, checkout root) processed
echo "import site; site.addsitedir('$(cd "$base_site" && pwd)')" > "$site/vlpe-base-venv.pth"
echo "[lmms-setup] installing lmms-eval into $VENV (first run: a few minutes)"
"$VENV/bin/python" -m pip install -q -r requirements-lmms.txt
"$VENV/bin/python" - <<'EOF'
import sysconfig

import av
import lmms_eval  # noqa: F401
import torch

own = sysconfig.get_paths()["purelib"]
assert not torch.__file__.startswith(own), f"a second torch was installed in {own}"
assert int(av.__version__.split(".")[0]) < 16, f"av {av.__version__} shadows nothing: lmms-eval needs av<16"
print(f"[lmms-setup] lmms-eval ready: torch {torch.__version__} (shared), av {av.__version__}")
EOF
echo "$want" > "$STAMP"
