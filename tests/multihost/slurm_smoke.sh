#!/bin/bash
# deploy/slurm/mlarun.sbatch on this machine as a one-node allocation of 2
# tasks: Slurm's variables set by hand, stand-ins for `scontrol` (the node
# list) and `srun` (which checks --mpi=pmix and the task count and hands the
# ranks to mpirun, the MCA settings travelling in OMPI_MCA_* as with Slurm).
# Passes only if the script reports ready, writes the address file and a
# client token file (mode 600), refuses a client without that token, serves
# a request with it with the tokens of one process, and on SIGTERM exits
# leaving none of its processes behind.
#
#   slurm_smoke.sh MLARUN SOURCE_DIR mpirun|srun
set -euo pipefail
if [ $# -ne 3 ] || { [ "$3" != mpirun ] && [ "$3" != srun ]; }; then
  echo "usage: slurm_smoke.sh MLARUN SOURCE_DIR mpirun|srun" >&2
  exit 2
fi
mlarun=$(realpath "$1") src=$(realpath "$2") launcher=$3
name="deploy_slurm_$launcher"
work=$(mktemp -d "/tmp/$name.XXXXXX")
job=""
logs=("$work/job.log")
before_exit() {
  if [ -n "$job" ] && kill -0 "$job" 2>/dev/null; then
    kill -TERM "$job" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$job" 2>/dev/null || true
  fi
}
source "$src/scripts/lib/on_exit.sh"

mkdir -p "$work/bin" "$work/submit"
cat >"$work/bin/scontrol" <<'EOF'
#!/bin/sh
# scontrol show hostnames LIST: one name per line (LIST is one name here).
[ "$1 $2" = "show hostnames" ] && echo "$3"
EOF
cat >"$work/bin/srun" <<'EOF'
#!/bin/bash
# srun [--opt=value...] CMD...: requires --mpi=pmix, runs --ntasks ranks of
# CMD under mpirun (one node), which reads OMPI_MCA_* as Slurm's ranks would.
set -euo pipefail
ntasks="" pmix=0
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do
  case $1 in
    --mpi=pmix) pmix=1 ;;
    --ntasks=*) ntasks=${1#--ntasks=} ;;
  esac
  shift
done
[ $pmix = 1 ] || { echo "srun stand-in: no --mpi=pmix" >&2; exit 2; }
[ -n "$ntasks" ] || { echo "srun stand-in: no --ntasks" >&2; exit 2; }
exec mpirun --oversubscribe --bind-to none -np "$ntasks" "$@"
EOF
chmod +x "$work/bin/scontrol" "$work/bin/srun"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
host=$(hostname)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Not SLURM_JOBID: Open MPI would take it for a real allocation.
env PATH="$work/bin:$PATH" SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE="2(x1)" SLURM_CPUS_PER_TASK=1 \
  SLURM_JOB_ID=4242 SLURM_JOB_NODELIST="$host" SLURM_SUBMIT_DIR="$work/submit" \
  MLARUN="$mlarun" MLARUN_LAUNCHER="$launcher" MLARUN_PORT="$port" MLARUN_LISTEN="127.0.0.1:$port" \
  MLARUN_COORDINATOR="127.0.0.1:$port" MLARUN_READY_TIMEOUT=60 MLARUN_POLICY=round_robin \
  MLARUN_WORKER_FLAGS="--cache-bytes 16777216 --kv-dtype fp32" \
  bash "$src/deploy/slurm/mlarun.sbatch" "$src/configs/models/tiny.yaml" dp=2 >"$work/job.log" 2>&1 &
job=$!

ready=0
for _ in $(seq 300); do
  kill -0 "$job" 2>/dev/null || fail "mlarun.sbatch exited before it was ready"
  if grep -q "^mlarun: ready" "$work/job.log"; then
    ready=1
    break
  fi
  sleep 0.2
done
[ $ready = 1 ] || fail "mlarun.sbatch did not report ready within 60 s"
[ -s "$work/submit/mlarun-4242.address" ] || fail "no address file mlarun-4242.address"
addr=$(cat "$work/submit/mlarun-4242.address")
[ "$addr" = "127.0.0.1:$port" ] || fail "address file holds '$addr', not 127.0.0.1:$port"
# The job closed its client API with a token file of its own (mode 600);
# without it a client is refused, with it served.
tokens="$work/submit/mlarun-4242.tokens"
[ -s "$tokens" ] || fail "no client token file mlarun-4242.tokens"
[ "$(stat -c %a "$tokens")" = 600 ] || fail "the client token file is mode $(stat -c %a "$tokens"), not 600"
timeout 30 "$mlarun" submit --coordinator "$addr" --prompt-ids 5,6,7 --max-tokens 6 --timeout 10 >/dev/null 2>"$work/refused.log" &&
  fail "mlarun submit without the job's token was served"
grep -q UNAUTHENTICATED "$work/refused.log" || fail "without the token: $(cat "$work/refused.log")"
timeout 60 "$mlarun" submit --coordinator "$addr" --auth-token-file "$tokens" --prompt-ids 5,6,7 --max-tokens 6 --json \
  >"$work/served.json" || fail "mlarun submit through the job failed"
timeout 60 "$mlarun" generate --model "$src/configs/models/tiny.yaml" --prompt-ids 5,6,7 --max-tokens 6 --json \
  --kv-dtype fp32 --threads 1 >"$work/local.json" 2>/dev/null || fail "mlarun generate failed"
python3 - "$work/served.json" "$work/local.json" <<'PY' || fail "served tokens differ from one process"
import json, sys
served, local = (json.loads(open(p).read()) for p in sys.argv[1:])
assert served["tokens"] == local["tokens"], (served, local)
PY

# SIGTERM (what scancel and the time limit send) ends the script and the job.
kill -TERM "$job"
stopped=0
for _ in $(seq 100); do
  if ! kill -0 "$job" 2>/dev/null; then
    stopped=1
    break
  fi
  sleep 0.1
done
[ $stopped = 1 ] || fail "mlarun.sbatch still running 10 s after SIGTERM"
wait "$job" 2>/dev/null || true
job=""
for _ in $(seq 50); do
  left=$(pgrep -f -- "--coordinator 127.0.0.1:$port|--listen 127.0.0.1:$port" || true)
  [ -z "$left" ] && break
  sleep 0.1
done
if [ -n "$left" ]; then
  # Ours (the port is this run's): stop them, then report.
  for p in $left; do kill -KILL "$p" 2>/dev/null || true; done
  fail "processes left after SIGTERM: $left"
fi
echo "$name: PASS (ready after $(sed -n 's/.* after \([0-9]*\) s .*/\1/p' "$work/job.log") s; tokens equal one process's)"
exit 0
