#!/bin/bash
# What fetching a cached prompt prefix from another DP group saves
# (--prefix-fetch-min-tokens): a coordinator routing round robin and
# `mpirun -np 2 mlarun worker --parallel dp=2 --transfer shm` on one host.
# Per prompt size N, three requests one after another, each with the same
# N-token prefix and a 3-token tail of its own, 1 token each:
#   cold   the first, on group A: its whole prompt computed
#   other  the second, on group B: with fetch on (mode "fetch") B fetches
#          A's blocks of the prefix and computes the rest; with fetch off
#          (mode "off", --prefix-fetch-min-tokens 0) B computes it all
#   own    the third, back on A: its own prefix cache holds the prefix
# Times to first token are the coordinator's (submit's "first token"),
# after a short request on each group (first touches). Modes alternate
# round by round, each on a fresh deployment; a round's prompts are the
# same in both modes. Prints one line per run, the medians, and each
# round's other-group ratio fetch / off.
# Usage: bench/prefix_fetch.sh --model DIR|YAML [--tokens 1024,4096]
#          [--modes off,fetch] [--rounds 3] [--mlarun PATH] [--threads 1]
set -eu -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
MLARUN=${MLARUN:-$here/../build/release/mlarun}
MODEL="" TOKENS=1024,4096 MODES=off,fetch ROUNDS=3 THREADS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --modes) MODES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --mlarun) MLARUN=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    *) echo "prefix_fetch: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$MODEL" ] || { echo "prefix_fetch: --model is required" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
name=prefix_fetch
work=$(mktemp -d)
run=()
mpirun_args=(--oversubscribe --mca pml ob1 --mca btl self,vader,tcp)
source "$here/lib/two_groups.sh"
trap 'stop_two_groups; rm -rf "$work"' EXIT

start() {  # $1: mode
  local min=1
  [ "$1" = off ] && min=0
  start_two_groups --policy round_robin --prefix-fetch-min-tokens "$min" -- --transfer shm
}

ttft() {  # $1: request id, $2: prompt ids -> ms
  "$MLARUN" submit --coordinator "$addr" --request-id "$1" --prompt-ids "$2" --max-tokens 1 --ignore-eos \
    --timeout 600 >"$work/$1.out" 2>"$work/$1.err" || { echo "prefix_fetch: $1 failed: $(cat "$work/$1.err")" >&2; exit 1; }
  python3 -c "import re,sys; print(re.search(r'first token ([0-9.]+) ms', open(sys.argv[1]).read()).group(1))" "$work/$1.out"
}

warm_up() {  # a short request on each group: first touches are not timed
  local i
  for i in 1 2; do ttft "warm-$i-$1" "$(python3 -c "import random; r = random.Random($i); print(','.join(str(r.randrange(2, 500)) for _ in range(200)))")" >/dev/null; done
}

one() {  # $1: mode, $2: prompt tokens, $3: round -> one line
  local prefix cold other own
  prefix=$(python3 -c "import random; r = random.Random($2 * 7 + $3); print(','.join(str(r.randrange(2, 500)) for _ in range($2)))")
  cold=$(ttft "cold-$1-$2-$3" "$prefix,11,12,13")
  other=$(ttft "other-$1-$2-$3" "$prefix,21,22,23")
  own=$(ttft "own-$1-$2-$3" "$prefix,31,32,33")
  stats >"$work/stats.json"
  python3 - "$work/stats.json" "$1" "$2" "$cold" "$other" "$own" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = d["coordinator"]
print(json.dumps({"mode": sys.argv[2], "prompt_tokens": int(sys.argv[3]), "cold_ms": float(sys.argv[4]),
                  "other_ms": float(sys.argv[5]), "own_ms": float(sys.argv[6]),
                  "fetches": int(c.get("prefix_fetches", 0)), "fetch_tokens": int(c.get("prefix_fetch_tokens", 0))}))
PY
}

IFS=, read -r -a modes <<<"$MODES"
IFS=, read -r -a sizes <<<"$TOKENS"
for round in $(seq "$ROUNDS"); do
  for mode in "${modes[@]}"; do
    start "$mode"
    warm_up "$mode-$round"
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
med = lambda xs: statistics.median(xs)
print(f"{'prompt':>8} {'cold ms':>9} {'other, off':>11} {'other, fetch':>13} {'own ms':>8} {'fetch/off':>10}")
for n in sorted({r["prompt_tokens"] for r in runs}):
    rs = [r for r in runs if r["prompt_tokens"] == n]
    off = [r["other_ms"] for r in rs if r["mode"] == "off"]
    on = [r["other_ms"] for r in rs if r["mode"] == "fetch"]
    # Same round: the fetch run follows the off run.
    ratios = [b / a for a, b in zip(off, on)]
    print(f"{n:>8} {med([r['cold_ms'] for r in rs]):>9.1f} {med(off) if off else float('nan'):>11.1f} "
          f"{med(on) if on else float('nan'):>13.1f} {med([r['own_ms'] for r in rs]):>8.1f} "
          f"{med(ratios) if ratios else float('nan'):>10.3f}  (" + ", ".join("%.3f" % x for x in ratios) + ")")
PY
