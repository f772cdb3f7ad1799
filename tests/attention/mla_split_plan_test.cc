// The CUDA decode's split plan (attention/cuda/split_plan.h): host-only
// properties over random batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "attention/cuda/split_plan.h"
#include "attention/mla_params.h"

namespace mlarun {
namespace {

// Every property the decode and combine kernels rely on.
void ExpectValidPlan(const SplitPlanConfig& c, const std::vector<SplitSeq>& seqs, const SplitPlan& plan) {
  const int64_t n = static_cast<int64_t>(seqs.size());
  ASSERT_EQ(static_cast<int64_t>(plan.num_splits.size()), n);
  ASSERT_EQ(static_cast<int64_t>(plan.partial_offset.size()), n);
  int64_t base = 0, partial_rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    base += (seqs[i].q_len * c.h_q + c.rows_per_block - 1) / c.rows_per_block;
    const int32_t ns = plan.num_splits[i];
    ASSERT_GE(ns, 1);
    ASSERT_LE(ns, c.max_splits);
    if (ns > 1) {
      EXPECT_EQ(plan.partial_offset[i], partial_rows) << "partials of sequence " << i << " overlap another's";
      partial_rows += ns * seqs[i].q_len * c.h_q;
    } else {
      EXPECT_EQ(plan.partial_offset[i], -1);
    }
  }
  EXPECT_EQ(plan.partial_rows, partial_rows);
  EXPECT_EQ(plan.base_tiles, base);
  // At most target + base work items: three waves of blocks, or twice the tiles.
  EXPECT_LE(static_cast<int64_t>(plan.items.size()), plan.target_blocks + base);

  // Per sequence: every (row, split) pair exactly once; the splits of a row
  // tile cover [0, seq_len) exactly, page-aligned and non-empty; each item's
  // range is its split clipped to what its last token sees.
  std::vector<std::vector<int>> seen(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) seen[i].assign(static_cast<size_t>(seqs[i].q_len * c.h_q * plan.num_splits[i]), 0);
  for (const SplitWorkItem& it : plan.items) {
    ASSERT_GE(it.seq, 0);
    ASSERT_LT(it.seq, n);
    const SplitSeq& s = seqs[it.seq];
    const int32_t ns = plan.num_splits[it.seq];
    ASSERT_GE(it.split, 0);
    ASSERT_LT(it.split, ns);
    ASSERT_GE(it.rows, 1);
    ASSERT_LE(it.rows, c.rows_per_block);
    ASSERT_GE(it.row0, 0);
    ASSERT_LE(it.row0 + it.rows, s.q_len * c.h_q);
    const KeyRange r = SplitKeyRange(s.seq_len, c.page_rows, it.split, ns);
    EXPECT_EQ(r.begin % c.page_rows, 0);
    EXPECT_LT(r.begin, r.end) << "empty split " << it.split << " of sequence " << it.seq;
    EXPECT_EQ(it.key_begin, r.begin);
    const int64_t visible = CausalVisibleKeys(s.seq_len - s.q_len, (it.row0 + it.rows - 1) / c.h_q);
    EXPECT_EQ(it.key_end, std::min(r.end, visible));
    EXPECT_EQ(it.partial_row, ns > 1 ? plan.partial_offset[it.seq] + it.split * s.q_len * c.h_q + it.row0 : -1);
    for (int32_t row = it.row0; row < it.row0 + it.rows; ++row) ++seen[it.seq][row * ns + it.split];
  }
  for (int64_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < seen[i].size(); ++k) ASSERT_EQ(seen[i][k], 1) << "sequence " << i << " pair " << k;
    // The splits tile the keys exactly.
    int64_t next = 0;
    for (int32_t k = 0; k < plan.num_splits[i]; ++k) {
      const KeyRange r = SplitKeyRange(seqs[i].seq_len, c.page_rows, k, plan.num_splits[i]);
      EXPECT_EQ(r.begin, next);
      next = r.end;
    }
    EXPECT_EQ(next, seqs[i].seq_len);
  }
}

