// CUDA MLA attention against the CPU backend on the same inputs. Skips
// without a GPU.
//
// Inputs come from SyntheticBatch with poison: cache slots of no sequence
// (and past each sequence's last key) NaN, block tables shuffled with
// out-of-range ids after each row's valid entries, NaN padding between query
// heads and tokens, output, LSE and workspace buffers NaN before the run. The CUDA run
// reads copies of exactly those bytes.
//
// Tolerances. Both backends round the same operands to the cache dtype at
// the same points (q_nope, the absorbed query, the probabilities, o_latent,
// the expanded K and V) and accumulate in fp32; what differs is the order of
// the fp32 sums (and the tile maxima the probabilities are taken against).
// f32: only rounding-order noise, ~1e-6 relative: cosine distance < 1e-9,
// max error < 1e-4 of the largest output, |dlse| < 1e-4. bf16: a different
// fp32 sum can round an intermediate one bf16 ulp (2^-8) the other way;
// such flips are sparse and uncorrelated, so the cosine distance stays
// FlashMLA's bf16 bound (cal_diff: 1e-5) and the max error within 2e-2 of
// the largest output, |dlse| < 2e-2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "attention/mla.h"
#include "base/cuda_device.h"
#include "base/device_memory.h"
#include "base/workspace.h"
#include "bench/synthetic_batch.h"

namespace mlarun {
namespace {

struct Case {
  std::string name;
  MlaShape shape;
  DType dtype = DType::kBF16;
  int64_t block_size = 64;
  std::vector<SyntheticSeq> seqs;
  MlaPath path = MlaPath::kAuto;
  int64_t expand_chunk_rows = 65536;
};

// q_len <= 4 absorbed, longer blocks expanded (with or without a prefix).
MlaConfig ConfigFor(const Case& c, Backend b) {
  return MlaConfig{.backend = b,
                   .path = c.path,
                   .absorb_below_query_len = 5,
                   .absorb_below_query_len_no_prefix = 5,
                   .expand_chunk_rows = c.expand_chunk_rows};
}

std::vector<SyntheticSeq> Varlen(int64_t b, int64_t q_len, int64_t lo, int64_t hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<SyntheticSeq> s(static_cast<size_t>(b));
  for (SyntheticSeq& e : s)
    e = {.q_len = q_len, .seq_len = lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1))};
  return s;
}

StatusOr<DeviceBuffer> Upload(DeviceMemory& m, const void* src, size_t bytes, const char* what) {
  MLARUN_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(m, std::max<size_t>(bytes, 64), what));
  MLARUN_RETURN_IF_ERROR(m.CopyIn(b.data(), src, bytes));
  return b;
}

struct Diff {
  double cos_diff = 0, max_err_rel = 0, max_lse_err = 0;
  bool finite = true;
};

