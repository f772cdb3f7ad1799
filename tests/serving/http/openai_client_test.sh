#!/usr/bin/env bash
# The HTTP API with the official `openai` Python client: `mlarun coordinator
# --http` with the tiny model's tokenizer, one real worker under mpirun, and
# openai_client_test.py doing completions and chat, streamed and whole, stop
# strings, n=2, usage, errors; the text must equal the tokenizer's decode
# (the `tokenizers` package) of the tokens `mlarun generate` gives for the
# same prompt ids and seed (for chat: the template rendered with jinja2 as
# transformers renders it); structured output and forced tool calls (their
# texts checked when the worker enforces constraints), a tool call's round
# trip through DeepSeek-V3's template; and, from two more coordinators over
# simulated groups whose tokens are scripted, an R1 stream
# (reasoning_content, then content; --reasoning-parser deepseek_r1) and a
# JSON answer as parse() and a named call's tool_calls read it.
#
#   openai_client_test.sh MLARUN_BINARY SOURCE_DIR [VENV_DIR]
#
# The venv (openai and tokenizers pinned) is made in VENV_DIR (default: a
# scratch folder) and reused when it is already there. Exit 0 on success,
# 77 (skipped) only when the packages cannot be downloaded (no package
# index reachable), anything else on failure. Everything runs under
# `timeout`; the servers die with the script.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 MLARUN_BINARY SOURCE_DIR [VENV_DIR]" >&2
  exit 2
fi
mlarun=$1
src=$2
venv=${3:-}
openai_version=3.51.0
tokenizers_version=0.23.3
jinja2_version=3.1.6
pydantic_version=2.14.4

if [ -z "${MLARUN_OPENAI_TEST_INNER:-}" ]; then
  MLARUN_OPENAI_TEST_INNER=1 timeout -k 5 280 bash "$0" "$@" && rc=0 || rc=$?
  [ "$rc" -eq 124 ] && echo "openai_client_test: timed out" >&2
  exit "$rc"
fi

tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 124' TERM INT
fail() {
  echo "openai_client_test: FAILED: $*" >&2
  for log in "$tmp"/*.log; do
    [ -f "$log" ] && { echo "--- $(basename "$log")" >&2; tail -30 "$log" >&2; }
  done
  exit 1
}

tokenizer_json="$src/configs/models/tiny-tokenizer/tokenizer.json"
[ -f "$tokenizer_json" ] || fail "$tokenizer_json is missing (configs/models/tiny.yaml names it)"
[ -x "$mlarun" ] || fail "$mlarun is not executable"

# ---- The venv -------------------------------------------------------------------
[ -n "$venv" ] || venv="$tmp/venv"
if ! "$venv/bin/python" -c "import openai, tokenizers, jinja2, pydantic; assert openai.__version__ == '$openai_version' and pydantic.VERSION == '$pydantic_version'" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv" >"$tmp/venv.log" 2>&1 || fail "python3 -m venv failed (python3-venv)"
  if ! timeout 180 "$venv/bin/pip" install --disable-pip-version-check -q "openai==$openai_version" \
      "tokenizers==$tokenizers_version" "jinja2==$jinja2_version" "pydantic==$pydantic_version" >>"$tmp/venv.log" 2>&1; then
    if grep -qiE "connection|network is unreachable|temporary failure in name resolution|timed out|proxyerror|no matching distribution|could not find a version" "$tmp/venv.log"; then
      echo "openai_client_test: SKIPPED: the Python packages cannot be downloaded: $(tail -1 "$tmp/venv.log")"
      rm -rf "$venv"
      exit 77
    fi
    fail "pip install openai==$openai_version tokenizers==$tokenizers_version jinja2==$jinja2_version pydantic==$pydantic_version failed"
  fi
fi
python="$venv/bin/python"

# ---- The deployment: coordinator with --http, one worker rank -----------------------
free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }
addr=127.0.0.1:$(free_port)
http=127.0.0.1:$(free_port)
timeout 250 "$mlarun" coordinator --listen "$addr" --http "$http" --model "$src/configs/models/tiny.yaml" \
  >"$tmp/coordinator.log" 2>&1 &
pids+=($!)
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  timeout 250 mpirun --oversubscribe --mca pml ob1 --mca btl self,vader,tcp -np 1 \
  "$mlarun" worker --coordinator "$addr" --model "$src/configs/models/tiny.yaml" --threads 1 --kv-dtype fp32 \
  >"$tmp/worker.log" 2>&1 &
pids+=($!)
# Two deployments of a simulated group whose tokens, for every request, are
# those of a scripted text: sim_deployment NAME TEXT [COORDINATOR FLAGS...]
# sets NAME_http. r1: a reasoning answer (random weights never write
# </think>); json: a JSON answer, the client's side of constrained answers.
sim_deployment() {
  local name=$1 text=$2 script a h
  shift 2
  script=$("$python" -c "import sys; from tokenizers import Tokenizer
print(','.join(map(str, Tokenizer.from_file(sys.argv[1]).encode(sys.argv[2], add_special_tokens=False).ids)))" \
    "$tokenizer_json" "$text")
  a=127.0.0.1:$(free_port)
  h=127.0.0.1:$(free_port)
  timeout 250 "$mlarun" coordinator --listen "$a" --http "$h" --model "$src/configs/models/tiny.yaml" "$@" \
    >"$tmp/$name-coordinator.log" 2>&1 &
  pids+=($!)
  timeout 250 "$mlarun" sim-worker --coordinator "$a" --vocab-size 512 --tokens-per-s 200 --script "$script" \
    >"$tmp/$name-sim-worker.log" 2>&1 &
  pids+=($!)
  printf -v "${name}_http" '%s' "$h"
}
r1_text=$'<think>\nwhy 2 < 3? </thi nk é</think>\n\nBecause. <think>x'
sim_deployment r1 "$r1_text" --reasoning-parser deepseek_r1
json_text='{"ok":false,"kind":"dog"}'
sim_deployment json "$json_text"
for url in "http://$http/health" "http://$r1_http/health" "http://$json_http/health"; do
  for _ in $(seq 300); do
    "$python" -c "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('$url', timeout=1).status == 200 else 1)" \
      2>/dev/null && break
    sleep 0.1
  done
  "$python" -c "import urllib.request; urllib.request.urlopen('$url', timeout=1)" 2>/dev/null ||
    fail "a DP group did not register ($url is not 200)"
done

# `mlarun generate` on this process gives the reference tokens: the script
# asks for them through this helper (JSON lines in, JSON lines out).
cat >"$tmp/generate.sh" <<EOF
#!/bin/sh
exec "$mlarun" generate --model "$src/configs/models/tiny.yaml" --threads 1 --kv-dtype fp32 --prompts "\$1" --json 2>/dev/null
EOF
chmod +x "$tmp/generate.sh"

timeout 200 "$python" "$src/tests/serving/http/openai_client_test.py" "http://$http/v1" "$tokenizer_json" "$tmp/generate.sh" \
  "$tmp" "http://$r1_http/v1" "$r1_text" "http://$json_http/v1" "$json_text" >"$tmp/client.log" 2>&1 || fail "openai_client_test.py: $(tail -5 "$tmp/client.log")"
cat "$tmp/client.log"
echo "openai_client_test: OK"
