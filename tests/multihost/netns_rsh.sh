#!/bin/bash
# Open MPI's rsh agent for "hosts" that are network namespaces of this machine
# (tests/multihost/netns_hosts.sh). Open MPI calls it as it would call ssh:
#
#   netns_rsh.sh [OPTIONS] HOST COMMAND...
#
# and it runs COMMAND (its words joined by spaces, then read by sh, as ssh's
# remote shell reads them) in HOST's namespace: a new mount namespace in which
# NETNS_HOSTS_FILE is bind-mounted over /etc/hosts (the machine's own file is
# never edited) and a new UTS namespace whose hostname is HOST. With --argv
# first, COMMAND is run as an argument vector instead (no shell, no joining):
# how the test starts mpirun, the coordinator and the clients on a host.
#
# HOST's namespace is named "$NETNS_PREFIX$HOST"; a HOST for which no such
# namespace exists is refused (exit 255, as ssh does when it cannot connect),
# so nothing is ever started on another machine.
set -euo pipefail
argv=0
if [ "${1:-}" = --argv ]; then
  argv=1
  shift
fi
# ssh-style options (Open MPI passes none by default; -x / -T style flags are
# skipped if a configuration adds them).
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
if [ $# -lt 2 ]; then
  echo "netns_rsh.sh: usage: netns_rsh.sh [--argv] [OPTIONS] HOST COMMAND..." >&2
  exit 255
fi
host=$1
shift
: "${NETNS_PREFIX:?netns_rsh.sh: NETNS_PREFIX is not set}"
: "${NETNS_HOSTS_FILE:?netns_rsh.sh: NETNS_HOSTS_FILE is not set}"
ns=$NETNS_PREFIX$host
if [ ! -e "/run/netns/$ns" ]; then
  echo "netns_rsh.sh: no namespace $ns for host '$host'" >&2
  exit 255
fi
# In the new namespaces: $1 the hosts file, $2 the hostname, $3 1 for an
# argument vector, then the command.
enter='mount --bind "$1" /etc/hosts && hostname "$2" || exit 255
argv=$3
shift 3
if [ "$argv" = 1 ]; then exec "$@"; else exec sh -c "$*"; fi'
exec ip netns exec "$ns" unshare --uts --mount --propagation private \
  sh -c "$enter" netns_rsh "$NETNS_HOSTS_FILE" "$host" "$argv" "$@"
