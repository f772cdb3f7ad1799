#!/bin/bash
# Three hosts on one machine: network namespaces joined by veth pairs to a
# bridge, each with its own address (10.77.0.11-13 on 10.77.0.0/24) and
# hostname (host1-3). The coordinator runs on host1; the worker job is started
# from host1 by `mpirun --hostfile` with one rank per host, Open MPI reaching
# the other hosts through tests/multihost/netns_rsh.sh (its rsh agent) and
# restricted to the bridge's subnet; the clients run on host2. In layout dp=3
# and then dp=1,attn_tp=3 a set of greedy requests goes through the
# coordinator with `mlarun submit`, and the test passes only if the ranks
# report the three hostnames, every request's tokens equal `mlarun generate`
# in one process on the same prompts, and host2 and host3 hold a TCP
# connection to each other (MPI's traffic crossed the bridge between two
# hosts: neither the coordinator's stream nor Open MPI's launch connects them).
# The model is tests/multihost/tiny3.yaml: configs/models/tiny.yaml with the
# widths split over ranks (heads, MLP, experts) divisible by 3.
#
#   netns_hosts.sh MLARUN SOURCE_DIR tcp|ucx
#
# tcp: Open MPI's ob1 PML over its TCP BTL; ucx: the UCX PML with UCX's TCP
# transport on the namespaces' interface. Exits 77 (skipped) when not root or
# when the namespaces or the bridge cannot be created. Nothing but loopback
# and the namespaces' own addresses is ever a traffic target, and the root
# namespace gets no address: the bridge only joins the namespaces. Everything
# it creates is named after its PID (namespaces mlarun-mh<PID>-host<i>, bridge
# mlbr<PID>, links mlv<PID>h<i>), so parallel runs do not collide; on exit (a
# failure, a signal, its own deadline) it stops its processes and deletes
# what it created, and at start it deletes what a run that was killed left
# (tests/multihost/netns_lib.sh, shared with the other namespace scripts).
set -euo pipefail
if [ $# -ne 3 ] || { [ "$3" != tcp ] && [ "$3" != ucx ]; }; then
  echo "usage: netns_hosts.sh MLARUN SOURCE_DIR tcp|ucx" >&2
  exit 2
fi
mlarun=$(realpath "$1") src=$(realpath "$2") transport=$3
name="multihost_$transport"
here="$src/tests/multihost"
model="$here/tiny3.yaml"
hosts=(host1 host2 host3)
addrs=(10.77.0.11 10.77.0.12 10.77.0.13)
work=$(mktemp -d "/tmp/$name.XXXXXX")
logs=()
source "$here/netns_lib.sh"
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, a bridge, mount and UTS namespaces)"
for tool in ip unshare mount mpirun python3 timeout ss; do
  command -v "$tool" >/dev/null || skip "$tool not found"
done
# The whole run ends within the budget: past it, TERM (and the cleanup).
netns_watchdog "${MULTIHOST_BUDGET_S:-100}"
netns_delete_stale

# ---- the network -------------------------------------------------------------
netns_create
for h in "${hosts[@]}"; do echo "$h slots=1"; done >"$work/hostfile"
netns_wait_reachable
echo "$name: hosts ${hosts[*]} (${addrs[*]}) on bridge $bridge"

# ---- Open MPI ------------------------------------------------------------------
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(--hostfile "$work/hostfile" -np 3 --bind-to none
     --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1
     --mca oob_tcp_if_include "$subnet" --mca btl_tcp_if_include "$subnet")
if [ "$transport" = tcp ]; then
  mpi+=(--mca pml ob1 --mca btl self,vader,tcp)
else
  # UCX_LOG_LEVEL=info: each rank logs the transports of each endpoint it
  # opens ("ep_cfg[1]: tag(tcp/mh0)"), which the test checks.
  mpi+=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any
        -x UCX_TLS=tcp,sm,self -x UCX_NET_DEVICES="$nic" -x UCX_LOG_LEVEL=info)
fi

# ---- the requests and the answer of one process -----------------------------
python3 - >"$work/requests.jsonl" <<'PY'
import json, random
rng = random.Random(7)
for i in range(12):
    print(json.dumps({"prompt_ids": [rng.randrange(2, 512) for _ in range(rng.randrange(1, 24))],
                      "max_tokens": rng.randrange(2, 9), "ignore_eos": i % 2 == 0}))
PY
logs+=("$work/generate.log")
timeout 60 "$mlarun" generate --model "$model" --prompts "$work/requests.jsonl" --json --kv-dtype fp32 --threads 1 \
  >"$work/local.jsonl" 2>"$work/generate.log" || fail "mlarun generate (one process) failed"