TEST(MlaSplitPlan, RandomBatchesAreValid) {
  std::mt19937_64 rng(41);
  for (int round = 0; round < 300; ++round) {
    SplitPlanConfig c;
    c.h_q = std::vector<int64_t>{1, 3, 16, 63, 64, 128}[rng() % 6];
    c.rows_per_block = rng() % 2 ? 64 : 32;
    c.page_rows = std::vector<int64_t>{16, 64, 64, 100}[rng() % 4];
    c.num_sms = std::vector<int64_t>{1, 7, 108, 132}[rng() % 4];
    c.blocks_per_sm = 1 + static_cast<int64_t>(rng() % 2);
    c.min_split_keys = std::vector<int64_t>{1, 128, 300}[rng() % 3];
    c.max_splits = std::vector<int64_t>{1, 5, 64}[rng() % 3];
    const int64_t b = 1 + static_cast<int64_t>(rng() % 140);
    std::vector<SplitSeq> seqs(static_cast<size_t>(b));
    for (SplitSeq& s : seqs) {
      s.q_len = 1 + static_cast<int64_t>(rng() % 5);
      s.seq_len = s.q_len + static_cast<int64_t>(rng() % (rng() % 2 ? 20000 : 300));
    }
    ASSERT_TRUE(CheckSplitPlanInput(c, seqs.data(), b).ok());
    SplitPlan plan;
    PlanSplits(c, seqs.data(), b, &plan);
    SCOPED_TRACE(testing::Message() << "round " << round << " b=" << b << " h_q=" << c.h_q);
    ExpectValidPlan(c, seqs, plan);
    if (HasFatalFailure()) return;
  }
}

TEST(MlaSplitPlan, SmallBatchesSplitLargeUniformOnesDoNot) {
  SplitPlanConfig c{.h_q = 128, .rows_per_block = 64, .page_rows = 64, .num_sms = 132, .blocks_per_sm = 1};
  // One DeepSeek decode sequence of 16k keys: 2 tiles would use 2 of 132 SMs.
  std::vector<SplitSeq> one{{.q_len = 1, .seq_len = 16384}};
  SplitPlan plan;
  PlanSplits(c, one.data(), 1, &plan);
  EXPECT_GT(plan.num_splits[0], 1);
  EXPECT_GE(static_cast<int64_t>(plan.items.size()), c.num_sms / 2) << "the split batch should fill the SMs";
  ExpectValidPlan(c, one, plan);

  // 128 sequences x 2 tiles = 256 blocks: already two waves, nothing to split.
  std::vector<SplitSeq> big(128, SplitSeq{.q_len = 1, .seq_len = 4096});
  PlanSplits(c, big.data(), 128, &plan);
  for (int32_t ns : plan.num_splits) EXPECT_EQ(ns, 1);
  EXPECT_EQ(plan.items.size(), 256u);
  EXPECT_EQ(plan.partial_rows, 0);

  // A large batch with one very long sequence: only that one is cut.
  big[5].seq_len = 200000;
  PlanSplits(c, big.data(), 128, &plan);
  for (size_t i = 0; i < big.size(); ++i) EXPECT_EQ(plan.num_splits[i] > 1, i == 5) << i;
  ExpectValidPlan(c, big, plan);
}

TEST(MlaSplitPlan, ShortContextsAndLimits) {
  SplitPlanConfig c{.h_q = 16, .rows_per_block = 64, .page_rows = 64, .num_sms = 132, .min_split_keys = 128};
  // Shorter than min_split_keys: never split, whatever the idle SMs.
  std::vector<SplitSeq> seqs{{.q_len = 1, .seq_len = 20}, {.q_len = 4, .seq_len = 100}};
  SplitPlan plan;
  PlanSplits(c, seqs.data(), 2, &plan);
  EXPECT_EQ(plan.num_splits[0], 1);
  EXPECT_EQ(plan.num_splits[1], 1);
  EXPECT_EQ(plan.split_keys % c.page_rows, 0);
  EXPECT_GE(plan.split_keys, 128);
  // max_splits caps a long sequence.
  c.max_splits = 3;
  std::vector<SplitSeq> longer{{.q_len = 2, .seq_len = 100000}};
  PlanSplits(c, longer.data(), 1, &plan);
  EXPECT_EQ(plan.num_splits[0], 3);
  ExpectValidPlan(c, longer, plan);
}

