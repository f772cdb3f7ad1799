// `mlarun bench accuracy`: how far a model's logits are from a reference
// model's on the same token ids (an int4 or int8 checkpoint against the bf16
// one it was made from, say), and how far logits that llama.cpp wrote for
// the same ids (bench/llama_logits.cpp) are from the reference's.
//
// The ids: `positions` random token ids (uniform over the reference's
// vocabulary, from `seed`), cut into positions / sequence_length sequences
// that each start from an empty cache. Every sequence runs as one
// teacher-forced prompt and gives the logits of every one of its positions;
// with chunk_tokens, as forwards of that many tokens each (1: every position
// a decode step, so the products are the few-row ones decode runs: int8
// activations with int4 weights, cpu::UseIntDot).
//
// Per position, with l the logits under test and r the reference's (every
// sum in float64):
//   relative error  ||l - r||_2 / ||r||_2
//   KL divergence   KL(p_r || p_l) of the next-token distributions
//                   p = softmax(logits), in nats
//   top-1           the tested model's greedy token (the lowest id among
//                   equal maxima) is one of the reference's most likely
// and per model: relative error mean / median / max, KL mean / p99 / max,
// the share of positions whose top-1 agrees.
//
// The reference runs first and only its logits are kept (positions x vocab
// f32: 400 MB for 1024 positions of a 102400-token vocabulary); then each
// model in turn is loaded, run and freed, so two large models never share
// memory.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

struct AccuracyBenchOptions {
  std::vector<std::string> models;  // checkpoint directories or configs/models/*.yaml
  std::string reference;            // the same
  int64_t positions = 1024;
  int64_t sequence_length = 256;  // positions must be a multiple of it
  int64_t chunk_tokens = 0;       // tokens per forward within a sequence; 0: all of it at once
  uint64_t seed = 0;
  // Logits files of bench/llama_logits.cpp (raw f32 [positions, vocab]),
  // each with its FILE.ids (the ids it evaluated, as WriteAccuracyIds writes
  // them), which must be this run's.
  std::vector<std::string> llama_logits;
  // Write this run's ids there (WriteAccuracyIds) and stop: what
  // bench/llama_logits.cpp reads. Loads only the reference's config.
  std::string write_ids;
  bool json = false;
};

// The options' own checks (no file is read): positions and sequence_length
// positive, positions a multiple of sequence_length, a reference, something
// to compare with it (or write_ids). The error names the flag.
Status ValidateAccuracyOptions(const AccuracyBenchOptions& o);

// Runs the comparison: the table (markdown) on `out`, or with o.json one
// JSON document on `out` and the table on `err`; progress on `err`. A model
// or file that fails gets its error in its row and the run goes on; the
// returned status then names each failure.
Status RunAccuracyBench(const AccuracyBenchOptions& o, std::ostream& out, std::ostream& err);

// The ids of a run: `positions` ids uniform in [0, vocab) from `seed`.
std::vector<int32_t> AccuracyIds(int64_t positions, int64_t vocab, uint64_t seed);

// The ids file: text, "mlarun-accuracy-ids 1", then "sequence_length L",
// "positions N", then the N ids separated by white space.
struct AccuracyIdsFile {
  int64_t sequence_length = 0;
  std::vector<int32_t> ids;
};
Status WriteAccuracyIds(const std::string& path, const AccuracyIdsFile& f);
// Errors name the file and what is wrong in it (the line's field, an id
// count that is not `positions`, a negative id).
StatusOr<AccuracyIdsFile> ReadAccuracyIds(const std::string& path);

// --- The metrics (float64 throughout) -------------------------------------

// ||x - ref|| / ||ref||; +inf when ref is all zeros and x is not, 0 when both are.
double RelativeError(std::span<const float> ref, std::span<const float> x);
// KL(softmax(ref) || softmax(x)) in nats, computed from log-softmax with the
// maximum subtracted (no overflow for logits of any finite magnitude).
double KlDivergence(std::span<const float> ref, std::span<const float> x);
// The lowest index of the maximum.
int64_t Argmax(std::span<const float> x);
// x's greedy token (Argmax) has ref's maximal value.
bool Top1Agrees(std::span<const float> ref, std::span<const float> x);

// The q-quantile (0 <= q <= 1) of `v`, interpolated linearly between the
// closest ranks (numpy's default); 0 for an empty `v`.
double Quantile(std::vector<double> v, double q);

// The metrics of one model, position by position.
class LogitComparison {
 public:
  // One position: `ref` and `x` are one row of logits each (vocab wide).
  // INVALID_ARGUMENT when the widths differ or a logit is not finite
  // (naming `what` and the position).
  Status Add(std::span<const float> ref, std::span<const float> x, const std::string& what);

  struct Summary {
    int64_t positions = 0;
    double rel_err_mean = 0, rel_err_median = 0, rel_err_max = 0;
    double kl_mean = 0, kl_p99 = 0, kl_max = 0;
    double top1_percent = 0;
  };
  Summary Summarize() const;

 private:
  std::vector<double> rel_err_, kl_;
  int64_t top1_ = 0;
};

}  // namespace mlarun
