#!/bin/bash
# `cmake --install` (what scripts/install runs) into a scratch prefix: the
# installed binary runs from there on the installed tiny model config.
#   install_test.sh CMAKE BUILD_DIR
set -u
cmake=$1 build=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
"$cmake" --install "$build" --prefix "$prefix" >/dev/null || { echo "install_test: cmake --install failed"; exit 1; }
bin="$prefix/bin/mlarun"
[ -x "$bin" ] || { echo "install_test: no $bin"; exit 1; }
model="$prefix/share/mlarun/configs/models/tiny.yaml"
[ -f "$model" ] || { echo "install_test: no $model"; exit 1; }
out=$(cd / && "$bin" generate --model "$model" --prompt-ids 5,6,7 --max-tokens 4 --json 2>/dev/null) ||
  { echo "install_test: the installed mlarun failed"; exit 1; }
python3 -c "import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if len(r['tokens']) == 4 else 1)" "$out" ||
  { echo "install_test: unexpected output: $out"; exit 1; }
echo "install_test: ok"
