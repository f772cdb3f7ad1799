#!/bin/bash
# Decode across three namespace hosts over a shaped network: what the network
# costs DP attention (dp=3) and attention tensor parallelism (dp=1,attn_tp=3)
# next to one host. The kernel's netem is not needed: the delay and the rate
# come from tests/multihost/tun_link.cc, a user-space link between one TUN
# device per host, and Open MPI's TCP BTL is pinned to that link's subnet
# (the out-of-band traffic of the launch stays on the bridge).
#
#   shaped_bench.sh MLARUN TUN_LINK SOURCE_DIR
#
# Environment (defaults in brackets):
#   SHAPED_SHAPES   networks, in the order each round runs them
#                   ["bridge tun:0:0 tun:200:10000 tun:100:25000"]: bridge is
#                   the namespaces' veth bridge (the kernel's path, unshaped);
#                   tun:D:R the emulator with D us one-way delay and R Mbit/s
#                   per host (0: unlimited), so tun:0:0 is the emulator's own cost
#   SHAPED_ROUNDS   rounds [3]; each runs every network and layout once (A B A B),
#                   the table gives medians over rounds and same-round ratios
#   SHAPED_BATCHES  sequences per step [1,3,8,24,32,96]: all of them in the
#                   one group of attn_tp=3 and of one host; dp=3 runs the
#                   multiples of 3 (1, 8, 32 per DP group)
#   SHAPED_LAYERS, SHAPED_EXPERTS   model depth [4] and routed experts [6]
#   SHAPED_REPS     timed decode steps per point [5]; bench comm takes 4x
#   SHAPED_OUT      a folder to keep every run's JSON and the table in
#
# The model is configs/models/deepseek-v2-lite.yaml (hidden 2048, so V2-Lite's
# message sizes) with 15 heads instead of 16 and experts of 1416 instead of
# 1408, the nearest widths that split over 3 ranks; random bf16 weights.
# Every rank runs one thread (--threads 1). Before the rounds each tun link is
# measured from host1 to host2 (tun_link rtt, tun_link send) and reported.
#
# Needs root (exits 77 otherwise, or without namespaces or /dev/net/tun).
# Cleans up as tests/multihost/netns_lib.sh does; the run ends within
# SHAPED_BUDGET_S [3000] seconds.
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: shaped_bench.sh MLARUN TUN_LINK SOURCE_DIR" >&2
  exit 2
fi
mlarun=$(realpath "$1") tun_link=$(realpath "$2") src=$(realpath "$3")
name=shaped_bench
shapes=(${SHAPED_SHAPES:-bridge tun:0:0 tun:200:10000 tun:100:25000})
rounds=${SHAPED_ROUNDS:-3}
batches=${SHAPED_BATCHES:-1,3,8,24,32,96}
layers=${SHAPED_LAYERS:-4}
experts=${SHAPED_EXPERTS:-6}
reps=${SHAPED_REPS:-5}
hosts=(host1 host2 host3)
addrs=(10.77.0.11 10.77.0.12 10.77.0.13)
work=$(mktemp -d "/tmp/$name.XXXXXX")
logs=()
source "$src/tests/multihost/netns_lib.sh"
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, TUN devices)"
[ -c /dev/net/tun ] || skip "no /dev/net/tun"
for tool in ip unshare mount mpirun python3 timeout; do
  command -v "$tool" >/dev/null || skip "$tool not found"
done
out=${SHAPED_OUT:-$work/out}
mkdir -p "$out"
netns_watchdog "${SHAPED_BUDGET_S:-3000}"
netns_delete_stale

# ---- the model ---------------------------------------------------------------
model="$work/v2-lite-3.yaml"
sed -e 's/^num_attention_heads: 16$/num_attention_heads: 15/' \
    -e 's/^moe_intermediate_size: 1408 .*/moe_intermediate_size: 1416/' \
    "$src/configs/models/deepseek-v2-lite.yaml" >"$model"
grep -q '^num_attention_heads: 15$' "$model" && grep -q '^moe_intermediate_size: 1416$' "$model" ||
  fail "configs/models/deepseek-v2-lite.yaml changed: cannot make the 3-rank variant"

# ---- the networks --------------------------------------------------------------
netns_create
netns_wait_reachable
for h in "${hosts[@]}"; do echo "$h slots=1"; done >"$work/hostfile"
declare -A btl_subnet
k=0
for s in "${shapes[@]}"; do
  if [ "$s" = bridge ]; then
    btl_subnet[$s]=$subnet
    continue
  fi
  IFS=: read -r _ delay rate <<<"$s"
  [[ $s =~ ^tun:[0-9]+:[0-9]+$ ]] || fail "bad network '$s' (bridge or tun:DELAY_US:RATE_MBIT)"
  netns_tun_start $k "$delay" "$rate"
  btl_subnet[$s]=10.78.$k.0/24
  k=$((k + 1))
done
echo "$name: hosts ${hosts[*]}; networks: ${shapes[*]}"

