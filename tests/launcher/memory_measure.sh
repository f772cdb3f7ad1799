#!/bin/bash
# Predicted vs measured memory on a live deployment: a coordinator,
# `mpirun -np NP mlarun worker --parallel LAYOUT --memory-gib G` on the tiny
# model, a request set with shared prefixes. Passes only if
#  * `mlarun memory --measure` reports agreement on every rank;
#  * independently of it, the ranks' own GetStats numbers equal what this
#    script works out from the tiny model's shapes: the weights by category,
#    the cache blocks that fit in G minus weights and workspace, and the
#    blocks the request set held on each rank (every request's prompt +
#    tokens - 1, in whole blocks, on each rank of the group that served it);
#  * a wrong prediction (another cache dtype) is reported as a disagreement;
#  * bad input exits 2 naming what was wrong.
#
#   memory_measure.sh MLARUN SOURCE_DIR LAYOUT NP GROUPS [LM_HEAD]
# LM_HEAD (keep, int8 or int4): the workers' --lm-head.
set -u
mlarun=$1 src=$2 layout=$3 np=$4 groups=$5 lm_head=${6:-keep}
name=memory_measure
source "$src/scripts/lib/deployment.sh"

# Bad input first: no deployment needed.
"$mlarun" memory --model "$work/none.yaml" >/dev/null 2>"$work/bad.log"
[ $? = 2 ] || fail "a missing model file did not exit 2"
grep -q "none.yaml" "$work/bad.log" || fail "the error does not name the file: $(cat "$work/bad.log")"
"$mlarun" memory --model "$src/configs/models/tiny.yaml" --world 4 --layouts tp3 >/dev/null 2>"$work/bad.log"
[ $? = 2 ] || fail "a 3-rank layout on --world 4 did not exit 2"
grep -q "tp3" "$work/bad.log" || fail "the error does not name the layout: $(cat "$work/bad.log")"

gib=0.0625
start_deployment prefix_affinity --parallel "$layout" --memory-gib $gib --block-size 16 --lm-head "$lm_head"
wait_for_groups

# 40 requests; half share a 40-token prefix; some may stop at eos.
python3 - >"$work/requests.jsonl" <<'PY'
import json, random
rng = random.Random(17)
shared = [rng.randrange(2, 512) for _ in range(40)]
for i in range(40):
    own = [rng.randrange(2, 512) for _ in range(rng.randrange(1, 50))]
    req = {"prompt_ids": (shared + own) if i % 2 == 0 else own, "max_tokens": rng.randrange(1, 30), "ignore_eos": i % 4 != 0}
    if i % 3 == 0:
        req.update(temperature=0.9, seed=i)
    print(json.dumps(req))
PY
timeout 180 "$mlarun" submit --coordinator "$addr" --prompts "$work/requests.jsonl" --concurrency 40 --json \
  >"$work/results.jsonl" 2>"$work/submit.log" || fail "submit failed: $(tail -3 "$work/submit.log")"

timeout 60 "$mlarun" memory --measure --coordinator "$addr" --requests "$work/requests.jsonl" \
  --results "$work/results.jsonl" --json >"$work/measure.json" 2>"$work/measure.log" ||
  fail "mlarun memory --measure: $(cat "$work/measure.log") $(head -c 3000 "$work/measure.json")"
"$mlarun" stats --coordinator "$addr" --json >"$work/stats.json" || fail "stats failed"

