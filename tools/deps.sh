#!/usr/bin/env bash
# Installs every system and Python package the build and the tests need.
# Idempotent: when everything is present it installs nothing and says so.
set -euo pipefail

apt_pkgs=(gcc make clang libclang-rt-dev libcmocka-dev libcjson-dev ca-certificates)
# make run waits for the gateway's /health and shows a request with curl.
apt_pkgs+=(curl)
# The services' RPC link: libevent (with its OpenSSL and pthreads parts),
# OpenSSL, and nanopb (generator + runtime) for proto/aerie.proto;
# protoc compiles the same contract for the Python test client, and the
# openssl tool makes the TLS tests' certificates.
apt_pkgs+=(libevent-dev libssl-dev openssl nanopb libnanopb-dev protobuf-compiler)
command -v python3 >/dev/null 2>&1 || apt_pkgs+=(python3)
python3 -m pip --version >/dev/null 2>&1 || apt_pkgs+=(python3-pip)

# PyTorch trains EAGLE-3 heads (tools/train_eagle3.py; the pipeline's smoke
# test runs it). Debian's python3-torch is enough on the CPU; it serves
# Debian's own python3. Its matrix products go through whatever
# libblas.so.3 is installed: the reference BLAS by default, about 20x
# slower than OpenBLAS (5 against 120 GFLOP/s on 2 cores), so OpenBLAS
# comes with it.
if [ "$(command -v python3)" = /usr/bin/python3 ]; then
    apt_pkgs+=(libopenblas0-pthread)
    python3 -c 'import torch' >/dev/null 2>&1 || apt_pkgs+=(python3-torch)
fi

py_missing=()
# The integration tests speak the wire contract through Google's protobuf
# runtime (tests/integration/aerie_rpc.py).
if ! python3 -c 'import google.protobuf' >/dev/null 2>&1; then
    if [ "$(command -v python3)" = /usr/bin/python3 ]; then apt_pkgs+=(python3-protobuf); else py_missing+=(protobuf); fi
fi

missing=()
for p in "${apt_pkgs[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}"
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python3 -c 'import pytest' >/dev/null 2>&1 || py_missing+=(pytest)
# numpy writes the random EAGLE-3 head the speculative tests run with
# (tools/gen_eagle_fixture.py --default-head).
python3 -c 'import numpy' >/dev/null 2>&1 || py_missing+=(numpy)
# The gateway's tests talk to it as users do: through OpenAI's own client.
python3 -c 'import openai' >/dev/null 2>&1 || py_missing+=(openai)
# Another python3 (a virtualenv, pyenv) takes torch from PyPI.
python3 -c 'import torch' >/dev/null 2>&1 || [ "$(command -v python3)" = /usr/bin/python3 ] || py_missing+=(torch)
if [ ${#py_missing[@]} -gt 0 ]; then
    echo "deps: pip installing ${py_missing[*]}"
    # Debian's own python3 refuses plain pip installs (PEP 668); these are
    # test tools only, so allow it there.
    python3 -m pip install -q --root-user-action=ignore "${py_missing[@]}" 2>/dev/null ||
        python3 -m pip install -q --root-user-action=ignore --break-system-packages "${py_missing[@]}"
fi
[ ${#missing[@]} -eq 0 ] && [ ${#py_missing[@]} -eq 0 ] && echo "deps: all present"
exit 0
