// Aligned text tables for the command line (`mlarun stats`, `mlarun memory
// --measure`): every column as wide as its widest cell, so large numbers
// never run into their neighbours.
#pragma once

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

namespace mlarun {

// Prints `rows` under `header`, each line prefixed by `indent`: text columns
// (left[i]) flush left, numbers flush right, two spaces apart; trailing
// spaces trimmed.
inline void PrintTable(std::ostream& out, const std::vector<std::string>& header, const std::vector<bool>& left,
                       const std::vector<std::vector<std::string>>& rows, const std::string& indent = "") {
  std::vector<size_t> width(header.size());
  for (size_t i = 0; i < header.size(); ++i) width[i] = header[i].size();
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size() && i < width.size(); ++i) width[i] = std::max(width[i], r[i].size());
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s = indent;
    for (size_t i = 0; i < cells.size() && i < width.size(); ++i) {
      if (i > 0) s += "  ";
      const std::string pad(width[i] - cells[i].size(), ' ');
      s += left[i] ? cells[i] + pad : pad + cells[i];
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    out << s << "\n";
  };
  line(header);
  for (const auto& r : rows) line(r);
}

}  // namespace mlarun
