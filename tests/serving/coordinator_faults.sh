#!/bin/bash
# Live faults around the coordinator: a coordinator and one `mpirun mlarun
# worker` job on the tiny model (-np 2 --parallel dp=2 unless a mode says
# otherwise).
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
#   coordinator_faults.sh MLARUN SOURCE_DIR FAULT_CLIENT stopped_rank
#     A rank that stalls without dying: `mpirun -np 4 ... --parallel
#     dp=2,attn_tp=2` behind a coordinator with --stall-timeout-s 4,
#     --queue-timeout-s 5 and --lost-group-wait-s 2; 4 calls without a
#     deadline stream long answers on
#     both groups; rank 3 (attn-TP rank 1 of group 1, not a leader: its
#     leader's link stays open while the leader waits in a collective) is
#     stopped (SIGSTOP). The ranks of one job step in lockstep, so one
#     stopped rank freezes every group of the job: both groups must be taken
#     as stalled. Passes only if, with the rank stopped: every call ends by
#     itself within 10 s of the stop (stall timeout + the lost-group wait
#     for a group to resume it on + 4 s) with UNAVAILABLE saying its group
#     stalled after sending tokens (a call may first resume on the other
#     group, until that one is seen stalled too; nothing new is routed to
#     them); Health shows no group connected within 8 s
#     of the stop and none again until SIGCONT; a call sent then (no
#     deadline) is routed to neither frozen group and ends within 9 s (queue
#     timeout + 4 s) with the queue timeout's UNAVAILABLE. And after
#     SIGCONT (once that call ended, 10 s after the stop at the earliest):
#     every process of the job still runs, both groups register again
#     within 10 s, 4 new requests are served by both groups with the tokens
#     of one process (greedy, `mlarun generate`), and no cache block stays
#     in use. Prints the detection and rejoin times. Every failed check is
#     listed, not only the first.
#
#   coordinator_faults.sh MLARUN SOURCE_DIR FAULT_CLIENT load_500
#     `mpirun -np 4 ... --parallel dp=4` (--threads 1 per rank), 500
#     streaming calls opened at once (fault_client load: 16 channels, no
#     deadline, distinct request ids, 20 distinct prompts repeated, 16
#     tokens each, ignore_eos), twice. Passes only if each round ends
#     within 60 s (2 s on a quiet machine), all 500 calls were open at
#     once (the last opened before the first ended), every call is OK with
#     exactly 16 tokens in sequence (none repeated or missing, every
#     response carrying its own request_id, one Finished, finish "length"),
#     each call's tokens equal `mlarun generate` of its prompt on one
#     process, all 4 groups served, GetStats counts 500 (then 1000)
#     received and completed, none failed, rejected, cancelled or
#     re-routed, and the coordinator's resident memory (VmRSS) grew by less
#     than 200 MB over both rounds and less than 64 MB over the second.
#     Prints RSS before and after each round and the wall time of each.
#
# Every wait is bounded (timeout, loops); leaves no process behind.
set -u
mlarun=$1 src=$2 fault_client=$3 mode=$4
np=2 groups=2
case $mode in
  stopped_rank) np=4 groups=2 coordinator_flags=(--stall-timeout-s 4 --queue-timeout-s 5 --lost-group-wait-s 2) ;;
  load_500) np=4 groups=4 ;;
esac
name=coordinator_faults_$mode
source "$src/scripts/lib/deployment.sh"
# Besides the deployment: a stopped rank is continued (a stopped process
# acts on SIGTERM only once it runs again), and this script's background
# clients end.
stopped_pid=""
bg=()
before_exit() {
  if [ -n "$stopped_pid" ]; then kill -CONT "$stopped_pid" 2>/dev/null || true; fi
  touch "$work/watch.stop"
  for p in "${bg[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  stop_deployment
  for p in "${bg[@]}"; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null; done
}
now() { python3 -c 'import time; print(f"{time.time():.3f}")'; }

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

