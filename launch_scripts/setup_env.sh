#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment and installs hybrid into it.
# Sourced by the quick-start commands, so each works on a fresh machine; on a machine where the
# environment is already complete it changes nothing and installs nothing (about a second).
#
#   VENV=.venv                  where the virtual environment lives
#   TORCH_SPEC=torch==2.13.0    the torch to install; the default pins the CPU build these machines carry.
#                               On a GPU cluster set it to the CUDA build you use, e.g. "torch==2.13.0".
#   EXTRAS=                     pip extras of hybrid to install ("test" for the test suite)
#   FORCE_INSTALL=0             1 reinstalls hybrid even when the environment looks complete
#   SETUP_LOG=$VENV/setup.log   where pip's output goes (a failed step shows its last lines and names the file)
set -euo pipefail
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$_here/.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${EXTRAS:-}"
FORCE_INSTALL="${FORCE_INSTALL:-0}"
SETUP_LOG="${SETUP_LOG:-$VENV/setup.log}"
# Installing prints hundreds of lines nobody reads on success: they go to SETUP_LOG, and the terminal gets one
# line saying so, or, when a step fails, that step and the last lines of its output.
_setup_announced=0
_setup_step() {
  if [ "$_setup_announced" = 0 ]; then
    echo "setting up $VENV: installing what is missing (pip's output goes to $SETUP_LOG)"
    _setup_announced=1
  fi
  printf '\n$ %s\n' "$*" >>"$SETUP_LOG"
  if ! "$@" >>"$SETUP_LOG" 2>&1; then
    echo "setup_env.sh: '$*' failed; the last lines of $SETUP_LOG:" >&2
    tail -n 5 "$SETUP_LOG" >&2
    return 1
  fi
}
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$VENV"
  _setup_step python3 -m venv "$VENV"
  _setup_step "$VENV/bin/python" -m pip install --upgrade pip
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# Torch first and pinned: an unpinned dependency resolution could pull a multi-GB CUDA build.
# Read from the installed metadata: importing torch would cost seconds on every launch.
python -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('torch').split('+')[0] == '${TORCH_SPEC#torch==}' else 1)" 2>/dev/null \
  || _setup_step python -m pip install "$TORCH_SPEC"
# pip is run only when something is missing: hybrid not installed from this checkout, or a requirement
# of pyproject.toml (with EXTRAS) absent or at a version it excludes.
if [ "$FORCE_INSTALL" = "1" ] || ! python "$_here/launch_scripts/env_complete.py" "$_here" "$EXTRAS"; then
  _target="$_here"
  [ -n "$EXTRAS" ] && _target="$_here[$EXTRAS]"
  _setup_step python -m pip install -e "$_target"
fi
unset -f _setup_step
unset _setup_announced
python -c "import importlib.metadata as m; print(f\"hybrid {m.version('hybrid')} with torch {m.version('torch')} in $VENV\")"