python3 - "$work" "$layout" "$np" "$gib" "$lm_head" <<'PY' || fail "measured memory differs from the shapes' arithmetic"
import json, math, sys
work, layout, np_, gib, lm_head = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
kv = dict(p.split("=") for p in layout.split(","))
dp, tp = int(kv.get("dp", 1)), int(kv.get("attn_tp", 1))
m = json.load(open(f"{work}/measure.json"))
assert m["agree"] is True and m["settled"] is True, m
ranks = json.load(open(f"{work}/stats.json"))["ranks"]
assert len(ranks) == np_, ranks
# tiny.yaml: 4 layers, kv_lora_rank 32, rope 8, 4 heads of nope 16 / v 16, bf16 cache,
# max_position_embeddings 4096 (the workspace chunk), blocks of 16 tokens.
layers, L, R, heads, P, V, e, block = 4, 32, 8, 4, 16, 16, 2, 16
per_token = layers * (L + R) * e
# Weights per rank from the same shapes: hidden 64, vocab 512, q_lora 32; the first
# layer dense (intermediate 128), then MoE: 8 experts and 1 shared, each 32 wide, a
# router [8, 64] and a score bias [8]. float32 weights (4 B) and norms; W_UK / W_UV
# kept in the bf16 cache dtype. Attention heads split over attn_tp; the MLPs over
# all ranks (whole experts, or each expert's width with moe=intermediate; the dense
# MLP's and the shared expert's width either way).
H, vocab, QL, dense_layers, inter, n_exp, moe_inter, f = 64, 512, 32, 1, 128, 8, 32, 4
world, N = np_, heads // tp
assert dp * tp == world, (dp, tp, world)
mlp = lambda width: 3 * width * H * f  # gate, up [width, H]; down [H, width]
attn_replicated = (L + R) * H * f + L * f + 2 * H * f + QL * H * f + QL * f  # kv_a, its norm, 2 layer norms, q_a, its norm
attn_split = N * (P + V) * L * e + H * N * V * f + N * (P + R) * QL * f  # W_UK + W_UV, o, q_b
if kv.get("moe", "expert") == "expert":
    routed = (n_exp // world) * mlp(moe_inter)
else:
    routed = n_exp * mlp(moe_inter // world)
want_weights = {
    "attention_weight_bytes": layers * (attn_replicated + attn_split),
    "dense_mlp_weight_bytes": dense_layers * mlp(inter // world),
    "moe_weight_bytes": (layers - dense_layers) * (routed + mlp(moe_inter // world) + n_exp * H * f + n_exp * f),
    "embedding_head_weight_bytes": 2 * vocab * H * f + H * f,  # embed_tokens, lm_head, final norm
}
# --lm-head int8: a byte per element and an fp32 scale per row; int4: half a
# byte and a scale per row per group of 128 (one here).
head = {"keep": vocab * H * f, "int8": vocab * (H + 4), "int4": vocab * (H // 2 + 4)}[lm_head]
want_weights["embedding_head_weight_bytes"] = vocab * H * f + head + H * f
weights = sum(want_weights.values())
# docs/memory.md's table (tiny model, 4 ranks): 683,360 B per rank under dp=4, 572,768 B under attn_tp=4.
readme = {(4, 1): 683_360, (1, 4): 572_768}
if world == 4 and "moe" not in kv and lm_head == "keep":
    assert weights == readme[(dp, tp)], (weights, readme[(dp, tp)])
rows = min(65536, 4096)
workspace = rows * (L + R) * e + rows * (heads // tp) * ((P + R) + V) * e
reqs = [json.loads(l) for l in open(f"{work}/requests.jsonl")]
res = [json.loads(l) for l in open(f"{work}/results.jsonl")]
assert len(reqs) == len(res) == 40
by_group = {}
for q, r in zip(reqs, res):
    assert "error" not in r, r
    by_group[r["dp_group"]] = by_group.get(r["dp_group"], 0) + math.ceil((len(q["prompt_ids"]) + len(r["tokens"]) - 1) / block)
for k in ranks:
    for field, want in want_weights.items():
        assert int(k.get(field, 0)) == want, (k["rank"], field, k.get(field), want)
    assert int(k["cache_bytes_per_token"]) == per_token, k
    assert int(k["workspace_bytes"]) == workspace, (k["workspace_bytes"], workspace)
    want_blocks = (int(gib * 2**30) - weights - workspace) // (per_token * block)
    assert int(k["cache_blocks_total"]) == want_blocks, (k["rank"], k["cache_blocks_total"], want_blocks)
    # The committed cache and the weights are resident before serving.
    assert int(k["resident_bytes"]) >= weights + want_blocks * per_token * block, (k["rank"], k["resident_bytes"])
    g = int(k.get("dp_group", 0))
    assert int(k.get("cache_blocks_retired", 0)) == by_group.get(g, 0), (k["rank"], k.get("cache_blocks_retired"), by_group)
    assert int(k.get("cache_blocks_used", 0)) == 0, k
    assert 0 < int(k["cache_blocks_peak"]) <= by_group.get(g, 0), k
total = sum(int(k.get("cache_blocks_retired", 0)) for k in ranks)
once = sum(by_group.values())
assert total == once * tp, (total, once, tp)  # TP holds every block on each of its ranks, DP once
print(f"memory_measure: {layout}: weights {weights} B per rank; {once} request blocks, held {total} times over {np_} ranks; capacity {want_blocks} blocks per rank")
PY

# A prediction for another cache dtype must be reported as a disagreement.
"$mlarun" memory --measure --coordinator "$addr" --kv-dtype fp32 --timeout 2 >"$work/wrong.txt" 2>&1 &&
  fail "a wrong prediction (fp32 cache) was reported as agreeing: $(cat "$work/wrong.txt")"
grep -q "DISAGREE" "$work/wrong.txt" || fail "no DISAGREE in: $(cat "$work/wrong.txt")"
echo "memory_measure: PASS ($layout, lm_head $lm_head)"
exit 0
