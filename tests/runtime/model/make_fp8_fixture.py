#!/usr/bin/env python3
"""Writes tests/fixtures/models/v3_fp8/: the tiny DeepSeek-V3 fixture v3_bf16 with its decoder-layer
projections re-stored as DeepSeek-V3's release stores them.

Run by hand from the repository root (CI only reads the committed files; numpy is all it needs):

    python3 tests/runtime/model/make_fp8_fixture.py

For every projection (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, and gate/up/down_proj
of the dense MLP, the routed experts and the shared experts) it writes, as the V3 release does,
  <name>            F8_E4M3 [rows, cols]
  <name>_scale_inv  F32 [ceil(rows / 128), ceil(cols / 128)]
with one scale per 128 x 128 block: scale_inv = amax(|w| over the block) / 448, e4m3 = round-to-nearest-even of
w / scale_inv (saturated at 448). The dequantized weight is e4m3 x scale_inv. Embeddings, lm_head, norms, the
router (mlp.gate.weight) and its score bias stay as they are (bf16), as in the release. config.json gains the
release's quantization_config. The blocks here are cut short at the edges (every tensor is < 128 wide), which
is what the loader must handle at the edges of real tensors too.

Deterministic: no random numbers; the same input rewrites byte-identical files.
"""
import json
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "fixtures", "models", "v3_bf16")
DST = os.path.join(HERE, "..", "fixtures", "models", "v3_fp8")
BLOCK = 128
E4M3_MAX = 448.0

PROJECTIONS = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
               "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[b:e]
        if info["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        elif info["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4").copy()
        else:
            sys.exit(f"{name}: unexpected dtype {info['dtype']}")
        tensors[name] = (info["dtype"], arr.reshape(info["shape"]))
    return tensors, header.get("__metadata__")


def e4m3_values():
    """The 127 non-negative finite e4m3fn values, by code 0x00..0x7e (ascending)."""
    vals = []
    for code in range(0x7f):
        e, m = code >> 3, code & 7
        vals.append((m / 8.0) * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


VALUES = e4m3_values()


def to_e4m3(x):
    """Round-to-nearest-even float64 array -> e4m3fn codes (uint8), saturating at +-448."""
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(VALUES, a, side="left"), 0, len(VALUES) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - VALUES[lo], VALUES[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))  # ties to the even code (mantissa lsb 0)
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return np.where(x < 0, code | 0x80, code).astype(np.uint8)


def quantize(w):
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = np.zeros((br, bc), dtype=np.float32)
    q = np.zeros((rows, cols), dtype=np.uint8)
    for i in range(br):
        for j in range(bc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].astype(np.float64)
            s = np.float32(max(np.abs(blk).max(), 1e-12) / E4M3_MAX)
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = to_e4m3(blk / np.float64(s))
    return q, scale


ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F8_E4M3": 1}


def write_safetensors(path, tensors, metadata):
    # Widest elements first, so every tensor starts aligned to its element size without padding (the
    # bf16 embeddings are then read in place, as from a real checkpoint).
    order = sorted(tensors, key=lambda n: (-ELEMENT_BYTES[tensors[n][0]], n))
    header, blobs, offset = {}, [], 0
    for name in order:
        dtype, raw, shape = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def main():
    src, metadata = read_safetensors(os.path.join(SRC, "model.safetensors"))
    out = {}
    n_fp8 = 0
    for name, (dtype, arr) in src.items():
        if name.endswith(PROJECTIONS) and ".layers." in name and not name.endswith("mlp.gate.weight"):
            q, s = quantize(arr)
            out[name] = ("F8_E4M3", q.tobytes(), q.shape)
            out[name + "_scale_inv"] = ("F32", s.astype("<f4").tobytes(), s.shape)
            n_fp8 += 1
        else:
            raw = (arr.view(np.uint32) >> 16).astype("<u2").tobytes() if dtype == "BF16" else arr.astype("<f4").tobytes()
            out[name] = (dtype, raw, arr.shape)
    os.makedirs(DST, exist_ok=True)
    write_safetensors(os.path.join(DST, "model.safetensors"), out, metadata)
    with open(os.path.join(SRC, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [BLOCK, BLOCK]}
    with open(os.path.join(DST, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    size = os.path.getsize(os.path.join(DST, "model.safetensors"))
    print(f"{DST}: {n_fp8} F8_E4M3 projections, {size} bytes")
    assert size < 1 << 20


if __name__ == "__main__":
    main()
