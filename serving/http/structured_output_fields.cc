#include "serving/http/structured_output_fields.h"

#include <utility>

#include "base/status.h"

namespace mlarun {
namespace {

using json = nlohmann::ordered_json;
using internal::StrCat;
using Kind = StructuredOutput::Kind;

FieldError Bad(const std::string& field, const std::string& what) {
  return FieldError{field, StrCat(field, ": ", what)};
}

const char* TypeName(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "a number";
}

const json* Field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

// A JSON schema given as an object, or as its text (vLLM's guided_json takes
// both): the schema's text for the wire.
std::string SchemaText(const json& v, const std::string& field) {
  if (v.is_object()) return v.dump();
  if (!v.is_string()) throw Bad(field, StrCat("must be a JSON schema (an object or its text), got ", TypeName(v)));
  json parsed = json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object()) throw Bad(field, "the string is not the text of a JSON schema (a JSON object)");
  return parsed.dump();
}

std::string NonEmptyString(const json& v, const std::string& field) {
  if (!v.is_string()) throw Bad(field, StrCat("must be a string, got ", TypeName(v)));
  if (v.get<std::string>().empty()) throw Bad(field, "must not be empty");
  return v.get<std::string>();
}

std::vector<std::string> Choices(const json& v, const std::string& field) {
  if (!v.is_array() || v.empty()) throw Bad(field, "must be a non-empty array of strings");
  std::vector<std::string> out;
  for (const json& c : v) {
    if (!c.is_string()) throw Bad(field, StrCat("must be a non-empty array of strings, got one holding ", TypeName(c)));
    out.push_back(c.get<std::string>());
  }
  return out;
}

// One constraint found, and where.
struct Found {
  std::string field;
  StructuredOutput structured;
};

// response_format: {"type": "text"} asks nothing; json_object any object;
// json_schema {"json_schema": {"name", "schema", "strict", "description"}}.
void ReadResponseFormat(const json& body, std::vector<Found>& found) {
  const json* rf = Field(body, "response_format");
  if (rf == nullptr) return;
  if (!rf->is_object()) throw Bad("response_format", StrCat("must be an object, got ", TypeName(*rf)));
  const json type = rf->value("type", json());
  if (type == "text") return;
  if (type == "json_object") {
    found.push_back({"response_format", {.kind = Kind::kJsonObject}});
    return;
  }
  if (type != "json_schema") throw Bad("response_format.type", "must be \"text\", \"json_object\" or \"json_schema\"");
  const json* js = Field(*rf, "json_schema");
  if (js == nullptr || !js->is_object())
    throw Bad("response_format.json_schema", "required with type json_schema, an object holding \"schema\"");
  for (const char* text_field : {"name", "description"}) {
    if (const json* v = Field(*js, text_field); v != nullptr && !v->is_string())
      throw Bad(StrCat("response_format.json_schema.", text_field), StrCat("must be a string, got ", TypeName(*v)));
  }
  if (const json* v = Field(*js, "strict"); v != nullptr && !v->is_boolean())
    throw Bad("response_format.json_schema.strict", StrCat("must be a boolean, got ", TypeName(*v)));
  const json* schema = Field(*js, "schema");
  if (schema == nullptr) throw Bad("response_format.json_schema.schema", "required");
  if (!schema->is_object())
    throw Bad("response_format.json_schema.schema", StrCat("must be an object, got ", TypeName(*schema)));
  found.push_back({"response_format", {.kind = Kind::kJsonSchema, .spec = schema->dump()}});
}

// vLLM's guided_* fields and the keys of structured_outputs share their forms.
void ReadConstraint(const json& v, const std::string& field, Kind kind, std::vector<Found>& found) {
  StructuredOutput s{.kind = kind};
  if (kind == Kind::kJsonSchema) s.spec = SchemaText(v, field);
  if (kind == Kind::kRegex || kind == Kind::kGrammar) s.spec = NonEmptyString(v, field);
  if (kind == Kind::kChoice) s.choices = Choices(v, field);
  found.push_back({field, std::move(s)});
}

constexpr std::pair<const char*, Kind> kGuided[] = {{"guided_json", Kind::kJsonSchema},
                                                    {"guided_regex", Kind::kRegex},
                                                    {"guided_choice", Kind::kChoice},
                                                    {"guided_grammar", Kind::kGrammar}};
constexpr std::pair<const char*, Kind> kStructured[] = {
    {"json", Kind::kJsonSchema}, {"regex", Kind::kRegex}, {"choice", Kind::kChoice}, {"grammar", Kind::kGrammar}};

// structured_outputs: {"json" | "regex" | "choice" | "grammar" |
// "json_object": true, "disable_any_whitespace"}; `backend` and
// `disable_fallback` are vLLM's choice of engine, which has no say here.
// Returns disable_any_whitespace.
bool ReadStructuredOutputs(const json& body, std::vector<Found>& found) {
  const json* so = Field(body, "structured_outputs");
  if (so == nullptr) return false;
  if (!so->is_object()) throw Bad("structured_outputs", StrCat("must be an object, got ", TypeName(*so)));
  bool disable_ws = false;
  for (const auto& [key, value] : so->items()) {
    const std::string field = "structured_outputs." + key;
    if (value.is_null()) continue;
    bool known = false;
    for (const auto& [name, kind] : kStructured) {
      if (key != name) continue;
      ReadConstraint(value, field, kind, found);
      known = true;
    }
    if (known || key == "backend" || key == "disable_fallback") continue;
    if (key == "json_object" || key == "disable_any_whitespace") {
      if (!value.is_boolean()) throw Bad(field, StrCat("must be a boolean, got ", TypeName(value)));
      if (key == "disable_any_whitespace") disable_ws = value.get<bool>();
      if (key == "json_object" && value.get<bool>()) found.push_back({field, {.kind = Kind::kJsonObject}});
      continue;
    }
    throw Bad(field, "not supported (json, regex, choice, grammar, json_object and disable_any_whitespace are)");
  }
  return disable_ws;
}

}  // namespace

