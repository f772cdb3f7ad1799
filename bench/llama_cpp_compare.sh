#!/usr/bin/env bash
# mlarun vs llama.cpp on this machine's CPU, on the same random weights.
#
# Makes a random Hugging Face DeepSeek-V2 checkpoint at DeepSeek-V2-Lite widths
# (bench/make_random_checkpoint.py), converts it to GGUF with the llama.cpp that
# llama-cpp-python's PyPI sdist vendors, builds that llama.cpp, and times both
# runtimes in interleaved rounds with the same thread count:
#   batch-1 decode       llama-bench -p 0 -n 64 -d 128   vs  mlarun bench decode --batch 1 --context 128
#   prefill 512 tokens   llama-bench -p 512 -n 0         vs  mlarun bench decode --prefill-tokens 512
#   batched decode       llama-batched-bench -npl 8,32   vs  mlarun bench decode --batch 8,32 --context 512
# then prints a markdown table of the medians (and writes it to --out).
# Idempotent: every step whose output exists is skipped. See bench/README.md.
#
# Usage: bench/llama_cpp_compare.sh [--out FILE] [--rounds N] [--threads T] [--layers N]
#            [--dtype bf16|f32|fp8|int8|int4] [--work DIR] [--mlarun PATH] [--skip-build] [--quick]
#            [--seed S] [--llama-load-mode auto|none|mmap|mlock|mmap+mlock] [--isa native|avx2]
#            [--page-cache huge|as-is] [--table RUN_DIR] [--lm-head keep|int8|int4]
#            [--accuracy [--positions N] [--sequence-length L]]
# --dtype fp8|int8|int4: mlarun loads a copy of the bf16 checkpoint with its
# decoder projections in that format (fp8: 128 x 128 blocks as DeepSeek-V3
# stores them; int8 / int4: `mlarun quantize --format int8|int4`), llama.cpp
# the BF16 GGUF quantized by llama-quantize (fp8 and int8: Q8_0, int4: Q4_K_M).
# --accuracy (bench/accuracy_compare.sh): instead of timing, compares logits
# with those of mlarun on the bf16 checkpoint, on the same random ids
# (`mlarun bench accuracy`, bench/llama_logits.cpp): mlarun fp8 / int8 / int4
# (each where it can be made) and llama.cpp F32 / Q8_0 / Q4_K_M (from the F32
# GGUF); prints one markdown table.
# --lm-head int8|int4: mlarun quantizes its lm_head at load (`--lm-head`);
# llama.cpp's lm_head is as llama-quantize made it (Q4_K_M: Q6_K).
# --table RUN_DIR: print the table of an earlier run again (from its raw
# outputs and RUN_DIR/table.env), run nothing.
# --isa avx2: both sides as on a CPU with AVX2 and FMA only, on a machine that
# has more: llama.cpp built without its AVX-512 code (GGML_NATIVE=OFF, AVX2/FMA/
# F16C on, every AVX-512 variant off; its own build folder), mlarun run with
# MLARUN_CPU_ISA=avx2.
# --page-cache huge (the default): both weight files are evicted from the page
# cache once and re-read through a MADV_HUGEPAGE mapping
# (bench/warm_page_cache.py), so both runtimes' mappings get 2 MiB pages; as-is
# leaves the page cache as earlier reads left it (often 4 KiB pages, which
# cost mlarun ~10% at batch 1).
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BENCH="$ROOT/bench"

WORK="${WORK:-/tmp/mlarun-vs-llama}"
ROUNDS=3
THREADS="$(nproc)"
LAYERS=4
DTYPE=bf16
MLARUN=""
SKIP_BUILD=0
QUICK=0
OUT=""
SEED=0
LLAMA_LOAD_MODE=auto
ISA=native
LM_HEAD=keep
PAGE_CACHE=huge
TABLE_FROM=""
# What the table (bench/compare_table.py) reads from the environment; kept in
# each run folder as table.env.
TABLE_VARS=(MLARUN MLARUN_BUILT RECLAIM_NOTE PAGE_CACHE LLAMA_LOAD_MODE RUN ROUNDS THREADS LAYERS DTYPE GGUF_TYPE CPU_MODEL CPU_FLAGS MLARUN_REV LLAMA_PKG_VERSION TG DEPTH PP BCTX BTG BATCHES QUICK CKPT GGUF)
# Pin the llama-cpp-python release (and so the llama.cpp it vendors); empty: the newest on PyPI.
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"
ACCURACY=0
POSITIONS=1024
SEQ_LEN=256

