// Internal to text/: the chat-template renderer, which walks the tree
// jinja_parse builds with jinja2's semantics as transformers configures it
// (see chat_template.h for the subset).
//
// The Renderer's methods are defined by phase: statements and shared
// argument helpers in jinja_runtime.cc, expressions and operators in
// jinja_eval.cc, methods of str, dict and list in jinja_methods.cc, filters
// in jinja_filters.cc, `is` tests in jinja_tests.cc and the globals in
// jinja_globals.cc.
//
// Scopes follow jinja2: a for loop's body and a macro's body get their own
// (a `set` inside them is not seen outside; namespace() is the way out), an
// if's body does not. Runaway templates are stopped by budgets: output and
// string bytes built, steps (nodes run, loop iterations, calls), macro call
// depth, and how deep values nest.
//
// Threading: a Renderer and the Values and Scopes of its render belong to
// one thread; each render makes its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "text/jinja_parse.h"
#include "text/jinja_value.h"

namespace mlarun::text::jinja {

// A prompt is at most a few MB; these bound what a broken template can cost.
constexpr size_t kMaxOutputBytes = size_t{32} << 20;
constexpr size_t kMaxBuiltBytes = size_t{512} << 20;  // all strings built, together
constexpr int64_t kMaxSteps = 5'000'000;
constexpr int kMaxCallDepth = 100;
constexpr int64_t kMaxRangeLength = 1'000'000;
// Nesting of lists and dicts: the context's, and what the template builds.
constexpr int kMaxContextDepth = 128;
constexpr int kMaxValueDepth = 256;

// A template's variables at one level; lookups walk up the parents.
struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};

class Renderer;
using FilterFn = StatusOr<Value> (*)(Renderer&, const Value&, CallArgs&);
using TestFn = StatusOr<bool> (*)(Renderer&, const Value&, CallArgs&);

// The filters (jinja_filters.cc) and tests (jinja_tests.cc) by name.
const std::unordered_map<std::string, FilterFn>& Filters();
const std::unordered_map<std::string, TestFn>& Tests();

// Whether `obj.name` is a bound method of obj's type (str, dict or list);
// Renderer::CallMethod calls it (jinja_methods.cc).
bool HasMethod(const Value& obj, const std::string& name);

// The argument at position `pos`, or else the keyword argument `name`; null
// when neither was given.
const Value* Arg(const CallArgs& a, size_t pos, const char* name);
// An optional integer argument (def when missing or None) / a required str
// one; INVALID_ARGUMENT naming `what` otherwise.
StatusOr<int64_t> IntArg(const Value* v, int64_t def, const char* what);
StatusOr<std::string> StrArg(const Value* v, const char* what);

// Python's // and % on integers (rounding toward negative infinity; b != 0).
int64_t FloorDiv(int64_t a, int64_t b);
int64_t FloorMod(int64_t a, int64_t b);

class Renderer {
 public:
  Renderer() = default;
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;
  // Namespaces may refer to each other (even in a cycle, or a chain as long
  // as the template made it): emptying them all while every one is still held
  // here frees them without recursion and without leaking a cycle.
  ~Renderer() {
    for (const auto& ns : namespaces_) ns->attrs.items.clear();
  }

  Status Exec(const NodeList& nodes, const std::shared_ptr<Scope>& scope, std::string* out);
  StatusOr<Value> Eval(const Expr& e, const std::shared_ptr<Scope>& scope);
  // The arguments of a call, filter or test: children[1..] positional (the
  // first child is the callee or operand), then the keyword ones.
  StatusOr<CallArgs> EvalArgs(const Expr& e, const std::shared_ptr<Scope>& scope);

