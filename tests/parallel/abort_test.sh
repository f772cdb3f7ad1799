#!/bin/sh
# Runs an MPI job (the arguments: mpirun ... program ...) and passes only if
# the job exits non-zero by itself within the time limit AND the expected
# message (the extended regular expression MLARUN_EXPECT; default: the
# aborting rank's message of abort_main) reached the output. A hang (the job killed by `timeout`) or
# a zero exit fails. The limit is MLARUN_ABORT_TIMEOUT_S (default 45 s, under
# ctest's 60 s TIMEOUT so this script reports the hang itself).
limit=${MLARUN_ABORT_TIMEOUT_S:-45}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
start=$(date +%s)
timeout -k 5 "$limit" "$@" >"$out" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$out"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "abort_test: FAIL: the job hung and was killed after ${limit} s"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  echo "abort_test: FAIL: the job exited 0"
  exit 1
fi
expect=${MLARUN_EXPECT:-"mlarun: rank 1 on .*: simulated start-up failure: bad shard"}
if ! grep -Eq "$expect" "$out"; then
  echo "abort_test: FAIL: the abort message is missing from the output"
  exit 1
fi
echo "abort_test: PASS: the job exited $rc after ${elapsed} s with the message"
exit 0
