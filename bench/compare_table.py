#!/usr/bin/env python3
"""The markdown table of a bench/llama_cpp_compare.sh run.

Reads the run's raw outputs (RUN/roundN/...) and the settings the script
exports (or RUN/table.env, written by the script, for
`bench/llama_cpp_compare.sh --table RUN`); prints the table on stdout.
"""
import glob, json, os, statistics, sys
E = os.environ
run, rounds = E["RUN"], int(E["ROUNDS"])

def fail(msg):
    sys.exit(f"llama_cpp_compare: FAILED: parsing the results: {msg}")

def load_json(path):
    text = open(path).read()
    start = min([i for i in (text.find("{"), text.find("[")) if i >= 0], default=-1)
    if start < 0:
        fail(f"{path}: no JSON")
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0]
    except ValueError as e:
        fail(f"{path}: {e}")

def mlarun_doc(path):
    doc = load_json(path)
    if not isinstance(doc, dict):
        fail(f"{path}: not a JSON object")
    return doc

# `mlarun bench decode --json`, read by key: decode points in "decode" with
# "tokens_per_s" (older builds: "rows" with "decode_tokens_per_s"); the prefill
# figure in "prefill" (older builds: "prefill_tokens_per_s" in each row).
def mlarun_decode_row(path, batch, context):
    doc = mlarun_doc(path)
    for key, rows in (("tokens_per_s", doc.get("decode")), ("decode_tokens_per_s", doc.get("rows"))):
        for row in rows if isinstance(rows, list) else []:
            if row.get("batch") == batch and row.get("context") == context and key in row:
                return row, key
    fail(f"{path}: no decode figure for batch {batch}, context {context}")

def mlarun_decode(path, batch, context):
    row, key = mlarun_decode_row(path, batch, context)
    return float(row[key])

def mlarun_prefill(path, tokens):
    doc = mlarun_doc(path)
    p = doc.get("prefill")
    if isinstance(p, dict) and "tokens_per_s" in p:
        if p.get("tokens", tokens) != tokens:
            fail(f"{path}: prefill of {p.get('tokens')} tokens, expected {tokens}")
        return float(p["tokens_per_s"])
    for row in doc.get("rows") or []:
        if "prefill_tokens_per_s" in row:
            return float(row["prefill_tokens_per_s"])
    fail(f"{path}: no prefill figure")

def llama_bench_fig(path, n_prompt, n_gen):
    tests = load_json(path)
    tests = tests if isinstance(tests, list) else [tests]
    for t in tests:
        if int(t.get("n_prompt", -1)) == n_prompt and int(t.get("n_gen", -1)) == n_gen:
            return float(t["avg_ts"])
    fail(f"{path}: no test with n_prompt={n_prompt}, n_gen={n_gen}")

def batched_fig(path, pl):
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            d = json.loads(line)
            if int(d.get("pl", -1)) == pl:
                return float(d["speed_tg"])
    fail(f"{path}: no line with pl={pl}")

tg, depth, pp, bctx, btg = (int(E[k]) for k in ("TG", "DEPTH", "PP", "BCTX", "BTG"))
batches = [int(b) for b in E["BATCHES"].split(",")]
figures = [(f"batch-1 decode, context {depth}",
            lambda d: mlarun_decode(f"{d}/mlarun-decode.json", 1, depth),
            lambda d: llama_bench_fig(f"{d}/llama-bench-decode.json", 0, tg)),
           (f"prefill, {pp}-token prompt",
            lambda d: mlarun_prefill(f"{d}/mlarun-prefill.json", pp),
            lambda d: llama_bench_fig(f"{d}/llama-bench-prefill.json", pp, 0))]
for b in batches:
    figures.append((f"batched decode, {b} x {bctx} context",
                    lambda d, b=b: mlarun_decode(f"{d}/mlarun-batched.json", b, bctx),
                    lambda d, b=b: batched_fig(f"{d}/llama-batched-bench.jsonl", b)))

dirs = [f"{run}/round{r}" for r in range(1, rounds + 1)]
results = []
for label, fm, fl in figures:
    m = [fm(d) for d in dirs]
    l = [fl(d) for d in dirs]
    results.append((label, m, l))

