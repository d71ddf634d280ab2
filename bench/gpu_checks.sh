#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, results in OUT (default ./gpu-results): the CUDA
# tests, `kvctl bench gpu` and `kvctl bench ttft` (Llama-3.1-8B shape, bf16; the long contexts
# apart, so a time limit cuts one half only). About 10 minutes on one H100/H200.
#   bench/gpu_checks.sh [OUT] [CONTEXTS...]     e.g. bench/gpu_checks.sh out 1k,16k,64k 32k,100k
set -uo pipefail
out=${1:-gpu-results}
shift || true
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(1k,16k,64k 32k,100k)
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
"$py" -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/unit tests/functional \
  > "$out/cuda-tests.log" 2>&1
echo "cuda tests: rc=$?"
"$py" -m kvctl bench gpu --json > "$out/bench-gpu.json" 2> "$out/bench-gpu.err"
echo "bench gpu: rc=$?"
for contexts in "${groups[@]}"; do
  "$py" -m kvctl bench ttft --device cuda --contexts "$contexts" --json \
    > "$out/ttft-${contexts//,/_}.json" 2> "$out/ttft-${contexts//,/_}.err"
  echo "bench ttft $contexts: rc=$?"
done
