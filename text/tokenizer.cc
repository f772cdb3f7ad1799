// Tokenizer::Load and the byte-level BPE tokenizer behind it.
//
// Encode follows the order of Hugging Face tokenizers' TokenizerImpl:
//   1. invalid UTF-8 repaired (Python's errors="replace"),
//   2. added tokens with normalized=false split out of the raw text,
//   3. the normalizer (only identities are supported) and the added tokens
//      with normalized=true split out of what is left,
//   4. the pre-tokenizer steps (Split regexes, then ByteLevel),
//   5. BPE on each piece's byte-level form (the shared word cache first),
//   6. the post-processor's special tokens.
// Decode maps each id to its token, each token to bytes (ByteLevel decoder),
// and repairs the result as from_utf8_lossy does.

#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "base/file.h"
#include "text/bpe.h"
#include "text/pretokenize.h"
#include "text/scratch.h"
#include "text/utf8.h"

namespace mlarun::text {

std::string Tokenizer::TokenBytes(int32_t id, bool skip_special_tokens) const {
  return Decode(std::span<const int32_t>(&id, 1), skip_special_tokens);
}

namespace {

using nlohmann::json;

std::string TypeOf(const json& j) {
  if (!j.is_object()) return "";
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

Status Unsupported(const std::string& path, const std::string& what) {
  return InvalidArgumentError(path, " '", what, "' is not supported");
}

bool IsNullOrEmpty(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty());
}

bool BoolOr(const json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : dflt;
}

// One added token of tokenizer.json's added_tokens.
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Leftmost-longest matching of a set of strings (what tokenizers'
// aho-corasick with MatchKind::LeftmostLongest reports): a byte trie walked
// from each position, the longest string starting at the first position
// where any does.
class TokenTrie {
 public:
  void Add(std::string_view s, int32_t value) {
    if (s.empty()) return;
    int32_t node = 0;
    for (unsigned char c : s) {
      int32_t next = Child(node, c);
      if (next < 0) {
        next = int32_t(nodes_.size());
        nodes_.emplace_back();
        nodes_[node].children.emplace_back(c, next);
      }
      node = next;
    }
    nodes_[node].value = value;
    first_[static_cast<unsigned char>(s[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The next match at or after `from`: its start, length and value; false
  // when there is none.
  bool Find(std::string_view s, size_t from, size_t* start, size_t* len, int32_t* value) const {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    for (size_t i = from; i < s.size(); ++i) {
      if (!first_[p[i]]) continue;
      int32_t node = 0;
      int32_t best = -1;
      size_t best_len = 0;
      for (size_t j = i; j < s.size(); ++j) {
        node = Child(node, p[j]);
        if (node < 0) break;
        if (nodes_[node].value >= 0) {
          best = nodes_[node].value;
          best_len = j - i + 1;
        }
      }
      if (best >= 0) {
        *start = i;
        *len = best_len;
        *value = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t value = -1;
  };
  int32_t Child(int32_t node, unsigned char c) const {
    for (const auto& [k, v] : nodes_[node].children)
      if (k == c) return v;
    return -1;
  }
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_{};
};

// A piece of the input: text still to tokenize (added < 0) or an added token.
struct Segment {
  size_t begin, end;
  int32_t added;  // index into added_, or -1
};

// `\w` as Rust's regex crate has it, near enough for single_word: letters,
// marks, digits and connector punctuation.
bool IsWordChar(char32_t cp) {
  static const Regex* word = [] {
    auto r = Regex::Compile(R"(^[\p{L}\p{M}\p{Nd}\p{Pc}]$)", false, "word");
    return r.ok() ? r->release() : nullptr;
  }();
  std::string s;
  utf8::Append(cp, &s);
  bool found = false;
  if (word != nullptr) word->ForEachMatch(s, [&](size_t, size_t) { found = true; });
  return found;
}

class BpeTokenizer final : public Tokenizer {
 public:
  static StatusOr<std::unique_ptr<Tokenizer>> Create(std::string_view tokenizer_json, std::string_view config_json);

  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override;
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> TokenToId(std::string_view token) const override;
  std::optional<std::string> IdToToken(int32_t id) const override;
  bool IsSpecial(int32_t id) const override { return id >= 0 && size_t(id) < special_.size() && special_[id]; }
  std::optional<int32_t> bos_id() const override { return bos_id_; }
  std::optional<int32_t> eos_id() const override { return eos_id_; }
  const std::string& bos_token() const override { return bos_token_; }
  const std::string& eos_token() const override { return eos_token_; }
  const std::string& chat_template() const override { return chat_template_; }

 private:
  std::string TokenBytes(int32_t id, bool skip_special_tokens) const override;

  Status ParseAddedTokens(const json& j);
  Status ParseNormalizer(const json& j, const std::string& path);
  Status ParsePostProcessor(const json& j, const std::string& path);
  Status ParseDecoder(const json& j, const std::string& path);
  Status ParseConfig(std::string_view config_json);

  // Splits text[begin, end) around the matches of `trie`, as AddedVocabulary's
  // find_matches does (single_word, lstrip and rstrip applied).
  void SplitAdded(std::string_view text, size_t begin, size_t end, const TokenTrie& trie,
                  std::vector<Segment>* out) const;
  void EncodeText(std::string_view text, std::vector<int32_t>* ids) const;

  // Constant after construction.
  Bpe bpe_;
  PreTokenizer pre_tokenizer_;
  std::vector<AddedToken> added_;
  TokenTrie raw_trie_;         // added tokens with normalized=false
  TokenTrie normalized_trie_;  // added tokens with normalized=true
  std::unordered_map<std::string, int32_t> added_by_content_;
  std::vector<std::string> tokens_;       // id -> token string ("" for a hole)
  std::vector<std::string> token_bytes_;  // id -> what the ByteLevel decoder makes of it
  std::vector<bool> present_;             // id -> in the vocabulary or the added tokens
  std::vector<bool> special_;
  int64_t vocab_size_ = 0;
  // The post-processor's single template for add_special_tokens: ids before
  // and after the sequence.
  std::vector<int32_t> prefix_ids_, suffix_ids_;
  std::optional<int32_t> bos_id_, eos_id_;
  std::string bos_token_, eos_token_, chat_template_;
};

Status BpeTokenizer::ParseAddedTokens(const json& j) {
  auto it = j.find("added_tokens");
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_array()) return InvalidArgumentError("added_tokens is not an array");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
        !t["content"].is_string())
      return InvalidArgumentError(path, " needs an integer id and a string content");
    AddedToken a;
    a.id = t["id"].get<int32_t>();
    if (a.id < 0) return InvalidArgumentError(path, ".id is negative");
    a.content = t["content"].get<std::string>();
    a.single_word = BoolOr(t, "single_word", false);
    a.lstrip = BoolOr(t, "lstrip", false);
    a.rstrip = BoolOr(t, "rstrip", false);
    a.special = BoolOr(t, "special", false);
    a.normalized = BoolOr(t, "normalized", !a.special);
    added_.push_back(std::move(a));
  }
  return Status::Ok();
}

Status BpeTokenizer::ParseNormalizer(const json& j, const std::string& path) {
  if (j.is_null()) return Status::Ok();
  const std::string type = TypeOf(j);
  if (type == "Sequence") {
    auto it = j.find("normalizers");
    if (it == j.end() || !it->is_array()) return InvalidArgumentError(path, ".normalizers is not an array");
    for (size_t i = 0; i < it->size(); ++i)
      MLARUN_RETURN_IF_ERROR(ParseNormalizer((*it)[i], path + ".normalizers[" + std::to_string(i) + "]"));
    return Status::Ok();
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD")
    return InvalidArgumentError(path, ".type '", type,
                                "' is not supported (Unicode normalization is not implemented; only a null "
                                "normalizer or an empty Sequence is)");
  return Unsupported(path + ".type", type.empty() ? j.dump() : type);
}

Status BpeTokenizer::ParsePostProcessor(const json& j, const std::string& path) {
  if (j.is_null()) return Status::Ok();
  const std::string type = TypeOf(j);
  if (type == "ByteLevel") return Status::Ok();  // offsets only
  if (type == "Sequence") {
    auto it = j.find("processors");
    if (it == j.end() || !it->is_array()) return InvalidArgumentError(path, ".processors is not an array");
    for (size_t i = 0; i < it->size(); ++i)
      MLARUN_RETURN_IF_ERROR(ParsePostProcessor((*it)[i], path + ".processors[" + std::to_string(i) + "]"));
    return Status::Ok();
  }
  if (type != "TemplateProcessing") return Unsupported(path + ".type", type);
  auto single = j.find("single");
  if (single == j.end() || !single->is_array()) return InvalidArgumentError(path, ".single is not an array");
  const json specials = j.value("special_tokens", json::object());
  bool seen_sequence = false;
  prefix_ids_.clear();
  suffix_ids_.clear();
  for (size_t i = 0; i < single->size(); ++i) {
    const json& item = (*single)[i];
    const std::string ipath = path + ".single[" + std::to_string(i) + "]";
    if (item.contains("Sequence")) {
      if (item["Sequence"].value("id", "") != "A") return InvalidArgumentError(ipath, ": only sequence A is supported");
      if (seen_sequence) return InvalidArgumentError(ipath, ": sequence A appears twice");
      seen_sequence = true;
    } else if (item.contains("SpecialToken")) {
      const std::string name = item["SpecialToken"].value("id", "");
      auto sp = specials.find(name);
      if (sp == specials.end() || !sp->contains("ids") || !(*sp)["ids"].is_array())
        return InvalidArgumentError(ipath, ": special token '", name, "' is not in special_tokens");
      for (const json& id : (*sp)["ids"]) (seen_sequence ? suffix_ids_ : prefix_ids_).push_back(id.get<int32_t>());
    } else {
      return InvalidArgumentError(ipath, " is neither a Sequence nor a SpecialToken");
    }
  }
  if (!seen_sequence) return InvalidArgumentError(path, ".single has no sequence A");
  return Status::Ok();
}

Status BpeTokenizer::ParseDecoder(const json& j, const std::string& path) {
  const std::string type = TypeOf(j);
  if (type == "ByteLevel") return Status::Ok();
  if (type == "Sequence") {
    auto it = j.find("decoders");
    if (it == j.end() || !it->is_array() || it->size() != 1)
      return InvalidArgumentError(path, ": only a Sequence of one ByteLevel decoder is supported");
    return ParseDecoder((*it)[0], path + ".decoders[0]");
  }
  return Unsupported(path + ".type", j.is_null() ? "null" : type);
}

// bos_token / eos_token in tokenizer_config.json: a string or an AddedToken.
std::string TokenString(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"].get<std::string>();
  return "";
}

Status BpeTokenizer::ParseConfig(std::string_view config_json) {
  if (config_json.empty()) return Status::Ok();
  json c = json::parse(config_json, nullptr, false);
  if (c.is_discarded() || !c.is_object())
    return InvalidArgumentError("tokenizer_config.json does not parse as a JSON object");
  if (c.contains("bos_token")) bos_token_ = TokenString(c["bos_token"]);
  if (c.contains("eos_token")) eos_token_ = TokenString(c["eos_token"]);
  if (auto it = c.find("chat_template"); it != c.end()) {
    if (it->is_string()) {
      chat_template_ = it->get<std::string>();
    } else if (it->is_array()) {
      // Named templates: transformers' default is the one named "default".
      for (const json& t : *it)
        if (t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
          chat_template_ = t["template"].get<std::string>();
    }
  }
  // transformers (tokenization_utils_tokenizers.py, update_post_processor):
  // add_bos_token / add_eos_token given in the config replace the
  // post-processor by a template of bos + $A + eos; LlamaTokenizerFast
  // defaults add_bos_token to true.
  const std::string cls = c.value("tokenizer_class", "");
  const bool llama = cls == "LlamaTokenizerFast" || cls == "LlamaTokenizer";
  const bool explicit_flags = c.contains("add_bos_token") || c.contains("add_eos_token");
  if (explicit_flags || llama) {
    const bool add_bos = BoolOr(c, "add_bos_token", llama);
    const bool add_eos = BoolOr(c, "add_eos_token", false);
    prefix_ids_.clear();
    suffix_ids_.clear();
    if (add_bos && !bos_token_.empty()) {
      auto id = TokenToId(bos_token_);
      if (!id)
        return InvalidArgumentError("tokenizer_config.json: bos_token '", bos_token_, "' is not in the vocabulary");
      prefix_ids_.push_back(*id);
    }
    if (add_eos && !eos_token_.empty()) {
      auto id = TokenToId(eos_token_);
      if (!id)
        return InvalidArgumentError("tokenizer_config.json: eos_token '", eos_token_, "' is not in the vocabulary");
      suffix_ids_.push_back(*id);
    }
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<Tokenizer>> BpeTokenizer::Create(std::string_view tokenizer_json,
                                                          std::string_view config_json) {
  json j = json::parse(tokenizer_json, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgumentError("tokenizer.json does not parse as a JSON object");
  auto t = std::make_unique<BpeTokenizer>();

  if (j.contains("truncation") && !j["truncation"].is_null()) return Unsupported("truncation", j["truncation"].dump());
  if (j.contains("padding") && !j["padding"].is_null()) return Unsupported("padding", j["padding"].dump());

  // model
  if (!j.contains("model") || !j["model"].is_object()) return InvalidArgumentError("tokenizer.json has no model");
  const json& m = j["model"];
  const std::string mtype = TypeOf(m).empty() && m.contains("merges") ? "BPE" : TypeOf(m);
  if (mtype != "BPE") return Unsupported("model.type", mtype);
  if (m.contains("dropout") && !m["dropout"].is_null()) return Unsupported("model.dropout", m["dropout"].dump());
  if (BoolOr(m, "byte_fallback", false)) return Unsupported("model.byte_fallback", "true");
  if (!IsNullOrEmpty(m, "continuing_subword_prefix"))
    return Unsupported("model.continuing_subword_prefix", m["continuing_subword_prefix"].dump());
  if (!IsNullOrEmpty(m, "end_of_word_suffix"))
    return Unsupported("model.end_of_word_suffix", m["end_of_word_suffix"].dump());
  if (!m.contains("vocab") || !m["vocab"].is_object()) return InvalidArgumentError("model.vocab is not an object");

  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(m["vocab"].size());
  for (const auto& [k, v] : m["vocab"].items()) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
      return InvalidArgumentError("model.vocab['", k, "'] is not a valid id");
    vocab.emplace_back(k, v.get<int32_t>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  if (auto it = m.find("merges"); it != m.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgumentError("model.merges is not an array");
    merges.reserve(it->size());
    for (size_t i = 0; i < it->size(); ++i) {
      const json& mg = (*it)[i];
      if (mg.is_string()) {
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) return InvalidArgumentError("model.merges[", i, "] '", s, "' is not 'a b'");
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
        merges.emplace_back(mg[0].get<std::string>(), mg[1].get<std::string>());
      } else {
        return InvalidArgumentError("model.merges[", i, "] is neither 'a b' nor [a, b]");
      }
    }
  }
  std::optional<std::string> unk;
  if (!IsNullOrEmpty(m, "unk_token")) unk = m["unk_token"].get<std::string>();
  MLARUN_RETURN_IF_ERROR(t->bpe_.Init(vocab, merges, BoolOr(m, "ignore_merges", false), unk));

  // pre_tokenizer
  MLARUN_RETURN_IF_ERROR(t->pre_tokenizer_.Init(j.value("pre_tokenizer", json()), "pre_tokenizer"));

  MLARUN_RETURN_IF_ERROR(t->ParseNormalizer(j.value("normalizer", json()), "normalizer"));
  MLARUN_RETURN_IF_ERROR(t->ParseAddedTokens(j));
  MLARUN_RETURN_IF_ERROR(t->ParsePostProcessor(j.value("post_processor", json()), "post_processor"));
  MLARUN_RETURN_IF_ERROR(t->ParseDecoder(j.value("decoder", json()), "decoder"));

  // The id tables: model vocabulary, then added tokens (which win on decode,
  // as AddedVocabulary's id_to_token is asked first).
  int64_t max_id = -1;
  for (const auto& [s, id] : vocab) max_id = std::max<int64_t>(max_id, id);
  for (const auto& a : t->added_) max_id = std::max<int64_t>(max_id, a.id);
  t->vocab_size_ = max_id + 1;
  t->tokens_.assign(t->vocab_size_, "");
  t->present_.assign(t->vocab_size_, false);
  t->special_.assign(t->vocab_size_, false);
  for (const auto& [s, id] : vocab) {
    t->tokens_[id] = s;
    t->present_[id] = true;
  }
  for (size_t i = 0; i < t->added_.size(); ++i) {
    const AddedToken& a = t->added_[i];
    t->tokens_[a.id] = a.content;
    t->present_[a.id] = true;
    t->special_[a.id] = a.special;
    t->added_by_content_[a.content] = a.id;
    (a.normalized ? t->normalized_trie_ : t->raw_trie_).Add(a.content, int32_t(i));
  }
  t->token_bytes_.resize(t->vocab_size_);
  for (int64_t id = 0; id < t->vocab_size_; ++id) t->token_bytes_[id] = ByteLevelDecode(t->tokens_[id]);

  MLARUN_RETURN_IF_ERROR(t->ParseConfig(config_json));
  if (!t->bos_token_.empty()) t->bos_id_ = t->TokenToId(t->bos_token_);
  if (!t->eos_token_.empty()) t->eos_id_ = t->TokenToId(t->eos_token_);
  return std::unique_ptr<Tokenizer>(std::move(t));
}

std::optional<int32_t> BpeTokenizer::TokenToId(std::string_view token) const {
  if (auto it = added_by_content_.find(std::string(token)); it != added_by_content_.end()) return it->second;
  return bpe_.TokenToId(token);
}

std::optional<std::string> BpeTokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= vocab_size_ || !present_[id]) return std::nullopt;
  return tokens_[id];
}

void BpeTokenizer::SplitAdded(std::string_view text, size_t begin, size_t end, const TokenTrie& trie,
                              std::vector<Segment>* out) const {
  if (trie.empty()) {
    out->push_back({begin, end, -1});
    return;
  }
  const std::string_view s = text.substr(0, end);
  size_t start_offset = begin;
  size_t pos = begin;
  size_t mstart, mlen;
  int32_t idx;
  while (trie.Find(s, pos, &mstart, &mlen, &idx)) {
    size_t start = mstart;
    size_t stop = mstart + mlen;
    pos = stop;
    const AddedToken& a = added_[idx];
    if (a.single_word) {
      bool start_space = start == begin;
      if (!start_space) {
        size_t e = start;
        start_space = !IsWordChar(utf8::Prev(s, &e));
      }
      bool stop_space = stop == end;
      if (!stop_space) {
        size_t i = stop;
        stop_space = !IsWordChar(utf8::Next(s, &i));
      }
      if (!start_space || !stop_space) continue;
    }
    if (a.lstrip) {
      size_t e = start;
      while (e > begin) {
        size_t p = e;
        if (!utf8::IsWhiteSpace(utf8::Prev(s, &p))) break;
        e = p;
      }
      start = std::max(e, start_offset);
    }
    if (a.rstrip) {
      while (stop < end) {
        size_t i = stop;
        if (!utf8::IsWhiteSpace(utf8::Next(s, &i))) break;
        stop = i;
      }
    }
    if (start_offset < start) out->push_back({start_offset, start, -1});
    out->push_back({start, stop, idx});
    start_offset = stop;
    pos = std::max(pos, stop);
  }
  if (start_offset < end) out->push_back({start_offset, end, -1});
}

void BpeTokenizer::EncodeText(std::string_view text, std::vector<int32_t>* ids) const {
  // Reused per thread: no allocation per call once warm.
  thread_local std::vector<Segment> first, second;
  ReleaseIfLargeOnExit release_first(first);
  ReleaseIfLargeOnExit release_second(second);
  first.clear();
  second.clear();
  SplitAdded(text, 0, text.size(), raw_trie_, &first);
  for (const Segment& seg : first) {
    if (seg.added >= 0) {
      second.push_back(seg);
      continue;
    }
    SplitAdded(text, seg.begin, seg.end, normalized_trie_, &second);
  }
  for (const Segment& seg : second) {
    if (seg.added >= 0) {
      ids->push_back(added_[seg.added].id);
      continue;
    }
    pre_tokenizer_.Run(text.substr(seg.begin, seg.end - seg.begin),
                       [&](std::string_view piece) { bpe_.EncodeWord(piece, ids); });
  }
}

std::vector<int32_t> BpeTokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
  if (utf8::IsValid(text)) {
    EncodeText(text, &ids);
  } else {
    EncodeText(utf8::Lossy(text), &ids);
  }
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

std::string BpeTokenizer::TokenBytes(int32_t id, bool skip_special_tokens) const {
  if (id < 0 || id >= vocab_size_ || !present_[id]) return "";
  if (skip_special_tokens && special_[id]) return "";
  return token_bytes_[id];
}

std::string BpeTokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size_ || !present_[id]) continue;
    if (skip_special_tokens && special_[id]) continue;
    bytes += token_bytes_[id];
  }
  if (utf8::IsValid(bytes)) return bytes;
  return utf8::Lossy(bytes);
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view tokenizer_json,
                                                         std::string_view tokenizer_config_json) {
  return BpeTokenizer::Create(tokenizer_json, tokenizer_config_json);
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path dir = path;
  if (!fs::exists(path, ec)) return NotFoundError(path, ": no such file or directory");
  if (fs::is_regular_file(path, ec)) {
    const std::string ext = fs::path(path).extension().string();
    if (ext == ".yaml" || ext == ".yml") {
      YAML::Node root;
      try {
        root = YAML::LoadFile(path);
      } catch (const std::exception& e) {
        return InvalidArgumentError(path, ": ", e.what());
      }
      if (!root.IsMap() || !root["tokenizer"] || !root["tokenizer"].IsScalar())
        return NotFoundError(path, " has no tokenizer: key naming the directory of its tokenizer.json");
      dir = fs::path(path).parent_path() / root["tokenizer"].as<std::string>();
    } else {
      dir = fs::path(path).parent_path();  // tokenizer.json itself
    }
  }
  const fs::path json_path = dir / "tokenizer.json";
  if (!fs::is_regular_file(json_path, ec)) {
    if (dir.string() == path)
      return NotFoundError(path, ": not a model YAML, checkpoint or tokenizer directory (it has no tokenizer.json)");
    return NotFoundError("no tokenizer.json at ", json_path.string());
  }
  auto tok = ReadFileToString(json_path.string());
  if (!tok.ok()) return tok.status();
  std::string config;
  const fs::path config_path = dir / "tokenizer_config.json";
  if (fs::is_regular_file(config_path, ec)) {
    auto c = ReadFileToString(config_path.string());
    if (!c.ok()) return c.status();
    config = std::move(*c);
  }
  auto t = FromJson(*tok, config);
  if (!t.ok()) return t.status().WithContext(json_path.string());
  return t;
}

}  // namespace mlarun::text
