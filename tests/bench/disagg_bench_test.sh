#!/bin/bash
# mlarun bench disagg --quick --json: 4 mixed groups against 2 prefill + 2
# decode groups, on the prefill-heavy and the short workload. Passes only if
# the document has a mixed and a disagg row and a ratio for each workload,
# every run verified all its requests, both layouts saw the same requests,
# the mixed layout moved nothing, and in the disaggregated one every request
# moved from a prefill group to a decode group with its blocks (the groups'
# migrated_out / migrated_in, the decode ranks' fetches). Then bad options
# exit 2 naming them.
#   disagg_bench_test.sh MLARUN
set -eu -o pipefail
mlarun=$1
out=$(mktemp) table=$(mktemp)
trap 'rm -f "$out" "$table"' EXIT
timeout 120 "$mlarun" bench disagg --quick --json >"$out" 2>"$table" || { cat "$table" "$out"; exit 1; }
cat "$table"
python3 - "$out" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["benchmark"] == "disagg" and doc["all_verified"] is True, doc.get("all_verified")
cfg = doc["config"]
assert cfg["quick"] is True and cfg["rounds"] == 1, cfg
assert (cfg["groups"], cfg["prefill_groups"], cfg["decode_groups"]) == (4, 2, 2), cfg
workloads = ["prefill-heavy", "short"]
assert sorted((r["workload"], r["layout"]) for r in doc["rows"]) == \
    sorted((w, l) for w in workloads for l in ("mixed", "disagg")), doc["rows"]
for r in doc["rows"]:
    assert r["verified"] is True and r["requests"] > 0, r
    assert r["decode_tokens_per_s"]["median"] > 0, r
    assert 0 < r["ttft_p50_ms"]["median"] <= r["ttft_p99_ms"]["median"], r
    assert 0 < r["itl_p50_ms"]["median"] <= r["itl_p99_ms"]["median"], r
assert sorted(r["workload"] for r in doc["ratios"]) == workloads, doc["ratios"]
runs = doc["runs"]
assert len(runs) == 2 * len(workloads), len(runs)
for r in runs:
    assert r["verified"] is True and r["failed"] == 0 and r["first_error"] is None, r
    assert r["tokens"] > r["requests"] > 0, r
    assert r["migrations_failed"] == 0, r
moved = 0
for w in workloads:
    mixed, disagg = ([r for r in runs if r["workload"] == w and r["layout"] == l][0] for l in ("mixed", "disagg"))
    # The same requests for both layouts.
    assert mixed["requests"] == disagg["requests"] and mixed["tokens"] == disagg["tokens"], (mixed, disagg)
    assert mixed["moves"] == 0 and mixed["block_moves"] == 0 and mixed["requests_migrated"] == 0, mixed
    n = disagg["requests"]
    assert disagg["moves"] == n and disagg["requests_migrated"] == n, disagg
    assert disagg["prefill_migrated_out"] == n and disagg["decode_migrated_in"] == n, disagg
    assert disagg["block_moves"] == n and disagg["transfer_bytes"] > 0, disagg
    moved += n
print(f"disagg bench: {len(runs)} runs verified, {moved} requests moved prefill -> decode with their blocks")
PY
# Bad options: exit 2, naming them.
for bad in "--rate 0:--rate" "--groups 1:--groups" "--long-prompt-min 5000:--long-prompt"; do
  args=${bad%%:*} name=${bad##*:}
  rc=0
  # shellcheck disable=SC2086
  "$mlarun" bench disagg $args >"$out" 2>&1 || rc=$?
  if [ "$rc" != 2 ] || ! grep -q -- "$name" "$out"; then
    echo "$args: exit $rc"
    cat "$out"
    exit 1
  fi
  echo "disagg bench: $args refused"
done
