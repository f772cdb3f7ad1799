#include "parallel/layout.h"

#include <charconv>

namespace mlarun {
namespace {

// Largest dp or attn_tp accepted: far above any real deployment, low enough
// that dp x attn_tp cannot overflow an int.
constexpr int kMaxParallelDegree = 4096;

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string_view MoeName(MoeSharding m) {
  switch (m) {
    case MoeSharding::kByExpert:
      return "expert";
    case MoeSharding::kByIntermediate:
      return "intermediate";
  }
  return "unknown";
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const ParallelLayout& l) {
  return os << "dp=" << l.dp << ",attn_tp=" << l.attn_tp << ",moe=" << MoeName(l.moe);
}

namespace {

// A dp or attn_tp degree: "" when `value` is one, else why not.
std::string ParseDegree(std::string_view value, int& out) {
  // from_chars accepts a leading '-'; reject it (and '+') as not a positive integer.
  int v = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, v);
  if (value.empty() || value.front() == '-' || ec == std::errc::invalid_argument || ptr != end)
    return "value is not a positive integer";
  if (ec == std::errc::result_out_of_range || v > kMaxParallelDegree)
    return "value exceeds " + std::to_string(kMaxParallelDegree);
  if (v <= 0) return "value must be positive";
  out = v;
  return "";
}

// The short names of `mlarun memory` and the tables: tpN, dpN, dpAxtpB.
// "" when `part` is one (setting `layout` and what it names), else why not.
std::string ParseShortForm(std::string_view part, ParallelLayout& layout, bool& seen_dp, bool& seen_attn_tp) {
  constexpr std::string_view kExpected = "expected key=value, or tpN, dpN or dpAxtpB";
  std::string_view dp, tp;
  if (part.starts_with("tp")) {
    tp = part.substr(2);
  } else if (part.starts_with("dp")) {
    const size_t x = part.find("xtp");
    dp = part.substr(2, x == std::string_view::npos ? std::string_view::npos : x - 2);
    if (x != std::string_view::npos) tp = part.substr(x + 3);
    if (x != std::string_view::npos && tp.empty()) return std::string(kExpected);
  } else {
    return std::string(kExpected);
  }
  if (part.starts_with("dp") && dp.empty()) return std::string(kExpected);
  if ((!dp.empty() && seen_dp) || (!tp.empty() && seen_attn_tp)) return "duplicate key";
  if (!dp.empty()) {
    if (std::string e = ParseDegree(dp, layout.dp); !e.empty()) return e;
    seen_dp = true;
  }
  if (!tp.empty() || part.starts_with("tp")) {
    if (std::string e = ParseDegree(tp, layout.attn_tp); !e.empty()) return e;
    seen_attn_tp = true;
  }
  return "";
}

}  // namespace

StatusOr<ParallelLayout> ParseParallelLayout(std::string_view text) {
  ParallelLayout layout;
  auto error = [&](std::string_view part, std::string_view why) {
    return InvalidArgumentError("parallel layout \"", text, "\": ", why, " in \"", part, "\"");
  };
  bool seen_dp = false, seen_attn_tp = false, seen_moe = false;
  // An empty text leaves every key at its default (a single rank).
  if (Trim(text).empty()) return layout;
  std::string_view rest = text;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view part = Trim(rest.substr(0, comma));
    if (part.empty()) return error(part, "empty part");
    const size_t eq = part.find('=');
    const std::string_view key = Trim(part.substr(0, eq));
    const std::string_view value = eq == std::string_view::npos ? "" : Trim(part.substr(eq + 1));
    if (eq == std::string_view::npos) {
      if (std::string e = ParseShortForm(part, layout, seen_dp, seen_attn_tp); !e.empty()) return error(part, e);
    } else if (key == "moe") {
      if (seen_moe) return error(part, "duplicate key");
      seen_moe = true;
      if (value == "expert") {
        layout.moe = MoeSharding::kByExpert;
      } else if (value == "intermediate") {
        layout.moe = MoeSharding::kByIntermediate;
      } else {
        return error(part, "moe must be expert or intermediate");
      }
    } else if (key == "dp" || key == "attn_tp") {
      bool& seen = key == "dp" ? seen_dp : seen_attn_tp;
      if (seen) return error(part, "duplicate key");
      seen = true;
      if (std::string e = ParseDegree(value, key == "dp" ? layout.dp : layout.attn_tp); !e.empty())
        return error(part, e);
    } else {
      return error(part, "unknown key (expected dp, attn_tp or moe)");
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return layout;
}

}  // namespace mlarun
