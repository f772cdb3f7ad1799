// The model's own tokenizer, read from a Hugging Face checkpoint's
// tokenizer.json (and tokenizer_config.json), producing exactly the ids the
// `tokenizers` package does for what DeepSeek-V2/V3-style checkpoints ship:
// byte-level BPE with merges, a pre-tokenizer Sequence of Split regexes
// (PCRE2: Unicode classes and lookahead) and ByteLevel, added and special
// tokens matched before pre-tokenization, the ByteLevel decoder and the
// normalizers those files use. Any other component is refused by Load with a
// message naming it.
//
// Part of the serving front end: no engine, model or gRPC here.
//
// Threading: a loaded Tokenizer is immutable; Encode and Decode may be called
// from any number of threads at once. The word cache is the tokenizer's,
// shared by the threads and at most 16 MiB however many they are; each
// thread that encodes keeps only PCRE2 match state and small scratch.
//
// What is supported and refused, and how the ids are checked against
// tokenizers: docs/tokenizer.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace mlarun::text {

class Tokenizer {
 public:
  // `path`: a checkpoint directory holding tokenizer.json (and, when present,
  // tokenizer_config.json); a directory holding only those files; or a model
  // YAML (configs/models/*.yaml) whose `tokenizer:` key names such a
  // directory relative to the YAML's own. NOT_FOUND when there is no
  // tokenizer.json there (the message says where it looked),
  // INVALID_ARGUMENT for a file that does not parse or uses an unsupported
  // component (named: "pre_tokenizer.pretokenizers[1].type 'Metaspace' is not
  // supported").
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  // The same from the files' contents; `tokenizer_config_json` may be empty.
  static StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view tokenizer_json,
                                                       std::string_view tokenizer_config_json);
  virtual ~Tokenizer() = default;

  // The ids of `text` as transformers' tokenizer(text,
  // add_special_tokens=...) gives them: with `add_special_tokens`, the
  // post-processor's tokens (bos when tokenizer_config.json's add_bos_token
  // or the TemplateProcessing of tokenizer.json asks for it; add_bos_token /
  // add_eos_token in the config replace the template, and a config naming
  // LlamaTokenizerFast without them means add_bos_token true, as
  // transformers 4.x has it). Text that is
  // not valid UTF-8 is first repaired as Python's bytes.decode("utf-8",
  // errors="replace") does (each maximal invalid subsequence becomes
  // U+FFFD), then encoded.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const = 0;
  // The text of `ids` as tokenizers' decode(ids, skip_special_tokens) gives
  // it: byte-level tokens to bytes, then bytes to UTF-8 with each maximal
  // invalid subsequence replaced by U+FFFD (Rust's from_utf8_lossy). Ids
  // outside the vocabulary are skipped (as tokenizers does).
  virtual std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const = 0;

  // Highest id (model vocabulary or added token) + 1.
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  // The vocabulary's string for an id (byte-level form, "Ġthe"); nullopt
  // outside the vocabulary.
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;
  // An added token marked special (skipped by skip_special_tokens).
  virtual bool IsSpecial(int32_t id) const = 0;

  // From tokenizer_config.json (bos_token / eos_token as a string or an
  // AddedToken object) and tokenizer.json's added tokens; nullopt/"" when
  // absent.
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
  virtual const std::string& bos_token() const = 0;
  virtual const std::string& eos_token() const = 0;
  // tokenizer_config.json's chat_template (the default one when it lists
  // several by name); "" when none.
  virtual const std::string& chat_template() const = 0;

  // The bytes `id` contributes to Decode's output before the UTF-8 repair
  // ("" for a skipped or unknown id): what IncrementalDecoder joins, and the
  // `bytes` of OpenAI's logprobs. The default, for tokenizers whose tokens
  // are whole characters, is Decode of the id alone.
  virtual std::string TokenBytes(int32_t id, bool skip_special_tokens) const;
};

// `base` with `chat_template` in place of its tokenizer_config.json's (the
// serving flag --chat-template); everything else is base's.
std::shared_ptr<const Tokenizer> WithChatTemplate(std::shared_ptr<const Tokenizer> base, std::string chat_template);

// A tokenizer without a vocabulary, for a server that has none
// (--skip-tokenizer-init): Encode gives no ids, Decode and TokenBytes no
// text, vocab_size 0, no special tokens and no chat template.
std::shared_ptr<const Tokenizer> NoTokenizer();

// vLLM's bad_words as token-id sequences (SamplingParams.bad_words): each
// word, its leading spaces stripped, is encoded without special tokens as
// is, and once more with one leading space when that encodes to as many
// tokens but starts with another one (so the word is refused both at the
// start of the text and after a space). Empty encodings are dropped.
std::vector<std::vector<int32_t>> EncodeBadWords(const Tokenizer& tokenizer, const std::vector<std::string>& words);

// Streaming detokenization: the text of a growing id sequence in deltas that
// never split a UTF-8 character. Add returns the text that became final with
// this token (possibly ""), holding back bytes of a character that is not
// complete yet; an incomplete sequence that can no longer complete becomes
// U+FFFD exactly where Decode would put it. Invariant, for any ids:
//   Add(ids[0]) + ... + Add(ids[n-1]) + Finish() == tokenizer.Decode(ids, skip)
// One per stream; not thread-safe. The tokenizer must outlive it.
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  std::string Add(int32_t id);
  // The end of the stream: what is still held (as U+FFFD where incomplete).
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  const bool skip_special_tokens_;
  std::string pending_;  // bytes not yet returned (an incomplete character)
};

// OpenAI's `stop` strings, matched on the detokenized text across token (and
// delta) boundaries. Add returns the part of the text that is safe to send
// now: it holds back a suffix that may be the start of a stop string. When a
// stop string appears, `stopped` is set, the text before it is returned and
// the stop string itself and everything after it never are. Not thread-safe.
class StopMatcher {
 public:
  // Empty strings in `stops` are ignored.
  explicit StopMatcher(std::vector<std::string> stops);
  struct Result {
    std::string text;      // to send now
    bool stopped = false;  // a stop string matched; nothing more will be returned
  };
  Result Add(std::string_view delta);
  // The end of the stream: what was held back, cut before the earliest stop
  // string in it if one is there (a match held back because a longer stop
  // string starting earlier could still have completed; stopped() then
  // turns true).
  std::string Finish();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace mlarun::text