void RunCase(const Case& c, MlaPlan* reuse = nullptr) {
  SCOPED_TRACE(c.name);
  auto memory = CudaMemory();
  ASSERT_TRUE(memory.ok()) << memory.status();
  DeviceMemory& dm = **memory;
  SyntheticBatch batch(
      SyntheticSpec{.shape = c.shape, .dtype = c.dtype, .block_size = c.block_size, .seqs = c.seqs, .seed = 17});
  MlaParams hp = batch.params();
  const MlaShape& s = c.shape;
  const size_t es = DTypeSize(c.dtype);
  const int64_t T = hp.num_tokens;

  // Device copies of every input, and NaN-filled outputs.
  const size_t pool_bytes = static_cast<size_t>(hp.cache.num_blocks * hp.cache.stride_block) * es;
  const std::vector<float> nan_out(static_cast<size_t>(T * hp.out_stride_token), NAN);
  const std::vector<float> nan_lse(static_cast<size_t>(T * s.h_q), NAN);
  auto d_pool = Upload(dm, hp.cache.data, pool_bytes, "cache");
  auto d_wuk = Upload(dm, hp.w_uk_t, static_cast<size_t>(s.h_q * s.d_nope * s.d_latent) * es, "w_uk_t");
  auto d_wuv = Upload(dm, hp.w_uv, static_cast<size_t>(s.h_q * s.d_latent * s.d_v) * es, "w_uv");
  auto d_q = Upload(dm, hp.q, static_cast<size_t>(T * hp.q_stride_token) * 4, "q");
  auto d_out = Upload(dm, nan_out.data(), nan_out.size() * 4, "out");
  auto d_lse = Upload(dm, nan_lse.data(), nan_lse.size() * 4, "lse");
  for (auto* b : {&d_pool, &d_wuk, &d_wuv, &d_q, &d_out, &d_lse}) ASSERT_TRUE(b->ok()) << b->status();

  MlaParams dp = hp;
  dp.cache.data = d_pool->data();
  dp.w_uk_t = d_wuk->data();
  dp.w_uv = d_wuv->data();
  dp.q = static_cast<const float*>(d_q->data());
  dp.out = static_cast<float*>(d_out->data());
  dp.lse = static_cast<float*>(d_lse->data());

  Workspace host_ws;
  ASSERT_TRUE(MlaForward(hp, ConfigFor(c, Backend::kCpu), host_ws).ok());

  MlaPlan own;
  MlaPlan& plan = reuse != nullptr ? *reuse : own;
  const Status planned = MlaReplan(dp, ConfigFor(c, Backend::kCuda), plan);
  ASSERT_TRUE(planned.ok()) << planned;
  // The workspace starts NaN too: scratch that a kernel reads before any
  // kernel wrote it (a split's partial, a staged descriptor) shows in the output.
  Workspace dev_ws(&dm);
  WorkspaceView v = dev_ws.Reserve(plan.workspace_bytes);
  ASSERT_TRUE(plan.workspace_bytes == 0 || v.data != nullptr);
  const std::vector<unsigned char> nan_ws(plan.workspace_bytes, 0xff);
  ASSERT_TRUE(dm.CopyIn(v.data, nan_ws.data(), nan_ws.size()).ok());
  const Status st = MlaRun(dp, plan, v);
  ASSERT_TRUE(st.ok()) << st;
  std::vector<float> out(nan_out.size()), lse(nan_lse.size());
  ASSERT_TRUE(dm.CopyOut(out.data(), dp.out, out.size() * 4).ok());
  ASSERT_TRUE(dm.CopyOut(lse.data(), dp.lse, lse.size() * 4).ok());

  // Compare every valid element; padding must still be NaN.
  Diff d;
  double dot = 0, aa = 0, bb = 0, max_ref = 0, max_err = 0;
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    const std::vector<double> ref = batch.SeqOut(static_cast<int64_t>(i));
    const std::vector<double> ref_lse = batch.SeqLse(static_cast<int64_t>(i));
    const int64_t t0 = hp.query_start[i];
    for (int64_t j = 0; j < c.seqs[i].q_len; ++j) {
      for (int64_t h = 0; h < s.h_q; ++h) {
        for (int64_t k = 0; k < s.d_v; ++k) {
          const double a = out[static_cast<size_t>((t0 + j) * hp.out_stride_token + h * hp.out_stride_head + k)];
          const double b = ref[static_cast<size_t>((j * s.h_q + h) * s.d_v + k)];
          if (!std::isfinite(a)) d.finite = false;
          dot += a * b, aa += a * a, bb += b * b;
          max_ref = std::max(max_ref, std::fabs(b));
          max_err = std::max(max_err, std::fabs(a - b));
        }
        const double a = lse[static_cast<size_t>((t0 + j) * s.h_q + h)];
        const double b = ref_lse[static_cast<size_t>(j * s.h_q + h)];
        if (!std::isfinite(a)) d.finite = false;
        d.max_lse_err = std::max(d.max_lse_err, std::fabs(a - b) / std::max(1.0, std::fabs(b)));
      }
    }
  }
  d.cos_diff = aa + bb > 0 ? 1.0 - 2.0 * dot / (aa + bb) : 0.0;
  d.max_err_rel = max_ref > 0 ? max_err / max_ref : max_err;
  int64_t padding_written = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i) {
    const int64_t in_token = i % hp.out_stride_token;
    const bool valid = in_token < s.h_q * hp.out_stride_head && in_token % hp.out_stride_head < s.d_v;
    if (!valid && !std::isnan(out[static_cast<size_t>(i)])) ++padding_written;
  }

  const bool bf16 = c.dtype == DType::kBF16;
  const double cos_tol = bf16 ? 1e-5 : 1e-9, err_tol = bf16 ? 2e-2 : 1e-4, lse_tol = bf16 ? 2e-2 : 1e-4;
  std::cout << "[ mla_cuda ] " << c.name << " " << DTypeName(c.dtype) << " " << s << ": cos_diff " << d.cos_diff
            << " (< " << cos_tol << "), max err / max |ref| " << d.max_err_rel << " (< " << err_tol << "), max lse err "
            << d.max_lse_err << " (< " << lse_tol << ")\n";
  EXPECT_TRUE(d.finite) << "NaN or inf in the CUDA output";
  EXPECT_LT(d.cos_diff, cos_tol);
  EXPECT_LT(d.max_err_rel, err_tol);
  EXPECT_LT(d.max_lse_err, lse_tol);
  EXPECT_EQ(padding_written, 0) << "the CUDA run wrote output padding";
  EXPECT_GT(bb, 0.0) << "the reference output is all zeros: the test checks nothing";
}

