#!/usr/bin/env python3
"""Compares `mlarun generate --json --logprobs N` with tests/ref/deepseek_v3_reference.py's output.

Greedy tokens must be equal (exit 1 otherwise). Per step, over the tokens of mlarun's top logprobs that the
reference also lists: the largest |logprob difference| against the float64 reference as it is, and against
the reference whose lm_head input is rounded to bf16 (what mlarun's bf16 lm_head computes); relative figures
divide by the reference's largest |logit| of the step. Logprobs are logits less a per-step constant, so their
differences are those of the logits up to that constant.

    python3 bench/v3_widths_compare.py REF.json MLARUN.json [--label NAME]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("mlarun")
    ap.add_argument("--label", default="mlarun")
    args = ap.parse_args()
    ref = json.load(open(args.ref))
    got = [json.loads(line) for line in open(args.mlarun) if line.startswith("{")][0]
    same = ref["tokens"] == got["tokens"]
    print(f"{args.label}: reference tokens {ref['tokens']}, mlarun {got['tokens']}: {'equal' if same else 'DIFFER'}")
    worst = {"top": 0.0, "top_bf16_head_input": 0.0}
    for i, (step, top) in enumerate(zip(ref["steps"], got["top_logprobs"])):
        parts = []
        for key in worst:
            lp = {t: p for t, _, p in step[key]}
            common = [(t, p) for t, p in top if t in lp]
            d = max((abs(p - lp[t]) for t, p in common), default=float("inf"))
            worst[key] = max(worst[key], d / step["logit_max_abs"])
            parts.append(f"{'fp64' if key == 'top' else 'fp64, bf16 head input'}: max |d logprob| {d:.2e} "
                         f"(rel {d / step['logit_max_abs']:.1e}, {len(common)} tokens)")
        print(f"  step {i + 1}: |logit| max {step['logit_max_abs']:.2f}; " + "; ".join(parts))
    print(f"  worst relative: {worst['top']:.1e} against fp64, {worst['top_bf16_head_input']:.1e} against fp64 "
          f"with the bf16 head input")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
