#!/usr/bin/env bash
# Runs every CPU test: the cmocka unit suites (built with ASan+UBSan; the
# threaded ones also with TSan), each
# libFuzzer target for a short while, the layout check (tools/format.sh),
# then the pytest integration suite
# against the real binaries. Ends with one summary line over all of them.
# Expects what make test builds and fetches first (the builds, the model).
set -uo pipefail
cd "$(dirname "$0")/.."

# --only BIN...: just those cmocka binaries (make test-cuda-cpu).
only=()
if [ "${1:-}" = --only ]; then
    shift
    only=("$@")
fi

FUZZ_SECONDS=${FUZZ_SECONDS:-20}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
logdir=build/test-logs
[ ${#only[@]} -gt 0 ] || rm -rf "$logdir"
mkdir -p "$logdir"

passed=0 failed=0
failures=()
# Each phase's seconds, printed above the summary: CI has 90 minutes.
phase_times=()
t_phase=$SECONDS
end_phase() {
    phase_times+=("$1 $((SECONDS - t_phase)) s")
    t_phase=$SECONDS
}

suites=(build/asan/tests/test_* build/asan/cuda/test_* build/tsan/tests/test_* build/tsan/cuda/test_* build/tests/test_*)
if [ ${#only[@]} -gt 0 ]; then
    suites=("${only[@]}")
else
    echo "== unit tests (cmocka: ASan+UBSan; TSan for the suites that share state across threads;"
    echo "   release build for the whole-model comparisons in tests/model; the CUDA kernels on the CPU shim)"
fi
for t in "${suites[@]}"; do
    [ -x "$t" ] || continue
    name=$(basename "$(dirname "$(dirname "$t")")")/$(basename "$t")
    name=${name/#build\//release/}   # build/tests/test_x: the release-build model tests
    log=$logdir/${name//\//-}.log
    t0=$SECONDS
    "$t" >"$log" 2>&1
    rc=$?
    secs=$((SECONDS - t0))
    # A file may hold several cmocka groups: add up their summaries.
    p=0 f=0
    for k in $(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$'); do p=$((p + k)); done
    for k in $(grep -oE '^\[  FAILED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+'); do f=$((f + k)); done
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi   # crashed or sanitizer report
    passed=$((passed + p)) failed=$((failed + f))
    if [ $rc -eq 0 ]; then
        printf '  %-28s %3d passed %5d s\n' "$name" "$p" "$secs"
    else
        printf '  %-28s %3d passed, %d FAILED (exit %d, %d s) — %s\n' "$name" "$p" "$f" $rc "$secs" "$log"
        grep -E 'FAILED|ERROR|error|Sanitizer' "$log" | head -n 20 | sed 's/^/      /'
        failures+=("$name")
    fi
done

if [ ${#only[@]} -gt 0 ]; then
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ] && [ ${#failures[@]} -eq 0 ]
    exit
fi

end_phase unit
# One fuzzer a core: each is a single process.
FUZZ_JOBS=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}
echo "== fuzz targets (libFuzzer, ASan+UBSan, ${FUZZ_SECONDS}s each, $FUZZ_JOBS at a time)"
fuzz_one() {
    local f=$1 name seeds work log dirs
    name=$(basename "$f")
    seeds=tests/fuzz/corpus/${name#fuzz_}
    work=build/fuzz/work-${name#fuzz_}
    rm -rf "$work" && mkdir -p "$work"
    log=$logdir/$name.log
    dirs=("$work")
    [ -d "$seeds" ] && dirs+=("$seeds")
    "$f" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$logdir/$name-" "${dirs[@]}" >"$log" 2>&1
    echo $? >"$log.rc"
}
fuzzers=()
for f in build/fuzz/fuzz_*; do [ -x "$f" ] && fuzzers+=("$f"); done
for ((i = 0; i < ${#fuzzers[@]}; i += FUZZ_JOBS)); do
    for f in "${fuzzers[@]:i:FUZZ_JOBS}"; do fuzz_one "$f" & done
    wait
done
for f in "${fuzzers[@]}"; do
    name=$(basename "$f")
    log=$logdir/$name.log
    rc=$(cat "$log.rc" 2>/dev/null || echo 1)
    runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
    if [ $rc -eq 0 ]; then
        printf '  %-28s %s runs, no finding\n' "$name" "${runs:-?}"
        passed=$((passed + 1))
    else
        printf '  %-28s FAILED (exit %d) — %s\n' "$name" $rc "$log"
        grep -E 'ERROR|SUMMARY|artifact' "$log" | head -n 10 | sed 's/^/      /'
        failed=$((failed + 1))
        failures+=("$name")
    fi
done

end_phase fuzz
echo "== layout (tools/format.sh --check, the pinned clang-format)"
if tools/format.sh --check >"$logdir/format.log" 2>&1; then
    printf '  %-28s %s\n' layout "$(tail -n 1 "$logdir/format.log")"
    passed=$((passed + 1))
else
    printf '  %-28s FAILED — %s\n' layout "$logdir/format.log"
    tail -n 20 "$logdir/format.log" | sed 's/^/      /'
    failed=$((failed + 1))
    failures+=(layout)
fi

end_phase layout
# Two test files at a time, one a core (pytest-xdist; a file's tests stay
# together, sharing its services); then the tests marked serial, which
# assert on wall-clock time, with nothing beside them. The 25 slowest of
# each part are listed: CI has 90 minutes in all.
PYTEST_JOBS=${PYTEST_JOBS:-$(nproc 2>/dev/null || echo 2)}
pytest_part() { # name, may it select nothing (yes|no), pytest arguments...
    local name=$1 may_be_empty=$2 log=$logdir/$1.log prc summary p f k
    shift 2
    python3 -m pytest -q --durations=25 "$@" tests/integration 2>&1 | tee "$log"
    prc=${PIPESTATUS[0]}
    [ "$prc" -eq 5 ] && [ "$may_be_empty" = yes ] && return  # no test carries the mark
    summary=$(tail -n1 "$log")
    p=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+')
    f=0
    for k in $(grep -oE '[0-9]+ (failed|errors?)' <<<"$summary" | grep -oE '[0-9]+'); do f=$((f + k)); done
    p=${p:-0}
    if [ "$prc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi  # collection errors, no tests run
    passed=$((passed + p)) failed=$((failed + f))
    [ "$prc" -eq 0 ] || failures+=("$name")
}
echo "== integration tests (pytest, $PYTEST_JOBS files at a time)"
pytest_part pytest no -n "$PYTEST_JOBS" --dist loadfile -m "not serial"
echo "== integration tests that time themselves (pytest -m serial, alone)"
pytest_part pytest-serial yes -m serial

end_phase pytest

echo
times=$(printf '%s, ' "${phase_times[@]}")
echo "time: ${times%, }"
[ ${#failures[@]} -eq 0 ] || echo "failed suites: ${failures[*]}"
echo "tests: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ ${#failures[@]} -eq 0 ]