# ---- serve each layout across the three hosts --------------------------------
coordinator="host1:50051"
serve() {  # serve LAYOUT TAG GROUPS
  local layout=$1 tag=$2 groups=$3 t0=$SECONDS
  logs+=("$work/coord-$tag.log" "$work/worker-$tag.log" "$work/submit-$tag.log")
  [ -s "$work/secret" ] || (umask 077 && head -c 32 /dev/urandom | base64 >"$work/secret")
  # The clients on host2 authenticate, as a deployment beyond loopback does:
  # GetStats tells the ranks' hosts only to authenticated callers.
  [ -s "$work/token" ] || (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token")
  on_host host1 "$mlarun" coordinator --listen "$coordinator" --policy round_robin \
    --worker-secret-file "$work/secret" --auth-token-file "$work/token" 2>"$work/coord-$tag.log" &
  pids+=($!)
  on_host host1 timeout --kill-after=5 120 mpirun "${mpi[@]}" \
    "$mlarun" worker --coordinator "$coordinator" --model "$model" --parallel "$layout" --threads 1 \
    --worker-secret-file "$work/secret" --kv-dtype fp32 --cache-bytes 16777216 --block-size 16 \
    >"$work/worker-$tag.log" 2>&1 &
  local job=$!
  pids+=("$job")
  local up=0
  for _ in $(seq 150); do
    kill -0 "$job" 2>/dev/null || fail "$tag: the worker job ended before its groups registered"
    if on_host host2 "$mlarun" stats --coordinator "$coordinator" --auth-token-file "$work/token" --json --timeout 2 \
         >"$work/stats-$tag.json" 2>/dev/null &&
       python3 -c "import json,sys; d=json.load(open('$work/stats-$tag.json')); sys.exit(0 if sum(1 for g in d.get('groups', []) if g.get('connected')) == $groups else 1)"; then
      up=1
      break
    fi
    sleep 0.2
  done
  [ $up = 1 ] || fail "$tag: the $groups DP group(s) did not register with the coordinator on host1 within 30 s"
  echo "$name: $tag: $groups group(s) registered after $((SECONDS - t0)) s"
  python3 - "$work/stats-$tag.json" <<'PY' || fail "$tag: the ranks did not run one per host"
import json, sys
ranks = json.load(open(sys.argv[1]))["ranks"]
hosts = sorted(r.get("host", "") for r in ranks)
assert hosts == ["host1", "host2", "host3"], f"ranks' hosts: {hosts}"
PY
  timeout 60 "$agent" --argv host2 "$mlarun" submit --coordinator "$coordinator" --auth-token-file "$work/token" \
    --prompts "$work/requests.jsonl" \
    --concurrency 12 --json >"$work/served-$tag.jsonl" 2>"$work/submit-$tag.log" ||
    fail "$tag: mlarun submit from host2 failed: $(tail -3 "$work/submit-$tag.log")"
  python3 - "$work/served-$tag.jsonl" "$work/local.jsonl" "$groups" <<'PY' || fail "$tag: served tokens differ from one process"
import json, sys
served = [json.loads(l) for l in open(sys.argv[1])]
local = [json.loads(l) for l in open(sys.argv[2])]
groups = int(sys.argv[3])
assert len(served) == len(local) == 12, (len(served), len(local))
for i, (s, l) in enumerate(zip(served, local)):
    assert "error" not in s, (i, s)
    assert s["tokens"] == l["tokens"], (i, s["tokens"], l["tokens"])
    assert s["finish_reason"] == l["finish_reason"], (i, s, l)
used = sorted({s["dp_group"] for s in served})
assert used == list(range(groups)), f"groups that served: {used}"
PY
  # MPI's traffic between host2 and host3 went over the bridge.
  on_host host2 ss -tnH state established >"$work/ss-$tag.txt" 2>&1 || fail "$tag: ss on host2 failed"
  grep -q "${addrs[2]}:" "$work/ss-$tag.txt" ||
    fail "$tag: no TCP connection between host2 and host3 ($transport): $(cat "$work/ss-$tag.txt")"
  if [ "$transport" = ucx ]; then
    for h in "${hosts[@]}"; do
      grep -q "\[$h:.*ep_cfg\[[0-9]*\]: tag(tcp/$nic)" "$work/worker-$tag.log" ||
        fail "$tag: UCX on $h opened no endpoint over tcp/$nic"
    done
    if grep "ep_cfg\[" "$work/worker-$tag.log" | grep -v "tag(self/" | grep -qv "tag(tcp/$nic)"; then
      fail "$tag: UCX reached another host by something other than tcp/$nic: $(grep "ep_cfg\[" "$work/worker-$tag.log")"
    fi
  fi
  echo "$name: $tag: 12 requests from host2, tokens equal one process's; ranks on host1-3 ($((SECONDS - t0)) s)"
  echo "$name: $tag: host2's TCP connections (local-peer): $(awk '{print $3 "-" $4}' "$work/ss-$tag.txt" | sort | tr '\n' ' ')"
  netns_stop_processes
}

serve dp=3 dp3 3
serve dp=1,attn_tp=3 tp3 1
echo "$name: PASS ($transport)"
exit 0
