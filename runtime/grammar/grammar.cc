#include "runtime/grammar/grammar.h"

#include <pthread.h>
#include <xgrammar/xgrammar.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <regex>
#include <thread>

namespace mlarun {
namespace {

std::atomic<int64_t> g_fills{0};
std::atomic<int64_t> g_fill_ns{0};

std::string_view KindName(StructuredOutput::Kind k) {
  switch (k) {
    case StructuredOutput::Kind::kNone:
      return "none";
    case StructuredOutput::Kind::kJsonObject:
      return "json_object";
    case StructuredOutput::Kind::kJsonSchema:
      return "json_schema";
    case StructuredOutput::Kind::kRegex:
      return "regex";
    case StructuredOutput::Kind::kChoice:
      return "choice";
    case StructuredOutput::Kind::kGrammar:
      return "grammar";
  }
  return "none";
}

// One request's place in its grammar. xgrammar's bitmask is int32 words,
// bit t % 32 of word t / 32 for token t: the layout TokenConstraint asks
// for, so the matcher fills the sampler's words directly.
class GrammarConstraint final : public TokenConstraint {
 public:
  // `banned`: tokens never allowed whatever the grammar says (a bit per
  // token as in FillAllowed), or nullptr.
  GrammarConstraint(const xgrammar::CompiledGrammar& compiled, int64_t vocab_size,
                    std::shared_ptr<const std::vector<uint32_t>> banned)
      : matcher_(compiled), vocab_size_(vocab_size), banned_(std::move(banned)) {}

  void FillAllowed(std::span<uint32_t> words) override {
    const auto start = std::chrono::steady_clock::now();
    std::fill(words.begin(), words.end(), 0u);
    const size_t own = static_cast<size_t>(xgrammar::GetBitmaskSize(static_cast<int>(vocab_size_)));
    // A row narrower or wider than the model's vocabulary (never in the
    // engine) goes through a buffer of the matcher's own size.
    const bool direct = words.size() == own;
    if (!direct) buffer_.assign(own, 0);
    int32_t* data = direct ? reinterpret_cast<int32_t*>(words.data()) : buffer_.data();
    if (!done()) {
      int64_t shape = static_cast<int64_t>(own);
      DLTensor t{};
      t.data = data;
      t.device = DLDevice{kDLCPU, 0};
      t.ndim = 1;
      t.dtype = xgrammar::GetBitmaskDLType();
      t.shape = &shape;
      try {
        matcher_.FillNextTokenBitmask(&t);
      } catch (const std::exception&) {
        std::fill(data, data + own, 0);  // nothing allowed: the row has no distribution
      }
    }
    if (!direct) std::copy_n(buffer_.begin(), std::min(own, words.size()), reinterpret_cast<int32_t*>(words.data()));
    if (banned_ != nullptr)
      for (size_t i = 0; i < std::min(words.size(), banned_->size()); ++i) words[i] &= ~(*banned_)[i];
    g_fills.fetch_add(1, std::memory_order_relaxed);
    g_fill_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
        std::memory_order_relaxed);
  }

  void Accept(int64_t token) override {
    if (done()) return;
    bool ok = false;
    try {
      ok = token >= 0 && token < vocab_size_ && matcher_.AcceptToken(static_cast<int32_t>(token));
    } catch (const std::exception&) {
    }
    if (!ok) refused_ = true;
  }

  bool terminated() const override { return done(); }

 private:
  bool done() const { return refused_ || matcher_.IsTerminated(); }

  xgrammar::GrammarMatcher matcher_;
  int64_t vocab_size_;
  std::shared_ptr<const std::vector<uint32_t>> banned_;
  bool refused_ = false;
  std::vector<int32_t> buffer_;
};

// The tokens holding a control byte (< 0x20), but for \t, \n and \r when
// `whitespace`: none can be part of JSON text, where a control character
// appears only escaped, or between values as whitespace. xgrammar 0.2.8's
// length-bounded JSON strings (maxLength, minLength) admit them raw.
std::vector<uint32_t> ControlByteTokens(const std::vector<std::string>& vocab, int64_t vocab_size, bool whitespace) {
  std::vector<uint32_t> words(static_cast<size_t>((vocab_size + 31) / 32), 0u);
  for (size_t id = 0; id < vocab.size(); ++id) {
    const bool control = std::any_of(vocab[id].begin(), vocab[id].end(), [&](char ch) {
      const auto c = static_cast<unsigned char>(ch);
      return c < 0x20 && !(whitespace && (c == '\t' || c == '\n' || c == '\r'));
    });
    if (control) words[id / 32] |= 1u << (id % 32);
  }
  return words;
}

}  // namespace

