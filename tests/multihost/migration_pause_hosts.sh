#!/bin/bash
# The pause of a live migration between two namespace hosts: bench/
# migration_pause.sh with the coordinator and its clients on host1 and the
# two DP groups of `--parallel dp=2` on host2 and host3, the moved blocks on
# UCX's TCP over one network at a time: the veth bridge, and tun_link's
# shaped links (tests/multihost/tun_link.cc, as shaped_bench.sh). Open MPI's
# own traffic stays on the bridge. Prints each network's table.
#
#   migration_pause_hosts.sh MLARUN TUN_LINK SOURCE_DIR
#
# Environment (defaults in brackets):
#   PAUSE_MODEL     checkpoint directory or configs/models/*.yaml [required]
#   PAUSE_TOKENS    prompt tokens [1024,4096]
#   PAUSE_MODES     transfer modes [off,any] (shm cannot cross hosts)
#   PAUSE_ROUNDS    [3]
#   PAUSE_MAX_TOKENS  each request's [48]; enough to still run when moved
#   SHAPED_SHAPES   ["bridge tun:200:10000 tun:100:25000"]
#
# Needs root; exits 77 otherwise. Cleans up as tests/multihost/netns_lib.sh
# does; ends within SHAPED_BUDGET_S [3600] s.
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: migration_pause_hosts.sh MLARUN TUN_LINK SOURCE_DIR" >&2
  exit 2
fi
mlarun=$(realpath "$1") tun_link=$(realpath "$2") src=$(realpath "$3")
name=migration_pause_hosts
model=${PAUSE_MODEL:?migration_pause_hosts: set PAUSE_MODEL to a checkpoint or configs/models/*.yaml}
shapes=(${SHAPED_SHAPES:-bridge tun:200:10000 tun:100:25000})
hosts=(host1 host2 host3)
addrs=(10.77.0.11 10.77.0.12 10.77.0.13)
work=$(mktemp -d "/tmp/$name.XXXXXX")
logs=()
source "$src/tests/multihost/netns_lib.sh"
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, TUN devices)"
for tool in ip unshare mount mpirun python3 timeout; do
  command -v "$tool" >/dev/null || skip "$tool not found"
done
netns_watchdog "${SHAPED_BUDGET_S:-3600}"
netns_delete_stale
netns_create
netns_wait_reachable
printf 'host2 slots=1\nhost3 slots=1\n' >"$work/hostfile"

declare -A dev net
k=0
for s in "${shapes[@]}"; do
  if [ "$s" = bridge ]; then
    dev[$s]=$nic net[$s]=$subnet
    continue
  fi
  [[ $s =~ ^tun:[0-9]+:[0-9]+$ ]] || fail "bad network '$s' (bridge or tun:DELAY_US:RATE_MBIT)"
  IFS=: read -r _ delay rate <<<"$s"
  [ -c /dev/net/tun ] || skip "no /dev/net/tun"
  netns_tun_start $k "$delay" "$rate"
  dev[$s]=mlt$k net[$s]=10.78.$k.0/24
  k=$((k + 1))
done
echo "$name: coordinator on host1, DP groups on host2 and host3; networks: ${shapes[*]}"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for s in "${shapes[@]}"; do
  echo "== $s (UCX on ${dev[$s]})"
  logs+=("$work/pause-${s//:/_}.log")
  MLARUN=$mlarun bash ${PAUSE_TRACE:+-x} "$src/bench/migration_pause.sh" --model "$model" --tokens "${PAUSE_TOKENS:-1024,4096}" \
    --modes "${PAUSE_MODES:-off,any}" --rounds "${PAUSE_ROUNDS:-3}" --max-tokens "${PAUSE_MAX_TOKENS:-48}" \
    --run-prefix "$agent --argv host1" --listen-host host1 \
    --mpirun-args "--hostfile $work/hostfile --bind-to none --mca plm_rsh_agent $agent --mca plm_rsh_no_tree_spawn 1
                   --mca oob_tcp_if_include $subnet --mca btl_tcp_if_include $subnet --mca pml ob1
                   --mca btl self,vader,tcp -x UCX_TLS=tcp,self -x UCX_NET_DEVICES=${dev[$s]}" \
    2>"$work/pause-${s//:/_}.log" || fail "$s: migration_pause.sh failed: $(tail -5 "$work/pause-${s//:/_}.log")"
done
echo "$name: done"
exit 0
