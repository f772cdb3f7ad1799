#!/bin/bash
# Predicted vs measured memory on a prefill/decode split: a coordinator and
# two mpirun jobs on the tiny model, `mlarun worker --role prefill` and
# `--role decode`, each `-np 2 --parallel dp=2 --memory-gib G` (each its own
# MPI world of 2 ranks), 8 requests handed from prefill to decode groups.
# Passes only if
#  * `mlarun memory --measure` reports agreement on every rank of both jobs
#    and names each job's role;
#  * `mlarun memory --world 4 --layouts p2+d2` predicts, for each job, what
#    that job's ranks report through GetStats (weights by category, cache
#    blocks);
#  * independently of both, every rank's MoE bytes equal this script's
#    arithmetic from the tiny model's shapes over the job's 2 ranks (not
#    the 4 of the whole deployment);
#  * a split whose ranks do not add up to --world exits 2 naming both.
#
#   memory_measure_split.sh MLARUN SOURCE_DIR
set -u
mlarun=$1 src=$2
np=2 groups=4
name=memory_measure_split
source "$src/scripts/lib/deployment.sh"
logs=("$work/coord.log" "$work/prefill.log" "$work/decode.log")
model="$src/configs/models/tiny.yaml"
gib=0.0625

"$mlarun" memory --model "$model" --world 4 --layouts p2+d4 >/dev/null 2>"$work/bad.log"
[ $? = 2 ] || fail "a 6-rank split on --world 4 did not exit 2"
grep -q "'p2+d4' has 6 ranks .* but --world is 4" "$work/bad.log" || fail "the error: $(cat "$work/bad.log")"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
addr=127.0.0.1:$port
"$mlarun" coordinator --listen "$addr" --policy least_loaded 2>"$work/coord.log" &
pids+=($!)
for role in prefill decode; do
  mpirun --oversubscribe --mca pml ob1 --mca btl self,vader,tcp -np $np \
    "$mlarun" worker --coordinator "$addr" --model "$model" --threads 1 --parallel dp=2 --memory-gib $gib \
    --block-size 16 --role "$role" --transfer shm 2>"$work/$role.log" &
  pids+=($!)
done
wait_for_groups

python3 - >"$work/requests.jsonl" <<'PY'
import json, random
rng = random.Random(5)
for i in range(8):
    print(json.dumps({"prompt_ids": [rng.randrange(2, 512) for _ in range(rng.randrange(20, 120))],
                      "max_tokens": rng.randrange(5, 30), "ignore_eos": True}))
PY
timeout 120 "$mlarun" submit --coordinator "$addr" --prompts "$work/requests.jsonl" --concurrency 8 --json \
  >"$work/served.jsonl" 2>"$work/submit.log" || fail "submit failed: $(tail -3 "$work/submit.log")"
wait_caches_empty || fail "cache blocks still in use: $(cat "$work/stats.json")"

timeout 60 "$mlarun" memory --measure --coordinator "$addr" --json >"$work/measure.json" 2>"$work/measure.log" ||
  fail "mlarun memory --measure: $(cat "$work/measure.log") $(head -c 3000 "$work/measure.json")"
"$mlarun" memory --measure --coordinator "$addr" >"$work/measure.txt" 2>&1 || fail "measure (text) failed"
for role in prefill decode; do
  grep -q "($role)" "$work/measure.txt" || fail "the $role job is not named: $(head -5 "$work/measure.txt")"
done
"$mlarun" memory --model "$model" --world 4 --layouts p2+d2 --hbm-gib $gib --block-size 16 --json \
  >"$work/predicted.json" || fail "mlarun memory --layouts p2+d2 failed"
"$mlarun" stats --coordinator "$addr" --json >"$work/stats.json" || fail "stats failed"

python3 - "$work" <<'PY' || fail "the split's measured memory differs"
import json, sys
work = sys.argv[1]
m = json.load(open(f"{work}/measure.json"))
assert m["agree"] is True, m
assert sorted(j["role"] for j in m["jobs"]) == ["decode", "prefill"], [j["role"] for j in m["jobs"]]
d = json.load(open(f"{work}/stats.json"))
role_of = {g["worker_id"]: g["role"] for g in d["groups"]}
assert sorted(role_of.values()) == ["decode", "prefill"], d["groups"]
moved = sum(int(g.get("migrated_in", 0)) for g in d["groups"] if g["role"] == "decode")
assert moved == 8, ("requests handed to the decode groups", moved)
split = json.load(open(f"{work}/predicted.json"))["disaggregated"][0]
assert split["name"] == "p:dp2+d:dp2" and split["transfer_staging_bytes_per_rank"] == 0, split
jobs = {j["role"]: j["per_rank"] for j in split["jobs"]}
# tiny.yaml: hidden 64, fp32 weights, 4 layers (the first dense), 8 routed
# experts and 1 shared, each 32 wide, a router [8, 64] and a bias [8].
H, f, experts = 64, 4, 8
mlp = lambda width: 3 * width * H * f
moe = lambda w: 3 * ((experts // w) * mlp(32) + mlp(32 // w) + experts * H * f + experts * f)
ranks = d["ranks"]
assert len(ranks) == 4, ranks
for k in ranks:
    role = role_of[k["worker_id"]]
    want = jobs[role]
    assert int(k["moe_weight_bytes"]) == moe(2) != moe(4), (role, k["rank"], k["moe_weight_bytes"], moe(2))
    assert int(k["moe_weight_bytes"]) == want["weights"]["moe"], (role, k["rank"])
    assert int(k["dense_mlp_weight_bytes"]) == want["weights"]["dense_mlp"] == mlp(128 // 2), (role, k["rank"])
    assert int(k["attention_weight_bytes"]) == want["weights"]["attention_replicated"] + want["weights"]["attention_split"]
    assert int(k["embedding_head_weight_bytes"]) == want["weights"]["embedding_and_head"]
    assert int(k["cache_blocks_total"]) == want["cache_blocks"], (role, k["rank"], k["cache_blocks_total"], want)
    assert int(k["workspace_bytes"]) == want["prefill_workspace_bytes"], (role, k["rank"])
print(f"memory_measure_split: p:dp2+d:dp2: MoE {moe(2)} B per rank (over 2 ranks, not {moe(4)} over 4), "
      f"{jobs['decode']['cache_blocks']} cache blocks per rank, both jobs as predicted")
PY
echo "memory_measure_split: PASS"
exit 0