bool GrammarCompiler::Available() { return true; }

GrammarMaskStats GrammarMaskTotals() {
  return {.fills = g_fills.load(std::memory_order_relaxed),
          .seconds = static_cast<double>(g_fill_ns.load(std::memory_order_relaxed)) * 1e-9};
}

struct GrammarCompiler::Impl {
  xgrammar::TokenizerInfo info;
  xgrammar::GrammarCompiler compiler;
  // ControlByteTokens without and with whitespace: the JSON kinds' bans.
  std::shared_ptr<const std::vector<uint32_t>> json_banned, json_banned_whitespace;
};

// A fixed set of threads taking compiles in order. Its destructor ends the
// threads after the compile each is in; queued ones are dropped (their
// futures report a broken promise, read by nobody: the engine that asked is
// gone first).
struct GrammarCompiler::Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stopping = false;
  std::vector<std::thread> threads;

  explicit Pool(int n) {
    for (int i = 0; i < n; ++i)
      threads.emplace_back([this] {
        pthread_setname_np(pthread_self(), kCompileThreadName);
        Run();
      });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
      queue.clear();
    }
    cv.notify_all();
    for (std::thread& t : threads) t.join();
  }
  void Push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(task));
    }
    cv.notify_one();
  }
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [this] { return stopping || !queue.empty(); });
        if (stopping) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      task();
    }
  }
};

GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl, int64_t vocab_size)
    : impl_(std::move(impl)), vocab_size_(vocab_size) {}
// The pool first: its threads use impl_.
GrammarCompiler::~GrammarCompiler() { pool_.reset(); }

std::future<GrammarCompiler::Compiled> GrammarCompiler::CompileAsync(
    const StructuredOutput& so, std::shared_ptr<const std::atomic<bool>> abandoned) {
  auto promise = std::make_shared<std::promise<Compiled>>();
  std::future<Compiled> result = promise->get_future();
  {
    static std::mutex start_mu;  // one pool, however many engines ask first
    std::lock_guard<std::mutex> lock(start_mu);
    if (pool_ == nullptr) pool_ = std::make_unique<Pool>(kCompileThreads);
  }
  pool_->Push([this, so, abandoned = std::move(abandoned), promise] {
    if (abandoned != nullptr && abandoned->load()) {
      promise->set_value(
          Status(StatusCode::kCancelled, "structured output: the request ended before its grammar compiled"));
      return;
    }
    promise->set_value(Compile(so));
  });
  return result;
}

StatusOr<std::shared_ptr<GrammarCompiler>> GrammarCompiler::Create(const text::Tokenizer& tokenizer,
                                                                   int64_t model_vocab_size,
                                                                   std::span<const int64_t> stop_token_ids) {
  // Each token as the bytes it decodes to (xgrammar's RAW vocabulary).
  // Special tokens are "" (xgrammar's special tokens): never text a grammar
  // could match.
  const int64_t n = tokenizer.vocab_size();
  std::vector<std::string> vocab(static_cast<size_t>(n));
  for (int32_t id = 0; id < n; ++id)
    if (!tokenizer.IsSpecial(id) && tokenizer.IdToToken(id)) vocab[id] = tokenizer.TokenBytes(id, false);
  return FromVocabulary(vocab, model_vocab_size, stop_token_ids);
}

StatusOr<std::shared_ptr<GrammarCompiler>> GrammarCompiler::FromVocabulary(std::vector<std::string> vocab,
                                                                           int64_t model_vocab_size,
                                                                           std::span<const int64_t> stop_token_ids) {
  const int64_t n = static_cast<int64_t>(vocab.size());
  if (n > model_vocab_size)
    return InvalidArgumentError("structured output: the tokenizer's ", n, " tokens exceed the model's vocab_size ",
                                model_vocab_size);
  // The stop ids' text is never matched either.
  std::vector<int32_t> stops;
  for (int64_t id : stop_token_ids) {
    if (id < 0 || id >= model_vocab_size) continue;
    stops.push_back(static_cast<int32_t>(id));
    if (id < n) vocab[static_cast<size_t>(id)].clear();
  }
  try {
    xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, static_cast<int>(model_vocab_size), stops);
    auto impl = std::make_unique<Impl>(
        Impl{info, xgrammar::GrammarCompiler(info),
             std::make_shared<const std::vector<uint32_t>>(ControlByteTokens(vocab, model_vocab_size, false)),
             std::make_shared<const std::vector<uint32_t>>(ControlByteTokens(vocab, model_vocab_size, true))});
    return std::shared_ptr<GrammarCompiler>(new GrammarCompiler(std::move(impl), model_vocab_size));
  } catch (const std::exception& e) {
    return InvalidArgumentError("structured output: the vocabulary: ", e.what());
  }
}

