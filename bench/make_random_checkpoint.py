#!/usr/bin/env python3
"""Writes a random Hugging Face DeepSeek-V2 / V3 checkpoint (default: V2-Lite widths).

The directory it writes is what transformers' DeepseekV2ForCausalLM (or
DeepseekV3ForCausalLM for a deepseek_v3 description) would save (config.json,
model.safetensors with the same tensor names and [out, in] layouts), plus a synthetic byte-level BPE tokenizer (tokenizer.json,
tokenizer_config.json) with exactly vocab_size entries, which llama.cpp's
convert_hf_to_gguf.py needs for the DeepseekV2 architecture. The tokenizer is
not meant to tokenize text well: the benchmarks feed token ids.

Every width comes from the model description (--config, default
configs/models/deepseek-v2-lite.yaml); only the depth changes (--layers,
default 4, of which the first first_k_dense_replace are dense; --dense-layers
overrides that count).

Weights: linear layers ~ N(0, 1/fan_in), the embedding ~ N(0, 1), norms
1 + 0.1 * N(0, 1), so activations stay of order one through the layers; V3's
router score bias (e_score_correction_bias, F32) ~ N(0, 0.1^2).

--dtype fp8 stores the decoder-layer projections as DeepSeek-V3's release
does: `<name>` F8_E4M3 [out, in] and `<name>_scale_inv` F32 [ceil(out / 128),
ceil(in / 128)], one scale per 128 x 128 block (amax of the block / 448; e4m3
rounded to nearest even, saturated at 448), and config.json carries the
release's quantization_config. Embeddings, lm_head, norms and the router
weight are BF16, the score bias F32, as in the release. Tensors are laid out
widest element first (F32, BF16, F8), so every tensor is aligned to its
element size.

Needs numpy, PyYAML, safetensors and tokenizers. The safetensors file is
written tensor by tensor (bf16 as uint16 bit patterns, rounded to nearest
even), so memory stays small whatever the depth; the `safetensors` package
then reads the header back to check it.

    python3 bench/make_random_checkpoint.py --out /tmp/ckpt --layers 4 --dtype bf16
    python3 bench/make_random_checkpoint.py --config configs/models/deepseek-v3.yaml \
        --layers 2 --dense-layers 1 --dtype fp8 --out /data/v3-2layer-fp8
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO / "configs" / "models" / "deepseek-v2-lite.yaml"

# Fields of the YAML that only mlarun reads; config.json leaves them out.
MLARUN_ONLY_FIELDS = ("kv_dtype",)

BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"


def load_yaml_config(path: Path) -> dict:
    import yaml  # PyYAML

    with open(path, encoding="utf-8") as f:  # a config.json too (YAML 1.1 reads "1e-06" as text)
        cfg = json.load(f) if path.suffix == ".json" else yaml.safe_load(f)
    if not isinstance(cfg, dict) or cfg.get("model_type") not in ("deepseek_v2", "deepseek_v3"):
        sys.exit(f"{path}: expected a deepseek_v2 or deepseek_v3 model description")
    for key in MLARUN_ONLY_FIELDS:
        cfg.pop(key, None)
    return cfg


def hf_config(yaml_cfg: dict, layers: int, dtype: str, dense_layers: int | None = None,
              vocab_size: int | None = None) -> dict:
    """config.json as the Hugging Face release writes it, at `layers` depth."""
    c = dict(yaml_cfg)
    if vocab_size is not None:
        c["vocab_size"] = vocab_size
    if layers < 1:
        sys.exit("--layers must be at least 1")
    c["num_hidden_layers"] = layers
    if dense_layers is not None:
        if not 0 <= dense_layers <= layers:
            sys.exit("--dense-layers must be between 0 and --layers")
        c["first_k_dense_replace"] = dense_layers
    c["first_k_dense_replace"] = min(int(c["first_k_dense_replace"]), layers)
    c["torch_dtype"] = "float32" if dtype == "f32" else "bfloat16"
    # No multi-token-prediction module is written (V3's release has one).
    c["num_nextn_predict_layers"] = 0
    if dtype == "fp8":  # as DeepSeek-V3's release says it
        c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    v3 = c["model_type"] == "deepseek_v3"
    # Fields the release has and transformers / llama.cpp's converter read
    # (num_key_value_heads: MLA has as many as query heads in HF's modeling).
    extra = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": c["num_attention_heads"],
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }
    for k, v in extra.items():
        c.setdefault(k, v)
    # Stable key order: architectures and model_type first, then alphabetical.
    head = {k: c.pop(k) for k in ("architectures", "model_type")}
    return {**head, **dict(sorted(c.items()))}


def tensor_specs(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in the order transformers' state_dict lists them.

    kind: "embed" (std 1), "linear" (std 1/sqrt(fan_in)), "proj" (the same,
    a decoder-layer projection: fp8 with --dtype fp8), "norm" (1 + 0.1 N),
    "bias" (0.1 N, always F32).
    """
    H = c["hidden_size"]
    N = c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    L = c["kv_lora_rank"]
    q_lora = c.get("q_lora_rank")
    E, Im, S = c["n_routed_experts"], c["moe_intermediate_size"], c["n_shared_experts"]
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (c["vocab_size"], H), "embed")]

    def mlp(prefix: str, inter: int) -> None:
        specs.append((prefix + "gate_proj.weight", (inter, H), "proj"))
        specs.append((prefix + "up_proj.weight", (inter, H), "proj"))
        specs.append((prefix + "down_proj.weight", (H, inter), "proj"))

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if q_lora:
            specs.append((a + "q_a_proj.weight", (q_lora, H), "proj"))
            specs.append((a + "q_a_layernorm.weight", (q_lora,), "norm"))
            specs.append((a + "q_b_proj.weight", (N * (nope + rope), q_lora), "proj"))
        else:
            specs.append((a + "q_proj.weight", (N * (nope + rope), H), "proj"))
        specs.append((a + "kv_a_proj_with_mqa.weight", (L + rope, H), "proj"))
        specs.append((a + "kv_a_layernorm.weight", (L,), "norm"))
        specs.append((a + "kv_b_proj.weight", (N * (nope + v), L), "proj"))
        specs.append((a + "o_proj.weight", (H, N * v), "proj"))
        moe = E and i >= c["first_k_dense_replace"] and i % c.get("moe_layer_freq", 1) == 0
        if moe:
            specs.append((p + "mlp.gate.weight", (E, H), "linear"))
            if c["model_type"] == "deepseek_v3":
                specs.append((p + "mlp.gate.e_score_correction_bias", (E,), "bias"))
            for e in range(E):
                mlp(f"{p}mlp.experts.{e}.", Im)
            if S:
                mlp(p + "mlp.shared_experts.", Im * S)
        else:
            mlp(p + "mlp.", c["intermediate_size"])
        specs.append((p + "input_layernorm.weight", (H,), "norm"))
        specs.append((p + "post_attention_layernorm.weight", (H,), "norm"))
    specs.append(("model.norm.weight", (H,), "norm"))
    if not c.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (c["vocab_size"], H), "linear"))
    return specs


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even."""
    u = x.astype(np.float32, copy=False).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


FP8_BLOCK = 128
E4M3_MAX = 448.0
ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F8_E4M3": 1}


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes (uint8), rounded to nearest even, saturated at +-448.

    Normal results (|x| >= 2^-6) keep 3 of float32's 23 mantissa bits, rounded
    on the bit pattern (a carry into the exponent is the right result); below
    2^-6 the e4m3 values are the multiples of 2^-9, rounded by np.rint (ties to
    even). tests/runtime/model/make_fp8_fixture.py rounds by search over the
    127 values instead; bench tests compare the two.
    """
    a = np.minimum(np.abs(x.astype(np.float32, copy=False)), np.float32(E4M3_MAX))
    u = a.view(np.uint32)
    r = (u + (np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1)))) >> np.uint32(20)
    normal = (r.astype(np.int32) - (120 << 3)).clip(0, 0x7E)  # e4m3 exponent = float32's - 120
    sub = np.rint(a * np.float32(512.0)).astype(np.int32)  # 0..8; 8 is the code of 2^-6
    code = np.where(a < np.float32(2.0 ** -6), sub, normal).astype(np.uint8)
    return np.where(np.signbit(x), code | np.uint8(0x80), code)


