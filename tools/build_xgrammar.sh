#!/usr/bin/env bash
# Builds XGrammar's C++ library (structured output, target/grammar.h) from
# its source release on PyPI into build/xgrammar/:
#
#   build/xgrammar/lib/libxgrammar.a
#   build/xgrammar/include/{xgrammar,dlpack}/
#
# The release is pinned by version and SHA-256. Its Python bindings,
# tests and link-time optimisation are off: the library is linked into C
# programs by gcc and clang alike. Takes about 3 minutes on 2 cores; does
# nothing when the library is there.
set -euo pipefail

VERSION=0.2.9
SHA256=87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90
root=$(cd "$(dirname "$0")/.." && pwd)
out=$root/build/xgrammar
[ -f "$out/lib/libxgrammar.a" ] && exit 0

for t in cmake g++; do
    command -v $t >/dev/null 2>&1 || {
        echo "build_xgrammar: $t is missing; tools/deps.sh run installs it" >&2
        exit 1
    }
done
work=$out/work
rm -rf "$work"
mkdir -p "$work"
echo "xgrammar: downloading the source of version $VERSION from PyPI" >&2
tarball=$work/xgrammar-$VERSION.tar.gz
# The file's address comes from PyPI's simple index (pip itself would
# build the package's metadata, and with it cmake, from source).
python3 - "$tarball" <<'PY'
import re, sys, urllib.request
out = sys.argv[1]
name = out.rsplit("/", 1)[1]
page = urllib.request.urlopen("https://pypi.org/simple/xgrammar/", timeout=60).read().decode()
links = [h for h in re.findall(r'href="([^"]+)"', page) if h.split("#")[0].endswith("/" + name)]
if not links:
    sys.exit(f"build_xgrammar: {name} is not on PyPI's index")
with urllib.request.urlopen(links[0].split("#")[0], timeout=120) as r, open(out, "wb") as f:
    f.write(r.read())
PY
echo "$SHA256  $tarball" | sha256sum -c --quiet - || {
    echo "build_xgrammar: $tarball does not have the pinned SHA-256" >&2
    exit 1
}
tar -xzf "$tarball" -C "$work"
src=$work/xgrammar-$VERSION
mkdir -p "$work/build"
cat >"$work/build/config.cmake" <<'EOF'
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
EOF
echo "xgrammar: building (about 3 minutes on 2 cores)" >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="-fno-lto" \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON >"$work/cmake.log" 2>&1 || {
    tail -20 "$work/cmake.log" >&2
    exit 1
}
cmake --build "$work/build" -j "$(nproc)" >"$work/build.log" 2>&1 || {
    tail -40 "$work/build.log" >&2
    exit 1
}
mkdir -p "$out/lib" "$out/include"
cp -r "$src/include/xgrammar" "$out/include/"
cp -r "$src/3rdparty/dlpack/include/dlpack" "$out/include/"
cp "$work/build/libxgrammar.a" "$out/lib/"
cp "$src/LICENSE" "$out/LICENSE"
rm -rf "$work"
echo "xgrammar: built $out/lib/libxgrammar.a" >&2
