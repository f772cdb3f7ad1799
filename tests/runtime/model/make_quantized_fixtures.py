#!/usr/bin/env python3
"""Writes tests/fixtures/models/v3_w4a16, v3_w4a16_asym and v3_w8a16: the tiny DeepSeek-V3 fixture v3_bf16
with its Linear layers quantized and stored as llm-compressor stores them, by the compressed-tensors package's
own code (calculate_qparams for the scales and zero points, its compressors for quantizing and packing).

Run by hand from the repository root, with torch and compressed-tensors installed (CI only reads the committed
files):

    python3 tests/runtime/model/make_quantized_fixtures.py

  v3_w4a16       pack-quantized int4, symmetric, group 32, bf16 scales;  ignore: lm_head, re:.*mlp\\.gate$
  v3_w4a16_asym  pack-quantized int4, asymmetric (packed zero points), group 32, f16 scales;
                 ignore: lm_head, re:model\\.layers\\.0\\.mlp\\..* (layer 0's dense MLP stays bf16)
  v3_w8a16       int-quantized int8, symmetric, per channel, f32 scales; lm_head quantized too

Every tensor of v3_bf16 is < 128 wide, hence group 32. Which modules: every nn.Linear of HF's DeepseekV3 that
is not ignored (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj, the MLPs, the experts, lm_head); the
embeddings, norms and the router (DeepseekV3TopkRouter, not a Linear) stay bf16.

The script also checks, for every quantized module, that the library's own decompression (its
decompress(), which unpacks and dequantizes) equals a float64 dequantization of the stored integers written
here independently: the C++ test (quantized_checkpoint_test.cc) computes its reference the same independent
way from the committed files (no f32 copy of the dequantized weights is committed).

Deterministic: no random numbers; the same input rewrites byte-identical files.
"""
import json
import os
import re

import numpy as np
import torch
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             QuantizationStatus)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "..", "fixtures", "models")
SRC = os.path.join(MODELS, "v3_bf16")

LINEAR = re.compile(r"^(lm_head|model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|"
                    r"kv_b_proj|o_proj)|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj))\.weight$")

FIXTURES = {
    "v3_w4a16": dict(fmt="pack-quantized", bits=4, symmetric=True, strategy="group", group=32,
                     scale_dtype=torch.bfloat16, ignore=["lm_head", r"re:.*mlp\.gate$"]),
    "v3_w4a16_asym": dict(fmt="pack-quantized", bits=4, symmetric=False, strategy="group", group=32,
                          scale_dtype=torch.float16, ignore=["lm_head", r"re:model\.layers\.0\.mlp\..*"]),
    "v3_w8a16": dict(fmt="int-quantized", bits=8, symmetric=True, strategy="channel", group=None,
                     scale_dtype=torch.float32, ignore=[]),
}


def ignored(module, ignore):
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif pattern == module:
            return True
    return False


def qparams(w, args):
    """The library's scales and zero points of w (float32 [out, in]) under args, scales rounded to the
    stored dtype first (the quantization then uses exactly the stored scales)."""
    out, cols = w.shape
    if args.strategy == "group":
        g = w.reshape(out, cols // args.group_size, args.group_size)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    else:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args)
    return scale, zp


def reference_dequantized(state, f, shape):
    """float64 dequantization of the stored integers, written independently of the library."""
    out, cols = shape
    scale = state["weight_scale"].to(torch.float64).numpy()
    if f["bits"] == 4:
        words = state["weight_packed"].numpy().astype("<i4")
        b = words.view(np.uint8).reshape(out, -1)
        q = np.stack([b & 0xF, b >> 4], axis=-1).reshape(out, -1)[:, :cols].astype(np.float64) - 8
    else:
        q = state["weight"].numpy().astype(np.float64)
    groups = scale.shape[1]
    per = (cols + groups - 1) // groups
    s = np.repeat(scale, per, axis=1)[:, :cols]
    if f["symmetric"]:
        return q * s
    zw = state["weight_zero_point"].numpy().astype("<i4")  # [ceil(out / 8), groups], packed along out
    zb = zw.T.copy().view(np.uint8).reshape(groups, -1)
    z = np.stack([zb & 0xF, zb >> 4], axis=-1).reshape(groups, -1)[:, :out].T.astype(np.float64) - 8
    return (q - np.repeat(z, per, axis=1)[:, :cols]) * s


def write(name, f, tensors, config):
    dst = os.path.join(MODELS, name)
    os.makedirs(dst, exist_ok=True)
    args = QuantizationArgs(num_bits=f["bits"], type="int", symmetric=f["symmetric"], strategy=f["strategy"],
                            group_size=f["group"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = PackedQuantizationCompressor if f["bits"] == 4 else NaiveQuantizationCompressor
    out = {}
    worst = 0.0
    for tname in sorted(tensors):
        t = tensors[tname]
        m = LINEAR.match(tname)
        module = tname[:-len(".weight")] if m else None
        if module is None or ignored(module, f["ignore"]):
            out[tname] = t
            continue
        w = t.to(torch.float32)
        scale, zp = qparams(w, args)
        scale = scale.to(f["scale_dtype"])
        state = {"weight": w, "weight_scale": scale.to(torch.float32)}
        if not f["symmetric"]:
            state["weight_zero_point"] = zp
        stored = compressor.compress(state, scheme)
        stored["weight_scale"] = scale
        back = compressor.decompress({k: (v.to(torch.float32) if k == "weight_scale" else v)
                                      for k, v in stored.items()}, scheme)["weight"].to(torch.float64).numpy()
        ref = reference_dequantized(stored, f, w.shape)
        worst = max(worst, float(np.abs(back - ref).max() / np.abs(ref).max()))
        for k, v in stored.items():
            out[module + "." + k] = v.contiguous()
    assert worst < 1e-6, f"{name}: the library's decompression and the float64 one differ by {worst}"
    save_file(out, os.path.join(dst, "model.safetensors"))
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=f["fmt"], ignore=f["ignore"],
                            quantization_status=QuantizationStatus.COMPRESSED).to_dict()
    qc["quant_method"] = "compressed-tensors"
    cfg = dict(config)
    cfg["quantization_config"] = json.loads(json.dumps(qc, default=str))
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")
    print(f"{name}: {len(out)} tensors, library vs float64 dequantization {worst:.2e}")


def main():
    tensors = load_file(os.path.join(SRC, "model.safetensors"))
    with open(os.path.join(SRC, "config.json")) as fh:
        config = json.load(fh)
    for name, f in FIXTURES.items():
        write(name, f, tensors, config)


if __name__ == "__main__":
    main()
