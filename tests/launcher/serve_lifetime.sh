#!/bin/bash
# `mlarun serve` killed with SIGKILL takes its worker job with it, within 10 s:
#  1. the plain job: mpirun and its ranks;
#  2. a job whose mpirun is a wrapper that runs the real one as its child, so
#     that the kernel's signal on serve's death (PR_SET_PDEATHSIG) reaches
#     only the wrapper: the ranks, no longer under serve, leave by themselves
#     and mpirun with them;
#  3. a stand-in launcher that only sleeps (no ranks to notice anything):
#     the kernel's signal ends it.
# The worker-secret directory a killed serve left is removed by the next
# serve, while one whose serve is alive stays.
#
#   serve_lifetime.sh MLARUN SOURCE_DIR
set -u
mlarun=$1 src=$2
name=serve_lifetime
work=$(mktemp -d)
# serve keeps its secret directory in $TMPDIR: a private one, so that the
# serves of tests running beside this one neither see nor clean ours.
export TMPDIR="$work/tmp"
mkdir -p "$TMPDIR"
logs=("$work/serve1.log" "$work/serve2.log" "$work/serve3.log")
serve_pid=
job=()
left_dirs=()
before_exit() {
  [ -n "$serve_pid" ] && kill -KILL "$serve_pid" 2>/dev/null
  for p in "${job[@]}"; do kill -KILL "$p" 2>/dev/null; done
  for d in "${left_dirs[@]}"; do rm -rf "$d"; done
  true
}
source "$src/scripts/lib/on_exit.sh"

model="$src/configs/models/tiny.yaml"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# alive PID: the process exists and is not a zombie waiting for its reaper
alive() { [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" != Z ]; }

# starts serve on dp=2 with its log in LOG and PATH from the second
# argument, waits until it has started its job (and, with `ready`, until the
# job is ready), sets serve_pid, addr, job (the launcher and the ranks) and
# secret_dir
start_serve() {
  local log=$1 path=$2 wait_for=$3
  addr=127.0.0.1:$(free_port)
  PATH=$path "$mlarun" serve --model "$model" --parallel dp=2 --grpc "$addr" --http "" --threads 1 \
    --worker-arg=--kv-dtype --worker-arg=fp32 2>"$log" &
  serve_pid=$!
  for _ in $(seq 1200); do
    grep -q "$wait_for" "$log" 2>/dev/null && break
    kill -0 "$serve_pid" 2>/dev/null || fail "serve exited before '$wait_for'"
    sleep 0.1
  done
  grep -q "$wait_for" "$log" || fail "no '$wait_for' in $log after 120 s"
  mapfile -t job < <(pgrep -f -- "--coordinator $addr ")
  secret_dir=$(grep -o -- "--worker-secret-file [^ ]*" "$log" | head -1 | awk '{print $2}' | xargs dirname)
  [ -d "$secret_dir" ] || fail "no worker secret directory found in $log"
  left_dirs+=("$secret_dir")
}
ready="mlarun serve: ready: 2 DP group(s)"

# waits up to 10 s until none of the pids in `job` is alive
expect_job_gone() {
  local what=$1 left
  for _ in $(seq 100); do
    left=()
    for p in "${job[@]}"; do alive "$p" && left+=("$p"); done
    [ "${#left[@]}" = 0 ] && return 0
    sleep 0.1
  done
  fail "$what: still running 10 s later: $(ps -o pid,ppid,stat,cmd -p "$(IFS=,; echo "${left[*]}")" | cut -c1-160)"
}

# 1. The plain job.
start_serve "$work/serve1.log" "$PATH" "$ready"
[ "${#job[@]}" -ge 3 ] || fail "expected the launcher and 2 ranks, found: ${job[*]}"
first_dir=$secret_dir
kill -KILL "$serve_pid"
wait "$serve_pid" 2>/dev/null
serve_pid=
expect_job_gone "serve killed with SIGKILL: its job"
[ -d "$first_dir" ] || fail "the killed serve's secret directory is already gone (nothing left to clean up?)"

# A directory whose serve is alive (this script) must stay.
live_dir=$(mktemp -d "$TMPDIR/mlarun-serve-XXXXXX")
left_dirs+=("$live_dir")
echo $$ >"$live_dir/serve-pid"

# 2. mpirun behind a wrapper.
mkdir "$work/wrapper" "$work/stand-in"
printf '#!/bin/sh\n%s "$@"\n' "$(command -v mpirun)" >"$work/wrapper/mpirun"
printf '#!/bin/sh\nexec sleep 300\n' >"$work/stand-in/mpirun"
chmod +x "$work/wrapper/mpirun" "$work/stand-in/mpirun"
start_serve "$work/serve2.log" "$work/wrapper:$PATH" "$ready"
[ "${#job[@]}" -ge 4 ] || fail "expected the wrapper, mpirun and 2 ranks, found: ${job[*]}"
[ ! -e "$first_dir" ] || fail "the next serve did not remove $first_dir"
grep -q "removed $first_dir" "$work/serve2.log" || fail "the next serve did not say it removed $first_dir"
[ -d "$live_dir" ] || fail "the next serve removed $live_dir, whose serve (pid $$) is alive"
kill -KILL "$serve_pid"
wait "$serve_pid" 2>/dev/null
serve_pid=
expect_job_gone "serve killed with SIGKILL, its mpirun behind a wrapper: the job"

# 3. A launcher that starts no ranks.
start_serve "$work/serve3.log" "$work/stand-in:$PATH" "started the worker job"
launcher=$(grep -o "started the worker job (pid [0-9]*)" "$work/serve3.log" | grep -o "[0-9]*")
job=("$launcher")
alive "$launcher" || fail "the stand-in launcher is not running"
kill -KILL "$serve_pid"
wait "$serve_pid" 2>/dev/null
serve_pid=
expect_job_gone "serve killed with SIGKILL: its stand-in launcher"
echo "serve_lifetime: ok"
