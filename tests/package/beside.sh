#!/usr/bin/env bash
# Runs a command (make test: the suite) with the package check (check.sh) beside it at a lower
# priority: the check spends much of its minutes waiting on pip and on one core, which the
# suite's two workers leave idle; at nice 10 it takes little from them otherwise. The check's
# output follows the command's; the exit status is the command's, else the check's.
#
#   tests/package/beside.sh PYTHON COMMAND...
set -uo pipefail
python=$1
shift
log=$(mktemp "${TMPDIR:-/tmp}/kvchat-package-check-XXXXXX.log")
trap 'rm -f "$log"' EXIT
nice -n 10 bash "$(dirname "$0")/check.sh" "$python" >"$log" 2>&1 &
check=$!
"$@"
status=$?
wait "$check"
checked=$?
printf '\n== the package check, run beside the tests (tests/package/check.sh)\n'
cat "$log"
[ "$status" -ne 0 ] && exit "$status"
exit "$checked"
