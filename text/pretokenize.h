// The pre-tokenizer of the tokenizer: tokenizers' Split (a regex or a
// literal string; behaviors Isolated, Removed, MergedWithPrevious,
// MergedWithNext, Contiguous; invert) and ByteLevel (add_prefix_space;
// use_regex: GPT-2's pattern), alone or in a Sequence whose last step is the
// ByteLevel one.
//
// Regexes: tokenizers compiles its patterns with Oniguruma (Ruby syntax,
// UTF-8); here they are compiled by PCRE2 with PCRE2_UTF | PCRE2_UCP and JIT.
// What differs between the two for these patterns is bridged when compiling:
//  * `\s` / `\S` outside a class: Oniguruma's \s is Unicode White_Space,
//    PCRE2's also takes U+180E, so it becomes [^\S\x{180E}] / [\S\x{180E}];
//  * `^` and `$` are line anchors in Ruby syntax: PCRE2_MULTILINE.
//  * Unicode classes (\p{L}, \P{N}, \pL, ...): tokenizers' Oniguruma has
//    Unicode 16.0's tables, Debian 12's PCRE2 Unicode 14.0's, so each class
//    gains the code points 15.0 to 16.0 assigned to it (and loses the few
//    that moved): text/unicode_delta.inc, made by scripts/gen-unicode-delta.
//    Inside a bracket class only the additions apply (\P{..} there, and the
//    removals from Mn and C/Cn, keep PCRE2's tables).
//
// Thread-safe after Init: the match data and JIT stack are per thread, and
// so is scratch, released after an input that grew it past 64 KiB.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace mlarun::text {

class Regex {
 public:
  // `pattern` in tokenizers' (Oniguruma) syntax, or a literal when `literal`.
  // INVALID_ARGUMENT naming `path` and PCRE2's message when it does not
  // compile.
  static StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal, const std::string& path);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls f(start, end) for each non-empty match in `s` from left to right
  // (after an empty match the search goes on one character later).
  // REQUIRES: s is valid UTF-8.
  template <typename F>
  void ForEachMatch(std::string_view s, F&& f) const {
    size_t pos = 0;
    size_t start, end;
    while (pos <= s.size() && Find(s, pos, &start, &end)) {
      if (end > start) {
        f(start, end);
        pos = end;
      } else {
        pos = start + 1;
        while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
      }
    }
  }

 private:
  Regex() = default;
  bool Find(std::string_view s, size_t from, size_t* start, size_t* end) const;
  void* code_ = nullptr;  // pcre2_code_8
  bool jit_ = false;
};

class PreTokenizer {
 public:
  PreTokenizer();
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // tokenizer.json's pre_tokenizer (null: the text is one piece).
  // INVALID_ARGUMENT naming the path of an unsupported step or option.
  Status Init(const nlohmann::json& j, const std::string& path);

  // Calls emit(piece) for each non-empty piece of `text` in order; a piece
  // may live in per-thread storage (ByteLevel's prefix space) and is valid
  // during the call only.
  void Run(std::string_view text, const std::function<void(std::string_view)>& emit) const;

 private:
  static constexpr size_t kMaxSteps = 16;
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  struct Step {
    std::unique_ptr<Regex> regex;
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
  };
  Status AddStep(const nlohmann::json& j, const std::string& path, bool last);
  // Adds ByteLevel's prefix space where it applies, then RunStep.
  void RunFrom(size_t step, std::string_view text, const std::function<void(std::string_view)>& emit) const;
  void RunStep(size_t step, std::string_view text, const std::function<void(std::string_view)>& emit) const;

  std::vector<Step> steps_;  // the Split steps, then ByteLevel's regex if use_regex
  bool byte_level_ = false;
  bool add_prefix_space_ = false;
  size_t prefix_step_ = 0;  // index in steps_ before which the prefix space is added
};

}  // namespace mlarun::text
