#!/usr/bin/env python3
"""AWQ and GPTQ fixtures for tests/runtime/model/awq_gptq_test.cc.

Writes tests/fixtures/quantized/{awq,gptq,gptq_v2}/model.safetensors: small modules packed by the
libraries' own packing code (autoawq's WQLinear_GEMM.from_linear, auto-gptq's
QuantLinear.pack from qlinear_cuda, the "gptq" v1 checkpoint format), each
beside `<module>.dequantized`: its weight [out, in] as f32, dequantized by the
same libraries (autoawq's dequantize_gemm; auto-gptq's QuantLinear.forward on
an identity matrix, its CPU path), never by mlarun's code.

The integers, zero points and scales are drawn first (scales rounded to f16)
and the float weight is built from them, so that the packers' own rounding
gives back exactly the drawn integers; the script checks that it does.

Needs (not CI): numpy, torch, safetensors, autoawq 0.2.9 and auto-gptq 0.7.1
installed with --no-deps. Their package __init__ files pull in model code
(datasets, transformers internals) that the packers do not use, so only the
packing modules are imported, under stand-in parent packages.

    python3 tests/runtime/model/make_awq_gptq_fixtures.py
"""

import importlib
import importlib.util
import os
import sys
import types

import numpy as np
import torch
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
OUT = os.path.join(ROOT, "tests", "fixtures", "quantized")


def stub_package_tree(root):
    """Stand-in packages for every folder of `root` (no __init__ runs)."""
    spec = importlib.util.find_spec(root)
    base = os.path.dirname(spec.origin)
    for folder, _, _ in os.walk(base):
        rel = os.path.relpath(folder, base)
        name = root if rel == "." else root + "." + rel.replace(os.sep, ".")
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [folder]
            sys.modules[name] = stub


def draw(rng, out_f, in_f, bits, group, sym, g_idx):
    """Integers q [out, in], zeros [out, groups], f16-exact scales [out, groups]
    and the weight (q - zero) * scale [out, in] they make (exact in f32)."""
    groups = int(g_idx.max()) + 1
    maxq = 2**bits - 1
    q = rng.integers(0, maxq + 1, size=(out_f, in_f))
    if sym:
        zeros = np.full((out_f, groups), 2 ** (bits - 1))
    else:
        # Zero 0 would be written as -1 by the v1 format and spill into the
        # neighbouring fields; real zero points stay in 1..maxq.
        zeros = rng.integers(1, maxq + 1, size=(out_f, groups))
    scales = rng.uniform(0.002, 0.03, size=(out_f, groups)).astype(np.float16).astype(np.float32)
    w = ((q - zeros[:, g_idx]) * scales[:, g_idx]).astype(np.float32)
    return q, zeros, scales, w


def awq_module(gemm, packing, rng, out_f, in_f, group):
    g_idx = np.arange(in_f) // group
    q, zeros, scales, w = draw(rng, out_f, in_f, 4, group, False, g_idx)
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    linear.weight.data = torch.from_numpy(w)
    # from_linear takes scales and zeros as [groups, out].
    m = gemm.WQLinear_GEMM.from_linear(
        linear, 4, group, scales=torch.from_numpy(scales.T.copy()), zeros=torch.from_numpy(zeros.T.astype(np.float32))
    )
    qweight, qzeros, scales16 = m.qweight, m.qzeros, m.scales
    # The library's dequantization, [in, out]; scales as f32 so that
    # (q - z) * s is not rounded to f16.
    deq = packing.dequantize_gemm(qweight, qzeros, scales16.float(), 4, group).T.contiguous().numpy()
    iw, iz = packing.reverse_awq_order(*packing.unpack_awq(qweight, qzeros, 4), 4)
    assert np.array_equal((iw & 15).numpy().T, q), "AWQ packing did not keep the drawn integers"
    assert np.array_equal((iz & 15).numpy().T, zeros)
    assert np.array_equal(deq, w)
    return {"qweight": qweight.numpy(), "qzeros": qzeros.numpy(), "scales": scales16.numpy(), "dequantized": deq}


