// Random MLA attention batches over a paged latent cache, for tests and
// benchmarks: owns the cache pool, weights, queries, outputs and the batch
// description, and hands out MlaParams over them.
//
// With `poison`, everything the kernels must not read is NaN: cache slots of
// no sequence (and those past each sequence's last key), padding between query
// heads and tokens, and unused block-table entries hold out-of-range ids. The
// output and LSE buffers start as NaN, so a row the kernel forgets stays NaN.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/mla_params.h"

namespace mlarun {

struct SyntheticSeq {
  int64_t q_len = 1;
  int64_t seq_len = 1;  // keys, including the q_len new tokens
};

struct SyntheticSpec {
  MlaShape shape;
  DType dtype = DType::kBF16;
  int64_t block_size = 64;
  std::vector<SyntheticSeq> seqs;
  uint64_t seed = 1;
  bool shuffle_blocks = true;  // fragmented block tables (ids in random order)
  bool poison = true;          // NaN in everything that must not be read
  int64_t spare_blocks = 2;    // blocks owned by no sequence
};

class SyntheticBatch {
 public:
  explicit SyntheticBatch(const SyntheticSpec& spec);

  const SyntheticSpec& spec() const { return spec_; }
  // Params over this batch's buffers; softmax scale 1/sqrt(d_nope + d_rope).
  MlaParams params();
  int64_t num_tokens() const { return query_start_.back(); }

  // Values as stored (after rounding to the cache dtype), in double.
  std::vector<double> SeqRows(int64_t seq) const;     // [seq_len, L + R]
  std::vector<double> SeqQueries(int64_t seq) const;  // [q_len, h_q, P + R]
  std::vector<double> WukT() const;                   // [h_q, P, L]
  std::vector<double> Wuv() const;                    // [h_q, L, V]
  // Outputs of sequence `seq` as written by the kernel.
  std::vector<double> SeqOut(int64_t seq) const;  // [q_len, h_q, V]
  std::vector<double> SeqLse(int64_t seq) const;  // [q_len, h_q]
  // True when every element outside the valid output (padding) is still NaN.
  bool OutputPaddingUntouched() const;

  // Writable access for tests that craft special inputs.
  void SetRow(int64_t seq, int64_t pos, const std::vector<float>& row);  // [L + R]
  float* query(int64_t token, int64_t head) {
    return &q_[static_cast<size_t>(token * q_stride_token_ + head * q_stride_head_)];
  }
  int64_t num_blocks() const { return num_blocks_; }
  std::vector<int32_t>& block_table() { return block_table_; }

 private:
  // [q_len, h_q, width] of sequence `seq` from a strided per-token buffer.
  std::vector<double> SeqTokens(const std::vector<float>& buf, int64_t seq, int64_t stride_token, int64_t stride_head,
                                int64_t width) const;
  const std::byte* RowPtr(int64_t seq, int64_t pos) const;

  SyntheticSpec spec_;
  int64_t num_blocks_ = 0, table_stride_ = 0;
  int64_t q_stride_token_ = 0, q_stride_head_ = 0, out_stride_token_ = 0, out_stride_head_ = 0;
  std::vector<std::byte> pool_, w_uk_t_, w_uv_;
  std::vector<float> q_, out_, lse_;
  std::vector<int32_t> query_start_, seq_lens_, block_table_;
};

}  // namespace mlarun
