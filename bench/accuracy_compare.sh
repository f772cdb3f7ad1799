#!/usr/bin/env bash
# The accuracy of mlarun's and llama.cpp's quantized weights on the same
# random V2-Lite-width checkpoint: llama_cpp_compare.sh --accuracy (see its
# --help and bench/README.md). Every row's logits against those of mlarun on
# the bf16 checkpoint, on the same random ids:
#   mlarun fp8 / int8 / int4      (int8 / int4: `mlarun quantize`)
#   llama.cpp F32 / Q8_0 / Q4_K_M (F32: the sanity row)
#
# Usage: bench/accuracy_compare.sh [--positions N] [--sequence-length L] [--layers N]
#            [--seed S] [--threads T] [--work DIR] [--mlarun PATH] [--skip-build] [--out FILE]
set -Eeuo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_compare.sh" --accuracy "$@"
