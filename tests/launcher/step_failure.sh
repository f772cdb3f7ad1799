#!/bin/bash
# Live failures: a coordinator and `mpirun -np 4 mlarun worker --parallel dp=4`
# on the tiny model.
#
#   step_failure.sh MLARUN SOURCE_DIR failed_step
#     The worker runs with fault injection on rank 2 (--fail-forward-call
#     3@2: the fourth model step fails there). One request first takes steps 0
#     and 1; then a batch of 8 long ones starts at step 2. Passes only if the
#     first request completes, the clients whose requests were in step 3 (as
#     many as the worker logs, at least one) get INTERNAL with a message naming
#     rank 2 and the failure, every other request completes with the tokens of
#     `mlarun generate` on one rank, a second batch afterwards completes the
#     same way on all four groups, no cache block stays in use, the
#     coordinator's counters agree, and every rank logged its CPU once and
#     reports it in GetStats.
#
#   step_failure.sh MLARUN SOURCE_DIR killed_rank
#     Four clients stream long answers, one per group; rank 2 is killed
#     (SIGKILL). Passes only if every client gets an error within a few
#     seconds that names the group that went away (not a wait for its 60 s
#     deadline), and a request sent afterwards is told which group went away
#     instead of only "no DP group registered".
#
# Every wait is bounded (timeout, loops); leaves no process behind.
set -u
mlarun=$1 src=$2 mode=$3
np=4 groups=4
name=step_failure_$mode
source "$src/scripts/lib/deployment.sh"

# Seconds since the epoch, with fractions.
now() { python3 -c 'import time; print(time.time())'; }

failed_step() {
  start_deployment round_robin --parallel dp=4 --kv-dtype fp32 --cache-bytes 67108864 --fail-forward-call 3@2
  wait_for_groups
  # "before" runs alone in steps 0 and 1 (a prompt, then one decode); the
  # first batch starts at step 2 and runs 40 steps, so step 3 has the part of
  # it routed by then; the second batch is sent after.
  python3 - "$work" <<'PY'
import json, random, sys
rng = random.Random(23)
for name, n, max_tokens in (("before", 1, 2), ("first", 8, 40), ("second", 16, 6)):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for i in range(n):
            req = {"prompt_ids": [rng.randrange(2, 512) for _ in range(rng.randrange(3, 30))],
                   "max_tokens": max_tokens, "ignore_eos": True}
            if i % 2:
                req.update(temperature=0.8, top_p=0.9, seed=i)
            print(json.dumps(req), file=f)
PY
  timeout 60 "$mlarun" submit --coordinator "$addr" --prompts "$work/before.jsonl" --json \
    >"$work/before.out" 2>"$work/before.log" || fail "the request before the failure failed: $(tr '\r' '\n' <"$work/before.log" | tail -3)"
  # Some of the first batch fail, so submit exits 1 there.
  timeout 60 "$mlarun" submit --coordinator "$addr" --prompts "$work/first.jsonl" --concurrency 8 --json \
    >"$work/first.out" 2>"$work/first.log"
  [ $? = 124 ] && fail "the first batch did not finish within 60 s"
  timeout 60 "$mlarun" submit --coordinator "$addr" --prompts "$work/second.jsonl" --concurrency 16 --json \
    >"$work/second.out" 2>"$work/second.log" || fail "the second batch failed: $(tr '\r' '\n' <"$work/second.log" | tail -3)"
  cat "$work/before.jsonl" "$work/first.jsonl" "$work/second.jsonl" >"$work/all.jsonl"
  timeout 120 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompts "$work/all.jsonl" --json \
    --kv-dtype fp32 >"$work/local.jsonl" 2>/dev/null || fail "local generate failed"
  python3 - "$work" <<'PY' || fail "results"
import json, re, sys
work = sys.argv[1]
before = [json.loads(l) for l in open(f"{work}/before.out")]
first = [json.loads(l) for l in open(f"{work}/first.out")]
second = [json.loads(l) for l in open(f"{work}/second.out")]
local = [json.loads(l) for l in open(f"{work}/local.jsonl")]
assert len(before) == 1 and len(first) == 8 and len(second) == 16 and len(local) == 25, (len(first), len(second), len(local))
assert before[0]["tokens"] == local[0]["tokens"], (before, local[0])
local = local[1:]
# How many requests each group's leader says the failed step ended.
logged = sum(int(m) for m in re.findall(r"a step failed; its (\d+) requests end", open(f"{work}/worker.log").read()))
failed = 0
for i, r in enumerate(first):
    if "error" in r:
        e = r["error"]
        assert e.startswith("INTERNAL: "), (i, e)
        assert "step failed on rank 2 (" in e and "injected failure (fail_forward_call 3)" in e, (i, e)
        failed += 1
    else:
        assert r["tokens"] == local[i]["tokens"], (i, r, local[i])
assert failed >= 1, "no request was in the failing step"
assert failed == logged, f"{failed} clients got the error, the worker ended {logged} requests"
for i, r in enumerate(second):
    assert "error" not in r, (i, r)
    assert r["tokens"] == local[8 + i]["tokens"], (i, r, local[8 + i])
    assert r["finish_reason"] == local[8 + i]["finish_reason"], (i, r)
used = {r["dp_group"] for r in second}
assert used == {0, 1, 2, 3}, f"groups that served after the failure: {sorted(used)}"
print(f"first batch: {failed} of 8 in the failing step got INTERNAL naming rank 2, the others their tokens;"
      " second batch: 16 of 16 served by every group")
PY
  # Nothing stays in the caches; the coordinator counted the failures; each
  # rank reports its CPU.
  wait_caches_empty || fail "cache blocks still in use: $(cat "$work/stats.json")"
  python3 - "$work" <<'PY' || fail "stats"
import json, re, sys
work = sys.argv[1]
d = json.load(open(f"{work}/stats.json"))
first = [json.loads(l) for l in open(f"{work}/first.out")]
errors = sum("error" in r for r in first)
c = d["coordinator"]
assert int(c["requests_failed"]) == errors, (c, errors)
assert int(c["requests_completed"]) == 25 - errors, c
assert all(g["connected"] for g in d["groups"]) and len(d["groups"]) == 4, d["groups"]
ranks = sorted(d["ranks"], key=lambda r: r["rank"])
assert [r["rank"] for r in ranks] == [0, 1, 2, 3], ranks
for r in ranks:
    assert r["cpu_isa"] in ("scalar", "avx2", "avx512", "amx"), r
    assert r["cpu_model_name"] and r["cpu_flags"], r
log = open(f"{work}/worker.log").read()
for k in range(4):
    lines = re.findall(rf"^mlarun worker: rank {k} \([^)]*\): cpu (.*)$", log, re.M)
    assert len(lines) == 1, (k, lines)
    assert lines[0].endswith("kernels " + ranks[k]["cpu_isa"]) or ("kernels " + ranks[k]["cpu_isa"] + " ") in lines[0], (lines, ranks[k])
assert len(re.findall(r"fault injection", log)) == 1 and "rank 2 (" in re.search(r".*fault injection.*", log).group(0), log
print("caches empty, counters", c["requests_completed"], "completed", c["requests_failed"], "failed; CPUs reported:",
      sorted({r["cpu_isa"] for r in ranks}))
PY
}

