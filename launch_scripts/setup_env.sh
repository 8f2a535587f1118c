#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment and installs hybrid into it.
# Sourced by the quick-start commands, so each works on a fresh machine.
#
#   VENV=.venv                  where the virtual environment lives
#   TORCH_SPEC=torch==2.13.0    the torch to install; the default pins the CPU build these machines carry.
#                               On a GPU cluster set it to the CUDA build you use, e.g. "torch==2.13.0".
#   EXTRAS=                     pip extras of hybrid to install ("test" for the test suite)
set -euo pipefail
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$_here/.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${EXTRAS:-}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# Torch first and pinned: an unpinned dependency resolution could pull a multi-GB CUDA build.
python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '${TORCH_SPEC#torch==}' else 1)" 2>/dev/null \
  || python -m pip install -q "$TORCH_SPEC"
_target="$_here"
[ -n "$EXTRAS" ] && _target="$_here[$EXTRAS]"
python -m pip install -q -e "$_target" 2>&1 | grep -v '^WARNING: Location' || true
python -c "import hybrid, torch; print(f'hybrid {hybrid.__version__} with torch {torch.__version__} in $VENV')"
