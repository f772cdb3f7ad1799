#!/bin/bash
# Live migration end to end: a coordinator, `mpirun -np NP mlarun worker
# --parallel LAYOUT` on the tiny model, 8 long streaming requests (greedy and
# seeded), each moved to the other DP group with `mlarun migrate` while it
# runs, half of them moved back. With `--transfer shm|any` (TRANSFER) the
# groups fetch the moved requests' blocks over UCX: passes only if every
# request's tokens equal `mlarun generate` on one rank (no gap, no repeat, no
# changed token), every rank of a new group fetched, none failed. Without
# (off) the new group computes the rows again, by prefill, which sums in
# another order than the decode steps that wrote them: the rows may differ
# in the last bits, and a sampled request may draw another token somewhere
# after the move, as after a preemption. Then the tokens must be one rank's
# up to 8 past the first move (the earlier tokens, the advanced random
# stream, the penalties' history), and every stream whole. One request may
# differ from the reference anywhere (tests/launcher/
# moved_tokens.py says why). In both, every
# move returns 0 once the request runs on its new group, GetStats counts the
# moves per group, a move of an unknown request fails naming it, and no
# cache block stays in use. Leaves no process behind.
#
#   migration_e2e.sh MLARUN SOURCE_DIR LAYOUT NP GROUPS [TRANSFER]
set -u
mlarun=$1 src=$2 layout=$3 np=$4 groups=$5 transfer=${6:-off}
name=migration_e2e
source "$src/scripts/lib/deployment.sh"
start_deployment round_robin --parallel "$layout" --kv-dtype fp32 --cache-bytes 67108864 --transfer "$transfer"
wait_for_groups

# Long answers, so that each request is still running when it moves.
python3 - >"$work/requests.jsonl" <<'PY'
import json, random
rng = random.Random(11)
for i in range(8):
    req = {"prompt_ids": [rng.randrange(2, 512) for _ in range(rng.randrange(2, 30))],
           "max_tokens": 3000, "ignore_eos": True}
    if i % 2:
        req.update(temperature=0.8, top_p=0.9, seed=100 + i)
    print(json.dumps(req))
PY
submits=()
for i in $(seq 0 7); do
  python3 - "$work/requests.jsonl" "$i" >"$work/args$i" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[int(sys.argv[2])])
args = ["--prompt-ids", ",".join(map(str, r["prompt_ids"])), "--max-tokens", str(r["max_tokens"]), "--ignore-eos"]
if "seed" in r:
    args += ["--temperature", str(r["temperature"]), "--top-p", str(r["top_p"]), "--seed", str(r["seed"])]
print(" ".join(args))
PY
  # shellcheck disable=SC2046
  timeout 300 "$mlarun" submit --coordinator "$addr" --request-id "move-$i" --json --timeout 240 \
    $(cat "$work/args$i") >"$work/served$i.json" 2>"$work/submit$i.log" &
  submits+=($!)
done
# Every request routed and streaming.
for _ in $(seq 300); do
  "$mlarun" stats --coordinator "$addr" --json >"$work/stats.json" 2>/dev/null &&
    python3 -c "
import json, sys
d = json.load(open('$work/stats.json'))
sys.exit(0 if sum(int(g.get('requests_in_flight', 0)) for g in d['groups']) == 8 and
         all(int(g.get('tokens_generated', 0)) >= 16 for g in d['groups']) else 1)" && break
  sleep 0.05
done
moves=0
for i in $(seq 0 7); do
  timeout 60 "$mlarun" migrate --coordinator "$addr" --request-id "move-$i" >"$work/move$i.out" 2>&1 ||
    fail "mlarun migrate of move-$i failed: $(cat "$work/move$i.out")"
  moves=$((moves + 1))
done
for i in 0 1 2 3; do
  timeout 60 "$mlarun" migrate --coordinator "$addr" --request-id "move-$i" >>"$work/move$i.out" 2>&1 ||
    fail "moving move-$i back failed: $(cat "$work/move$i.out")"
  moves=$((moves + 1))
done
cat "$work/move0.out"
for p in "${submits[@]}"; do wait "$p" || fail "a submit failed: $(cat "$work"/submit*.log)"; done

"$mlarun" migrate --coordinator "$addr" --request-id move-0 >/dev/null 2>"$work/gone.log" &&
  fail "moving a finished request succeeded"
grep -q "NOT_FOUND.*move-0" "$work/gone.log" || fail "no NOT_FOUND naming the request: $(cat "$work/gone.log")"

timeout 180 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompts "$work/requests.jsonl" --json \
  --kv-dtype fp32 >"$work/local.jsonl" 2>/dev/null || fail "local generate failed"
wait_caches_empty || fail "cache blocks still in use: $(cat "$work/stats.json")"
python3 - "$work" "$groups" "$moves" "$transfer" "$src/tests/launcher" <<'PY' || fail "migrated results differ from one rank"
import json, sys
work, groups, moves, transfer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, sys.argv[5])
import moved_tokens
differed = moved_tokens.check(work, f"{work}/local.jsonl", None if transfer != "off" else 8)
d = json.load(open(f"{work}/stats.json"))
c = d["coordinator"]
assert int(c["requests_migrated"]) == moves and int(c["migrations_failed"]) == 0, c
assert int(c["requests_completed"]) == 8, c
ins = sum(int(g["migrated_in"]) for g in d["groups"])
outs = sum(int(g["migrated_out"]) for g in d["groups"])
assert ins == outs == moves, (ins, outs, moves)
assert all(int(g["migrated_in"]) > 0 for g in d["groups"]), d["groups"]
ranks = d["ranks"]
fetches = [int(r.get("transfer_fetches", 0)) for r in ranks]
moved = sum(int(r.get("transfer_bytes", 0)) for r in ranks)
failures = sum(int(r.get("transfer_failures", 0)) for r in ranks)
if transfer == "off":
    assert sum(fetches) == 0 and all(r.get("transfer_path", "") == "" for r in ranks), ranks
    how = "computed again on the new group"
else:
    assert all(r.get("transfer_path") == transfer for r in ranks), [r.get("transfer_path") for r in ranks]
    assert failures == 0, f"{failures} fetches failed"
    # A move back finds the blocks it left behind in the prefix cache: every
    # first move fetches on every rank of its new group.
    assert all(f > 0 for f in fetches), f"a rank fetched nothing: {fetches}"
    how = f"{sum(fetches)} fetches, {moved} bytes over UCX ({transfer})"
same = "equal one rank's" if transfer != "off" else "equal one rank's to 8 past the first move"
if differed:
    same += f" (request {differed[0]} differed at token {differed[1]}, first move at {differed[2]})"
print(f"8 requests of 3000 tokens, {moves} moves over {groups} DP groups ({how}): tokens {same}")
PY
echo "migration_e2e $layout: PASS"
