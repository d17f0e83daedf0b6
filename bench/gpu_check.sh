#!/usr/bin/env bash
# One run on a machine with a GPU: build for dev_cuda_archs of build_settings.json (sm_90a), the CUDA tests, the kernel benchmarks. Results go to
# $OUT (or bench/out). Uses the machine's python3 and torch; wheels under .whl/ are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
dev_archs=$(python3 -c 'import json; print(json.load(open("build_settings.json"))["dev_cuda_archs"])')
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$dev_archs}" MAX_JOBS="${MAX_JOBS:-16}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
python3 -m specdec_ext.cli info | tee -a "$OUT/gpu.txt"
python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.txt" | tail -15
python3 -m specdec_ext.cli bench philox --device cuda --json "$OUT/philox.json" 2>&1 | tail -9 | tee "$OUT/bench_philox.txt"
python3 -m specdec_ext.cli bench sampling --device cuda --repeats 30 --json "$OUT/sampling.json" --plot "$OUT/sampling.png" \
  > "$OUT/bench_sampling.txt" 2>&1
tail -26 "$OUT/bench_sampling.txt"
python3 -m specdec_ext.cli bench row_filters --device cuda --repeats 30 --json "$OUT/row_filters.json" \
  > "$OUT/bench_row_filters.txt" 2>&1
tail -12 "$OUT/bench_row_filters.txt"
python3 -m specdec_ext.cli bench quantized_linear --device cuda --repeats 30 --json "$OUT/quantized_linear.json" \
  > "$OUT/bench_quantized_linear.txt" 2>&1
tail -42 "$OUT/bench_quantized_linear.txt"
python3 -m specdec_ext.cli bench tree_sampling --device cuda --repeats 30 --json "$OUT/tree_sampling.json" \
  > "$OUT/bench_tree_sampling.txt" 2>&1
tail -40 "$OUT/bench_tree_sampling.txt"
python3 -m specdec_ext.cli bench attention --device cuda --repeats 30 --json "$OUT/attention.json" \
  --plot "$OUT/attention.png" > "$OUT/bench_attention.txt" 2>&1
tail -30 "$OUT/bench_attention.txt"
python3 -m specdec_ext.cli bench attention --device cuda --repeats 30 --flex --batch 1,8 --vocab 4096,32768 --k 5 \
  > "$OUT/bench_attention_flex.txt" 2>&1
tail -8 "$OUT/bench_attention_flex.txt"
python3 -m specdec_ext.cli bench attention --device cuda --repeats 50 --layouts --json "$OUT/attention_layouts.json" \
  > "$OUT/bench_attention_layouts.txt" 2>&1
tail -9 "$OUT/bench_attention_layouts.txt"
python3 -m specdec_ext.cli bench flat_sampling --device cuda --repeats 30 --json "$OUT/flat_sampling.json" \
  > "$OUT/bench_flat_sampling.txt" 2>&1
tail -6 "$OUT/bench_flat_sampling.txt"
for shim in flashinfer vllm sglang transformers; do
  python3 -m specdec_ext.cli bench "compat_$shim" --device cuda --repeats 30 --json "$OUT/compat_$shim.json" \
    > "$OUT/bench_compat_$shim.txt" 2>&1
  tail -12 "$OUT/bench_compat_$shim.txt"
done
