// Chat templates: the Jinja source in a checkpoint's tokenizer_config.json
// (`chat_template`), rendered as transformers' apply_chat_template renders it
// with Python's jinja2: an environment with trim_blocks and lstrip_blocks,
// the loopcontrols extension, `raise_exception(msg)`, the `tojson` filter
// transformers registers, and the context it passes (messages,
// add_generation_prompt, bos_token, eos_token, and the other special tokens;
// tools and documents undefined unless given).
//
// The interpreter covers the subset of Jinja the DeepSeek-V2, V2.5 and V3
// templates (and templates like them) use; anything else is refused at Parse
// with a message naming the construct and its line, and saying that
// /v1/completions with a prompt string is the way around it.
//
// Threading: a parsed ChatTemplate is immutable; Render may run on any
// number of threads at once.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"

namespace mlarun::text {

class ChatTemplate {
 public:
  // INVALID_ARGUMENT: a syntax error or an unsupported construct (named,
  // with its line).
  static StatusOr<std::shared_ptr<const ChatTemplate>> Parse(const std::string& source);
  virtual ~ChatTemplate() = default;

  // Renders with `context` as the template's variables, e.g.
  //   {"messages": [{"role": "user", "content": "hi"}],
  //    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"}
  // JSON null is Python's None; a missing key is undefined. Objects iterate
  // (and print, `tojson`) in the context's key order, as Python's dicts
  // keep the order a request gave: pass an ordered_json made from the
  // request to get transformers' output exactly (a plain nlohmann::json has
  // its keys sorted). INVALID_ARGUMENT when the template raises
  // (raise_exception: its message) or an operation fails on the values given
  // (named: "messages[2].content is not a string").
  virtual StatusOr<std::string> Render(const nlohmann::ordered_json& context) const = 0;
  StatusOr<std::string> Render(const nlohmann::json& context) const { return Render(nlohmann::ordered_json(context)); }
};

}  // namespace mlarun::text
