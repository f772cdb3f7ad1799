// The HTTP API's structured-output fields, read as vLLM's OpenAI server reads
// them, into SamplingParams::structured: response_format (json_object,
// json_schema), guided_json, guided_regex, guided_choice, guided_grammar and
// the structured_outputs object; and tool_choice "required" or a named
// function, which constrain the answer to a JSON schema of the tools and turn
// it into tool calls (ForcedToolCalls).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/request/sampling_params.h"
#include "text/tool_call_parser.h"

namespace mlarun {

// A request field that cannot be honoured: the 400's param and message.
struct FieldError {
  std::string field;
  std::string message;
};

// The constraint a request's body asks for (kind kNone: none) and the field
// that asked for it (for errors about the constraint: "response_format",
// "guided_json", "structured_outputs.regex", ...); any_whitespace holds
// structured_outputs.disable_any_whitespace even without a constraint (for
// tool_choice's). More than one constraint,
// a malformed one, or guided_whitespace_pattern (the grammar engine has only
// JSON whitespace on or off): FieldError.
struct RequestedStructure {
  StructuredOutput structured;
  std::string field;
};
RequestedStructure ParseStructuredOutput(const nlohmann::ordered_json& body);

// tools: an array (empty when absent) of {"type": "function", "function":
// {"name": ..., ...}}, names non-empty. Throws FieldError.
nlohmann::ordered_json ParseToolsField(const nlohmann::ordered_json& body);

// tool_choice, as vLLM: "none", "auto", "required" or {"type": "function",
// "function": {"name": ...}} naming one of `tools` (ParseToolsField's).
struct ToolChoice {
  enum class Kind { kNone, kAuto, kRequired, kNamed };
  Kind kind = Kind::kNone;
  std::string name;  // kNamed: the function's
};
// Throws FieldError (param "tool_choice") for another value, a choice other
// than "none" without tools, or a name not among them.
ToolChoice ParseToolChoice(const nlohmann::ordered_json& body, const nlohmann::ordered_json& tools);

// The JSON schema that "required" and a named function constrain the answer
// to, as vLLM's: the named function's `parameters`; for "required" a
// non-empty array of {"name": <a tool's name>, "parameters": <its
// parameters>} (anyOf over the tools), the tools' $defs hoisted to the top
// (the same name with two schemas: FieldError, param "tools").
nlohmann::ordered_json ToolChoiceSchema(const ToolChoice& choice, const nlohmann::ordered_json& tools);

// The constrained answer of "required" or a named function as tool calls, as
// its text arrives. Named: one call, its arguments the text itself, in
// pieces. Required: each element of the array one call once the element is
// complete, its arguments the element's "parameters" as JSON text. Not
// thread-safe.
class ForcedToolCalls {
 public:
  explicit ForcedToolCalls(ToolChoice choice) : choice_(std::move(choice)) {}
  std::vector<text::ToolCallDelta> Add(std::string_view delta);
  bool called() const { return calls_ > 0; }

 private:
  void Scan(std::string_view delta, std::vector<text::ToolCallDelta>& out);

  const ToolChoice choice_;
  size_t calls_ = 0;
  // Required: where the scan of the array stands.
  int depth_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
  std::string element_;  // the text of the array's element being read
};

}  // namespace mlarun
