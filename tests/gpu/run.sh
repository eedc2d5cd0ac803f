#!/usr/bin/env bash
# Everything that needs a GPU, in one script for a lent GPU machine (one
# H200, 16 cores, about 15 minutes of device time in all, start-up
# included). It must finish within 8 minutes.
#
# Prepare here, where the libraries are:   make gpu-tests
# Run there, from the repo root, carrying build/gpu (the test binaries and
# the shared libraries they load, which that machine lacks):
#   tests/gpu/run.sh            logs to $OUT (or build/gpu-out)
#
# It builds the CUDA plugin with that machine's nvcc, prints the machine,
# driver, CUDA, cuBLAS and NCCL versions, then runs every op of the CUDA
# backend against the CPU backend and the tiny golden models
# (tests/cuda_cpu/: the same tests make test-cuda-cpu runs on the CPU
# shim), the lossless speculative test with the target on CUDA, and the
# benchmarks; it ends with one summary line. tests/gpu/UNRUN.md lists what
# has never run on a GPU; update it from this script's log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
t0=$SECONDS
passed=0 failed=0 failures=()

step() { echo; echo "== $* ($((SECONDS - t0)) s)"; }

# run NAME TIMEOUT CMD...: one check, its output to $OUT/NAME.log and here.
run() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1))
        echo "-- $name: passed"
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "-- $name: FAILED (exit $rc)"
    fi
}

step "machine"
nvidia-smi || echo "nvidia-smi: not found or failed"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free,clocks.max.sm --format=csv || true
NVCC=$(command -v nvcc || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
[ -n "$NVCC" ] && "$NVCC" --version | tail -n 2
echo "cuBLAS and NCCL libraries present:"
{ ldconfig -p 2>/dev/null | grep -oE '(libcublas|libcublasLt|libnccl)\.so[.0-9]*' | sort -u
  find / -xdev \( -name 'libcublas.so.*' -o -name 'libnccl.so.*' \) 2>/dev/null | head -n 6; } | sed 's/^/  /'
python3 - <<'PY' 2>/dev/null || true
import torch
print("  torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))
PY
nproc
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU here: nothing to run"
    echo "gpu: 0 passed, 1 failed in $((SECONDS - t0)) s"
    exit 1
fi

step "build: make cuda with this machine's nvcc"
if [ -z "$NVCC" ]; then
    echo "no nvcc on this machine"; failed=$((failed + 1)); failures+=(build)
else
    run build 300 make -j"$(nproc)" cuda NVCC="$NVCC"
fi
if [ ! -x build/gpu/test_cuda_ops ]; then
    echo "build/gpu is missing: run make gpu-tests before, and carry build/gpu"
    failed=$((failed + 1)); failures+=(gpu-tests)
fi

export LD_LIBRARY_PATH=$PWD/build/gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export AERIE_CUDA_LIB=$PWD/build/libaerie-cuda.so

# The correctness runs wait for each kernel as it is launched, so that a
# fault names the kernel that made it (AERIE_CUDA_SYNC=1).
step "ops: every op of the CUDA backend against the CPU backend"
AERIE_CUDA_SYNC=1 run ops 120 build/gpu/test_cuda_ops

step "models: the tiny golden checkpoints through the engine on CUDA"
AERIE_CUDA_SYNC=1 run models 180 build/gpu/test_cuda_model

step "speculation: greedy speculative output on CUDA equals plain decoding"
run spec 180 build/gpu/test_cuda_spec

# Decode at batch 1 against the HBM roofline: weight bytes per step over
# the device's copy bandwidth measured in the same run (aerie bench
# --device cuda). Models with random weights made here (no download): the
# default model's shape (SmolLM2-135M, Q4_1), which launch latency bounds,
# and a Llama-3.1-8B shape in Q4_0 and in BF16.
#
# Then speculation at a fixed acceptance: an oracle draft proposes the
# target's own greedy tokens, K right then one wrong, so each step's
# acceptance length is exactly K + 1 (2, 3, 4): tokens/s against plain
# decoding, the system's cost apart from any head's quality.
step "benchmarks"
models=${AERIE_GPU_MODELS:-/tmp/aerie-models}
mkdir -p "$models"
make_model() { # shape type: sets $file, made once
    file=$models/$1-$2.gguf
    [ -s "$file" ] || run "make-$1-$2" 240 build/gpu/aerie make-model --shape "$1" --type "$2" --out "$file"
}
bench() { # name file args...
    local name=$1 file=$2
    shift 2
    run "$name" 240 build/gpu/aerie bench --model "$file" --device cuda --prompt-tokens 128 "$@"
}
make_model smollm2-135m q4_1
bench bench-smollm2-135m-q4_1 "$file" --gen-tokens 64 --repeat 3
make_model llama-3.1-8b q4_0
bench bench-llama-3.1-8b-q4_0 "$file" --gen-tokens 64 --repeat 3
for k in 1 2 3; do
    bench "oracle-$((k + 1))-llama-3.1-8b-q4_0" "$file" --gen-tokens 30 --repeat 1 --oracle-accept $k
done
make_model llama-3.1-8b bf16
bench bench-llama-3.1-8b-bf16 "$file" --gen-tokens 64 --repeat 3
echo
echo "figures (one JSON line each):"
for f in "$OUT"/bench-*.log "$OUT"/oracle-*.log; do
    [ -f "$f" ] && printf '  %s: %s\n' "$(basename "$f" .log)" "$(grep '^{' "$f" | tail -n 1 | cut -c1-400)"
done

echo
[ ${#failures[@]} -eq 0 ] || echo "failed: ${failures[*]}"
echo "gpu: $passed passed, $failed failed in $((SECONDS - t0)) s"
[ "$failed" -eq 0 ]
