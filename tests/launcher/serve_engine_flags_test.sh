#!/bin/bash
# vLLM's engine and tokenizer flags of `mlarun serve`: --kv-cache-dtype,
# --max-num-seqs, --max-num-batched-tokens and --[no-]enable-prefix-caching
# reach the worker job as its flags; --parallel takes tp8 / dp2xtp4 as well
# as dp=2,attn_tp=4; --tokenizer serves a model without one, and
# --skip-tokenizer-init serves none (token ids only); --chat-template is
# read from a file or taken as it is. What mlarun cannot do is refused with
# a message, and a mistyped flag of serve, coordinator, worker or memory is
# told the flag it most likely meant. `mlarun coordinator --max-model-len`
# bounds the context at the front door. No MPI: a stand-in mpirun that only
# sleeps plays the worker job.
#
#   serve_engine_flags_test.sh MLARUN SOURCE_DIR
set -u
mlarun=$1 src=$2
name=serve_engine_flags_test
work=$(mktemp -d)
logs=("$work/serve.log" "$work/usage.log")
serve_pid=
before_exit() { [ -n "$serve_pid" ] && kill -KILL "$serve_pid" 2>/dev/null; true; }
source "$src/scripts/lib/on_exit.sh"

model="$src/configs/models/tiny.yaml"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mkdir "$work/bin"
printf '#!/bin/sh\necho "$@" >"%s/mpirun.args"\nexec sleep 300\n' "$work" >"$work/bin/mpirun"
chmod +x "$work/bin/mpirun"

# Starts `mlarun serve ARGS...` in the background and waits for its job.
start_serve() {
  rm -f "$work/mpirun.args"
  PATH="$work/bin:$PATH" "$mlarun" serve --grpc 127.0.0.1:0 --threads 1 --max-queued 0 "$@" 2>"$work/serve.log" &
  serve_pid=$!
  for _ in $(seq 300); do
    [ -s "$work/mpirun.args" ] && return 0
    kill -0 "$serve_pid" 2>/dev/null || fail "serve $* exited: $(tail -3 "$work/serve.log")"
    sleep 0.1
  done
  fail "serve $* did not start its job within 30 s"
}
stop_serve() {
  kill -TERM "$serve_pid"
  wait "$serve_pid"
  serve_pid=
}
# POSTs JSON to the HTTP API on port $1, path $2; prints "STATUS BODY".
post() {
  python3 - "$@" <<'PY'
import json, sys, urllib.error, urllib.request
port, path, body = sys.argv[1], sys.argv[2], sys.argv[3]
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body.encode(),
                             headers={"Content-Type": "application/json"})
try:
    r = urllib.request.urlopen(req, timeout=10)
    print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
PY
}

