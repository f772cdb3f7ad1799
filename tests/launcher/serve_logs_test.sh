#!/bin/bash
# What `mlarun serve` says, on the tiny model with dp=2:
#  1. the logs: a "loaded" line per rank (load time, weights, cache tokens,
#     maximum concurrency); a request line per finished request (its id as
#     the HTTP answer gives it, token counts, TTFT, duration, finish reason;
#     no prompt text); stats lines every --log-stats-interval while busy,
#     then silence; --disable-log-requests and --log-stats-interval 0 turn
#     them off;
#  2. a Ctrl-C (SIGINT): exit 0, "shutting down on request", the groups
#     leaving on request, no "died", no "failed";
#  3. the HTTP API off and serve's log a pipe whose reader left: serve keeps
#     serving (no SIGPIPE), stops on SIGTERM with exit 0 and removes its
#     secret directory;
#  4. start-up failures end with the cause as the last line: a model that
#     cannot load on the ranks, a port in use (HTTP and gRPC), a --model
#     that does not exist.
#
#   serve_logs_test.sh MLARUN SOURCE_DIR
set -u
mlarun=$1 src=$2
name=serve_logs_test
work=$(mktemp -d)
export TMPDIR="$work/tmp"  # serve's secret directories: ours only
mkdir -p "$TMPDIR"
logs=("$work/serve.log" "$work/quiet.log" "$work/int.log")
serve_pid=
holder_pid=
before_exit() {
  [ -n "$serve_pid" ] && kill -KILL "$serve_pid" 2>/dev/null
  [ -n "$holder_pid" ] && kill "$holder_pid" 2>/dev/null
  true
}
source "$src/scripts/lib/on_exit.sh"

model="$src/configs/models/tiny.yaml"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_serve LOG ARGS...: serve on dp=2 in the background, its stderr in LOG
start_serve() {
  local log=$1
  shift
  grpc=127.0.0.1:$(free_port)
  timeout 200 "$mlarun" serve --model "$model" --parallel dp=2 --grpc "$grpc" --threads 1 \
    --worker-arg=--kv-dtype --worker-arg=fp32 "$@" 2>"$log" &
  serve_pid=$!
}
# wait_log LOG PATTERN SECONDS
wait_log() {
  for _ in $(seq $(($3 * 10))); do
    grep -q -- "$2" "$1" 2>/dev/null && return 0
    kill -0 "$serve_pid" 2>/dev/null || fail "serve exited while waiting for '$2'"
    sleep 0.1
  done
  fail "no '$2' in $1 after $3 s"
}
# stop_serve SIGNAL: sends it, waits (20 s at most), sets rc
stop_serve() {
  kill -"$1" "$serve_pid"
  for _ in $(seq 200); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$serve_pid" 2>/dev/null && fail "serve still running 20 s after SIG$1"
  wait "$serve_pid"
  rc=$?
  serve_pid=
}
complete() {  # complete PORT MAX_TOKENS: prints the answer's id
  python3 - "$1" "$2" <<'PY'
import json, sys, urllib.request
body = json.dumps({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": int(sys.argv[2]),
                   "ignore_eos": True}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=60))
print(r["id"], r["usage"]["prompt_tokens"])
PY
}

# ---- 1. The logs -------------------------------------------------------------
hport=$(free_port)
start_serve "$work/serve.log" --http "127.0.0.1:$hport" --log-stats-interval 1
wait_log "$work/serve.log" "mlarun serve: ready: 2 DP group(s)" 120
loaded=$(grep -cE "mlarun worker: rank [01] \(.*\): loaded in [0-9.]+ s: [0-9.]+ [KMG]iB of weights; KV cache [0-9]+ tokens \([0-9]+ blocks of [0-9]+\); maximum concurrency for 4096 tokens per request: [0-9.]+x" "$work/serve.log")
[ "$loaded" = 2 ] || fail "expected a 'loaded' line per rank, found $loaded"
read -r id1 prompt_tokens < <(complete "$hport" 7) || fail "the first completion failed"
read -r id2 _ < <(complete "$hport" 3) || fail "the second completion failed"
wait_log "$work/serve.log" "request $id2 finished" 10
grep -qE "mlarun coordinator: request $id1 finished: prompt_tokens=$prompt_tokens output_tokens=7 ttft=[0-9.]+s duration=[0-9.]+s finish_reason=length" "$work/serve.log" ||
  fail "no request line for $id1: $(grep "request " "$work/serve.log" | head -3)"