RequestedStructure ParseStructuredOutput(const json& body) {
  if (Field(body, "guided_whitespace_pattern") != nullptr)
    throw Bad("guided_whitespace_pattern",
              "not supported: the grammar engine allows JSON whitespace or none "
              "(structured_outputs.disable_any_whitespace)");
  std::vector<Found> found;
  ReadResponseFormat(body, found);
  for (const auto& [name, kind] : kGuided) {
    if (const json* v = Field(body, name)) ReadConstraint(*v, name, kind, found);
  }
  const bool disable_ws = ReadStructuredOutputs(body, found);
  if (found.size() > 1)
    throw FieldError{found[1].field, StrCat("one structured-output constraint per request: both ", found[0].field,
                                            " and ", found[1].field, " were given")};
  // Without a constraint, disable_any_whitespace is tool_choice's to apply.
  if (found.empty()) return {.structured = {.any_whitespace = !disable_ws}};
  found[0].structured.any_whitespace = !disable_ws;
  return {std::move(found[0].structured), std::move(found[0].field)};
}

json ParseToolsField(const json& body) {
  const json* tools = Field(body, "tools");
  if (tools == nullptr) return json::array();
  if (!tools->is_array()) throw Bad("tools", StrCat("must be an array, got ", TypeName(*tools)));
  for (size_t i = 0; i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    const std::string at = StrCat("tools[", i, "]");
    if (!t.is_object() || t.value("type", json()) != "function")
      throw Bad(at + ".type", "only {\"type\": \"function\", \"function\": {...}} tools are supported");
    const json* f = Field(t, "function");
    if (f == nullptr || !f->is_object() || !f->contains("name") || !(*f)["name"].is_string() ||
        (*f)["name"].get<std::string>().empty())
      throw Bad(at + ".function.name", "required, a non-empty string");
  }
  return *tools;
}

