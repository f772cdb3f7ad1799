#!/usr/bin/env python3
"""Writes tests/fixtures/quantize/: what the compressed-tensors library makes of a few small bf16 weights, for
tests/runtime/model/quantize_checkpoint_test.cc to compare `QuantizeLinear` and the checkpoint writer against
byte for byte.

Run by hand from the repository root with torch and compressed-tensors installed (CI only reads the
committed files):

    python3 tests/runtime/model/make_quantize_reference.py
    python3 tests/runtime/model/make_quantize_reference.py --check build/release/launcher/mlarun

reference.safetensors holds the inputs `in.<w>` (bf16, fixed seed) and, for each scheme <s>, the tensors the
library's compressor stores for a Linear of that weight: `<s>.<w>.weight_packed` / `.weight` / `.weight_scale`
/ `.weight_zero_point` / `.weight_shape`. Scales and zero points come from the library's calculate_qparams
over per-group min / max in the weight's own dtype (what llm-compressor's minmax observer hands it), the
integers from the library's PackedQuantizationCompressor / NaiveQuantizationCompressor.compress.

reference.json holds, per `mlarun quantize` run of the C++ test, the quantization_config llm-compressor writes
(built with the library's QuantizationConfig and dumped as ModelCompressor.update_config dumps it). With
--check MLARUN, the script also runs those commands on tests/fixtures/models/v3_bf16, parses each written
config.json with the library, decompresses every quantized tensor with the library and checks that it equals the
library's own quantize-dequantize of the original weight; it records that it did, and the largest error in steps,
in reference.json ("checked").
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

import compressed_tensors
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             QuantizationStatus)
from compressed_tensors.quantization.utils.helpers import calculate_qparams

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
DST = os.path.join(ROOT, "tests", "fixtures", "quantize")
MODEL = os.path.join(ROOT, "tests", "fixtures", "models", "v3_bf16")


def inputs():
    g = torch.Generator().manual_seed(37)
    a = (torch.randn(37, 96, generator=g) * 0.05).to(torch.bfloat16)
    # Row 0: every group spans [-7.5, 7.5] in steps of 0.5, so the int4 symmetric scale is exactly 1 and
    # half the quotients are ties (half to even decides them).
    ties = torch.arange(-15, 17, dtype=torch.float32) * 0.5
    ties[-1] = 7.5
    a[0] = ties.repeat(3).to(torch.bfloat16)
    a[1, 32:64] = 0  # an all-zero group: the library's eps scale
    a[2, 5] = 1.5  # an outlier that stretches one group
    b = (torch.rand(24, 64, generator=g) * 0.4 - 0.3).to(torch.bfloat16)  # mostly negative: asymmetric ranges
    c = (torch.randn(13, 70, generator=g) * 0.02).to(torch.bfloat16)  # odd width: packing pads the last word
    return {"a": a, "b": b, "c": c}


def args(bits, group, symmetric):
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group or None, dynamic=False,
                            observer="minmax")


SCHEMES = {  # name: (bits, group, symmetric, weights)
    "int4_sym_g32": (4, 32, True, "ab"),
    "int4_asym_g32": (4, 32, False, "ab"),
    "int8_sym_channel": (8, 0, True, "abc"),
    "int4_sym_channel": (4, 0, True, "c"),
    "int8_asym_channel": (8, 0, False, "c"),
}


def compress(w, bits, group, symmetric):
    qargs = args(bits, group, symmetric)
    rows, cols = w.shape
    grouped = w.reshape(rows, cols // group, group) if group else w.reshape(rows, 1, cols)
    lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale, zp = calculate_qparams(lo, hi, qargs)
    scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    compressor = PackedQuantizationCompressor if bits == 4 else NaiveQuantizationCompressor
    return compressor.compress(state, scheme)


def quant_config(bits, group, symmetric, lm_head):
    """The quantization_config llm-compressor writes for a DeepSeek model quantized this way."""
    ignore = ["re:.*mlp.gate$"] if lm_head == "quantized" else ["lm_head", "re:.*mlp.gate$"]
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args(bits, group, symmetric))},
        format="pack-quantized" if bits == 4 else "int-quantized", quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore)
    data = config.model_dump(exclude=["quant_method"])
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors", "sparsity_config": {},
            "transform_config": {}, **data}


RUNS = {  # name: (mlarun quantize arguments, bits, group, symmetric, lm_head)
    "int4_g32": (["--format", "int4", "--group-size", "32"], 4, 32, True, "keep"),
    "int4_asym_g32": (["--format", "int4", "--group-size", "32", "--asymmetric"], 4, 32, False, "keep"),
    "int8_channel": (["--format", "int8"], 8, 0, True, "keep"),
}


def check_output(out_dir, bits, group, symmetric, expected):
    with open(os.path.join(out_dir, "config.json")) as f:
        written = json.load(f)["quantization_config"]
    parsed = QuantizationConfig.model_validate(written)
    dumped = {"version": written["version"], "quant_method": written["quant_method"],
              "sparsity_config": written.get("sparsity_config"), "transform_config": written.get("transform_config"),
              **parsed.model_dump(exclude=["quant_method"])}
    assert json.dumps(dumped, sort_keys=True) == json.dumps(expected, sort_keys=True), (dumped, expected)
    scheme = parsed.config_groups["group_0"]
    original = load_file(os.path.join(MODEL, "model.safetensors"))
    files = [f for f in os.listdir(out_dir) if f.endswith(".safetensors")]
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(out_dir, f)))
    compressor = PackedQuantizationCompressor if bits == 4 else NaiveQuantizationCompressor
    checked, worst = 0, 0.0
    for name, w in original.items():
        module = name[:-len(".weight")]
        if not name.endswith(".weight") or (module + ".weight_scale") not in tensors:
            assert torch.equal(tensors[name], w), name  # copied as stored
            continue
        state = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".weight")}
        deq = compressor.decompress(state, scheme)["weight"]
        # The library's own round trip of the original weight: the same values, to the bit.
        want = compressor.decompress(compress(w, bits, group, symmetric), scheme)["weight"]
        assert torch.equal(deq, want), name
        scale = state["weight_scale"].to(torch.float64)
        step = scale.repeat_interleave(group, dim=1) if group else scale
        worst = max(worst, float(((deq.to(torch.float64) - w.to(torch.float64)).abs() / step).max()))
        checked += 1
    return checked, worst


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", metavar="MLARUN", help="also run MLARUN quantize on v3_bf16 and check the output")
    opts = p.parse_args()
    ws = inputs()
    out = {f"in.{k}": v.contiguous() for k, v in ws.items()}
    for s, (bits, group, symmetric, names) in SCHEMES.items():
        for n in names:
            for k, v in compress(ws[n], bits, group, symmetric).items():
                out[f"{s}.{n}.{k}"] = v.contiguous()
    os.makedirs(DST, exist_ok=True)
    save_file(out, os.path.join(DST, "reference.safetensors"), metadata={"format": "pt"})
    ref = {"compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__, "runs": {}}
    for r, (argv, bits, group, symmetric, lm_head) in RUNS.items():
        ref["runs"][r] = {"args": argv, "quantization_config": quant_config(bits, group, symmetric, lm_head)}
    if opts.check:
        for r, (argv, bits, group, symmetric, lm_head) in RUNS.items():
            with tempfile.TemporaryDirectory() as tmp:
                out_dir = os.path.join(tmp, "out")
                subprocess.run([opts.check, "quantize", "--model", MODEL, "--out", out_dir, *argv], check=True)
                n, worst = check_output(out_dir, bits, group, symmetric, ref["runs"][r]["quantization_config"])
                ref["runs"][r]["checked"] = (f"config.json parsed by QuantizationConfig; {n} quantized weights "
                                             "decompressed by the library equal its own quantize-dequantize of "
                                             f"v3_bf16's; largest error {worst:.3f} steps")
    with open(os.path.join(DST, "reference.json"), "w") as f:
        json.dump(ref, f, indent=2, sort_keys=True)
        f.write("\n")
    print("wrote", DST, file=sys.stderr)


if __name__ == "__main__":
    main()
