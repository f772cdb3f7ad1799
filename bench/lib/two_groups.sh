# Sourced by bench/migration_pause.sh and bench/prefix_fetch.sh: a
# coordinator and `mpirun -np 2 mlarun worker --parallel dp=2` (two DP
# groups), one deployment at a time, with a worker secret (a coordinator
# beyond loopback needs one).
#
#   Expects $MLARUN $MODEL $THREADS $work $name, and the arrays run (a
#   prefix for every command, e.g. an agent entering a network namespace;
#   may be empty) and mpirun_args; $LISTEN_HOST is the coordinator's
#   address (default 127.0.0.1).
#   start_two_groups COORDINATOR_FLAGS... -- WORKER_FLAGS...   -> $addr
#   stats                  GetStats of the deployment, as JSON
#   stop_two_groups        (the caller's exit trap should call it too)
pids=()

stop_two_groups() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}

stats() { "${run[@]}" "$MLARUN" stats --coordinator "$addr" --json 2>/dev/null; }

start_two_groups() {
  local coordinator=() port
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    coordinator+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  addr=${LISTEN_HOST:-127.0.0.1}:$port
  [ -s "$work/secret" ] || (umask 077 && head -c 32 /dev/urandom | base64 >"$work/secret")
  "${run[@]}" "$MLARUN" coordinator --listen "$addr" --worker-secret-file "$work/secret" \
    ${coordinator[@]+"${coordinator[@]}"} 2>"$work/coord.log" &
  pids=($!)
  "${run[@]}" mpirun "${mpirun_args[@]}" -np 2 "$MLARUN" worker --coordinator "$addr" --model "$MODEL" \
    --parallel dp=2 --threads "$THREADS" --cache-bytes 1073741824 --worker-secret-file "$work/secret" "$@" \
    2>"$work/worker.log" &
  pids+=($!)
  for _ in $(seq 300); do
    stats | python3 -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if sum(g.get('connected', False) for g in d['groups']) == 2 else 1)" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "$name: the groups did not register: $(tail -3 "$work/worker.log")" >&2
  exit 1
}
