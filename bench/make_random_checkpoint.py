#!/usr/bin/env python3
"""Writes a random Hugging Face DeepSeek-V2 checkpoint at DeepSeek-V2-Lite widths.

The directory it writes is what transformers' DeepseekV2ForCausalLM would save
(config.json, model.safetensors with the same tensor names and [out, in]
layouts), plus a synthetic byte-level BPE tokenizer (tokenizer.json,
tokenizer_config.json) with exactly vocab_size entries, which llama.cpp's
convert_hf_to_gguf.py needs for the DeepseekV2 architecture. The tokenizer is
not meant to tokenize text well: the benchmarks feed token ids.

Every width comes from configs/models/deepseek-v2-lite.yaml; only the depth
changes (--layers, default 4: the dense first layer and 3 MoE layers).

Weights: linear layers ~ N(0, 1/fan_in), the embedding ~ N(0, 1), norms
1 + 0.1 * N(0, 1), so activations stay of order one through the layers.

Needs numpy, PyYAML, safetensors and tokenizers. The safetensors file is
written tensor by tensor (bf16 as uint16 bit patterns, rounded to nearest
even), so memory stays small whatever the depth; the `safetensors` package
then reads the header back to check it.

    python3 bench/make_random_checkpoint.py --out /tmp/ckpt --layers 4 --dtype bf16
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

    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict) or cfg.get("model_type") != "deepseek_v2":
        sys.exit(f"{path}: expected a deepseek_v2 model description")
    for key in MLARUN_ONLY_FIELDS:
        cfg.pop(key, None)
    return cfg


def hf_config(yaml_cfg: dict, layers: int, dtype: str) -> dict:
    """config.json as the Hugging Face release writes it, at `layers` depth."""
    c = dict(yaml_cfg)
    if layers < 1:
        sys.exit("--layers must be at least 1")
    c["num_hidden_layers"] = layers
    c["first_k_dense_replace"] = min(int(c["first_k_dense_replace"]), layers)
    c["torch_dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    # Fields the release has and transformers / llama.cpp's converter read
    # (num_key_value_heads: MLA has as many as query heads in HF's modeling).
    extra = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_key_value_heads": c["num_attention_heads"],
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "num_nextn_predict_layers": 0,
    }
    for k, v in extra.items():
        c.setdefault(k, v)
    # Stable key order: architectures and model_type first, then alphabetical.
    head = {k: c.pop(k) for k in ("architectures", "model_type")}
    return {**head, **dict(sorted(c.items()))}


def tensor_specs(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in the order transformers' state_dict lists them.

    kind: "embed" (std 1), "linear" (std 1/sqrt(fan_in)), "norm" (1 + 0.1 N).
    """
    H = c["hidden_size"]
    N = c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    L = c["kv_lora_rank"]
    q_lora = c.get("q_lora_rank")
    E, Im, S = c["n_routed_experts"], c["moe_intermediate_size"], c["n_shared_experts"]
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (c["vocab_size"], H), "embed")]

    def mlp(prefix: str, inter: int) -> None:
        specs.append((prefix + "gate_proj.weight", (inter, H), "linear"))
        specs.append((prefix + "up_proj.weight", (inter, H), "linear"))
        specs.append((prefix + "down_proj.weight", (H, inter), "linear"))

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if q_lora:
            specs.append((a + "q_a_proj.weight", (q_lora, H), "linear"))
            specs.append((a + "q_a_layernorm.weight", (q_lora,), "norm"))
            specs.append((a + "q_b_proj.weight", (N * (nope + rope), q_lora), "linear"))
        else:
            specs.append((a + "q_proj.weight", (N * (nope + rope), H), "linear"))
        specs.append((a + "kv_a_proj_with_mqa.weight", (L + rope, H), "linear"))
        specs.append((a + "kv_a_layernorm.weight", (L,), "norm"))
        specs.append((a + "kv_b_proj.weight", (N * (nope + v), L), "linear"))
        specs.append((a + "o_proj.weight", (H, N * v), "linear"))
        moe = E and i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0
        if moe:
            specs.append((p + "mlp.gate.weight", (E, H), "linear"))
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


def write_safetensors(path: Path, specs, dtype: str, rng: np.random.Generator) -> int:
    """Streams the tensors of `specs` into `path`; returns the bytes written."""
    st_dtype, esize = ("BF16", 2) if dtype == "bf16" else ("F32", 4)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in specs:
        n = int(np.prod(shape)) * esize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * ((8 - len(blob) % 8) % 8)  # data starts 8-byte aligned
    tmp = path.with_suffix(".safetensors.partial")
    rows_per_chunk_elems = 1 << 24  # generate at most 16M values at a time
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, kind in specs:
            if kind == "norm":
                x = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
                f.write((to_bf16_bits(x) if dtype == "bf16" else x).tobytes())
                continue
            std = 1.0 if kind == "embed" else 1.0 / np.sqrt(shape[-1])
            rows, cols = shape
            step = max(1, rows_per_chunk_elems // cols)
            for r in range(0, rows, step):
                x = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
                x *= np.float32(std)
                f.write((to_bf16_bits(x) if dtype == "bf16" else x).tobytes())
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


def check_safetensors(path: Path, specs) -> None:
    """Reads the file back with the safetensors package: names and shapes.

    A file larger than half the machine's memory is checked from its header
    only: the package maps the whole file copy-on-write, which the kernel
    refuses beyond the commit limit (a full-depth checkpoint on a small host).
    """
    want = {name: list(shape) for name, shape, _ in specs}
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
    ap.add_argument("--dtype", choices=["bf16", "float32", "f32"], default="bf16", help="weight dtype (default bf16)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--config", type=Path, default=DEFAULT_YAML, help=f"model description (default {DEFAULT_YAML})")
    ap.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer files")
    args = ap.parse_args()
    dtype = "bf16" if args.dtype == "bf16" else "f32"

    t0 = time.time()
    cfg = hf_config(load_yaml_config(args.config), args.layers, dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(cfg)
    rng = np.random.default_rng(args.seed)
    size = write_safetensors(args.out / "model.safetensors", specs, dtype, rng)
    check_safetensors(args.out / "model.safetensors", specs)
    if not args.no_tokenizer:
        write_tokenizer(args.out, cfg)
    # config.json last: its presence marks a complete checkpoint.
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(specs)} tensors, {size / 2**30:.2f} GiB {dtype}, {cfg['num_hidden_layers']} layers "
          f"({cfg['num_hidden_layers'] - cfg['first_k_dense_replace']} MoE), seed {args.seed}, "
          f"{time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
