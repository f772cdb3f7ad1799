# Sourced by scripts that work in a scratch folder and must leave nothing
# behind (scripts/lib/deployment.sh and the tests that start processes).
#
#   name=NAME work=DIR logs=(FILE...); before_exit() { ...; }; source on_exit.sh
#   fail MESSAGE                               (exit 1)
#
# On exit, for any reason (success, fail, a command under set -e, a signal),
# `before_exit` runs first if the script defines it (stop processes, delete
# what was created). The scratch folder is deleted when the script succeeded
# (exit 0) or skipped (77); otherwise it is kept and the last 40 lines of
# each non-empty file in `logs` are printed under a header.
on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  if declare -F before_exit >/dev/null; then before_exit || true; fi
  if [ "$rc" = 0 ] || [ "$rc" = 77 ]; then
    rm -rf "$work"
    return "$rc"
  fi
  echo "$name: FAILED (exit code $rc); logs kept in $work"
  local log
  for log in "${logs[@]}"; do
    if [ -s "$log" ]; then
      echo "========== $name: last 40 lines of $log =========="
      tail -n 40 "$log"
    fi
  done
  echo "========== $name: end of logs =========="
  return "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
fail() {
  echo "$name: FAIL: $*"
  exit 1
}