grep -qE "request $id2 finished: prompt_tokens=$prompt_tokens output_tokens=3 " "$work/serve.log" || fail "no request line for $id2"
grep -q "quick brown" "$work/serve.log" && fail "the log holds prompt text"
wait_log "$work/serve.log" "stats: prompt throughput [0-9.]* tokens/s, generation throughput [0-9.]* tokens/s, running [0-9]*, waiting [0-9]*, cache use [0-9.]*%, prefix-cache hit rate [0-9.]*%" 10
grep "stats: " "$work/serve.log" | grep -qv "generation throughput 0.0 " || fail "no stats line shows the tokens generated"
# Idle: at most the line that shows the change, then silence.
sleep 3
before=$(grep -c "stats: " "$work/serve.log")
sleep 3.5
[ "$(grep -c "stats: " "$work/serve.log")" = "$before" ] || fail "stats lines while idle: $(grep "stats: " "$work/serve.log" | tail -2)"
stop_serve TERM
[ "$rc" = 0 ] || fail "serve exited $rc after SIGTERM"

# Turned off.
hport=$(free_port)
start_serve "$work/quiet.log" --http "127.0.0.1:$hport" --disable-log-requests --log-stats-interval 0
wait_log "$work/quiet.log" "mlarun serve: ready: 2 DP group(s)" 120
complete "$hport" 4 >/dev/null || fail "a completion with the logs off failed"
sleep 2
grep -q "mlarun coordinator: request \|stats: " "$work/quiet.log" && fail "request or stats lines despite their flags: $(grep "request \|stats" "$work/quiet.log" | head -2)"
stop_serve TERM

# `mlarun coordinator` has the same flags; a negative interval is refused.
for cmd in serve coordinator; do
  help=$("$mlarun" "$cmd" --help 2>&1)
  grep -q -- "--disable-log-requests" <<<"$help" && grep -q -- "--log-stats-interval" <<<"$help" ||
    fail "mlarun $cmd --help lacks the log flags"
  timeout 10 "$mlarun" "$cmd" --model "$model" --log-stats-interval -1 >/dev/null 2>&1
  [ $? = 2 ] || fail "mlarun $cmd --log-stats-interval -1 is not a usage error"
done

# ---- 2. Ctrl-C ---------------------------------------------------------------
start_serve "$work/int.log" --http ""
wait_log "$work/int.log" "mlarun serve: ready: 2 DP group(s)" 120
stop_serve INT
[ "$rc" = 0 ] || fail "serve exited $rc after SIGINT"
grep -q "mlarun serve: SIGINT: shutting down on request" "$work/int.log" || fail "SIGINT: no 'shutting down on request'"
[ "$(grep -c "went away: its leader left: rank [0-9] (.*): stopping on request (SIGTERM)" "$work/int.log")" = 2 ] ||
  fail "SIGINT: the groups did not leave on request: $(grep "went away" "$work/int.log")"
grep -qi "died\|failed\|error" "$work/int.log" && fail "SIGINT logged as a failure: $(grep -i "died\|failed\|error" "$work/int.log")"
[ "$(tail -1 "$work/int.log")" = "mlarun serve: stopped" ] || fail "SIGINT: the last line is $(tail -1 "$work/int.log")"