def gptq_module(qlinear, rng, out_f, in_f, bits, group, sym, permute=False):
    group_len = group if group > 0 else in_f
    groups = -(-in_f // group_len)
    if permute:
        # desc_act (act-order): columns quantized in a permuted order, so the
        # column c belongs to group position(c) // group.
        perm = rng.permutation(in_f)
        g_idx = np.empty(in_f, dtype=np.int64)
        g_idx[perm] = np.arange(in_f) // group_len
    else:
        g_idx = np.arange(in_f) // group_len
    assert int(g_idx.max()) + 1 == groups
    q, zeros, scales, w = draw(rng, out_f, in_f, bits, group_len, sym, g_idx)
    m = qlinear.QuantLinear(bits, group, in_f, out_f, bias=False, weight_dtype=torch.float32)
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    linear.weight.data = torch.from_numpy(w)
    m.pack(
        linear,
        torch.from_numpy(scales),
        torch.from_numpy(zeros.astype(np.float32)),
        g_idx=torch.from_numpy(g_idx.astype(np.int32)),
    )
    # The library's dequantization: its CPU forward on the identity gives
    # W^T (scales kept f32 here; they hold f16 values).
    with torch.no_grad():
        deq = m.forward(torch.eye(in_f, dtype=torch.float32)).T.contiguous().numpy()
    assert np.array_equal(deq, w), "GPTQ packing did not keep the drawn weight"
    return {
        "qweight": m.qweight.numpy(),
        "qzeros": m.qzeros.numpy(),
        "scales": m.scales.to(torch.float16).numpy(),
        "g_idx": m.g_idx.numpy().astype(np.int32),
        "dequantized": deq,
    }


def to_v2(module, bits):
    """The module in checkpoint_format "gptq_v2" (gptqmodel): zero points
    stored as they are, i.e. each v1 field plus one (fields stay within
    their bits because v1 zeros are 0..maxq - 1 here)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    words = module["qzeros"].view(np.uint32)
    fields = (words[:, :, None] >> (bits * np.arange(per, dtype=np.uint32))) & mask
    assert fields.max() < mask
    v2 = ((fields + 1) << (bits * np.arange(per, dtype=np.uint32))).sum(axis=2, dtype=np.uint64).astype(np.uint32)
    out = dict(module)
    out["qzeros"] = v2.view(np.int32)
    return out


def write(folder, modules):
    tensors = {}
    for prefix, parts in modules.items():
        for k, v in parts.items():
            tensors[prefix + "." + k] = np.ascontiguousarray(v)
    os.makedirs(os.path.join(OUT, folder), exist_ok=True)
    save_file(tensors, os.path.join(OUT, folder, "model.safetensors"))


def main():
    torch.manual_seed(0)
    stub_package_tree("awq")
    stub_package_tree("auto_gptq")
    gemm = importlib.import_module("awq.modules.linear.gemm")
    packing = importlib.import_module("awq.utils.packing_utils")
    qlinear = importlib.import_module("auto_gptq.nn_modules.qlinear.qlinear_cuda")

    rng = np.random.default_rng(20261206)
    # auto-gptq's buffers need in and out multiples of 32, autoawq's out a
    # multiple of 32 and in of the group. Shapes and schemes are read back
    # by awq_gptq_test.cc; keep them in step.
    write(
        "awq",
        {
            "model.layers.0.mlp.down_proj": awq_module(gemm, packing, rng, 96, 256, 64),
            "model.layers.0.mlp.up_proj": awq_module(gemm, packing, rng, 64, 256, 128),
            "model.layers.0.self_attn.o_proj": awq_module(gemm, packing, rng, 32, 96, 32),
        },
    )
    gptq = {
        # 4-bit symmetric, group 64.
        "model.layers.0.mlp.down_proj": gptq_module(qlinear, rng, 96, 256, 4, 64, True),
        # 4-bit asymmetric, group 64 with a short last group (224 = 3 * 64 + 32).
        "model.layers.0.mlp.gate_proj": gptq_module(qlinear, rng, 64, 224, 4, 64, False),
        # 4-bit asymmetric, group 36 (not a whole number of int32 words;
        # 160 = 4 * 36 + 16).
        "model.layers.1.self_attn.q_proj": gptq_module(qlinear, rng, 32, 160, 4, 36, False),
        # 8-bit symmetric, group 96 (224 = 2 * 96 + 32).
        "model.layers.0.mlp.up_proj": gptq_module(qlinear, rng, 64, 224, 8, 96, True),
        # 8-bit asymmetric, group 32.
        "model.layers.1.mlp.up_proj": gptq_module(qlinear, rng, 32, 128, 8, 32, False),
        # 4-bit asymmetric, one group per output channel (group_size -1).
        "model.layers.0.self_attn.o_proj": gptq_module(qlinear, rng, 64, 96, 4, -1, False),
        # 4-bit symmetric with desc_act: g_idx a real permutation of the groups.
        "model.layers.1.mlp.down_proj": gptq_module(qlinear, rng, 32, 128, 4, 32, True, permute=True),
    }
    write("gptq", gptq)
    # The asymmetric 4- and 8-bit modules again in the "gptq_v2" format.
    write(
        "gptq_v2",
        {
            "model.layers.0.mlp.gate_proj": to_v2(gptq["model.layers.0.mlp.gate_proj"], 4),
            "model.layers.1.mlp.up_proj": to_v2(gptq["model.layers.1.mlp.up_proj"], 8),
        },
    )


if __name__ == "__main__":
    main()
