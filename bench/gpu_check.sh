#!/usr/bin/env bash
# One run on a machine with a GPU: build for dev_cuda_archs of build_settings.json (sm_90a), the CUDA tests, the
# end-to-end rows on synthetic models, the kernel benchmarks. Results go to $OUT (or bench/out). Uses the machine's
# python3 and torch; wheels under .whl/ are installed first.
#
# Priority (most wanted first; the order the steps run in):
#    1. build                 the extension for sm_90a (about 2 minutes with 16 jobs)
#    2. tests_gpu             tests/gpu: the CUDA paths correct before anything is timed
#    3. e2e_must              synthetic Llama-3.1-8B target, B = 1 and 8, k = 4, a = 0.8, draft none and synthetic
#                             Llama-3.2-1B, greedy: plain against the weight-read floor, efficiency against the bound
#    4. chain_sampling, verify_attention          the kernels' figures
#    5. e2e_rest              B = 32; a = 0.6 / 0.9; invariant sampling; a one-layer head as the draft
#    6. flashinfer            FlashInfer's chain_speculative_sampling, then its paged attention wrappers, beside
#                             ours (when .anchors/ is carried)
#    7. tree_sampling, verify_attention-layouts, chain_sampling_flat, row_filters, quantized_linear, philox,
#       compat_* shims, verify_attention-flex
#
# Time: each step has a limit (STEP_SCALE multiplies them); a step starts only when its limit fits in what is left
# of this command's budget (BUDGET_S, default 530 s), else it and every step after it wait for the next command.
# The steps that ran are recorded in $OUT/done, so running the same command again on the warm machine (the build
# kept) goes on with the steps left: two commands of at most 540 s run the whole list. A slow or hung step costs its
# own limit only.
#
# Rehearsal on a machine without a GPU: DEVICE=cpu SKIP_BUILD=1 bash bench/gpu_check.sh runs every step at CPU size
# (the tiny synthetic target and a one-layer head for e2e, the benchmarks on the CPU; tests/gpu skip).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
touch "$OUT/done"
DEVICE="${DEVICE:-cuda}"
if [ "$DEVICE" = cuda ]; then
  E2E_TARGET=synthetic:llama-3.1-8b E2E_DRAFT=synthetic:llama-3.2-1b E2E_TOKENS=128 E2E_BATCH=1,8 E2E_WIDE=32
else
  E2E_TARGET=synthetic:tiny E2E_DRAFT=head E2E_TOKENS=32 E2E_BATCH=1,2 E2E_WIDE=4
fi
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
budget="${BUDGET_S:-530}"
deferred=""
t0=$(date +%s)

# step NAME LIMIT_S COMMAND...: runs COMMAND under its limit, output to $OUT/NAME.txt, and prints its tail; skipped
# when it ran in an earlier command (listed in $OUT/done) or when its limit does not fit in the budget left.
step() {
  local name=$1 limit=$(( $2 * scale )) start=$(date +%s) rc
  shift 2
  if grep -qx "$name" "$OUT/done"; then
    return 0
  fi
  if [ -n "$deferred" ] || [ $(( start - t0 + limit )) -gt "$budget" ]; then
    # in priority order: once a step waits for the next command, every step after it waits too
    [ -z "$deferred" ] && echo "== $name and the steps after it: left for the next command (limit $limit s," \
      "$(( budget - start + t0 )) s of the budget left)"
    deferred=1
    return 0
  fi
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  echo "$name" >> "$OUT/done"
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s (limit $limit s), at $(( $(date +%s) - t0 )) s"
  tail -n "${TAIL:-12}" "$OUT/$name.txt"
  return $rc
}
bench() {  # bench NAME[-STEP] LIMIT_S ARGS...: `specdec bench NAME --device $DEVICE ARGS` (-STEP names the step only)
  local name=$1 limit=$2
  shift 2
  step "bench_$name" "$limit" python3 -m specdec_ext.cli bench "${name%%-*}" --device "$DEVICE" "$@"
}