  // Budgets.
  Status Step(int64_t n = 1) {
    steps_ += n;
    if (steps_ > kMaxSteps) {
      return ResourceExhaustedError("chat template: rendering took more than ", kMaxSteps,
                                    " steps (loop iterations, calls, tags); a runaway template?");
    }
    return Status::Ok();
  }
  Status Charge(size_t bytes) {
    built_bytes_ += bytes;
    if (bytes > kMaxOutputBytes || built_bytes_ > kMaxBuiltBytes) {
      return ResourceExhaustedError("chat template: the rendering built more than ",
                                    bytes > kMaxOutputBytes ? kMaxOutputBytes : kMaxBuiltBytes,
                                    " bytes of text; a runaway template?");
    }
    return Status::Ok();
  }
  // Values only nest deeper by being stored and rebuilt ({% set x = [x] %}
  // in a loop), so the stores check.
  static Status CheckDepth(const Value& v, int line) {
    if (v.depth > kMaxValueDepth) {
      return ResourceExhaustedError("chat template line ", line, ": a value nests more than ", kMaxValueDepth,
                                    " lists/dicts deep; a runaway template?");
    }
    return Status::Ok();
  }
  Status Append(std::string* out, const std::string& s) {
    if (out->size() + s.size() > kMaxOutputBytes) {
      return ResourceExhaustedError("chat template: the output grew past ", kMaxOutputBytes,
                                    " bytes; a runaway template?");
    }
    MLARUN_RETURN_IF_ERROR(Charge(s.size()));
    out->append(s);
    return Status::Ok();
  }

  StatusOr<ValueList> Iterate(const Value& v);
  StatusOr<Value> GetAttr(const Value& obj, const std::string& name);
  StatusOr<Value> GetItem(const Value& obj, const Value& key);
  StatusOr<Value> CallValue(const Value& callee, CallArgs& args);
  StatusOr<Value> CallMethod(const Value& obj, const std::string& name, CallArgs& args);
  StatusOr<bool> Contains(const Value& container, const Value& item);
  StatusOr<Value> ApplyFilter(const std::string& name, const Value& input, CallArgs& args);
  StatusOr<bool> ApplyTest(const std::string& name, const Value& input, CallArgs& args);
  // x.a.b or x.0 as jinja2's attribute= arguments take it.
  StatusOr<Value> AttributePath(const Value& v, const Value& path);

  // raise_exception, strftime_now, namespace, dict and range in `root`.
  void InstallGlobals(Scope* root);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  // Statements (jinja_runtime.cc).
  Status ExecSet(const Node& n, const std::shared_ptr<Scope>& scope);
  Status ExecFor(const Node& n, const std::shared_ptr<Scope>& scope, std::string* out);
  Status ExecMacro(const Node& n, const std::shared_ptr<Scope>& scope);
  Status Assign(const Node& n, const std::vector<std::string>& targets, bool unpack, const Value& v, Scope* scope);

  // Expressions, one kind each (jinja_eval.cc).
  StatusOr<Value> EvalName(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalSequence(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalDict(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalAttr(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalItem(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalSlice(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalCall(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalTest(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalUnary(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalCompare(const Expr& e, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> EvalFilter(const Expr& e, const Value& input, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> Slice(const Expr& e, const Value& obj, const Value* start, const Value* stop, const Value* step);

  // Binary operators (jinja_eval.cc): EvalBinary dispatches on e.op.
  StatusOr<Value> EvalBinary(const Expr& e, const Value& a, const Value& b);
  StatusOr<Value> Add(const Expr& e, const Value& a, const Value& b);
  StatusOr<Value> Multiply(const Expr& e, const Value& a, const Value& b);
  StatusOr<Value> Modulo(const Expr& e, const Value& a, const Value& b);
  StatusOr<Value> Power(const Expr& e, const Value& a, const Value& b);

  // Errors: Fail names the expression and its line; Wrap does so for an
  // INVALID_ARGUMENT that does not name one yet.
  Status Fail(const Expr& e, const std::string& message) const {
    return InvalidArgumentError("chat template line ", e.line, ": `", e.text, "`: ", message);
  }
  Status Wrap(const Expr& e, const Status& s) const;
  static Status UndefinedError(const Value& v) {
    return InvalidArgumentError(v.s.empty() ? "a value is undefined" : v.s);
  }
  // "unsupported operand type(s) for OP: 'A' and 'B'" / the 64-bit limit.
  Status Unsupported(const Expr& e, const Value& a, const Value& b) const;
  Status Overflow(const Expr& e) const { return Fail(e, "integer overflow (beyond 64 bits)"); }

  Flow flow_ = Flow::kNormal;
  std::vector<std::shared_ptr<Namespace>> namespaces_;  // every namespace() made
  int64_t steps_ = 0;
  size_t built_bytes_ = 0;
  int call_depth_ = 0;
};

}  // namespace mlarun::text::jinja
