// The chat-template interpreter: walks the tree jinja_parse builds, with
// jinja2's semantics as transformers configures it (see chat_template.h).
// This file holds the public entry points (ChatTemplate::Parse, Render);
// the engine is split by phase: jinja_parse (lexer and parser),
// jinja_value (values), jinja_runtime and jinja_eval (statements and
// expressions), jinja_methods, jinja_filters, jinja_tests, jinja_globals,
// and jinja_string (Python's str semantics).
//
// The subset:
//   statements  if/elif/else, for (tuple targets, `if` filter, else, the
//               loop object: index index0 revindex revindex0 first last
//               length previtem nextitem depth cycle()), break/continue,
//               set (names, tuples, ns.attr, block set with filters), with, macro and
//               calls of macros (positional, keyword, defaults), filter
//               blocks, raw, comments, transformers' {% generation %}.
//   expressions literals, lists, tuples, dicts, attribute/subscript/slice,
//               + - * / // % ** ~, comparisons (chained), in / not in,
//               and/or/not, conditional expressions, `str % values`.
//   globals     raise_exception, strftime_now, namespace, range, dict.
//   filters     see Filters() (jinja_filters.cc); tests: see Tests()
//               (jinja_tests.cc); methods of str
//               (split strip startswith replace find format join ...), of
//               dict (get items keys values) and of list (index count).
// Values print as Python prints them (True, None, 1.0, reprs of lists and
// dicts, dict_items([...]) views).
//
// Where it differs from Python: integers are 64-bit (overflow is an error,
// not a big int); case mapping covers ASCII, Latin-1, Latin Extended-A,
// Greek and Cyrillic; range() is a list (it prints as one).
#include "text/chat_template.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_parse.h"
#include "text/jinja_runtime.h"
#include "text/jinja_value.h"

namespace mlarun::text {
namespace {

using jinja::kMaxContextDepth;
using jinja::NodeList;
using jinja::Renderer;
using jinja::Scope;

// The context's nesting, measured without recursion (it comes from a
// request).
Status CheckContextDepth(const nlohmann::ordered_json& context) {
  std::vector<std::pair<const nlohmann::ordered_json*, int>> stack = {{&context, 1}};
  while (!stack.empty()) {
    auto [j, depth] = stack.back();
    stack.pop_back();
    if (depth > kMaxContextDepth) {
      return InvalidArgumentError("chat template: the context nests more than ", kMaxContextDepth,
                                  " arrays/objects deep");
    }
    if (j->is_structured()) {
      for (const auto& child : *j) {
        if (child.is_structured()) stack.emplace_back(&child, depth + 1);
      }
    }
  }
  return Status::Ok();
}

class ChatTemplateImpl final : public ChatTemplate {
 public:
  explicit ChatTemplateImpl(NodeList nodes) : nodes_(std::move(nodes)) {}

  using ChatTemplate::Render;
  StatusOr<std::string> Render(const nlohmann::ordered_json& context) const override {
    if (!context.is_object() && !context.is_null()) {
      return InvalidArgumentError("chat template: the context must be a JSON object, not ", context.type_name());
    }
    Renderer renderer;
    auto root = std::make_shared<Scope>();
    renderer.InstallGlobals(root.get());
    auto vars = std::make_shared<Scope>();
    vars->parent = root;
    if (context.is_object()) {
      MLARUN_RETURN_IF_ERROR(CheckContextDepth(context));
      for (auto it = context.begin(); it != context.end(); ++it) vars->vars[it.key()] = jinja::FromJson(it.value());
    }
    std::string out;
    MLARUN_RETURN_IF_ERROR(renderer.Exec(nodes_, vars, &out));
    return out;
  }

 private:
  const NodeList nodes_;
};

}  // namespace

StatusOr<std::shared_ptr<const ChatTemplate>> ChatTemplate::Parse(const std::string& source) {
  NodeList nodes;
  MLARUN_ASSIGN_OR_RETURN(nodes, jinja::ParseTemplate(source));
  return std::shared_ptr<const ChatTemplate>(std::make_shared<ChatTemplateImpl>(std::move(nodes)));
}

}  // namespace mlarun::text
