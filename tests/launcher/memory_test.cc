// `mlarun memory`: every number the DeepSeek-V3 report must carry appears in
// its table and its JSON, with values worked out by hand from the shapes; bad
// input is an error naming what was wrong.
#include "launcher/memory/memory.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/ref/deepseek_v3_by_hand.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

using Json = nlohmann::json;
const std::string kModels = ConfigPath("models/");

MemoryOptions V3Options() {
  MemoryOptions o;
  o.model = kModels + "deepseek-v3.yaml";
  o.world = 8;
  o.layouts = {"tp8", "dp8", "dp2xtp4"};
  o.memory_gib = 141;
  o.kv_dtype = "bf16";
  return o;
}

std::string Report(const MemoryOptions& o) {
  std::ostringstream out;
  const Status st = RunMemory(o, out);
  EXPECT_TRUE(st.ok()) << st;
  return out.str();
}

// One layout's per_rank JSON against the hand arithmetic.
void ExpectRank(const Json& r, const v3_by_hand::Rank& want, int64_t memory, const std::string& name) {
  const v3_by_hand::Cache cache = v3_by_hand::CacheOf(want, memory);
  const Json& w = r["weights"];
  EXPECT_EQ(w["attention_replicated"], want.attention_replicated) << name;
  EXPECT_EQ(w["attention_split"], want.attention_split) << name;
  EXPECT_EQ(w["dense_mlp"], want.dense_mlp) << name;
  EXPECT_EQ(w["moe"], want.moe) << name;
  EXPECT_EQ(w["embedding_and_head"], want.embedding_and_head) << name;
  EXPECT_EQ(w["total"], want.weights()) << name;
  EXPECT_EQ(r["prefill_workspace_bytes"], want.workspace) << name;
  EXPECT_EQ(r["cache_bytes_per_token"], v3_by_hand::kCacheBytesPerToken) << name;
  EXPECT_EQ(r["cache_budget_bytes"], cache.budget) << name;
  EXPECT_EQ(r["cache_blocks"], cache.blocks) << name;
  EXPECT_EQ(r["max_cached_tokens"], cache.tokens) << name;
}

TEST(MemoryCommand, TableCarriesThePinnedNumbers) {
  const std::string text = Report(V3Options());
  for (const char* s :
       {"1,152 B", "70,272 B = 68.625 KiB", "4,997,120 B = 4.765625 MiB", "71.11x", "320 KiB", "= 4.66", "75,497,472 B",
        "3,221,225,472 B", "132 B per layer", "8,052 B = 7.86 KiB", "tp8", "dp8", "dp2xtp4"}) {
    EXPECT_NE(text.find(s), std::string::npos) << "missing '" << s << "' in:\n" << text;
  }
  // bf16 weights of V3 do not fit 8 x 141 GiB: the report says so.
  EXPECT_NE(text.find("does not fit"), std::string::npos);
}

