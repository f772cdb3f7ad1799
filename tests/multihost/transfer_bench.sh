#!/bin/bash
# The transfer plane between two namespace hosts against ucx_perftest, on the
# veth bridge and through the shaped user-space link (tests/multihost/
# tun_link.cc): `mlarun bench transfer --path any` (2 ranks under mpirun, one
# per host: the rank on host2 fetches blocks from host1's pool) against
# `ucx_perftest -t ucp_get` (server on host1, client on host2: the bytes flow
# the same way), both on UCX's TCP pinned to the network's interface
# (UCX_TLS=tcp, UCX_NET_DEVICES). Per network and size, alternating perftest
# and mlarun, SHAPED_ROUNDS times; prints the medians and mlarun / perftest.
#
#   transfer_bench.sh MLARUN TUN_LINK SOURCE_DIR
#
# Environment (defaults in brackets):
#   SHAPED_SHAPES   ["bridge tun:0:0 tun:200:10000 tun:100:25000"], as for
#                   shaped_bench.sh: tun:D:R is D us one-way delay, R Mbit/s
#   SHAPED_SIZES    bytes per fetch [1105920,16809984,67166208]: 15, 228 and
#                   911 blocks of 64 tokens x 576 bf16 values
#   SHAPED_ROUNDS   [3]
#   SHAPED_OUT      a folder to keep the table and every run's output
#   SHAPED_PERFTEST_ARGS  more ucx_perftest arguments on both sides, e.g. -e
#                   (endpoints with peer error handling, as mlarun's any path)
#   SHAPED_MLARUN_ARGS    more `mlarun bench transfer` arguments, e.g.
#                   --process-memory
#
# Needs root and ucx_perftest (Debian ucx-utils); exits 77 otherwise. Cleans
# up as tests/multihost/netns_lib.sh does; ends within SHAPED_BUDGET_S [1800] s.
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: transfer_bench.sh MLARUN TUN_LINK SOURCE_DIR" >&2
  exit 2
fi
mlarun=$(realpath "$1") tun_link=$(realpath "$2") src=$(realpath "$3")
name=transfer_bench
shapes=(${SHAPED_SHAPES:-bridge tun:0:0 tun:200:10000 tun:100:25000})
sizes=${SHAPED_SIZES:-1105920,16809984,67166208}
rounds=${SHAPED_ROUNDS:-3}
hosts=(host1 host2)
addrs=(10.77.0.11 10.77.0.12)
work=$(mktemp -d "/tmp/$name.XXXXXX")
logs=()
source "$src/tests/multihost/netns_lib.sh"
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, TUN devices)"
[ -c /dev/net/tun ] || skip "no /dev/net/tun"
for tool in ip unshare mount mpirun python3 timeout ucx_perftest; do
  command -v "$tool" >/dev/null || skip "$tool not found"
done
out=${SHAPED_OUT:-$work/out}
mkdir -p "$out"
netns_watchdog "${SHAPED_BUDGET_S:-1800}"
netns_delete_stale
netns_create
netns_wait_reachable
echo "host1 slots=1" >"$work/hostfile"
echo "host2 slots=1" >>"$work/hostfile"

# Each network's interface and host1's address on it.
declare -A dev server
k=0
for s in "${shapes[@]}"; do
  if [ "$s" = bridge ]; then
    dev[$s]=$nic server[$s]=${addrs[0]}
    continue
  fi
  [[ $s =~ ^tun:[0-9]+:[0-9]+$ ]] || fail "bad network '$s' (bridge or tun:DELAY_US:RATE_MBIT)"
  IFS=: read -r _ delay rate <<<"$s"
  netns_tun_start $k "$delay" "$rate"
  dev[$s]=mlt$k server[$s]=${tun_addrs[0]}
  k=$((k + 1))
done
echo "$name: hosts ${hosts[*]}; networks: ${shapes[*]}; sizes $sizes; $rounds rounds"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
port=$((20000 + RANDOM % 10000))
perftest_us() {  # perftest_us NETWORK BYTES: median us of one get
  local s=$1 size=$2 env
  env=(env UCX_TLS=tcp UCX_NET_DEVICES="${dev[$s]}")
  # shellcheck disable=SC2086
  on_host host1 "${env[@]}" timeout 120 ucx_perftest -t ucp_get -s "$size" -n 50 -p "$port" ${SHAPED_PERFTEST_ARGS:-} \
    >>"$out/perftest-server.log" 2>&1 &
  local server_pid=$!
  pids+=("$server_pid")
  sleep 1
  # shellcheck disable=SC2086
  on_host host2 "${env[@]}" timeout 120 ucx_perftest "${server[$s]}" -t ucp_get -s "$size" -n 50 -p "$port" \
    ${SHAPED_PERFTEST_ARGS:-} \
    2>>"$out/perftest-client.log" | tee -a "$out/perftest-client.log" | awk '/^Final:/ {print $3}'
  wait "$server_pid" || true
  port=$((port + 1))
}
mlarun_us() {  # mlarun_us NETWORK BYTES
  local s=$1 size=$2
  # shellcheck disable=SC2086
  on_host host1 timeout --kill-after=5 300 mpirun --hostfile "$work/hostfile" -np 2 --bind-to none \
    --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include "$subnet" --mca btl_tcp_if_include "$subnet" --mca pml ob1 --mca btl self,vader,tcp \
    -x UCX_TLS=tcp,self -x UCX_NET_DEVICES="${dev[$s]}" \
    "$mlarun" bench transfer --path any --sizes "$size" --repetitions 50 ${SHAPED_MLARUN_ARGS:-} --json \
    2>>"$out/mlarun.log" |
    tee -a "$out/mlarun.json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["rows"][0]["median_us"])'
}

echo "| network | bytes | ucx_perftest us | mlarun us | perftest Gbit/s | mlarun Gbit/s | mlarun / perftest | spread of the ratio |" |
  tee "$out/table.md"
echo "|---|---:|---:|---:|---:|---:|---:|---|" | tee -a "$out/table.md"
for s in "${shapes[@]}"; do
  for size in ${sizes//,/ }; do
    p=() m=()
    for _ in $(seq "$rounds"); do
      p+=("$(perftest_us "$s" "$size")")
      m+=("$(mlarun_us "$s" "$size")")
      [ -n "${p[-1]}" ] || fail "$s $size: ucx_perftest gave no figure: $(tail -3 "$out/perftest-client.log")"
      [ -n "${m[-1]}" ] || fail "$s $size: mlarun bench transfer gave no figure: $(tail -3 "$out/mlarun.log")"
    done
    python3 - "$s" "$size" "${p[*]}" "${m[*]}" <<'PY' | tee -a "$out/table.md"
import statistics, sys
s, size = sys.argv[1], int(sys.argv[2])
p = [float(x) for x in sys.argv[3].split()]
m = [float(x) for x in sys.argv[4].split()]
ratios = [a / b for a, b in zip(p, m)]  # same-round: perftest time / mlarun time
pm, mm = statistics.median(p), statistics.median(m)
print(f"| {s} | {size:,} | {pm:,.0f} | {mm:,.0f} | {size * 8 / pm / 1e3:.2f} | {size * 8 / mm / 1e3:.2f} | "
      f"{statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} |")
PY
  done
done
echo "$name: done; table in $out/table.md"
exit 0