usage() { sed -n '2,/^set -E/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="${2:?--out needs a value}"; shift 2 ;;
    --rounds) ROUNDS="${2:?--rounds needs a value}"; shift 2 ;;
    --threads) THREADS="${2:?--threads needs a value}"; shift 2 ;;
    --layers) LAYERS="${2:?--layers needs a value}"; shift 2 ;;
    --dtype) DTYPE="${2:?--dtype needs a value}"; shift 2 ;;
    --work) WORK="${2:?--work needs a value}"; shift 2 ;;
    --mlarun) MLARUN="${2:?--mlarun needs a value}"; shift 2 ;;
    --seed) SEED="${2:?--seed needs a value}"; shift 2 ;;
    --llama-load-mode) LLAMA_LOAD_MODE="${2:?--llama-load-mode needs a value}"; shift 2 ;;
    --isa) ISA="${2:?--isa needs a value}"; shift 2 ;;
    --lm-head) LM_HEAD="${2:?--lm-head needs a value}"; shift 2 ;;
    --page-cache) PAGE_CACHE="${2:?--page-cache needs a value}"; shift 2 ;;
    --table) TABLE_FROM="${2:?--table needs a run folder}"; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --quick) QUICK=1; shift ;;
    --accuracy) ACCURACY=1; shift ;;
    --positions) POSITIONS="${2:?--positions needs a value}"; shift 2 ;;
    --sequence-length) SEQ_LEN="${2:?--sequence-length needs a value}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "llama_cpp_compare: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo -e "\nllama_cpp_compare: FAILED: $*" >&2; exit 1; }
if [ -n "$TABLE_FROM" ]; then
  [ -f "$TABLE_FROM/table.env" ] || die "$TABLE_FROM/table.env not found (a run folder of this script holds one)"
  # shellcheck disable=SC1091
  source "$TABLE_FROM/table.env"
  RUN="$(cd "$TABLE_FROM" && pwd)"
  export "${TABLE_VARS[@]}"
  python3 "$BENCH/compare_table.py" | if [ -n "$OUT" ]; then tee "$OUT"; else cat; fi
  exit "${PIPESTATUS[0]}"
fi
case "$PAGE_CACHE" in huge|as-is) ;; *) die "--page-cache must be huge or as-is, got '$PAGE_CACHE'" ;; esac
case "$DTYPE" in bf16|f32|fp8|int8|int4) ;; float32) DTYPE=f32 ;; *) die "--dtype must be bf16, f32, fp8, int8 or int4, got '$DTYPE'" ;; esac
# The checkpoint made first: fp8 / int8 / int4 are made from the bf16 one.
BASE_DTYPE=$([ "$DTYPE" = f32 ] && echo f32 || echo bf16)
[ "$ACCURACY" = 1 ] && [ "$BASE_DTYPE" != bf16 ] && die "--accuracy compares with the bf16 checkpoint: leave --dtype out"
case "$ISA" in
  native) LLAMA_ISA_FLAGS=(-DGGML_NATIVE=ON); LLAMA_ISA_SUFFIX="" ;;
  avx2) LLAMA_ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                         -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                         -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
        LLAMA_ISA_SUFFIX="-avx2"
        export MLARUN_CPU_ISA=avx2 ;;
  *) die "--isa must be native or avx2, got '$ISA'" ;;
esac
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer, got '$ROUNDS'"
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$THREADS'"
[[ "$LAYERS" =~ ^[1-9][0-9]*$ ]] || die "--layers must be a positive integer, got '$LAYERS'"
[ "$QUICK" = 1 ] && ROUNDS=1

# The shapes of the runs; --quick shrinks them to check the pipeline.
if [ "$QUICK" = 1 ]; then
  TG=16; DEPTH=128; PP=128; BCTX=128; BTG=8; BATCHES=8,32; LB_REPS=1; M_DEC_REPS=4; M_PP_REPS=1; M_BAT_REPS=2
else
  TG=64; DEPTH=128; PP=512; BCTX=512; BTG=32; BATCHES=8,32; LB_REPS=5; M_DEC_REPS=16; M_PP_REPS=5; M_BAT_REPS=8
fi
MAXB="${BATCHES##*,}"

mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
if [ -n "$OUT" ]; then
  [ -d "$(dirname "$OUT")" ] || die "--out $OUT: no such folder $(dirname "$OUT")"
  OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")"
fi
LOGS="$WORK/logs"
mkdir -p "$LOGS"
SCRIPT_T0=$SECONDS
STEP=""
STEP_T0=$SECONDS
TIMES=()