TEST(MemoryCommand, JsonCarriesThePinnedNumbers) {
  MemoryOptions o = V3Options();
  o.json = true;
  const Json j = Json::parse(Report(o));
  const Json& c = j["cache_per_token"];
  EXPECT_EQ(c["latent_bytes_per_layer"], (512 + 64) * 2);
  EXPECT_EQ(c["latent_bytes"], 61 * 1152);
  EXPECT_EQ(c["latent_kib"], 68.625);
  EXPECT_EQ(c["expanded_bytes"], 61 * 128 * (192 + 128) * 2);
  EXPECT_EQ(c["expanded_mib"], 4.765625);
  EXPECT_EQ(c["expanded_ratio"], 71.11);
  EXPECT_EQ(c["v32_indexer_key"]["bytes_per_layer"], 128 + 4);
  EXPECT_EQ(c["v32_indexer_key"]["bytes"], 61 * 132);
  EXPECT_EQ(c["v32_indexer_key"]["kib"], 7.86);
  EXPECT_EQ(c["v32_indexer_key"]["in_model"], false);
  EXPECT_EQ(j["prefill_workspace_all_heads"]["latent_bytes"], int64_t{2} * 576 * 65536);
  EXPECT_EQ(j["prefill_workspace_all_heads"]["key_bytes"], int64_t{2} * 192 * 128 * 65536);
  EXPECT_EQ(j["gqa_comparison"]["bytes_per_token"], 80 * 8 * 128 * 2 * 2);
  EXPECT_EQ(j["gqa_comparison"]["kib_per_token"], 320.0);
  EXPECT_EQ(j["gqa_comparison"]["mla_tp_break_even"], 4.66);
  ASSERT_EQ(j["layouts"].size(), 3u);
  // Per layout: TP holds every token on all 8 ranks, DP once; the split part
  // of attention shrinks with attn_tp.
  const Json& tp8 = j["layouts"][0];
  const Json& dp8 = j["layouts"][1];
  EXPECT_EQ(tp8["name"], "tp8");
  EXPECT_EQ(tp8["cluster"]["copies_per_token"], 8);
  EXPECT_EQ(dp8["cluster"]["copies_per_token"], 1);
  const int64_t split_tp1 =
      61 * ((int64_t{128} * 192 * 1536 + int64_t{7168} * 128 * 128) * 2 + int64_t{128} * 256 * 512 * 2);
  EXPECT_EQ(dp8["per_rank"]["weights"]["attention_split"], split_tp1);
  EXPECT_EQ(tp8["per_rank"]["weights"]["attention_split"], split_tp1 / 8);
  EXPECT_EQ(dp8["per_rank"]["prefill_workspace_bytes"], int64_t{65536} * (576 + 128 * 192 + 128 * 128) * 2);
  // Every layout's weights, workspace and cache budget from the shapes
  // (tests/ref/deepseek_v3_by_hand.h), bf16 throughout.
  const std::map<std::string, int64_t> attn_tp = {{"tp8", 8}, {"dp8", 1}, {"dp2xtp4", 4}};
  for (const Json& l : j["layouts"]) {
    const std::string name = l["name"];
    ASSERT_TRUE(attn_tp.count(name)) << name;
    const v3_by_hand::Rank want = v3_by_hand::ByHand(attn_tp.at(name), /*fp8=*/false);
    ExpectRank(l["per_rank"], want, int64_t{141} << 30, name);
    EXPECT_GT(want.weights(), int64_t{141} << 30) << name << ": bf16 weights alone exceed 141 GiB";
    EXPECT_EQ(l["per_rank"]["fits"], false) << name;  // bf16: 8 ranks are too few
  }
}

