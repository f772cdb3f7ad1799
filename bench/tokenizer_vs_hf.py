#!/usr/bin/env python3
"""Single-thread encode speed: Hugging Face tokenizers against mlarun's tokenizer.

Makes a mixed text (English-like prose, Python code, Chinese, Japanese, emoji,
numbers and whitespace runs; seeded, so every run makes the same text), then
alternates A B A B: one timed encode with `tokenizers` (TOKENIZERS_PARALLELISM
=false, one thread) and one with mlarun's benchmark (`mlarun bench tokenize`
or the standalone `tokenizer_bench`, which load the tokenizer, check the round
trip, warm up once and time one encode). Reports the medians.

Two modes, timed the same way on both sides:
  whole: the text is one encode call (tokenizers: Tokenizer.encode);
  lines: one call per line, newline kept (tokenizers: encode_batch, which
         runs sequentially with parallelism off).

  bench/tokenizer_vs_hf.py --tokenizer DIR --bench BINARY [--mb 16] [--rounds 5]
      [--mode whole lines] [--mlarun]  (BINARY is `mlarun`: call `mlarun bench tokenize`)

Prints one JSON object per mode and a table.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"


def make_text(target_bytes, seed=7):
    rng = random.Random(seed)
    syll = ["ka", "to", "ri", "an", "el", "or", "en", "th", "st", "qu", "ion", "ing", "er", "al", "pre", "con"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    common = "the of and to in is that for it as was with be by on not he this are or his from at which".split()
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    kana = [chr(c) for c in range(0x3041, 0x3097)] + [chr(c) for c in range(0x30A1, 0x30FB)]
    emoji = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🚀", "❤️", "🇯🇵", "✨"]
    code = [
        "def {n}(x, y=3):\n    return [i * {k} for i in range(x) if i % y]\n\n",
        "for (int i = 0; i < {k}; ++i) {{\n\tsum += a[i] * b[i];\n}}\n",
        "    if {n} is None:\n        raise ValueError(\"{n} must be set\")  # {k}\n",
        "{{\"{n}\": {k}, \"ok\": true, \"items\": [1, 2, 3]}}\n",
    ]
    parts, size = [], 0
    while size < target_bytes:
        kind = rng.random()
        if kind < 0.45:
            n = rng.randint(5, 30)
            ws = [rng.choice(common) if rng.random() < 0.4 else rng.choice(words) for _ in range(n)]
            ws[0] = ws[0].capitalize()
            s = " ".join(ws) + rng.choice([". ", ", ", "! ", "? ", ".\n", ".\n\n"])
        elif kind < 0.6:
            s = rng.choice(code).format(n=rng.choice(words), k=rng.randint(0, 99999))
        elif kind < 0.75:
            s = "".join(rng.choice(cjk) for _ in range(rng.randint(5, 40))) + rng.choice(["。", "，", "\n"])
        elif kind < 0.83:
            s = "".join(rng.choice(kana) for _ in range(rng.randint(3, 20))) + rng.choice(["、", "。", " "])
        elif kind < 0.88:
            s = " ".join(rng.choice(emoji) for _ in range(rng.randint(1, 5))) + " "
        elif kind < 0.95:
            s = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(rng.randint(1, 6))) + " "
        else:
            s = rng.choice(["\n", "   ", "\t\t", "\r\n", "        \n", "\n\n\n"])
        parts.append(s)
        size += len(s.encode())
    return "".join(parts)


def time_hf(tk, text, lines, mode):
    t0 = time.perf_counter()
    if mode == "whole":
        n = len(tk.encode(text, add_special_tokens=False).ids)
    else:
        n = sum(len(e.ids) for e in tk.encode_batch(lines, add_special_tokens=False))
    return time.perf_counter() - t0, n


def time_ours(args, path, mode):
    if args.mlarun:
        # One untimed warm-up run is mlarun bench tokenize's default.
        cmd = [args.bench, "bench", "tokenize", "--model", args.tokenizer, "--text", path, "--mode", mode,
               "--runs", "1", "--json"]
    else:
        cmd = [args.bench, args.tokenizer, path, "--mode", mode, "--runs", "1", "--warmup", "1", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["median_s"], r["tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    ap.add_argument("--bench", required=True, help="tokenizer_bench, or mlarun with --mlarun")
    ap.add_argument("--mlarun", action="store_true")
    ap.add_argument("--mb", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", nargs="+", default=["whole", "lines"])
    args = ap.parse_args()

    from tokenizers import Tokenizer

    text = make_text(int(args.mb * 1e6))
    nbytes = len(text.encode())
    lines = text.splitlines(keepends=True)
    tk = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8", newline="") as f:
        f.write(text)
        path = f.name
    results = []
    try:
        for mode in args.mode:
            time_hf(tk, text, lines, mode)  # warm-up: tokenizers' word cache, as ours warms up in-process
            hf, ours = [], []
            hf_tokens = our_tokens = 0
            for _ in range(args.rounds):
                s, hf_tokens = time_hf(tk, text, lines, mode)
                hf.append(s)
                s, our_tokens = time_ours(args, path, mode)
                ours.append(s)
            r = {"mode": mode, "bytes": nbytes, "hf_tokens": hf_tokens, "mlarun_tokens": our_tokens,
                 "hf_median_s": statistics.median(hf), "mlarun_median_s": statistics.median(ours),
                 "hf_runs_s": hf, "mlarun_runs_s": ours}
            r["hf_mb_per_s"] = nbytes / 1e6 / r["hf_median_s"]
            r["mlarun_mb_per_s"] = nbytes / 1e6 / r["mlarun_median_s"]
            r["hf_tokens_per_s"] = hf_tokens / r["hf_median_s"]
            r["mlarun_tokens_per_s"] = our_tokens / r["mlarun_median_s"]
            r["speedup"] = r["hf_median_s"] / r["mlarun_median_s"]
            results.append(r)
            print(json.dumps(r))
    finally:
        os.unlink(path)
    print(f"{'mode':6} {'MB':>6} {'tokens':>10} {'HF MB/s':>8} {'ours MB/s':>9} {'HF Mtok/s':>9} {'ours Mtok/s':>11} {'speedup':>7}")
    for r in results:
        print(f"{r['mode']:6} {r['bytes']/1e6:6.1f} {r['hf_tokens']:10d} {r['hf_mb_per_s']:8.2f} {r['mlarun_mb_per_s']:9.2f} "
              f"{r['hf_tokens_per_s']/1e6:9.3f} {r['mlarun_tokens_per_s']/1e6:11.3f} {r['speedup']:7.2f}")
    if any(r["hf_tokens"] != r["mlarun_tokens"] for r in results):
        print("token counts differ between tokenizers and mlarun", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
