#include "bench/synthetic_batch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "gemm/convert.h"

namespace mlarun {
namespace {

void StoreOne(float v, std::byte* dst, DType t) { StoreFromF32(&v, dst, t, 1); }

double LoadOne(const std::byte* src, DType t) {
  float v;
  LoadToF32(src, t, &v, 1);
  return v;
}

std::vector<std::byte> RandomTensor(size_t n, DType t, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<std::byte> out(n * DTypeSize(t));
  for (size_t i = 0; i < n; ++i) StoreOne(dist(rng), out.data() + i * DTypeSize(t), t);
  return out;
}

}  // namespace

SyntheticBatch::SyntheticBatch(const SyntheticSpec& spec) : spec_(spec) {
  const MlaShape& s = spec.shape;
  const int64_t W = s.d_cache(), bs = spec.block_size, es = static_cast<int64_t>(DTypeSize(spec.dtype));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> unit(0.f, 1.f);

  // Batch description and block tables.
  query_start_.push_back(0);
  int64_t max_blocks = 0;
  for (const SyntheticSeq& q : spec.seqs) {
    query_start_.push_back(query_start_.back() + static_cast<int32_t>(q.q_len));
    seq_lens_.push_back(static_cast<int32_t>(q.seq_len));
    const int64_t blocks = (q.seq_len + bs - 1) / bs;
    max_blocks = std::max(max_blocks, blocks);
    num_blocks_ += blocks;
  }
  num_blocks_ += spec.spare_blocks;
  num_blocks_ = std::max<int64_t>(num_blocks_, 1);
  table_stride_ = max_blocks + (spec.poison ? 2 : 0);
  std::vector<int32_t> ids(static_cast<size_t>(num_blocks_));
  std::iota(ids.begin(), ids.end(), 0);
  if (spec.shuffle_blocks) std::shuffle(ids.begin(), ids.end(), rng);
  block_table_.assign(static_cast<size_t>(std::max<int64_t>(1, spec.seqs.size() * table_stride_)),
                      spec.poison ? -7 : 0);
  size_t next = 0;
  for (size_t i = 0; i < spec.seqs.size(); ++i) {
    const int64_t blocks = (spec.seqs[i].seq_len + bs - 1) / bs;
    for (int64_t j = 0; j < blocks; ++j)
      block_table_[i * static_cast<size_t>(table_stride_) + static_cast<size_t>(j)] = ids[next++];
  }

  // Cache pool: NaN everywhere, then each sequence's rows.
  pool_.resize(static_cast<size_t>(num_blocks_ * bs * W * es));
  const float fill = spec.poison ? nan : 0.f;
  for (size_t i = 0; i < pool_.size() / static_cast<size_t>(es); ++i)
    StoreOne(fill, pool_.data() + i * static_cast<size_t>(es), spec.dtype);
  std::vector<float> row(static_cast<size_t>(W));
  for (size_t i = 0; i < spec.seqs.size(); ++i) {
    for (int64_t pos = 0; pos < spec.seqs[i].seq_len; ++pos) {
      for (float& v : row) v = unit(rng);
      SetRow(static_cast<int64_t>(i), pos, row);
    }
  }

  // Weights scaled so k_nope and v have unit variance.
  const float w_std = 1.f / std::sqrt(static_cast<float>(s.d_latent));
  w_uk_t_ = RandomTensor(static_cast<size_t>(s.h_q * s.d_nope * s.d_latent), spec.dtype, w_std, rng);
  w_uv_ = RandomTensor(static_cast<size_t>(s.h_q * s.d_latent * s.d_v), spec.dtype, w_std, rng);

  // Queries, outputs: padded strides under poison.
  const int64_t pad = spec.poison ? 1 : 0;
  q_stride_head_ = s.d_qk() + 2 * pad;
  q_stride_token_ = s.h_q * q_stride_head_ + 3 * pad;
  out_stride_head_ = s.d_v + 2 * pad;
  out_stride_token_ = s.h_q * out_stride_head_ + 3 * pad;
  const int64_t T = num_tokens();
  q_.assign(static_cast<size_t>(std::max<int64_t>(1, T * q_stride_token_)), nan);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < s.h_q; ++h)
      for (int64_t c = 0; c < s.d_qk(); ++c) *(query(t, h) + c) = unit(rng);
  out_.assign(static_cast<size_t>(std::max<int64_t>(1, T * out_stride_token_)), nan);
  lse_.assign(static_cast<size_t>(std::max<int64_t>(1, T * s.h_q)), nan);
}