// With the release's fp8 projections V3 fits, and data-parallel attention
// caches more distinct tokens than tensor-parallel at 141 GiB. Every number
// per rank is worked out from the shapes (tests/ref/deepseek_v3_by_hand.h).
TEST(MemoryCommand, Fp8FitsAndDpHoldsMoreDistinctTokens) {
  MemoryOptions o = V3Options();
  o.weight_dtype = "fp8";
  o.json = true;
  const Json j = Json::parse(Report(o));
  EXPECT_EQ(j["block_size"], v3_by_hand::kBlockTokens);
  std::map<std::string, Json> by;
  for (const Json& l : j["layouts"]) by[l["name"]] = l;
  ASSERT_EQ(by.size(), 3u);
  // docs/memory.md's table, max cached tokens per rank: 881,152 / 670,976 / 851,136.
  const std::map<std::string, std::pair<int64_t, int64_t>> layouts = {
      {"tp8", {8, 881'152}}, {"dp8", {1, 670'976}}, {"dp2xtp4", {4, 851'136}}};
  for (const auto& [name, tp_tokens] : layouts) {
    ASSERT_TRUE(by.count(name)) << name;
    const Json& l = by[name];
    const v3_by_hand::Rank want = v3_by_hand::ByHand(tp_tokens.first, /*fp8=*/true);
    const v3_by_hand::Cache cache = v3_by_hand::CacheOf(want, int64_t{141} << 30);
    EXPECT_EQ(cache.tokens, tp_tokens.second) << name << ": the hand arithmetic against docs/memory.md";
    ExpectRank(l["per_rank"], want, int64_t{141} << 30, name);
    EXPECT_EQ(l["per_rank"]["fits"], true) << name;
    EXPECT_EQ(l["dp"], 8 / tp_tokens.first) << name;
    EXPECT_EQ(l["cluster"]["distinct_cached_tokens"], cache.tokens * (8 / tp_tokens.first)) << name;
  }
  // fp8 per rank and layer, by hand in deepseek_v3_by_hand.h's terms.
  EXPECT_EQ(by["tp8"]["per_rank"]["weights"]["moe"], 82'503'702'656);
  EXPECT_EQ(by["tp8"]["per_rank"]["weights"]["dense_mlp"], 148'671'936);
  EXPECT_GT(by["dp8"]["cluster"]["distinct_cached_tokens"], by["dp2xtp4"]["cluster"]["distinct_cached_tokens"]);
  EXPECT_GT(by["dp2xtp4"]["cluster"]["distinct_cached_tokens"], by["tp8"]["cluster"]["distinct_cached_tokens"]);
  EXPECT_LT(by["dp8"]["per_rank"]["max_cached_tokens"], by["tp8"]["per_rank"]["max_cached_tokens"]);
  // Break-even below 141 GiB for every pair.
  ASSERT_EQ(j["break_even"].size(), 3u);
  for (const Json& b : j["break_even"]) EXPECT_LT(b["break_even_memory_bytes"].get<double>(), 141.0 * (1 << 30)) << b;
}

// --lm-head int8 / int4 (quantized at load): only the output layer changes,
// by hand: V3's [129280, 7168] head, bf16 against a byte (int8, one fp32
// scale per row) or half a byte (int4, a scale per 128 elements) per element.
TEST(MemoryCommand, LmHeadQuantizedAtLoad) {
  MemoryOptions o = V3Options();
  o.weight_dtype = "fp8";
  o.json = true;
  o.layouts = {"dp8"};
  auto weights = [&](const char* head) {
    o.lm_head = head;
    const Json j = Json::parse(Report(o));
    return j["layouts"][0]["per_rank"]["weights"];
  };
  const Json keep = weights("keep"), int8 = weights("int8"), int4 = weights("int4");
  const int64_t vocab = 129280, hidden = 7168;
  const int64_t bf16 = vocab * hidden * 2;
  EXPECT_EQ(keep["embedding_and_head"].get<int64_t>() - int8["embedding_and_head"].get<int64_t>(),
            bf16 - vocab * (hidden + 4));
  EXPECT_EQ(keep["embedding_and_head"].get<int64_t>() - int4["embedding_and_head"].get<int64_t>(),
            bf16 - vocab * (hidden / 2 + hidden / 128 * 4));
  EXPECT_EQ(keep["moe"], int8["moe"]);
  EXPECT_EQ(keep["attention_split"], int4["attention_split"]);
  o.json = false;
  o.lm_head = "int8";
  EXPECT_NE(Report(o).find("lm_head int8"), std::string::npos);
}

TEST(MemoryCommand, DeepSeekV32IndexerIsCached) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mlarun_memory_v32";
  std::filesystem::create_directories(dir);
  {
    std::ifstream in(kModels + "deepseek-v3.yaml");
    std::ofstream out(dir / "v32.yaml");
    std::string line;
    while (std::getline(in, line))
      out << (line.rfind("model_type:", 0) == 0 ? "model_type: deepseek_v32" : line) << "\n";
  }
  MemoryOptions o = V3Options();
  o.model = (dir / "v32.yaml").string();
  o.json = true;
  const Json j = Json::parse(Report(o));
  EXPECT_EQ(j["cache_per_token"]["bytes"], 70272 + 8052);
  EXPECT_EQ(j["cache_per_token"]["v32_indexer_key"]["in_model"], true);
  EXPECT_EQ(j["layouts"][0]["per_rank"]["cache_bytes_per_token"], 70272 + 8052);
  std::filesystem::remove_all(dir);
}

TEST(MemoryCommand, BadInputNamesWhatIsWrong) {
  auto error = [](const MemoryOptions& o) {
    std::ostringstream out;
    const Status st = RunMemory(o, out);
    EXPECT_FALSE(st.ok());
    EXPECT_TRUE(out.str().empty()) << "printed a report for bad input";
    return st.ToString();
  };
  MemoryOptions o = V3Options();
  o.model = "/nonexistent/model.yaml";
  EXPECT_NE(error(o).find("/nonexistent/model.yaml"), std::string::npos);
  o = V3Options();
  o.layouts = {"tp8", "dp4"};
  const std::string world = error(o);
  EXPECT_NE(world.find("dp4"), std::string::npos) << world;
  EXPECT_NE(world.find("--world is 8"), std::string::npos) << world;
  o.world = 3;
  o.layouts = {"tp3"};
  const std::string heads = error(o);
  EXPECT_NE(heads.find("num_attention_heads"), std::string::npos) << heads;
  o = V3Options();
  o.layouts = {"pp8"};
  EXPECT_NE(error(o).find("'pp8'"), std::string::npos);
  o = V3Options();
  o.weight_dtype = "int3";
  EXPECT_NE(error(o).find("--weight-dtype"), std::string::npos);
  o = V3Options();
  o.lm_head = "fp8";
  EXPECT_NE(error(o).find("--lm-head must be keep, int8 or int4, got 'fp8'"), std::string::npos);
  o = V3Options();
  o.memory_gib = -1;
  EXPECT_NE(error(o).find("--hbm-gib"), std::string::npos);
  // A file that is not a model config.
  const std::filesystem::path bad = std::filesystem::temp_directory_path() / "mlarun_memory_bad.json";
  std::ofstream(bad) << "{\"model_type\": \"llama\"}";
  o = V3Options();
  o.model = bad.string();
  const std::string type = error(o);
  EXPECT_NE(type.find("model_type"), std::string::npos) << type;
  std::filesystem::remove(bad);
}

TEST(MemoryCommand, LayoutsInTheParallelForm) {
  MemoryOptions o = V3Options();
  o.layouts = {"dp=2", "attn_tp=4", "dp=8", "moe=intermediate"};  // as the CLI splits "dp=2,attn_tp=4,dp=8,moe=..."
  o.json = true;
  const Json j = Json::parse(Report(o));
  ASSERT_EQ(j["layouts"].size(), 2u);
  EXPECT_EQ(j["layouts"][0]["name"], "dp2xtp4");
  EXPECT_EQ(j["layouts"][1]["moe"], "intermediate");
  // A short name takes a moe= after it, as serve's --parallel does.
  o.layouts = {"dp2xtp4", "moe=intermediate", "tp8"};  // "dp2xtp4,moe=intermediate,tp8"
  const Json k = Json::parse(Report(o));
  ASSERT_EQ(k["layouts"].size(), 2u);
  EXPECT_EQ(k["layouts"][0]["name"], "dp2xtp4(moe=intermediate)");
  EXPECT_EQ(k["layouts"][0]["moe"], "intermediate");
  EXPECT_EQ(k["layouts"][1]["name"], "tp8");
}

// ---- Prefill/decode splits ----------------------------------------------------

// The `disaggregated` entry of a report by name, and its job of `role`.
const Json& SplitEntry(const Json& j, const std::string& name) {
  for (const Json& s : j["disaggregated"])
    if (s["name"] == name) return s;
  ADD_FAILURE() << "no split " << name << " in " << j["disaggregated"].dump();
  static const Json none = Json::object();
  return none;
}
const Json& Job(const Json& split, const std::string& role) {
  for (const Json& job : split["jobs"])
    if (job["role"] == role) return job;
  ADD_FAILURE() << "no " << role << " job in " << split.dump();
  static const Json none = Json::object();
  return none;
}

// DeepSeek-V3 (fp8) on 16 ranks split 8 + 8: each job is its own world of 8,
// so each of its ranks holds exactly what a dp8 rank of an 8-rank world
// holds (tests/ref/deepseek_v3_by_hand.h), twice the MoE of a dp16 rank.
TEST(MemorySplit, EachJobShardsTheMoeOverItsOwnRanks) {
  MemoryOptions o = V3Options();
  o.world = 16;
  o.weight_dtype = "fp8";
  o.layouts = {"dp16", "p8+d8"};
  o.json = true;
  const Json j = Json::parse(Report(o));
  ASSERT_EQ(j["layouts"].size(), 1u);
  ASSERT_EQ(j["disaggregated"].size(), 1u);
  const Json& split = SplitEntry(j, "p:dp8+d:dp8");
  EXPECT_EQ(split["world"], 16);
  EXPECT_EQ(split["transfer_staging_bytes_per_rank"], 0);
  // MoE per rank of a world of w ranks, by hand: 58 MoE layers of 256 / w
  // whole routed experts, 1/w of the shared expert's width, the fp32 router
  // [256, 7168] and score bias [256] whole.
  auto moe = [](int64_t w) {
    return v3_by_hand::kMoeLayers * ((256 / w) * v3_by_hand::Mlp(2048, true) + v3_by_hand::Mlp(2048 / w, true) +
                                     256 * v3_by_hand::kHidden * 4 + 256 * 4);
  };
  const int64_t memory = int64_t{141} << 30;
  const v3_by_hand::Rank dp8 = v3_by_hand::ByHand(1, /*fp8=*/true);  // a rank of dp=8 over 8 ranks
  ASSERT_EQ(dp8.moe, moe(8));
  const v3_by_hand::Cache cache = v3_by_hand::CacheOf(dp8, memory);
  for (const char* role : {"prefill", "decode"}) {
    const Json& job = Job(split, role);
    EXPECT_EQ(job["name"], "dp8") << role;
    EXPECT_EQ(job["ranks"], 8) << role;
    EXPECT_EQ(job["dp"], 8) << role;
    ExpectRank(job["per_rank"], dp8, memory, role);
    // Sharded over the whole world of 16 it would be half as much.
    EXPECT_NE(job["per_rank"]["weights"]["moe"], moe(16)) << role << ": MoE sharded over the whole world";
    EXPECT_EQ(job["per_rank"]["weights"]["dense_mlp"], 3 * v3_by_hand::Mlp(18432 / 8, true)) << role;
  }
  EXPECT_EQ(j["layouts"][0]["per_rank"]["weights"]["moe"], moe(16));
  // Prompts of 4,096 tokens (64 blocks) on a prefill group, running
  // sequences of 5,120 (80 blocks) on a decode group.
  EXPECT_EQ(j["prompt_tokens"], 4096);
  EXPECT_EQ(j["context_tokens"], 4096 + 1024);
  const Json& prompts = Job(split, "prefill")["held"];
  EXPECT_EQ(prompts["unit"], "prompt");
  EXPECT_EQ(prompts["blocks_each"], 64);
  EXPECT_EQ(prompts["per_group"], cache.blocks / 64);
  EXPECT_EQ(prompts["cluster"], cache.blocks / 64 * 8);
  const Json& sequences = Job(split, "decode")["held"];
  EXPECT_EQ(sequences["unit"], "sequence");
  EXPECT_EQ(sequences["blocks_each"], 80);
  EXPECT_EQ(sequences["per_group"], cache.blocks / 80);
  // Beside the mixed dp16: the split's ranks hold more weight, its decode
  // groups fewer running sequences.
  ASSERT_EQ(split["vs_mixed"].size(), 1u);
  const Json& vs = split["vs_mixed"][0];
  EXPECT_EQ(vs["mixed"], "dp16");
  EXPECT_EQ(vs["decode_extra_weight_bytes_per_rank"],
            dp8.weights() - j["layouts"][0]["per_rank"]["weights"]["total"].get<int64_t>());
  EXPECT_EQ(vs["decode_sequences"], cache.blocks / 80 * 8);
  EXPECT_LT(vs["decode_sequences"].get<int64_t>(), vs["mixed_sequences"].get<int64_t>());

  o.json = false;
  const std::string text = Report(o);
  for (const char* want : {"p:dp8+d:dp8", "prefill dp8", "decode dp8", "transfer staging: 0 B per rank",
                           "prompts of 4,096 tokens", "sequences of 5,120 tokens", "vs dp16: weights per rank +"}) {
    EXPECT_NE(text.find(want), std::string::npos) << "missing '" << want << "' in:\n" << text;
  }
}

// The tiny model split 2 + 2 over 4 ranks, by hand from configs/models/tiny.yaml:
// hidden 64, fp32 weights, 4 layers (the first dense, intermediate 128), 8
// routed experts and 1 shared, each 32 wide, a router [8, 64] and a bias [8].
TEST(MemorySplit, TinyByHand) {
  MemoryOptions o;
  o.model = kModels + "tiny.yaml";
  o.world = 4;
  o.memory_gib = 0.0625;
  o.block_size = 16;
  o.prompt_tokens = 100;   // 7 blocks of 16
  o.context_tokens = 300;  // 19 blocks
  o.layouts = {"p2+d2"};
  o.json = true;
  const Json j = Json::parse(Report(o));
  const int64_t H = 64, f = 4, experts = 8;
  auto mlp = [&](int64_t width) { return 3 * width * H * f; };  // gate, up [width, H]; down [H, width]
  auto moe = [&](int64_t w) { return 3 * ((experts / w) * mlp(32) + mlp(32 / w) + experts * H * f + experts * f); };
  // Only a split named: the mixed layouts of the world go beside it.
  std::vector<std::string> mixed;
  for (const Json& l : j["layouts"]) {
    mixed.push_back(l["name"]);
    EXPECT_EQ(l["role"], "mixed");
    EXPECT_EQ(l["per_rank"]["weights"]["moe"], moe(4)) << l["name"];
  }
  EXPECT_EQ(mixed, (std::vector<std::string>{"tp4", "dp4", "dp2xtp2"}));
  const Json& split = SplitEntry(j, "p:dp2+d:dp2");
  for (const char* role : {"prefill", "decode"}) {
    const Json& rank = Job(split, role)["per_rank"];
    EXPECT_EQ(rank["weights"]["moe"], moe(2)) << role;
    EXPECT_NE(rank["weights"]["moe"], moe(4)) << role << ": MoE sharded over the whole world";
    EXPECT_EQ(rank["weights"]["dense_mlp"], mlp(128 / 2)) << role;
  }
  const int64_t blocks = Job(split, "decode")["per_rank"]["cache_blocks"];
  ASSERT_GT(blocks, 0);
  EXPECT_EQ(Job(split, "prefill")["held"]["blocks_each"], 7);
  EXPECT_EQ(Job(split, "prefill")["held"]["per_group"], blocks / 7);
  EXPECT_EQ(Job(split, "decode")["held"]["blocks_each"], 19);
  EXPECT_EQ(Job(split, "decode")["held"]["cluster"], blocks / 19 * 2);
}

// Every spelling of a split names the same two jobs; a moe= after a job
// applies to that job.
TEST(MemorySplit, Spellings) {
  MemoryOptions o = V3Options();
  o.world = 4;
  o.model = kModels + "tiny.yaml";
  o.json = true;
  auto names = [&](std::vector<std::string> layouts) {
    o.layouts = std::move(layouts);
    std::vector<std::string> out;
    const Json j = Json::parse(Report(o));
    for (const Json& s : j["disaggregated"]) out.push_back(s["name"]);
    return out;
  };
  using Names = std::vector<std::string>;
  // "p:dp=2,attn_tp=1+d:dp=2,attn_tp=1" as the CLI splits it on commas.
  EXPECT_EQ(names({"p:dp=2", "attn_tp=1+d:dp=2", "attn_tp=1"}), Names{"p:dp2+d:dp2"});
  EXPECT_EQ(names({"p2+d2"}), Names{"p:dp2+d:dp2"});
  EXPECT_EQ(names({"d:dp2+p:dp2"}), Names{"p:dp2+d:dp2"});
  EXPECT_EQ(names({"prefill:dp2+decode:dp2"}), Names{"p:dp2+d:dp2"});
  EXPECT_EQ(names({"p1xtp2+d2", "p:tp2+d:tp2", "dp4"}), (Names{"p:tp2+d:dp2", "p:tp2+d:tp2"}));
  EXPECT_EQ(names({"p2+d2", "moe=intermediate"}), Names{"p:dp2+d:dp2(moe=intermediate)"});
  EXPECT_EQ(names({"p:dp=2", "moe=intermediate+d:dp=2", "attn_tp=1"}), Names{"p:dp2(moe=intermediate)+d:dp2"});
  // A mixed layout named beside a split is the only one shown.
  o.layouts = {"p2+d2", "dp4"};
  const Json j = Json::parse(Report(o));
  ASSERT_EQ(j["layouts"].size(), 1u);
  EXPECT_EQ(j["layouts"][0]["name"], "dp4");
}

TEST(MemorySplit, BadSplitsNameWhatIsWrong) {
  auto error = [](const MemoryOptions& o) {
    std::ostringstream out;
    const Status st = RunMemory(o, out);
    EXPECT_FALSE(st.ok());
    EXPECT_TRUE(out.str().empty()) << "printed a report for bad input";
    return st.ToString();
  };
  MemoryOptions o;
  o.model = kModels + "tiny.yaml";
  o.world = 4;
  auto bad = [&](const std::string& layout, std::vector<std::string> wants) {
    o.layouts = {layout};
    const std::string e = error(o);
    for (const std::string& want : wants) EXPECT_NE(e.find(want), std::string::npos) << layout << ": " << e;
  };
  // The two jobs' ranks must add up to --world: the layout and both numbers.
  bad("p2+d4", {"'p2+d4'", "6 ranks", "prefill dp2: 2", "decode dp4: 4", "--world is 4"});
  bad("p1+d1", {"'p1+d1'", "2 ranks", "--world is 4"});
  bad("p2+p2", {"'p2+p2'", "one prefill job", "two prefill jobs"});
  bad("d2+d2", {"two decode jobs"});
  bad("p2+d1+d1", {"'p2+d1+d1'", "one '+'"});
  bad("x2+d2", {"'x2+d2'", "'x2'"});
  bad("p2+", {"'p2+'"});
  bad("p:+d2", {"no layout after 'p:'"});
  bad("p2x+d2", {"'p2x+d2'", "prefill job"});
  bad("p2+d:pp2", {"decode job", "pp2"});
  bad("p:tp3+d1", {"prefill job", "num_attention_heads"});
  o.layouts = {"p2+d2"};
  o.prompt_tokens = 0;
  EXPECT_NE(error(o).find("--prompt-tokens"), std::string::npos);
  o.prompt_tokens = 4096;
  o.context_tokens = -1;
  EXPECT_NE(error(o).find("--context-tokens"), std::string::npos);
}

}  // namespace
}  // namespace mlarun