stopped_rank() {
  local stall=4 queue=5 lost=2
  start_deployment round_robin --parallel dp=2,attn_tp=2 --kv-dtype fp32 --cache-bytes 67108864
  wait_for_groups
  # The victim: attn-TP rank 1 of a group, so not the leader holding the link.
  local victim
  victim=$(python3 -c "
import json
d = json.load(open('$work/stats.json'))
print(max(int(r.get('rank', 0)) for r in d['ranks'] if int(r.get('attn_tp_rank', 0)) == 1))") ||
    fail "no attn-TP rank 1 in GetStats: $(cat "$work/stats.json")"
  local job_pids=() r p
  for r in 0 1 2 3; do
    p=$(rank_pid "$r")
    [ -n "$p" ] || fail "rank $r's process not found"
    job_pids+=("$p")
  done
  local victim_pid=${job_pids[$victim]}
  timeout 120 "$fault_client" watch "$addr" 100 "$work/watch.stop" >"$work/watch.jsonl" 2>"$work/watch.err" &
  local wpid=$!
  bg+=("$wpid")
  timeout 60 "$fault_client" generate "$addr" 4 3000 30 >"$work/calls.jsonl" 2>"$work/calls.err" &
  local cpid=$!
  bg+=("$cpid")
  # Both groups stream (each has two running requests).
  local ok=0
  for _ in $(seq 200); do
    "$mlarun" stats --coordinator "$addr" --json >"$work/stats_before.json" 2>/dev/null &&
      python3 -c "
import json, sys
d = json.load(open('$work/stats_before.json'))
routed = [int(g.get('requests_in_flight', 0)) for g in d['groups']]
tokens = all(int(g.get('tokens_generated', 0)) >= 3 for g in d['groups'])
sys.exit(0 if routed == [2, 2] and tokens else 1)" && ok=1 && break
    sleep 0.1
  done
  [ $ok = 1 ] || fail "the 4 calls were not all routed and streaming on both groups: $(cat "$work/stats_before.json")"

  local t_stop t_cont
  t_stop=$(now)
  kill -STOP "$victim_pid"
  stopped_pid=$victim_pid
  echo "rank $victim (pid $victim_pid, not a group leader) stopped; the job's ranks step in lockstep, so both groups freeze"
  wait "$cpid" || fail "fault_client generate failed: $(cat "$work/calls.err")"
  # Sent once the calls were told: no group may take it while the rank is
  # stopped. No deadline: the queue timeout must end it.
  timeout 60 "$fault_client" generate "$addr" 1 8 $((queue + 8)) >"$work/during.jsonl" 2>"$work/during.err" ||
    fail "fault_client generate (during the stop) failed: $(cat "$work/during.err")"
  "$mlarun" stats --coordinator "$addr" --json >"$work/stats_stopped.json" 2>/dev/null ||
    fail "GetStats failed while the rank was stopped"
  # SIGCONT no earlier than 10 s after the stop, so the watch sees the
  # groups stay away for a while.
  python3 -c "import time; time.sleep(max(0.0, $t_stop + 10 - time.time()))"
  t_cont=$(now)
  kill -CONT "$victim_pid"
  stopped_pid=""
  sleep 0.5
  local dead=""
  for p in "${job_pids[@]}" "${pids[1]}"; do kill -0 "$p" 2>/dev/null || dead+=" $p"; done
  timeout 30 "$fault_client" rejoin "$addr" "$groups" 20 >"$work/rejoin.json" 2>/dev/null
  local t_rejoin_call_end
  t_rejoin_call_end=$(now)

  # After SIGCONT: 4 requests, served by both groups, against one process.
  python3 - >"$work/after_req.jsonl" <<'PY'
import json
for i, p in enumerate([[11, 12, 13], [40, 41], [7, 300, 9, 10, 5], [99]]):
    print(json.dumps({"prompt_ids": p, "max_tokens": 8, "ignore_eos": True}))
PY
  timeout 60 "$mlarun" submit --coordinator "$addr" --prompts "$work/after_req.jsonl" --concurrency 4 --json \
    --timeout 30 >"$work/after.jsonl" 2>"$work/after.err"
  local after_rc=$?
  timeout 120 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompts "$work/after_req.jsonl" --json \
    --kv-dtype fp32 >"$work/local.jsonl" 2>"$work/local.err" || fail "local generate failed: $(cat "$work/local.err")"
  local caches=ok
  wait_caches_empty || caches="cache blocks still in use: $(cat "$work/stats.json")"
  touch "$work/watch.stop"
  wait "$wpid"
  python3 - "$work" "$t_stop" "$t_cont" "$stall" "$queue" "$after_rc" "$caches" "$dead" "$lost" <<'PY' || fail "see above"
import json, sys
work, t_stop, t_cont = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
stall, queue, after_rc, caches, dead = float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]), sys.argv[7], sys.argv[8]
lost = float(sys.argv[9])
UNAVAILABLE = 14
# The calls had tokens: each waits the lost-group wait for a group to resume it on.
detect_bound, queue_bound, rejoin_bound = stall + lost + 4, queue + 4, 10
failures = []
def check(cond, what):
    if not cond:
        failures.append(what)
    return cond
