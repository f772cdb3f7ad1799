// Misspelt subcommands and flags, caught before CLI11 parses: CLI11 would
// report "A subcommand is required" for `mlarun generat` and "--model is
// required" for `--modle X`, hiding the typo.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

namespace mlarun {

// Walks argv as `app` would (subcommands by name, an option's values after
// it) and returns a message for the first word that names no subcommand
// where one is expected, or no flag of the subcommands reached, with the
// nearest name when one is close: "unknown subcommand 'generat' (did you
// mean 'generate'?)", "generate: unknown flag --modle (did you mean
// --model?)". nullopt when every word is known (CLI11 then checks the rest).
// Flags are matched as vLLM spells them too: "--max_model_len" and
// "-max-model-len" are each told --max-model-len. Words after "--" are not
// looked at.
std::optional<std::string> FindTypo(const CLI::App& app, int argc, const char* const* argv);

}  // namespace mlarun
