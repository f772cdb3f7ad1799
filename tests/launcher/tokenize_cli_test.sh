#!/bin/bash
# `mlarun tokenize` as scripts use it: lines in, lines out, in order; encode
# then --decode gives the strings back; a bad line answers in its place
# (exit 1) without stopping the rest; a missing tokenizer is exit 2.
#   tokenize_cli_test.sh MLARUN SOURCE_DIR
set -u
mlarun=$1 src=$2
model="$src/configs/models/tiny.yaml"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "tokenize_cli_test: $*"; exit 1; }
python3 - >"$work/in.jsonl" <<'PY'
import json, random
rng = random.Random(3)
alphabet = "abc xyz\n\t 0123456789 你好世界 ありがとう 😀👩‍👩‍👧 é ñ!?.,;"
for _ in range(200):
    print(json.dumps("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))), ensure_ascii=False))
PY
"$mlarun" tokenize --model "$model" --no-special-tokens <"$work/in.jsonl" >"$work/ids.jsonl" || fail "encode failed"
[ "$(wc -l <"$work/ids.jsonl")" = 200 ] || fail "not one line out per line in"
"$mlarun" tokenize --model "$model" --decode <"$work/ids.jsonl" >"$work/out.jsonl" || fail "decode failed"
python3 - "$work/in.jsonl" "$work/out.jsonl" <<'PY' || fail "decode(encode(x)) != x"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")]
b = [json.loads(l) for l in open(sys.argv[2], encoding="utf-8")]
sys.exit(0 if a == b else 1)
PY
# With special tokens, each line starts with bos (id 0 in the tiny tokenizer).
head -1 "$work/in.jsonl" | "$mlarun" tokenize --model "$model" | grep -q '^\[0,' || fail "no bos with special tokens"
printf '"a"\n{"not": "a string"}\n"b"\n' | "$mlarun" tokenize --model "$model" >"$work/mixed.jsonl"
[ $? = 1 ] || fail "a bad line did not make the exit code 1"
sed -n 2p "$work/mixed.jsonl" | grep -q '"error":"line 2' || fail "the bad line's answer is not an error naming line 2"
[ "$(wc -l <"$work/mixed.jsonl")" = 3 ] || fail "lines after the bad one were lost"
echo '"x"' | "$mlarun" tokenize --model "$work/nowhere" 2>"$work/err.txt"
[ $? = 2 ] && [ -s "$work/err.txt" ] || fail "a missing tokenizer is not exit 2 with a message"
echo "tokenize_cli_test: ok"
