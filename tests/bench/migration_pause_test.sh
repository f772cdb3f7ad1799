#!/bin/bash
# bench/migration_pause.sh on the tiny model: one round of each mode, one
# prompt size. Passes only if it prints a line per run and a summary row per
# mode, the shm run fetched at least the rows' own bytes and the computed
# one nothing, and every pause is a positive number.
#   migration_pause_test.sh MLARUN SOURCE_DIR
set -eu -o pipefail
mlarun=$1 src=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
timeout 240 bash "$src/bench/migration_pause.sh" --mlarun "$mlarun" --model "$src/configs/models/tiny.yaml" \
  --tokens 300 --modes off,shm --rounds 1 --max-tokens 3000 >"$out" 2>&1 || { cat "$out"; exit 1; }
cat "$out"
python3 - "$out" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
runs = [json.loads(l) for l in lines if l.startswith("{")]
assert [r["mode"] for r in runs] == ["off", "shm"], runs
for r in runs:
    assert r["pause_ms"] > 0 and r["prompt_tokens"] == 300, r
off, shm = runs
assert off["fetched_bytes"] == 0, off
assert shm["fetched_bytes"] >= shm["row_bytes"] > 0, shm
rows = [l for l in lines if l.split()[:2] in (["300", "off"], ["300", "shm"])]
assert len(rows) == 2, lines[-4:]
print("migration_pause: both modes measured")
PY
