#!/usr/bin/env bash
# Everything that needs a GPU, in one script for a lent GPU machine (one
# H200, 16 cores, about 15 minutes of device time in all, start-up
# included). It stops starting checks at its deadline (AERIE_GPU_DEADLINE,
# 330 s by default), so that one call leaves device time for a second.
#
# Prepare here, where the libraries and nvcc are:   make gpu-tests
# Run there, from the repo root, carrying build/gpu (the test binaries, the
# shared libraries they load, which that machine lacks, and the CUDA
# plugin built here):
#   tests/gpu/run.sh            logs to $OUT (or build/gpu-out): run.log,
#                               and each check's in gpu-logs.tgz
#
# It prints the machine, driver, CUDA, cuBLAS and NCCL versions, then, most
# telling first: every op of the CUDA backend against the CPU backend and
# the tiny golden models (tests/cuda_cpu/: the same tests make
# test-cuda-cpu runs on the CPU shim), the lossless speculative test with
# the target on CUDA, the CUDA path under the GPU units' confinement
# (memory-deny-write-execute, the system call filter), the benchmarks,
# compute-sanitizer's memcheck over the op test, and transformers on the
# same shapes as a side-by-side figure; it
# ends with one summary line. tests/gpu/UNRUN.md lists what has never run
# on a GPU; update it from this script's log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
exec > >(tee "$OUT/run.log") 2>&1
t0=$SECONDS
deadline=${AERIE_GPU_DEADLINE:-330}
passed=0 failed=0 failures=() skipped=() not_built=()

step() { echo; echo "== $* ($((SECONDS - t0)) s)"; }