def lines(f):
    return [json.loads(l) for l in open(f"{work}/{f}") if l.strip()]

# The 4 calls in flight when the rank stopped: told by the stall watch.
calls = lines("calls.jsonl")
check(len(calls) == 4, f"{len(calls)} of the 4 calls reported")
ends = []
for c in calls:
    ok = check(not c["watchdog"], f"a call without a deadline was left open (cancelled by the client's watchdog): {c}")
    ok &= check(c["code"] == UNAVAILABLE and "stalled" in c["message"] and "s ago after sending" in c["message"],
                f"a call in flight was not told UNAVAILABLE saying its group stalled: {c}")
    ends.append(c["end_at"] - t_stop)
    check(c["end_at"] - t_stop < detect_bound,
          f"a call in flight ended {c['end_at'] - t_stop:.1f} s after the stop (bound {detect_bound:.0f} s): {c}")
if ends:
    print(f"the 4 calls in flight ended {min(ends):.2f}-{max(ends):.2f} s after the stop (stall timeout {stall:.0f} s); "
          f"e.g. {calls[0]['message']!r}")

# Health, polled every 20 ms: no group connected from the detection until
# SIGCONT.
watch = lines("watch.jsonl")
summary = watch[-1] if watch and "samples" in watch[-1] else None
changes = [w for w in watch if "groups_connected" in w]
check(summary is not None, "the Health watch did not end with its summary")
if summary:
    check(summary["max_gap_s"] < 2 and summary["samples"] > 100,
          f"the Health watch sampled too little to judge ({summary})")
drop = next((w for w in changes if w["at"] >= t_stop and w["groups_connected"] == 0), None)
if check(drop is not None, f"Health never showed 0 groups connected after the stop: {changes}"):
    d = drop["at"] - t_stop
    print(f"Health showed no group connected {d:.2f} s after the stop")
    check(d < stall + 4, f"Health showed the frozen groups gone only {d:.1f} s after the stop (bound {stall + 4:.0f} s)")
    back = [w for w in changes if drop["at"] < w["at"] < t_cont and w["groups_connected"] > 0]
    check(not back, "a frozen group registered again while the rank was stopped (Health, s after the stop: "
          + ", ".join(f"{w['at'] - t_stop:.2f}: {w['groups_connected']} connected" for w in back[:6]) + ")")

# The call sent during the stop: never routed to the frozen groups, ended
# by the queue timeout.
during = lines("during.jsonl")
if check(len(during) == 1, f"the call sent during the stop reported {len(during)} times"):
    c = during[0]
    check(not c["watchdog"] and c["end_at"] < t_cont,
          f"the call sent during the stop did not end by itself while the rank was stopped: {c}")
    check(c["code"] == UNAVAILABLE and "queue timeout" in c["message"] and "stalled" in c["message"],
          f"the call sent during the stop did not end with the queue timeout's UNAVAILABLE naming the stall: {c}")
    check(c["end_s"] < queue_bound, f"the call sent during the stop took {c['end_s']:.1f} s (bound {queue_bound:.0f} s)")
    print(f"the call sent during the stop ended after {c['end_s']:.2f} s: code {c['code']}, {c['message']!r}")
before = {g["dp_group"] if "dp_group" in g else 0: int(g.get("requests_routed", 0))
          for g in json.load(open(f"{work}/stats_before.json"))["groups"]}
