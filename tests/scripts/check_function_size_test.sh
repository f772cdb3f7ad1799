#!/usr/bin/env bash
# scripts/check-function-size passes on the tree; on a small tree of its own
# it refuses a 200-line function by name, passes the same function marked
# NOLINT(readability-function-size) with a reason, and counts a lambda's
# lines toward the function that holds it.
#   check_function_size_test.sh SOURCE_DIR
set -u
src="$1"
check="$src/scripts/check-function-size"
fail() { echo "check_function_size_test: FAILED: $*" >&2; exit 1; }
out=$("$check" --root "$src") || fail "the tree itself: $out"
echo "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/base"
body() {  # N lines of statements, a brace in a string and a comment among them
  echo '  const char* s = "{ not a brace";  // nor this }'
  for ((i = 0; i < $1; ++i)); do echo "  x += $i;"; done
}
{
  echo 'namespace mlarun {'
  echo 'int Short(int x) {'; body 10; echo '  return x;'; echo '}'
  echo 'int Long(int x) {'; body 200; echo '  return x;'; echo '}'
  echo 'int HoldsALambda(int x) {'; echo '  auto f = [&](int y) {'; body 160; echo '    return y;'; echo '  };'
  echo '  return f(x);'; echo '}'
  echo '}  // namespace mlarun'
} >"$tmp/base/a.cc"
got=$("$check" --root "$tmp"); rc=$?
[ $rc -eq 1 ] || fail "a 200-line function: exit $rc, expected 1 ($got)"
echo "$got" | grep -q 'base/a.cc:16: 204 lines: int Long(int x) {' || fail "Long not named: $got"
echo "$got" | grep -q 'int HoldsALambda' || fail "the lambda's lines not counted: $got"
echo "$got" | grep -q 'int Short' && fail "Short refused: $got"
sed -i 's|^int Long(int x) {|int Long(int x) {  // NOLINT(readability-function-size): a kernel, one unit|; s|^int HoldsALambda|// NOLINTNEXTLINE(readability-function-size): the test of the marker on the line before\nint HoldsALambda|' "$tmp/base/a.cc"
got=$("$check" --root "$tmp") || fail "marked functions refused: $got"
echo "check_function_size_test: OK"
