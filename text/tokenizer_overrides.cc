// What the serving flags change of a loaded tokenizer (--chat-template), and
// vLLM's encoding of bad_words.
#include "text/tokenizer.h"

namespace mlarun::text {
namespace {

// Forwards everything to the tokenizer it wraps but the chat template.
class ChatTemplateOverride final : public Tokenizer {
 public:
  ChatTemplateOverride(std::shared_ptr<const Tokenizer> base, std::string chat_template)
      : base_(std::move(base)), chat_template_(std::move(chat_template)) {}
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override {
    return base_->Encode(text, add_special_tokens);
  }
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const override {
    return base_->Decode(ids, skip_special_tokens);
  }
  int64_t vocab_size() const override { return base_->vocab_size(); }
  std::optional<int32_t> TokenToId(std::string_view token) const override { return base_->TokenToId(token); }
  std::optional<std::string> IdToToken(int32_t id) const override { return base_->IdToToken(id); }
  bool IsSpecial(int32_t id) const override { return base_->IsSpecial(id); }
  std::optional<int32_t> bos_id() const override { return base_->bos_id(); }
  std::optional<int32_t> eos_id() const override { return base_->eos_id(); }
  const std::string& bos_token() const override { return base_->bos_token(); }
  const std::string& eos_token() const override { return base_->eos_token(); }
  const std::string& chat_template() const override { return chat_template_; }
  std::string TokenBytes(int32_t id, bool skip_special_tokens) const override {
    return base_->TokenBytes(id, skip_special_tokens);
  }

 private:
  const std::shared_ptr<const Tokenizer> base_;
  const std::string chat_template_;
};

class NoVocabulary final : public Tokenizer {
 public:
  std::vector<int32_t> Encode(std::string_view, bool) const override { return {}; }
  std::string Decode(std::span<const int32_t>, bool) const override { return ""; }
  int64_t vocab_size() const override { return 0; }
  std::optional<int32_t> TokenToId(std::string_view) const override { return std::nullopt; }
  std::optional<std::string> IdToToken(int32_t) const override { return std::nullopt; }
  bool IsSpecial(int32_t) const override { return false; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::optional<int32_t> eos_id() const override { return std::nullopt; }
  const std::string& bos_token() const override { return empty_; }
  const std::string& eos_token() const override { return empty_; }
  const std::string& chat_template() const override { return empty_; }
  std::string TokenBytes(int32_t, bool) const override { return ""; }

 private:
  const std::string empty_;
};

}  // namespace

std::shared_ptr<const Tokenizer> NoTokenizer() { return std::make_shared<NoVocabulary>(); }

std::shared_ptr<const Tokenizer> WithChatTemplate(std::shared_ptr<const Tokenizer> base, std::string chat_template) {
  return std::make_shared<ChatTemplateOverride>(std::move(base), std::move(chat_template));
}

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
