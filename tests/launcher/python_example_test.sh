#!/usr/bin/env bash
# examples/python/submit.py end to end: the real `mlarun coordinator`, a
# simulated worker with 2 groups, stubs generated from the .proto, one
# streaming request and GetStats; then the same against a second coordinator
# with TLS, client tokens and a worker secret (certificates made with the
# openssl CLI), where submit.py with --tls-ca and --auth-token-file and
# `mlarun submit` / `mlarun stats` with the same flags are served, and
# calls without the token get UNAUTHENTICATED, without TLS no connection.
#
#   python_example_test.sh MLARUN_BINARY SOURCE_DIR
#
# Exit 0 on success, 77 (skipped) when no python3 can import grpc (the Debian
# packages python3-grpcio and python3-protobuf), anything else on failure.
# Everything runs under `timeout`, and the servers die with the script.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 MLARUN_BINARY SOURCE_DIR" >&2
  exit 2
fi
mlarun=$1
src=$2

# The whole test under one limit (below ctest's TIMEOUT of 120 s), so a hang
# is reported by this script, with the servers' logs, rather than killed blind.
if [ -z "${MLARUN_PY_EXAMPLE_INNER:-}" ]; then
  MLARUN_PY_EXAMPLE_INNER=1 timeout -k 5 100 bash "$0" "$@" && rc=0 || rc=$?
  [ "$rc" -eq 124 ] && echo "python_example_test: timed out" >&2
  exit "$rc"
fi

skip() {
  echo "python_example_test: SKIPPED: $*"
  exit 77
}

# The first python3 that has grpc: a pyenv or venv python3 earlier on PATH may
# lack the Debian packages that /usr/bin/python3 has.
python=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null && "$p" -c 'import grpc, google.protobuf' 2>/dev/null; then
    python=$(command -v "$p")
    break
  fi
done
[ -n "$python" ] || skip "python3 cannot import grpc (install python3-grpcio python3-protobuf)"
# The rest is part of every build machine (scripts/install-deps): missing, it fails.
early_fail() {
  echo "python_example_test: FAILED: $*" >&2
  exit 1
}
command -v protoc >/dev/null || early_fail "protoc not found (protobuf-compiler)"
plugin=$(command -v grpc_python_plugin) || early_fail "grpc_python_plugin not found (protobuf-compiler-grpc)"
[ -x "$mlarun" ] || early_fail "$mlarun is not executable"
for sub in coordinator sim-worker; do
  "$mlarun" "$sub" --help >/dev/null 2>&1 || early_fail "$mlarun has no '$sub' subcommand"
done

tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 124' TERM INT
fail() {
  echo "python_example_test: FAILED: $*" >&2
  for log in "$tmp"/*.log; do
    [ -f "$log" ] && { echo "--- $(basename "$log")" >&2; tail -30 "$log" >&2; }
  done
  exit 1
}

# Stubs, exactly as examples/python/README.md generates them.
protoc --python_out="$tmp" --grpc_python_out="$tmp" --plugin=protoc-gen-grpc_python="$plugin" \
  -I "$src/serving/proto" "$src/serving/proto/mlarun.proto" || fail "protoc could not generate the stubs"

# A free port: bind port 0, read it back, release it. (Another process could
# take it in between; the coordinator then fails to bind and the test says so.)
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
addr="127.0.0.1:$port"

timeout 90 "$mlarun" coordinator --listen "$addr" >"$tmp/coordinator.log" 2>&1 &
pids+=($!)
timeout 90 "$mlarun" sim-worker --coordinator "$addr" --groups 2 >"$tmp/sim-worker.log" 2>&1 &
pids+=($!)

# Wait (up to 20 s) until both simulated groups have registered.
PYTHONPATH="$tmp" timeout 30 "$python" - "$addr" <<'EOF' || fail "the 2 simulated groups did not register"
import sys, time
import grpc
import mlarun_pb2, mlarun_pb2_grpc
stub = mlarun_pb2_grpc.MlarunStub(grpc.insecure_channel(sys.argv[1]))
end = time.time() + 20
while time.time() < end:
    try:
        if stub.Health(mlarun_pb2.HealthRequest(), timeout=1).groups_connected == 2:
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(0.1)
sys.exit(1)
EOF

PYTHONPATH="$tmp" timeout 30 "$python" "$src/examples/python/submit.py" "$addr" 8 3 4 5 >"$tmp/submit.out" 2>"$tmp/submit.log" ||
  fail "submit.py exited with $?: $(cat "$tmp/submit.out")"
out=$(cat "$tmp/submit.out")
echo "$out"

[ "$(grep -c '^token [0-9]*: [0-9]* (logprob ' "$tmp/submit.out")" -eq 8 ] || fail "expected 8 token lines"
for i in 0 1 2 3 4 5 6 7; do
  grep -q "^token $i: " "$tmp/submit.out" || fail "token $i missing"
done
grep -qx 'finish_reason: length' "$tmp/submit.out" || fail "no 'finish_reason: length'"
grep -qE '^dp_group: [01]$' "$tmp/submit.out" || fail "no dp_group of the 2 groups"
grep -qx 'groups connected: 2' "$tmp/submit.out" || fail "GetStats did not report 2 connected groups"

# ---- The same, secured: TLS, client tokens, the worker secret ----------------
command -v openssl >/dev/null || early_fail "openssl not found (scripts/install-deps installs it)"
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 "${ec[@]}" -keyout "$tmp/ca.key" -out "$tmp/ca.crt" -days 3 -subj /CN=mlarun-test-ca \
  >"$tmp/openssl.log" 2>&1 || fail "openssl could not make the CA"
openssl req "${ec[@]}" -keyout "$tmp/server.key" -out "$tmp/server.csr" -subj /CN=localhost >>"$tmp/openssl.log" 2>&1 &&
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"$tmp/server.ext" &&
  openssl x509 -req -in "$tmp/server.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial -days 3 \
    -out "$tmp/server.crt" -extfile "$tmp/server.ext" >>"$tmp/openssl.log" 2>&1 || fail "openssl could not make the server certificate"
openssl rand -hex 32 >"$tmp/alice.token"
{ echo "# principals of the test"; echo "$(cat "$tmp/alice.token") alice"; openssl rand -hex 32; } >"$tmp/tokens"
openssl rand -hex 32 >"$tmp/worker.secret"
openssl rand -hex 32 >"$tmp/wrong.token"
sport=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
saddr="127.0.0.1:$sport"
timeout 60 "$mlarun" coordinator --listen "$saddr" --tls-cert "$tmp/server.crt" --tls-key "$tmp/server.key" \
  --auth-token-file "$tmp/tokens" --worker-secret-file "$tmp/worker.secret" >"$tmp/coordinator-tls.log" 2>&1 &
pids+=($!)
timeout 60 "$mlarun" sim-worker --coordinator "$saddr" --groups 2 --tls-ca "$tmp/ca.crt" \
  --worker-secret-file "$tmp/worker.secret" >"$tmp/sim-worker-tls.log" 2>&1 &
pids+=($!)
for _ in $(seq 200); do
  "$mlarun" stats --coordinator "$saddr" --tls-ca "$tmp/ca.crt" --auth-token-file "$tmp/alice.token" --json \
    >"$tmp/stats-tls.json" 2>/dev/null && [ "$(grep -o '"connected": *true' "$tmp/stats-tls.json" | wc -l)" -eq 2 ] &&
    break
  sleep 0.1
done
[ "$(grep -o '"connected": *true' "$tmp/stats-tls.json" 2>/dev/null | wc -l)" -eq 2 ] ||
  fail "the 2 simulated groups did not register over TLS with the secret"

PYTHONPATH="$tmp" timeout 30 "$python" "$src/examples/python/submit.py" --tls-ca "$tmp/ca.crt" \
  --auth-token-file "$tmp/alice.token" "$saddr" 8 3 4 5 >"$tmp/submit-tls.out" 2>"$tmp/submit-tls.log" ||
  fail "submit.py over TLS with a token exited with $?: $(cat "$tmp/submit-tls.log")"
# The simulated tokens are a function of the request: the same as in the clear.
diff <(grep '^token ' "$tmp/submit.out") <(grep '^token ' "$tmp/submit-tls.out") >/dev/null ||
  fail "the tokens over TLS differ from the plaintext run"
grep -qx 'groups connected: 2' "$tmp/submit-tls.out" || fail "GetStats over TLS did not report 2 connected groups"

# Refusals: no token, a wrong token, no TLS.
PYTHONPATH="$tmp" timeout 30 "$python" "$src/examples/python/submit.py" --tls-ca "$tmp/ca.crt" "$saddr" 8 3 4 5 \
  >/dev/null 2>"$tmp/refused.log" && fail "submit.py without a token was served"
grep -q 'UNAUTHENTICATED' "$tmp/refused.log" || fail "without a token: $(cat "$tmp/refused.log")"
"$mlarun" submit --coordinator "$saddr" --tls-ca "$tmp/ca.crt" --auth-token-file "$tmp/wrong.token" --prompt-ids 3,4,5 \
  --max-tokens 4 --timeout 10 >/dev/null 2>"$tmp/refused2.log" && fail "mlarun submit with a wrong token was served"
grep -q 'UNAUTHENTICATED' "$tmp/refused2.log" || fail "with a wrong token: $(cat "$tmp/refused2.log")"
"$mlarun" submit --coordinator "$saddr" --auth-token-file "$tmp/alice.token" --prompt-ids 3,4,5 --max-tokens 4 \
  --timeout 5 >/dev/null 2>"$tmp/refused3.log" && fail "mlarun submit in plaintext to the TLS port was served"
grep -q 'UNAVAILABLE' "$tmp/refused3.log" || fail "in plaintext: $(cat "$tmp/refused3.log")"
# The coordinator's own token file serves a client too: its first token (alice's).
"$mlarun" submit --coordinator "$saddr" --tls-ca "$tmp/ca.crt" --auth-token-file "$tmp/tokens" --prompt-ids 3,4,5 \
  --max-tokens 4 --ignore-eos --json --timeout 20 >"$tmp/submit-cli.json" 2>"$tmp/submit-cli.log" ||
  fail "mlarun submit over TLS with the token failed: $(cat "$tmp/submit-cli.log")"
grep -q '"tokens":\[' "$tmp/submit-cli.json" || fail "mlarun submit printed no tokens: $(cat "$tmp/submit-cli.json")"
# A bad token file is a usage error naming the flag.
printf 'short\n' >"$tmp/bad.tokens"
"$mlarun" coordinator --listen 127.0.0.1:0 --auth-token-file "$tmp/bad.tokens" >"$tmp/bad.log" 2>&1 && fail "a bad token file was accepted"
grep -q -- '--auth-token-file' "$tmp/bad.log" || fail "the bad token file's error: $(cat "$tmp/bad.log")"
echo "python_example_test: OK"
