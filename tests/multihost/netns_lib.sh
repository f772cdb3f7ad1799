# Sourced by the scripts that build "hosts" out of network namespaces of this
# machine (netns_hosts.sh, tun_link_smoke.sh, shaped_bench.sh): the
# namespaces on a bridge, the cleanup, the run's deadline.
#
#   name=NAME src=SOURCE_DIR work=DIR logs=(...)
#   hosts=(host1 host2 ...) addrs=(10.77.0.11 ...)   # on 10.77.0.0/24
#   source netns_lib.sh          # before_exit, fail (scripts/lib/on_exit.sh)
#   netns_watchdog BUDGET_S      # TERM to the script past BUDGET_S seconds
#   netns_delete_stale           # what runs that were killed left behind
#   netns_create                 # namespaces, veths, bridge, /etc/hosts; skips (77) when it cannot
#   netns_wait_reachable         # every host reaches every other over the bridge
#   on_host HOST COMMAND...      # COMMAND in HOST's namespace
#   pids+=($!)                   # processes stopped on exit
#
# Everything is named after the script's PID (namespaces mlarun-mh<PID>-<host>,
# bridge mlbr<PID>, links mlv<PID>h<i>), so parallel runs do not collide and a
# later run can tell what a killed one left (its PID no longer lives). Only
# loopback and the namespaces' own addresses are ever traffic targets, and the
# root namespace gets no address: the bridge only joins the namespaces.
nic=mh0  # every host's interface on the bridge (inside its namespace)
subnet=10.77.0.0/24
agent="$src/tests/multihost/netns_rsh.sh"
export NETNS_PREFIX="mlarun-mh$$-"
export NETNS_HOSTS_FILE="$work/hosts"
bridge="mlbr$$"
pids=()
created=0
watchdog=""

skip() {
  echo "$name: SKIPPED: $*"
  exit 77
}

netns_stop_processes() {
  local p ns h
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 30); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
  # Whatever is left in the namespaces (orteds, ranks) is ours.
  for h in "${hosts[@]}"; do
    ns=$NETNS_PREFIX$h
    [ -e "/run/netns/$ns" ] || continue
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
  done
}
# What the run with PID $1 created: every namespace, link and bridge of its names.
netns_delete() {
  local ns p link
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^mlarun-mh$1-" || true); do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  for link in $(ip -o link show 2>/dev/null | sed -n -E "s/^[0-9]+: (mlv$1h[0-9]+)@.*/\1/p"); do
    ip link del "$link" 2>/dev/null || true
  done
  ip link del "mlbr$1" 2>/dev/null || true
}
netns_before_exit() {
  [ -n "$watchdog" ] && kill "$watchdog" 2>/dev/null
  netns_stop_processes
  [ "$created" = 1 ] && netns_delete $$
  return 0
}
# A script that needs more on exit defines its own before_exit after this
# file and calls netns_before_exit from it.
before_exit() { netns_before_exit; }
source "$src/scripts/lib/on_exit.sh"

# The whole run ends within $1 seconds: past it, TERM (and the cleanup).
# Killing what runs in the namespaces ends any command the script waits for.
netns_watchdog() {
  local budget=$1
  (
    for ((t = 0; t < budget; t++)); do
      sleep 1
      kill -0 $$ 2>/dev/null || exit 0
    done
    echo "$name: FAIL: still running after $budget s"
    kill -TERM $$
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -F "$NETNS_PREFIX" || true); do
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    done
  ) 2>/dev/null &
  watchdog=$!
}

# Runs left behind by a kill that gave them no chance to clean up.
netns_delete_stale() {
  local old
  for old in $(ip netns list 2>/dev/null | sed -n -E 's/^mlarun-mh([0-9]+)-.*/\1/p' | sort -u); do
    if [ "$old" != $$ ] && ! kill -0 "$old" 2>/dev/null; then
      echo "$name: deleting namespaces left by run $old"
      netns_delete "$old"
    fi
  done
}

on_host() {  # on_host HOST COMMAND...: COMMAND in HOST's namespace
  "$agent" --argv "$@"
}

