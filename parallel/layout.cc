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
    if (eq == std::string_view::npos) return error(part, "expected key=value");
    const std::string_view key = Trim(part.substr(0, eq));
    const std::string_view value = Trim(part.substr(eq + 1));
    if (key == "moe") {
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
      // from_chars accepts a leading '-'; reject it (and '+') as not a positive integer.
      int v = 0;
      const char* end = value.data() + value.size();
      const auto [ptr, ec] = std::from_chars(value.data(), end, v);
      if (value.empty() || value.front() == '-' || ec == std::errc::invalid_argument || ptr != end) {
        return error(part, "value is not a positive integer");
      }
      if (ec == std::errc::result_out_of_range || v > kMaxParallelDegree) {
        return error(part, "value exceeds " + std::to_string(kMaxParallelDegree));
      }
      if (v <= 0) return error(part, "value must be positive");
      (key == "dp" ? layout.dp : layout.attn_tp) = v;
    } else {
      return error(part, "unknown key (expected dp, attn_tp or moe)");
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return layout;
}

}  // namespace mlarun
