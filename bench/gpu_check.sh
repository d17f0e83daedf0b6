#!/usr/bin/env bash
# One run on a machine with a GPU: build for dev_cuda_archs of build_settings.json (sm_90a), the CUDA tests, the
# kernel benchmarks. Results go to $OUT (or bench/out). Uses the machine's python3 and torch; wheels under .whl/
# are installed first. Each step has its own time limit (STEP_SCALE multiplies them), so that one slow or hung
# step costs its own limit only and the steps after it still run; the most wanted figures come first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
dev_archs=$(python3 -c 'import json; print(json.load(open("build_settings.json"))["dev_cuda_archs"])')
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$dev_archs}" MAX_JOBS="${MAX_JOBS:-16}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  # Carried wheels (gguf; transformers as in the development environment, with its hub client) must leave the image's
  # packages importable: if transformers does not import, the image's own serves and only gguf is kept.
  if ! python3 -c "import transformers.generation.utils" > /dev/null 2>&1; then
    echo "carried transformers does not import here: the image's is used"
    rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
  fi
fi
scale="${STEP_SCALE:-1}"
t0=$(date +%s)

# step NAME LIMIT_S COMMAND...: runs COMMAND under its limit, output to $OUT/NAME.txt, and prints its tail.
step() {
  local name=$1 limit=$(( $2 * scale )) start=$(date +%s) rc
  shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s (limit $limit s), at $(( $(date +%s) - t0 )) s"
  tail -n "${TAIL:-12}" "$OUT/$name.txt"
  return $rc
}
bench() {  # bench NAME[-STEP] LIMIT_S ARGS...: `specdec bench NAME --device cuda ARGS` (-STEP names the step only)
  local name=$1 limit=$2
  shift 2
  step "bench_$name" "$limit" python3 -m specdec_ext.cli bench "${name%%-*}" --device cuda "$@"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys, transformers; print('torch', torch.__version__, torch.version.cuda, 'python', sys.version.split()[0], 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
# The emulator is not needed here (SPECDEC_NO_SIM): CI runs it.
export SPECDEC_NO_SIM=1
TAIL=40 step build 420 python3 setup.py -q build_ext --inplace || exit 1
step info 60 python3 -m specdec_ext.cli info
TAIL=25 step tests_gpu 240 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs --durations=10 -n 4
TAIL=26 bench chain_sampling 60 --repeats 30 --json "$OUT/chain_sampling.json" --plot "$OUT/chain_sampling.png"
TAIL=40 bench tree_sampling 70 --repeats 30 --json "$OUT/tree_sampling.json"
TAIL=30 bench verify_attention 90 --repeats 30 --json "$OUT/verify_attention.json" --plot "$OUT/verify_attention.png"
TAIL=9 bench verify_attention-layouts 40 --repeats 50 --layouts --json "$OUT/verify_attention_layouts.json"
TAIL=6 bench chain_sampling_flat 40 --repeats 30 --json "$OUT/chain_sampling_flat.json"
TAIL=12 bench chain_sampling_row_filters 40 --repeats 30 --json "$OUT/chain_sampling_row_filters.json"
TAIL=42 bench quantized_linear 60 --repeats 30 --json "$OUT/quantized_linear.json"
TAIL=9 bench philox_uniform 30 --json "$OUT/philox_uniform.json"
for shim in flashinfer vllm vllm_v2 sglang transformers; do
  bench "compat_$shim" 30 --repeats 30 --json "$OUT/compat_$shim.json"
done
TAIL=8 bench verify_attention-flex 40 --repeats 30 --flex --batch 1,8 --contexts 4096,32768 --queries 5
echo "gpu_check: $(( $(date +%s) - t0 )) s"
