// The syntax tree of a chat template, and the lexer and parser that build it
// with the whitespace rules transformers' environment sets: trim_blocks (the
// newline right after a block or comment tag goes), lstrip_blocks (spaces and
// tabs before a block or comment tag at the start of a line go), `{%-`/`-%}`
// and `{{-`/`-}}` (all whitespace on that side goes), `{%+`/`+%}` (keeps it),
// and, as jinja2 does by default, one trailing newline of the source dropped.
//
// Parse refuses, with the construct and its line, what the interpreter does
// not implement (include, extends, import, block, call, recursive loops, ...).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "text/jinja_value.h"

namespace mlarun::text::jinja {

enum class ExprKind : int {
  kLiteral,  // literal
  kName,     // name
  kList,     // children: items
  kTuple,    // children: items
  kDict,     // children: key, value, key, value, ...
  kAttr,     // children[0].name
  kItem,     // children[0][children[1]]
  kSlice,    // children[0][children[1]:children[2]:children[3]] (each may be null)
  kCall,     // children[0](children[1..], kwargs)
  kFilter,   // children[0] | name(children[1..], kwargs)
  kTest,     // children[0] is [not] name(children[1..])
  kNeg,      // -children[0]
  kPos,      // +children[0]
  kNot,      // not children[0]
  kBinary,   // children[0] op children[1]
  kCompare,  // children[0] cmp_ops[0] children[1] cmp_ops[1] children[2] ...
  kAnd,      // children[0] and children[1]
  kOr,       // children[0] or children[1]
  kCond,     // children[0] if children[1] else children[2] (children[2] may be null)
};

enum class BinOp : int { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow, kConcat };
enum class CmpOp : int { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr {
  ExprKind kind = ExprKind::kLiteral;
  int line = 0;
  std::string text;  // the expression's source, for error messages
  Value literal;
  std::string name;
  BinOp op = BinOp::kAdd;
  std::vector<CmpOp> cmp_ops;
  bool negated = false;  // kTest: `is not`
  std::vector<std::unique_ptr<Expr>> children;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
};

enum class NodeKind : int {
  kText,      // text
  kOutput,    // {{ expr }}
  kIf,        // branches, else_body
  kFor,       // for targets in expr [if cond]: body, else_body
  kSet,       // set targets = expr, or set targets[0].attr = expr
  kSetBlock,  // set targets[0]: body (expr: filters over its text, or null)
  kMacro,     // macro name(params = defaults): body
  kBreak,
  kContinue,
  kWith,         // with targets = values: body
  kFilterBlock,  // filter expr (a kFilter chain over the body's text): body
  kScope,        // body rendered as is ({% generation %})
};

struct Node;
using NodeList = std::vector<std::unique_ptr<Node>>;

struct Node {
  NodeKind kind = NodeKind::kText;
  int line = 0;
  std::string text;
  std::unique_ptr<Expr> expr;
  std::unique_ptr<Expr> cond;
  std::vector<std::pair<std::unique_ptr<Expr>, NodeList>> branches;
  NodeList body;
  NodeList else_body;
  std::vector<std::string> targets;
  bool unpack = false;  // targets came as a tuple (`for k, v in ...`)
  std::string attr;
  std::string name;
  std::vector<std::string> params;
  std::vector<std::unique_ptr<Expr>> defaults;  // per param; null when none
  std::vector<std::unique_ptr<Expr>> values;
};

// The template's nodes. INVALID_ARGUMENT for a syntax error or a construct
// outside the subset: "chat template line N: ...".
StatusOr<NodeList> ParseTemplate(const std::string& source);

// The filters and tests the interpreter implements (jinja_filters.cc,
// jinja_tests.cc); Parse refuses any other name, as jinja2 does when it
// compiles.
bool IsKnownFilter(const std::string& name);
bool IsKnownTest(const std::string& name);

// The advice every refusal ends with.
inline constexpr char kRenderYourselfHint[] = "; render the prompt yourself and send it to /v1/completions as `prompt`";

}  // namespace mlarun::text::jinja
