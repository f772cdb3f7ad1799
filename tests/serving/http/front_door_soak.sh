#!/usr/bin/env bash
# The HTTP API under a bounded mix of hostile and careless clients (loopback,
# about a minute): `mlarun coordinator --http` on the tiny model's tokenizer
# with two simulated DP groups and API tokens, hit by slow clients,
# chunked-body floods with and without a token and disconnecting streams
# while normal clients send completions. bench/http_front_door.py --check
# asserts that every normal answer arrives once and equals its quiet-phase
# answer, that /health answers, that p99 stays within 10x of quiet, and
# that RSS after the churn stays within its bound.
#   front_door_soak.sh MLARUN SOURCE_DIR
set -euo pipefail
mlarun="$1"
src="$2"
name=front_door_soak
work=$(mktemp -d)
tmp=$work
logs=("$work/coordinator.log" "$work/sim-worker.log" "$work/soak.log")
pids=()
before_exit() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  true
}
source "$src/scripts/lib/on_exit.sh"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
grpc_port=$(free_port)
http_port=$(free_port)
token=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
echo "$token alice" >"$tmp/tokens"
worker_secret=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
echo "$worker_secret" >"$tmp/worker.secret"

"$mlarun" coordinator --listen "127.0.0.1:$grpc_port" --http "127.0.0.1:$http_port" \
  --model "$src/configs/models/tiny.yaml" --auth-token-file "$tmp/tokens" \
  --worker-secret-file "$tmp/worker.secret" >"$tmp/coordinator.log" 2>&1 &
coordinator=$!
pids+=($coordinator)
"$mlarun" sim-worker --coordinator "127.0.0.1:$grpc_port" --groups 2 --tokens-per-s 0 \
  --worker-secret-file "$tmp/worker.secret" >"$tmp/sim-worker.log" 2>&1 &
pids+=($!)
healthy() {
  python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
    "http://127.0.0.1:$http_port/health" >/dev/null 2>&1
}
for _ in $(seq 100); do
  healthy && break
  sleep 0.2
done
healthy || fail "the coordinator did not become healthy"

python3 "$src/bench/http_front_door.py" --url "http://127.0.0.1:$http_port" --pid "$coordinator" \
  --token "$token" --requests 60 --slow 300 --floods 2 --churn 1500 --rss-slack-mb 50 --check \
  >"$tmp/soak.log" 2>&1 || fail "bench/http_front_door.py --check failed"
cat "$tmp/soak.log"
kill -0 "$coordinator" || fail "the coordinator died"