# ---- 3. A log pipe whose reader left, the HTTP API off -------------------------
mkfifo "$work/log.fifo"
grpc=127.0.0.1:$(free_port)
timeout 200 "$mlarun" serve --model "$model" --parallel dp=2 --grpc "$grpc" --http "" --threads 1 \
  --worker-arg=--kv-dtype --worker-arg=fp32 2>"$work/log.fifo" &
serve_pid=$!
timeout 60 head -n 1 <"$work/log.fifo" >/dev/null  # reads one line, then the pipe has no reader
served=
for _ in $(seq 300); do
  kill -0 "$serve_pid" 2>/dev/null || break
  timeout 10 "$mlarun" submit --coordinator "$grpc" --prompt-ids 3,14,15 --max-tokens 4 >/dev/null 2>&1 && served=1 && break
  sleep 0.2
done
kill -0 "$serve_pid" 2>/dev/null || { wait "$serve_pid"; fail "serve died with its log's reader gone (exit $?)"; }
[ -n "$served" ] || fail "serve did not serve with its log's reader gone"
sleep 1  # a request line, written into the broken pipe
kill -0 "$serve_pid" 2>/dev/null || fail "serve died writing to its broken log"
stop_serve TERM
[ "$rc" = 0 ] || fail "serve with a broken log exited $rc after SIGTERM"
left=$(ls "$TMPDIR" | grep "^mlarun-serve-")
[ -z "$left" ] || fail "secret directories left in \$TMPDIR: $left"
pgrep -f -- "--coordinator $grpc " >/dev/null && fail "processes of the job left behind"

# ---- 4. Start-up failures: the cause last --------------------------------------
# last_line_is LOG RC WANT_RC REGEX
last_line_is() {
  [ "$2" = "$3" ] || fail "$1: exit $2, not $3: $(tail -2 "$1")"
  tail -1 "$1" | grep -qE "$4" || fail "$1: the last line is not /$4/: $(tail -1 "$1")"
}
sed 's/^hidden_size: .*/hidden_size: 1000000000/' "$model" >"$work/huge.yaml"
sed -i "s|^tokenizer: .*|tokenizer: $src/configs/models/tiny-tokenizer|" "$work/huge.yaml"
timeout 120 "$mlarun" serve --model "$work/huge.yaml" --grpc 127.0.0.1:0 --http "" --threads 1 2>"$work/huge.log"
last_line_is "$work/huge.log" $? 1 "^mlarun serve: failed: RESOURCE_EXHAUSTED: loading the model failed on 1 of 1 ranks: rank 0 \(.*\): cannot load $work/huge.yaml: .*memory"
python3 -c 'import socket, time; s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1); print(s.getsockname()[1], flush=True); time.sleep(120)' >"$work/held" &
holder_pid=$!
for _ in $(seq 50); do [ -s "$work/held" ] && break; sleep 0.1; done
held=$(cat "$work/held")
timeout 60 "$mlarun" serve --model "$model" --grpc 127.0.0.1:0 --http "127.0.0.1:$held" 2>"$work/http_port.log"
last_line_is "$work/http_port.log" $? 1 "^mlarun serve: failed: .*127.0.0.1:$held: Address already in use"
timeout 60 "$mlarun" serve --model "$model" --grpc "127.0.0.1:$held" --http "" 2>"$work/grpc_port.log"
last_line_is "$work/grpc_port.log" $? 1 "^mlarun serve: failed: .*cannot listen on '127.0.0.1:$held': Address already in use"
timeout 60 "$mlarun" serve --model "$work/no-such-model" --http "" 2>"$work/missing.log"
last_line_is "$work/missing.log" $? 2 "^mlarun serve: failed: --model: $work/no-such-model: no such file or directory"
grep -q "started the worker job" "$work/http_port.log" "$work/grpc_port.log" "$work/missing.log" &&
  fail "a job started despite a start-up failure"
echo "serve_logs_test: ok"
