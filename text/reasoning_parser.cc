#include "text/reasoning_parser.h"

#include <algorithm>

namespace mlarun::text {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

// The length of the longest suffix of `s` that is a proper prefix of `marker`.
size_t PartialMarker(std::string_view s, std::string_view marker) {
  for (size_t n = std::min(s.size(), marker.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

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
  size_t keep = PartialMarker(held_, kClose);
  if (state_ == State::kStart) keep = std::max(keep, PartialMarker(held_, kOpen));
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
