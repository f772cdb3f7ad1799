#!/bin/bash
# `mlarun serve` takes the coordinator's queue and HTTP flags and gives them to
# its coordinator: with --max-queued 0 a request finds the queue full (429,
# not a wait for a group), a body beyond --http-max-body-bytes gets 413, and
# /v1/models names --served-model-name. A bad value of a shared flag is a
# usage error naming it, for serve and the coordinator alike. Either refuses
# --http beyond loopback without client tokens unless told
# --allow-unauthenticated, and then warns. No MPI: a stand-in mpirun that
# only sleeps plays the worker job.
#
#   serve_flags_test.sh MLARUN SOURCE_DIR
set -u
mlarun=$1 src=$2
name=serve_flags_test
work=$(mktemp -d)
logs=("$work/serve.log" "$work/usage.log")
serve_pid=
before_exit() { [ -n "$serve_pid" ] && kill -KILL "$serve_pid" 2>/dev/null; true; }
source "$src/scripts/lib/on_exit.sh"

model="$src/configs/models/tiny.yaml"
hport=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir "$work/bin"
printf '#!/bin/sh\necho "$@" >"%s/mpirun.args"\nexec sleep 300\n' "$work" >"$work/bin/mpirun"
chmod +x "$work/bin/mpirun"

PATH="$work/bin:$PATH" "$mlarun" serve --model "$model" --grpc 127.0.0.1:0 --http "127.0.0.1:$hport" --threads 1 \
  --max-queued 0 --queue-timeout-s 20 --lost-group-wait-s 1 --stall-timeout-s 10 --http-threads 4 \
  --http-max-body-bytes 2048 --http-request-timeout-s 60 --served-model-name flagged \
  --http-max-header-bytes 4096 --allowed-hosts llm.internal 2>"$work/serve.log" &
serve_pid=$!
for _ in $(seq 300); do
  grep -q "started the worker job" "$work/serve.log" && break
  kill -0 "$serve_pid" 2>/dev/null || fail "serve exited: $(tail -3 "$work/serve.log")"
  sleep 0.1
done
grep -q "started the worker job" "$work/serve.log" || fail "serve did not start its job within 30 s"

timeout 15 python3 - "$hport" <<'PY' || fail "the HTTP API did not apply serve's flags"
import json, sys, urllib.error, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=5))
assert [m["id"] for m in models["data"]] == ["flagged"], models

