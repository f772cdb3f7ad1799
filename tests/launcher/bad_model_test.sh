#!/bin/bash
# `mlarun generate` on model files whose sizes cannot be allocated, or whose
# weights are not finite: each must end with exit code 2 and a message naming
# the field (or tensor) and the bytes, never a crash (134 from std::bad_alloc,
# 137 from the OOM killer) or a hang.
# Usage: bad_model_test.sh <mlarun> <source dir>
set -u
mlarun=$1
src=$2
tiny=$src/configs/models/tiny.yaml
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0

# check <name> <expected exit code> <extended regex> <model path>
check() {
  local name=$1 want=$2 expect=$3 model=$4
  timeout -k 5 60 "$mlarun" generate --model "$model" --prompt-ids 1,2 >"$dir/out" 2>&1
  local rc=$?
  if [ "$rc" -ne "$want" ] || ! grep -Eq "$expect" "$dir/out"; then
    echo "bad_model_test: FAIL: $name: exit $rc (want $want), output:"
    cat "$dir/out"
    echo "  expected /$expect/"
    failures=$((failures + 1))
  else
    echo "bad_model_test: ok: $name: $(head -c 300 "$dir/out")"
  fi
}

# tiny.yaml with one line replaced: yaml_with <name> <sed expression>
yaml_with() {
  sed "$2" "$tiny" >"$dir/$1.yaml"
  echo "$dir/$1.yaml"
}

check vocab_2_40 2 "INVALID_ARGUMENT: .*vocab_size x hidden_size: model.embed_tokens.weight .*281474976710656 bytes" \
  "$(yaml_with vocab 's/^vocab_size: .*/vocab_size: 1099511627776/')"
check hidden_1e9 2 "RESOURCE_EXHAUSTED: .*would need [0-9]+ bytes.*memory and swap.*hidden_size" \
  "$(yaml_with hidden 's/^hidden_size: .*/hidden_size: 1000000000/')"
check hidden_negative 2 "INVALID_ARGUMENT: .*hidden_size must be positive, got -64" \
  "$(yaml_with hneg 's/^hidden_size: .*/hidden_size: -64/')"
check vocab_zero 2 "INVALID_ARGUMENT: .*vocab_size must be positive, got 0" \
  "$(yaml_with vzero 's/^vocab_size: .*/vocab_size: 0/')"
check layers_huge 2 "INVALID_ARGUMENT: .*num_hidden_layers must be at most 65536, got 100000000000" \
  "$(yaml_with layers 's/^num_hidden_layers: .*/num_hidden_layers: 100000000000/')"
check experts_huge 2 "INVALID_ARGUMENT: .*n_routed_experts must be at most 65536" \
  "$(yaml_with experts 's/^n_routed_experts: .*/n_routed_experts: 4294967296/')"
check unknown_key 2 "INVALID_ARGUMENT: .*hiden_size: unknown key" \
  "$(yaml_with typo 's/^hidden_size:/hiden_size:/')"

# A checkpoint directory whose config.json has vocab_size 2^40.
mkdir -p "$dir/ckpt"
printf '{"model_type": "deepseek_v3", "vocab_size": 1099511627776, "hidden_size": 64}\n' >"$dir/ckpt/config.json"
check config_json_vocab_2_40 2 "INVALID_ARGUMENT: .*config.json: vocab_size x hidden_size: .* bytes" "$dir/ckpt"

if [ "$failures" -ne 0 ]; then
  echo "bad_model_test: $failures case(s) failed"
  exit 1
fi
echo "bad_model_test: PASS"
