#!/usr/bin/env python3
"""DeepSeek-V3's forward in float64, numpy only, read from a Hugging Face checkpoint directory.

An independent reference for mlarun at any width, the real ones included: written the long way from the
architecture as transformers' DeepseekV3ForCausalLM defines it (and the release's modeling_deepseek.py):

* RMSNorm: x / sqrt(mean(x^2) + rms_norm_eps) * weight.
* MLA expanded per head: q = q_b(norm(q_a(x))) (or q_proj(x)), [nope | rope] per head; kv_a_proj_with_mqa(x) =
  [latent | k_rope]; kv_b(norm(latent)) = [k_nope | v] per head; k_rope shared by the heads. RoPE on the rope
  parts with rope_interleave (the default): the pairs (2i, 2i+1) are first gathered into halves (i, i + d/2),
  then rotated as rotate_half does. Scores (q . k) x softmax_scale, causal; o_proj of the heads' outputs.
* YaRN (rope_scaling / rope_parameters of type yarn): inverse frequencies blended between base^(-2i/d) and that
  / factor by the linear ramp between the floor / ceil of the correction dims of beta_fast / beta_slow; cos and
  sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim); softmax_scale = qk_head_dim^-0.5 x
  mscale(factor, mscale_all_dim)^2, where mscale(s, m) = 0.1 m ln(s) + 1 (s > 1).
* MoE (noaux_tc): s = sigmoid(x . router); choice = s + e_score_correction_bias; a group's score is the sum of
  its 2 best choices; the topk_group best groups are kept (the others' choices set to 0); the
  num_experts_per_tok best choices are the experts; their weights are the unbiased s, divided by their sum
  (norm_topk_prob), times routed_scaling_factor; plus the shared experts; SiLU-gated MLPs.

Weights are dequantized from the memory-mapped safetensors file, a block of rows at a time (F8_E4M3 with its
`_scale_inv` 128 x 128 blocks, BF16, F32), into float64; only what the prompt touches is read: the embedding rows
of its tokens, every projection of the attention and dense MLPs, the router, the routed experts its tokens
select, and lm_head. Memory stays at a few hundred MB whatever the width.

Greedy decoding: the prompt, then --new-tokens tokens, each the argmax of the last position's logits (a latent
cache of the keys and values of earlier positions; the same as recomputing the sequence). Prints JSON: the
generated tokens, and per step the --top best (token, logit, logprob) plus the logits' scale; also
(top_bf16_head_input) those of lm_head applied to its input rounded to bf16, which is what a runtime that
multiplies bf16 weights by bf16-rounded activations computes (mlarun does, for the bf16 lm_head).

    python3 tests/ref/deepseek_v3_reference.py --model DIR --prompt-ids 3,17,99 --new-tokens 4 > ref.json
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np

BLOCK = 128
ROWS_PER_CHUNK_ELEMS = 1 << 23  # float64 values dequantized at a time (64 MiB)


def e4m3_table():
    """float64 value of every e4m3fn code; the NaN codes (0x7f, 0xff) map to NaN."""
    t = np.empty(256, dtype=np.float64)
    for code in range(256):
        e, m = (code >> 3) & 0xF, code & 7
        v = (m / 8.0) * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
        t[code] = -v if code & 0x80 else v
    t[0x7F] = t[0xFF] = np.nan
    return t


E4M3 = e4m3_table()


class Checkpoint:
    """The tensors of model.safetensors (or the shards of model.safetensors.index.json), mapped."""

    def __init__(self, directory):
        index = os.path.join(directory, "model.safetensors.index.json")
        files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else [
            "model.safetensors"]
        self.tensors = {}
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
            for k, v in header.items():
                if k != "__metadata__":
                    self.tensors[k] = (data, v)
        self.bytes_read = 0

    def has(self, name):
        return name in self.tensors

    def _raw(self, name):
        data, info = self.tensors[name]
        b, e = info["data_offsets"]
        dt = {"F8_E4M3": np.uint8, "BF16": np.dtype("<u2"), "F32": np.dtype("<f4")}[info["dtype"]]
        return info["dtype"], data[b:e].view(dt).reshape(info["shape"])

    def rows(self, name, r0, r1):
        """Rows r0:r1 of a 2-D tensor (or all of a 1-D one) as float64, dequantized."""
        dtype, raw = self._raw(name)
        block = raw[r0:r1] if raw.ndim == 2 else raw
        self.bytes_read += block.nbytes
        if dtype == "BF16":
            return (block.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if dtype == "F32":
            return block.astype(np.float64)
        sdtype, scale = self._raw(name + "_scale_inv")
        s = scale.astype(np.uint32) << 16 if sdtype == "BF16" else scale
        s = (s.view(np.float32) if sdtype == "BF16" else s).astype(np.float64)
        rs = np.repeat(s, BLOCK, axis=0)[r0:r1]  # [r1 - r0, ceil(cols / 128)]
        return E4M3[block] * np.repeat(rs, BLOCK, axis=1)[:, :block.shape[1]]

    def full(self, name):
        return self.rows(name, 0, self.tensors[name][1]["shape"][0])

    def shape(self, name):
        return self.tensors[name][1]["shape"]


def to_bf16(x):
    """float64 -> float32 -> bf16 (round to nearest even) -> float64."""
    u = x.astype(np.float32).view(np.uint32)
    u = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return u.view(np.float32).astype(np.float64)


def linear(ck, name, x):
    """x [n, in] @ W.T, W [out, in] dequantized a block of rows at a time."""
    out, cols = ck.shape(name)
    step = max(BLOCK, ROWS_PER_CHUNK_ELEMS // cols // BLOCK * BLOCK)
    y = np.empty((x.shape[0], out), dtype=np.float64)
    for r in range(0, out, step):
        y[:, r:r + step] = x @ ck.rows(name, r, min(out, r + step)).T
    return y


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def mlp(ck, prefix, x):
    return linear(ck, prefix + "down_proj.weight",
                  silu(linear(ck, prefix + "gate_proj.weight", x)) * linear(ck, prefix + "up_proj.weight", x))


def yarn_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class Rope:
    """cos / sin per position of the rope dims (halves layout) and the attention's softmax scale."""

    def __init__(self, c):
        d = c["qk_rope_head_dim"]
        rs = c.get("rope_scaling") or c.get("rope_parameters") or {}
        base = float(rs.get("rope_theta", c.get("rope_theta", 10000.0)))
        kind = rs.get("type", rs.get("rope_type", "default"))
        inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
        self.attn_factor = 1.0
        self.softmax_scale = (c["qk_nope_head_dim"] + d) ** -0.5
        if kind == "yarn":
            factor = float(rs["factor"])
            orig = float(rs["original_max_position_embeddings"])
            fast, slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

            def corr_dim(rot):
                return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

            lo, hi = max(math.floor(corr_dim(fast)), 0), min(math.ceil(corr_dim(slow)), d - 1)
            if lo == hi:
                hi += 0.001
            ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
            extrapolate = 1.0 - ramp
            inv = inv / factor * (1 - extrapolate) + inv * extrapolate
            m, m_all = float(rs.get("mscale", 1) or 0), float(rs.get("mscale_all_dim", 0) or 0)
            if m and m_all:
                self.attn_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
            else:
                self.attn_factor = yarn_mscale(factor, 1.0)
            if m_all:
                self.softmax_scale *= yarn_mscale(factor, m_all) ** 2
        elif kind not in ("default", None):
            sys.exit(f"rope type {kind}: not in this reference")
        self.inv = inv
        self.interleave = c.get("rope_interleave", True)

    def apply(self, x, pos):
        """x [..., n, d] at positions pos [n] -> rotated, in the halves layout."""
        d = x.shape[-1]
        if self.interleave:  # (2i, 2i+1) -> (i, i + d/2)
            x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        ang = np.outer(pos.astype(np.float64), self.inv)
        cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1) * self.attn_factor
        sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1) * self.attn_factor
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * cos + rot * sin


