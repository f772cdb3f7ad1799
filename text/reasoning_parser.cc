#include "text/reasoning_parser.h"

#include <algorithm>

#include "text/partial_marker.h"

namespace mlarun::text {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = kReasoningEnd;

}  // namespace

ReasoningSplit SplitReasoning(std::string_view text) {
  const size_t close = text.find(kClose);
  std::string_view reasoning = text.substr(0, close);
  std::string_view content = close == std::string_view::npos ? std::string_view() : text.substr(close + kClose.size());
  std::string r(reasoning);
  if (const size_t open = r.find(kOpen); open != std::string::npos) r.erase(open, kOpen.size());
  return {std::move(r), std::string(content)};
}

ReasoningSplit ReasoningParser::Add(std::string_view delta) {
  ReasoningSplit out;
  if (state_ == State::kContent) {
    out.content = delta;
    return out;
  }
  held_ += delta;
  for (;;) {
    // Before `<think>`: either marker may come; after it, only `</think>`.
    const size_t close = held_.find(kClose);
    const size_t open = state_ == State::kStart ? held_.find(kOpen) : std::string::npos;
    if (open != std::string::npos && open < close) {
      out.reasoning += held_.substr(0, open);
      held_.erase(0, open + kOpen.size());
      state_ = State::kReasoning;
      continue;
    }
    if (close != std::string::npos) {
      out.reasoning += held_.substr(0, close);
      out.content = held_.substr(close + kClose.size());
      held_.clear();
      state_ = State::kContent;
      return out;
    }
    break;
  }
  const size_t keep =
      state_ == State::kStart ? PartialMarkerLength(held_, {kClose, kOpen}) : PartialMarkerLength(held_, {kClose});
  out.reasoning += held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

ReasoningSplit ReasoningParser::Finish() {
  ReasoningSplit out;
  out.reasoning = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace mlarun::text
