// IncrementalDecoder (tokenizer.h).
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace mlarun::text {

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDecoder::Add(int32_t id) {
  pending_ += tokenizer_.TokenBytes(id, skip_special_tokens_);
  // Everything up to a trailing sequence that may still complete is final:
  // its repair cannot change, and it ends where Decode's repair of the whole
  // sequence has a character boundary.
  const size_t final_len = utf8::FinalPrefixLength(pending_);
  if (final_len == 0) return "";
  std::string out;
  utf8::AppendLossy(std::string_view(pending_).substr(0, final_len), &out);
  pending_.erase(0, final_len);
  return out;
}

std::string IncrementalDecoder::Finish() {
  std::string out = utf8::Lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace mlarun::text
