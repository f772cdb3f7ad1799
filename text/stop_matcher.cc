// StopMatcher (tokenizer.h).
//
// The text seen so far but not yet returned is held in held_. After each
// delta: the earliest complete occurrence of any stop string in held_ is
// found, and so is the earliest position from which held_'s suffix is a
// proper prefix of a stop string (a match that may still complete). A
// complete match ends the stream unless a possible match starts before it;
// otherwise everything before the earliest possible match is returned. The
// result is the text before the earliest occurrence in the whole stream,
// however it was cut into deltas.
#include <algorithm>

#include "text/partial_marker.h"
#include "text/tokenizer.h"

namespace mlarun::text {
namespace {

// The earliest start of a complete occurrence of any stop in `s`, or npos.
size_t EarliestMatch(std::string_view s, const std::vector<std::string>& stops) {
  size_t best = std::string_view::npos;
  for (const std::string& stop : stops) best = std::min(best, s.find(stop));
  return best;
}

}  // namespace

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

StopMatcher::Result StopMatcher::Add(std::string_view delta) {
  Result r;
  if (stopped_) {
    r.stopped = true;
    return r;
  }
  held_.append(delta);
  if (stops_.empty()) {
    r.text = std::move(held_);
    held_.clear();
    return r;
  }
  const size_t match = EarliestMatch(held_, stops_);
  const size_t partial = held_.size() - PartialMarkerLength(held_, stops_);
  if (match != std::string::npos && match <= partial) {
    r.text = held_.substr(0, match);
    r.stopped = stopped_ = true;
    held_.clear();
    return r;
  }
  const size_t safe = std::min(match, partial);
  r.text = held_.substr(0, safe);
  held_.erase(0, safe);
  return r;
}

std::string StopMatcher::Finish() {
  if (stopped_) return "";
  std::string out;
  const size_t match = EarliestMatch(held_, stops_);
  if (match != std::string::npos) {
    out = held_.substr(0, match);
    stopped_ = true;
  } else {
    out = std::move(held_);
  }
  held_.clear();
  return out;
}

}  // namespace mlarun::text
