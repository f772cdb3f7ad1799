#!/usr/bin/env bash
# scripts/hooks/commit-msg accepts messages that follow the convention and
# rejects a long subject, a subject without an area, and a missing blank line.
#   commit_msg_test.sh SOURCE_DIR
set -u
hook="$1/scripts/hooks/commit-msg"
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
failed=0
expect() {  # rc message
  printf '%b' "$2" >"$tmp"
  "$hook" "$tmp" 2>/dev/null
  local rc=$?
  if [ $rc -ne "$1" ]; then echo "commit_msg_test: expected $1, got $rc for: $2" >&2; failed=1; fi
}
long=$(printf 'x%.0s' $(seq 66))
expect 0 "gemm: move the kernel tables out of base\n\nWhy, and the tests.\n"
expect 0 "serving/http: check JSON types only\n"
expect 0 "# a comment git drops\ntree: one folder per layer\n\nBody.\n"
expect 0 "gemm: ${long}\n"
expect 1 "gemm: ${long}x\n"
expect 1 "Move the kernel tables out of base\n"
expect 1 "gemm: move the kernels\nno blank line\n"
expect 1 "\n\n"
[ $failed -eq 0 ] && echo "commit_msg_test: OK"
exit $failed
