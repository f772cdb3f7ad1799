#!/usr/bin/env bash
# scripts/check-layers passes on the tree, and fails, naming the file and the
# include, on a copy of the tree with one include against the order added:
# base/ including the coordinator, serving/ including the engine, and a peer
# (kv/ including attention/).
#   check_layers_test.sh SOURCE_DIR
set -u
src="$1"
check="$src/scripts/check-layers"
fail() { echo "check_layers_test: FAILED: $*" >&2; exit 1; }
out=$("$check" --root "$src") || fail "the tree itself: $out"
echo "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Every top-level folder but the build, the tests and the docs (whatever
# LAYERS names is among them).
for d in "$src"/*/; do
  case "$(basename "$d")" in build | tests | docs) continue ;; esac
  cp -r "$d" "$tmp/"
done
"$tmp/scripts/check-layers" --root "$tmp" >/dev/null || fail "an unchanged copy of the tree does not pass"
inject() {  # file include expected-message
  local file="$1" inc="$2" expect="$3"
  cp "$tmp/$file" "$tmp/$file.orig"
  sed -i "1i #include \"$inc\"" "$tmp/$file"
  local got rc
  got=$("$tmp/scripts/check-layers" --root "$tmp" 2>&1); rc=$?
  mv "$tmp/$file.orig" "$tmp/$file"
  [ $rc -eq 1 ] || fail "$file including $inc: exit $rc, expected 1 ($got)"
  echo "$got" | grep -qF "$file:1: includes $inc, but $expect" || fail "$file including $inc: message was: $got"
  echo "refused as expected: $file -> $inc"
}
inject base/status.h serving/coordinator/coordinator.h "base/ may include only base"
inject serving/sim/sim_worker.cc runtime/engine/engine.h "serving/ may include only"
inject kv/latent_cache.h attention/mla.h "kv/ may include only base, gemm, kv"
inject runtime/ops/norm.h runtime/model/model.h "runtime/ops/ may include only"
echo "check_layers_test: OK"