def post(body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as e:
        return e.code
    return 200

def get(path, headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code

# --allowed-hosts: its name is answered, another is not (DNS rebinding).
assert (code := get("/v1/models", {"Host": "llm.internal"})) == 200, code
assert (code := get("/v1/models", {"Host": "other.internal"})) == 403, code
# --http-max-header-bytes: a header block over 4096 bytes gets 431.
assert (code := get("/v1/models", {"X-Pad": "p" * 5000})) == 431, code
# A body over 2048 bytes: 413 before anything is queued.
assert (code := post({"model": "flagged", "prompt": "x" * 3000, "max_tokens": 1})) == 413, code
# No group registered and no room in the queue: 429 at once (the default
# queue would hold it for --queue-timeout-s, beyond this call's 10 s).
assert (code := post({"model": "flagged", "prompt": "hi", "max_tokens": 1})) == 429, code
PY

kill -TERM "$serve_pid"
wait "$serve_pid"
rc=$?
serve_pid=
[ "$rc" = 0 ] || fail "serve exited with $rc after SIGTERM"

# vLLM's spellings: MODEL, --host/--port, -tp/-dp with --enable-dp-attention
# (the job's --parallel), --max-model-len (requests beyond it refused in
# vLLM's words) and --api-key (a bearer token like a file's).
key=$(openssl rand -hex 16)
vport=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rm -f "$work/mpirun.args"
PATH="$work/bin:$PATH" "$mlarun" serve "$model" --host 127.0.0.1 --port "$vport" -tp 1 -dp 2 --enable-dp-attention \
  --max-model-len 512 --api-key "$key" --grpc 127.0.0.1:0 --threads 1 --max-queued 0 2>"$work/serve.log" &
serve_pid=$!
for _ in $(seq 300); do
  grep -q "started the worker job" "$work/serve.log" && break
  kill -0 "$serve_pid" 2>/dev/null || fail "serve with vLLM's flags exited: $(tail -3 "$work/serve.log")"
  sleep 0.1
done
for _ in $(seq 100); do [ -s "$work/mpirun.args" ] && break; sleep 0.1; done  # the stand-in may lag the log line
grep -q -- "-np 2 .* worker .*--model $model --parallel dp=2,attn_tp=1 " "$work/mpirun.args" ||
  fail "the job's command line: $(cat "$work/mpirun.args")"
timeout 15 python3 - "$vport" "$key" <<'PY' || fail "the HTTP API did not apply vLLM's flags"
import json, sys, urllib.error, urllib.request
base, key = f"http://127.0.0.1:{sys.argv[1]}", sys.argv[2]

def call(path, body=None, token=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    data = None if body is None else json.dumps(body).encode()
    try:
        r = urllib.request.urlopen(urllib.request.Request(base + path, data=data, headers=headers), timeout=5)
        return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)

assert call("/v1/models")[0] == 401
assert call("/v1/models", token="wrong" * 8)[0] == 401
code, models = call("/v1/models", token=key)
assert code == 200 and models["data"][0]["id"] == "tiny", models
code, e = call("/v1/completions", {"prompt": [1] * 500, "max_tokens": 13}, token=key)
assert code == 400 and e["error"]["message"].startswith(
    "This model's maximum context length is 512 tokens. However, you requested 513 tokens"), (code, e)
PY
kill -TERM "$serve_pid"
wait "$serve_pid"
serve_pid=
# Combinations that do not map onto --parallel, and --http with --host.
for case in "-dp 2|without --enable-dp-attention" "-tp 2 --parallel dp=2|--parallel or --tensor-parallel-size" \
  "--enable-dp-attention|needs --data-parallel-size" "--http 127.0.0.1:0 --port 8001|--http or --host/--port" \
  "--model $src/configs/models/other.yaml|differ: give one" "--api-key short|--api-key: at least 16"; do
  bad=${case%%|*} want=${case#*|}
  # shellcheck disable=SC2086
  PATH="$work/bin:$PATH" timeout 30 "$mlarun" serve "$model" $bad >"$work/usage.log" 2>&1
  rc=$?
  [ "$rc" = 2 ] && grep -qF -- "$want" "$work/usage.log" && ! grep -q "started the worker job" "$work/usage.log" ||
    fail "mlarun serve $bad: exit $rc, $(head -2 "$work/usage.log")"
done
[ "$("$mlarun" --version)" = "$(sed -n 's/^project(mlarun VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")" ] ||
  fail "mlarun --version: $("$mlarun" --version)"

# Bad values: usage errors (exit 2) naming the flag, in both commands.
for cmd in serve coordinator; do
  for bad in "--max-queued -1" "--http-threads 0" "--http-max-body-bytes 10" "--queue-timeout-s 0" \
    "--http-header-timeout-s 0" "--http-max-connections 0" "--http-max-header-bytes 100"; do
    # shellcheck disable=SC2086
    "$mlarun" $cmd --model "$model" $bad >"$work/usage.log" 2>&1
    rc=$?
    [ "$rc" = 2 ] && grep -q -- "${bad% *}" "$work/usage.log" ||
      fail "mlarun $cmd $bad: exit $rc, $(head -2 "$work/usage.log")"
  done
done
# A --model that is not a model: exit 2 saying what is wrong with the path
# (not a missing tokenizer), before anything starts. The coordinator needs
# only a tokenizer, and says so of a path without one.
mkdir "$work/empty" "$work/broken"
echo '{"model_type": ' >"$work/broken/config.json"
for case in "$src/configs/models/nope.yaml|nope.yaml: no such file or directory" \
  "$work/empty|empty: not a checkpoint directory (it has no config.json)" \
  "$work/broken|broken/config.json: malformed JSON" "$work/broken/config.json|not a model YAML"; do
  path=${case%%|*} want=${case#*|}
  PATH="$work/bin:$PATH" timeout 30 "$mlarun" serve --model "$path" --grpc 127.0.0.1:0 >"$work/usage.log" 2>&1
  rc=$?
  [ "$rc" = 2 ] && grep -qF -- "--model: $path" "$work/usage.log" && grep -qF -- "$want" "$work/usage.log" &&
    ! grep -q "tokenizer\|started the worker job" "$work/usage.log" ||
    fail "mlarun serve --model $path: exit $rc, $(head -2 "$work/usage.log")"
done
for case in "$src/configs/models/nope.yaml|nope.yaml: no such file or directory" \
  "$work/empty|empty: not a model YAML, checkpoint or tokenizer directory (it has no tokenizer.json)"; do
  path=${case%%|*} want=${case#*|}
  timeout 30 "$mlarun" coordinator --model "$path" --listen 127.0.0.1:0 --http 127.0.0.1:0 >"$work/usage.log" 2>&1
  rc=$?
  [ "$rc" != 0 ] && grep -qF -- "$want" "$work/usage.log" ||
    fail "mlarun coordinator --model $path: exit $rc, $(head -2 "$work/usage.log")"
done

# --http beyond loopback without client tokens: refused before anything
# starts (exit 2, naming the way out), by serve and the coordinator alike.
for cmd in "serve --grpc 127.0.0.1:0" "coordinator --listen 127.0.0.1:0"; do
  for http in 0.0.0.0:0 "[::]:0" 10.11.12.13:0; do
    # shellcheck disable=SC2086
    PATH="$work/bin:$PATH" timeout 30 "$mlarun" $cmd --model "$model" --http "$http" >"$work/usage.log" 2>&1
    rc=$?
    [ "$rc" = 2 ] && grep -qF -- "--http binds beyond loopback (got '$http')" "$work/usage.log" &&
      grep -q -- "--allow-unauthenticated" "$work/usage.log" && ! grep -q "started the worker job" "$work/usage.log" ||
      fail "mlarun $cmd --http $http without tokens: exit $rc, $(head -2 "$work/usage.log")"
  done
done

# Allowed: with --allow-unauthenticated (a warning), or with client tokens
# (no warning); the HTTP API then answers on the address beyond loopback.
echo "$(openssl rand -hex 32) alice" >"$work/tokens"
for cmd in "serve --grpc 127.0.0.1:0" "coordinator --listen 127.0.0.1:0"; do
  for how in --allow-unauthenticated "--auth-token-file $work/tokens"; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # shellcheck disable=SC2086
    PATH="$work/bin:$PATH" "$mlarun" $cmd --model "$model" --http "0.0.0.0:$port" $how 2>"$work/serve.log" &
    serve_pid=$!
    # /health answers 503 while no group is connected: an answer all the same.
    health() { curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health"; }
    for _ in $(seq 300); do
      [ "$(health)" = 503 ] && break
      kill -0 "$serve_pid" 2>/dev/null || fail "mlarun $cmd --http 0.0.0.0 $how exited: $(tail -2 "$work/serve.log")"
      sleep 0.1
    done
    [ "$(health)" = 503 ] || fail "mlarun $cmd --http 0.0.0.0 $how: no HTTP API"
    kill -TERM "$serve_pid"
    wait "$serve_pid"
    serve_pid=
    if [ "$how" = --allow-unauthenticated ]; then
      grep -q "warning: the HTTP API on 0.0.0.0:$port takes requests from anyone" "$work/serve.log" ||
        fail "mlarun $cmd $how: no warning"
    else
      ! grep -q "warning" "$work/serve.log" || fail "mlarun $cmd $how: a warning: $(grep warning "$work/serve.log")"
    fi
  done
done
echo "serve_flags_test: ok"
