#!/bin/bash
# The pause of a live migration (`mlarun migrate`): a coordinator and
# `mpirun -np 2 mlarun worker --parallel dp=2` on one host, one request of
# N prompt tokens generating on group A, moved to group B; the pause is the
# coordinator's (last token from A to first token from B). Per N and per
# transfer mode, alternating the modes round by round:
#   off  B computes the request's N + k rows again (a prefill of N + k)
#   shm  B fetches A's blocks over UCX shared memory (mlarun worker --transfer shm)
#   any  the same over any transport (TCP on the loopback here)
# Prints one line per run and the medians: pause, bytes fetched (from the
# ranks' transfer_bytes), the request's own rows (N + k) x bytes per token,
# and its time to first token on A (the prefill the move spares).
# Usage: bench/migration_pause.sh --model DIR|YAML [--tokens 1024,4096,16384]
#          [--modes off,shm] [--rounds 3] [--mlarun PATH] [--threads 1]
#          [--max-tokens 48]   (each request's; enough to still run when moved)
#          [--run-prefix WORDS] [--listen-host HOST] [--mpirun-args WORDS]
# Across hosts (tests/multihost/migration_pause_hosts.sh): --run-prefix runs
# every command (coordinator, mpirun, clients) through it, e.g. an agent that
# enters one host's network namespace; --listen-host is the coordinator's
# address there; --mpirun-args replace the one-host defaults (a hostfile, the
# agent, the interfaces).
set -eu -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
MLARUN=${MLARUN:-$here/../build/release/mlarun}
MODEL="" TOKENS=1024,4096,16384 MODES=off,shm ROUNDS=3 THREADS=1 MAX_TOKENS=48
RUN_PREFIX="" LISTEN_HOST=127.0.0.1 MPIRUN_ARGS="--oversubscribe --mca pml ob1 --mca btl self,vader,tcp"
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --modes) MODES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --mlarun) MLARUN=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --run-prefix) RUN_PREFIX=$2; shift 2 ;;
    --listen-host) LISTEN_HOST=$2; shift 2 ;;
    --mpirun-args) MPIRUN_ARGS=$2; shift 2 ;;
    *) echo "migration_pause: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$MODEL" ] || { echo "migration_pause: --model is required" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
name=migration_pause
work=$(mktemp -d)
# Words split on any whitespace, newlines included.
read -r -d '' -a run <<<"$RUN_PREFIX" || true
read -r -d '' -a mpirun_args <<<"$MPIRUN_ARGS" || true
source "$here/lib/two_groups.sh"
trap 'stop_two_groups; rm -rf "$work"' EXIT

start() { start_two_groups --policy round_robin -- --transfer "$1"; }  # $1: transfer mode

one() {  # $1: mode, $2: prompt tokens, $3: round -> one line
  local id="pause-$1-$2-$3" before after
  before=$(stats | python3 -c "import json,sys; print(sum(int(r.get('transfer_bytes', 0)) for r in json.load(sys.stdin)['ranks']))")
  local prompt
  prompt=$(python3 -c "import random; r = random.Random($2 + $3); print(','.join(str(r.randrange(2, 500)) for _ in range($2)))")
  "${run[@]}" "$MLARUN" submit --coordinator "$addr" --request-id "$id" --prompt-ids "$prompt" --max-tokens "$MAX_TOKENS" --ignore-eos \
    --timeout 600 >"$work/$id.out" 2>"$work/$id.err" &
  local submit=$!
  # Moved once it has a few tokens, so the pause is a decode's gap.
  for _ in $(seq 1500); do
    kill -0 "$submit" 2>/dev/null || { echo "migration_pause: the request ended early: $(cat "$work/$id.err")" >&2; exit 1; }
    stats | python3 -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if sum(int(g.get('tokens_generated', 0)) for g in d['groups']) >= $(cat "$work/tokens") + 4 else 1)" && break
    sleep 0.02
  done
  "${run[@]}" "$MLARUN" migrate --coordinator "$addr" --request-id "$id" --timeout 600 >"$work/$id.move" 2>&1 ||
    { echo "migration_pause: migrate failed: $(cat "$work/$id.move")" >&2; exit 1; }
  wait "$submit" || { echo "migration_pause: submit failed: $(cat "$work/$id.err")" >&2; exit 1; }
  stats >"$work/stats.json"
  python3 - "$work" "$id" "$1" "$2" "$before" <<'PY'
import json, re, sys
work, rid, mode, n, before = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
move = open(f"{work}/{rid}.move").read()
pause = float(re.search(r"paused ([0-9.]+) ms", move).group(1))
k = int(re.search(r"after (\d+) tokens", move).group(1))
d = json.load(open(f"{work}/stats.json"))
fetched = sum(int(r.get("transfer_bytes", 0)) for r in d["ranks"]) - before
per_token = int(d["ranks"][0]["cache_bytes_per_token"])
tokens = sum(int(g.get("tokens_generated", 0)) for g in d["groups"])
open(f"{work}/tokens", "w").write(str(tokens))
ttft = float(re.search(r"first token ([0-9.]+) ms", open(f"{work}/{rid}.out").read()).group(1))
rows = n + k - 1
print(json.dumps({"mode": mode, "prompt_tokens": n, "tokens_before": k, "pause_ms": pause, "fetched_bytes": fetched,
                  "row_bytes": rows * per_token, "first_token_ms": ttft}))
PY
}

IFS=, read -r -a modes <<<"$MODES"
IFS=, read -r -a sizes <<<"$TOKENS"
for round in $(seq "$ROUNDS"); do
  for mode in "${modes[@]}"; do
    start "$mode"
    echo 0 >"$work/tokens"
    for n in "${sizes[@]}"; do
      one "$mode" "$n" "$round" >>"$work/runs.jsonl"
      tail -1 "$work/runs.jsonl"
    done
    stop_two_groups
  done
done
python3 - "$work/runs.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'prompt':>8} {'mode':>5} {'pause ms':>10} {'fetched MB':>11} {'rows MB':>8} {'TTFT on A ms':>13}")
for n in sorted({r["prompt_tokens"] for r in runs}):
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rs = [r for r in runs if r["prompt_tokens"] == n and r["mode"] == mode]
        if not rs: continue
        med = lambda k: statistics.median(r[k] for r in rs)
        print(f"{n:>8} {mode:>5} {med('pause_ms'):>10.1f} {med('fetched_bytes') / 1e6:>11.2f} "
              f"{med('row_bytes') / 1e6:>8.2f} {med('first_token_ms'):>13.1f}  ({len(rs)} runs: "
              + ", ".join("%.1f" % r["pause_ms"] for r in rs) + ")")
PY