# What each network gives one TCP flow from host1 to host2: the round trip
# of one byte and the rate of a 200 MB transfer (tun_link's own probes).
on_host host2 "$tun_link" serve 0.0.0.0 7000 2>/dev/null &
pids+=($!)
sleep 0.3
for s in "${shapes[@]}"; do
  target=${addrs[1]}
  [ "$s" != bridge ] && target=${btl_subnet[$s]%.0/24}.12
  rtt=$(on_host host1 timeout 60 "$tun_link" rtt "$target" 7000 200) || fail "$s: round trips: $rtt"
  send=$(on_host host1 timeout 120 "$tun_link" send "$target" 7000 200000000) || fail "$s: transfer: $send"
  echo "link $s $rtt $send" | tee -a "$out/links.txt"
done

# ---- the runs -------------------------------------------------------------------
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model_flags=(--model "$model" --num-layers "$layers" --experts "$experts")
mpi() {  # mpi NETWORK NP: mpirun's options, Open MPI's TCP BTL on NETWORK
  echo --hostfile "$work/hostfile" -np "$2" --bind-to none \
    --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include "$subnet" --mca btl_tcp_if_include "${btl_subnet[$1]}" \
    --mca pml ob1 --mca btl self,vader,tcp
}
run() {  # run TAG NETWORK NP MLARUN-ARGS...: one job from host1, its JSON kept as TAG
  local tag=$1 net=$2 np=$3
  shift 3
  logs+=("$out/$tag.log")
  # shellcheck disable=SC2046
  on_host host1 timeout --kill-after=5 600 mpirun $(mpi "$net" "$np") "$mlarun" "$@" --json \
    >"$out/$tag.json" 2>"$out/$tag.log" || fail "$tag: mpirun $* failed: $(tail -5 "$out/$tag.log")"
}
# dp=3: the batches that split over 3 groups, per group for bench comm.
dp_batches=$(tr , '\n' <<<"$batches" | awk '$1 % 3 == 0' | paste -sd,)
dp_group_batches=$(tr , '\n' <<<"$dp_batches" | awk '{print $1 / 3}' | paste -sd,)
[ -n "$dp_batches" ] || fail "SHAPED_BATCHES ($batches) has no multiple of 3 for dp=3"
for ((r = 1; r <= rounds; r++)); do
  t0=$SECONDS
  # One host: one rank, the whole model (no network at all).
  run "r$r-one-decode" bridge 1 bench decode "${model_flags[@]}" --parallel dp=1,attn_tp=1 --batch "$batches" \
    --context 512 --repetitions "$reps" --threads 1
  for s in "${shapes[@]}"; do
    tag=${s//:/_}
    run "r$r-$tag-dp3-decode" "$s" 3 bench decode "${model_flags[@]}" --parallel dp=3,attn_tp=1 --batch "$dp_batches" \
      --context 512 --repetitions "$reps" --threads 1
    run "r$r-$tag-tp3-decode" "$s" 3 bench decode "${model_flags[@]}" --parallel dp=1,attn_tp=3 --batch "$batches" \
      --context 512 --repetitions "$reps" --threads 1
    run "r$r-$tag-dp3-comm" "$s" 3 bench comm --model "$model" --parallel dp=3,attn_tp=1 --batch "$dp_group_batches" \
      --repetitions $((4 * reps))
    run "r$r-$tag-tp3-comm" "$s" 3 bench comm --model "$model" --parallel dp=1,attn_tp=3 --batch "$batches" \
      --repetitions $((4 * reps))
  done
  echo "$name: round $r of $rounds done in $((SECONDS - t0)) s"
done

# ---- the table ------------------------------------------------------------------
python3 - "$out" "$rounds" "$layers" "${shapes[@]}" <<'PY' | tee "$out/table.txt"
import json, statistics, sys
out, rounds, layers, shapes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def load(tag):
    return json.load(open(f"{out}/{tag}.json"))
def med(xs):
    return statistics.median(xs)
def tag(s):
    return s.replace(":", "_")
def decode_rows(doc):
    return {r["batch"]: r for r in doc["rows"]}
def comm_rows(doc):
    return {r["batch"]: r for r in doc["rows"]}

print("links, host1 -> host2, one TCP flow (tun_link rtt: 200 one-byte round trips; tun_link send: 200 MB):")
for line in open(f"{out}/links.txt"):
    print("  " + line.strip())
print()
batches = sorted(decode_rows(load("r1-one-decode")))
print(f"decode step (ms, median of {rounds} rounds; each round's value the median of its timed steps), "
      "tokens/s, and the step's time over the same round's bridge run of the layout")
print(f"{'network':<16}{'batch':>6} | {'one host ms':>11} | {'dp=3 ms':>8} {'tok/s':>7} {'x bridge':>8} | "
      f"{'attn_tp=3 ms':>12} {'tok/s':>7} {'x bridge':>8} | {'tp3/dp3':>7}")
def steps(name, b):
    rows = [decode_rows(load(f"r{r}-{name}-decode")) for r in range(1, rounds + 1)]
    return [x[b]["decode_step_ms"] for x in rows] if b in rows[0] else None
def ratio(xs, ys):
    return med([x / y for x, y in zip(xs, ys)])
for s in shapes:
    base = "bridge" if "bridge" in shapes else tag(s)
    for b in batches:
        one, dp, tp = steps("one", b), steps(f"{tag(s)}-dp3", b), steps(f"{tag(s)}-tp3", b)
        dpb, tpb = steps(f"{base}-dp3", b), steps(f"{base}-tp3", b)
        dcell = f"{med(dp):>8.1f} {b / med(dp) * 1e3:>7.1f} {ratio(dp, dpb):>8.2f}" if dp else f"{'-':>8} {'-':>7} {'-':>8}"
        print(f"{s:<16}{b:>6} | {med(one):>11.1f} | {dcell} | {med(tp):>12.1f} {b / med(tp) * 1e3:>7.1f} "
              f"{ratio(tp, tpb):>8.2f} | {ratio(tp, dp) if dp else float('nan'):>7.2f}")
print()
print("bytes per step on rank 0 by collective, measured by bench decode (its prediction: docs/notes/2026-12-01-comm-bench.md)")
print(f"{'layout':<10}{'batch':>6} {'all-reduce':>22} {'all-gather':>22} {'reduce-scatter':>22}  agree")
for lay in ("dp3", "tp3"):
    for b, row in sorted(decode_rows(load(f"r1-{tag(shapes[0])}-{lay}-decode")).items()):
        m, p = row["bytes_per_step"], row["predicted_bytes_per_step"]
        cell = lambda k: f"{m[k]:.0f} ({p[k]:.0f})"
        print(f"{lay:<10}{b:>6} {cell('all_reduce'):>22} {cell('all_gather'):>22} {cell('reduce_scatter'):>22}  "
              f"{'yes' if row['ranks_disagreeing_with_prediction'] == 0 else 'NO'}")
print()
print(f"collectives of one step alone (bench comm; ms/step: the sum over the step's calls of each call's median,"
      f" slowest rank; median of {rounds} rounds); batch = sequences per step, bus bytes per rank")
print("  bus bytes (predicted): per layer, dp=3 all-gathers and reduce-scatters the step's B x H fp32 rows, 2/3 of")
print("  each crossing a rank's links (4/3 x 4BH); attn_tp=3 all-reduces them twice, 4/3 each (8/3 x 4BH); plus the")
print("  step's lock-step gather and plan broadcast, a few hundred bytes")
print(f"{'network':<16}{'batch':>6} | {'dp=3 ms':>8} {'bus bytes':>10} {'(predicted)':>12} | "
      f"{'attn_tp=3 ms':>12} {'bus bytes':>10} {'(predicted)':>12} | {'tp3/dp3':>7}")
comm = {(s, lay): [load(f"r{r}-{tag(s)}-{lay}-comm") for r in range(1, rounds + 1)] for s in shapes for lay in ("dp3", "tp3")}
def cr(s, lay, b):
    return [comm_rows(x)[b // 3 if lay == "dp3" else b] for x in comm[(s, lay)]]
for s in shapes:
    for b in [x for x in batches if x % 3 == 0]:
        d, t = cr(s, "dp3", b), cr(s, "tp3", b)
        dm, tm = med([x["step_time_ms"] for x in d]), med([x["step_time_ms"] for x in t])
        H, L = comm[(s, "dp3")][0]["hidden_size"], comm[(s, "dp3")][0]["layers"]
        print(f"{s:<16}{b:>6} | {dm:>8.2f} {d[0]['step_bus_bytes']:>10.0f} {f'({L * 4 * b * H * 4 // 3})':>12} | "
              f"{tm:>12.2f} {t[0]['step_bus_bytes']:>10.0f} {f'({L * 8 * b * H * 4 // 3})':>12} | "
              f"{med([y['step_time_ms'] / x['step_time_ms'] for x, y in zip(d, t)]):>7.2f}")
print()
print("by collective: calls per step, bytes per call (nccl-tests' size), and each call's median time in us per network")
print(f"{'layout':<10}{'batch':>6} {'collective':<22}{'calls':>6}{'bytes':>9} | " + " ".join(f"{s:>14}" for s in shapes))
for lay in ("dp3", "tp3"):
    for b in [x for x in batches if x % 3 == 0]:
        for i, c in enumerate(cr(shapes[0], lay, b)[0]["collectives"]):
            times = [med([x["collectives"][i]["time_us"] for x in cr(s, lay, b)]) for s in shapes]
            print(f"{lay:<10}{b:>6} {c['name']:<22}{c['calls_per_step']:>6}{c['bytes']:>9} | "
                  + " ".join(f"{t:>14.1f}" for t in times))
PY
echo "$name: done; runs in $out"