def quantize_fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, cols] float32 (rows a multiple of 128, or the tensor's last rows)
    -> (e4m3 codes [rows, cols], F32 scale_inv [ceil(rows/128), ceil(cols/128)])."""
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    if rows % FP8_BLOCK or cols % FP8_BLOCK:  # blocks cut short: pad with zeros (they change no amax)
        pad = np.zeros((br * FP8_BLOCK, bc * FP8_BLOCK), dtype=np.float32)
        pad[:rows, :cols] = w
        q, scale = quantize_fp8_rows(pad)
        return np.ascontiguousarray(q[:rows, :cols]), scale
    v = w.reshape(br, FP8_BLOCK, bc, FP8_BLOCK)
    amax = np.abs(v).max(axis=(1, 3))
    scale = (np.maximum(amax, np.float32(1e-12)) / np.float32(E4M3_MAX)).astype(np.float32)
    return to_e4m3((v / scale[:, None, :, None]).reshape(rows, cols)), scale


def layout(specs, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor the file holds, in file order."""
    wide = "F32" if dtype == "f32" else "BF16"
    out = []
    for name, shape, kind in specs:
        if kind == "bias":
            out.append((name, "F32", shape))
        elif kind == "proj" and dtype == "fp8":
            out.append((name, "F8_E4M3", shape))
            out.append((name + "_scale_inv", "F32", tuple(-(-d // FP8_BLOCK) for d in shape)))
        else:
            out.append((name, wide, shape))
    if dtype == "fp8":  # widest elements first: every tensor aligned to its element size
        out.sort(key=lambda t: -ELEMENT_BYTES[t[1]])
    return out


def write_safetensors(path: Path, specs, dtype: str, rng: np.random.Generator) -> int:
    """Streams the tensors of `specs` into `path`; returns the bytes written.

    Values are drawn in the order of `specs` whatever the file order; each
    tensor (a chunk of rows at a time) is written at its offset.
    """
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, st_dtype, shape in layout(specs, dtype):
        n = int(np.prod(shape)) * ELEMENT_BYTES[st_dtype]
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * ((8 - len(blob) % 8) % 8)  # data starts 8-byte aligned
    base = 8 + len(blob)
    tmp = path.with_suffix(".safetensors.partial")
    rows_per_chunk_elems = 1 << 24  # generate at most 16M values at a time

    def encode(x: np.ndarray) -> bytes:
        return (to_bf16_bits(x) if dtype in ("bf16", "fp8") else x).tobytes()

    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(base + offset)
        for name, shape, kind in specs:
            f.seek(base + header[name]["data_offsets"][0])
            if kind in ("norm", "bias"):
                x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
                if kind == "norm":
                    x = (1.0 + x).astype(np.float32)
                f.write(x.tobytes() if kind == "bias" else encode(x))
                continue
            std = 1.0 if kind == "embed" else 1.0 / np.sqrt(shape[-1])
            rows, cols = shape
            fp8 = kind == "proj" and dtype == "fp8"
            step = max(1, rows_per_chunk_elems // cols)
            if fp8:
                step = max(FP8_BLOCK, step // FP8_BLOCK * FP8_BLOCK)
            for r in range(0, rows, step):
                x = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
                x *= np.float32(std)
                if not fp8:
                    f.write(encode(x))
                    continue
                q, scale = quantize_fp8_rows(x)
                f.seek(base + header[name]["data_offsets"][0] + r * cols)
                f.write(q.tobytes())
                f.seek(base + header[name + "_scale_inv"]["data_offsets"][0] + (r // FP8_BLOCK) * scale.shape[1] * 4)
                f.write(scale.astype("<f4").tobytes())
    os.replace(tmp, path)
    return path.stat().st_size


def check_header(path: Path, want: dict) -> None:
    """Names and shapes from the header alone (no mapping of the data)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    if {k: v["shape"] for k, v in header.items()} != want:
        sys.exit(f"{path}: tensor names or shapes differ from what was written")


def check_safetensors(path: Path, specs, dtype: str) -> None:
    """Reads the file back with the safetensors package: names and shapes.

    A file larger than half the machine's memory is checked from its header
    only: the package maps the whole file copy-on-write, which the kernel
    refuses beyond the commit limit (a full-depth checkpoint on a small host).
    """
    want = {name: list(shape) for name, _, shape in layout(specs, dtype)}
    if path.stat().st_size > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2:
        check_header(path, want)
        return
    from safetensors import safe_open

    try:
        import torch  # noqa: F401  (bf16 tensors need the torch framework)

        framework = "pt"
    except ImportError:
        framework = "numpy"
    with safe_open(str(path), framework=framework) as f:
        names = set(f.keys())
        if names != set(want):
            sys.exit(f"{path}: tensor names differ from what was written")
        for name in (specs[0][0], specs[1][0], specs[-1][0]):
            got = list(f.get_slice(name).get_shape())
            if got != want[name]:
                sys.exit(f"{path}: {name} has shape {got}, expected {want[name]}")
        if framework == "pt":
            t = f.get_tensor(specs[-1][0]).float()
            expected = 1.0 / np.sqrt(want[specs[-1][0]][-1]) if specs[-1][2] != "norm" else 0.1
            if not 0.5 * expected < float(t.std()) < 2.0 * expected:
                sys.exit(f"{path}: {specs[-1][0]} has std {float(t.std())}, expected about {expected}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_tokenizer(out: Path, c: dict) -> None:
    """A byte-level BPE with exactly vocab_size entries; bos/eos at the config's ids.

    Tokens: the 256 byte symbols, then every two-symbol string (merge "a b"),
    then three-symbol strings (merge "ab c") until the vocabulary is full; the
    bos and eos strings sit at bos_token_id and eos_token_id as special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab_size = int(c["vocab_size"])
    bos_id, eos_id = int(c["bos_token_id"]), int(c["eos_token_id"])
    specials = {bos_id: BOS_TEXT, eos_id: EOS_TEXT}
    if not all(0 <= i < vocab_size for i in specials) or bos_id == eos_id:
        sys.exit("bos_token_id / eos_token_id must be distinct ids below vocab_size")
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    need = vocab_size - len(specials)
    tokens: list[str] = list(alphabet)
    merges: list[tuple[str, str]] = []
    pairs = [a + b for a in alphabet for b in alphabet]
    for p in pairs:
        if len(tokens) >= need:
            break
        tokens.append(p)
        merges.append((p[0], p[1]))
    for p in pairs:
        for s in alphabet:
            if len(tokens) >= need:
                break
            tokens.append(p + s)
            merges.append((p, s))
        if len(tokens) >= need:
            break
    if len(tokens) != need:
        sys.exit(f"vocab_size {vocab_size} is too large for the synthetic tokenizer")
    vocab: dict[str, int] = {}
    it = iter(tokens)
    for i in range(vocab_size):
        vocab[specials[i] if i in specials else next(it)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS_TEXT, special=True, normalized=False),
                            AddedToken(EOS_TEXT, special=True, normalized=False)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        sys.exit(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} entries, expected {vocab_size}")
    if tok.token_to_id(BOS_TEXT) != bos_id or tok.token_to_id(EOS_TEXT) != eos_id:
        sys.exit("special tokens did not land on bos_token_id / eos_token_id")
    tok.save(str(out / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TEXT,
        "eos_token": EOS_TEXT,
        "pad_token": EOS_TEXT,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(c["max_position_embeddings"]),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TEXT, "eos_token": EOS_TEXT, "pad_token": EOS_TEXT}, indent=2, ensure_ascii=False)
        + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4: 1 dense + 3 MoE)")
    ap.add_argument("--dense-layers", type=int, default=None,
                    help="dense layers before the MoE ones (default: the config's first_k_dense_replace)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="override the vocabulary (embedding and lm_head rows), e.g. to fit a small disk")
    ap.add_argument("--dtype", choices=["bf16", "float32", "f32", "fp8"], default="bf16",
                    help="weight dtype (default bf16; fp8: projections e4m3 with 128 x 128 block scales)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--config", type=Path, default=DEFAULT_YAML, help=f"model description (default {DEFAULT_YAML})")
    ap.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer files")
    args = ap.parse_args()
    dtype = {"float32": "f32"}.get(args.dtype, args.dtype)

    t0 = time.time()
    cfg = hf_config(load_yaml_config(args.config), args.layers, dtype, args.dense_layers, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(cfg)
    rng = np.random.default_rng(args.seed)
    size = write_safetensors(args.out / "model.safetensors", specs, dtype, rng)
    check_safetensors(args.out / "model.safetensors", specs, dtype)
    if not args.no_tokenizer:
        write_tokenizer(args.out, cfg)
    # config.json last: its presence marks a complete checkpoint.
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(specs)} tensors, {size / 2**30:.2f} GiB {dtype}, {cfg['num_hidden_layers']} layers "
          f"({cfg['num_hidden_layers'] - cfg['first_k_dense_replace']} MoE), seed {args.seed}, "
          f"{time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
