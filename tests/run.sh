#!/usr/bin/env bash
# Sets up the environment (with the test extra) and runs the whole test suite.
#   PYTEST_ARGS="-x -k zero"   extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test source launch_scripts/setup_env.sh
# shellcheck disable=SC2086
python -m pytest tests -q ${PYTEST_ARGS:-} --durations=15
