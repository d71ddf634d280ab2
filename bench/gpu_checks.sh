#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, results in OUT (default ./gpu-results): the CUDA
# tests, `kvctl bench gpu` and `kvctl bench ttft` (Llama-3.1-8B shape, bf16) in groups, each
# group CONTEXTS[:SOURCES][+lw][@SECONDS] (+lw: --layerwise), so a time limit cuts one group
# only, then `kvctl bench agent` with the 8B shape's 32 MiB chunks (the GPU host's cores copying
# puts and gets). Each
# step has its own limit in seconds (the environment's, or the group's) so the whole fits a short
# lease: under 10 minutes with the defaults but for the last step (180 + 50 + 220 + 130 + 60 s
# at most; the CUDA tests took 153 s with -n 8 on a 16-core H200 host, 130 s with -n 12 on
# 2026-11-28, the two bit-for-bit engine tests 93-103 s of it; each step prints its end time).
#   bench/gpu_checks.sh [OUT] [GROUP...]     e.g. bench/gpu_checks.sh out 1k,32k@220 100k:cpu@130
#   bench/gpu_checks.sh out 32k,100k:cpu+lw@150   (the cpu tier with layer-wise copies)
#   TESTS_S=240 GPU_S=90 TTFT_S=300 WORKERS=4 bench/gpu_checks.sh out
# A step cut by its limit leaves its stderr (the ttft bench writes one line per source there).
set -uo pipefail
out=${1:-gpu-results}
shift || true
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(1k,32k@220 100k:cpu@130)
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
# the files with CUDA tests (a -k filter would collect, and import, every test module)
timeout "${TESTS_S:-180}" "$py" -m pytest -q -p no:cacheprovider -n "${WORKERS:-12}" \
  tests/unit/test_gpu_tier.py tests/unit/test_hostreg.py tests/unit/test_kvload.py \
  tests/unit/test_bench_gpu.py tests/functional/test_agent_gpu.py \
  tests/functional/test_engine_hf.py tests/functional/test_bench_ttft.py \
  tests/functional/test_pull_leased.py tests/functional/test_vllm_plan.py \
  > "$out/cuda-tests.log" 2>&1
echo "cuda tests: rc=$? after ${SECONDS}s"
timeout "${GPU_S:-50}" "$py" -m kvctl bench gpu --json > "$out/bench-gpu.json" 2> "$out/bench-gpu.err"
echo "bench gpu: rc=$? after ${SECONDS}s"
for group in "${groups[@]}"; do
  limit=${TTFT_S:-300}
  [[ $group != *@* ]] || { limit=${group##*@}; group=${group%@*}; }
  flags=() lw=""
  [[ $group != *+lw ]] || { flags=(--layerwise); lw=-lw; group=${group%+lw}; }
  contexts=${group%%:*}
  sources=cpu,disk,pool
  [ "$group" = "$contexts" ] || sources=${group#*:}
  name=ttft-${contexts//,/_}-${sources//,/_}$lw
  timeout "$limit" "$py" -m kvctl bench ttft --device cuda --contexts "$contexts" \
    --sources "$sources" ${flags[@]+"${flags[@]}"} --json > "$out/$name.json" 2> "$out/$name.err"
  echo "bench ttft $group: rc=$? after ${SECONDS}s"
done
timeout "${AGENT_S:-60}" "$py" -m kvctl bench agent --sizes 32MiB --bytes-per-size 1GiB \
  --repeats 3 --json > "$out/bench-agent.json" 2> "$out/bench-agent.err"
echo "bench agent: rc=$? after ${SECONDS}s"
