#!/usr/bin/env bash
# `make run`: the whole serving stack on this machine.
#
#   aerie-draft   the EAGLE-3 head found beside the model (--draft auto)
#   aerie-target  the model, speculating through the draft
#   aerie-gateway the OpenAI-compatible API on http://127.0.0.1:8080
#
# They talk over Unix sockets in a private directory. Each one's log lines
# are shown with its name in front. Ctrl-C stops all three (each drains
# and exits). With no trained head for the model, the target runs without a
# draft, and this says so.
#
# AERIE_MODEL, AERIE_HOST and AERIE_PORT change the model and the address.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${AERIE_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
host=${AERIE_HOST:-127.0.0.1}
port=${AERIE_PORT:-8080}
# The services read AERIE_* themselves; these are this script's.
unset AERIE_MODEL AERIE_HOST AERIE_PORT

dir=$(mktemp -d /tmp/aerie-run.XXXXXX)
pids=()

stop_all() {
    trap - INT TERM EXIT
    [ ${#pids[@]} -gt 0 ] || { rm -rf "$dir"; return; }
    echo
    echo "run: stopping (gateway, then target, then draft)"
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill -TERM "${pids[i]}" 2>/dev/null || true
        wait "${pids[i]}" 2>/dev/null || true
    done
    pids=()
    rm -rf "$dir"
    echo "run: stopped"
}
trap 'stop_all; exit 0' INT TERM
trap stop_all EXIT

# start NAME ARGS...: runs build/NAME with its output prefixed by its name.
start() {
    local name=$1
    shift
    "build/$name" "$@" > >(trap "" INT; sed -u "s/^/[${name#aerie-}] /") 2>&1 &
    pids+=($!)
}

alive() {
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || return 1; done
}

draft_addr=none
if build/aerie-draft --model "$model" --print-config >/dev/null 2>&1; then
    draft_addr="unix:$dir/draft.sock"
    start aerie-draft --model "$model" --listen "$draft_addr"
else
    echo "run: no trained EAGLE-3 head beside $model (make train-draft makes one):"
    echo "run: the target runs without a draft (plain decoding, same output)"
fi
start aerie-target --model "$model" --listen "unix:$dir/target.sock" --draft-addr "$draft_addr"
start aerie-gateway --model "$model" --targets "unix:$dir/target.sock" --host "$host" --port "$port"

echo "run: waiting for http://$host:$port/health"
for ((i = 0; ; i++)); do
    if ! alive; then
        echo "run: a service exited while starting (its lines above say why)" >&2
        exit 1
    fi
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://$host:$port/health" || true)
    [ "$code" = 200 ] && break
    if [ "$i" -ge 600 ]; then
        echo "run: /health still answers $code after 60 s" >&2
        exit 1
    fi
    sleep 0.1
done

name=$(curl -s "http://$host:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
cat <<EOF

Aerie is serving $name at http://$host:$port/v1 (draft: $([ "$draft_addr" = none ] && echo none || echo "the EAGLE-3 head beside the model"))

  curl http://$host:$port/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$name", "messages": [{"role": "user", "content": "What is speculative decoding?"}], "max_tokens": 64}'

  also: /v1/completions, /v1/models, /health, /metrics, /server_info, /tokenize, /detokenize
  Ctrl-C stops all three.

EOF
while alive; do sleep 1; done
echo "run: a service exited (its lines above say why)" >&2
exit 1
