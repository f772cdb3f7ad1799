// MLA attention against the float64 reference: absorbed, expanded and the
// per-sequence dispatch, on random inputs with everything unused NaN-poisoned.
#include "attention/mla.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "bench/synthetic_batch.h"
#include "tests/ref/mla_ref.h"

namespace mlarun {
namespace {

struct DatasetSpec {
  std::string name;
  MlaShape shape;
  int64_t block_size;
  std::vector<SyntheticSeq> seqs;
};

std::ostream& operator<<(std::ostream& os, const DatasetSpec& d) { return os << d.name; }

// Relative error as max |x - ref| / max |ref| over a tensor (elementwise
// relative error is meaningless near zero); LSE is compared the same way.
struct Errors {
  double out = 0, lse = 0;
  bool finite = true;
};

class MlaVsReference : public ::testing::TestWithParam<std::tuple<DatasetSpec, DType>> {
 protected:
  void SetUp() override {
    const auto& [d, dtype] = GetParam();
    SyntheticSpec s{.shape = d.shape,
                    .dtype = dtype,
                    .block_size = d.block_size,
                    .seqs = d.seqs,
                    .seed = std::hash<std::string>()(d.name) ^ static_cast<uint64_t>(dtype)};
    batch_ = std::make_unique<SyntheticBatch>(s);
    const ref::MlaRefShape rs{d.shape.h_q, d.shape.d_latent, d.shape.d_rope, d.shape.d_nope, d.shape.d_v};
    const double scale = batch_->params().softmax_scale;
    for (size_t i = 0; i < d.seqs.size(); ++i) {
      ref_out_.emplace_back();
      ref_lse_.emplace_back();
      ref::MlaReference(rs, batch_->SeqRows(static_cast<int64_t>(i)), batch_->SeqQueries(static_cast<int64_t>(i)),
                        batch_->WukT(), batch_->Wuv(), d.seqs[i].q_len, d.seqs[i].seq_len, scale, ref_out_.back(),
                        ref_lse_.back());
    }
  }

  Errors RunAndCompare(const MlaConfig& config) {
    // Fresh NaN outputs for every run.
    *batch_ = SyntheticBatch(batch_->spec());
    MlaParams p = batch_->params();
    Workspace ws;
    const Status st = MlaForward(p, config, ws);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(batch_->OutputPaddingUntouched()) << "kernel wrote outside the output rows";
    Errors e;
    double max_ref = 0, max_ref_lse = 0, max_err = 0, max_err_lse = 0;
    for (size_t i = 0; i < ref_out_.size(); ++i) {
      const auto out = batch_->SeqOut(static_cast<int64_t>(i));
      const auto lse = batch_->SeqLse(static_cast<int64_t>(i));
      for (size_t k = 0; k < out.size(); ++k) {
        if (!std::isfinite(out[k])) e.finite = false;
        max_ref = std::max(max_ref, std::abs(ref_out_[i][k]));
        max_err = std::max(max_err, std::abs(out[k] - ref_out_[i][k]));
      }
      for (size_t k = 0; k < lse.size(); ++k) {
        if (!std::isfinite(lse[k])) e.finite = false;
        max_ref_lse = std::max(max_ref_lse, std::abs(ref_lse_[i][k]));
        max_err_lse = std::max(max_err_lse, std::abs(lse[k] - ref_lse_[i][k]));
      }
    }
    e.out = max_err / std::max(max_ref, 1e-30);
    e.lse = max_err_lse / std::max(max_ref_lse, 1.0);
    return e;
  }

  std::unique_ptr<SyntheticBatch> batch_;
  std::vector<std::vector<double>> ref_out_, ref_lse_;
};

TEST_P(MlaVsReference, AllPathsMatch) {
  const auto& [d, dtype] = GetParam();
  const double tol = dtype == DType::kF32 ? 1e-5 : 1e-2;
  int64_t max_q = 0;
  for (const auto& s : d.seqs) max_q = std::max(max_q, s.q_len);
  struct Variant {
    const char* name;
    MlaConfig config;
  };
  std::vector<Variant> variants = {
      {"absorbed", MlaConfig{.path = MlaPath::kAbsorbed}},
      {"expanded", MlaConfig{.path = MlaPath::kExpanded}},
      // Dispatch: a threshold in the middle of the batch's query lengths.
      {"dispatch", MlaConfig{.path = MlaPath::kAuto,
                             .absorb_below_query_len = std::max<int64_t>(2, max_q / 2 + 1),
                             .absorb_below_query_len_no_prefix = std::max<int64_t>(2, max_q / 4 + 1)}},
      // Small tiles and chunks: many LSE merges, key splits across 4 threads.
      {"absorbed-small-tiles",
       MlaConfig{.path = MlaPath::kAbsorbed, .kv_tile_rows = 64, .q_tile_rows = 37, .num_threads = 4}},
      {"expanded-chunked", MlaConfig{.path = MlaPath::kExpanded,
                                     .expand_chunk_rows = 100,
                                     .kv_tile_rows = 64,
                                     .q_tile_rows = 5,
                                     .num_threads = 3}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const Errors e = RunAndCompare(v.config);
    EXPECT_TRUE(e.finite) << "NaN or Inf in the output: the kernel read a poisoned value";
    if (getenv("MLA_TEST_VERBOSE")) printf("%-24s out %.3g lse %.3g\n", v.name, e.out, e.lse);
    EXPECT_LE(e.out, tol) << "output relative error";
    EXPECT_LE(e.lse, tol) << "lse relative error";
  }
}

MlaShape Small(int64_t heads) { return MlaShape{.h_q = heads, .d_latent = 40, .d_rope = 8, .d_nope = 16, .d_v = 24}; }

const std::vector<DatasetSpec> kDatasets = {
    // DeepSeek-V3 attention dims: decode rows, a short block and a prefill.
    {"v3_mixed", DeepSeekV3MlaShape(), 64, {{1, 300}, {1, 65}, {4, 100}, {9, 9}}},
    // Odd sizes: heads 1, 3, 16, 128; contexts 1, 63, 64, 65, 4100.
    {"h1_contexts", Small(1), 16, {{1, 1}, {1, 63}, {1, 64}, {1, 65}, {3, 4100}}},
    {"h3_qlens", Small(3), 16, {{1, 40}, {2, 41}, {3, 3}, {4, 70}, {5, 64}, {6, 6}, {7, 100}, {8, 129}, {9, 200}}},
    {"h16_prefill", Small(16), 64, {{300, 300}, {300, 700}, {0, 10}, {1, 4100}}},
    {"h128_small_dims", Small(128), 64, {{1, 65}, {9, 72}, {1, 1}, {5, 5}}},
    // One decode row: fewer items than threads, so its keys split into
    // ranges of 64-key groups (uneven at the end) merged by LSE.
    {"decode_one", Small(16), 16, {{1, 700}}},
};

INSTANTIATE_TEST_SUITE_P(Mla, MlaVsReference,
                         ::testing::Combine(::testing::ValuesIn(kDatasets),
                                            ::testing::Values(DType::kF32, DType::kBF16)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" + std::string(DTypeName(std::get<1>(info.param)));
                         });

}  // namespace
}  // namespace mlarun