netns_create() {
  local i h ns
  # The hosts' /etc/hosts (bind-mounted in their mount namespaces).
  {
    echo "127.0.0.1 localhost"
    for i in "${!hosts[@]}"; do echo "${addrs[$i]} ${hosts[$i]}"; done
  } >"$NETNS_HOSTS_FILE"
  created=1
  ip link add "$bridge" type bridge 2>"$work/ip.log" || skip "cannot create a bridge: $(cat "$work/ip.log")"
  ip link set "$bridge" up
  for i in "${!hosts[@]}"; do
    h=${hosts[$i]}
    ns=$NETNS_PREFIX$h
    ip netns add "$ns" 2>"$work/ip.log" || skip "cannot create a network namespace: $(cat "$work/ip.log")"
    "$agent" --argv "$h" true 2>"$work/ip.log" || skip "cannot enter $ns with new mount and UTS namespaces: $(cat "$work/ip.log")"
    ip link add "mlv$$h$((i + 1))" type veth peer name "$nic" netns "$ns" 2>"$work/ip.log" ||
      skip "cannot create a veth pair: $(cat "$work/ip.log")"
    ip link set "mlv$$h$((i + 1))" master "$bridge" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "${addrs[$i]}/24" dev "$nic"
    ip -n "$ns" link set "$nic" up
  done
}

# netns_wait_reachable [ADDR...]: every host reaches every other host (at
# ADDR, default the bridge addresses) at once, as a rule; the loop only
# bounds the wait.
netns_wait_reachable() {
  local targets=("${addrs[@]}")
  [ $# -gt 0 ] && targets=("$@")
  local i j ok answer
  for i in "${!hosts[@]}"; do
    for j in "${!targets[@]}"; do
      [ "$i" = "$j" ] && continue
      ok=0
      for _ in $(seq 50); do
        # Port 9 listens nowhere: "refused" means the host answered.
        answer=$(on_host "${hosts[$i]}" timeout 2 bash -c "exec 3<>/dev/tcp/${targets[$j]}/9" 2>&1 || true)
        if [[ $answer == *refused* ]]; then
          ok=1
          break
        fi
        sleep 0.1
      done
      [ $ok = 1 ] || fail "${hosts[$i]} cannot reach ${hosts[$j]} at ${targets[$j]}"
    done
  done
}

# netns_tun_start K DELAY_US RATE_MBIT: the hosts joined a second time, through
# tests/multihost/tun_link.cc ($tun_link: one TUN device per host, a fixed
# one-way delay and a line rate; RATE_MBIT 0 is unlimited), on 10.78.K.0/24:
# device mlt<K>, host i at 10.78.K.<11+i>, MTU 65000 (few packets per byte at
# multi-Gbit/s rates). The emulator is one of `pids`: stopping it removes the
# devices. Sets tun_addrs to the hosts' addresses on it.
netns_tun_start() {
  local k=$1 delay=$2 rate=$3 i ns args=()
  tun_addrs=()
  for i in "${!hosts[@]}"; do
    tun_addrs+=("10.78.$k.$((11 + i))")
    args+=("$NETNS_PREFIX${hosts[$i]}=10.78.$k.$((11 + i))")
  done
  logs+=("$work/tun_link$k.log")
  "$tun_link" link --delay-us "$delay" --rate-mbit "$rate" --dev "mlt$k" --ready "$work/tun_link$k.ready" \
    "${args[@]}" 2>"$work/tun_link$k.log" &
  local link=$!
  pids+=("$link")
  for _ in $(seq 50); do
    [ -s "$work/tun_link$k.ready" ] && break
    kill -0 "$link" 2>/dev/null || fail "tun_link $k ended before its devices existed: $(cat "$work/tun_link$k.log")"
    sleep 0.1
  done
  [ -s "$work/tun_link$k.ready" ] || fail "tun_link $k did not create its devices within 5 s"
  for i in "${!hosts[@]}"; do
    ns=$NETNS_PREFIX${hosts[$i]}
    ip -n "$ns" addr add "${tun_addrs[$i]}/24" dev "mlt$k"
    ip -n "$ns" link set "mlt$k" mtu 65000 up
  done
  netns_wait_reachable "${tun_addrs[@]}"
}
