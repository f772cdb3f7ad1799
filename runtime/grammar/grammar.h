// Structured output: the token masks of a request's StructuredOutput
// (JSON object, JSON Schema, regular expression, choice, EBNF grammar),
// computed by xgrammar over the model's vocabulary. The engine compiles a
// request's constraint when it is added and hands it to the request's
// Sampler (runtime/ops/sampler.h TokenConstraint), which masks each row
// with it; only the group's leader samples, so only it holds one.
//
// xgrammar stays behind this interface: nothing above includes it.
#pragma once

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/ops/sampler.h"
#include "runtime/request/sampling_params.h"
#include "text/tokenizer.h"

namespace mlarun {

// Time spent filling masks, over every constraint of the process (what the
// decode benchmark reports per step).
struct GrammarMaskStats {
  int64_t fills = 0;
  double seconds = 0;
};
GrammarMaskStats GrammarMaskTotals();

// The model's vocabulary as xgrammar sees it, and its compile cache: one
// per model, shared by every request. Thread-safe: Compile may run on any
// thread, several at once.
class GrammarCompiler {
 public:
  // `tokenizer`: the model's (its tokens' bytes; special tokens are never
  // allowed by a grammar). `model_vocab_size`: the logits' width, which may
  // exceed the tokenizer's (tokens beyond it are never allowed).
  // `stop_token_ids`: the model's EOS ids, allowed once the grammar is
  // complete. INVALID_ARGUMENT when the tokenizer is wider than the model.
  static StatusOr<std::shared_ptr<GrammarCompiler>> Create(const text::Tokenizer& tokenizer, int64_t model_vocab_size,
                                                           std::span<const int64_t> stop_token_ids);
  // The same from each token's bytes ("": a special token, never allowed):
  // a synthetic vocabulary (the decode benchmark's, for a model without a
  // tokenizer).
  static StatusOr<std::shared_ptr<GrammarCompiler>> FromVocabulary(std::vector<std::string> token_bytes,
                                                                   int64_t model_vocab_size,
                                                                   std::span<const int64_t> stop_token_ids);
  // The same from the tokenizer of the model at `model_path` (what
  // text::Tokenizer::Load takes: a model YAML, a checkpoint directory).
  // NOT_FOUND when the model has no tokenizer.
  static StatusOr<std::shared_ptr<GrammarCompiler>> ForModel(const std::string& model_path, int64_t model_vocab_size,
                                                             std::span<const int64_t> stop_token_ids);
  ~GrammarCompiler();
  // False in a build without xgrammar: then every factory above returns
  // UNIMPLEMENTED saying so.
  static bool Available();

  // Whether `so` (active()) compiles, without the vocabulary's part of the
  // work (a parse, cheap): the errors Compile would return.
  Status Check(const StructuredOutput& so) const;
  // A fresh constraint for `so` (active()), at the start of its output.
  // INVALID_ARGUMENT naming the kind and xgrammar's reason for a schema,
  // regex or grammar that does not compile, or an empty choice list.
  StatusOr<std::unique_ptr<TokenConstraint>> Compile(const StructuredOutput& so);
  // Compile on one of the compiler's own threads (kCompileThreads), in the
  // order asked: a schema can take seconds to compile, so the step loop
  // never waits for one, and a flood of them queues instead of starting a
  // thread each. A compile whose `abandoned` is true when its turn comes is
  // skipped (its future then holds CANCELLED). Dropping the future never
  // blocks.
  using Compiled = StatusOr<std::unique_ptr<TokenConstraint>>;
  std::future<Compiled> CompileAsync(const StructuredOutput& so, std::shared_ptr<const std::atomic<bool>> abandoned);
  static constexpr int kCompileThreads = 2;
  static constexpr const char* kCompileThreadName = "mlarun-grammar";  // what top and /proc show

  int64_t vocab_size() const { return vocab_size_; }

 private:
  struct Impl;
  struct Pool;
  explicit GrammarCompiler(std::unique_ptr<Impl> impl, int64_t vocab_size);
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<Pool> pool_;  // started on the first CompileAsync
  int64_t vocab_size_;
};

// The EBNF grammar whose language is exactly `choices` (each a string
// literal, escaped): what Compile uses for StructuredOutput::kChoice.
std::string ChoiceGrammar(std::span<const std::string> choices);

}  // namespace mlarun
