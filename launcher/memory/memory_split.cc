// `mlarun memory`: the spelling of a prefill/decode split in --layouts, and
// what a group's cache holds in prompts or running sequences.
#include <cctype>
#include <cstring>
#include <utility>

#include "launcher/memory/memory_internal.h"

namespace mlarun::memory_internal {
namespace {

// One job of a split: its role and the spelling of its layout.
struct SplitPart {
  bool prefill = false;
  std::string layout;
};

StatusOr<SplitPart> ParseSplitPart(const std::string& split, const std::string& part) {
  const std::pair<const char*, bool> prefixes[] = {{"prefill:", true}, {"decode:", false}, {"p:", true}, {"d:", false}};
  for (const auto& [prefix, prefill] : prefixes) {
    if (!part.starts_with(prefix)) continue;
    if (part.size() == std::strlen(prefix))
      return InvalidArgumentError("layout '", split, "': no layout after '", prefix, "'");
    return SplitPart{prefill, part.substr(std::strlen(prefix))};
  }
  // The short form: the role letter in place of "dp" (p2 = p:dp2, d1xtp2 = d:dp1xtp2).
  if (part.size() >= 2 && (part[0] == 'p' || part[0] == 'd') && std::isdigit(static_cast<unsigned char>(part[1])))
    return SplitPart{part[0] == 'p', "dp" + part.substr(1)};
  return InvalidArgumentError("layout '", split, "': expected p:LAYOUT, d:LAYOUT, pN, dN, pAxtpB or dAxtpB, got '",
                              part, "'");
}

}  // namespace

bool IsSplitName(const std::string& name) { return name.find('+') != std::string::npos; }

StatusOr<SplitLayout> ParseSplitName(const std::string& name, int world) {
  const size_t plus = name.find('+');
  if (plus == std::string::npos || name.find('+', plus + 1) != std::string::npos)
    return InvalidArgumentError("layout '", name,
                                "': a split is a prefill job and a decode job joined by one '+' "
                                "(p:LAYOUT+d:LAYOUT, or p2+d2)");
  MLARUN_ASSIGN_OR_RETURN(const SplitPart a, ParseSplitPart(name, name.substr(0, plus)));
  MLARUN_ASSIGN_OR_RETURN(const SplitPart b, ParseSplitPart(name, name.substr(plus + 1)));
  if (a.prefill == b.prefill)
    return InvalidArgumentError("layout '", name, "': needs one prefill job (p...) and one decode job (d...), got two ",
                                a.prefill ? "prefill" : "decode", " jobs");
  const SplitPart& p = a.prefill ? a : b;
  const SplitPart& d = a.prefill ? b : a;
  SplitLayout s;
  auto prefill = ParseLayoutName(p.layout, 0);
  if (!prefill.ok()) return InvalidArgumentError("layout '", name, "', prefill job: ", prefill.status().message());
  auto decode = ParseLayoutName(d.layout, 0);
  if (!decode.ok()) return InvalidArgumentError("layout '", name, "', decode job: ", decode.status().message());
  s.prefill = *prefill;
  s.decode = *decode;
  if (world > 0 && s.world() != world)
    return InvalidArgumentError("layout '", name, "' has ", s.world(), " ranks (prefill ", LayoutName(s.prefill), ": ",
                                s.prefill.world(), " + decode ", LayoutName(s.decode), ": ", s.decode.world(),
                                ") but --world is ", world);
  return s;
}

std::string SplitName(const SplitLayout& s) { return "p:" + LayoutName(s.prefill) + "+d:" + LayoutName(s.decode); }

Held HeldBy(const RankMemory& plan, int64_t tokens_each) {
  Held h;
  h.tokens_each = tokens_each;
  h.blocks_each = plan.block_size > 0 ? (tokens_each + plan.block_size - 1) / plan.block_size : 0;
  h.per_group = h.blocks_each > 0 && plan.cache_blocks > 0 ? plan.cache_blocks / h.blocks_each : 0;
  h.cluster = h.per_group * plan.layout.dp;
  return h;
}

}  // namespace mlarun::memory_internal
