#!/bin/bash
# The link emulator of the shaped-network benchmark (tests/multihost/
# tun_link.cc) between two namespace hosts: 5 ms one-way delay and 100 Mbit/s.
# Passes if a one-byte TCP round trip takes at least the 10 ms the two delays
# add (and well under a second), and 4 MB sent from host1 to host2 arrive
# intact (count and hash) no sooner than 100 Mbit/s allows (0.32 s) and
# within 30 s. The bounds hold on a busy machine: the emulator can only make
# a packet later than the model says, never earlier.
#
#   tun_link_smoke.sh TUN_LINK SOURCE_DIR
#
# Exits 77 (skipped) when not root or without namespaces or /dev/net/tun.
# Cleans up as tests/multihost/netns_lib.sh does.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: tun_link_smoke.sh TUN_LINK SOURCE_DIR" >&2
  exit 2
fi
tun_link=$(realpath "$1") src=$(realpath "$2")
name=multihost_tun_link
hosts=(host1 host2)
addrs=(10.77.0.11 10.77.0.12)
work=$(mktemp -d "/tmp/$name.XXXXXX")
logs=("$work/serve.log")
source "$src/tests/multihost/netns_lib.sh"
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, TUN devices)"
[ -c /dev/net/tun ] || skip "no /dev/net/tun"
for tool in ip unshare mount timeout; do
  command -v "$tool" >/dev/null || skip "$tool not found"
done
netns_watchdog 60
netns_delete_stale
netns_create
netns_tun_start 0 5000 100

bytes=4000000
on_host host2 "$tun_link" serve "${tun_addrs[1]}" 7000 2>"$work/serve.log" &
pids+=($!)
for _ in $(seq 50); do
  # Refused until the server listens.
  answer=$(on_host host1 timeout 2 bash -c "exec 3<>/dev/tcp/${tun_addrs[1]}/7000" 2>&1 && echo connected || true)
  [[ $answer == *connected* ]] && break
  sleep 0.1
done
rtt=$(on_host host1 timeout 20 "$tun_link" rtt "${tun_addrs[1]}" 7000 20) || fail "round trips: $rtt"
send=$(on_host host1 timeout 40 "$tun_link" send "${tun_addrs[1]}" 7000 $bytes) || fail "transfer: $send"
echo "$name: $rtt"
echo "$name: $send"
min_us=$(sed -n -E 's/.*min=([0-9.]+).*/\1/p' <<<"$rtt")
seconds=$(sed -n -E 's/.*seconds=([0-9.]+).*/\1/p' <<<"$send")
awk -v m="$min_us" 'BEGIN { exit !(m >= 10000 && m < 1000000) }' ||
  fail "the shortest round trip took $min_us us: expected at least 10000 (2 x 5 ms) and under 1 s"
[[ $send == *" intact" ]] || fail "the transfer did not arrive intact: $send"
awk -v s="$seconds" -v b=$bytes 'BEGIN { exit !(s >= b * 8 / 100e6 && s < 30) }' ||
  fail "$bytes bytes took $seconds s: expected at least $(awk -v b=$bytes 'BEGIN { print b * 8 / 100e6 }') s (100 Mbit/s) and under 30 s"
echo "$name: PASS"
