#include "launcher/cli_typos.h"

#include <algorithm>
#include <cctype>
#include <string_view>
#include <vector>

#include "base/suggest.h"

namespace mlarun {
namespace {

// The option named `--name` of `app` or of an app above it (options of a
// parent stay valid after a subcommand only when CLI11 falls through to it,
// which mlarun never asks for; --help is every app's own).
const CLI::Option* FindLong(const CLI::App& app, std::string_view name) {
  for (const CLI::Option* opt : app.get_options()) {
    for (const std::string& l : opt->get_lnames())
      if (l == name) return opt;
  }
  return nullptr;
}

// The flag of `app` the user most likely meant by --`name`: vLLM's
// underscore spellings (--max_model_len) are its dashed ones, and a long
// name may be further off than a short one; "" when none is close.
std::string NearestFlag(const CLI::App& app, std::string_view name) {
  std::vector<std::string> names;
  for (const CLI::Option* o : app.get_options())
    for (const std::string& l : o->get_lnames()) names.push_back(l);
  std::string dashed(name);
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return NearestName(dashed, names, dashed.size() >= 12 ? 3 : 2);
}

std::string Path(const CLI::App* app) {
  std::string path;
  for (const CLI::App* a = app; a != nullptr && a->get_parent() != nullptr; a = a->get_parent())
    path = a->get_name() + (path.empty() ? "" : " " + path);
  return path;
}

}  // namespace

std::optional<std::string> FindTypo(const CLI::App& app, int argc, const char* const* argv) {
  const CLI::App* current = &app;
  int values_left = 0;  // words the previous option still takes as its values
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    if (word == "--") break;
    if (word.starts_with("--")) {
      const size_t eq = word.find('=');
      const std::string_view name = word.substr(2, eq == std::string_view::npos ? std::string_view::npos : eq - 2);
      const CLI::Option* opt = FindLong(*current, name);
      if (opt == nullptr) {
        const std::string best = NearestFlag(*current, name);
        const std::string where = Path(current);
        return (where.empty() ? "" : where + ": ") + "unknown flag --" + std::string(name) +
               (best.empty() ? std::string() : " (did you mean --" + best + "?)");
      }
      // Flags take no word; an option given as --name=value took its value.
      values_left =
          eq != std::string_view::npos || opt->get_items_expected_max() == 0 ? 0 : opt->get_items_expected_max();
      continue;
    }
    if (word.size() >= 2 && word[0] == '-') {  // a short flag: CLI11 checks it
      // ... unless it is a long one with one dash (-max-model-len), which
      // CLI11 would call "not expected" without naming the flag.
      const std::string_view name =
          word.substr(1, word.find('=') == std::string_view::npos ? std::string_view::npos : word.find('=') - 1);
      if (values_left == 0 && name.size() > 2 && std::isalpha(static_cast<unsigned char>(name[0]))) {
        if (const std::string best = NearestFlag(*current, name); !best.empty()) {
          const std::string where = Path(current);
          return (where.empty() ? "" : where + ": ") + "unknown flag -" + std::string(name) + " (did you mean --" +
                 best + "?)";
        }
      }
      values_left = 0;
      continue;
    }
    if (values_left > 0) {
      --values_left;
      continue;
    }
    const CLI::App* sub = nullptr;
    for (const CLI::App* s : current->get_subcommands([](const CLI::App*) { return true; }))
      if (s->check_name(std::string(word))) sub = s;
    if (sub != nullptr) {
      current = sub;
      continue;
    }
    std::vector<std::string> names;
    for (const CLI::App* s : current->get_subcommands([](const CLI::App*) { return true; }))
      names.push_back(s->get_name());
    if (names.empty()) continue;  // a positional argument: CLI11 checks it
    const std::string best = NearestName(word, names);
    const std::string where = Path(current);
    return (where.empty() ? "" : where + ": ") + "unknown subcommand '" + std::string(word) + "'" +
           (best.empty() ? std::string() : " (did you mean '" + best + "'?)");
  }
  return std::nullopt;
}

}  // namespace mlarun