trap 'rc=$?; [ $rc -ne 0 ] && [ -n "$STEP" ] && echo -e "\nllama_cpp_compare: FAILED in step \"$STEP\" (exit $rc); logs under $LOGS" >&2' EXIT

step() {  # step NAME: closes the previous step's timer and opens one
  end_step
  STEP="$1"
  STEP_T0=$SECONDS
  echo "== $STEP" >&2
}
end_step() {
  if [ -n "$STEP" ]; then
    TIMES+=("$STEP: $((SECONDS - STEP_T0)) s")
    STEP=""
  fi
}
# run LOG CMD...: runs CMD with its output in LOG; on failure shows the log's end.
run() {
  local log="$1"; shift
  if ! "$@" >"$log" 2>&1; then
    echo "---- last lines of $log:" >&2
    tail -n 30 "$log" >&2
    die "step \"$STEP\": command failed: $*"
  fi
}

# --- 1. Python environment -----------------------------------------------
VENV="$WORK/venv"
PY="$VENV/bin/python"
# torch: convert_hf_to_gguf.py imports it (its tensors carry the conversion);
# PyPI's Linux wheel brings CUDA libraries along (a few GiB) though only the CPU is used.
# transformers: the converter reads config.json and the tokenizer with it (pinned as in
# llama.cpp's requirements-convert_hf_to_gguf.txt).
PIP_PACKAGES=(numpy safetensors tokenizers "transformers==4.57.6" torch sentencepiece
              "protobuf>=4.21.0,<5.0.0" pyyaml tqdm requests)
step "python venv ($VENV)"
if [ ! -f "$VENV/.deps-ok" ] || [ "$(cat "$VENV/.deps-ok")" != "${PIP_PACKAGES[*]}" ]; then
  command -v python3 >/dev/null || die "python3 not found (Debian: apt-get install python3 python3-venv)"
  if [ ! -x "$PY" ] && ! python3 -m venv "$VENV" >"$LOGS/venv.log" 2>&1; then
    tail -n 30 "$LOGS/venv.log" >&2
    die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  fi
  run "$LOGS/pip-upgrade.log" "$PY" -m pip install --upgrade pip
  run "$LOGS/pip-install.log" "$PY" -m pip install "${PIP_PACKAGES[@]}"
  echo "${PIP_PACKAGES[*]}" >"$VENV/.deps-ok"
fi

# --- 2. llama.cpp sources (vendored in llama-cpp-python's sdist) ------------
step "llama.cpp sources"
SRC="$WORK/src"
mkdir -p "$SRC"
find_llama() {
  local pat="llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION:-*}"
  find "$SRC" -maxdepth 1 -type d -name "$pat" 2>/dev/null | sort -V | tail -n 1
}
PKG="$(find_llama)"
if [ -z "$PKG" ] || [ ! -f "$PKG/vendor/llama.cpp/CMakeLists.txt" ]; then
  spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
  run "$LOGS/pip-download.log" "$PY" -m pip download "$spec" --no-binary :all: --no-deps -d "$SRC/dl"
  tarball="$(ls -t "$SRC"/dl/llama_cpp_python-*.tar.gz | head -n 1)"
  [ -n "$tarball" ] || die "pip download left no llama_cpp_python-*.tar.gz in $SRC/dl"
  run "$LOGS/untar.log" tar -xzf "$tarball" -C "$SRC"
  PKG="$(find_llama)"
  [ -f "$PKG/vendor/llama.cpp/CMakeLists.txt" ] || die "$tarball has no vendor/llama.cpp"
fi
LLAMA_SRC="$PKG/vendor/llama.cpp"
LLAMA_PKG_VERSION="${PKG##*llama_cpp_python-}"
echo "   llama-cpp-python $LLAMA_PKG_VERSION: $LLAMA_SRC" >&2

# --- 3. Build llama.cpp -----------------------------------------------------
LLAMA_BUILD="$WORK/llama.cpp-build-$LLAMA_PKG_VERSION$LLAMA_ISA_SUFFIX"
LB="$LLAMA_BUILD/bin/llama-bench"
LBB="$LLAMA_BUILD/bin/llama-batched-bench"
GREEDY="$LLAMA_BUILD/bin/llama_greedy"
step "build llama.cpp ($LLAMA_BUILD)"
if [ ! -x "$LB" ] || [ ! -x "$LBB" ]; then
  [ "$SKIP_BUILD" = 1 ] && die "--skip-build, but $LB or $LBB is missing"
  command -v cmake >/dev/null || die "cmake not found (Debian: apt-get install cmake ninja-build g++)"
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  [ -f "$LLAMA_BUILD/CMakeCache.txt" ] || run "$LOGS/llama-cmake.log" cmake -S "$LLAMA_SRC" -B "$LLAMA_BUILD" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release "${LLAMA_ISA_FLAGS[@]}" -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON
  echo "   building (the llama.cpp build takes a while on few cores; log: $LOGS/llama-build.log)" >&2
  run "$LOGS/llama-build.log" cmake --build "$LLAMA_BUILD" -j "$(nproc)" --target llama-bench llama-batched-bench llama-simple llama-quantize