MlaParams SyntheticBatch::params() {
  const MlaShape& s = spec_.shape;
  MlaParams p;
  p.shape = s;
  p.q = q_.data();
  p.num_tokens = num_tokens();
  p.q_stride_token = q_stride_token_;
  p.q_stride_head = q_stride_head_;
  p.w_uk_t = w_uk_t_.data();
  p.w_uv = w_uv_.data();
  p.w_dtype = spec_.dtype;
  p.cache = PagedRowsView{.data = pool_.data(),
                          .dtype = spec_.dtype,
                          .num_blocks = num_blocks_,
                          .block_size = spec_.block_size,
                          .row_width = s.d_cache(),
                          .stride_block = spec_.block_size * s.d_cache(),
                          .stride_token = s.d_cache()};
  p.num_seqs = static_cast<int32_t>(spec_.seqs.size());
  p.query_start = query_start_.data();
  p.seq_lens = seq_lens_.data();
  p.block_table = block_table_.data();
  p.block_table_stride = table_stride_;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.d_qk())));
  p.out = out_.data();
  p.out_stride_token = out_stride_token_;
  p.out_stride_head = out_stride_head_;
  p.lse = lse_.data();
  return p;
}

const std::byte* SyntheticBatch::RowPtr(int64_t seq, int64_t pos) const {
  const int64_t bs = spec_.block_size, W = spec_.shape.d_cache();
  const int64_t block = block_table_[static_cast<size_t>(seq * table_stride_ + pos / bs)];
  return pool_.data() + ((block * bs + pos % bs) * W) * static_cast<int64_t>(DTypeSize(spec_.dtype));
}

void SyntheticBatch::SetRow(int64_t seq, int64_t pos, const std::vector<float>& row) {
  StoreFromF32(row.data(), const_cast<std::byte*>(RowPtr(seq, pos)), spec_.dtype, spec_.shape.d_cache());
}

std::vector<double> SyntheticBatch::SeqRows(int64_t seq) const {
  const int64_t W = spec_.shape.d_cache(), es = static_cast<int64_t>(DTypeSize(spec_.dtype));
  const int64_t n = spec_.seqs[static_cast<size_t>(seq)].seq_len;
  std::vector<double> out(static_cast<size_t>(n * W));
  for (int64_t pos = 0; pos < n; ++pos) {
    const std::byte* r = RowPtr(seq, pos);
    for (int64_t c = 0; c < W; ++c) out[static_cast<size_t>(pos * W + c)] = LoadOne(r + c * es, spec_.dtype);
  }
  return out;
}

std::vector<double> SyntheticBatch::SeqTokens(const std::vector<float>& buf, int64_t seq, int64_t stride_token,
                                              int64_t stride_head, int64_t width) const {
  const int64_t q_len = spec_.seqs[static_cast<size_t>(seq)].q_len, t0 = query_start_[static_cast<size_t>(seq)];
  std::vector<double> out;
  for (int64_t j = 0; j < q_len; ++j)
    for (int64_t h = 0; h < spec_.shape.h_q; ++h)
      for (int64_t c = 0; c < width; ++c)
        out.push_back(buf[static_cast<size_t>((t0 + j) * stride_token + h * stride_head + c)]);
  return out;
}

std::vector<double> SyntheticBatch::SeqQueries(int64_t seq) const {
  return SeqTokens(q_, seq, q_stride_token_, q_stride_head_, spec_.shape.d_qk());
}

static std::vector<double> ToDouble(const std::vector<std::byte>& v, DType t) {
  const size_t es = DTypeSize(t);
  std::vector<double> out(v.size() / es);
  for (size_t i = 0; i < out.size(); ++i) out[i] = LoadOne(v.data() + i * es, t);
  return out;
}

std::vector<double> SyntheticBatch::WukT() const { return ToDouble(w_uk_t_, spec_.dtype); }
std::vector<double> SyntheticBatch::Wuv() const { return ToDouble(w_uv_, spec_.dtype); }

std::vector<double> SyntheticBatch::SeqOut(int64_t seq) const {
  return SeqTokens(out_, seq, out_stride_token_, out_stride_head_, spec_.shape.d_v);
}

std::vector<double> SyntheticBatch::SeqLse(int64_t seq) const {
  const MlaShape& s = spec_.shape;
  const int64_t q_len = spec_.seqs[static_cast<size_t>(seq)].q_len, t0 = query_start_[static_cast<size_t>(seq)];
  return std::vector<double>(lse_.begin() + t0 * s.h_q, lse_.begin() + (t0 + q_len) * s.h_q);
}

bool SyntheticBatch::OutputPaddingUntouched() const {
  const MlaShape& s = spec_.shape;
  for (int64_t i = 0; i < static_cast<int64_t>(out_.size()); ++i) {
    const int64_t in_token = i % out_stride_token_;
    const bool valid = in_token < s.h_q * out_stride_head_ && in_token % out_stride_head_ < s.d_v;
    if (!valid && !std::isnan(out_[static_cast<size_t>(i)])) return false;
  }
  return true;
}

}  // namespace mlarun