TEST(MlaSplitPlan, LastSplitPastATileIsEmptyForItOnly) {
  // prefix 638, q_len 4, one-page splits: token 0 sees [0, 639) and token 1
  // [0, 640), so the last split [640, 642) is empty for their tiles only.
  SplitPlanConfig c{.h_q = 64, .rows_per_block = 64, .page_rows = 64, .num_sms = 132, .min_split_keys = 64};
  std::vector<SplitSeq> seqs{{.q_len = 4, .seq_len = 642}};
  SplitPlan plan;
  PlanSplits(c, seqs.data(), 1, &plan);
  ExpectValidPlan(c, seqs, plan);
  ASSERT_EQ(plan.num_splits[0], 11);
  bool saw_empty = false;
  for (const SplitWorkItem& it : plan.items) {
    if (it.key_end <= it.key_begin) {
      saw_empty = true;
      EXPECT_EQ(it.split, plan.num_splits[0] - 1);
      EXPECT_LT(it.row0 / c.h_q, 2);
    }
  }
  EXPECT_TRUE(saw_empty);
}

TEST(MlaSplitPlan, DeterministicAndReusable) {
  std::mt19937_64 rng(7);
  SplitPlanConfig c{.h_q = 16, .rows_per_block = 64, .page_rows = 64, .num_sms = 108};
  std::vector<SplitSeq> a(9), b(3);
  for (SplitSeq& s : a)
    s = {.q_len = 1 + static_cast<int64_t>(rng() % 4), .seq_len = 5 + static_cast<int64_t>(rng() % 9000)};
  for (SplitSeq& s : b) s = {.q_len = 2, .seq_len = 70 + static_cast<int64_t>(rng() % 3000)};
  SplitPlan fresh_a, fresh_b, reused;
  PlanSplits(c, a.data(), 9, &fresh_a);
  PlanSplits(c, b.data(), 3, &fresh_b);
  PlanSplits(c, a.data(), 9, &reused);
  PlanSplits(c, b.data(), 3, &reused);
  const size_t cap = reused.items.capacity();
  EXPECT_EQ(reused.num_splits, fresh_b.num_splits);
  EXPECT_EQ(reused.partial_offset, fresh_b.partial_offset);
  ASSERT_EQ(reused.items.size(), fresh_b.items.size());
  for (size_t i = 0; i < reused.items.size(); ++i) {
    EXPECT_EQ(reused.items[i].key_begin, fresh_b.items[i].key_begin);
    EXPECT_EQ(reused.items[i].key_end, fresh_b.items[i].key_end);
    EXPECT_EQ(reused.items[i].partial_row, fresh_b.items[i].partial_row);
  }
  PlanSplits(c, b.data(), 3, &reused);
  EXPECT_EQ(reused.items.capacity(), cap) << "replanning a batch no larger allocates";
}

TEST(MlaSplitPlan, RejectsBadInput) {
  SplitPlanConfig c;
  std::vector<SplitSeq> bad{{.q_len = 3, .seq_len = 2}};
  EXPECT_FALSE(CheckSplitPlanInput(c, bad.data(), 1).ok());
  bad[0] = {.q_len = 0, .seq_len = 2};
  EXPECT_FALSE(CheckSplitPlanInput(c, bad.data(), 1).ok());
  c.num_sms = 0;
  bad[0] = {.q_len = 1, .seq_len = 2};
  EXPECT_FALSE(CheckSplitPlanInput(c, bad.data(), 1).ok());
}

}  // namespace
}  // namespace mlarun
