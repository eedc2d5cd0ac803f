#!/usr/bin/env bash
# make check's checks, after its build: the layout (tools/format.sh
# --check), the names (tools/check_names.py) and the given cmocka suites
# (tools/run_tests.sh --only). Each runs whatever the others found; the last
# line sums them, and the exit status is 1 if any failed.
#
# usage: tools/check.sh SUITE...
set -uo pipefail
cd "$(dirname "$0")/.."

failed=()
echo "== layout (tools/format.sh --check)"
tools/format.sh --check || failed+=(layout)
echo "== names (tools/check_names.py)"
python3 tools/check_names.py || failed+=(names)
echo "== unit suites (ASan+UBSan)"
tools/run_tests.sh --only "$@" || failed+=(unit)
if [ ${#failed[@]} -eq 0 ]; then
    echo "check: layout, names and $# suites passed"
else
    echo "check: FAILED: ${failed[*]}"
    exit 1
fi
