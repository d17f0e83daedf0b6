#!/usr/bin/env bash
# The demo: builds from nothing (scripts/setup_env.sh, the same build as scripts/test.sh's: switching between the
# two rebuilds nothing), then runs `specdec demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
bash scripts/setup_env.sh
.venv/bin/specdec demo "$@"
