#!/bin/bash
# The transfer plane (`mlarun bench transfer`, 2 ranks under mpirun) against
# `ucx_perftest -t ucp_get` (Debian ucx-utils) on one host, the same
# transport and message sizes, alternating: per size, perftest then mlarun,
# `--rounds` times; prints the medians and mlarun / perftest.
#   any: mlarun's peer-failure path, which in UCX 1.13 is TCP on the
#        loopback; perftest with UCX_TLS=tcp.
#   shm: mlarun's shared-memory path; perftest with UCX_TLS=sm.
# Each mlarun run sizes its pools for its one size (as perftest does its
# buffers), so neither side's working set is larger than the other's.
# Usage: bench/transfer_vs_perftest.sh [--mlarun PATH] [--path any|shm]
#          [--sizes 73728,1105920,...] [--rounds N]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
MLARUN=${MLARUN:-$here/../build/release/mlarun}
PATH_KIND=shm
SIZES=73728,1105920,16809984,67166208
ROUNDS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --mlarun) MLARUN=$2; shift 2 ;;
    --path) PATH_KIND=$2; shift 2 ;;
    --sizes) SIZES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "transfer_vs_perftest: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v ucx_perftest >/dev/null || { echo "transfer_vs_perftest: no ucx_perftest (apt-get install ucx-utils)" >&2; exit 1; }
case "$PATH_KIND" in any) TLS=tcp ;; shm) TLS=sm ;; *) echo "--path any|shm" >&2; exit 2 ;; esac
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=(mpirun --oversubscribe --mca pml ob1 --mca btl self,vader,tcp -np 2)
port=$((20000 + RANDOM % 10000))

perftest_us() {  # median us of one get of $1 bytes
  UCX_TLS=$TLS timeout 120 ucx_perftest -t ucp_get -s "$1" -n 50 -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  UCX_TLS=$TLS timeout 120 ucx_perftest 127.0.0.1 -t ucp_get -s "$1" -n 50 -p "$port" 2>/dev/null |
    awk '/^Final:/ {print $3}'
  wait "$server" || true
  port=$((port + 1))
}
mlarun_us() {
  "${MPIRUN[@]}" "$MLARUN" bench transfer --path "$PATH_KIND" --sizes "$1" --repetitions 50 --json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["rows"][0]["median_us"])'
}

echo "| bytes | ucx_perftest us | mlarun us | perftest GB/s | mlarun GB/s | mlarun / perftest |"
echo "|---:|---:|---:|---:|---:|---:|"
for size in ${SIZES//,/ }; do
  p=(); m=()
  for _ in $(seq "$ROUNDS"); do p+=("$(perftest_us "$size")"); m+=("$(mlarun_us "$size")"); done
  python3 - "$size" "${p[*]}" "${m[*]}" <<'PY'
import statistics, sys
size = int(sys.argv[1]); p = statistics.median(map(float, sys.argv[2].split())); m = statistics.median(map(float, sys.argv[3].split()))
print(f"| {size} | {p:.1f} | {m:.1f} | {size / p / 1e3:.2f} | {size / m / 1e3:.2f} | {p / m:.2f} |")
PY
done