st = json.load(open(f"{work}/stats_stopped.json"))
stopped = {g["dp_group"] if "dp_group" in g else 0: int(g.get("requests_routed", 0)) for g in st["groups"]}
# Only the calls in flight may be routed again while the rank is stopped:
# those of the group seen stalled first resume on the other, not seen
# stalled yet (its silence is no longer than theirs); nothing new is routed.
extra = sum(stopped.values()) - sum(before.values())
rerouted = int(st["coordinator"].get("requests_rerouted", "0"))
check(extra <= rerouted, f"requests other than re-routed ones were routed to the frozen groups while the rank was "
      f"stopped (requests_routed per group before the stop {before}, with the rank stopped {stopped}; "
      f"requests_rerouted {rerouted})")

# After SIGCONT.
check(not dead.strip(), f"processes of the job ended after SIGSTOP/SIGCONT: pids{dead}")
rejoin = json.load(open(f"{work}/rejoin.json")) if open(f"{work}/rejoin.json").read().strip() else {}
if check(rejoin.get("rejoined_s") is not None, f"the groups did not register again within 20 s of SIGCONT: {rejoin}"):
    # The watch's last change to 2 groups, or the rejoin poll.
    up = next((w for w in changes if w["at"] >= t_cont and w["groups_connected"] == 2), None)
    took = (up["at"] - t_cont) if up else None
    if took is not None:
        print(f"both groups registered again {took:.2f} s after SIGCONT")
        check(took < rejoin_bound, f"the groups registered again only {took:.1f} s after SIGCONT (bound {rejoin_bound} s)")
    else:
        print("both groups were already connected at SIGCONT")
served = lines("after.jsonl") if after_rc == 0 else []
if check(after_rc == 0, f"the requests after SIGCONT failed: {open(f'{work}/after.err').read()[-500:]}"):
    local = lines("local.jsonl")
    check(len(served) == len(local) == 4, f"{len(served)} served, {len(local)} local")
    for i, (s, l) in enumerate(zip(served, local)):
        check("error" not in s and s.get("tokens") == l["tokens"],
              f"request {i} after SIGCONT: {s} instead of one process's {l['tokens']}")
    used = {s.get("dp_group", 0) for s in served}
    check(used == {0, 1}, f"groups that served after SIGCONT: {sorted(used)}")
    print(f"after SIGCONT: 4 requests served by groups {sorted(used)}, tokens equal one process's")
check(caches == "ok", caches)
for f in failures:
    print("FAILED CHECK:", f)
sys.exit(1 if failures else 0)
PY
}

