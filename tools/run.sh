#!/usr/bin/env bash
# `make run`: the whole serving stack on this machine.
#
#   aerie-draft   the EAGLE-3 head found beside the model (--draft auto)
#   aerie-target  the model, speculating through the draft
#   aerie-gateway the OpenAI-compatible API on http://127.0.0.1:8080
#
# They talk over Unix sockets in a private directory. Each one's log lines
# are shown with its name in front. One that exits is started again with
# backoff while the others keep serving (see supervise). Ctrl-C stops all
# three (each drains and exits). With no trained head for the model, the target runs without a
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
sups=()   # one supervisor per service, in start order

stop_all() {
    trap - INT TERM EXIT
    [ ${#sups[@]} -gt 0 ] || { rm -rf "$dir"; return; }
    echo
    echo "run: stopping (gateway, then target, then draft)"
    for ((i = ${#sups[@]} - 1; i >= 0; i--)); do
        kill -TERM "${sups[i]}" 2>/dev/null || true
        wait "${sups[i]}" 2>/dev/null || true
    done
    sups=()
    rm -rf "$dir"
    echo "run: stopped"
}
trap 'stop_all; exit 0' INT TERM
trap stop_all EXIT

# supervise NAME ARGS...: runs build/NAME with its output prefixed by its
# name, and starts it again when it fails, as systemd's Restart=on-failure
# would: after 0.5 s, doubling up to 8 s while it keeps dying young (under
# 10 s), giving up after 5 such exits in a row. The others keep serving
# meanwhile (the target decodes without its draft, the gateway answers 503
# with Retry-After while no target is up). A clean exit (status 0: the
# service was asked to stop, e.g. by Ctrl-C, which reaches the whole
# process group) is not restarted. SIGTERM stops the service and this.
# The "started pid=" and "exited (...)" lines are for people and tests.
supervise() {
    local name=$1 short=${1#aerie-}
    shift
    local pid= spid= lpid= stopping=false delay=0.5 young=0 t0 rc how
    local fifo="$dir/$short.out"
    mkfifo "$fifo"
    trap 'stopping=true; [ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null; [ -z "$spid" ] || kill "$spid" 2>/dev/null' TERM
    # Ctrl-C reaches the service itself (the whole group gets it); this
    # only waits for it and does not restart it. Without this trap a
    # subshell of a script that traps INT would die of it, leaving the
    # service running while the script removes its socket directory.
    trap 'stopping=true' INT
    while :; do
        t0=$SECONDS
        # The prefixer reads a FIFO, not a process substitution, so that
        # this can wait for it: the service's last lines are printed before
        # "run: stopped" (it ignores Ctrl-C and ends at the service's EOF).
        (trap "" INT TERM; exec sed -u "s/^/[$short] /" <"$fifo") &
        lpid=$!
        "build/$name" "$@" >"$fifo" 2>&1 &
        pid=$!
        echo "run: $short started pid=$pid"
        # A stop that came before pid was set has not reached the service.
        ! $stopping || kill -TERM "$pid" 2>/dev/null || true
        # A trapped TERM interrupts wait; wait again for the service itself,
        # then for its prefixer to print what is left.
        while :; do
            rc=0
            wait "$pid" || rc=$?
            kill -0 "$pid" 2>/dev/null || break
        done
        while kill -0 "$lpid" 2>/dev/null; do wait "$lpid" || true; done
        pid= lpid=
        $stopping && return 0
        if [ "$rc" -eq 0 ]; then
            # A clean exit (it was asked to stop) is not a failure:
            # Restart=on-failure would leave it stopped too.
            echo "run: $short exited (status 0); not restarting"
            return 0
        fi
        if [ "$rc" -gt 128 ]; then how="signal $((rc - 128))"; else how="status $rc"; fi
        if [ $((SECONDS - t0)) -ge 10 ]; then delay=0.5 young=0; else young=$((young + 1)); fi
        if [ "$young" -ge 5 ]; then
            echo "run: $short exited ($how) $young times in a row within 10 s of starting; giving up" >&2
            return 1
        fi
        echo "run: $short exited ($how); restarting in $delay s"
        sleep "$delay" &
        spid=$!
        wait "$spid" || true
        spid=
        $stopping && return 0
        delay=$(awk -v d="$delay" 'BEGIN { d *= 2; print (d > 8 ? 8 : d) }')
    done
}

start() {
    supervise "$@" &
    sups+=($!)
}

alive() {
    for p in "${sups[@]}"; do kill -0 "$p" 2>/dev/null || return 1; done
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
        echo "run: a service keeps exiting while starting (its lines above say why)" >&2
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
  A service that exits is started again; Ctrl-C stops all three.

EOF
while alive; do sleep 1; done
echo "run: a service stopped for good (its lines above say why)" >&2
exit 1
