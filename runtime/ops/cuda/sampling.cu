// The next token of each logit row, logits on the GPU (sampling.h).
//
// Greedy rows (Sampler::greedy) without penalties or biases
// (Sampler::modifies_logits) are reduced where the logits lie and only
// (argmax, weight sum) per row comes back, 16 bytes; the sampler turns that
// into the token and its logprob and advances its stream by its one draw
// (Sampler::SampleGreedyFrom), so tokens, logprobs and streams equal the CPU
// path's bit for bit. Other rows are copied to the host one by one and sampled
// there by the same Sampler::Sample as on the CPU, penalties and biases included.
//
// GreedyReduceKernel: one block per row (the kernel runs over every row when
// any is greedy; the others' results are not read), as SamplerGreedyReduce
// (runtime/ops/sampling_math.h) computes it:
//  1. the max over the row, NaN skipped (a block max; any row without a value
//     above -inf has no distribution);
//  2. each thread takes whole blocks of kSamplerWeightBlock ids: the block's
//     weight sum with SamplerBlockWeightSum, into global scratch, and the
//     first id in it equal to the max;
//  3. the lowest such id (a block min), and one thread adds the block sums in
//     id order, as the sampler does.
#include <span>
#include <vector>

#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"
#include "runtime/ops/sampling_math.h"

namespace mlarun::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kNone = INT64_MAX;

struct GreedyRow {
  double weight_sum;
  int64_t argmax;  // -1: no distribution
};

__global__ void GreedyReduceKernel(const float* __restrict__ logits, int64_t vocab, int64_t ld,
                                   double* __restrict__ block_sums, GreedyRow* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const float* row = logits + r * ld;
  float max_key = -INFINITY;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) max_key = row[i] > max_key ? row[i] : max_key;
  max_key = BlockReduce(max_key, MaxOp{}, -INFINITY);  // no NaN reaches the reduction
  if (!(max_key > -INFINITY)) {                        // the same for every thread of the block
    if (threadIdx.x == 0) out[r] = GreedyRow{0.0, -1};
    return;
  }
  const double max_logit = SamplerCleanLogit(max_key);
  const int64_t blocks = (vocab + kSamplerWeightBlock - 1) / kSamplerWeightBlock;
  double* sums = block_sums + r * blocks;
  int64_t first = kNone;
  for (int64_t b = threadIdx.x; b < blocks; b += kThreads) {
    const int64_t start = b * kSamplerWeightBlock;
    const int64_t end = start + kSamplerWeightBlock < vocab ? start + kSamplerWeightBlock : vocab;
    sums[b] = SamplerBlockWeightSum(row, start, end, max_logit);
    for (int64_t i = start; first == kNone && i < end; ++i)
      if (row[i] == max_key) first = i;
  }
  // The barrier inside also makes every thread's sums[] visible to thread 0.
  first = BlockReduce(first, MinOp{}, kNone);
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) total = sampler_math::Add(total, sums[b]);
    out[r] = GreedyRow{total, first};
  }
}

}  // namespace

Status Sample(const SampleParams& p) {
  const int64_t rows = p.rows, vocab = p.vocab;
  bool any_greedy = false;
  // Greedy rows are reduced where they lie, unless they also list their most
  // likely tokens or have penalties: those, and sampled rows, come to the
  // host whole.
  auto reduced = [](const Sampler& s) { return s.greedy() && !s.wants_top() && !s.modifies_logits(); };
  for (int64_t r = 0; r < rows; ++r) any_greedy = any_greedy || reduced(*p.samplers[r]);
  thread_local std::vector<GreedyRow> greedy;
  greedy.assign(static_cast<size_t>(rows), GreedyRow{0.0, -1});
  if (any_greedy && vocab > 0) {
    MLARUN_RETURN_IF_ERROR(CheckInt("sample", "rows", rows));
    MLARUN_RETURN_IF_ERROR(CheckInt("sample", "vocab", vocab));
    const int64_t blocks = (vocab + kSamplerWeightBlock - 1) / kSamplerWeightBlock;
    const size_t out_bytes = static_cast<size_t>(rows) * sizeof(GreedyRow);
    thread_local DeviceScratch scratch;
    MLARUN_ASSIGN_OR_RETURN(void* buf, scratch.Get(out_bytes + static_cast<size_t>(rows * blocks) * sizeof(double),
                                                   "sample: the greedy reductions"));
    auto* out = static_cast<GreedyRow*>(buf);
    auto* block_sums = reinterpret_cast<double*>(static_cast<std::byte*>(buf) + out_bytes);
    GreedyReduceKernel<<<static_cast<unsigned>(rows), kThreads>>>(p.logits, vocab, p.ld, block_sums, out);
    MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("GreedyReduceKernel");
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(greedy.data(), out, out_bytes, cudaMemcpyDeviceToHost));
  }
  thread_local std::vector<float> host_row;
  for (int64_t r = 0; r < rows; ++r) {
    Sampler& s = *p.samplers[r];
    if (reduced(s)) {
      const GreedyRow& g = greedy[static_cast<size_t>(r)];
      p.out[r] = s.SampleGreedyFrom(g.argmax, g.weight_sum);
      continue;
    }
    host_row.resize(static_cast<size_t>(vocab));
    if (vocab > 0)
      MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(host_row.data(), p.logits + r * p.ld,
                                             static_cast<size_t>(vocab) * sizeof(float), cudaMemcpyDeviceToHost));
    p.out[r] = s.Sample(std::span<const float>(host_row.data(), static_cast<size_t>(vocab)));
  }
  return Status::Ok();
}

Status Score(const ScoreParams& p) {
  thread_local std::vector<float> host_row;
  host_row.resize(static_cast<size_t>(p.vocab));
  for (int64_t r = 0; r < p.rows; ++r) {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(host_row.data(), p.logits + r * p.ld,
                                           static_cast<size_t>(p.vocab) * sizeof(float), cudaMemcpyDeviceToHost));
    p.out[r] = ScoreToken(std::span<const float>(host_row.data(), host_row.size()), p.tokens[r], p.top);
  }
  return Status::Ok();
}

}  // namespace mlarun::cuda
