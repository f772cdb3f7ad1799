// "Did you mean ...?" for misspelt names: model-file keys, subcommands,
// flags.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mlarun {

// Levenshtein distance (insertions, deletions, substitutions; bytes).
size_t EditDistance(std::string_view a, std::string_view b);

// The candidate closest to `name`, if it is within `max_distance` edits
// (ties: the first); "" when none is. A candidate that starts with `name`
// (an abbreviation, "gen" for "generate") counts as close.
std::string NearestName(std::string_view name, const std::vector<std::string>& candidates, size_t max_distance = 2);

}  // namespace mlarun
