#!/usr/bin/env bash
# mlarun at DeepSeek-V3's widths, in fp8 as the release stores it, against a
# float64 reference.
#
# 1. Makes (once) a random checkpoint of 2 layers at V3's widths, 1 dense + 1
#    MoE (256 routed experts), projections F8_E4M3 with 128 x 128 block scales:
#    bench/make_random_checkpoint.py --dtype fp8 (~15 GiB; kept in --ckpt).
# 2. Runs tests/ref/deepseek_v3_reference.py (numpy float64) on a prompt of
#    random token ids and 4 greedy tokens.
# 3. Runs `mlarun generate` on the same ids (weight_dtype f32 with an fp32
#    latent cache, then the checkpoint's bf16 with an fp32 and a bf16 cache)
#    and compares tokens and top logprobs (bench/v3_widths_compare.py); exits
#    1 when the greedy tokens differ.
# 4. With --bench: `mlarun bench decode` at batch 1 / 8 / 32 (context 128 and
#    512) and a 512-token prefill, and the load time with the page cache
#    dropped (needs root) and warm.
#
# Usage: bench/v3_widths.sh [--ckpt DIR] [--work DIR] [--threads T]
#            [--mlarun PATH] [--prompt-ids 1,2,3] [--vocab-size N] [--bench]
# --vocab-size N: a smaller vocabulary than the release's 129,280 (the
# embedding and lm_head are BF16: 1.85 GB each at full size).
# Outputs (raw logs, JSON) go to --work (default /tmp/v3-widths); the
# checkpoint to --ckpt (default WORK/ckpt). Python: $PYTHON or python3, with
# numpy (Debian: apt-get install python3-numpy).
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CKPT=
WORK=/tmp/v3-widths
THREADS=2
MLARUN="$ROOT/build/release/mlarun"
PY="${PYTHON:-python3}"
PROMPT=""
VOCAB=()
BENCH=0

usage() { sed -n '2,/^set -E/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --ckpt) CKPT="${2:?--ckpt needs a value}"; shift 2 ;;
    --work) WORK="${2:?--work needs a value}"; shift 2 ;;
    --threads) THREADS="${2:?--threads needs a value}"; shift 2 ;;
    --mlarun) MLARUN="${2:?--mlarun needs a value}"; shift 2 ;;
    --prompt-ids) PROMPT="${2:?--prompt-ids needs a value}"; shift 2 ;;
    --vocab-size) VOCAB=(--vocab-size "${2:?--vocab-size needs a value}"); shift 2 ;;
    --bench) BENCH=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
[ -x "$MLARUN" ] || { echo "no mlarun at $MLARUN (ninja -C build/release mlarun)" >&2; exit 2; }
"$PY" -c 'import numpy' 2>/dev/null ||
  { echo "$PY cannot import numpy (Debian: apt-get install python3-numpy, or set PYTHON)" >&2; exit 2; }
CKPT="${CKPT:-$WORK/ckpt}"
mkdir -p "$WORK"

# 1. The checkpoint: config.json is written last, so its presence means complete.
if [ ! -f "$CKPT/config.json" ]; then
  "$PY" "$ROOT/bench/make_random_checkpoint.py" --config "$ROOT/configs/models/deepseek-v3.yaml" \
    --layers 2 --dense-layers 1 --dtype fp8 "${VOCAB[@]}" --out "$CKPT" | tee "$WORK/checkpoint.log"
fi

# 2. The reference. Six random ids (seeded, below the checkpoint's vocab_size) unless given.
if [ -z "$PROMPT" ]; then
  PROMPT="$("$PY" -c 'import json, sys, numpy as np
v = json.load(open(sys.argv[1]))["vocab_size"]
print(",".join(map(str, np.random.default_rng(7).integers(2, v, 6))))' "$CKPT/config.json")"
fi
echo "prompt ids: $PROMPT"
REF="$WORK/reference.json"
if [ ! -f "$REF" ] || [ "$(cat "$WORK/reference.prompt" 2>/dev/null)" != "$PROMPT" ]; then
  OPENBLAS_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" /usr/bin/time -v \
    "$PY" "$ROOT/tests/ref/deepseek_v3_reference.py" --model "$CKPT" --prompt-ids "$PROMPT" --new-tokens 4 \
    --top 64 > "$REF.partial" 2> "$WORK/reference.log"
  mv "$REF.partial" "$REF"
  echo "$PROMPT" > "$WORK/reference.prompt"
fi

# 3. mlarun. First with everything but the fp8 weights in fp32: weight_dtype
#    f32 (the same file, through a config.json that says float32) and an fp32
#    latent cache; then with the checkpoint's bf16 (lm_head and embedding bf16,
#    lm_head's input rounded to bf16), cache fp32 and bf16 (the default).
F32="$WORK/f32-config"
mkdir -p "$F32"
ln -sfn "$CKPT/model.safetensors" "$F32/model.safetensors"
"$PY" -c 'import json, sys
c = json.load(open(sys.argv[1]))
c["torch_dtype"] = "float32"
c.pop("dtype", None)
json.dump(c, open(sys.argv[2], "w"), indent=2)' "$CKPT/config.json" "$F32/config.json"
status=0
for run in "f32 fp32 $F32" "bf16 fp32 $CKPT" "bf16 bf16 $CKPT"; do
  read -r wt kv dir <<< "$run"
  out="$WORK/mlarun-$wt-kv-$kv"
  "$MLARUN" generate --model "$dir" --prompt-ids "$PROMPT" --max-tokens 4 --ignore-eos --json --logprobs 20 \
    --kv-dtype "$kv" --threads "$THREADS" > "$out.json" 2> "$out.log" || { cat "$out.log" >&2; status=1; continue; }
  "$PY" "$ROOT/bench/v3_widths_compare.py" "$REF" "$out.json" --label "mlarun, weight_dtype $wt, latent cache $kv" ||
    status=1
done

# 4. Benchmarks.
if [ "$BENCH" = 1 ]; then
  for mode in cold warm; do
    if [ "$mode" = cold ]; then
      sync
      echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || { echo "cannot drop caches (not root): skipped"; continue; }
    fi
    /usr/bin/time -v "$MLARUN" generate --model "$CKPT" --prompt-ids "$PROMPT" --max-tokens 1 --ignore-eos \
      --threads "$THREADS" > /dev/null 2> "$WORK/load-$mode.log"
    grep -E '^loaded|Elapsed|Maximum resident|Major' "$WORK/load-$mode.log" | sed "s/^/load $mode: /"
  done
  "$MLARUN" bench decode --model "$CKPT" --batch 1,8,32 --context 128,512 --prefill-tokens 512 --threads "$THREADS" \
    --json > "$WORK/bench-decode.json" 2> "$WORK/bench-decode.log"
  cat "$WORK/bench-decode.log"
fi
exit "$status"
