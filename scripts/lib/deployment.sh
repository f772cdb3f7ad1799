# Sourced by scripts/demo and the live-deployment tests (serving_e2e.sh,
# memory_measure.sh, step_failure.sh): a scratch folder, a coordinator and one
# mpirun worker job on the tiny model at a time, and a cleanup that leaves no
# process behind.
#
#   name=NAME; source deployment.sh            (expects $mlarun $src $np $groups)
#   start_deployment POLICY WORKER_FLAGS...    -> $addr, logs in $work
#                                              (coordinator_flags=(...), if set, go to the coordinator)
#   wait_for_groups                            (fails unless $groups register)
#   stop_deployment                            (the cleanup on exit does it too)
#   fail MESSAGE                               (exit 1)
#   rank_pid N                                 the pid of the worker job's rank N (empty if none)
#
# On exit the deployment is stopped. The scratch folder (and the logs in it)
# is deleted only when the script succeeded; when it failed in any way (fail,
# a command under set -e, a signal) the last lines of the coordinator and
# worker logs are printed under a header and the folder is kept.
work=$(mktemp -d)
pids=()
stop_deployment() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    if [ $alive = 0 ]; then break; fi
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  pids=()
}
logs=("$work/coord.log" "$work/worker.log")
before_exit() { stop_deployment; }
source "$(dirname "${BASH_SOURCE[0]}")/on_exit.sh"

rank_pid() {  # by the rank Open MPI gave the process, not by start order
  local p
  for p in $(pgrep -f "$mlarun worker"); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1"; then echo "$p"; return; fi
  done
}

start_deployment() {
  local policy=$1
  shift
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  addr=127.0.0.1:$port
  "$mlarun" coordinator --listen "$addr" --policy "$policy" ${coordinator_flags[@]+"${coordinator_flags[@]}"} \
    2>"$work/coord.log" &
  pids+=($!)
  mpirun --oversubscribe --mca pml ob1 --mca btl self,vader,tcp -np "$np" \
    "$mlarun" worker --coordinator "$addr" --model "$src/configs/models/tiny.yaml" --threads 1 "$@" \
    2>"$work/worker.log" &
  pids+=($!)
}

wait_for_groups() {
  for _ in $(seq 150); do
    if "$mlarun" stats --coordinator "$addr" --json >"$work/stats.json" 2>/dev/null &&
       python3 -c "import json,sys; d=json.load(open('$work/stats.json')); sys.exit(0 if sum(1 for g in d.get('groups', []) if g.get('connected')) == $groups else 1)"; then
      return 0
    fi
    sleep 0.2
  done
  fail "the $groups DP groups did not register"
}

# Waits (up to ~10 s) until every rank reports an empty latent cache: the
# requests served have released all their blocks. The last GetStats is left
# in $work/stats.json. Returns non-zero if the caches never emptied.
wait_caches_empty() {
  for _ in $(seq 50); do
    "$mlarun" stats --coordinator "$addr" --json >"$work/stats.json" 2>/dev/null &&
      python3 -c "import json,sys; d=json.load(open('$work/stats.json')); sys.exit(0 if d['ranks'] and all(int(r.get('cache_blocks_used', 0)) == 0 for r in d['ranks']) else 1)" &&
      return 0
    sleep 0.2
  done
  return 1
}