killed_rank() {
  start_deployment round_robin --parallel dp=4 --kv-dtype fp32 --cache-bytes 67108864
  wait_for_groups
  local spids=() i
  for i in 0 1 2 3; do
    timeout 60 "$mlarun" submit --coordinator "$addr" --prompt-ids "$((i + 5)),6,7" --max-tokens 3000 --ignore-eos \
      --stream --json --timeout 60 >"$work/s$i.out" 2>"$work/s$i.err" &
    spids+=($!)
  done
  # Every client is streaming (one request per group, round robin).
  local streaming=0
  for _ in $(seq 200); do
    streaming=1
    for i in 0 1 2 3; do [ "$(wc -l <"$work/s$i.out")" -ge 3 ] || streaming=0; done
    [ $streaming = 1 ] && break
    sleep 0.1
  done
  [ $streaming = 1 ] || fail "the four clients did not all stream"
  local victim
  victim=$(rank_pid 2)
  [ -n "$victim" ] || fail "rank 2's process not found"
  local t0 t1
  t0=$(now)
  kill -KILL "$victim"
  for i in 0 1 2 3; do
    wait "${spids[$i]}" && fail "client $i succeeded although its group died"
  done
  t1=$(now)
  python3 - "$work" "$t0" "$t1" <<'PY' || fail "what the clients were told"
import sys
work, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
for i in range(4):
    err = open(f"{work}/s{i}.err").read()
    assert "UNAVAILABLE" in err and "went away" in err and "DP group" in err, (i, err)
    assert sum(1 for l in open(f"{work}/s{i}.out") if l.strip()) >= 3, i
print(f"4 streaming clients told within {t1 - t0:.1f} s of the kill, e.g.: {open(f'{work}/s2.err').read().strip()}")
assert t1 - t0 < 10, f"the clients learned it only after {t1 - t0:.1f} s"
PY
  # A request sent now waits for its own deadline and is told what happened.
  timeout 30 "$mlarun" submit --coordinator "$addr" --prompt-ids 3,4 --max-tokens 2 --timeout 2 \
    >/dev/null 2>"$work/after.err" && fail "a request was served with every group gone"
  grep -q "UNAVAILABLE" "$work/after.err" && grep -q "went away" "$work/after.err" ||
    fail "a request after the kill was not told what happened: $(cat "$work/after.err")"
  echo "after the kill: $(cat "$work/after.err")"
}

case $mode in
  failed_step) failed_step ;;
  killed_rank) killed_rank ;;
  *) fail "unknown mode '$mode' (failed_step | killed_rank)" ;;
esac
echo "$name: PASS"
exit 0
