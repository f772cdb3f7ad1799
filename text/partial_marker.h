// While text streams in, a marker (a stop string, `</think>`, a tool-call
// token) may arrive cut between two deltas: a stream holds back the longest
// suffix of what it has that is a proper prefix of a marker, and sends the
// rest. StopMatcher, ReasoningParser and ToolCallParser share this.
#pragma once

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <string_view>

namespace mlarun::text {

// The length of the longest suffix of `s` that is a proper prefix of one of
// `markers` (a range of strings; empty ones are ignored).
template <class Markers>
size_t PartialMarkerLength(std::string_view s, const Markers& markers) {
  size_t best = 0;
  for (std::string_view m : markers) {
    if (m.empty()) continue;
    for (size_t n = std::min(s.size(), m.size() - 1); n > best; --n) {
      if (s.substr(s.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
    }
  }
  return best;
}

inline size_t PartialMarkerLength(std::string_view s, std::initializer_list<std::string_view> markers) {
  return PartialMarkerLength<std::initializer_list<std::string_view>>(s, markers);
}

}  // namespace mlarun::text