ToolChoice ParseToolChoice(const json& body, const json& tools) {
  ToolChoice choice{.kind = tools.empty() ? ToolChoice::Kind::kNone : ToolChoice::Kind::kAuto};
  if (const json* tc = Field(body, "tool_choice")) {
    if (*tc == "none" || *tc == "auto" || *tc == "required") {
      choice.kind = *tc == "none"   ? ToolChoice::Kind::kNone
                    : *tc == "auto" ? ToolChoice::Kind::kAuto
                                    : ToolChoice::Kind::kRequired;
    } else if (tc->is_object() && tc->value("type", json()) == "function") {
      const json* f = Field(*tc, "function");
      const json* name = f != nullptr && f->is_object() ? Field(*f, "name") : nullptr;
      if (name == nullptr || !name->is_string() || name->get<std::string>().empty())
        throw Bad("tool_choice.function.name", "required, a non-empty string");
      choice = {.kind = ToolChoice::Kind::kNamed, .name = name->get<std::string>()};
    } else {
      throw Bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", ...}");
    }
  }
  if (choice.kind != ToolChoice::Kind::kNone && tools.empty()) throw Bad("tool_choice", "needs tools");
  if (choice.kind == ToolChoice::Kind::kNamed) {
    bool known = false;
    for (const json& t : tools) known = known || t["function"]["name"] == choice.name;
    if (!known)
      throw FieldError{"tool_choice", StrCat("tool_choice: the function '", choice.name, "' is not among the tools")};
  }
  return choice;
}

json ToolChoiceSchema(const ToolChoice& choice, const json& tools) {
  // A function without parameters takes none: an empty object.
  auto parameters = [](const json& f) {
    const json* p = Field(f, "parameters");
    return p != nullptr && p->is_object() && !p->empty()
               ? *p
               : json{{"type", "object"}, {"properties", json::object()}, {"additionalProperties", false}};
  };
  if (choice.kind == ToolChoice::Kind::kNamed) {
    for (const json& t : tools)
      if (t["function"]["name"] == choice.name) return parameters(t["function"]);
  }
  json any_of = json::array();
  json defs = json::object();
  for (const json& t : tools) {
    json params = parameters(t["function"]);
    if (const json* d = Field(params, "$defs"); d != nullptr && d->is_object()) {
      for (const auto& [name, schema] : d->items()) {
        if (defs.contains(name) && defs[name] != schema)
          throw Bad("tools", StrCat("the definition '", name, "' has two different schemas among the tools"));
        defs[name] = schema;
      }
      params.erase("$defs");
    }
    any_of.push_back({{"properties",
                       {{"name", {{"type", "string"}, {"enum", json::array({t["function"]["name"]})}}},
                        {"parameters", std::move(params)}}},
                      {"required", json::array({"name", "parameters"})}});
  }
  json schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"type", "object"}, {"anyOf", std::move(any_of)}}}};
  if (!defs.empty()) schema["$defs"] = std::move(defs);
  return schema;
}

std::vector<text::ToolCallDelta> ForcedToolCalls::Add(std::string_view delta) {
  std::vector<text::ToolCallDelta> out;
  if (choice_.kind == ToolChoice::Kind::kNamed) {
    if (delta.empty() && calls_ > 0) return out;
    out.push_back(
        {.index = 0, .begins = calls_ == 0, .name = calls_ == 0 ? choice_.name : "", .arguments = std::string(delta)});
    calls_ = 1;
    return out;
  }
  Scan(delta, out);
  return out;
}

// The array's elements are objects at depth 2 (the array is depth 1); the
// brackets inside strings do not count.
void ForcedToolCalls::Scan(std::string_view delta, std::vector<text::ToolCallDelta>& out) {
  for (const char ch : delta) {
    if (depth_ >= 2) element_ += ch;
    if (in_string_) {
      if (escaped_) {
        escaped_ = false;
      } else if (ch == '\\') {
        escaped_ = true;
      } else if (ch == '"') {
        in_string_ = false;
      }
      continue;
    }
    if (ch == '"') {
      in_string_ = true;
    } else if (ch == '{' || ch == '[') {
      if (++depth_ == 2) element_ = ch;
    } else if ((ch == '}' || ch == ']') && depth_ > 0 && --depth_ == 1) {
      const json e = json::parse(element_, nullptr, /*allow_exceptions=*/false);
      element_.clear();
      if (!e.is_object() || !e.contains("name") || !e["name"].is_string()) continue;
      const json args = e.contains("parameters") ? e["parameters"] : json::object();
      out.push_back({.index = calls_++,
                     .begins = true,
                     .name = e["name"].get<std::string>(),
                     .arguments = args.dump(-1, ' ', false, json::error_handler_t::replace)});
    }
  }
}

}  // namespace mlarun
