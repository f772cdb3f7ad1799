#!/bin/bash
# mlarun bench rebalance --quick --json on a workload built to be skewed:
# round_robin routing, which ignores what its groups run, and 30% long
# requests, so long ones pile up on some groups. Passes only if the document
# has an off and an on row and a ratio for each group count, every run
# verified all its requests, no run with rebalancing off moved anything,
# and the runs with it on moved at least one request. Then a bad option
# exits 2 naming it.
#   rebalance_bench_test.sh MLARUN
set -eu -o pipefail
mlarun=$1
out=$(mktemp) table=$(mktemp)
trap 'rm -f "$out" "$table"' EXIT
timeout 120 "$mlarun" bench rebalance --quick --json --policy round_robin --long-fraction 0.3 >"$out" 2>"$table" ||
  { cat "$table" "$out"; exit 1; }
cat "$table"
python3 - "$out" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["benchmark"] == "rebalance" and doc["all_verified"] is True, doc.get("all_verified")
cfg = doc["config"]
assert cfg["policy"] == "round_robin" and cfg["quick"] is True and cfg["rounds"] == 1, cfg
groups = cfg["groups"]
assert groups == [2, 4], groups
assert sorted((r["groups"], r["rebalance"]) for r in doc["rows"]) == \
    sorted((g, m) for g in groups for m in ("off", "on")), doc["rows"]
for r in doc["rows"]:
    assert r["verified"] is True and r["requests"] > 0, r
    assert r["decode_tokens_per_s"]["median"] > 0, r
    assert 0 < r["balance"]["median"] <= 1, r
    assert 0 < r["itl_p50_ms"]["median"] <= r["itl_p99_ms"]["median"], r
assert sorted(r["groups"] for r in doc["ratios"]) == groups, doc["ratios"]
runs = doc["runs"]
assert len(runs) == 2 * len(groups), len(runs)
for r in runs:
    assert r["verified"] is True and r["failed"] == 0 and r["first_error"] is None, r
    assert r["tokens"] > r["requests"] > 0, r
    assert r["migrations_failed"] == 0, r
# The same workload for off and on.
for g in groups:
    off, on = ([r for r in runs if r["groups"] == g and r["rebalance"] == m][0] for m in ("off", "on"))
    assert off["requests"] == on["requests"] and off["tokens"] == on["tokens"], (off, on)
    assert off["rebalance_moves"] == 0 and off["requests_migrated"] == 0, off
moves = sum(r["rebalance_moves"] for r in runs if r["rebalance"] == "on")
assert moves >= 1, "rebalancing on moved nothing on the skewed workload"
print(f"rebalance bench: {len(runs)} runs verified, {moves} moves with rebalancing on")
PY
# A bad option: exit 2, naming it.
rc=0
"$mlarun" bench rebalance --rate 0 >"$out" 2>&1 || rc=$?
[ "$rc" = 2 ] && grep -q -- "--rate" "$out" || { echo "--rate 0: exit $rc"; cat "$out"; exit 1; }
echo "rebalance bench: --rate 0 refused"