# run NAME TIMEOUT CMD...: one check, its output to $LOGS/NAME.log and here;
# cut to the time left before the deadline, and skipped with under 15 s.
run() {
    local name=$1 limit=$2 left=$((deadline - (SECONDS - t0)))
    shift 2
    if [ "$left" -lt 15 ]; then
        echo "-- $name: skipped (deadline ${deadline} s)"
        skipped+=("$name")
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
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
# Fast mode (--no-deterministic) opens cuBLAS with dlopen: where the
# loader does not find libcublas.so.13 (or .12), the first on the disk.
if [ -z "${AERIE_CUBLAS_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -qE 'libcublas\.so\.1[23] '; then
    AERIE_CUBLAS_LIB=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -n 1)
    [ -n "$AERIE_CUBLAS_LIB" ] || AERIE_CUBLAS_LIB=$(find / -xdev -name 'libcublas.so.12' 2>/dev/null | head -n 1)
    [ -n "$AERIE_CUBLAS_LIB" ] && export AERIE_CUBLAS_LIB
fi
echo "cuBLAS for fast mode: ${AERIE_CUBLAS_LIB:-libcublas.so.13, from the loader path}"
python3 - <<'PY' 2>/dev/null || true
import torch
print("  torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))
PY
# NCCL's own version (ncclGetVersion: major*10000 + minor*100 + patch
# from 2.9 on), from the first libnccl the loader or the disk has.
# The newest libnccl on the machine (the loader's may be older than one
# a Python package brings: ranks sharing a GPU need 2.30).
nccl_found=$(python3 - <<'PY' 2>/dev/null
import ctypes, ctypes.util, subprocess
names = [ctypes.util.find_library("nccl") or "libnccl.so.2"]
names += subprocess.run(["find", "/", "-xdev", "-name", "libnccl.so.2"], capture_output=True, text=True).stdout.split()
best = None
for n in names:
    try:
        lib = ctypes.CDLL(n)
    except OSError:
        continue
    v = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(v)) == 0 and (best is None or v.value > best[0]):
        best = (v.value, n)
if best:
    v, n = best
    print(f"{v // 10000}.{v // 100 % 100}.{v % 100} {n}")
PY
)
nccl_version=${nccl_found%% *}
# The plugin opens NCCL with dlopen: the file found, unless told.
if [ -n "$nccl_found" ] && [ -z "${AERIE_NCCL_LIB:-}" ]; then
    AERIE_NCCL_LIB=${nccl_found#* }
    [ "${AERIE_NCCL_LIB#/}" != "$AERIE_NCCL_LIB" ] && export AERIE_NCCL_LIB || unset AERIE_NCCL_LIB
fi
echo "NCCL: ${nccl_version:-no libnccl.so.2 found}${AERIE_NCCL_LIB:+ ($AERIE_NCCL_LIB)}"
nproc
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU here: nothing to run"
    echo "gpu: 0 passed, 1 failed in $((SECONDS - t0)) s"
    exit 1
fi

step "the CUDA plugin"
if [ ! -x build/gpu/test_cuda_ops ] || [ ! -f build/gpu/libaerie-cuda.so ]; then
    echo "build/gpu is incomplete: run make gpu-tests before, and carry build/gpu"
    echo "gpu: 0 passed, 1 failed in $((SECONDS - t0)) s"
    exit 1
fi
[ -n "$NVCC" ] && cuobjdump --list-elf build/gpu/libaerie-cuda.so 2>/dev/null | sed 's/^/  /'
# AERIE_GPU_BUILD=1: build the plugin with this machine's nvcc too (about a
# minute of device time) and test that one; by default the plugin built
# here by the same nvcc 13 is used, to keep the device time for the checks.
if [ "${AERIE_GPU_BUILD:-0}" = 1 ]; then
    if [ -z "$NVCC" ]; then
        echo "no nvcc on this machine"; failed=$((failed + 1)); failures+=(build)
    elif run build 300 make -j"$(nproc)" cuda NVCC="$NVCC"; [ -f build/libaerie-cuda.so ]; then
        cp build/libaerie-cuda.so build/gpu/libaerie-cuda.so
    fi
fi

export LD_LIBRARY_PATH=$PWD/build/gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export AERIE_CUDA_LIB=$PWD/build/gpu/libaerie-cuda.so

# The correctness runs wait for each kernel as it is launched, so that a
# fault names the kernel that made it (AERIE_CUDA_SYNC=1).
step "ops: every op of the CUDA backend against the CPU backend"
AERIE_CUDA_SYNC=1 run ops 120 build/gpu/test_cuda_ops

step "models: the tiny golden checkpoints through the engine on CUDA"
AERIE_CUDA_SYNC=1 run models 180 build/gpu/test_cuda_model

step "speculation: greedy speculative output on CUDA equals plain decoding"
run spec 180 build/gpu/test_cuda_spec

# The GPU units' confinement on the CUDA path (aerie bench --device cuda,
# the target's engine), through tools/run_confined.py: mdwe-cuda under
# prctl(PR_SET_MDWE), which MemoryDenyWriteExecute= sets and the target and
# draft units leave off until this passes (CUDA might map memory writable
# and executable); filter-cuda under the target unit's own system call
# filter (@system-service), a refused call named in the log and killed.
step "unit hardening: the CUDA path under MDWE and under the units' system call filter"
# Models with random weights are made here, in $models, once.
models=${AERIE_GPU_MODELS:-/tmp/aerie-models}
mkdir -p "$models"
small=$models/smollm2-135m-q4_1.gguf
[ -s "$small" ] ||
    run make-smollm2-135m-q4_1 240 build/gpu/aerie make-model --shape smollm2-135m --type q4_1 --out "$small"
confined_bench=(build/gpu/aerie bench --model "$small" --device cuda --prompt-tokens 32 --gen-tokens 16 --repeat 1)
if ! python3 -c 'import ctypes, sys; sys.exit(ctypes.CDLL(None).prctl(66, 0, 0, 0, 0) < 0)' 2>/dev/null; then
    echo "-- mdwe-cuda: skipped (no python3, or a kernel without PR_SET_MDWE: Linux 6.3 or later)"
    not_built+=(mdwe-cuda)
else
    run mdwe-cuda 120 python3 tools/run_confined.py --mdwe -- "${confined_bench[@]}"
fi
if /usr/bin/python3 -c 'import seccomp' 2>/dev/null && command -v systemd-analyze >/dev/null; then
    run filter-cuda 120 /usr/bin/python3 tools/run_confined.py --unit deploy/aerie-target@.service --refuse kill \
        -- "${confined_bench[@]}"
else
    echo "-- filter-cuda: skipped (needs python3-seccomp for /usr/bin/python3, and systemd-analyze)"
    not_built+=(filter-cuda)
fi

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
# AERIE_GPU_BENCH=0: the correctness checks and memcheck only.
bench_on=${AERIE_GPU_BENCH:-1}
[ "$bench_on" = 1 ] && step "benchmarks"
file=
make_model() { # shape type: sets $file, made once
    [ "$bench_on" = 1 ] || return 0
    file=$models/$1-$2.gguf
    [ -s "$file" ] || run "make-$1-$2" 240 build/gpu/aerie make-model --shape "$1" --type "$2" --out "$file"
}
bench() { # name file args...
    [ "$bench_on" = 1 ] || return 0
    local name=$1 file=$2
    shift 2
    run "$name" 240 build/gpu/aerie bench --model "$file" --device cuda --prompt-tokens 128 "$@"
}
# Each decode step is a CUDA graph by default (--cuda-graphs auto); the
# same with --cuda-graphs 0 beside it is what the graphs save.
make_model smollm2-135m q4_1
bench bench-smollm2-135m-q4_1 "$file" --gen-tokens 64 --repeat 3
bench bench-smollm2-135m-q4_1-nographs "$file" --gen-tokens 64 --repeat 3 --cuda-graphs 0
make_model llama-3.1-8b q4_0
bench bench-llama-3.1-8b-q4_0 "$file" --gen-tokens 64 --repeat 3
bench bench-llama-3.1-8b-q4_0-nographs "$file" --gen-tokens 64 --repeat 3 --cuda-graphs 0
for k in 1 2 3; do
    bench "oracle-$((k + 1))-llama-3.1-8b-q4_0" "$file" --gen-tokens 30 --repeat 1 --oracle-accept $k
done

# Out-of-bounds and misaligned accesses, and reads of memory never
# written, in every kernel of the op test (the shim's ASan cannot see the
# device's own addressing).
# Tensor parallelism on this one GPU (the ranks share the plugin's
# device: kernels/cuda/kn_cuda_comm.cu). NCCL at TP 1: its allreduce
# called on one rank leaves the bits. At TP 2 (NCCL 2.30 or later, with
# NCCL_MULTI_RANK_GPU_ENABLE=1): two ranks' sums bit-equal to the CPU's,
# and the engine at two ranks through NCCL, speculative output equal to
# plain. The custom kernel's two ranks ran in "spec" above. Then the
# allreduce figures of a verify pass at TP 2 on the GPU: aerie bench, auto
# (its measurement of both kinds is in the log), on the 8B shape.
step "tensor parallelism: NCCL and the custom allreduce"
if [ -z "$nccl_version" ]; then
    echo "-- nccl-tp1: skipped (no libnccl.so.2 on this machine)"
    echo "-- nccl-tp2: skipped (no libnccl.so.2 on this machine)"
    not_built+=(nccl-tp1 nccl-tp2)
else
    # Kernels loaded at start: a rank's first launch of a kernel must not
    # wait on a lazy load while another rank's NCCL kernel spins.
    export CUDA_MODULE_LOADING=EAGER
    AERIE_TEST_NCCL_RANKS=1 run nccl-tp1 60 build/gpu/test_cuda_ops nccl_allreduce_when_asked
    IFS=. read -r nccl_major nccl_minor _ <<<"$nccl_version"
    if [ "$nccl_major" -gt 2 ] || { [ "$nccl_major" -eq 2 ] && [ "$nccl_minor" -ge 30 ]; }; then
        NCCL_MULTI_RANK_GPU_ENABLE=1 AERIE_TEST_NCCL_RANKS=2 run nccl-tp2 60 build/gpu/test_cuda_ops nccl_allreduce_when_asked
        NCCL_MULTI_RANK_GPU_ENABLE=1 AERIE_TEST_ALLREDUCE=nccl run nccl-tp2-spec 120 build/gpu/test_cuda_spec \
            ranks_on_cuda_give_the_cpu_ranks_bits
        # and on two GPUs, where this machine has them (the test says when not)
        AERIE_TEST_ALLREDUCE=nccl run nccl-tp2-two-gpus 120 build/gpu/test_cuda_spec \
            ranks_on_two_devices_give_the_cpu_ranks_bits
    else
        echo "-- nccl-tp2: skipped (NCCL $nccl_version: two ranks on one GPU need NCCL 2.30 or later)"
        not_built+=(nccl-tp2)
    fi
    unset CUDA_MODULE_LOADING
fi
# The custom kind here: NCCL's ranks sharing one GPU from two threads is
# the mode most likely to hang (UNRUN.md), and the checks above say
# whether it works; a hang in the bench would cost its whole timeout.
make_model llama-3.1-8b q4_0
bench bench-llama-3.1-8b-q4_0-tp2 "$file" --gen-tokens 32 --repeat 1 --tp 2 --allreduce custom

step "compute-sanitizer: memcheck over the op test"
if command -v compute-sanitizer >/dev/null 2>&1; then
    run memcheck 120 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 3 build/gpu/test_cuda_ops
else
    echo "compute-sanitizer: not on this machine"
fi

# The cost of deterministic mode: the BF16 shape again in fast mode
# (--no-deterministic: its matmuls by cuBLAS, x rounded to bf16).
step "benchmarks: bf16, deterministic and fast"
make_model llama-3.1-8b bf16
bench bench-llama-3.1-8b-bf16 "$file" --gen-tokens 64 --repeat 3
bench bench-llama-3.1-8b-bf16-fast "$file" --gen-tokens 64 --repeat 3 --no-deterministic

# The side-by-side figure: transformers' batch-1 greedy decode on the same
# shapes (bf16, random weights), where its python3 has torch.
step "peer: transformers on the same shapes"
if [ "$bench_on" != 1 ]; then
    echo "off (AERIE_GPU_BENCH=0)"
elif python3 -c 'import torch, transformers' 2>/dev/null; then
    run peer-transformers 120 python3 tests/gpu/peer_transformers.py smollm2-135m llama-3.1-8b
else
    echo "transformers: not on this machine"
fi
echo
echo "figures (one JSON line each):"
for f in "$LOGS"/bench-*.log "$LOGS"/oracle-*.log "$LOGS"/peer-*.log; do
    [ -f "$f" ] && grep "^{" "$f" | tail -n 2 | cut -c1-2000 | sed "s/^/  $(basename "$f" .log): /"
done

echo
[ ${#failures[@]} -eq 0 ] || echo "failed: ${failures[*]}"
[ ${#skipped[@]} -eq 0 ] || echo "skipped at the deadline: ${skipped[*]}"
[ ${#not_built[@]} -eq 0 ] || echo "skipped, not possible here: ${not_built[*]}"
tar czf "$OUT/gpu-logs.tgz" -C "$LOGS" .
echo "gpu: $passed passed, $failed failed in $((SECONDS - t0)) s"
[ "$failed" -eq 0 ]
