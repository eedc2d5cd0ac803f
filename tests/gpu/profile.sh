#!/usr/bin/env bash
# Where decode's GPU time goes: ncu's per-kernel times over launches of
# aerie bench past its two prefills (about 650 launches each for the
# Llama-3.1-8B shape), so about one decode step, summarized per
# kernel and grid by tests/gpu/ncu_summary.py; the raw CSV goes to $OUT.
# Run on the GPU machine after tests/gpu/run.sh's preparation (make
# gpu-tests here, build/gpu carried). Models are made as run.sh makes
# them, in AERIE_GPU_MODELS (/tmp/aerie-models).
#
#   tests/gpu/profile.sh [SKIP [LAUNCHES]]   (1400 and 600 by default)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
skip=${1:-1400} launches=${2:-600}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { echo "ncu: not on this machine"; exit 1; }
export LD_LIBRARY_PATH=$PWD/build/gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export AERIE_CUDA_LIB=$PWD/build/gpu/libaerie-cuda.so
models=${AERIE_GPU_MODELS:-/tmp/aerie-models}
mkdir -p "$models"
rc=0
for spec in ${PROFILE_MODELS:-smollm2-135m:q4_1 llama-3.1-8b:q4_0 llama-3.1-8b:bf16}; do
    shape=${spec%%:*} type=${spec##*:}
    file=$models/$shape-$type.gguf
    [ -s "$file" ] || build/gpu/aerie make-model --shape "$shape" --type "$type" --out "$file" >/dev/null || { rc=1; continue; }
    echo "== $shape $type: launches $skip .. $((skip + launches)) of aerie bench"
    csv=$OUT/ncu-$shape-$type.csv
    timeout 150 "$NCU" --clock-control none --print-units base --csv \
        --metrics gpu__time_duration.sum --launch-skip "$skip" --launch-count "$launches" --log-file "$csv" \
        build/gpu/aerie bench --model "$file" --device cuda --prompt-tokens 128 --gen-tokens 8 --repeat 1 \
        >/dev/null 2>"/tmp/ncu-$shape-$type.err" || { echo "ncu failed:"; tail -n 5 "/tmp/ncu-$shape-$type.err"; rc=1; }
    python3 tests/gpu/ncu_summary.py "$csv" 25 || rc=1
done
# PROFILE_DETAIL="KERNEL:SKIP ...": ncu's speed-of-light, occupancy and
# warp-stall sections for two launches of each KERNEL past its first SKIP
# (the first prefill and decode kernels, on the q4_0 model), into
# $OUT/ncu-detail.txt; the headline rows are printed.
file=$models/llama-3.1-8b-q4_0.gguf
for spec in ${PROFILE_DETAIL:-}; do
    kernel=${spec%%:*} kskip=${spec##*:}
    echo "== $kernel: launches $kskip and $((kskip + 1)), in detail"
    timeout 120 "$NCU" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis --kernel-name "$kernel" --launch-skip "$kskip" \
        --launch-count 2 build/gpu/aerie bench --model "$file" --device cuda --prompt-tokens 128 --gen-tokens 4 \
        --repeat 1 2>/dev/null | sed -n '/==PROF== Disconnected/,$p' >>"$OUT/ncu-detail.txt" || rc=1
    grep -E "^  [a-z_]+|Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|L1/TEX Hit|Grid Size" \
        "$OUT/ncu-detail.txt" | tail -n 40
done
exit $rc
