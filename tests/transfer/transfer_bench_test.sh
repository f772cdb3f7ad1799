#!/bin/bash
# `mlarun bench transfer` under mpirun on 2 ranks, on both paths: each size
# fetched, checked byte for byte by the program, and reported with the
# whole blocks it rounds to (this script derives them from the block's
# 64 x 576 bf16 values), one get per fetch (per block with --scattered),
# positive times. Then the refusals: 3 ranks and an unknown path end the job
# non-zero, within the time limit, with the message.
# Usage: transfer_bench_test.sh <mpirun and its options...> -- <mlarun>
set -u
mpirun=()
while [ "$1" != "--" ]; do mpirun+=("$1"); shift; done
shift
mlarun=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "transfer_bench_test: FAIL: $*"; failures=$((failures + 1)); }

block=$((64 * 576 * 2))
for args in "--path any" "--path shm" "--path shm --scattered"; do
  # shellcheck disable=SC2086
  if ! timeout -k 5 90 "${mpirun[@]}" -np 2 "$mlarun" bench transfer --sizes 1000,$((3 * block)) --repetitions 2 \
      $args --json >"$work/out.json" 2>"$work/err"; then
    fail "bench transfer $args failed:"; cat "$work/err"; continue
  fi
  python3 - "$work/out.json" "$block" "$args" <<'PY' || fail "bench transfer $args: the JSON is off"
import json, sys
doc = json.load(open(sys.argv[1]))
block, scattered = int(sys.argv[2]), "--scattered" in sys.argv[3]
rows = doc["rows"]
assert doc["block_bytes"] == block, doc["block_bytes"]
assert [r["blocks"] for r in rows] == [1, 3], rows
assert [r["bytes"] for r in rows] == [block, 3 * block], rows
assert [r["gets_per_fetch"] for r in rows] == ([1, 3] if scattered else [1, 1]), rows
assert all(r["median_us"] > 0 and r["gb_per_s"] > 0 for r in rows), rows
assert doc["path"] == sys.argv[3].split()[1], doc["path"]
PY
done

timeout -k 5 60 "${mpirun[@]}" -np 3 "$mlarun" bench transfer --repetitions 1 >"$work/out" 2>&1
rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "3 ranks: exit $rc"
grep -q "runs on 2 ranks (mpirun -np 2), not 3" "$work/out" || fail "3 ranks: no message"
timeout -k 5 60 "${mpirun[@]}" -np 2 "$mlarun" bench transfer --path rdma >"$work/out" 2>&1
rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "--path rdma: exit $rc"
grep -q "path must be any or shm, got 'rdma'" "$work/out" || fail "--path rdma: no message"

[ "$failures" -eq 0 ] && echo "transfer_bench_test: ok"
exit $((failures > 0))
