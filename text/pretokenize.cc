#include "text/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>

#include "text/scratch.h"

namespace mlarun::text {
namespace {

using nlohmann::json;

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Per general category, what Unicode 15.0 to 16.0 assigned or moved
// (tokenizers' Oniguruma has those tables, Debian's PCRE2 Unicode 14.0's):
// PCRE2 class fragments to add to and remove from \p{cls}.
struct UnicodeDelta {
  std::string_view cls, add, remove;
};
constexpr UnicodeDelta kUnicodeDelta[] = {
#include "text/unicode_delta.inc"
};

const UnicodeDelta* DeltaOf(std::string_view cls) {
  for (const UnicodeDelta& d : kUnicodeDelta)
    if (d.cls == cls) return &d;
  return nullptr;
}

// A \p / \P property at p[i] (\pL or \p{L}): its name and length, or 0.
size_t PropertyAt(std::string_view p, size_t i, std::string_view* name) {
  if (i + 2 >= p.size() || (p[i + 1] != 'p' && p[i + 1] != 'P')) return 0;
  if (p[i + 2] != '{') {
    *name = p.substr(i + 2, 1);
    return 3;
  }
  const size_t close = p.find('}', i + 3);
  if (close == std::string_view::npos) return 0;
  *name = p.substr(i + 3, close - i - 3);
  return close - i + 1;
}

// \p{cls} with the newer tables: inside a class its additions join it
// (removals cannot be said there; only Mn and C/Cn have any); outside, one
// character that is in the newer class.
std::string Property(std::string_view original, bool negated, const UnicodeDelta& d, bool in_class) {
  const std::string add(d.add), remove(d.remove);
  if (in_class) return negated || add.empty() ? std::string(original) : std::string(original) + add;
  if (!negated) {
    const std::string cls = "[" + std::string(original) + add + "]";
    return remove.empty() ? cls : "(?:(?![" + remove + "])" + cls + ")";
  }
  const std::string cls = "[" + std::string(original) + remove + "]";
  return add.empty() ? cls : "(?:(?![" + add + "])" + cls + ")";
}

// tokenizers' patterns in PCRE2 terms (see the header): Oniguruma's \s and
// \S outside classes, and \p{..} with Oniguruma's Unicode tables.
std::string TranslatePattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  int class_depth = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      std::string_view name;
      if (class_depth == 0 && n == 's') {
        out += "[^\\S\\x{180E}]";
      } else if (class_depth == 0 && n == 'S') {
        out += "[\\S\\x{180E}]";
      } else if (const size_t len = PropertyAt(p, i, &name); len > 0 && DeltaOf(name) != nullptr) {
        out += Property(p.substr(i, len), n == 'P', *DeltaOf(name), class_depth > 0);
        i += len - 1;
        continue;
      } else {
        out += c;
        out += n;
      }
      ++i;
      continue;
    }
    if (c == '[') {
      ++class_depth;
      out += c;
      // A ']' right after '[' or '[^' is a literal in both syntaxes.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == ']' && class_depth > 0) --class_depth;
    out += c;
  }
  return out;
}

// Per-thread PCRE2 state shared by every Regex: one pair of offsets is all a
// match needs here; the JIT stack grows up to 8 MiB for long inputs.
struct MatchState {
  pcre2_match_data* data;
  pcre2_match_context* context;
  pcre2_jit_stack* stack;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchState& State() {
  thread_local MatchState state;
  return state;
}

Status Unsupported(const std::string& path, const std::string& what) {
  return InvalidArgumentError(path, " '", what, "' is not supported");
}

}  // namespace

StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern, bool literal, const std::string& path) {
  const std::string translated = literal ? std::string(pattern) : TranslatePattern(pattern);
  // PCRE2_LITERAL admits only a few other options (UCP and MULTILINE are
  // not among them, and a literal needs neither).
  const uint32_t options = PCRE2_UTF | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : PCRE2_UCP | PCRE2_MULTILINE);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), options, &error,
                                   &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(error, msg, sizeof(msg));
    return InvalidArgumentError(path, ": the pattern does not compile at offset ", offset, ": ",
                                reinterpret_cast<const char*>(msg));
  }
  auto r = std::unique_ptr<Regex>(new Regex());
  r->code_ = code;
  r->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return r;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::Find(std::string_view s, size_t from, size_t* start, size_t* end) const {
  MatchState& st = State();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  int rc;
  if (jit_) {
    rc = pcre2_jit_match(code, subject, s.size(), from, 0, st.data, st.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(code, subject, s.size(), from, PCRE2_NO_JIT | PCRE2_NO_UTF_CHECK, st.data, st.context);
  } else {
    rc = pcre2_match(code, subject, s.size(), from, PCRE2_NO_UTF_CHECK, st.data, st.context);
  }
  if (rc < 0) return false;  // no match (or a resource limit: the rest is one gap)
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
  *start = ov[0];
  *end = ov[1];
  return true;
}

PreTokenizer::PreTokenizer() = default;
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

Status PreTokenizer::AddStep(const json& j, const std::string& path, bool last) {
  const std::string type =
      j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "";
  if (type == "ByteLevel") {
    if (!last) return InvalidArgumentError(path, ": ByteLevel is supported only as the last pre-tokenizer");
    byte_level_ = true;
    add_prefix_space_ = j.value("add_prefix_space", true);
    prefix_step_ = steps_.size();
    if (j.value("use_regex", true)) {
      auto r = Regex::Compile(kGpt2Pattern, false, path);
      if (!r.ok()) return r.status();
      steps_.push_back(Step{std::move(*r), Behavior::kIsolated, false});
    }
    return Status::Ok();
  }
  if (type != "Split") return Unsupported(path + ".type", type.empty() ? j.dump() : type);
  const json pattern = j.value("pattern", json());
  std::unique_ptr<Regex> regex;
  if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
    auto r = Regex::Compile(pattern["Regex"].get<std::string>(), false, path + ".pattern.Regex");
    if (!r.ok()) return r.status();
    regex = std::move(*r);
  } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
    auto r = Regex::Compile(pattern["String"].get<std::string>(), true, path + ".pattern.String");
    if (!r.ok()) return r.status();
    regex = std::move(*r);
  } else {
    return InvalidArgumentError(path, ".pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
  }
  const std::string behavior = j.value("behavior", "");
  Behavior b;
  if (behavior == "Isolated") {
    b = Behavior::kIsolated;
  } else if (behavior == "Removed") {
    b = Behavior::kRemoved;
  } else if (behavior == "MergedWithPrevious") {
    b = Behavior::kMergedWithPrevious;
  } else if (behavior == "MergedWithNext") {
    b = Behavior::kMergedWithNext;
  } else if (behavior == "Contiguous") {
    b = Behavior::kContiguous;
  } else {
    return Unsupported(path + ".behavior", behavior);
  }
  steps_.push_back(Step{std::move(regex), b, j.value("invert", false)});
  return Status::Ok();
}

