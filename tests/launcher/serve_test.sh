#!/bin/bash
# `mlarun serve` end to end on the tiny model: ready line once both DP groups
# of dp=2 registered; a request served with the tokens `mlarun generate`
# gives, over gRPC and over the HTTP API (/health, /v1/completions); the job
# listening on loopback only (but for Open MPI's own out-of-band listener);
# a rank killed -9 takes its job down, serve reports it and restarts
# the job with back-off, and serving resumes; SIGTERM stops everything within
# the grace, exit 0, leaving no process and no temporary directory behind. A
# model that cannot load is reported and not restarted (exit 1).
#
#   serve_test.sh MLARUN SOURCE_DIR
set -u
mlarun=$1 src=$2
name=serve_test
work=$(mktemp -d)
logs=("$work/serve.log")
serve_pid=
before_exit() { [ -n "$serve_pid" ] && kill -KILL "$serve_pid" 2>/dev/null; pkill -KILL -f "coordinator 127.0.0.1:$port " 2>/dev/null; true; }
source "$src/scripts/lib/on_exit.sh"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
addr=127.0.0.1:$port
hport=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
model="$src/configs/models/tiny.yaml"

# waits until serve.log holds COUNT lines matching PATTERN (fails after S seconds)
wait_log() {
  local pattern=$1 count=$2 seconds=$3
  for _ in $(seq $((seconds * 10))); do
    [ "$(grep -c -- "$pattern" "$work/serve.log")" -ge "$count" ] && return 0
    kill -0 "$serve_pid" 2>/dev/null || fail "serve exited while waiting for '$pattern'"
    sleep 0.1
  done
  fail "no '$pattern' (x$count) in serve's log after $seconds s"
}
job_pids() { pgrep -f -- "--coordinator $addr " ; }

"$mlarun" serve --model "$model" --parallel dp=2 --grpc "$addr" --http "127.0.0.1:$hport" --threads 1 --worker-arg=--kv-dtype --worker-arg=fp32 \
  2>"$work/serve.log" &
serve_pid=$!
wait_log "mlarun serve: ready: 2 DP group(s)" 1 120

prompt=3,14,15,92,65
"$mlarun" submit --coordinator "$addr" --prompt-ids $prompt --max-tokens 8 --json >"$work/served.json" ||
  fail "submit failed"
"$mlarun" generate --model "$model" --kv-dtype fp32 --prompt-ids $prompt --max-tokens 8 --json >"$work/local.json" 2>/dev/null ||
  fail "generate failed"
python3 - "$work/served.json" "$work/local.json" <<'PY' || fail "served tokens differ from mlarun generate's"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
sys.exit(0 if a["tokens"] == b["tokens"] and len(a["tokens"]) == 8 else 1)
PY

grep -q "HTTP API at http://127.0.0.1:$hport/v1" "$work/serve.log" || fail "the ready line does not give the HTTP API"
python3 - "$hport" "$work/local.json" <<'PY' || fail "the HTTP API did not serve"
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
assert urllib.request.urlopen(base + "/health", timeout=10).status == 200
ids = [3, 14, 15, 92, 65]
body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 8, "ignore_eos": True}).encode()
req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=60))
assert r["usage"]["completion_tokens"] == 8 and r["usage"]["prompt_tokens"] == 5, r
PY

# The job on loopback: no rank listens beyond 127.0.0.0/8 and [::1] (TCP or
# UDP), and the launcher only on Open MPI's out-of-band pair (one IPv4 and
# one IPv6 socket on every address, which no MCA setting moves).
launcher=$(grep -o "started the worker job (pid [0-9]*)" "$work/serve.log" | head -1 | grep -o "[0-9]*")
ss -Hltunp >"$work/listening.txt" || fail "ss -ltunp failed"
python3 - "$work/listening.txt" "$launcher" $(job_pids) <<'PY' || fail "the worker job listens beyond loopback"
import re, sys
launcher, job = sys.argv[2], set(sys.argv[3:])
assert launcher in job and len(job) >= 3, f"expected the launcher {launcher} and 2 ranks, found {job}"
wide = {}
for line in open(sys.argv[1]):
    fields = line.split()
    host = fields[-3].rsplit(":", 1)[0]
    for pid in set(re.findall(r"pid=(\d+)", fields[-1])) & job:
        if not (host.startswith("127.") or host == "[::1]"):
            wide.setdefault(pid, []).append(fields[-3])
