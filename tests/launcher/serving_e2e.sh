#!/bin/bash
# End to end: a coordinator, `mpirun -np NP mlarun worker --parallel LAYOUT` on
# the tiny model, 64 concurrent streaming clients. Passes only if every request
# completes once, its tokens equal `mlarun generate` on one rank for the same
# prompt and seed, every DP group served some, a malformed request is refused
# while the service keeps serving, and a request cancelled mid-stream (its
# deadline) leaves no cache block in use. Leaves no process behind.
#
#   serving_e2e.sh MLARUN SOURCE_DIR LAYOUT NP GROUPS
set -u
mlarun=$1 src=$2 layout=$3 np=$4 groups=$5
name=serving_e2e
source "$src/scripts/lib/deployment.sh"
start_deployment round_robin --parallel "$layout" --kv-dtype fp32 --cache-bytes 67108864
wait_for_groups

# 64 requests: different prompts, lengths, seeds; greedy and sampled.
python3 - >"$work/requests.jsonl" <<'PY'
import json, random
rng = random.Random(5)
for i in range(64):
    req = {"prompt_ids": [rng.randrange(2, 512) for _ in range(rng.randrange(1, 40))],
           "max_tokens": rng.randrange(1, 12), "ignore_eos": i % 3 != 0}
    if i % 2:
        req.update(temperature=0.8, top_p=0.9, seed=i)
    print(json.dumps(req))
PY
timeout 180 "$mlarun" submit --coordinator "$addr" --prompts "$work/requests.jsonl" --concurrency 64 --json \
  >"$work/served.jsonl" 2>"$work/submit.log" || fail "submit failed: $(tail -3 "$work/submit.log")"
timeout 180 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompts "$work/requests.jsonl" --json \
  --kv-dtype fp32 >"$work/local.jsonl" 2>/dev/null || fail "local generate failed"
python3 - "$work" "$groups" <<'PY' || fail "served results differ from one rank"
import json, sys
work, groups = sys.argv[1], int(sys.argv[2])
served = [json.loads(l) for l in open(f"{work}/served.jsonl")]
local = [json.loads(l) for l in open(f"{work}/local.jsonl")]
assert len(served) == len(local) == 64, (len(served), len(local))
for i, (s, l) in enumerate(zip(served, local)):
    assert "error" not in s, (i, s)
    assert s["tokens"] == l["tokens"], (i, s["tokens"], l["tokens"])
    assert s["finish_reason"] == l["finish_reason"], (i, s, l)
used = {s["dp_group"] for s in served}
assert used == set(range(groups)), f"groups that served: {sorted(used)}"
print("64 requests: tokens equal one rank's; groups served:", sorted(used))
PY
"$mlarun" stats --coordinator "$addr" --json >"$work/stats.json" || fail "stats failed"
python3 - "$work" <<'PY' || fail "coordinator counters"
import json, sys
d = json.load(open(f"{sys.argv[1]}/stats.json"))
c = d["coordinator"]
completed = int(c.get("requests_completed", 0))
assert completed == 64, c
routed = sum(int(g.get("requests_routed", 0)) for g in d["groups"])
assert routed == 64, f"routed {routed}: a request was lost or duplicated"
PY

# A malformed request is refused; the service keeps serving.
"$mlarun" submit --coordinator "$addr" --prompt-ids 3,4 --temperature -1 >/dev/null 2>"$work/bad.log" &&
  fail "a negative temperature was accepted"
grep -q "INVALID_ARGUMENT" "$work/bad.log" || fail "no INVALID_ARGUMENT: $(cat "$work/bad.log")"
"$mlarun" submit --coordinator "$addr" --prompt-ids 3,4 --max-tokens 2 --json >/dev/null 2>&1 ||
  fail "the service stopped serving after a bad request"

# A request cancelled mid-stream (its deadline passes) frees its blocks. It
# must end on its deadline (DEADLINE_EXCEEDED, not some other error) after
# streaming at least one token, so the cancellation came mid-stream.
"$mlarun" submit --coordinator "$addr" --prompt-ids 5,6,7 --max-tokens 3000 --ignore-eos --timeout 0.5 \
  --stream --json >"$work/cancel.out" 2>"$work/cancel.log" && fail "a 3000-token request finished within 0.5 s"
grep -q "DEADLINE_EXCEEDED" "$work/cancel.log" || fail "the cancelled request did not end on its deadline: $(cat "$work/cancel.log")"
python3 - "$work/cancel.out" <<'PY' || fail "no token streamed before the deadline: $(head -c 300 "$work/cancel.out")"
import json, sys
toks = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert toks, "empty stream"
assert [t["index"] for t in toks] == list(range(len(toks))), toks[:5]
assert len(toks) < 3000, len(toks)
PY
wait_caches_empty || fail "cache blocks still in use after cancellation: $(cat "$work/stats.json")"
echo "serving_e2e: PASS ($layout)"
exit 0
