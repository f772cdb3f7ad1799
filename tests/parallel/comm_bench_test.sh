#!/bin/bash
# `mlarun bench comm` under mpirun on dp x attn_tp ranks of the tiny model:
# every collective of a decode step (and none that the layout skips) is in the
# JSON with the byte counts this script derives from the model's hidden_size
# and num_hidden_layers (not from the program), with positive times and
# nccl-tests' busbw factors. Then the refusals: batch 0 and a layout of
# another world size must end the job non-zero, within the time limit, with
# the message from every rank.
# Usage: comm_bench_test.sh <tiny.yaml> <dp> <attn_tp> <mpirun and its options...> -- <mlarun>
set -u
model=$1
dp=$2
tp=$3
np=$((dp * tp))
shift 3
mpirun=()
while [ "$1" != "--" ]; do mpirun+=("$1"); shift; done
shift
mlarun=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "comm_bench_test: FAIL: $*"; failures=$((failures + 1)); }

H=$(sed -n 's/^hidden_size: *\([0-9]*\).*/\1/p' "$model")
L=$(sed -n 's/^num_hidden_layers: *\([0-9]*\).*/\1/p' "$model")
[ -n "$H" ] && [ -n "$L" ] || { echo "comm_bench_test: FAIL: no hidden_size / num_hidden_layers in $model"; exit 1; }

timeout -k 5 90 "${mpirun[@]}" -np "$np" "$mlarun" bench comm --model "$model" --parallel "dp=$dp,attn_tp=$tp" --batch 1,8 \
  --repetitions 3 --json >"$work/out.json" 2>"$work/err"
rc=$?
cat "$work/err"
if [ "$rc" -ne 0 ]; then
  fail "the benchmark exited $rc"
else
  python3 - "$work/out.json" "$H" "$L" "$dp" "$tp" <<'PY' || fail "the JSON differs from the layout's prediction"
import json, sys
doc = json.load(open(sys.argv[1]))
H, L = int(sys.argv[2]), int(sys.argv[3])
dp, tp = int(sys.argv[4]), int(sys.argv[5])
world = dp * tp
words = 9                       # LockstepReport::kWords
blocks = (512 + 1 + 63) // 64   # a plan sequence's blocks (512 cached tokens + 1, 64 per block)
bad = []
def check(what, got, want):
    if got != want:
        bad.append(f"{what}: {got}, want {want}")
check("hidden_size", doc["hidden_size"], H)
check("layers", doc["layers"], L)
check("world", doc["world"], world)
check("batches", [r["batch"] for r in doc["rows"]], [1, 8])
for row in doc["rows"]:
    T = row["batch"]
    # name: (group, ranks, calls per step, bytes, busbw / algbw); a group of
    # one rank runs nothing.
    want = {"lockstep_all_gather": ("world", world, 1, world * words * 8, (world - 1) / world)}
    if tp > 1:
        want["attn_tp_all_reduce"] = ("attn_tp", tp, 2 * L, T * H * 4, 2 * (tp - 1) / tp)
        want["plan_broadcast"] = ("attn_tp", tp, 1, (1 + 7 + T * (5 + blocks)) * 8, 1.0)
    if dp > 1:
        want["dp_all_gather_v"] = ("dp_peers", dp, L, dp * T * H * 4, (dp - 1) / dp)
        want["dp_reduce_scatter_v"] = ("dp_peers", dp, L, dp * T * H * 4, (dp - 1) / dp)
    got = {c["name"]: c for c in row["collectives"]}
    check(f"batch {T}: collectives", sorted(got), sorted(want))
    step_time = 0.0
    for name, (group, ranks, calls, nbytes, factor) in want.items():
        c = got.get(name)
        if c is None:
            continue
        check(f"batch {T} {name} group", c["group"], group)
        check(f"batch {T} {name} ranks", c["ranks"], ranks)
        check(f"batch {T} {name} calls_per_step", c["calls_per_step"], calls)
        check(f"batch {T} {name} bytes", c["bytes"], nbytes)
        if not c["time_us"] > 0:
            bad.append(f"batch {T} {name}: time_us {c['time_us']} is not positive")
            continue
        algbw = nbytes / (c["time_us"] * 1e-6) / 1e9
        if abs(c["algbw_gbps"] - algbw) > 1e-6 * algbw:
            bad.append(f"batch {T} {name}: algbw {c['algbw_gbps']}, want bytes / time = {algbw}")
        if abs(c["busbw_gbps"] - algbw * factor) > 1e-6 * algbw:
            bad.append(f"batch {T} {name}: busbw {c['busbw_gbps']}, want algbw x {factor}")
        step_time += calls * c["time_us"]
    if abs(row["step_time_ms"] * 1e3 - step_time) > 1e-6 * step_time:
        bad.append(f"batch {T}: step_time_ms {row['step_time_ms']}, want the sum of calls x time = {step_time / 1e3}")
    check(f"batch {T} step_bytes", row["step_bytes"], sum(w[2] * w[3] for w in want.values()))
for b in bad:
    print("comm_bench_test:", b)
print(f"comm_bench_test: checked {len(doc['rows'])} batches, {len(bad)} differences")
sys.exit(1 if bad else 0)
PY
fi

# refuse <name> <ranks> <regex> <args...>: a non-zero exit within the limit,
# and the message from each of the ranks.
refuse() {
  local name=$1 np=$2 expect=$3
  shift 3
  timeout -k 5 45 "${mpirun[@]}" -np "$np" "$mlarun" bench comm --model "$model" "$@" >"$work/$name" 2>&1
  local rc=$?
  local n
  n=$(grep -Ec "mlarun bench comm: .*$expect" "$work/$name")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    fail "$name: the job hung and was killed"
    cat "$work/$name"
  elif [ "$rc" -eq 0 ] || [ "$n" -ne "$np" ]; then
    fail "$name: exit $rc, the message on $n of $np ranks, output:"
    cat "$work/$name"
  else
    echo "comm_bench_test: ok: $name: exit $rc, on all $np ranks: $(grep -Em1 -e "$expect" "$work/$name")"
  fi
}
refuse batch_zero "$np" "--batch 0: tokens per DP group must be positive" --parallel "dp=$dp,attn_tp=$tp" --batch 1,0
refuse world_size "$((np - 1))" "--parallel dp=$dp,attn_tp=$tp needs $np ranks, the job has $((np - 1))" \
  --parallel "dp=$dp,attn_tp=$tp" --batch 1

if [ "$failures" -ne 0 ]; then
  echo "comm_bench_test: $failures failures"
  exit 1
fi
echo "comm_bench_test: PASS"
