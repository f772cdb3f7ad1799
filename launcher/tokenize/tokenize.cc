#include "launcher/tokenize/tokenize.h"

#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace mlarun::text {
namespace {

using nlohmann::json;

std::string ErrorLine(size_t line, const std::string& what) {
  return json{{"error", "line " + std::to_string(line) + ": " + what}}.dump();
}

}  // namespace

int RunTokenize(const TokenizeOptions& options, std::istream& in, std::ostream& out, std::ostream& err) {
  auto tok = Tokenizer::Load(options.model);
  if (!tok.ok()) {
    err << "mlarun tokenize: " << tok.status() << "\n";
    return 2;
  }
  const Tokenizer& t = **tok;
  std::string line;
  size_t n = 0;
  bool failed = false;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    json j = json::parse(line, nullptr, false);
    if (options.decode) {
      std::vector<int32_t> ids;
      bool ok = j.is_array();
      if (ok) {
        for (const json& v : j) {
          if (!v.is_number_integer() || v.get<int64_t>() < INT32_MIN || v.get<int64_t>() > INT32_MAX) {
            ok = false;
            break;
          }
          ids.push_back(v.get<int32_t>());
        }
      }
      if (!ok) {
        out << ErrorLine(n, "expected a JSON array of integer ids") << "\n";
        failed = true;
        continue;
      }
      out << json(t.Decode(ids, options.skip_special_tokens)).dump() << "\n";
    } else {
      if (!j.is_string()) {
        out << ErrorLine(n, "expected a JSON string") << "\n";
        failed = true;
        continue;
      }
      out << json(t.Encode(j.get<std::string>(), options.add_special_tokens)).dump() << "\n";
    }
  }
  return failed ? 1 : 0;
}

}  // namespace mlarun::text
