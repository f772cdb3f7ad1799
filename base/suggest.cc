#include "base/suggest.h"

#include <algorithm>

namespace mlarun {

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string NearestName(std::string_view name, const std::vector<std::string>& candidates, size_t max_distance) {
  std::string best;
  size_t best_distance = max_distance + 1;
  for (const std::string& c : candidates) {
    size_t d = EditDistance(name, c);
    if (name.size() >= 3 && std::string_view(c).starts_with(name)) d = std::min<size_t>(d, 1);
    if (d < best_distance) best = c, best_distance = d;
  }
  return best;
}

}  // namespace mlarun