StatusOr<std::shared_ptr<GrammarCompiler>> GrammarCompiler::ForModel(const std::string& model_path,
                                                                     int64_t model_vocab_size,
                                                                     std::span<const int64_t> stop_token_ids) {
  MLARUN_ASSIGN_OR_RETURN(auto tokenizer, text::Tokenizer::Load(model_path));
  return Create(*tokenizer, model_vocab_size, stop_token_ids);
}

namespace {

// xgrammar's reason, as Check and Compile report it: without the
// "[hh:mm:ss] /its/build/path/file.cc:83: " its log lines start with,
// which means nothing to a client.
Status CompileError(const StructuredOutput& so, const std::exception& e) {
  static const std::regex kLogPrefix(R"(^\[[0-9:]+\] [^ ]+:[0-9]+: )");
  std::string why = std::regex_replace(e.what(), kLogPrefix, "", std::regex_constants::format_first_only);
  while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
  return InvalidArgumentError("structured output: the ", KindName(so.kind), " does not compile: ", why);
}

}  // namespace

Status GrammarCompiler::Check(const StructuredOutput& so) const {
  if (so.kind == StructuredOutput::Kind::kChoice && so.choices.empty())
    return InvalidArgumentError("structured output: choice needs at least one choice");
  try {
    switch (so.kind) {
      case StructuredOutput::Kind::kNone:
        return InvalidArgumentError("structured output: no constraint to compile");
      case StructuredOutput::Kind::kJsonObject:
        break;
      case StructuredOutput::Kind::kJsonSchema:
        xgrammar::Grammar::FromJSONSchema(so.spec, so.any_whitespace);
        break;
      case StructuredOutput::Kind::kRegex:
        xgrammar::Grammar::FromRegex(so.spec);
        break;
      case StructuredOutput::Kind::kChoice:
        xgrammar::Grammar::FromEBNF(ChoiceGrammar(so.choices));
        break;
      case StructuredOutput::Kind::kGrammar:
        xgrammar::Grammar::FromEBNF(so.spec);
        break;
    }
  } catch (const std::exception& e) {
    return CompileError(so, e);
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<TokenConstraint>> GrammarCompiler::Compile(const StructuredOutput& so) {
  if (so.kind == StructuredOutput::Kind::kChoice && so.choices.empty())
    return InvalidArgumentError("structured output: choice needs at least one choice");
  try {
    std::optional<xgrammar::CompiledGrammar> compiled;
    xgrammar::GrammarCompiler& c = impl_->compiler;
    switch (so.kind) {
      case StructuredOutput::Kind::kNone:
        return InvalidArgumentError("structured output: no constraint to compile");
      case StructuredOutput::Kind::kJsonObject:
        compiled = c.CompileJSONSchema(R"({"type": "object"})", so.any_whitespace);
        break;
      case StructuredOutput::Kind::kJsonSchema:
        compiled = c.CompileJSONSchema(so.spec, so.any_whitespace);
        break;
      case StructuredOutput::Kind::kRegex:
        compiled = c.CompileRegex(so.spec);
        break;
      case StructuredOutput::Kind::kChoice:
        compiled = c.CompileGrammar(ChoiceGrammar(so.choices));
        break;
      case StructuredOutput::Kind::kGrammar:
        compiled = c.CompileGrammar(so.spec);
        break;
    }
    const bool json = so.kind == StructuredOutput::Kind::kJsonObject || so.kind == StructuredOutput::Kind::kJsonSchema;
    auto banned = !json ? nullptr : so.any_whitespace ? impl_->json_banned_whitespace : impl_->json_banned;
    return std::unique_ptr<TokenConstraint>(new GrammarConstraint(*compiled, vocab_size_, std::move(banned)));
  } catch (const std::exception& e) {
    return CompileError(so, e);
  }
}

}  // namespace mlarun
