#!/bin/bash
# Live faults around the coordinator: a coordinator and `mpirun -np 2 mlarun
# worker --parallel dp=2` on the tiny model.
#
#   coordinator_faults.sh MLARUN SOURCE_DIR FAULT_CLIENT killed_rank_queued
#     --max-num-seqs 1, so each group runs one request and holds the others
#     waiting inside its engine; 12 calls without a gRPC deadline stream long
#     answers; rank 1 is killed (SIGKILL). Passes only if every call ends by
#     itself (none by the client's watchdog) within 10 s of its group's loss
#     and 15 s of the kill, with UNAVAILABLE naming the DP group that went
#     away, never "no DP group registered".
#
#   coordinator_faults.sh MLARUN SOURCE_DIR FAULT_CLIENT coordinator_restart
#     The coordinator is killed (SIGKILL) while the groups are registered and
#     restarted on the same port after 3 s. Passes only if both groups
#     register again within 8 s of it answering (the workers' back-off is 2 s
#     at most; 8 s leaves room for a loaded machine, and a failure costs
#     every client of the job an outage), and a request sent then succeeds.
#     Prints the measured rejoin time.
#
# Every wait is bounded (timeout, loops); leaves no process behind.
set -u
mlarun=$1 src=$2 fault_client=$3 mode=$4
np=2 groups=2
name=coordinator_faults_$mode
source "$src/scripts/lib/deployment.sh"

killed_rank_queued() {
  start_deployment round_robin --parallel dp=2 --kv-dtype fp32 --cache-bytes 67108864 --max-num-seqs 1
  wait_for_groups
  timeout 60 "$fault_client" generate "$addr" 12 3000 30 >"$work/calls.jsonl" 2>"$work/calls.err" &
  local cpid=$!
  # Both groups stream (each has one running request) and the others are
  # routed and waiting inside the engines.
  local ok=0
  for _ in $(seq 200); do
    "$mlarun" stats --coordinator "$addr" --json >"$work/stats.json" 2>/dev/null &&
      python3 -c "
import json, sys
d = json.load(open('$work/stats.json'))
routed = sum(int(g.get('requests_in_flight', 0)) for g in d['groups'])
tokens = all(int(g.get('tokens_generated', 0)) >= 3 for g in d['groups'])
sys.exit(0 if routed == 12 and tokens else 1)" && ok=1 && break
    sleep 0.1
  done
  [ $ok = 1 ] || fail "the 12 calls were not all routed and streaming: $(cat "$work/stats.json")"
  local victim
  victim=$(rank_pid 1)
  [ -n "$victim" ] || fail "rank 1's process not found"
  local t0 t1
  t0=$(python3 -c 'import time; print(time.time())')
  kill -KILL "$victim"
  wait "$cpid" || fail "fault_client failed: $(cat "$work/calls.err")"
  t1=$(python3 -c 'import time; print(time.time())')
  python3 - "$work" "$t0" "$t1" <<'PY' || fail "what the calls were told"
import json, sys
work, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
calls = [json.loads(l) for l in open(f"{work}/calls.jsonl") if l.strip()]
assert len(calls) == 12, len(calls)
UNAVAILABLE = 14
for c in calls:
    assert not c["watchdog"], ("a call without a deadline was left open", c)
    assert c["code"] == UNAVAILABLE, c
    m = c["message"]
    assert "DP group" in m and "went away" in m, c
    assert "no DP group registered" not in m, c
started = sum(1 for c in calls if c["tokens"] > 0)
print(f"12 calls without a deadline ended UNAVAILABLE within {t1 - t0:.1f} s of the kill "
      f"({started} had tokens, {12 - started} were waiting in the engines); e.g.: "
      f"{[c for c in calls if c['tokens'] == 0][:1]}")
# Within 10 s of its group's loss (the killed rank's group goes at once, the
# other when mpirun ends the job, which a loaded machine may take seconds to
# do), and all of them within 15 s of the kill.
import re
for c in calls:
    m = re.search(r"went away (\d+\.\d) s ago", c["message"])
    assert c["tokens"] > 0 or (m and float(m.group(1)) < 10), c
assert t1 - t0 < 15, f"the calls ended only {t1 - t0:.1f} s after the kill"
PY
}

coordinator_restart() {
  start_deployment round_robin --parallel dp=2 --kv-dtype fp32 --cache-bytes 67108864
  wait_for_groups
  "$mlarun" submit --coordinator "$addr" --prompt-ids 3,4 --max-tokens 2 --timeout 30 >/dev/null 2>"$work/before.err" ||
    fail "a request before the restart failed: $(cat "$work/before.err")"
  local coord_pid=${pids[0]}
  kill -KILL "$coord_pid"
  wait "$coord_pid" 2>/dev/null
  sleep 3
  "$mlarun" coordinator --listen "$addr" --policy round_robin 2>"$work/coord2.log" &
  pids+=($!)
  timeout 30 "$fault_client" rejoin "$addr" "$groups" 20 >"$work/rejoin.json" ||
    fail "the groups did not register again within 20 s: $(cat "$work/rejoin.json")"
  python3 - "$work" <<'PY' || fail "rejoin time"
import json, sys
d = json.load(open(f"{sys.argv[1]}/rejoin.json"))
took = d["rejoined_s"] - d["answered_s"]
print(f"both groups registered again {took:.2f} s after the restarted coordinator answered")
assert took < 8, f"rejoin took {took:.2f} s"
PY
  timeout 40 "$mlarun" submit --coordinator "$addr" --prompt-ids 3,4,5 --max-tokens 4 --json --timeout 30 \
    >"$work/after.json" 2>"$work/after.err" || fail "a request after the restart failed: $(cat "$work/after.err")"
  echo "after the restart: $(cat "$work/after.json")"
}

case $mode in
  killed_rank_queued) killed_rank_queued ;;
  coordinator_restart) coordinator_restart ;;
  *) fail "unknown mode '$mode' (killed_rank_queued | coordinator_restart)" ;;
esac
echo "$name: PASS"
exit 0