class Model:
    def __init__(self, directory):
        self.c = json.load(open(os.path.join(directory, "config.json")))
        self.ck = Checkpoint(directory)
        self.rope = Rope(self.c)
        self.cache = [{"k": None, "v": None} for _ in range(self.c["num_hidden_layers"])]
        self.experts_used = set()

    def attention(self, i, x, pos):
        c, ck, a = self.c, self.ck, f"model.layers.{i}.self_attn."
        n, H = x.shape[0], c["num_attention_heads"]
        nope, dr, dv, L = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        eps = c["rms_norm_eps"]
        if c.get("q_lora_rank"):
            qa = rms_norm(linear(ck, a + "q_a_proj.weight", x), ck.full(a + "q_a_layernorm.weight"), eps)
            q = linear(ck, a + "q_b_proj.weight", qa)
        else:
            q = linear(ck, a + "q_proj.weight", x)
        q = q.reshape(n, H, nope + dr).transpose(1, 0, 2)  # [H, n, nope + rope]
        kv = linear(ck, a + "kv_a_proj_with_mqa.weight", x)
        latent = rms_norm(kv[:, :L], ck.full(a + "kv_a_layernorm.weight"), eps)
        kvb = linear(ck, a + "kv_b_proj.weight", latent).reshape(n, H, nope + dv).transpose(1, 0, 2)
        k_rope = self.rope.apply(kv[:, L:], pos)  # [n, rope], one for all heads
        k = np.concatenate([kvb[:, :, :nope], np.broadcast_to(k_rope, (H, n, dr))], axis=-1)
        v = kvb[:, :, nope:]
        q = np.concatenate([q[:, :, :nope], self.rope.apply(q[:, :, nope:], pos)], axis=-1)
        cache = self.cache[i]
        cache["k"] = k if cache["k"] is None else np.concatenate([cache["k"], k], axis=1)
        cache["v"] = v if cache["v"] is None else np.concatenate([cache["v"], v], axis=1)
        K, V = cache["k"], cache["v"]  # [H, past + n, .]
        s = np.einsum("hqd,hkd->hqk", q, K) * self.rope.softmax_scale
        kpos = np.arange(K.shape[1])
        s = np.where(kpos[None, None, :] <= pos[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        o = np.einsum("hqk,hkd->qhd", p, V).reshape(n, H * dv)
        return linear(ck, a + "o_proj.weight", o)

    def route(self, p, x):
        """(experts [n, k], weights [n, k]) of the noaux_tc router."""
        c = self.c
        logits = x @ self.ck.full(p + "gate.weight").T
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + self.ck.full(p + "gate.e_score_correction_bias")
        n, E = scores.shape
        G, kg, k = c["n_group"], c["topk_group"], c["num_experts_per_tok"]
        grouped = choice.reshape(n, G, E // G)
        group_score = np.sort(grouped, axis=-1)[:, :, -2:].sum(axis=-1)
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :kg]
        mask = np.zeros((n, G), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, E // G, axis=-1), choice, 0.0)
        experts = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(scores, experts, axis=-1)
        if c.get("norm_topk_prob", True):
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        return experts, w * c["routed_scaling_factor"]

    def moe(self, i, x):
        p = f"model.layers.{i}.mlp."
        experts, w = self.route(p, x)
        y = np.zeros_like(x)
        for e in np.unique(experts):
            rows = np.nonzero((experts == e).any(axis=-1))[0]
            we = (w * (experts == e)).sum(axis=-1)[rows]
            y[rows] += we[:, None] * mlp(self.ck, f"{p}experts.{e}.", x[rows])
            self.experts_used.add((i, int(e)))
        if self.c.get("n_shared_experts"):
            y += mlp(self.ck, p + "shared_experts.", x)
        return y

    def forward(self, tokens, start):
        """Logits of the last of `tokens` (at positions start..), extending the cache: [2, vocab], the
        second row from lm_head's input rounded to bf16."""
        c, ck = self.c, self.ck
        eps = c["rms_norm_eps"]
        x = np.stack([ck.rows("model.embed_tokens.weight", t, t + 1)[0] for t in tokens])
        pos = np.arange(start, start + len(tokens))
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + self.attention(i, rms_norm(x, ck.full(p + "input_layernorm.weight"), eps), pos)
            h = rms_norm(x, ck.full(p + "post_attention_layernorm.weight"), eps)
            dense = i < c["first_k_dense_replace"] or i % c.get("moe_layer_freq", 1) != 0
            x = x + (mlp(ck, p + "mlp.", h) if dense else self.moe(i, h))
        h = rms_norm(x[-1:], ck.full("model.norm.weight"), eps)
        head = "model.embed_tokens.weight" if c.get("tie_word_embeddings") else "lm_head.weight"
        # Also with lm_head's input rounded to bf16: what a runtime multiplying
        # bf16 weights by bf16 activations computes.
        return linear(ck, head, np.concatenate([h, to_bf16(h)]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, model.safetensors)")
    ap.add_argument("--prompt-ids", required=True, help="token ids: 1,2,3")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--top", type=int, default=20, help="best logits reported per step")
    args = ap.parse_args()
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    t0 = time.time()
    m = Model(args.model)
    tokens, steps, start, feed = [], [], 0, prompt
    for _ in range(args.new_tokens):
        both = m.forward(feed, start)
        start += len(feed)
        step = {}
        for key, logits in (("top", both[0]), ("top_bf16_head_input", both[1])):
            mx = logits.max()
            lse = mx + math.log(np.exp(logits - mx).sum())
            best = np.argsort(-logits, kind="stable")[:args.top]
            step[key] = [[int(t), float(logits[t]), float(logits[t] - lse)] for t in best]
        best = [t for t, _, _ in step["top"]]
        step["logit_max_abs"], step["logit_std"] = float(np.abs(both[0]).max()), float(both[0].std())
        steps.append(step)
        tokens.append(int(best[0]))
        feed = [tokens[-1]]
        print(f"step {len(tokens)}: token {tokens[-1]} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    json.dump({"prompt": prompt, "tokens": tokens, "steps": steps, "experts_used": len(m.experts_used),
               "bytes_read": m.ck.bytes_read, "seconds": time.time() - t0}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
