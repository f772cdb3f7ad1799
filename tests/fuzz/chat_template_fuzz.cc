// Fuzz target: chat templates. The input up to its first NUL byte is a
// template's source, the rest a message's content; a template that parses is
// rendered with a two-message conversation. Parse and Render must answer with
// a Status (a refusal, a raised exception, a runaway stopped), never crash or
// hang.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "text/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string source = input.substr(0, nul);
  std::string content = nul == std::string::npos ? "hello" : input.substr(nul + 1);
  auto parsed = mlarun::text::ChatTemplate::Parse(source);
  if (!parsed.ok()) return 0;
  nlohmann::json context;
  try {
    context = {
        {"messages",
         {{{"role", "system"}, {"content", "be brief"}},
          {{"role", "user"},
           {"content", nlohmann::json(content).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)}}}},
        {"add_generation_prompt", true},
        {"bos_token", "<s>"},
        {"eos_token", "</s>"}};
  } catch (...) {
    return 0;
  }
  (void)(*parsed)->Render(context);
  return 0;
}
