// GrammarCompiler in a build without xgrammar (scripts/install-deps could
// not fetch its sdist): every way to make one says so, so a worker starts
// with structured output off and logs why, and its requests asking for it
// are refused (Engine::Add).
#include "runtime/grammar/grammar.h"

namespace mlarun {
namespace {

Status Unavailable() {
  return UnimplementedError(
      "structured output: this build has no xgrammar (scripts/install-deps builds it into /opt/xgrammar; then "
      "rebuild)");
}

}  // namespace

struct GrammarCompiler::Impl {};
struct GrammarCompiler::Pool {};

GrammarMaskStats GrammarMaskTotals() { return {}; }

bool GrammarCompiler::Available() { return false; }

GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl, int64_t vocab_size)
    : impl_(std::move(impl)), vocab_size_(vocab_size) {}
GrammarCompiler::~GrammarCompiler() = default;

StatusOr<std::shared_ptr<GrammarCompiler>> GrammarCompiler::Create(const text::Tokenizer&, int64_t,
                                                                   std::span<const int64_t>) {
  return Unavailable();
}

StatusOr<std::shared_ptr<GrammarCompiler>> GrammarCompiler::FromVocabulary(std::vector<std::string>, int64_t,
                                                                           std::span<const int64_t>) {
  return Unavailable();
}

StatusOr<std::shared_ptr<GrammarCompiler>> GrammarCompiler::ForModel(const std::string&, int64_t,
                                                                     std::span<const int64_t>) {
  return Unavailable();
}

Status GrammarCompiler::Check(const StructuredOutput&) const { return Unavailable(); }

StatusOr<std::unique_ptr<TokenConstraint>> GrammarCompiler::Compile(const StructuredOutput&) { return Unavailable(); }

std::future<GrammarCompiler::Compiled> GrammarCompiler::CompileAsync(const StructuredOutput&,
                                                                     std::shared_ptr<const std::atomic<bool>>) {
  std::promise<Compiled> p;
  p.set_value(Unavailable());
  return p.get_future();
}

}  // namespace mlarun