load_500() {
  local n=500 max_tokens=16 round_bound=60
  start_deployment round_robin --parallel dp=4 --kv-dtype fp32 --cache-bytes 67108864
  wait_for_groups
  local coord_pid=${pids[0]}
  # 20 distinct prompts of 1 to 39 tokens; call i gets prompt i % 20.
  python3 - "$work" "$max_tokens" <<'PY'
import json, random, sys
work, max_tokens = sys.argv[1], int(sys.argv[2])
rng = random.Random(7)
prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
with open(f"{work}/prompts.txt", "w") as f, open(f"{work}/prompts.jsonl", "w") as j:
    for p in prompts:
        print(" ".join(map(str, p)), file=f)
        print(json.dumps({"prompt_ids": p, "max_tokens": max_tokens, "ignore_eos": True}), file=j)
PY
  timeout 120 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompts "$work/prompts.jsonl" --json \
    --kv-dtype fp32 >"$work/local.jsonl" 2>"$work/local.err" || fail "local generate failed: $(cat "$work/local.err")"
  local rss=() walls=() round t0 t1
  rss+=("$(awk '/^VmRSS/ {print $2}' "/proc/$coord_pid/status")")
  for round in 1 2; do
    t0=$(now)
    timeout $((round_bound + 20)) "$fault_client" load "$addr" "$n" "$max_tokens" "$work/prompts.txt" "$round_bound" \
      >"$work/load$round.jsonl" 2>"$work/load$round.err" || fail "fault_client load failed: $(cat "$work/load$round.err")"
    t1=$(now)
    walls+=("$(python3 -c "print(f'{$t1 - $t0:.2f}')")")
    "$mlarun" stats --coordinator "$addr" --json >"$work/stats$round.json" 2>/dev/null || fail "GetStats failed"
    rss+=("$(awk '/^VmRSS/ {print $2}' "/proc/$coord_pid/status")")
  done
  python3 - "$work" "$n" "$max_tokens" "${rss[*]}" "${walls[*]}" <<'PY' || fail "see above"
import collections, json, sys
work, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rss = [int(x) for x in sys.argv[4].split()]  # kB
walls = [float(x) for x in sys.argv[5].split()]
local = [json.loads(l)["tokens"] for l in open(f"{work}/local.jsonl") if l.strip()]
assert len(local) == 20, f"{len(local)} local results"
failures = []
for rnd in (1, 2):
    calls = [json.loads(l) for l in open(f"{work}/load{rnd}.jsonl") if l.strip()]
    ids = collections.Counter(c["i"] for c in calls)
    if len(calls) != n or set(ids) != set(range(n)):
        failures.append(f"round {rnd}: {len(calls)} calls reported, {len(ids)} distinct, of {n}")
    bad = [c for c in calls if c["code"] != 0 or c["watchdog"] or c["errors"] or len(c["tokens"]) != max_tokens
           or c["finish_reason"] != "length"]
    if bad:
        failures.append(f"round {rnd}: {len(bad)} calls failed or streamed wrong, e.g. {bad[:2]}")
    wrong = [c for c in calls if c["code"] == 0 and c["tokens"] != local[c["prompt"]]]
    if wrong:
        failures.append(f"round {rnd}: {len(wrong)} calls' tokens differ from one process's, e.g. "
                        f"{[(c['i'], c['prompt'], c['tokens'], local[c['prompt']]) for c in wrong[:2]]}")
    groups = collections.Counter(c["dp_group"] for c in calls)
    if set(groups) != {0, 1, 2, 3}:
        failures.append(f"round {rnd}: groups that served: {dict(groups)}")
    opened = max(c["start_s"] for c in calls)
    first_end = min(c["end_s"] for c in calls)
    if opened >= first_end:
        failures.append(f"round {rnd}: a call ended ({first_end:.3f} s) before the last was opened ({opened:.3f} s): "
                        f"they were not all in flight at once")
    d = json.load(open(f"{work}/stats{rnd}.json"))["coordinator"]
    want = {"requests_received": n * rnd, "requests_completed": n * rnd, "requests_failed": 0,
            "requests_rejected": 0, "requests_cancelled": 0, "requests_rerouted": 0, "requests_queued": 0}
    got = {k: int(d.get(k, 0)) for k in want}
    if got != want:
        failures.append(f"round {rnd}: GetStats counters {got}, expected {want}")
    print(f"round {rnd}: {n} calls in {walls[rnd - 1]:.2f} s (all opened within {opened:.3f} s, the first ended at "
          f"{first_end:.3f} s); groups {dict(sorted(groups.items()))}; GetStats received {got['requests_received']}, "
          f"completed {got['requests_completed']}")
mb = lambda kb: kb / 1024
print(f"coordinator VmRSS: {mb(rss[0]):.1f} MB before, {mb(rss[1]):.1f} MB after round 1, {mb(rss[2]):.1f} MB after round 2")
if rss[2] - rss[0] >= 200 * 1024:
    failures.append(f"the coordinator's RSS grew by {mb(rss[2] - rss[0]):.1f} MB over {2 * n} calls (bound 200 MB)")
if rss[2] - rss[1] >= 64 * 1024:
    failures.append(f"the coordinator's RSS grew by {mb(rss[2] - rss[1]):.1f} MB over the second {n} calls (bound 64 MB)")
for f in failures:
    print("FAILED CHECK:", f)
sys.exit(1 if failures else 0)
PY
}

case $mode in
  killed_rank_queued) killed_rank_queued ;;
  coordinator_restart) coordinator_restart ;;
  stopped_rank) stopped_rank ;;
  load_500) load_500 ;;
  *) fail "unknown mode '$mode' (killed_rank_queued | coordinator_restart | stopped_rank | load_500)" ;;
esac
echo "$name: PASS"
exit 0
