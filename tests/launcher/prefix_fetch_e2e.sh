#!/bin/bash
# Prefix fetch between DP groups end to end: a coordinator routing round
# robin with --prefix-fetch-min-tokens 64, `mpirun -np NP mlarun worker
# --parallel LAYOUT --transfer TRANSFER` on the tiny model, and 8 requests
# one after another over two 400-token prefixes (X X Y Y X Y X Y, greedy
# and seeded): the second X and the second Y go to the other group than
# the first ones, which caches their prefix, so it fetches those 6 blocks
# of 64 from that group's pool instead of computing them. Passes only if every request's
# tokens equal `mlarun generate` on one rank, the coordinator counts
# exactly those 2 fetches of 384 tokens, every rank of that group fetched
# each once with no failure, and no cache block stays in use (the pinned
# prefixes were released). Leaves no process behind.
#
#   prefix_fetch_e2e.sh MLARUN SOURCE_DIR LAYOUT NP TRANSFER
set -u
mlarun=$1 src=$2 layout=$3 np=$4 transfer=$5
groups=2
name=prefix_fetch_e2e
source "$src/scripts/lib/deployment.sh"
coordinator_flags=(--prefix-fetch-min-tokens 64)
start_deployment round_robin --parallel "$layout" --kv-dtype fp32 --cache-bytes 67108864 --transfer "$transfer"
wait_for_groups

python3 - >"$work/requests.jsonl" <<'PY'
import json, random
rng = random.Random(5)
prefix = {k: [rng.randrange(2, 512) for _ in range(400)] for k in "XY"}
for i, k in enumerate("XXYYXYXY"):
    req = {"prompt_ids": prefix[k] + [rng.randrange(2, 512) for _ in range(rng.randrange(3, 40))],
           "max_tokens": rng.randrange(20, 60), "ignore_eos": True}
    if i % 2:
        req.update(temperature=0.7, top_p=0.95, seed=i)
    print(json.dumps(req))
PY
timeout 180 "$mlarun" submit --coordinator "$addr" --prompts "$work/requests.jsonl" --concurrency 1 --json \
  >"$work/served.jsonl" 2>"$work/submit.log" || fail "submit failed: $(tail -3 "$work/submit.log")"
timeout 180 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompts "$work/requests.jsonl" --json \
  --kv-dtype fp32 >"$work/local.jsonl" 2>/dev/null || fail "local generate failed"
wait_caches_empty || fail "cache blocks still in use: $(cat "$work/stats.json")"
python3 - "$work" "$np" <<'PY' || fail "prefix fetch results"
import json, sys
work, np = sys.argv[1], int(sys.argv[2])
served = [json.loads(l) for l in open(f"{work}/served.jsonl")]
local = [json.loads(l) for l in open(f"{work}/local.jsonl")]
assert len(served) == len(local) == 8, (len(served), len(local))
for i, (s, l) in enumerate(zip(served, local)):
    assert "error" not in s, (i, s)
    assert s["tokens"] == l["tokens"], (i, "tokens differ from one rank's")
d = json.load(open(f"{work}/stats.json"))
c = d["coordinator"]
assert int(c.get("prefix_fetches", 0)) == 2 and int(c.get("prefix_fetch_tokens", 0)) == 2 * 384, c
by_group = {}
for r in d["ranks"]:
    by_group.setdefault(int(r.get("dp_group", 0)), []).append(r)
tp = np // 2
# Round robin starts at the group that registered first: it computes, the
# other fetches.
fetched = sorted(g for g, ranks in by_group.items() if any(int(r.get("transfer_fetches", 0)) for r in ranks))
assert len(fetched) == 1, d["ranks"]
for g, ranks in by_group.items():
    assert len(ranks) == tp, ranks
    for r in ranks:
        assert int(r.get("transfer_fetches", 0)) == (2 if g == fetched[0] else 0), (g, r)
        assert int(r.get("transfer_failures", 0)) == 0, (g, r)
print(f"8 requests, 2 prefixes of 384 tokens fetched by group {fetched[0]} ({tp} rank(s) each): tokens equal one rank's")
PY
echo "prefix_fetch_e2e $layout $transfer: PASS"