fi
LQUANT="$LLAMA_BUILD/bin/llama-quantize"
if [ ! -x "$LQUANT" ]; then
  [ "$SKIP_BUILD" = 1 ] && die "--skip-build, but $LQUANT is missing"
  run "$LOGS/llama-quantize-build.log" cmake --build "$LLAMA_BUILD" -j "$(nproc)" --target llama-quantize
fi
LOGITS="$LLAMA_BUILD/bin/llama_logits"
for prog in llama_greedy llama_logits; do  # our two llama.cpp programs
  bin="$LLAMA_BUILD/bin/$prog"
  if [ ! -x "$bin" ] || [ "$BENCH/$prog.cpp" -nt "$bin" ]; then
    [ "$SKIP_BUILD" = 1 ] && [ ! -x "$bin" ] && die "--skip-build, but $bin is missing"
    run "$LOGS/$prog-build.log" "${CXX:-g++}" -O2 -std=c++17 "$BENCH/$prog.cpp" -o "$bin" \
      -I"$LLAMA_SRC/include" -I"$LLAMA_SRC/ggml/include" -L"$LLAMA_BUILD/bin" -lllama -Wl,-rpath,"$LLAMA_BUILD/bin"
  fi
done

# --- 4. mlarun ----------------------------------------------------------------
step "mlarun"
if [ -z "$MLARUN" ]; then
  if [ "$SKIP_BUILD" = 1 ]; then
    MLARUN="$ROOT/build/release/mlarun"
  else
    bdir="$("$ROOT/scripts/build" Release 2>"$LOGS/mlarun-build.log")" || { tail -n 30 "$LOGS/mlarun-build.log" >&2; die "scripts/build Release failed"; }
    MLARUN="$bdir/mlarun"
  fi
fi
[ -x "$MLARUN" ] || die "mlarun binary not found at $MLARUN (pass --mlarun PATH)"
MLARUN="$(cd "$(dirname "$MLARUN")" && pwd)/$(basename "$MLARUN")"
MLARUN_REV="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
git -C "$ROOT" diff --quiet HEAD 2>/dev/null || MLARUN_REV="$MLARUN_REV (+ uncommitted changes)"
MLARUN_BUILT="$(date -r "$MLARUN" '+%Y-%m-%d %H:%M')"
echo "   $MLARUN (built $MLARUN_BUILT; tree at $MLARUN_REV)" >&2

# --accuracy: mlarun's bf16 checkpoint is the reference; every other row is
# compared with its logits on the same random ids (bench accuracy writes
# them, llama_logits evaluates them). Rows that cannot be made are skipped
# with a note (mlarun int8 / int4 until this mlarun has `quantize`).
accuracy_table() {
  RUN="$WORK/runs/accuracy-$(date +%Y%m%d-%H%M%S)"
  mkdir -p "$RUN"
  local ids="$RUN/ids.txt" ck g t fmt rc=0 models=() files=() notes=()
  local acc=(--reference "$CKPT" --positions "$POSITIONS" --sequence-length "$SEQ_LEN" --seed "$SEED"
             --threads "$THREADS")
  step "the random ids"
  run "$RUN/write-ids.log" "$MLARUN" bench accuracy "${acc[@]}" --write-ids "$ids"
  for fmt in fp8 int8 int4; do
    step "mlarun's $fmt checkpoint"
    if [ "$fmt" != fp8 ] && ! "$MLARUN" quantize --help >/dev/null 2>&1; then
      notes+=("mlarun $fmt: skipped, this mlarun has no quantize command")
    elif ck="$(quantized_checkpoint "$fmt")"; then
      ln -sfn "$ck" "$RUN/$fmt"
      models+=(--model "$RUN/$fmt")
    else
      notes+=("mlarun $fmt: skipped, the checkpoint could not be made (see $LOGS/checkpoint-$fmt.log)")
    fi
  done
  for t in F32 Q8_0 Q4_K_M; do
    step "llama.cpp $t logits"
    g="$GGUF_BASE"
    [ "$t" = F32 ] || g="$(gguf_quantized "$t")"
    run "$RUN/llama-logits-$t.log" "$LOGITS" "$g" "$ids" "$RUN/$t.logits" "$THREADS"
    files+=(--llama-logits "$RUN/$t.logits")
  done
  step "mlarun bench accuracy"
  "$MLARUN" bench accuracy "${acc[@]}" "${models[@]}" "${files[@]}" >"$RUN/accuracy.md" 2>"$RUN/accuracy.log" || rc=$?
  end_step
  {
    echo "# Logits against mlarun bf16 ($(date +%Y-%m-%d))"
    echo
    echo "* CPU: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1), $THREADS threads"
    echo "* Model: random weights at DeepSeek-V2-Lite widths, $LAYERS layers; mlarun $MLARUN_REV; llama.cpp from" \
         "llama-cpp-python $LLAMA_PKG_VERSION (its GGUFs: the F32 conversion of the bf16 checkpoint, and" \
         "llama-quantize of it)"
    cat "$RUN/accuracy.md"
    [ "${#notes[@]}" = 0 ] || echo
    for t in "${notes[@]}"; do echo "* $t"; done
  } >"$RUN/table.md"
  cat "$RUN/table.md"
  [ -n "$OUT" ] && cp "$RUN/table.md" "$OUT"
  [ "$rc" = 0 ] || die "mlarun bench accuracy exited $rc (see $RUN/accuracy.log)"
}

