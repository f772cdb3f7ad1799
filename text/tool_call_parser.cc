#include "text/tool_call_parser.h"

#include <algorithm>
#include <initializer_list>

#include "text/partial_marker.h"

namespace mlarun::text {
namespace {

constexpr std::string_view kCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kCallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kSep = "<｜tool▁sep｜>";
constexpr std::string_view kFenceOpen = "```json\n";
constexpr std::string_view kFenceClose = "\n```";

// The arguments of a call that starts at `text` (after its name's line):
// their length and where the text after the call starts (npos: the end).
std::pair<std::string_view, size_t> Arguments(std::string_view text) {
  const size_t end = text.find(kCallEnd);
  std::string_view args = text.substr(0, end);
  if (end == std::string_view::npos) return {args, end};
  if (args.ends_with(kFenceClose)) args.remove_suffix(kFenceClose.size());
  return {args, end + kCallEnd.size()};
}

}  // namespace

bool IsToolCallMarker(std::string_view text) {
  for (std::string_view m : {kCallsBegin, kCallsEnd, kCallBegin, kCallEnd, kSep})
    if (text == m) return true;
  return false;
}

ToolCalls ParseToolCalls(std::string_view text) {
  ToolCalls out;
  size_t at = text.find(kCallsBegin);
  out.content = text.substr(0, at);
  if (at == std::string_view::npos) return out;
  at += kCallsBegin.size();
  for (;;) {
    const size_t begin = text.find(kCallBegin, at), end = text.find(kCallsEnd, at);
    if (end != std::string_view::npos && end < begin) {
      out.content += text.substr(end + kCallsEnd.size());
      return out;
    }
    if (begin == std::string_view::npos) return out;
    const size_t sep = text.find(kSep, begin + kCallBegin.size());
    if (sep == std::string_view::npos) return out;
    const size_t name_start = sep + kSep.size();
    const size_t newline = text.find('\n', name_start);
    if (newline == std::string_view::npos) return out;
    std::string_view rest = text.substr(newline + 1);
    if (rest.starts_with(kFenceOpen)) rest.remove_prefix(kFenceOpen.size());
    auto [args, next] = Arguments(rest);
    out.calls.push_back({std::string(text.substr(name_start, newline - name_start)), std::string(args)});
    if (next == std::string_view::npos) return out;
    at = text.size() - rest.size() + next;
  }
}

void ToolCallParser::AddArguments(ToolCallsDelta& out, std::string text) {
  if (text.empty()) return;
  if (!out.calls.empty() && out.calls.back().index == calls_ - 1) {
    out.calls.back().arguments += text;
  } else {
    out.calls.push_back({.index = calls_ - 1, .begins = false, .name = "", .arguments = std::move(text)});
  }
}

bool ToolCallParser::Step(ToolCallsDelta& out) {
  auto cut = [&](size_t n) {  // takes the first n bytes of held_
    std::string head = held_.substr(0, n);
    held_.erase(0, n);
    return head;
  };
  switch (state_) {
    case State::kContent: {
      const size_t at = held_.find(kCallsBegin);
      if (at == std::string::npos) {
        out.content += cut(held_.size() - PartialMarkerLength(held_, {kCallsBegin}));
        return false;
      }
      out.content += cut(at);
      cut(kCallsBegin.size());
      state_ = State::kBetween;
      return true;
    }
    case State::kBetween: {
      const size_t begin = held_.find(kCallBegin), end = held_.find(kCallsEnd);
      if (begin == std::string::npos && end == std::string::npos) {
        cut(held_.size() - PartialMarkerLength(held_, {kCallBegin, kCallsEnd}));
        return false;
      }
      const bool ends = end < begin;
      cut((ends ? end : begin) + (ends ? kCallsEnd : kCallBegin).size());
      state_ = ends ? State::kAfter : State::kType;
      return true;
    }
    case State::kType: {
      const size_t sep = held_.find(kSep);
      if (sep == std::string::npos) return false;
      cut(sep + kSep.size());
      state_ = State::kName;
      return true;
    }
    case State::kName: {
      const size_t newline = held_.find('\n');
      if (newline == std::string::npos) return false;
      out.calls.push_back({.index = calls_++, .begins = true, .name = cut(newline), .arguments = ""});
      cut(1);
      state_ = State::kFence;
      return true;
    }
    case State::kFence:
      if (held_.size() < kFenceOpen.size() && std::string_view(kFenceOpen).starts_with(held_)) return false;
      if (held_.starts_with(kFenceOpen)) cut(kFenceOpen.size());
      state_ = State::kArguments;
      return true;
    case State::kArguments: {
      const size_t end = held_.find(kCallEnd);
      if (end == std::string::npos) {
        AddArguments(out, cut(held_.size() - PartialMarkerLength(held_, {kCallEnd, "\n```<｜tool▁call▁end｜>"})));
        return false;
      }
      std::string args = cut(end);
      cut(kCallEnd.size());
      if (args.ends_with(kFenceClose)) args.resize(args.size() - kFenceClose.size());
      AddArguments(out, std::move(args));
      state_ = State::kBetween;
      return true;
    }
    case State::kAfter:
      out.content += cut(held_.size());
      return false;
  }
  return false;
}

ToolCallsDelta ToolCallParser::Add(std::string_view delta) {
  ToolCallsDelta out;
  held_ += delta;
  while (Step(out)) {
  }
  return out;
}

ToolCallsDelta ToolCallParser::Finish() {
  ToolCallsDelta out;
  // What is held is a marker's start that never completed: content before
  // the calls, a call's arguments in them, dropped elsewhere.
  if (state_ == State::kContent || state_ == State::kAfter) out.content = std::move(held_);
  if (state_ == State::kFence || state_ == State::kArguments) AddArguments(out, std::move(held_));
  held_.clear();
  return out;
}

}  // namespace mlarun::text