#define MLARUN_REQUIRE_GPU()                             \
  do {                                                   \
    auto devices = CudaDevices();                        \
    if (!devices.ok()) GTEST_SKIP() << devices.status(); \
  } while (0)

// FlashMLA's decoding shapes (DeepSeek-V3: L 512, R 64), a subset that runs
// quickly: batch {1, 3, 32, 128}, contexts 20 .. 16384 (varlen), heads
// {1, 3, 16, 63, 64, 128}, query lengths {1, 2, 4}.
TEST(MlaCuda, DecodeMatchesCpu) {
  MLARUN_REQUIRE_GPU();
  const std::vector<Case> cases = {
      {.name = "b1_h128_q1_16k", .shape = DeepSeekV3MlaShape(128), .seqs = {{1, 16384}}},
      {.name = "b3_h64_q4_varlen", .shape = DeepSeekV3MlaShape(64), .seqs = {{4, 20}, {4, 1000}, {4, 5000}}},
      {.name = "b32_h16_q2_varlen", .shape = DeepSeekV3MlaShape(16), .seqs = Varlen(32, 2, 20, 4096, 3)},
      {.name = "b128_h63_q1_varlen", .shape = DeepSeekV3MlaShape(63), .seqs = Varlen(128, 1, 20, 600, 4)},
      {.name = "b128_h16_q1_short", .shape = DeepSeekV3MlaShape(16), .seqs = Varlen(128, 1, 1, 64, 5)},
      {.name = "b4_h128_q2_8k", .shape = DeepSeekV3MlaShape(128), .seqs = {{2, 8192}, {2, 300}, {2, 64}, {2, 65}}},
      {.name = "b3_h3_varq",
       .shape = DeepSeekV3MlaShape(3),
       .dtype = DType::kF32,
       .seqs = {{1, 20}, {2, 2000}, {4, 16384}}},
      {.name = "b1_h1_q1", .shape = DeepSeekV3MlaShape(1), .dtype = DType::kF32, .seqs = {{1, 777}}},
      {.name = "b1_h1_q1_bf16", .shape = DeepSeekV3MlaShape(1), .seqs = {{1, 3000}}},
      // Sequences without query tokens (empty, and with a cached context) between decoding ones.
      {.name = "b5_h16_qlen0", .shape = DeepSeekV3MlaShape(16), .seqs = {{0, 0}, {1, 300}, {0, 50}, {2, 2}, {0, 64}}},
  };
  for (const Case& c : cases) RunCase(c);
}