ranks = {pid: where for pid, where in wide.items() if pid != launcher}
assert not ranks, f"ranks listening beyond loopback: {ranks}"
assert len(wide.get(launcher, [])) <= 2, f"the launcher listens beyond loopback on {wide[launcher]}"
PY

# Kill rank 1 (not the launcher): Open MPI ends the job; serve restarts it.
rank1=
for p in $(job_pids); do
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1" && rank1=$p
done
[ -n "$rank1" ] || fail "no rank 1 among the job's processes"
kill -KILL "$rank1"
wait_log "mlarun serve: the worker job (pid [0-9]*) .* after" 1 60
wait_log "mlarun serve: restarting it in 1.0 s" 1 5
wait_log "mlarun serve: ready: 2 DP group(s)" 2 120
"$mlarun" submit --coordinator "$addr" --prompt-ids $prompt --max-tokens 8 --json >"$work/served2.json" ||
  fail "submit after the restart failed"
cmp -s <(python3 -c "import json,sys; print(json.load(open('$work/served2.json'))['tokens'])") \
       <(python3 -c "import json,sys; print(json.load(open('$work/local.json'))['tokens'])") ||
  fail "tokens after the restart differ"

secret_dir=$(grep -o -- "--worker-secret-file [^ ]*" "$work/serve.log" | head -1 | awk '{print $2}' | xargs dirname)
[ -d "$secret_dir" ] || fail "no worker secret directory found in the log"
[ "$(stat -c %a "$secret_dir/worker-secret")" = 600 ] || fail "the worker secret is not mode 600"

kill -TERM "$serve_pid"
for _ in $(seq 200); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$serve_pid" 2>/dev/null && fail "serve still running 20 s after SIGTERM"
wait "$serve_pid"
rc=$?
serve_pid=
[ "$rc" = 0 ] || fail "serve exited with $rc after SIGTERM"
grep -q "mlarun serve: stopped" "$work/serve.log" || fail "no 'stopped' line"
left=$(job_pids)
[ -z "$left" ] || fail "processes left behind: $(ps -o pid,ppid,pgid,stat,etime,cmd -p "$(echo $left | tr " " ",")" | cut -c1-160)"
[ ! -e "$secret_dir" ] || fail "$secret_dir left behind"

# Workers that cannot start (an argument they refuse; the HTTP API off):
# reported, not restarted, exit 1.
timeout 120 "$mlarun" serve --model "$model" --grpc "127.0.0.1:0" --http "" --threads 1 \
  --worker-arg=--no-such-worker-flag 2>"$work/broken.log"
rc=$?
[ "$rc" = 1 ] || fail "serve with failing workers exited $rc, not 1: $(tail -3 "$work/broken.log")"
grep -q "not restarting a job that never became ready" "$work/broken.log" || fail "no reason given for the failing job"
# A model file that is not valid YAML: a usage error naming what is wrong,
# before any job starts, with the HTTP API off or on.
echo "vocab_size: [" >"$work/broken.yaml"
timeout 60 "$mlarun" serve --model "$work/broken.yaml" --grpc "127.0.0.1:0" --http "" 2>"$work/broken1.log"
rc=$?
[ "$rc" = 2 ] && grep -q "malformed YAML" "$work/broken1.log" && ! grep -q "started the worker job" "$work/broken1.log" ||
  fail "a broken model without --http: exit $rc, $(tail -2 "$work/broken1.log")"
# With the HTTP API on, the coordinator reads the model's tokenizer first: a
# usage error naming the file, before any worker starts.
timeout 60 "$mlarun" serve --model "$work/broken.yaml" --grpc "127.0.0.1:0" --http "127.0.0.1:0" 2>"$work/broken2.log"
rc=$?
[ "$rc" = 2 ] && grep -q "broken.yaml" "$work/broken2.log" && ! grep -q "started the worker job" "$work/broken2.log" ||
  fail "a broken model with --http: exit $rc, $(tail -2 "$work/broken2.log")"
"$mlarun" serve --model "$model" --parallel dp=x 2>"$work/usage.log"
[ $? = 2 ] && grep -q -- "--parallel" "$work/usage.log" || fail "a bad --parallel is not a usage error naming it"
echo "serve_test: ok"