doc0 = mlarun_doc(f"{dirs[0]}/mlarun-decode.json")
lb0 = load_json(f"{dirs[0]}/llama-bench-decode.json")
lb0 = lb0[0] if isinstance(lb0, list) else lb0
dtype = E["DTYPE"]
mcol = f"mlarun ({dtype}) tok/s"
lcol = f"llama.cpp {E['GGUF_TYPE']} GGUF tok/s"

def fmt(v):
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"

def spread(vs):
    return "" if len(vs) == 1 else f" ({fmt(min(vs))}-{fmt(max(vs))})"

def ratios_summary(pairs):  # the median of the rounds' own ratios (range)
    return "-" if not pairs else f"{statistics.median(pairs):.2f}x" + (
        "" if len(pairs) == 1 else f" ({min(pairs):.2f}-{max(pairs):.2f})")

import datetime
date = datetime.date.today().isoformat()
moe = doc0.get("moe_layers")
layers = doc0.get("layers", E["LAYERS"])
print(f"# mlarun vs llama.cpp on the CPU ({date})")
print()
if E["QUICK"] == "1":
    print("**--quick run: 1 round, short runs; for checking the pipeline, not for quoting.**")
    print()
print(f"* CPU: {E['CPU_MODEL']} ({E['CPU_FLAGS']}), {E['THREADS']} threads for both")
print(f"* Model: random weights at DeepSeek-V2-Lite widths, {layers} layers ({moe} MoE, 64 routed experts, top-6); "
      + (f"mlarun reads the {dtype} safetensors checkpoint, llama.cpp its {E['GGUF_TYPE']} GGUF conversion"
         if dtype in ("bf16", "f32") else
         f"mlarun reads a copy of the bf16 safetensors checkpoint in {dtype}, llama.cpp the BF16 GGUF conversion "
         f"quantized to {E['GGUF_TYPE']} by llama-quantize"))
print(f"* mlarun {E['MLARUN_REV']} (binary {E['MLARUN']}, built {E['MLARUN_BUILT']}), weights {doc0.get('weight_dtype')}, latent cache {doc0.get('kv_dtype')}; "
      f"llama.cpp {lb0.get('build_commit', '?')} from llama-cpp-python {E['LLAMA_PKG_VERSION']}, "
      f"KV cache {lb0.get('type_k', '?')}/{lb0.get('type_v', '?')}, "
      f"flash_attn {({-1: 'auto', 0: 'off', 1: 'on'}).get(lb0.get('flash_attn'), lb0.get('flash_attn', '?'))}")
print(f"* Weights: mlarun maps the checkpoint; llama.cpp load mode {E['LLAMA_LOAD_MODE']}"
      + (" (its default: mmap)" if E["LLAMA_LOAD_MODE"] == "auto" else "")
      + "; each run starts with its weight file in the page cache"
      + (", which was evicted once and re-read in 2 MiB folios" if E["PAGE_CACHE"] == "huge" else " as earlier reads left it"))
# What warm_page_cache.py saw on 2 MiB pages before each run: the least per file.
on_huge = {}
for d in dirs:
    try:
        lines = open(f"{d}/page-cache.txt").read().splitlines()
    except OSError:
        continue
    for line in lines:
        name, _, rest = line.partition(": ")
        words = rest.split()
        if len(words) > 7 and words[1] == "MiB,":
            size, huge = int(words[0]), int(words[6])
            on_huge[name] = (size, min(huge, on_huge.get(name, (0, huge))[1]))
if on_huge:
    print("* Page cache on 2 MiB pages before the runs (least over rounds): "
          + "; ".join(f"{os.path.basename(n)} {h} of {s} MiB" for n, (s, h) in sorted(on_huge.items())))
if E.get("RECLAIM_NOTE"):
    print(f"* Note: {E['RECLAIM_NOTE']}")
print(f"* Same model on both sides: {open(f'{run}/greedy.txt').read().strip()}")
print(f"* Median of {rounds} interleaved round{'s' if rounds > 1 else ''} (range in parentheses); "
      "the last column is the median of the rounds' own ratios (each round's two runs a few seconds apart), "
      "which a drift of the machine between rounds moves less than the ratio of the medians")
print()
print(f"| | {mcol} | {lcol} | ratio of medians | median of round ratios |")
print("|---|---:|---:|---:|---:|")
for label, m, l in results:
    mm, ll = statistics.median(m), statistics.median(l)
    ratio = f"{mm / ll:.2f}x" if ll > 0 else "-"
    pairs = [a / b for a, b in zip(m, l) if b > 0]
    print(f"| {label} | {fmt(mm)}{spread(m)} | {fmt(ll)}{spread(l)} | {ratio} | {ratios_summary(pairs)} |")

