#!/usr/bin/env bash
# The test command: builds everything from nothing (scripts/setup_env.sh), then runs
#   0. ruff over the Python sources and tests (pyproject.toml's rules: E, F, I, lines of at most 120 characters);
#   1. the C++ unit tests (Philox known answers, the sampling arithmetic, emulator self-tests) under
#      AddressSanitizer, with ctest;
#   2. the whole pytest suite, with the emulated CUDA kernels under AddressSanitizer.
# tests/gpu runs only where a GPU is visible. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
export SPECDEC_SIM_ASAN=1  # the emulator under AddressSanitizer (setup_env.sh's default, shared with the demo)
bash scripts/setup_env.sh

.venv/bin/ruff check .

start=$(date +%s)
.venv/bin/cmake -S . -B build/cmake-tests -G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/.venv/bin/ninja" \
  -DSPECDEC_WITH_TORCH=OFF -DSPECDEC_ASAN=ON -DCMAKE_BUILD_TYPE=Debug > build/cmake_tests.log
.venv/bin/cmake --build build/cmake-tests -j2 >> build/cmake_tests.log
.venv/bin/ctest --test-dir build/cmake-tests --output-on-failure
echo "C++ tests built and run in $(( $(date +%s) - start )) s"

# libstdc++ is preloaded with the ASan runtime so that ASan's C++-exception interceptor resolves at start-up
# (python itself does not link libstdc++). Leak checking is off: CPython and torch keep allocations alive at exit.
# Two worker processes (pytest-xdist): the tiny-model tests run one intra-op thread each, so one process leaves a core
# idle (the suite takes 0.63 of its one-process time on 2 cores); `-n 0` among the arguments runs in one process.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
ASAN_OPTIONS=detect_leaks=0 \
  .venv/bin/python -m pytest tests -n 2 "$@"