// Dimensions that are no tile's multiple: odd L (a bf16 word straddles the
// latent and rope columns), 16-row pages, 5 heads.
TEST(MlaCuda, OddDimensionsMatchCpu) {
  MLARUN_REQUIRE_GPU();
  const MlaShape odd{.h_q = 5, .d_latent = 63, .d_rope = 5, .d_nope = 16, .d_v = 33};
  for (DType dt : {DType::kBF16, DType::kF32}) {
    RunCase({.name = "odd_decode",
             .shape = odd,
             .dtype = dt,
             .block_size = 16,
             .seqs = {{1, 300}, {3, 50}, {2, 2}, {4, 4}}});
    RunCase({.name = "odd_prefill",
             .shape = odd,
             .dtype = dt,
             .block_size = 16,
             .seqs = {{77, 77}, {30, 250}, {2, 90}},
             .path = MlaPath::kExpanded,
             .expand_chunk_rows = 40});
  }
}

// Prefill through the expanded path, with and without a prefix, several
// chunks (expand_chunk_rows not a page multiple), mixed with an absorbed
// decode sequence in the same call.
TEST(MlaCuda, PrefillMatchesCpu) {
  MLARUN_REQUIRE_GPU();
  RunCase({.name = "prefill_mixed",
           .shape = DeepSeekV3MlaShape(16),
           .seqs = {{300, 300}, {100, 600}, {1, 700}, {7, 7}},
           .expand_chunk_rows = 96});
  RunCase({.name = "prefill_f32",
           .shape = DeepSeekV3MlaShape(3),
           .dtype = DType::kF32,
           .seqs = {{129, 129}, {1, 300}, {65, 1000}},
           .expand_chunk_rows = 256});
  RunCase({.name = "expanded_q1",
           .shape = DeepSeekV3MlaShape(3),
           .seqs = {{1, 130}, {5, 5}},
           .path = MlaPath::kExpanded,
           .expand_chunk_rows = 64});
  RunCase({.name = "prefill_qlen0",
           .shape = DeepSeekV3MlaShape(16),
           .seqs = {{0, 100}, {40, 100}, {0, 0}, {1, 200}},
           .expand_chunk_rows = 64});
}

// One plan object replanned for successive batches (as a model step does).
TEST(MlaCuda, ReplanMatchesCpu) {
  MLARUN_REQUIRE_GPU();
  MlaPlan plan;
  RunCase({.name = "replan_a", .shape = DeepSeekV3MlaShape(16), .seqs = Varlen(8, 1, 100, 3000, 8)}, &plan);
  RunCase({.name = "replan_b", .shape = DeepSeekV3MlaShape(16), .seqs = Varlen(2, 3, 500, 9000, 9)}, &plan);
  RunCase({.name = "replan_c", .shape = DeepSeekV3MlaShape(16), .seqs = {{40, 200}, {1, 50}}}, &plan);
}

TEST(MlaCuda, RefusesUnsupportedShapes) {
  MLARUN_REQUIRE_GPU();
  SyntheticBatch batch(SyntheticSpec{.shape = {.h_q = 2, .d_latent = 1024, .d_rope = 64, .d_nope = 16, .d_v = 16},
                                     .dtype = DType::kBF16,
                                     .seqs = {{1, 10}},
                                     .poison = false});
  MlaParams p = batch.params();  // host pointers: planning must refuse before touching them
  auto plan = MlaMakePlan(p, MlaConfig{.backend = Backend::kCuda, .path = MlaPath::kAbsorbed});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("d_latent"), std::string::npos) << plan.status();
}

}  // namespace
}  // namespace mlarun
