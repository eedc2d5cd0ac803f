#!/usr/bin/env bash
# The RPC link's cost per speculative step (aerie bench-rpc) over a Unix
# socket, TCP and TLS 1.3 with client certificates: makes a throwaway CA,
# server and client certificates, then runs the benchmark. One JSON line.
#   tools/bench_rpc.sh [aerie bench-rpc options]
set -euo pipefail
cd "$(dirname "$0")/.."
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
ossl() { openssl "$@" >/dev/null 2>&1; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=aerie bench CA" \
    -keyout "$d/ca.key" -out "$d/ca.pem"
for name in server client; do
    ossl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
        -keyout "$d/$name.key" -out "$d/$name.csr"
    echo "subjectAltName=IP:127.0.0.1" >"$d/$name.ext"
    ossl x509 -req -in "$d/$name.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial -days 2 \
        -extfile "$d/$name.ext" -out "$d/$name.pem"
done
build/aerie bench-rpc --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
    --tls-cert "$d/server.pem" --tls-key "$d/server.key" --tls-ca "$d/ca.pem" \
    --tls-client-cert "$d/client.pem" --tls-client-key "$d/client.key" "$@"
