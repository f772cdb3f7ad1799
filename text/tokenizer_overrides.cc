// vLLM's encoding of bad_words.
#include "text/tokenizer.h"

namespace mlarun::text {

std::vector<std::vector<int32_t>> EncodeBadWords(const Tokenizer& tokenizer, const std::vector<std::string>& words) {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& word : words) {
    std::string_view bare = word;
    while (!bare.empty() && (bare.front() == ' ' || bare.front() == '\t' || bare.front() == '\n' ||
                             bare.front() == '\r' || bare.front() == '\v' || bare.front() == '\f'))
      bare.remove_prefix(1);
    std::vector<int32_t> plain = tokenizer.Encode(bare, /*add_special_tokens=*/false);
    if (plain.empty()) continue;
    // As vLLM's: the spaced form only when it is another word token of the
    // same length (a tokenizer that adds the prefix space itself gives the
    // same ids twice otherwise).
    std::vector<int32_t> spaced = tokenizer.Encode(" " + std::string(bare), /*add_special_tokens=*/false);
    out.push_back(std::move(plain));
    if (!spaced.empty() && spaced.size() == out.back().size() && spaced.front() != out.back().front())
      out.push_back(std::move(spaced));
  }
  return out;
}

}  // namespace mlarun::text
