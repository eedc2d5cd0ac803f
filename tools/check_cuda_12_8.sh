#!/usr/bin/env bash
# Checks that the CUDA backend (kernels/cuda/) still builds with CUDA 12.8,
# the version the system was specified with, using what PyPI has of 12.8:
# its runtime headers (nvidia-cuda-runtime-cu12) and its ptxas
# (nvidia-cuda-nvcc-cu12; the wheel has no nvcc front end).
#   - host code: kn_cuda.cu compiled by g++ against 12.8's cuda_runtime.h,
#     so no runtime call newer than 12.8 slips in unguarded;
#   - device code: this machine's nvcc writes PTX for each GPU target, the
#     PTX is labelled ISA 8.7 (12.8's), and 12.8's ptxas assembles it for
#     sm_90a, sm_100a and sm_120: an instruction 12.8 lacks fails there.
# The wheels are pinned by sha256 and kept in build/cuda-12.8/.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build/cuda-12.8
mkdir -p "$dir"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

wheels=(
    "nvidia-cuda-runtime-cu12==12.8.90 adade8dcbd0edf427b7204d480d6066d33902cab2a4707dcfc48a2d0fd44ab90"
    "nvidia-cuda-nvcc-cu12==12.8.93 2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011"
)
for w in "${wheels[@]}"; do
    spec=${w% *} sum=${w#* }
    name=${spec%%==*}
    if [ ! -f "$dir/$name.ok" ]; then
        rm -rf "$dir/dl" && mkdir -p "$dir/dl"
        python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
            --platform manylinux_2_17_x86_64 --python-version 3.11 -d "$dir/dl" "$spec"
        f=$(ls "$dir"/dl/*.whl)
        echo "$sum  $f" | sha256sum -c --quiet
        python3 -m zipfile -e "$f" "$dir/root"
        touch "$dir/$name.ok"
    fi
done
root=$dir/root/nvidia
chmod +x "$root/cuda_nvcc/bin/ptxas"
echo "  12.8   $("$root/cuda_nvcc/bin/ptxas" --version | tail -n 1)"

g++ -std=c++17 -x c++ -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter \
    -I"$root/cuda_runtime/include" -I"$root/cuda_nvcc/include" kernels/cuda/kn_cuda.cu
echo "  12.8   host code builds against CUDA 12.8's runtime headers"

for src in kernels/cuda/*.cu; do
    for arch in 90a 100a 120; do
        ptx=$dir/$(basename "$src" .cu)_$arch.ptx
        "$NVCC" -std=c++17 --fmad=false -O2 -arch=compute_$arch -ptx "$src" -o "$ptx"
        grep -q '^\.version 9\.0$' "$ptx" || { echo "unexpected PTX version in $ptx"; exit 1; }
        sed -i 's/^\.version 9\.0$/.version 8.7/' "$ptx"
        "$root/cuda_nvcc/bin/ptxas" -arch=sm_$arch -O2 --warn-on-spills --warning-as-error "$ptx" -o "${ptx%.ptx}.cubin"
    done
done
echo "  12.8   device code assembles with CUDA 12.8's ptxas for sm_90a, sm_100a and sm_120"