if [ "$DEVICE" = cuda ] && ! grep -qx gpu "$OUT/done"; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import torch, sys, transformers; print('torch', torch.__version__, torch.version.cuda, 'python', sys.version.split()[0], 'transformers', transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"
  echo gpu >> "$OUT/done"
fi
# The emulator is not needed here (SPECDEC_NO_SIM): CI runs it.
export SPECDEC_NO_SIM=1
if [ -z "${SKIP_BUILD:-}" ] && ! grep -qx build "$OUT/done"; then
  TAIL=40 step build 420 python3 setup.py -q build_ext --inplace || { sed -i '/^build$/d' "$OUT/done"; exit 1; }
fi
TAIL=25 step tests_gpu 240 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs --durations=10 -n 4
TAIL=30 bench e2e-must 200 --target "$E2E_TARGET" --batch "$E2E_BATCH" --k 4 --oracle-acceptance 0.8 \
  --draft "none,$E2E_DRAFT" --sampling greedy --new-tokens "$E2E_TOKENS" --repeats 3 \
  --json "$OUT/e2e_must.json" --plot "$OUT/e2e_must.png"
TAIL=38 bench chain_sampling 80 --repeats 30 --json "$OUT/chain_sampling.json" --plot "$OUT/chain_sampling.png"
TAIL=30 bench verify_attention 90 --repeats 30 --json "$OUT/verify_attention.json" --plot "$OUT/verify_attention.png"
TAIL=30 bench e2e-rest 200 --target "$E2E_TARGET" --batch "$E2E_WIDE" --k 4 --oracle-acceptance 0.6,0.8,0.9 \
  --draft "none,head" --sampling greedy,invariant --new-tokens "$E2E_TOKENS" --repeats 3 \
  --json "$OUT/e2e_rest.json" --plot "$OUT/e2e_rest.png"
# FlashInfer beside ours on the same inputs, when its source release is carried in .anchors/ (the project's shared
# anchors folder copied there): installed into /tmp/fi, its kernels compiled on first use; bounded, and a failure
# (no anchors, no build) costs this step only.
if [ -d .anchors ]; then
  TAIL=20 step flashinfer 120 bash -c '
    { timeout 60 python3 -m pip install -q --no-index --no-deps --target /tmp/fi .anchors/apache_tvm_ffi-*.whl \
        .anchors/flashinfer_python-0.5.3-*.whl && PYTHONPATH=/tmp/fi timeout 30 python3 -c "import flashinfer.sampling"; } \
      || timeout 90 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fi \
        .anchors/flashinfer_python-0.3.1.tar.gz || exit 3
    PYTHONPATH=/tmp/fi:${PYTHONPATH:-} python3 -m specdec_ext.cli bench chain_sampling --device "$1" --batch 1,8,64 \
      --k 4 --vocab 32000,128256 --repeats 30 --against flashinfer --json "$0/chain_sampling_flashinfer.json"' \
    "$OUT" "$DEVICE"
  # FlashInfer's paged prefill (decode at Q = 1) wrapper beside verify_attention, from the install above.
  TAIL=12 step flashinfer_attention 120 bash -c '
    PYTHONPATH=/tmp/fi:${PYTHONPATH:-} python3 -m specdec_ext.cli bench verify_attention --device "$1" --batch 1,8,32 \
      --contexts 4096,32768 --queries 1,5 --repeats 20 --against flashinfer --json "$0/verify_attention_flashinfer.json"' \
    "$OUT" "$DEVICE"
fi
TAIL=40 bench tree_sampling 70 --repeats 30 --json "$OUT/tree_sampling.json"
TAIL=9 bench verify_attention-layouts 40 --repeats 50 --layouts --json "$OUT/verify_attention_layouts.json"
TAIL=6 bench chain_sampling_flat 40 --repeats 30 --json "$OUT/chain_sampling_flat.json"
TAIL=12 bench chain_sampling_row_filters 40 --repeats 30 --json "$OUT/chain_sampling_row_filters.json"
TAIL=42 bench quantized_linear 60 --repeats 30 --json "$OUT/quantized_linear.json"
TAIL=9 bench philox_uniform 30 --json "$OUT/philox_uniform.json"
for shim in flashinfer vllm vllm_v2 sglang transformers; do
  bench "compat_$shim" 30 --repeats 30 --json "$OUT/compat_$shim.json"
done
TAIL=8 bench verify_attention-flex 40 --repeats 30 --flex --batch 1,8 --contexts 4096,32768 --queries 5
echo "gpu_check: $(( $(date +%s) - t0 )) s this command; done: $(tr '\n' ' ' < "$OUT/done")"