Status PreTokenizer::Init(const json& j, const std::string& path) {
  steps_.clear();
  byte_level_ = false;
  if (j.is_null()) return InvalidArgumentError(path, " is null: a byte-level BPE needs a ByteLevel pre-tokenizer");
  const std::string type =
      j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "";
  if (type == "Sequence") {
    const json& list = j.value("pretokenizers", json());
    if (!list.is_array()) return InvalidArgumentError(path, ".pretokenizers is not an array");
    for (size_t i = 0; i < list.size(); ++i)
      MLARUN_RETURN_IF_ERROR(
          AddStep(list[i], path + ".pretokenizers[" + std::to_string(i) + "]", i + 1 == list.size()));
  } else {
    MLARUN_RETURN_IF_ERROR(AddStep(j, path, true));
  }
  if (steps_.size() > kMaxSteps) return InvalidArgumentError(path, ": more than ", kMaxSteps, " steps");
  if (!byte_level_)
    return InvalidArgumentError(path, ": no ByteLevel pre-tokenizer (only byte-level BPE is supported)");
  return Status::Ok();
}

void PreTokenizer::Run(std::string_view text, const std::function<void(std::string_view)>& emit) const {
  if (!text.empty()) RunFrom(0, text, emit);
}

void PreTokenizer::RunFrom(size_t step, std::string_view text,
                           const std::function<void(std::string_view)>& emit) const {
  if (step == prefix_step_ && add_prefix_space_ && text[0] != ' ') {
    // ByteLevel's add_prefix_space, on each piece that reaches it. One
    // buffer per thread is enough: the steps below never come back here.
    thread_local std::string prefixed;
    ReleaseIfLargeOnExit release_prefixed(prefixed);
    prefixed.assign(1, ' ');
    prefixed.append(text);
    RunStep(step, prefixed, emit);
    return;
  }
  RunStep(step, text, emit);
}

void PreTokenizer::RunStep(size_t step, std::string_view text,
                           const std::function<void(std::string_view)>& emit) const {
  if (step == steps_.size()) {
    emit(text);
    return;
  }
  const Step& st = steps_[step];
  if (st.behavior == Behavior::kIsolated) {
    // Matches and gaps alike become pieces.
    size_t prev = 0;
    st.regex->ForEachMatch(text, [&](size_t start, size_t end) {
      if (start > prev) RunFrom(step + 1, text.substr(prev, start - prev), emit);
      RunFrom(step + 1, text.substr(start, end - start), emit);
      prev = end;
    });
    if (prev < text.size()) RunFrom(step + 1, text.substr(prev), emit);
    return;
  }
  // tokenizers' NormalizedString::split: the string as (offsets, is_match)
  // runs, then the behavior decides which runs join or go.
  struct Run {
    size_t begin, end;
    bool is_match;
  };
  thread_local std::array<std::vector<Run>, kMaxSteps> run_lists;
  std::vector<Run>& runs = run_lists[step];
  ReleaseIfLargeOnExit release_runs(runs);
  runs.clear();
  size_t prev = 0;
  st.regex->ForEachMatch(text, [&](size_t start, size_t end) {
    if (start > prev) runs.push_back({prev, start, st.invert});
    runs.push_back({start, end, !st.invert});
    prev = end;
  });
  if (prev < text.size()) runs.push_back({prev, text.size(), st.invert});

  thread_local std::array<std::vector<Run>, kMaxSteps> out_lists;
  std::vector<Run>& out = out_lists[step];
  ReleaseIfLargeOnExit release_out(out);
  out.clear();
  bool previous_match = false;
  switch (st.behavior) {
    case Behavior::kIsolated:
      out = runs;
      break;
    case Behavior::kRemoved:
      for (const Run& r : runs)
        if (!r.is_match) out.push_back(r);
      break;
    case Behavior::kContiguous:
      for (const Run& r : runs) {
        if (r.is_match == previous_match && !out.empty()) {
          out.back().end = r.end;
        } else {
          out.push_back(r);
        }
        previous_match = r.is_match;
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const Run& r : runs) {
        if (r.is_match && !previous_match && !out.empty()) {
          out.back().end = r.end;
        } else {
          out.push_back(r);
        }
        previous_match = r.is_match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty()) {
          out.back().begin = it->begin;
        } else {
          out.push_back(*it);
        }
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  for (const Run& r : out)
    if (r.end > r.begin) RunFrom(step + 1, text.substr(r.begin, r.end - r.begin), emit);
}

}  // namespace mlarun::text
