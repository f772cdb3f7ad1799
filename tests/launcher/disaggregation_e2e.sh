#!/bin/bash
# Prefill/decode disaggregation end to end: a coordinator and two mpirun
# jobs on the tiny model, `mlarun worker --role prefill` and `--role decode`
# (each --parallel dp=1, --transfer TRANSFER), 16 concurrent requests,
# greedy and seeded. Passes only if every request's tokens equal `mlarun
# generate` on one rank, the prefill group took every request and handed
# each to the decode group after its first token (GetStats: routed,
# migrated_in / migrated_out, roles), the decode group fetched their blocks
# over UCX with no failure (TRANSFER shm or any; off: computed), and no
# cache block stays in use. Leaves no process behind.
#
#   disaggregation_e2e.sh MLARUN SOURCE_DIR TRANSFER
set -u
mlarun=$1 src=$2 transfer=$3
np=1 groups=2
name=disaggregation_e2e
source "$src/scripts/lib/deployment.sh"
logs=("$work/coord.log" "$work/prefill.log" "$work/decode.log")
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
addr=127.0.0.1:$port
"$mlarun" coordinator --listen "$addr" --policy least_loaded 2>"$work/coord.log" &
pids+=($!)
for role in prefill decode; do
  mpirun --oversubscribe --mca pml ob1 --mca btl self,vader,tcp -np 1 \
    "$mlarun" worker --coordinator "$addr" --model "$src/configs/models/tiny.yaml" --threads 1 --kv-dtype fp32 \
    --cache-bytes 67108864 --role "$role" --transfer "$transfer" 2>"$work/$role.log" &
  pids+=($!)
done
wait_for_groups

python3 - >"$work/requests.jsonl" <<'PY'
import json, random
rng = random.Random(3)
for i in range(16):
    req = {"prompt_ids": [rng.randrange(2, 512) for _ in range(rng.randrange(20, 300))],
           "max_tokens": rng.randrange(40, 200), "ignore_eos": True}
    if i % 2:
        req.update(temperature=0.7, top_p=0.95, seed=i)
    print(json.dumps(req))
PY
timeout 180 "$mlarun" submit --coordinator "$addr" --prompts "$work/requests.jsonl" --concurrency 16 --json \
  >"$work/served.jsonl" 2>"$work/submit.log" || fail "submit failed: $(tail -3 "$work/submit.log")"
timeout 180 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompts "$work/requests.jsonl" --json \
  --kv-dtype fp32 >"$work/local.jsonl" 2>/dev/null || fail "local generate failed"
wait_caches_empty || fail "cache blocks still in use: $(cat "$work/stats.json")"
python3 - "$work" "$transfer" <<'PY' || fail "disaggregated results"
import json, sys
work, transfer = sys.argv[1], sys.argv[2]
served = [json.loads(l) for l in open(f"{work}/served.jsonl")]
local = [json.loads(l) for l in open(f"{work}/local.jsonl")]
assert len(served) == len(local) == 16, (len(served), len(local))
for i, (s, l) in enumerate(zip(served, local)):
    assert "error" not in s, (i, s)
    assert s["tokens"] == l["tokens"], (i, "tokens differ from one rank's")
d = json.load(open(f"{work}/stats.json"))
roles = {g["role"]: g for g in d["groups"]}
assert set(roles) == {"prefill", "decode"}, d["groups"]
p, q = roles["prefill"], roles["decode"]
assert int(p["requests_routed"]) == 16 and int(p["migrated_out"]) == 16, p
assert int(q["migrated_in"]) == 16 and int(q["requests_completed"]) == 16, q
fetches = sum(int(r.get("transfer_fetches", 0)) for r in d["ranks"])
failures = sum(int(r.get("transfer_failures", 0)) for r in d["ranks"])
if transfer == "off":
    assert fetches == 0, d["ranks"]
else:
    assert fetches == 16 and failures == 0, (fetches, failures)
print(f"16 requests, prefill group -> decode group ({fetches} fetches over {transfer}): tokens equal one rank's")
PY
echo "disaggregation_e2e $transfer: PASS"