# --- 5. Random checkpoint and its GGUF ----------------------------------------
CKPT="$WORK/ckpt-deepseek-v2-lite-L$LAYERS-$BASE_DTYPE-seed$SEED"
step "random checkpoint ($CKPT)"
if [ ! -f "$CKPT/config.json" ]; then
  ckdtype=$([ "$BASE_DTYPE" = bf16 ] && echo bf16 || echo float32)
  run "$LOGS/checkpoint.log" "$PY" "$BENCH/make_random_checkpoint.py" --out "$CKPT" --layers "$LAYERS" \
    --dtype "$ckdtype" --seed "$SEED"
  cat "$LOGS/checkpoint.log" >&2
fi

# The GGUF converted from the checkpoint: BF16 or F32 as the checkpoint is;
# F32 for --accuracy (its sanity row, and what llama-quantize starts from).
GGUF_BASE_TYPE=$([ "$BASE_DTYPE" = bf16 ] && [ "$ACCURACY" = 0 ] && echo BF16 || echo F32)
GGUF_BASE="$WORK/ckpt-deepseek-v2-lite-L$LAYERS-$BASE_DTYPE-seed$SEED-$GGUF_BASE_TYPE.gguf"
step "convert to GGUF ($GGUF_BASE)"
if [ ! -f "$GGUF_BASE" ]; then
  # The vendored convert_hf_to_gguf.py runs unchanged, under a wrapper that
  # replaces two of its methods in memory:
  # * it accepts a BPE tokenizer only if the hash of its encoding of a fixed
  #   text names a known pre-tokenizer; the synthetic tokenizer's hash is
  #   nobody's, so the wrapper answers "deepseek-llm" (the pre-tokenizer of
  #   DeepSeek-V2's own tokenizer). Tokenization does not matter here: every
  #   run feeds token ids.
  # * llama.cpp tells a DeepSeek-V2 without query compression (q_lora_rank
  #   null: q_proj, as V2-Lite) by its depth of 26 or 27 layers, and otherwise
  #   requires deepseek2.attention.q_lora_rank; the wrapper writes 0 there
  #   (then llama.cpp loads q_proj, as it does for V2-Lite).
  cat >"$WORK/convert_hf_to_gguf_synthetic.py" <<'EOF'
import logging, runpy, sys
llama_dir, args = sys.argv[1], sys.argv[2:]
sys.path.insert(0, llama_dir)
sys.path.insert(1, llama_dir + "/gguf-py")
import conversion.base as base
import conversion.deepseek as deepseek
log = logging.getLogger("hf-to-gguf")
def get_vocab_base_pre(self, tokenizer):
    log.info("synthetic tokenizer: pre-tokenizer set to 'deepseek-llm'")
    return "deepseek-llm"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
set_gguf_parameters = deepseek.DeepseekV2Model.set_gguf_parameters
def set_gguf_parameters_q_lora_0(self):
    set_gguf_parameters(self)
    if not self.hparams.get("q_lora_rank"):
        log.info("q_lora_rank is null: writing deepseek2.attention.q_lora_rank = 0")
        self.gguf_writer.add_q_lora_rank(0)