# The engine flags, as the worker job's own, in both layout spellings.
for parallel in "dp2xtp2|-np 4" "tp2|-np 2" "dp=2,attn_tp=2|-np 4"; do
  layout=${parallel%%|*} np=${parallel#*|}
  start_serve --model "$model" --http "" --parallel "$layout" --kv-cache-dtype bfloat16 --max-num-seqs 7 \
    --max-num-batched-tokens 256 --no-enable-prefix-caching
  args=$(cat "$work/mpirun.args")
  for want in "$np " "--parallel $layout " "--kv-dtype bf16" "--max-num-seqs 7" "--max-batched-tokens 256" \
    "--no-enable-prefix-caching"; do
    [[ "$args" == *"$want"* ]] || fail "serve --parallel $layout: no '$want' in the job's command line: $args"
  done
  stop_serve
done
start_serve --model "$model" --http "" --kv-cache-dtype auto --enable-prefix-caching
args=$(cat "$work/mpirun.args")
[[ "$args" != *--kv-dtype* && "$args" == *"--enable-prefix-caching"* ]] || fail "auto / prefix caching: $args"
stop_serve
# The worker's own flags that matter, as serve's, passed on as given.
start_serve --model "$model" --http "" --device cuda --weights copied --block-size 32 --memory-gib 2.5 \
  --fp8-weights dequantize --lm-head int8
args=$(cat "$work/mpirun.args")
for want in "--device cuda" "--weights copied" "--block-size 32" "--memory-gib 2.5" "--fp8-weights dequantize" \
  "--lm-head int8"; do
  [[ "$args" == *"$want"* ]] || fail "no '$want' in the job's command line: $args"
done
stop_serve

# Refused before anything starts: exit 2 and a message naming the problem.
echo "chat" >"$work/not-a-template-dir-name"
for case in "--kv-cache-dtype fp8|mlarun's latent cache holds bf16 or fp32, not fp8" \
  "--kv-cache-dtype fp8_e4m3|not fp8" "--kv-cache-dtype int4|expected auto, bfloat16 (bf16) or float32" \
  "--kv-cache-dtype bf16 --worker-arg=--kv-dtype --worker-arg=fp32|--kv-cache-dtype and --worker-arg=--kv-dtype" \
  "--max-num-seqs 4 --worker-arg=--max-num-seqs=8|--max-num-seqs and --worker-arg=--max-num-seqs=8" \
  "--max-num-seqs 0|--max-num-seqs" "--block-size 32 --worker-arg=--block-size=64|--block-size and --worker-arg" \
  "--memory-gib 2 --cache-bytes 1000|excludes" "--block-size 0|--block-size" "--parallel dp2xtp|expected key=value, or tpN, dpN or dpAxtpB" \
  "--parallel tp0|must be positive" "--parallel pp2|\"pp2\"" \
  "--chat-template $work/no-such-template|no such file (nor a template" \
  "--skip-tokenizer-init --tokenizer $src/configs/models/tiny-tokenizer|no --tokenizer or --chat-template"; do
  bad=${case%%|*} want=${case#*|}
  # shellcheck disable=SC2086
  PATH="$work/bin:$PATH" timeout 30 "$mlarun" serve --model "$model" --grpc 127.0.0.1:0 $bad >"$work/usage.log" 2>&1
  rc=$?
  [ "$rc" = 2 ] && grep -qF -- "$want" "$work/usage.log" && ! grep -q "started the worker job" "$work/usage.log" ||
    fail "mlarun serve $bad: exit $rc, $(head -2 "$work/usage.log")"
done

# A model whose YAML names no tokenizer: refused over HTTP unless
# --tokenizer gives one, or --skip-tokenizer-init serves token ids.
grep -v '^tokenizer:' "$model" >"$work/no-tokenizer.yaml"
PATH="$work/bin:$PATH" timeout 30 "$mlarun" serve --model "$work/no-tokenizer.yaml" --grpc 127.0.0.1:0 \
  --http 127.0.0.1:0 >"$work/usage.log" 2>&1
grep -q "has no tokenizer" "$work/usage.log" || fail "a model without tokenizer: $(head -2 "$work/usage.log")"
port=$(free_port)
printf '%s' "{% for m in messages %}[{{ m['content'] }}]{% endfor %}" >"$work/template.jinja"
start_serve --model "$work/no-tokenizer.yaml" --tokenizer "$src/configs/models/tiny-tokenizer" \
  --http "127.0.0.1:$port" --chat-template "$work/template.jinja"
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
out=$(post "$port" /tokenize '{"messages": [{"role": "user", "content": "hi"}]}')
want=$(post "$port" /tokenize '{"prompt": "[hi]", "add_special_tokens": false}')
[ "${out%% *}" = 200 ] && [ "$(echo "${out#* }" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')" = \
  "$(echo "${want#* }" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')" ] ||
  fail "--tokenizer with --chat-template FILE: $out vs $want"
stop_serve
port=$(free_port)
start_serve --model "$work/no-tokenizer.yaml" --skip-tokenizer-init --http "127.0.0.1:$port"
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
out=$(post "$port" /v1/completions '{"prompt": "hello", "max_tokens": 2}')
[ "${out%% *}" = 400 ] && [[ "$out" == *"--skip-tokenizer-init"* ]] || fail "a text prompt without tokenizer: $out"
out=$(post "$port" /v1/completions '{"prompt": [1, 2, 3], "max_tokens": 2}')
[ "${out%% *}" = 429 ] || fail "a token-id prompt without tokenizer (no group, no queue: 429): $out"
stop_serve

# --max-model-len at the coordinator's front door, in vLLM's words.
port=$(free_port)
"$mlarun" coordinator --model "$model" --listen 127.0.0.1:0 --http "127.0.0.1:$port" --max-model-len 64 \
  --chat-template "{{ messages[0]['content'] }}" 2>"$work/serve.log" &
serve_pid=$!
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
out=$(post "$port" /v1/completions "{\"prompt\": [$(seq -s, 1 60)], \"max_tokens\": 10}")
[ "${out%% *}" = 400 ] && [[ "$out" == *"maximum context length is 64 tokens. However, you requested 70 tokens"* ]] ||
  fail "coordinator --max-model-len 64: $out"
out=$(post "$port" /tokenize '{"messages": [{"role": "user", "content": "as is"}]}')
want=$(post "$port" /tokenize '{"prompt": "as is", "add_special_tokens": false}')
[ "$out" = "$want" ] || fail "coordinator --chat-template STRING: $out vs $want"
stop_serve

# The coordinator with --tokenizer alone: the tokenizer's directory names
# the model.
port=$(free_port)
"$mlarun" coordinator --tokenizer "$src/configs/models/tiny-tokenizer" --listen 127.0.0.1:0 \
  --http "127.0.0.1:$port" 2>"$work/serve.log" &
serve_pid=$!
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
out=$(curl -s "http://127.0.0.1:$port/v1/models")
[[ "$out" == *'"id":"tiny-tokenizer"'* ]] || fail "coordinator --tokenizer without --model: $out"
stop_serve

# A mistyped flag: the one meant, for each serving command.
for case in "serve --max-modle-len 5|serve: unknown flag --max-modle-len (did you mean --max-model-len?)" \
  "serve --max_num_batched_tokens 5|(did you mean --max-num-batched-tokens?)" \
  "serve -max-model-len 5|unknown flag -max-model-len (did you mean --max-model-len?)" \
  "serve --kv-cache-dtyp fp8|(did you mean --kv-cache-dtype?)" \
  "coordinator --max-modle-len 5|coordinator: unknown flag --max-modle-len (did you mean --max-model-len?)" \
  "worker --max-num-seq 5|worker: unknown flag --max-num-seq (did you mean --max-num-seqs?)" \
  "worker --no-enable-prefix-cache|(did you mean --no-enable-prefix-caching?)" \
  "memory --layout tp8|memory: unknown flag --layout (did you mean --layouts?)"; do
  cmd=${case%%|*} want=${case#*|}
  # shellcheck disable=SC2086
  "$mlarun" $cmd >"$work/usage.log" 2>&1
  rc=$?
  [ "$rc" = 2 ] && grep -qF -- "$want" "$work/usage.log" || fail "mlarun $cmd: exit $rc, $(head -2 "$work/usage.log")"
done
# memory takes serve's layout form and the short one alike.
a=$("$mlarun" memory --model "$model" --world 4 --layouts dp=2,attn_tp=2,tp4 --json) || fail "memory --layouts"
b=$("$mlarun" memory --model "$model" --world 4 --layouts dp2xtp2,attn_tp=4 --json) || fail "memory --layouts short"
[ "$a" = "$b" ] || fail "memory: the two layout forms differ"
echo "serve_engine_flags_test: ok"