# Batch-1 decode against the read bandwidth of its moment: mlarun's own
# fraction (a bandwidth pass before each timed step), llama.cpp's tok/s times
# the bytes mlarun's step reads (the same tensors) over `mlarun bench memory`
# run just before and after llama-bench. Runs made before the script measured
# the bandwidth have no such files and no such line.
def bound_gbs(path):
    try:
        return float(mlarun_doc(path)["median"]["bound_gb_per_s"])
    except (KeyError, TypeError, ValueError):
        fail(f"{path}: no median bound_gb_per_s")

bw_files = [(f"{d}/bandwidth-before-llama-bench-decode.json", f"{d}/bandwidth-after-llama-bench-decode.json")
            for d in dirs]
if all(os.path.exists(a) and os.path.exists(b) for a, b in bw_files):
    m_frac, l_frac, m_bw, l_bw, step_mb = [], [], [], [], []
    for d, (before, after) in zip(dirs, bw_files):
        row, _ = mlarun_decode_row(f"{d}/mlarun-decode.json", 1, depth)
        try:
            step_bytes = float(row["weight_bytes_per_step"]) + float(row["cache_bytes_per_step"])
            m_frac.append(float(row["fraction_of_bound"]))
            m_bw.append(float(row["read_bandwidth_gb_per_s"]))
        except (KeyError, TypeError, ValueError):
            fail(f"{d}/mlarun-decode.json: the batch-1 row has no bytes per step or fraction of the bound")
        bw = 0.5 * (bound_gbs(before) + bound_gbs(after))
        l_bw.append(bw)
        l_frac.append(llama_bench_fig(f"{d}/llama-bench-decode.json", 0, tg) * step_bytes * 1e-9 / bw)
        step_mb.append(step_bytes * 1e-6)
    pct = lambda vs: f"{100 * statistics.median(vs):.0f}%" + ("" if len(vs) == 1 else
                                                             f" ({100 * min(vs):.0f}-{100 * max(vs):.0f}%)")
    gbs = lambda vs: f"{fmt(statistics.median(vs))}{spread(vs)}"
    ratios = [a / b for a, b in zip(m_frac, l_frac) if b > 0]
    print()
    print(f"Batch-1 decode against the memory read bandwidth of its moment ({statistics.median(step_mb):.0f} MB "
          f"read per token, the tensors mlarun's step reads; llama.cpp reads the same ones):")
    print()
    print("| | mlarun | llama.cpp |")
    print("|---|---:|---:|")
    print(f"| read bandwidth next to the run, GB/s | {gbs(m_bw)} | {gbs(l_bw)} |")
    print(f"| decode, of the bandwidth bound | {pct(m_frac)} | {pct(l_frac)} |")
    print()
    if ratios:
        print(f"mlarun's fraction over llama.cpp's, the median of the rounds' own ratios: {ratios_summary(ratios)}.")
        print()
    print("mlarun's fraction is its own (`bench decode`: a bandwidth pass before each timed step, the median over "
          "steps); llama.cpp's is its tok/s x the bytes per token over the mean of two `mlarun bench memory` "
          "medians, taken just before and just after llama-bench. Unlike the tok/s ratio above, this one does not "
          "move with the machine's bandwidth between the two runs of a round.")
print()
print("What each row compares (see bench/README.md):")
print()
print(f"* batch-1 decode: llama-bench `-p 0 -n {tg} -d {depth}` (generates {tg} tokens after a {depth}-token context; "
      f"mean of its repetitions) vs mlarun's decode tok/s at batch 1 over {depth} cached tokens (median step)")
print(f"* prefill: llama-bench `-p {pp} -n 0` (a {pp}-token prompt on an empty cache) vs mlarun's prefill tok/s "
      f"(a fresh {pp}-token prompt in one step; median step)")
print(f"* batched decode: llama-batched-bench `S_TG` (B sequences, each with its own copy of a {bctx}-token prompt, "
      f"generating {btg} tokens together) vs mlarun's decode tok/s at batch B over {bctx} cached tokens each")
print()
print("Commands:")
print()
print("```")
print(open(f"{run}/commands.txt").read().rstrip())
print("```")
print()
print(f"Raw outputs: {run}")