deepseek.DeepseekV2Model.set_gguf_parameters = set_gguf_parameters_q_lora_0
sys.argv = [llama_dir + "/convert_hf_to_gguf.py"] + args
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
  outtype=$([ "$GGUF_BASE_TYPE" = BF16 ] && echo bf16 || echo f32)
  run "$LOGS/convert.log" "$PY" "$WORK/convert_hf_to_gguf_synthetic.py" "$LLAMA_SRC" "$CKPT" \
    --outtype "$outtype" --outfile "$GGUF_BASE.partial"
  mv "$GGUF_BASE.partial" "$GGUF_BASE"
fi
echo "   $(du -h "$GGUF_BASE" | cut -f1) $GGUF_BASE" >&2

# gguf_quantized TYPE: the base GGUF quantized by llama-quantize to TYPE
# (Q8_0, Q4_K_M), made once; prints its path.
gguf_quantized() {
  local out="${GGUF_BASE%.gguf}-to-$1.gguf"
  if [ ! -f "$out" ]; then
    run "$LOGS/llama-quantize-$1.log" "$LQUANT" "$GGUF_BASE" "$out.partial" "$1" "$THREADS"
    mv "$out.partial" "$out"
  fi
  echo "$out"
}

# fp8_checkpoint SRC DST: SRC with its decoder projections stored as the
# DeepSeek-V3 release stores them (F8_E4M3 and one fp32 `_scale_inv` per
# 128 x 128 block: amax / 448, the e4m3 rounded to nearest even by torch),
# everything else as it is; config.json gains the release's
# quantization_config.
fp8_checkpoint() {
  "$PY" - "$1" "$2" <<'PYEOF'
import json, os, shutil, sys, torch
from safetensors import safe_open
from safetensors.torch import save_file
src, dst = sys.argv[1], sys.argv[2]
PROJ = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
        "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
tmp = dst + ".partial"
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
out = {}
with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
    for name in f.keys():
        w = f.get_tensor(name)
        if ".layers." not in name or not name.endswith(PROJ) or name.endswith("mlp.gate.weight"):
            out[name] = w
            continue
        r, c = w.shape
        pr, pc = -r % 128, -c % 128
        b = torch.nn.functional.pad(w.float(), (0, pc, 0, pr)).reshape((r + pr) // 128, 128, (c + pc) // 128, 128)
        s = (b.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        q = (b / s[:, None, :, None]).reshape(r + pr, c + pc)[:r, :c].to(torch.float8_e4m3fn)
        out[name], out[name + "_scale_inv"] = q.contiguous(), s.contiguous()
save_file(out, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
for n in os.listdir(src):
    if n not in ("model.safetensors", "config.json"):
        shutil.copy(os.path.join(src, n), tmp)
config = json.load(open(os.path.join(src, "config.json")))
config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "weight_block_size": [128, 128]}
json.dump(config, open(os.path.join(tmp, "config.json"), "w"), indent=2)
os.rename(tmp, dst)
PYEOF
}

# quantized_checkpoint FORMAT: the bf16 checkpoint in FORMAT (fp8, int8,
# int4), made once; prints its path, or fails (int8 / int4 need `mlarun
# quantize`).
quantized_checkpoint() {
  local out="$CKPT-$1" log="$LOGS/checkpoint-$1.log"
  if [ ! -f "$out/config.json" ]; then
    if [ "$1" = fp8 ]; then
      fp8_checkpoint "$CKPT" "$out" >"$log" 2>&1 || { tail -n 20 "$log" >&2; return 1; }
    else
      rm -rf "$out.partial"
      "$MLARUN" quantize --model "$CKPT" --out "$out.partial" --format "$1" >"$log" 2>&1 ||
        { tail -n 20 "$log" >&2; return 1; }
      mv "$out.partial" "$out"
    fi
  fi
  echo "$out"
}

if [ "$ACCURACY" = 1 ]; then
  accuracy_table
  exit 0
fi

GGUF="$GGUF_BASE"
GGUF_TYPE="$GGUF_BASE_TYPE"
case "$DTYPE" in
  fp8|int8|int4)
    GGUF_TYPE=$([ "$DTYPE" = int4 ] && echo Q4_K_M || echo Q8_0)
    step "llama-quantize to $GGUF_TYPE"
    GGUF="$(gguf_quantized "$GGUF_TYPE")"
    step "mlarun's $DTYPE checkpoint"
    CKPT="$(quantized_checkpoint "$DTYPE")" || die "could not make the $DTYPE checkpoint (see $LOGS/checkpoint-$DTYPE.log)"
    echo "   $CKPT; llama.cpp: $(du -h "$GGUF" | cut -f1) $GGUF" >&2 ;;
esac

# --- 6. Both load the model and generate: greedy tokens side by side ------------
RUN="$WORK/runs/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN"
PROMPT_IDS=1,2,3,4,5,6,7,8
NGEN=8
step "sanity: greedy tokens from both"
run "$RUN/mlarun-generate.log" "$MLARUN" generate --model "$CKPT" --prompt-ids "$PROMPT_IDS" --max-tokens "$NGEN" \
  --ignore-eos --threads "$THREADS" --json
grep -E '^\{' "$RUN/mlarun-generate.log" | tail -n 1 >"$RUN/mlarun-generate.json"
run "$RUN/llama-greedy.log" "$GREEDY" "$GGUF" "$THREADS" "$NGEN" "$PROMPT_IDS"
grep -E '^\{' "$RUN/llama-greedy.log" | tail -n 1 >"$RUN/llama-greedy.json"
GREEDY_CMP='
import json, sys
m = json.load(open(sys.argv[1]))["tokens"]
l = json.load(open(sys.argv[2]))["tokens"]
same = next((i for i, (a, b) in enumerate(zip(m, l)) if a != b), min(len(m), len(l)))
verdict = "identical" if m == l else f"the same for the first {same}, then they differ"
print(f"greedy tokens after prompt ids {sys.argv[3]}: {verdict} (mlarun {m}, llama.cpp {l})")'
"$PY" -c "$GREEDY_CMP" "$RUN/mlarun-generate.json" "$RUN/llama-greedy.json" "$PROMPT_IDS" >"$RUN/greedy.txt" \
  || die "could not read the generated tokens (see $RUN/mlarun-generate.log and $RUN/llama-greedy.log)"
echo "   $(cat "$RUN/greedy.txt")" >&2

# --- 7. The timed runs, interleaved --------------------------------------------
# Weights: mlarun maps the safetensors file and reads bf16 weights in place;
# llama.cpp maps the GGUF by default. --llama-load-mode none reads them into
# llama.cpp's own memory instead (the flag's name changed across versions).
L_LOAD=(); LB_LOAD=()
if [ "$LLAMA_LOAD_MODE" != auto ]; then
  lb_help="$("$LB" --help 2>&1 || true)"
  lbb_help="$("$LBB" --help 2>&1 || true)"
  if [[ "$lb_help" == *--load-mode* ]] && [[ "$lbb_help" == *--load-mode* ]]; then
    L_LOAD=(-lm "$LLAMA_LOAD_MODE"); LB_LOAD=(-lm "$LLAMA_LOAD_MODE")
  elif [ "$LLAMA_LOAD_MODE" = none ]; then
    L_LOAD=(-mmp 0); LB_LOAD=(--no-mmap)
  else
    die "--llama-load-mode $LLAMA_LOAD_MODE: this llama.cpp has no --load-mode (only 'auto' and 'none' work)"
  fi
fi
M_COMMON=(--model "$CKPT" --threads "$THREADS" --kv-dtype bf16 --lm-head "$LM_HEAD" --json)
CMD_M_DEC=("$MLARUN" bench decode "${M_COMMON[@]}" --batch 1 --context "$DEPTH" --prefill-tokens 1 --repetitions "$M_DEC_REPS")
CMD_L_DEC=("$LB" -m "$GGUF" -p 0 -n "$TG" -d "$DEPTH" -t "$THREADS" -r "$LB_REPS" "${L_LOAD[@]}" -o json)
# mlarun's prefill: a fresh PP-token prompt, one step, median of the timed
# steps (its decode point at batch 1, context 1, is not used).
CMD_M_PP=("$MLARUN" bench decode "${M_COMMON[@]}" --batch 1 --context 1 --prefill-tokens "$PP" --repetitions "$M_PP_REPS")
CMD_L_PP=("$LB" -m "$GGUF" -p "$PP" -n 0 -t "$THREADS" -r "$LB_REPS" "${L_LOAD[@]}" -o json)
CMD_M_BAT=("$MLARUN" bench decode "${M_COMMON[@]}" --batch "$BATCHES" --context "$BCTX" --prefill-tokens 1 --repetitions "$M_BAT_REPS")
# -pps: one shared prompt, copied into every sequence's own KV stream before
# the timed generation (same S_TG, without prefilling B x PP tokens first).
CMD_L_BAT=("$LBB" -m "$GGUF" -c "$((MAXB * (BCTX + BTG)))" -b 2048 -ub 512 -npp "$BCTX" -ntg "$BTG" -npl "$BATCHES"
           -pps -t "$THREADS" "${LB_LOAD[@]}" --output-format jsonl)
{
  echo "mlarun decode:    ${CMD_M_DEC[*]}"
  echo "llama.cpp decode: ${CMD_L_DEC[*]}"
  echo "mlarun prefill:   ${CMD_M_PP[*]}"
  echo "llama.cpp prefill:${CMD_L_PP[*]}"
  echo "mlarun batched:   ${CMD_M_BAT[*]}"
  echo "llama.cpp batched:${CMD_L_BAT[*]}"
} >"$RUN/commands.txt"

# Both start every run with their weight file in the page cache (not timed),
# read the same way: through a MADV_HUGEPAGE mapping, which keeps (or, after
# an eviction, re-creates) 2 MiB folios.
warm_file() { "$PY" "$BENCH/warm_page_cache.py" "$@"; }
if [ "$PAGE_CACHE" = huge ]; then
  step "page cache in 2 MiB folios (evicted once, re-read from disk)"
  warm_file --drop "$CKPT"/*.safetensors "$GGUF" | tee "$RUN/page-cache.txt" | sed 's/^/   /' >&2
  end_step
fi

# The memory's read bandwidth now (mlarun bench memory, as bench decode
# measures it), into $1.
bandwidth() {
  "$MLARUN" bench memory --passes 3 --threads "$THREADS" --json >"$1" 2>"${1%.json}.log" ||
    die "mlarun bench memory failed (see ${1%.json}.log)"
}
for ((r = 1; r <= ROUNDS; r++)); do
  step "round $r/$ROUNDS"
  d="$RUN/round$r"
  mkdir -p "$d"
  for pair in "M_DEC mlarun-decode json" "L_DEC llama-bench-decode json" \
              "M_PP mlarun-prefill json" "L_PP llama-bench-prefill json" \
              "M_BAT mlarun-batched json" "L_BAT llama-batched-bench jsonl"; do
    read -r var name ext <<<"$pair"
    declare -n cmd="CMD_$var"
    if [[ "$var" == M_* ]]; then warm_file "$CKPT"/*.safetensors; else warm_file "$GGUF"; fi >>"$d/page-cache.txt"
    # llama-bench's batch-1 decode between two bandwidth measurements, so the
    # table can set it against the bandwidth of its moment, as mlarun's own
    # decode rows are (a pass before each timed step).
    [ "$var" = L_DEC ] && bandwidth "$d/bandwidth-before-$name.json"
    t0=$SECONDS
    if ! "${cmd[@]}" >"$d/$name.$ext" 2>"$d/$name.log"; then
      echo "---- last lines of $d/$name.log:" >&2
      tail -n 30 "$d/$name.log" >&2
      die "round $r: command failed: ${cmd[*]}"
    fi
    [ "$var" = L_DEC ] && bandwidth "$d/bandwidth-after-$name.json"
    unset -n cmd
    echo "   $name: $((SECONDS - t0)) s" >&2
  done
done
end_step

# --- 8. The table ---------------------------------------------------------------
CPU_MODEL="$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1)"
CPU_FLAGS="$(grep -o -E 'avx2|avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/ $//')"
[ "$ISA" = avx2 ] && CPU_FLAGS="$CPU_FLAGS; both limited to AVX2+FMA (llama.cpp built without its AVX-512 code, mlarun under MLARUN_CPU_ISA=avx2)"
# Proactive reclaim (DAMON "pageout") drops file pages that look cold, such as
# a mapped model's rarely routed experts: a note in the table when it is on.
RECLAIM_NOTE=""
for k in /sys/kernel/mm/damon/admin/kdamonds/*; do
  [ "$(cat "$k/state" 2>/dev/null)" = on ] || continue
  if grep -qs '^pageout$' "$k"/contexts/*/schemes/*/action; then
    RECLAIM_NOTE="the kernel reclaims cold pages proactively (DAMON pageout is on): mapped weights may be re-read from disk during the runs, which adds noise"
  fi
done
TABLE="$RUN/table.md"
export "${TABLE_VARS[@]}"
declare -p "${TABLE_VARS[@]}" >"$RUN/table.env"
"$PY" "$BENCH/compare_table.py" >"$TABLE"
cat "$TABLE"
if [ -n "$OUT" ]; then
  cp "$TABLE" "$OUT"
  echo "(table written to $OUT)" >&2
fi
{
  echo "Stage times:"
  printf '  %s\n' "${TIMES[@]}"
  echo "  total: $((SECONDS - SCRIPT_T0)) s"
} | tee "$RUN/stage-times.txt" >&2
