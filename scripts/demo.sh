#!/usr/bin/env bash
# The demo: builds from nothing (scripts/setup_env.sh), then runs `specdec demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
SPECDEC_SIM_ASAN=0 bash scripts/setup_env.sh
.venv/bin/specdec demo "$@"
