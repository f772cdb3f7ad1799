// The chat-template interpreter: walks the tree jinja_parse builds, with
// jinja2's semantics as transformers configures it (see chat_template.h).
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
//   filters     see Filters(); tests: see Tests(); methods of str
//               (split strip startswith replace find format join ...), of
//               dict (get items keys values) and of list (index count).
// Values print as Python prints them (True, None, 1.0, reprs of lists and
// dicts, dict_items([...]) views).
//
// Where it differs from Python: integers are 64-bit (overflow is an error,
// not a big int); case mapping covers ASCII, Latin-1, Latin Extended-A,
// Greek and Cyrillic; range() is a list (it prints as one).
//
// Scopes follow jinja2: a for loop's body and a macro's body get their own
// (a `set` inside them is not seen outside; namespace() is the way out), an
// if's body does not. Runaway templates are stopped by budgets: output and
// string bytes built, steps (nodes run, loop iterations, calls), macro call
// depth, and how deep values nest.
#include "text/chat_template.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <unordered_map>

#include "text/jinja_parse.h"
#include "text/jinja_value.h"

namespace mlarun::text {
namespace {

using jinja::BinOp;
using jinja::CallArgs;
using jinja::CmpOp;
using jinja::Dict;
using jinja::Expr;
using jinja::ExprKind;
using jinja::Kind;
using jinja::Node;
using jinja::NodeKind;
using jinja::NodeList;
using jinja::Value;
using jinja::ValueList;

// A prompt is at most a few MB; these bound what a broken template can cost.
constexpr size_t kMaxOutputBytes = size_t{32} << 20;
constexpr size_t kMaxBuiltBytes = size_t{512} << 20;  // all strings built, together
constexpr int64_t kMaxSteps = 5'000'000;
constexpr int kMaxCallDepth = 100;
constexpr int64_t kMaxRangeLength = 1'000'000;
// Nesting of lists and dicts: the context's, and what the template builds.
constexpr int kMaxContextDepth = 128;
constexpr int kMaxValueDepth = 256;

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};

// Errors a template raises itself (raise_exception) or that already name
// their expression pass through the call sites unchanged.
bool Named(const Status& s) { return s.message().rfind("chat template", 0) == 0; }

// Simple case mappings, as Python's str.lower/upper do them, for the scripts
// prompts mostly use: ASCII, Latin-1, Latin Extended-A, Greek and the basic
// Cyrillic alphabet (ß upper-cases to "SS"; Greek final sigma is not
// special-cased). Other code points keep their case.
char32_t LowerCp(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 32;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x130 || c == 0x131 || c == 0x138 || c == 0x149 || c == 0x17F) return c;
    if (c == 0x178) return 0xFF;
    bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
    bool is_upper = odd_upper ? (c % 2 == 1) : (c % 2 == 0);
    return is_upper ? c + 1 : c;
  }
  if ((c >= 0x391 && c <= 0x3AB && c != 0x3A2)) return c + 32;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 37;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 63;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  return c;
}

char32_t UpperCp(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  if (c == 0xB5) return 0x39C;
  if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 32;
  if (c == 0xFF) return 0x178;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x131) return 'I';
    if (c == 0x17F) return 'S';
    if (c == 0x130 || c == 0x138 || c == 0x149 || c == 0x178) return c;
    bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
    bool is_lower = odd_upper ? (c % 2 == 0) : (c % 2 == 1);
    return is_lower ? c - 1 : c;
  }
  if (c == 0x3C2) return 0x3A3;
  if (c >= 0x3B1 && c <= 0x3CB) return c - 32;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 37;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 63;
  if (c >= 0x430 && c <= 0x44F) return c - 32;
  if (c >= 0x450 && c <= 0x45F) return c - 80;
  return c;
}

bool IsLowerCp(char32_t c) { return UpperCp(c) != c || c == 0xDF || c == 0x138 || c == 0x149; }
bool IsUpperCp(char32_t c) { return LowerCp(c) != c || c == 0x130; }
bool IsCasedCp(char32_t c) { return IsLowerCp(c) || IsUpperCp(c); }

void AppendUpper(std::string* out, char32_t c) {
  if (c == 0xDF) {
    *out += "SS";
  } else {
    jinja::AppendUtf8(out, UpperCp(c));
  }
}

std::string PyLower(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : jinja::DecodeUtf8(s)) jinja::AppendUtf8(&out, LowerCp(c));
  return out;
}
std::string PyUpper(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : jinja::DecodeUtf8(s)) AppendUpper(&out, c);
  return out;
}

bool IsAsciiAlpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// Python's str.strip/lstrip/rstrip (chars: the set to strip; null:
// whitespace).
std::string Strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::u32string u = jinja::DecodeUtf8(s);
  std::u32string set;
  bool use_set = chars != nullptr && chars->is_string();
  if (use_set) set = jinja::DecodeUtf8(chars->s);
  auto strip_it = [&](char32_t c) { return use_set ? set.find(c) != std::u32string::npos : jinja::IsPyWhitespace(c); };
  size_t b = 0, e = u.size();
  if (left) {
    while (b < e && strip_it(u[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(u[e - 1])) --e;
  }
  return jinja::EncodeUtf8(std::u32string_view(u).substr(b, e - b));
}

// Python's str.split / rsplit.
ValueList Split(const std::string& s, const Value* sep, int64_t maxsplit, bool from_right) {
  ValueList out;
  if (sep == nullptr || sep->is_none()) {
    std::u32string u = jinja::DecodeUtf8(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && jinja::IsPyWhitespace(u[i])) ++i;
      if (i >= u.size()) break;
      size_t j = i;
      while (j < u.size() && !jinja::IsPyWhitespace(u[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit) {
      if (!from_right) {
        size_t rest = words[maxsplit].first;  // the remainder keeps its trailing whitespace
        words.resize(maxsplit);
        words.emplace_back(rest, u.size());
      } else {
        size_t keep_from = words.size() - maxsplit;
        size_t begin = 0;  // the remainder keeps its leading whitespace
        std::vector<std::pair<size_t, size_t>> w2;
        w2.emplace_back(begin, words[keep_from - 1].second);
        for (size_t k = keep_from; k < words.size(); ++k) w2.push_back(words[k]);
        words = std::move(w2);
      }
    }
    for (auto [b, e] : words) out.push_back(Value::Str(jinja::EncodeUtf8(std::u32string_view(u).substr(b, e - b))));
    return out;
  }
  const std::string& d = sep->s;
  std::vector<std::string> parts;
  if (!from_right) {
    size_t pos = 0;
    int64_t n = 0;
    while (maxsplit < 0 || n < maxsplit) {
      size_t f = s.find(d, pos);
      if (f == std::string::npos) break;
      parts.push_back(s.substr(pos, f - pos));
      pos = f + d.size();
      ++n;
    }
    parts.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    int64_t n = 0;
    std::vector<std::string> rev;
    while (maxsplit < 0 || n < maxsplit) {
      if (end < d.size()) break;
      size_t f = s.rfind(d, end - d.size());
      if (f == std::string::npos) break;
      rev.push_back(s.substr(f + d.size(), end - f - d.size()));
      end = f;
      ++n;
    }
    rev.push_back(s.substr(0, end));
    parts.assign(rev.rbegin(), rev.rend());
  }
  for (auto& p : parts) out.push_back(Value::Str(std::move(p)));
  return out;
}

// Python's str.replace.
std::string Replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    std::u32string u = jinja::DecodeUtf8(s);
    int64_t n = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (i < u.size()) jinja::AppendUtf8(&out, u[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    size_t f = s.find(old, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += repl;
    pos = f + old.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// Python's str.title: a cased letter after an uncased character starts a
// word (upper case), the rest of the word goes lower case.
std::string PyTitle(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t c : jinja::DecodeUtf8(s)) {
    if (prev_cased) {
      jinja::AppendUtf8(&out, LowerCp(c));
    } else if (c == 0xDF) {
      out += "Ss";
    } else {
      jinja::AppendUtf8(&out, UpperCp(c));
    }
    prev_cased = IsCasedCp(c);
  }
  return out;
}

// Python's str.capitalize: the first character title case, the rest lower.
std::string PyCapitalize(const std::string& s) {
  std::u32string u = jinja::DecodeUtf8(s);
  std::string out;
  for (size_t k = 0; k < u.size(); ++k) {
    if (k > 0) {
      jinja::AppendUtf8(&out, LowerCp(u[k]));
    } else if (u[k] == 0xDF) {
      out += "Ss";
    } else {
      jinja::AppendUtf8(&out, UpperCp(u[k]));
    }
  }
  return out;
}

// jinja2's title filter: each word (split at whitespace, '-', '(', '{', '['
// and '<') gets its first character upper case and the rest lower case.
std::string JinjaTitle(const std::string& s) {
  std::string out;
  bool word_start = true;
  for (char32_t c : jinja::DecodeUtf8(s)) {
    bool sep = jinja::IsPyWhitespace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      jinja::AppendUtf8(&out, c);
      word_start = true;
      continue;
    }
    if (word_start) {
      AppendUpper(&out, c);
    } else {
      jinja::AppendUtf8(&out, LowerCp(c));
    }
    word_start = false;
  }
  return out;
}

int64_t FloorDiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t FloorMod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

const Value* Arg(const CallArgs& a, size_t pos, const char* name) {
  if (pos < a.args.size()) return &a.args[pos];
  for (const auto& [k, v] : a.kwargs) {
    if (k == name) return &v;
  }
  return nullptr;
}

// Python's `str % value` for %s %r %d %i %f %x %%, flags and widths as
// printf reads them (value: one value, or a tuple of them).
StatusOr<std::string> PrintfFormat(const std::string& fmt, const Value& v) {
  ValueList args;
  if (v.is_list() && v.tuple) {
    args = *v.list;
  } else {
    args.push_back(v);
  }
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    size_t j = i + 1;
    while (j < fmt.size() && std::strchr("-+ #0123456789.", fmt[j]) != nullptr) ++j;
    if (j >= fmt.size()) return InvalidArgumentError("incomplete format");
    std::string spec = fmt.substr(i + 1, j - i - 1);
    char conv = fmt[j];
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (next >= args.size()) return InvalidArgumentError("not enough arguments for format string");
    const Value& a = args[next++];
    char buf[512];
    if (conv == 's' || conv == 'r') {
      std::string s = conv == 's' ? jinja::ToStr(a) : jinja::Repr(a);
      if (spec.empty()) {
        out += s;
      } else {
        std::snprintf(buf, sizeof(buf), ("%" + spec + "s").c_str(), s.c_str());
        out += buf;
      }
    } else if (conv == 'd' || conv == 'i' || conv == 'x' || conv == 'X' || conv == 'o') {
      if (!a.is_number())
        return InvalidArgumentError("%", conv, " format: a real number is required, not ", jinja::TypeName(a));
      long long x = a.kind == Kind::kFloat ? static_cast<long long>(a.f) : a.as_int();
      std::snprintf(buf, sizeof(buf), ("%" + spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(), x);
      out += buf;
    } else if (conv == 'f' || conv == 'F' || conv == 'e' || conv == 'E' || conv == 'g' || conv == 'G') {
      if (!a.is_number()) return InvalidArgumentError("must be real number, not ", jinja::TypeName(a));
      std::snprintf(buf, sizeof(buf), ("%" + spec + conv).c_str(), a.as_double());
      out += buf;
    } else {
      return InvalidArgumentError("unsupported format character '", std::string(1, conv), "'");
    }
  }
  if (next < args.size()) return InvalidArgumentError("not all arguments converted during string formatting");
  return out;
}

class Renderer;
using FilterFn = StatusOr<Value> (*)(Renderer&, const Value&, CallArgs&);
using TestFn = StatusOr<bool> (*)(Renderer&, const Value&, CallArgs&);

const std::unordered_map<std::string, FilterFn>& Filters();
const std::unordered_map<std::string, TestFn>& Tests();

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
  StatusOr<CallArgs> EvalArgs(const Expr& e, const std::shared_ptr<Scope>& scope) {
    CallArgs args;
    for (size_t k = 1; k < e.children.size(); ++k) {
      Value v;
      MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[k], scope));
      args.args.push_back(std::move(v));
    }
    for (const auto& [k, x] : e.kwargs) {
      Value v;
      MLARUN_ASSIGN_OR_RETURN(v, Eval(*x, scope));
      args.kwargs.emplace_back(k, std::move(v));
    }
    return args;
  }

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

  void InstallGlobals(Scope* root);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  Status ExecFor(const Node& n, const std::shared_ptr<Scope>& scope, std::string* out);
  Status ExecMacro(const Node& n, const std::shared_ptr<Scope>& scope);
  Status Assign(const Node& n, const std::vector<std::string>& targets, bool unpack, const Value& v, Scope* scope);
  StatusOr<Value> EvalBinary(const Expr& e, const Value& a, const Value& b);
  StatusOr<Value> EvalFilter(const Expr& e, const Value& input, const std::shared_ptr<Scope>& scope);
  StatusOr<Value> Slice(const Expr& e, const Value& obj, const Value* start, const Value* stop, const Value* step);
  Status Fail(const Expr& e, const std::string& message) const {
    return InvalidArgumentError("chat template line ", e.line, ": `", e.text, "`: ", message);
  }
  Status Wrap(const Expr& e, const Status& s) const {
    if (Named(s) || s.code() != StatusCode::kInvalidArgument) return s;
    return Fail(e, s.message());
  }
  static Status UndefinedError(const Value& v) {
    return InvalidArgumentError(v.s.empty() ? "a value is undefined" : v.s);
  }

  Flow flow_ = Flow::kNormal;
  std::vector<std::shared_ptr<jinja::Namespace>> namespaces_;  // every namespace() made
  int64_t steps_ = 0;
  size_t built_bytes_ = 0;
  int call_depth_ = 0;
};

// ----- statements -----

Status Renderer::Exec(const NodeList& nodes, const std::shared_ptr<Scope>& scope, std::string* out) {
  for (const auto& np : nodes) {
    const Node& n = *np;
    MLARUN_RETURN_IF_ERROR(Step());
    switch (n.kind) {
      case NodeKind::kText:
        MLARUN_RETURN_IF_ERROR(Append(out, n.text));
        break;
      case NodeKind::kOutput: {
        Value v;
        MLARUN_ASSIGN_OR_RETURN(v, Eval(*n.expr, scope));
        MLARUN_RETURN_IF_ERROR(Append(out, jinja::ToStr(v)));
        break;
      }
      case NodeKind::kIf: {
        const NodeList* chosen = &n.else_body;
        for (const auto& [cond, body] : n.branches) {
          Value c;
          MLARUN_ASSIGN_OR_RETURN(c, Eval(*cond, scope));
          if (jinja::Truthy(c)) {
            chosen = &body;
            break;
          }
        }
        MLARUN_RETURN_IF_ERROR(Exec(*chosen, scope, out));
        break;
      }
      case NodeKind::kFor:
        MLARUN_RETURN_IF_ERROR(ExecFor(n, scope, out));
        break;
      case NodeKind::kSet: {
        Value v;
        MLARUN_ASSIGN_OR_RETURN(v, Eval(*n.expr, scope));
        MLARUN_RETURN_IF_ERROR(CheckDepth(v, n.line));
        if (!n.attr.empty()) {
          Value target = Value::Undefined("'" + n.targets[0] + "' is undefined");
          for (Scope* s = scope.get(); s != nullptr; s = s->parent.get()) {
            auto it = s->vars.find(n.targets[0]);
            if (it != s->vars.end()) {
              target = it->second;
              break;
            }
          }
          if (target.kind != Kind::kNamespace) {
            return InvalidArgumentError("chat template line ", n.line, ": {% set ", n.targets[0], ".", n.attr,
                                        " %}: cannot assign an attribute of a ", jinja::TypeName(target),
                                        " (only of a namespace())");
          }
          target.ns->attrs.Set(n.attr, std::move(v));
        } else {
          MLARUN_RETURN_IF_ERROR(Assign(n, n.targets, n.unpack, v, scope.get()));
        }
        break;
      }
      case NodeKind::kSetBlock: {
        std::string text;
        MLARUN_RETURN_IF_ERROR(Exec(n.body, scope, &text));
        if (n.expr) {
          Value v;
          MLARUN_ASSIGN_OR_RETURN(v, EvalFilter(*n.expr, Value::Str(std::move(text)), scope));
          scope->vars[n.targets[0]] = std::move(v);
        } else {
          scope->vars[n.targets[0]] = Value::Str(std::move(text));
        }
        break;
      }
      case NodeKind::kMacro:
        MLARUN_RETURN_IF_ERROR(ExecMacro(n, scope));
        break;
      case NodeKind::kBreak:
        flow_ = Flow::kBreak;
        return Status::Ok();
      case NodeKind::kContinue:
        flow_ = Flow::kContinue;
        return Status::Ok();
      case NodeKind::kWith: {
        auto inner = std::make_shared<Scope>();
        inner->parent = scope;
        for (size_t k = 0; k < n.targets.size(); ++k) {
          Value v;
          MLARUN_ASSIGN_OR_RETURN(v, Eval(*n.values[k], scope));
          MLARUN_RETURN_IF_ERROR(CheckDepth(v, n.line));
          inner->vars[n.targets[k]] = std::move(v);
        }
        MLARUN_RETURN_IF_ERROR(Exec(n.body, inner, out));
        break;
      }
      case NodeKind::kFilterBlock: {
        std::string text;
        MLARUN_RETURN_IF_ERROR(Exec(n.body, scope, &text));
        Value v;
        MLARUN_ASSIGN_OR_RETURN(v, EvalFilter(*n.expr, Value::Str(std::move(text)), scope));
        MLARUN_RETURN_IF_ERROR(Append(out, jinja::ToStr(v)));
        break;
      }
      case NodeKind::kScope:
        MLARUN_RETURN_IF_ERROR(Exec(n.body, scope, out));
        break;
    }
    if (flow_ != Flow::kNormal) return Status::Ok();
  }
  return Status::Ok();
}

Status Renderer::Assign(const Node& n, const std::vector<std::string>& targets, bool unpack, const Value& v,
                        Scope* scope) {
  if (!unpack) {
    scope->vars[targets[0]] = v;
    return Status::Ok();
  }
  ValueList items;
  if (v.is_undefined()) {
    return InvalidArgumentError("chat template line ", n.line, ": cannot unpack an undefined value (", v.s, ")");
  }
  MLARUN_ASSIGN_OR_RETURN(items, Iterate(v));
  if (items.size() != targets.size()) {
    return InvalidArgumentError("chat template line ", n.line, ": cannot unpack ", items.size(), " values into ",
                                targets.size(), " names");
  }
  for (size_t k = 0; k < targets.size(); ++k) scope->vars[targets[k]] = items[k];
  return Status::Ok();
}

Status Renderer::ExecFor(const Node& n, const std::shared_ptr<Scope>& scope, std::string* out) {
  Value seq;
  MLARUN_ASSIGN_OR_RETURN(seq, Eval(*n.expr, scope));
  // A list is iterated in place (no copy); other iterables are listed first.
  std::shared_ptr<const ValueList> listed;
  if (seq.is_list()) {
    listed = seq.list;
  } else {
    auto r = Iterate(seq);
    if (!r.ok()) return Wrap(*n.expr, r.status());
    listed = std::make_shared<const ValueList>(std::move(r).value());
  }
  if (n.cond) {
    ValueList kept;
    for (const Value& item : *listed) {
      MLARUN_RETURN_IF_ERROR(Step());
      auto s = std::make_shared<Scope>();
      s->parent = scope;
      MLARUN_RETURN_IF_ERROR(Assign(n, n.targets, n.unpack, item, s.get()));
      Value c;
      MLARUN_ASSIGN_OR_RETURN(c, Eval(*n.cond, s));
      if (jinja::Truthy(c)) kept.push_back(item);
    }
    listed = std::make_shared<const ValueList>(std::move(kept));
  }
  const ValueList& items = *listed;
  if (items.empty()) {
    auto s = std::make_shared<Scope>();
    s->parent = scope;
    return Exec(n.else_body, s, out);
  }
  const int64_t length = static_cast<int64_t>(items.size());
  // The loop object: built once, then copied and updated per iteration (its
  // keys in this fixed order).
  enum : size_t { kIndex, kIndex0, kRevindex, kRevindex0, kFirst, kLast, kPrev, kNext };
  auto position = std::make_shared<int64_t>(0);
  Dict proto;
  for (const char* key : {"index", "index0", "revindex", "revindex0", "first", "last", "previtem", "nextitem"}) {
    proto.items.emplace_back(key, Value());
  }
  proto.items.emplace_back("length", Value::Int(length));
  proto.items.emplace_back("depth", Value::Int(1));
  proto.items.emplace_back("depth0", Value::Int(0));
  proto.items.emplace_back("cycle", Value::MakeCallable("loop.cycle", [position](CallArgs& a) -> StatusOr<Value> {
                             if (a.args.empty()) return InvalidArgumentError("loop.cycle() needs at least one value");
                             return a.args[static_cast<size_t>(*position) % a.args.size()];
                           }));
  for (int64_t k = 0; k < length; ++k) {
    MLARUN_RETURN_IF_ERROR(Step());
    auto s = std::make_shared<Scope>();
    s->parent = scope;
    MLARUN_RETURN_IF_ERROR(Assign(n, n.targets, n.unpack, items[k], s.get()));
    *position = k;
    Dict loop = proto;
    loop.items[kIndex].second = Value::Int(k + 1);
    loop.items[kIndex0].second = Value::Int(k);
    loop.items[kRevindex].second = Value::Int(length - k);
    loop.items[kRevindex0].second = Value::Int(length - k - 1);
    loop.items[kFirst].second = Value::Bool(k == 0);
    loop.items[kLast].second = Value::Bool(k == length - 1);
    loop.items[kPrev].second = k > 0 ? items[k - 1] : Value::Undefined("there is no previous item");
    loop.items[kNext].second = k + 1 < length ? items[k + 1] : Value::Undefined("there is no next item");
    s->vars["loop"] = Value::MakeDict(std::move(loop));
    MLARUN_RETURN_IF_ERROR(Exec(n.body, s, out));
    if (flow_ == Flow::kBreak) {
      flow_ = Flow::kNormal;
      break;
    }
    flow_ = Flow::kNormal;
  }
  return Status::Ok();
}

Status Renderer::ExecMacro(const Node& n, const std::shared_ptr<Scope>& scope) {
  std::weak_ptr<Scope> defined_in = scope;
  const Node* node = &n;
  Renderer* self = this;
  scope->vars[n.name] = Value::MakeCallable(
      n.name,
      [self, node, defined_in](CallArgs& a) -> StatusOr<Value> {
        std::shared_ptr<Scope> parent = defined_in.lock();
        if (!parent) {
          return InvalidArgumentError("chat template line ", node->line, ": macro '", node->name,
                                      "' was called after its scope ended");
        }
        if (a.args.size() > node->params.size()) {
          return InvalidArgumentError("chat template line ", node->line, ": macro '", node->name,
                                      "' takes not more than ", node->params.size(), " argument(s)");
        }
        if (++self->call_depth_ > kMaxCallDepth) {
          --self->call_depth_;
          return ResourceExhaustedError("chat template: macro calls nest deeper than ", kMaxCallDepth,
                                        "; a runaway template?");
        }
        MLARUN_RETURN_IF_ERROR(self->Step());
        auto s = std::make_shared<Scope>();
        s->parent = parent;
        for (const auto& [k, v] : a.kwargs) {
          if (std::find(node->params.begin(), node->params.end(), k) == node->params.end()) {
            --self->call_depth_;
            return InvalidArgumentError("chat template line ", node->line, ": macro '", node->name,
                                        "' has no parameter named '", k, "'");
          }
        }
        for (size_t p = 0; p < node->params.size(); ++p) {
          const Value* given = p < a.args.size() ? &a.args[p] : nullptr;
          for (const auto& [k, v] : a.kwargs) {
            if (k == node->params[p]) given = &v;
          }
          if (given != nullptr) {
            if (Status st = CheckDepth(*given, node->line); !st.ok()) {
              --self->call_depth_;
              return st;
            }
            s->vars[node->params[p]] = *given;
          } else if (node->defaults[p]) {
            auto d = self->Eval(*node->defaults[p], s);
            if (!d.ok()) {
              --self->call_depth_;
              return d.status();
            }
            s->vars[node->params[p]] = std::move(d).value();
          } else {
            s->vars[node->params[p]] =
                Value::Undefined("parameter '" + node->params[p] + "' of macro '" + node->name + "' was not given");
          }
        }
        std::string text;
        Status st = self->Exec(node->body, s, &text);
        self->flow_ = Flow::kNormal;
        --self->call_depth_;
        if (!st.ok()) return st;
        return Value::Str(std::move(text));
      },
      /*is_macro=*/true);
  return Status::Ok();
}

// ----- expressions -----

StatusOr<ValueList> Renderer::Iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return ValueList{};
    case Kind::kList:
      return *v.list;
    case Kind::kDict: {
      ValueList keys;
      keys.reserve(v.dict->items.size());
      for (const auto& kv : v.dict->items) keys.push_back(Value::Str(kv.first));
      return keys;
    }
    case Kind::kString: {
      ValueList chars;
      for (char32_t c : jinja::DecodeUtf8(v.s)) {
        std::string one;
        jinja::AppendUtf8(&one, c);
        chars.push_back(Value::Str(std::move(one)));
      }
      return chars;
    }
    default:
      return InvalidArgumentError("'", jinja::TypeName(v), "' object is not iterable");
  }
}

StatusOr<Value> Renderer::GetAttr(const Value& obj, const std::string& name) {
  static const char* kStrMethods[] = {"split",      "rsplit",       "strip",       "lstrip",  "rstrip",  "startswith",
                                      "endswith",   "replace",      "upper",       "lower",   "title",   "capitalize",
                                      "find",       "rfind",        "index",       "count",   "format",  "join",
                                      "isdigit",    "isalpha",      "isalnum",     "isspace", "islower", "isupper",
                                      "splitlines", "removeprefix", "removesuffix"};
  static const char* kDictMethods[] = {"get", "items", "keys", "values"};
  static const char* kListMethods[] = {"index", "count"};
  auto bound = [&](const char* const* names, size_t n) -> bool {
    for (size_t k = 0; k < n; ++k) {
      if (name == names[k]) return true;
    }
    return false;
  };
  auto method = [this, &obj, &name]() {
    Value self = obj;
    std::string m = name;
    return Value::MakeCallable(name, [this, self, m](CallArgs& a) { return CallMethod(self, m, a); });
  };
  switch (obj.kind) {
    case Kind::kUndefined:
      return UndefinedError(obj);
    case Kind::kDict: {
      if (bound(kDictMethods, std::size(kDictMethods))) return method();
      const Value* v = obj.dict->Find(name);
      if (v != nullptr) return *v;
      return Value::Undefined("'dict object' has no attribute '" + name + "'");
    }
    case Kind::kNamespace: {
      const Value* v = obj.ns->attrs.Find(name);
      if (v != nullptr) return *v;
      return Value::Undefined("'Namespace object' has no attribute '" + name + "'");
    }
    case Kind::kString:
      if (bound(kStrMethods, std::size(kStrMethods))) return method();
      break;
    case Kind::kList:
      if (bound(kListMethods, std::size(kListMethods))) return method();
      break;
    default:
      break;
  }
  return Value::Undefined("'" + jinja::TypeName(obj) + " object' has no attribute '" + name + "'");
}

StatusOr<Value> Renderer::GetItem(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Kind::kUndefined:
      return UndefinedError(obj);
    case Kind::kDict:
      if (key.is_string()) {
        const Value* v = obj.dict->Find(key.s);
        if (v != nullptr) return *v;
        return GetAttr(obj, key.s).value();
      }
      return Value::Undefined("'dict object' has no attribute " + jinja::Repr(key));
    case Kind::kList:
    case Kind::kString: {
      if (!key.is_integral()) {
        if (key.is_string()) return GetAttr(obj, key.s);
        return Value::Undefined("'" + jinja::TypeName(obj) + " object' has no attribute " + jinja::Repr(key));
      }
      int64_t i = key.as_int();
      if (obj.is_list()) {
        int64_t n = static_cast<int64_t>(obj.list->size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::Undefined(jinja::TypeName(obj) + " index out of range");
        return (*obj.list)[i];
      }
      std::u32string u = jinja::DecodeUtf8(obj.s);
      int64_t n = static_cast<int64_t>(u.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::Undefined("string index out of range");
      std::string one;
      jinja::AppendUtf8(&one, u[i]);
      return Value::Str(std::move(one));
    }
    case Kind::kNamespace:
      if (key.is_string()) return GetAttr(obj, key.s);
      break;
    default:
      break;
  }
  return Value::Undefined("'" + jinja::TypeName(obj) + " object' has no attribute " + jinja::Repr(key));
}

StatusOr<Value> Renderer::Slice(const Expr& e, const Value& obj, const Value* start, const Value* stop,
                                const Value* step) {
  if (obj.is_undefined()) return Fail(e, UndefinedError(obj).message());
  if (!obj.is_list() && !obj.is_string()) return Fail(e, "'" + jinja::TypeName(obj) + "' object is not subscriptable");
  auto as_index = [&](const Value* v, const char* what) -> StatusOr<std::optional<int64_t>> {
    if (v == nullptr || v->is_none()) return std::optional<int64_t>();
    if (!v->is_integral()) return Fail(e, std::string("slice ") + what + " must be an integer or None");
    return std::optional<int64_t>(v->as_int());
  };
  std::optional<int64_t> b, en, st;
  MLARUN_ASSIGN_OR_RETURN(b, as_index(start, "start"));
  MLARUN_ASSIGN_OR_RETURN(en, as_index(stop, "stop"));
  MLARUN_ASSIGN_OR_RETURN(st, as_index(step, "step"));
  int64_t stp = st.value_or(1);
  if (stp == 0) return Fail(e, "slice step cannot be zero");
  std::u32string u;
  int64_t n;
  if (obj.is_string()) {
    u = jinja::DecodeUtf8(obj.s);
    n = static_cast<int64_t>(u.size());
  } else {
    n = static_cast<int64_t>(obj.list->size());
  }
  // CPython's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = stp < 0 ? -1 : 0;
    } else if (x >= n) {
      x = stp < 0 ? n - 1 : n;
    }
    return x;
  };
  int64_t lo = adjust(b, stp < 0 ? n - 1 : 0);
  int64_t hi = adjust(en, stp < 0 ? -1 : n);
  std::vector<int64_t> idx;
  if (stp > 0) {
    for (int64_t i = lo; i < hi; i += stp) idx.push_back(i);
  } else {
    for (int64_t i = lo; i > hi; i += stp) idx.push_back(i);
  }
  MLARUN_RETURN_IF_ERROR(Step(static_cast<int64_t>(idx.size())));
  if (obj.is_string()) {
    std::u32string r;
    for (int64_t i : idx) r.push_back(u[i]);
    return Value::Str(jinja::EncodeUtf8(r));
  }
  ValueList r;
  for (int64_t i : idx) r.push_back((*obj.list)[i]);
  return Value::List(std::move(r), obj.tuple);
}

StatusOr<Value> Renderer::CallValue(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) return UndefinedError(callee);
  if (callee.kind != Kind::kCallable) {
    return InvalidArgumentError("'", jinja::TypeName(callee), "' object is not callable");
  }
  MLARUN_RETURN_IF_ERROR(Step());
  return callee.fn->fn(args);
}

StatusOr<bool> Renderer::Contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      if (!item.is_string()) {
        return InvalidArgumentError("'in <string>' requires string as left operand, not ", jinja::TypeName(item));
      }
      return container.s.find(item.s) != std::string::npos;
    case Kind::kList:
      for (const Value& v : *container.list) {
        if (jinja::Equal(v, item)) return true;
      }
      return false;
    case Kind::kDict:
      return item.is_string() && container.dict->Find(item.s) != nullptr;
    default:
      return InvalidArgumentError("argument of type '", jinja::TypeName(container), "' is not iterable");
  }
}

StatusOr<Value> Renderer::EvalBinary(const Expr& e, const Value& a, const Value& b) {
  if (e.op == BinOp::kConcat) {
    std::string s = jinja::ToStr(a) + jinja::ToStr(b);
    MLARUN_RETURN_IF_ERROR(Charge(s.size()));
    return Value::Str(std::move(s));
  }
  if (a.is_undefined()) return Fail(e, UndefinedError(a).message());
  if (b.is_undefined()) return Fail(e, UndefinedError(b).message());
  static const char* kSymbols[] = {"+", "-", "*", "/", "//", "%", "**", "~"};
  auto unsupported = [&]() {
    return Fail(e, std::string("unsupported operand type(s) for ") + kSymbols[static_cast<int>(e.op)] + ": '" +
                       jinja::TypeName(a) + "' and '" + jinja::TypeName(b) + "'");
  };
  auto overflow = [&]() { return Fail(e, "integer overflow (beyond 64 bits)"); };
  const bool ints = a.is_integral() && b.is_integral();
  const bool nums = a.is_number() && b.is_number();
  switch (e.op) {
    case BinOp::kAdd:
      if (ints) {
        int64_t r;
        if (__builtin_add_overflow(a.as_int(), b.as_int(), &r)) return overflow();
        return Value::Int(r);
      }
      if (nums) return Value::Float(a.as_double() + b.as_double());
      if (a.is_string() && b.is_string()) {
        MLARUN_RETURN_IF_ERROR(Charge(a.s.size() + b.s.size()));
        return Value::Str(a.s + b.s);
      }
      if (a.is_list() && b.is_list() && a.tuple == b.tuple) {
        ValueList r = *a.list;
        r.insert(r.end(), b.list->begin(), b.list->end());
        MLARUN_RETURN_IF_ERROR(Step(static_cast<int64_t>(r.size())));
        return Value::List(std::move(r), a.tuple);
      }
      if (a.is_string()) return Fail(e, "can only concatenate str (not \"" + jinja::TypeName(b) + "\") to str");
      if (a.is_list()) return Fail(e, "can only concatenate list (not \"" + jinja::TypeName(b) + "\") to list");
      return unsupported();
    case BinOp::kSub:
      if (ints) {
        int64_t r;
        if (__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) return overflow();
        return Value::Int(r);
      }
      if (nums) return Value::Float(a.as_double() - b.as_double());
      return unsupported();
    case BinOp::kMul: {
      if (ints) {
        int64_t r;
        if (__builtin_mul_overflow(a.as_int(), b.as_int(), &r)) return overflow();
        return Value::Int(r);
      }
      if (nums) return Value::Float(a.as_double() * b.as_double());
      const Value* seq = (a.is_string() || a.is_list()) && b.is_integral() ? &a : nullptr;
      const Value* times = &b;
      if (seq == nullptr && (b.is_string() || b.is_list()) && a.is_integral()) {
        seq = &b;
        times = &a;
      }
      if (seq == nullptr) return unsupported();
      int64_t t = std::max<int64_t>(0, times->as_int());
      if (seq->is_string()) {
        if (!seq->s.empty() && t > static_cast<int64_t>(kMaxOutputBytes / seq->s.size())) {
          return Charge(kMaxOutputBytes + 1);
        }
        MLARUN_RETURN_IF_ERROR(Charge(seq->s.size() * static_cast<size_t>(t)));
        std::string r;
        r.reserve(seq->s.size() * static_cast<size_t>(t));
        for (int64_t k = 0; k < t; ++k) r += seq->s;
        return Value::Str(std::move(r));
      }
      if (!seq->list->empty() && t > kMaxRangeLength / static_cast<int64_t>(seq->list->size())) {
        return Step(kMaxSteps + 1);
      }
      ValueList r;
      for (int64_t k = 0; k < t; ++k) r.insert(r.end(), seq->list->begin(), seq->list->end());
      MLARUN_RETURN_IF_ERROR(Step(static_cast<int64_t>(r.size())));
      return Value::List(std::move(r), seq->tuple);
    }
    case BinOp::kDiv:
      if (!nums) return unsupported();
      if (b.as_double() == 0) return Fail(e, "division by zero");
      return Value::Float(a.as_double() / b.as_double());
    case BinOp::kFloorDiv:
      if (!nums) return unsupported();
      if (b.as_double() == 0) return Fail(e, "integer division or modulo by zero");
      if (ints) {
        if (a.as_int() == INT64_MIN && b.as_int() == -1) return overflow();
        return Value::Int(FloorDiv(a.as_int(), b.as_int()));
      }
      return Value::Float(std::floor(a.as_double() / b.as_double()));
    case BinOp::kMod:
      if (a.is_string()) {
        auto r = PrintfFormat(a.s, b);
        if (!r.ok()) return Fail(e, r.status().message());
        MLARUN_RETURN_IF_ERROR(Charge(r->size()));
        return Value::Str(std::move(r).value());
      }
      if (!nums) return unsupported();
      if (b.as_double() == 0) return Fail(e, "integer division or modulo by zero");
      if (ints) {
        if (b.as_int() == -1) return Value::Int(0);
        return Value::Int(FloorMod(a.as_int(), b.as_int()));
      }
      {
        double m = std::fmod(a.as_double(), b.as_double());
        if (m != 0 && ((m < 0) != (b.as_double() < 0))) m += b.as_double();
        return Value::Float(m);
      }
    case BinOp::kPow:
      if (!nums) return unsupported();
      if (ints && b.as_int() >= 0) {
        int64_t base = a.as_int(), r = 1;
        for (int64_t k = 0; k < b.as_int(); ++k) {
          if (__builtin_mul_overflow(r, base, &r)) return overflow();
          if (r == 0 || r == 1) break;
          if (r == -1 && k < b.as_int()) {
            r = (b.as_int() % 2 == 0) ? 1 : -1;
            break;
          }
        }
        return Value::Int(r);
      }
      return Value::Float(std::pow(a.as_double(), b.as_double()));
    case BinOp::kConcat:
      break;
  }
  return unsupported();
}

StatusOr<Value> Renderer::EvalFilter(const Expr& e, const Value& block_input, const std::shared_ptr<Scope>& scope) {
  // The innermost operand of a {% filter %} block is a placeholder for the
  // block's text.
  Value input;
  if (e.children[0]->kind == ExprKind::kLiteral && e.children[0]->text == "(block)") {
    input = block_input;
  } else if (e.children[0]->kind == ExprKind::kFilter) {
    MLARUN_ASSIGN_OR_RETURN(input, EvalFilter(*e.children[0], block_input, scope));
  } else {
    MLARUN_ASSIGN_OR_RETURN(input, Eval(*e.children[0], scope));
  }
  CallArgs args;
  MLARUN_ASSIGN_OR_RETURN(args, EvalArgs(e, scope));
  auto r = ApplyFilter(e.name, input, args);
  if (!r.ok()) return Wrap(e, r.status());
  return r;
}

StatusOr<Value> Renderer::ApplyFilter(const std::string& name, const Value& input, CallArgs& args) {
  auto it = Filters().find(name);
  if (it == Filters().end()) return InvalidArgumentError("no filter named '", name, "'");
  MLARUN_RETURN_IF_ERROR(Step());
  return it->second(*this, input, args);
}

StatusOr<bool> Renderer::ApplyTest(const std::string& name, const Value& input, CallArgs& args) {
  auto it = Tests().find(name);
  if (it == Tests().end()) return InvalidArgumentError("no test named '", name, "'");
  MLARUN_RETURN_IF_ERROR(Step());
  return it->second(*this, input, args);
}

StatusOr<Value> Renderer::AttributePath(const Value& v, const Value& path) {
  if (path.is_integral()) return GetItem(v, path);
  Value cur = v;
  std::string p = jinja::ToStr(path);
  size_t pos = 0;
  while (true) {
    size_t dot = p.find('.', pos);
    std::string part = p.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (numeric) {
      MLARUN_ASSIGN_OR_RETURN(cur, GetItem(cur, Value::Int(std::stoll(part))));
    } else {
      MLARUN_ASSIGN_OR_RETURN(cur, GetItem(cur, Value::Str(part)));
    }
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

StatusOr<Value> Renderer::Eval(const Expr& e, const std::shared_ptr<Scope>& scope) {
  switch (e.kind) {
    case ExprKind::kLiteral:
      return e.literal;
    case ExprKind::kName:
      for (Scope* s = scope.get(); s != nullptr; s = s->parent.get()) {
        auto it = s->vars.find(e.name);
        if (it != s->vars.end()) return it->second;
      }
      return Value::Undefined("'" + e.name + "' is undefined");
    case ExprKind::kList:
    case ExprKind::kTuple: {
      ValueList items;
      for (const auto& c : e.children) {
        Value v;
        MLARUN_ASSIGN_OR_RETURN(v, Eval(*c, scope));
        items.push_back(std::move(v));
      }
      return Value::List(std::move(items), e.kind == ExprKind::kTuple);
    }
    case ExprKind::kDict: {
      Dict d;
      for (size_t k = 0; k + 1 < e.children.size(); k += 2) {
        Value key, v;
        MLARUN_ASSIGN_OR_RETURN(key, Eval(*e.children[k], scope));
        MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[k + 1], scope));
        if (!key.is_string()) return Fail(e, "only str keys are supported in dict literals");
        d.Set(key.s, std::move(v));
      }
      return Value::MakeDict(std::move(d));
    }
    case ExprKind::kAttr: {
      Value obj;
      MLARUN_ASSIGN_OR_RETURN(obj, Eval(*e.children[0], scope));
      auto r = GetAttr(obj, e.name);
      if (!r.ok()) return Wrap(e, r.status());
      return r;
    }
    case ExprKind::kItem: {
      Value obj, key;
      MLARUN_ASSIGN_OR_RETURN(obj, Eval(*e.children[0], scope));
      MLARUN_ASSIGN_OR_RETURN(key, Eval(*e.children[1], scope));
      auto r = GetItem(obj, key);
      if (!r.ok()) return Wrap(e, r.status());
      return r;
    }
    case ExprKind::kSlice: {
      Value obj;
      MLARUN_ASSIGN_OR_RETURN(obj, Eval(*e.children[0], scope));
      Value parts[3];
      const Value* ptrs[3] = {nullptr, nullptr, nullptr};
      for (int k = 0; k < 3; ++k) {
        if (e.children[k + 1]) {
          MLARUN_ASSIGN_OR_RETURN(parts[k], Eval(*e.children[k + 1], scope));
          ptrs[k] = &parts[k];
        }
      }
      return Slice(e, obj, ptrs[0], ptrs[1], ptrs[2]);
    }
    case ExprKind::kCall: {
      Value callee;
      MLARUN_ASSIGN_OR_RETURN(callee, Eval(*e.children[0], scope));
      CallArgs args;
      MLARUN_ASSIGN_OR_RETURN(args, EvalArgs(e, scope));
      auto r = CallValue(callee, args);
      if (!r.ok()) return Wrap(e, r.status());
      return r;
    }
    case ExprKind::kFilter:
      return EvalFilter(e, Value(), scope);
    case ExprKind::kTest: {
      Value input;
      MLARUN_ASSIGN_OR_RETURN(input, Eval(*e.children[0], scope));
      CallArgs args;
      MLARUN_ASSIGN_OR_RETURN(args, EvalArgs(e, scope));
      auto r = ApplyTest(e.name, input, args);
      if (!r.ok()) return Wrap(e, r.status());
      return Value::Bool(*r != e.negated);
    }
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      Value v;
      MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[0], scope));
      if (v.is_undefined()) return Fail(e, UndefinedError(v).message());
      if (!v.is_number()) {
        return Fail(e, std::string("bad operand type for unary ") + (e.kind == ExprKind::kNeg ? "-" : "+") + ": '" +
                           jinja::TypeName(v) + "'");
      }
      if (e.kind == ExprKind::kPos) return v.kind == Kind::kBool ? Value::Int(v.as_int()) : v;
      if (v.kind == Kind::kFloat) return Value::Float(-v.f);
      if (v.as_int() == INT64_MIN) return Fail(e, "integer overflow (beyond 64 bits)");
      return Value::Int(-v.as_int());
    }
    case ExprKind::kNot: {
      Value v;
      MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[0], scope));
      return Value::Bool(!jinja::Truthy(v));
    }
    case ExprKind::kAnd:
    case ExprKind::kOr: {
      Value a;
      MLARUN_ASSIGN_OR_RETURN(a, Eval(*e.children[0], scope));
      bool t = jinja::Truthy(a);
      if (e.kind == ExprKind::kAnd ? !t : t) return a;
      return Eval(*e.children[1], scope);
    }
    case ExprKind::kCond: {
      Value c;
      MLARUN_ASSIGN_OR_RETURN(c, Eval(*e.children[1], scope));
      if (jinja::Truthy(c)) return Eval(*e.children[0], scope);
      if (e.children[2]) return Eval(*e.children[2], scope);
      return Value::Undefined("the conditional expression `" + e.text + "` had no else branch");
    }
    case ExprKind::kBinary: {
      Value a, b;
      MLARUN_ASSIGN_OR_RETURN(a, Eval(*e.children[0], scope));
      MLARUN_ASSIGN_OR_RETURN(b, Eval(*e.children[1], scope));
      return EvalBinary(e, a, b);
    }
    case ExprKind::kCompare: {
      Value left;
      MLARUN_ASSIGN_OR_RETURN(left, Eval(*e.children[0], scope));
      for (size_t k = 0; k < e.cmp_ops.size(); ++k) {
        Value right;
        MLARUN_ASSIGN_OR_RETURN(right, Eval(*e.children[k + 1], scope));
        bool r = false;
        CmpOp op = e.cmp_ops[k];
        if (op == CmpOp::kEq || op == CmpOp::kNe) {
          r = jinja::Equal(left, right) == (op == CmpOp::kEq);
        } else if (op == CmpOp::kIn || op == CmpOp::kNotIn) {
          auto c = Contains(right, left);
          if (!c.ok()) return Wrap(e, c.status());
          r = *c == (op == CmpOp::kIn);
        } else {
          if (left.is_undefined()) return Fail(e, UndefinedError(left).message());
          if (right.is_undefined()) return Fail(e, UndefinedError(right).message());
          auto c = jinja::Compare(left, right);
          if (!c.ok()) {
            static const char* kSym[] = {"==", "!=", "<", "<=", ">", ">=", "in", "not in"};
            std::string msg = c.status().message();
            size_t q = msg.find("'<'");
            if (q != std::string::npos) msg.replace(q, 3, std::string("'") + kSym[static_cast<int>(op)] + "'");
            return Fail(e, msg);
          }
          int cv = *c;
          r = op == CmpOp::kLt ? cv < 0 : op == CmpOp::kLe ? cv <= 0 : op == CmpOp::kGt ? cv > 0 : cv >= 0;
        }
        if (!r) return Value::Bool(false);
        left = std::move(right);
      }
      return Value::Bool(true);
    }
  }
  return Fail(e, "unknown expression");
}

// ----- methods of str, dict and list -----

StatusOr<int64_t> IntArg(const Value* v, int64_t def, const char* what) {
  if (v == nullptr || v->is_none()) return def;
  if (!v->is_integral()) return InvalidArgumentError(what, " must be an integer, not ", jinja::TypeName(*v));
  return v->as_int();
}

StatusOr<std::string> StrArg(const Value* v, const char* what) {
  if (v == nullptr) return InvalidArgumentError(what, " is missing");
  if (!v->is_string()) return InvalidArgumentError(what, " must be a str, not ", jinja::TypeName(*v));
  return v->s;
}

// Python's str.format with {}, {0}, {name} and {{ }} (no format specs).
StatusOr<std::string> PyFormat(const std::string& fmt, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '{' && i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    if (c == '}' && i + 1 < fmt.size() && fmt[i + 1] == '}') {
      out += '}';
      ++i;
      continue;
    }
    if (c == '}') return InvalidArgumentError("Single '}' encountered in format string");
    if (c != '{') {
      out += c;
      continue;
    }
    size_t close = fmt.find('}', i);
    if (close == std::string::npos) return InvalidArgumentError("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    if (field.find_first_of(":!") != std::string::npos) {
      return InvalidArgumentError("format specs and conversions in str.format are not supported");
    }
    const Value* v = nullptr;
    if (field.empty()) {
      if (auto_index >= a.args.size()) return InvalidArgumentError("Replacement index ", auto_index, " out of range");
      v = &a.args[auto_index++];
    } else if (std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
      size_t idx = std::stoul(field);
      if (idx >= a.args.size()) return InvalidArgumentError("Replacement index ", idx, " out of range");
      v = &a.args[idx];
    } else {
      for (const auto& [k, x] : a.kwargs) {
        if (k == field) v = &x;
      }
      if (v == nullptr) return InvalidArgumentError("KeyError: '", field, "'");
    }
    out += jinja::ToStr(*v);
    i = close;
  }
  return out;
}

// Code point offsets of `sub` in `s` (find/rfind/count/index).
int64_t FindCp(const std::u32string& s, const std::u32string& sub, int64_t start, int64_t end, bool reverse) {
  int64_t n = static_cast<int64_t>(s.size());
  if (start < 0) start = std::max<int64_t>(0, start + n);
  if (end < 0) end = std::max<int64_t>(0, end + n);
  end = std::min(end, n);
  int64_t m = static_cast<int64_t>(sub.size());
  if (start > end || end - start < m) return -1;
  if (!reverse) {
    for (int64_t i = start; i + m <= end; ++i) {
      if (s.compare(i, m, sub) == 0) return i;
    }
  } else {
    for (int64_t i = end - m; i >= start; --i) {
      if (s.compare(i, m, sub) == 0) return i;
    }
  }
  return -1;
}

StatusOr<Value> Renderer::CallMethod(const Value& obj, const std::string& name, CallArgs& a) {
  if (obj.is_dict()) {
    const Dict& d = *obj.dict;
    if (name == "get") {
      const Value* key = Arg(a, 0, "key");
      if (key == nullptr) return InvalidArgumentError("get expected at least 1 argument, got 0");
      const Value* def = Arg(a, 1, "default");
      const Value* v = key->is_string() ? d.Find(key->s) : nullptr;
      if (v != nullptr) return *v;
      return def != nullptr ? *def : Value::None();
    }
    ValueList out;
    for (const auto& [k, v] : d.items) {
      if (name == "keys") {
        out.push_back(Value::Str(k));
      } else if (name == "values") {
        out.push_back(v);
      } else {
        out.push_back(Value::List({Value::Str(k), v}, /*tuple=*/true));
      }
    }
    Value r = Value::List(std::move(out));
    r.view = name == "keys" ? "dict_keys" : name == "values" ? "dict_values" : "dict_items";
    return r;
  }
  if (obj.is_list()) {
    const Value* x = Arg(a, 0, "value");
    if (x == nullptr) return InvalidArgumentError(name, "() takes exactly one argument (0 given)");
    int64_t count = 0;
    for (size_t k = 0; k < obj.list->size(); ++k) {
      if (jinja::Equal((*obj.list)[k], *x)) {
        if (name == "index") return Value::Int(static_cast<int64_t>(k));
        ++count;
      }
    }
    if (name == "index") return InvalidArgumentError(jinja::Repr(*x), " is not in list");
    return Value::Int(count);
  }
  const std::string& s = obj.s;
  if (name == "split" || name == "rsplit") {
    const Value* sep = Arg(a, 0, "sep");
    if (sep != nullptr && !sep->is_none()) {
      if (!sep->is_string()) return InvalidArgumentError("must be str or None, not ", jinja::TypeName(*sep));
      if (sep->s.empty()) return InvalidArgumentError("empty separator");
    }
    int64_t maxsplit;
    MLARUN_ASSIGN_OR_RETURN(maxsplit, IntArg(Arg(a, 1, "maxsplit"), -1, "maxsplit"));
    ValueList parts = Split(s, sep, maxsplit, name == "rsplit");
    MLARUN_RETURN_IF_ERROR(Step(static_cast<int64_t>(parts.size())));
    return Value::List(std::move(parts));
  }
  if (name == "splitlines") {
    ValueList parts;
    size_t pos = 0;
    while (pos < s.size()) {
      size_t nl = s.find_first_of("\r\n", pos);
      if (nl == std::string::npos) {
        parts.push_back(Value::Str(s.substr(pos)));
        break;
      }
      parts.push_back(Value::Str(s.substr(pos, nl - pos)));
      pos = nl + ((s[nl] == '\r' && nl + 1 < s.size() && s[nl + 1] == '\n') ? 2 : 1);
    }
    return Value::List(std::move(parts));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const Value* chars = Arg(a, 0, "chars");
    if (chars != nullptr && !chars->is_none() && !chars->is_string()) {
      return InvalidArgumentError(name, " arg must be None or str");
    }
    return Value::Str(Strip(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "startswith" || name == "endswith") {
    const Value* p = Arg(a, 0, "prefix");
    if (p == nullptr) return InvalidArgumentError(name, "() takes at least 1 argument (0 given)");
    ValueList options;
    if (p->is_list() && p->tuple) {
      options = *p->list;
    } else {
      options.push_back(*p);
    }
    for (const Value& o : options) {
      if (!o.is_string()) {
        return InvalidArgumentError(name, " first arg must be str or a tuple of str, not ", jinja::TypeName(o));
      }
      bool hit = name == "startswith"
                     ? s.compare(0, o.s.size(), o.s) == 0
                     : (s.size() >= o.s.size() && s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0);
      if (hit) return Value::Bool(true);
    }
    return Value::Bool(false);
  }
  if (name == "replace") {
    std::string old, repl;
    MLARUN_ASSIGN_OR_RETURN(old, StrArg(Arg(a, 0, "old"), "replace() old"));
    MLARUN_ASSIGN_OR_RETURN(repl, StrArg(Arg(a, 1, "new"), "replace() new"));
    int64_t count;
    MLARUN_ASSIGN_OR_RETURN(count, IntArg(Arg(a, 2, "count"), -1, "count"));
    std::string r = Replace(s, old, repl, count);
    MLARUN_RETURN_IF_ERROR(Charge(r.size()));
    return Value::Str(std::move(r));
  }
  if (name == "upper") return Value::Str(PyUpper(s));
  if (name == "lower") return Value::Str(PyLower(s));
  if (name == "title") return Value::Str(PyTitle(s));
  if (name == "capitalize") return Value::Str(PyCapitalize(s));
  if (name == "find" || name == "rfind" || name == "index" || name == "count") {
    std::string sub;
    MLARUN_ASSIGN_OR_RETURN(sub, StrArg(Arg(a, 0, "sub"), (name + "() argument").c_str()));
    std::u32string u = jinja::DecodeUtf8(s), us = jinja::DecodeUtf8(sub);
    int64_t start, end;
    MLARUN_ASSIGN_OR_RETURN(start, IntArg(Arg(a, 1, "start"), 0, "start"));
    MLARUN_ASSIGN_OR_RETURN(end, IntArg(Arg(a, 2, "end"), static_cast<int64_t>(u.size()), "end"));
    if (name == "count") {
      int64_t n = 0, pos = start;
      if (us.empty()) {
        int64_t len = static_cast<int64_t>(u.size());
        int64_t b = start < 0 ? std::max<int64_t>(0, start + len) : std::min(start, len);
        int64_t e = end < 0 ? std::max<int64_t>(0, end + len) : std::min(end, len);
        return Value::Int(b > e ? 0 : e - b + 1);
      }
      while (true) {
        int64_t f = FindCp(u, us, pos, end, false);
        if (f < 0) break;
        ++n;
        pos = f + static_cast<int64_t>(us.size());
      }
      return Value::Int(n);
    }
    int64_t f = FindCp(u, us, start, end, name == "rfind");
    if (name == "index" && f < 0) return InvalidArgumentError("substring not found");
    return Value::Int(f);
  }
  if (name == "format") {
    std::string r;
    MLARUN_ASSIGN_OR_RETURN(r, PyFormat(s, a));
    MLARUN_RETURN_IF_ERROR(Charge(r.size()));
    return Value::Str(std::move(r));
  }
  if (name == "join") {
    const Value* it = Arg(a, 0, "iterable");
    if (it == nullptr) return InvalidArgumentError("join() takes exactly one argument (0 given)");
    ValueList items;
    MLARUN_ASSIGN_OR_RETURN(items, Iterate(*it));
    std::string r;
    for (size_t k = 0; k < items.size(); ++k) {
      if (!items[k].is_string()) {
        return InvalidArgumentError("sequence item ", k, ": expected str instance, ", jinja::TypeName(items[k]),
                                    " found");
      }
      if (k > 0) r += s;
      r += items[k].s;
      MLARUN_RETURN_IF_ERROR(Charge(items[k].s.size() + s.size()));
    }
    return Value::Str(std::move(r));
  }
  if (name == "removeprefix" || name == "removesuffix") {
    std::string p;
    MLARUN_ASSIGN_OR_RETURN(p, StrArg(Arg(a, 0, "prefix"), (name + "() argument").c_str()));
    if (name == "removeprefix" && s.compare(0, p.size(), p) == 0) return Value::Str(s.substr(p.size()));
    if (name == "removesuffix" && !p.empty() && s.size() >= p.size() &&
        s.compare(s.size() - p.size(), p.size(), p) == 0) {
      return Value::Str(s.substr(0, s.size() - p.size()));
    }
    return Value::Str(s);
  }
  // is* predicates (ASCII classes).
  std::u32string u = jinja::DecodeUtf8(s);
  auto all = [&](auto pred) { return !u.empty() && std::all_of(u.begin(), u.end(), pred); };
  if (name == "isdigit") return Value::Bool(all([](char32_t c) { return c >= '0' && c <= '9'; }));
  if (name == "isalpha") return Value::Bool(all([](char32_t c) { return IsAsciiAlpha(c); }));
  if (name == "isalnum") return Value::Bool(all([](char32_t c) { return IsAsciiAlpha(c) || (c >= '0' && c <= '9'); }));
  if (name == "isspace") return Value::Bool(all([](char32_t c) { return jinja::IsPyWhitespace(c); }));
  if (name == "islower" || name == "isupper") {
    bool cased = false, ok = true;
    for (char32_t c : u) {
      if (IsLowerCp(c)) {
        cased = true;
        if (name == "isupper") ok = false;
      } else if (IsUpperCp(c)) {
        cased = true;
        if (name == "islower") ok = false;
      }
    }
    return Value::Bool(cased && ok);
  }
  return InvalidArgumentError("'str' object has no method '", name, "'");
}

// ----- filters -----

StatusOr<Value> FLength(Renderer&, const Value& v, CallArgs&) {
  switch (v.kind) {
    case Kind::kUndefined:
      return Value::Int(0);
    case Kind::kString:
      return Value::Int(static_cast<int64_t>(jinja::DecodeUtf8(v.s).size()));
    case Kind::kList:
      return Value::Int(static_cast<int64_t>(v.list->size()));
    case Kind::kDict:
      return Value::Int(static_cast<int64_t>(v.dict->items.size()));
    default:
      return InvalidArgumentError("object of type '", jinja::TypeName(v), "' has no len()");
  }
}

StatusOr<Value> FDefault(Renderer&, const Value& v, CallArgs& a) {
  const Value* def = Arg(a, 0, "default_value");
  const Value* boolean = Arg(a, 1, "boolean");
  bool use = v.is_undefined() || (boolean != nullptr && jinja::Truthy(*boolean) && !jinja::Truthy(v));
  if (!use) return v;
  return def != nullptr ? *def : Value::Str("");
}

StatusOr<Value> FTrim(Renderer&, const Value& v, CallArgs& a) {
  const Value* chars = Arg(a, 0, "chars");
  return Value::Str(Strip(jinja::ToStr(v), chars != nullptr && chars->is_string() ? chars : nullptr, true, true));
}

StatusOr<Value> FUpper(Renderer&, const Value& v, CallArgs&) { return Value::Str(PyUpper(jinja::ToStr(v))); }
StatusOr<Value> FLower(Renderer&, const Value& v, CallArgs&) { return Value::Str(PyLower(jinja::ToStr(v))); }
StatusOr<Value> FCapitalize(Renderer&, const Value& v, CallArgs&) { return Value::Str(PyCapitalize(jinja::ToStr(v))); }
StatusOr<Value> FTitle(Renderer&, const Value& v, CallArgs&) { return Value::Str(JinjaTitle(jinja::ToStr(v))); }
StatusOr<Value> FString(Renderer&, const Value& v, CallArgs&) { return Value::Str(jinja::ToStr(v)); }
StatusOr<Value> FSafe(Renderer&, const Value& v, CallArgs&) { return v; }

StatusOr<Value> FEscape(Renderer& r, const Value& v, CallArgs&) {
  std::string out;
  for (char c : jinja::ToStr(v)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
}

StatusOr<Value> FJoin(Renderer& r, const Value& v, CallArgs& a) {
  const Value* sep = Arg(a, 0, "d");
  const Value* attr = Arg(a, 1, "attribute");
  std::string d = sep != nullptr ? jinja::ToStr(*sep) : "";
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  std::string out;
  for (size_t k = 0; k < items.size(); ++k) {
    Value item = items[k];
    if (attr != nullptr) {
      MLARUN_ASSIGN_OR_RETURN(item, r.AttributePath(item, *attr));
    }
    if (k > 0) out += d;
    std::string s = jinja::ToStr(item);
    MLARUN_RETURN_IF_ERROR(r.Charge(s.size() + d.size()));
    out += s;
  }
  return Value::Str(std::move(out));
}

StatusOr<Value> FReplace(Renderer& r, const Value& v, CallArgs& a) {
  const Value* old = Arg(a, 0, "old");
  const Value* repl = Arg(a, 1, "new");
  if (old == nullptr || repl == nullptr) return InvalidArgumentError("replace needs the old and the new string");
  int64_t count;
  MLARUN_ASSIGN_OR_RETURN(count, IntArg(Arg(a, 2, "count"), -1, "count"));
  std::string out = Replace(jinja::ToStr(v), jinja::ToStr(*old), jinja::ToStr(*repl), count);
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
}

StatusOr<Value> FToJson(Renderer& r, const Value& v, CallArgs& a) {
  const Value* indent = Arg(a, 0, "indent");
  const Value* sort_keys = nullptr;
  for (const auto& [k, x] : a.kwargs) {
    if (k == "sort_keys") sort_keys = &x;
  }
  int ind = -1;
  if (indent != nullptr && !indent->is_none()) {
    if (!indent->is_integral()) return InvalidArgumentError("tojson: indent must be an integer");
    ind = static_cast<int>(std::clamp<int64_t>(indent->as_int(), 0, 64));
  }
  std::string out;
  MLARUN_ASSIGN_OR_RETURN(out, jinja::ToJson(v, ind, sort_keys != nullptr && jinja::Truthy(*sort_keys)));
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
}

// Python's int(str) / float(str): surrounding whitespace and underscores
// between digits allowed.
bool ParsePyInt(const std::string& text, int64_t base, int64_t* out) {
  std::string t = Strip(text, nullptr, true, true);
  std::string digits;
  for (size_t k = 0; k < t.size(); ++k) {
    if (t[k] == '_' && k > 0 && k + 1 < t.size() && t[k - 1] != '_') continue;
    digits += t[k];
  }
  if (digits.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(digits.c_str(), &end, static_cast<int>(base));
  if (errno != 0 || end == digits.c_str() || *end != '\0') return false;
  *out = v;
  return true;
}
bool ParsePyFloat(const std::string& text, double* out) {
  std::string t = Strip(text, nullptr, true, true);
  if (t.empty()) return false;
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (end == t.c_str() || *end != '\0') return false;
  *out = v;
  return true;
}

StatusOr<Value> FInt(Renderer&, const Value& v, CallArgs& a) {
  const Value* def = Arg(a, 0, "default");
  int64_t base;
  MLARUN_ASSIGN_OR_RETURN(base, IntArg(Arg(a, 1, "base"), 10, "base"));
  Value fallback = def != nullptr ? *def : Value::Int(0);
  if (v.is_integral()) return Value::Int(v.as_int());
  if (v.kind == Kind::kFloat) {
    if (!std::isfinite(v.f) || std::fabs(v.f) > 9.2e18) return fallback;
    return Value::Int(static_cast<int64_t>(v.f));
  }
  if (v.is_string()) {
    int64_t i;
    if (ParsePyInt(v.s, base, &i)) return Value::Int(i);
    double d;
    if (base == 10 && ParsePyFloat(v.s, &d) && std::isfinite(d) && std::fabs(d) < 9.2e18) {
      return Value::Int(static_cast<int64_t>(d));
    }
  }
  return fallback;
}

StatusOr<Value> FFloat(Renderer&, const Value& v, CallArgs& a) {
  const Value* def = Arg(a, 0, "default");
  Value fallback = def != nullptr ? *def : Value::Float(0.0);
  if (v.is_number()) return Value::Float(v.as_double());
  double d;
  if (v.is_string() && ParsePyFloat(v.s, &d)) return Value::Float(d);
  return fallback;
}

StatusOr<Value> FFirst(Renderer& r, const Value& v, CallArgs&) {
  if (v.is_undefined()) return v;
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  if (items.empty()) return Value::Undefined("No first item, sequence was empty.");
  return items.front();
}

StatusOr<Value> FLast(Renderer& r, const Value& v, CallArgs&) {
  if (v.is_undefined()) return v;
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  if (items.empty()) return Value::Undefined("No last item, sequence was empty.");
  return items.back();
}

StatusOr<Value> FList(Renderer& r, const Value& v, CallArgs&) {
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  return Value::List(std::move(items));
}

StatusOr<Value> FItems(Renderer& r, const Value& v, CallArgs& a) {
  if (v.is_undefined()) return Value::List({});
  if (!v.is_dict()) return InvalidArgumentError("can only get item pairs from a mapping, not ", jinja::TypeName(v));
  Value items;
  MLARUN_ASSIGN_OR_RETURN(items, r.CallMethod(v, "items", a));
  items.view = nullptr;
  return items;
}

StatusOr<Value> FAbs(Renderer&, const Value& v, CallArgs&) {
  if (v.kind == Kind::kFloat) return Value::Float(std::fabs(v.f));
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) return InvalidArgumentError("integer overflow");
    return Value::Int(std::llabs(v.as_int()));
  }
  return InvalidArgumentError("bad operand type for abs(): '", jinja::TypeName(v), "'");
}

StatusOr<Value> FRound(Renderer&, const Value& v, CallArgs& a) {
  int64_t precision;
  MLARUN_ASSIGN_OR_RETURN(precision, IntArg(Arg(a, 0, "precision"), 0, "precision"));
  const Value* method = Arg(a, 1, "method");
  std::string m = method != nullptr ? jinja::ToStr(*method) : "common";
  if (!v.is_number()) return InvalidArgumentError("type ", jinja::TypeName(v), " doesn't define __round__ method");
  if (m != "common" && m != "floor" && m != "ceil") {
    return InvalidArgumentError("method must be common, ceil or floor");
  }
  if (v.is_integral() && m == "common") return Value::Int(v.as_int());
  double x = v.as_double();
  double scale = std::pow(10.0, static_cast<double>(precision));
  double y;
  if (m == "floor") {
    y = std::floor(x * scale) / scale;
  } else if (m == "ceil") {
    y = std::ceil(x * scale) / scale;
  } else {
    y = std::nearbyint(x * scale) / scale;  // round half to even, as Python's round
  }
  return Value::Float(y);
}

StatusOr<Value> FReverse(Renderer& r, const Value& v, CallArgs&) {
  if (v.is_string()) {
    std::u32string u = jinja::DecodeUtf8(v.s);
    std::reverse(u.begin(), u.end());
    return Value::Str(jinja::EncodeUtf8(u));
  }
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  std::reverse(items.begin(), items.end());
  return Value::List(std::move(items));
}

// The key sort, unique, min and max compare by: the attribute, lower-cased
// for strings unless case_sensitive.
StatusOr<Value> SortKey(Renderer& r, const Value& v, const Value* attr, bool case_sensitive) {
  Value k = v;
  if (attr != nullptr && !attr->is_none()) {
    MLARUN_ASSIGN_OR_RETURN(k, r.AttributePath(v, *attr));
  }
  if (!case_sensitive && k.is_string()) return Value::Str(PyLower(k.s));
  return k;
}

StatusOr<Value> FSort(Renderer& r, const Value& v, CallArgs& a) {
  const Value* rev = Arg(a, 0, "reverse");
  const Value* cs = Arg(a, 1, "case_sensitive");
  const Value* attr = Arg(a, 2, "attribute");
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  std::vector<std::pair<Value, Value>> keyed;
  for (const Value& item : items) {
    Value k;
    MLARUN_ASSIGN_OR_RETURN(k, SortKey(r, item, attr, cs != nullptr && jinja::Truthy(*cs)));
    keyed.emplace_back(std::move(k), item);
  }
  Status error;
  bool descending = rev != nullptr && jinja::Truthy(*rev);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    auto c = descending ? jinja::Compare(y.first, x.first) : jinja::Compare(x.first, y.first);
    if (!c.ok()) {
      if (error.ok()) error = c.status();
      return false;
    }
    return *c < 0;
  });
  MLARUN_RETURN_IF_ERROR(error);
  ValueList out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return Value::List(std::move(out));
}

StatusOr<Value> FUnique(Renderer& r, const Value& v, CallArgs& a) {
  const Value* cs = Arg(a, 0, "case_sensitive");
  const Value* attr = Arg(a, 1, "attribute");
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  ValueList out, seen;
  for (const Value& item : items) {
    Value k;
    MLARUN_ASSIGN_OR_RETURN(k, SortKey(r, item, attr, cs != nullptr && jinja::Truthy(*cs)));
    bool dup = false;
    for (const Value& s : seen) {
      if (jinja::Equal(s, k)) dup = true;
    }
    MLARUN_RETURN_IF_ERROR(r.Step(static_cast<int64_t>(seen.size())));
    if (dup) continue;
    seen.push_back(k);
    out.push_back(item);
  }
  return Value::List(std::move(out));
}

StatusOr<Value> MinMax(Renderer& r, const Value& v, CallArgs& a, bool want_max) {
  const Value* cs = Arg(a, 0, "case_sensitive");
  const Value* attr = Arg(a, 1, "attribute");
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  Value best_key;
  MLARUN_ASSIGN_OR_RETURN(best_key, SortKey(r, items[0], attr, cs != nullptr && jinja::Truthy(*cs)));
  for (size_t k = 1; k < items.size(); ++k) {
    Value key;
    MLARUN_ASSIGN_OR_RETURN(key, SortKey(r, items[k], attr, cs != nullptr && jinja::Truthy(*cs)));
    int c;
    MLARUN_ASSIGN_OR_RETURN(c, jinja::Compare(key, best_key));
    if (want_max ? c > 0 : c < 0) {
      best = k;
      best_key = key;
    }
  }
  return items[best];
}
StatusOr<Value> FMin(Renderer& r, const Value& v, CallArgs& a) { return MinMax(r, v, a, false); }
StatusOr<Value> FMax(Renderer& r, const Value& v, CallArgs& a) { return MinMax(r, v, a, true); }

StatusOr<Value> FSum(Renderer& r, const Value& v, CallArgs& a) {
  const Value* attr = Arg(a, 0, "attribute");
  const Value* start = Arg(a, 1, "start");
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  Value total = start != nullptr ? *start : Value::Int(0);
  for (const Value& item : items) {
    Value x = item;
    if (attr != nullptr && !attr->is_none()) {
      MLARUN_ASSIGN_OR_RETURN(x, r.AttributePath(item, *attr));
    }
    if (!total.is_number() || !x.is_number()) {
      return InvalidArgumentError("unsupported operand type(s) for +: '", jinja::TypeName(total), "' and '",
                                  jinja::TypeName(x), "'");
    }
    if (total.is_integral() && x.is_integral()) {
      int64_t s;
      if (__builtin_add_overflow(total.as_int(), x.as_int(), &s)) return InvalidArgumentError("integer overflow");
      total = Value::Int(s);
    } else {
      total = Value::Float(total.as_double() + x.as_double());
    }
  }
  return total;
}

// select/reject/selectattr/rejectattr: keep the items (or their attribute)
// that pass the test named by the first argument (truthiness when none).
StatusOr<Value> SelectOrReject(Renderer& r, const Value& v, CallArgs& a, bool by_attr, bool keep) {
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  size_t next = 0;
  const Value* attr = nullptr;
  if (by_attr) {
    if (a.args.empty()) return InvalidArgumentError("selectattr/rejectattr need an attribute name");
    attr = &a.args[next++];
  }
  std::string test;
  if (next < a.args.size()) {
    if (!a.args[next].is_string()) return InvalidArgumentError("the test name must be a string");
    test = a.args[next++].s;
    if (Tests().find(test) == Tests().end()) return InvalidArgumentError("no test named '", test, "'");
  }
  CallArgs test_args;
  test_args.args.assign(a.args.begin() + static_cast<std::ptrdiff_t>(next), a.args.end());
  ValueList out;
  for (const Value& item : items) {
    Value x = item;
    if (attr != nullptr) {
      MLARUN_ASSIGN_OR_RETURN(x, r.AttributePath(item, *attr));
    }
    bool pass;
    if (test.empty()) {
      pass = jinja::Truthy(x);
    } else {
      CallArgs copy = test_args;
      MLARUN_ASSIGN_OR_RETURN(pass, r.ApplyTest(test, x, copy));
    }
    if (pass == keep) out.push_back(item);
  }
  return Value::List(std::move(out));
}
StatusOr<Value> FSelect(Renderer& r, const Value& v, CallArgs& a) { return SelectOrReject(r, v, a, false, true); }
StatusOr<Value> FReject(Renderer& r, const Value& v, CallArgs& a) { return SelectOrReject(r, v, a, false, false); }
StatusOr<Value> FSelectAttr(Renderer& r, const Value& v, CallArgs& a) { return SelectOrReject(r, v, a, true, true); }
StatusOr<Value> FRejectAttr(Renderer& r, const Value& v, CallArgs& a) { return SelectOrReject(r, v, a, true, false); }

StatusOr<Value> FMap(Renderer& r, const Value& v, CallArgs& a) {
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  const Value* attr = nullptr;
  const Value* def = nullptr;
  for (const auto& [k, x] : a.kwargs) {
    if (k == "attribute") attr = &x;
    if (k == "default") def = &x;
  }
  ValueList out;
  if (attr != nullptr) {
    for (const Value& item : items) {
      Value x;
      MLARUN_ASSIGN_OR_RETURN(x, r.AttributePath(item, *attr));
      if (x.is_undefined() && def != nullptr) x = *def;
      out.push_back(std::move(x));
    }
    return Value::List(std::move(out));
  }
  if (a.args.empty() || !a.args[0].is_string()) return InvalidArgumentError("map needs a filter name or attribute=");
  std::string filter = a.args[0].s;
  CallArgs rest;
  rest.args.assign(a.args.begin() + 1, a.args.end());
  rest.kwargs = a.kwargs;
  for (const Value& item : items) {
    CallArgs copy = rest;
    Value x;
    MLARUN_ASSIGN_OR_RETURN(x, r.ApplyFilter(filter, item, copy));
    out.push_back(std::move(x));
  }
  return Value::List(std::move(out));
}

// jinja2's indent(width=4, first=False, blank=False).
StatusOr<Value> FIndent(Renderer& r, const Value& v, CallArgs& a) {
  const Value* width = Arg(a, 0, "width");
  const Value* first = Arg(a, 1, "first");
  const Value* blank = Arg(a, 2, "blank");
  std::string pad;
  if (width == nullptr) {
    pad = "    ";
  } else if (width->is_string()) {
    pad = width->s;
  } else if (width->is_integral()) {
    pad = std::string(static_cast<size_t>(std::clamp<int64_t>(width->as_int(), 0, 1024)), ' ');
  } else {
    return InvalidArgumentError("indent width must be an integer or a string");
  }
  std::string s = jinja::ToStr(v) + "\n";
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t nl = s.find_first_of("\r\n", pos);
    lines.push_back(s.substr(pos, nl - pos));
    pos = nl + ((s[nl] == '\r' && nl + 1 < s.size() && s[nl + 1] == '\n') ? 2 : 1);
  }
  std::string out;
  bool all = blank != nullptr && jinja::Truthy(*blank);
  for (size_t k = 0; k < lines.size(); ++k) {
    if (k > 0) {
      out += "\n";
      if (all || !lines[k].empty()) out += pad;
    }
    out += lines[k];
  }
  if (first != nullptr && jinja::Truthy(*first)) out = pad + out;
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
}

// str.center(width) as jinja2's center filter calls it (default 80).
StatusOr<Value> FCenter(Renderer&, const Value& v, CallArgs& a) {
  int64_t width;
  MLARUN_ASSIGN_OR_RETURN(width, IntArg(Arg(a, 0, "width"), 80, "width"));
  width = std::min<int64_t>(width, 4096);
  std::string s = jinja::ToStr(v);
  int64_t len = static_cast<int64_t>(jinja::DecodeUtf8(s).size());
  if (width <= len) return Value::Str(s);
  int64_t pad = width - len;
  int64_t left = pad / 2 + (pad & width & 1);  // CPython's split of an odd padding
  return Value::Str(std::string(static_cast<size_t>(left), ' ') + s +
                    std::string(static_cast<size_t>(pad - left), ' '));
}

StatusOr<Value> FWordcount(Renderer&, const Value& v, CallArgs&) {
  return Value::Int(static_cast<int64_t>(Split(jinja::ToStr(v), nullptr, -1, false).size()));
}

StatusOr<Value> FDictsort(Renderer& r, const Value& v, CallArgs& a) {
  if (!v.is_dict()) return InvalidArgumentError("dictsort needs a mapping, not ", jinja::TypeName(v));
  const Value* cs = Arg(a, 0, "case_sensitive");
  const Value* by = Arg(a, 1, "by");
  const Value* rev = Arg(a, 2, "reverse");
  bool by_value = by != nullptr && jinja::ToStr(*by) == "value";
  CallArgs none;
  Value items;
  MLARUN_ASSIGN_OR_RETURN(items, r.CallMethod(v, "items", none));
  CallArgs sort_args;
  sort_args.args = {rev != nullptr ? *rev : Value::Bool(false), cs != nullptr ? *cs : Value::Bool(false),
                    Value::Int(by_value ? 1 : 0)};
  return FSort(r, items, sort_args);
}

const std::unordered_map<std::string, FilterFn>& Filters() {
  static const auto* filters = new std::unordered_map<std::string, FilterFn>{
      {"abs", FAbs},
      {"capitalize", FCapitalize},
      {"center", FCenter},
      {"count", FLength},
      {"d", FDefault},
      {"default", FDefault},
      {"dictsort", FDictsort},
      {"e", FEscape},
      {"escape", FEscape},
      {"first", FFirst},
      {"float", FFloat},
      {"indent", FIndent},
      {"int", FInt},
      {"items", FItems},
      {"join", FJoin},
      {"last", FLast},
      {"length", FLength},
      {"list", FList},
      {"lower", FLower},
      {"map", FMap},
      {"max", FMax},
      {"min", FMin},
      {"reject", FReject},
      {"rejectattr", FRejectAttr},
      {"replace", FReplace},
      {"reverse", FReverse},
      {"round", FRound},
      {"safe", FSafe},
      {"select", FSelect},
      {"selectattr", FSelectAttr},
      {"sort", FSort},
      {"string", FString},
      {"sum", FSum},
      {"title", FTitle},
      {"tojson", FToJson},
      {"trim", FTrim},
      {"unique", FUnique},
      {"upper", FUpper},
      {"wordcount", FWordcount},
  };
  return *filters;
}

// ----- tests -----

StatusOr<bool> TDefined(Renderer&, const Value& v, CallArgs&) { return !v.is_undefined(); }
StatusOr<bool> TUndefined(Renderer&, const Value& v, CallArgs&) { return v.is_undefined(); }
StatusOr<bool> TNone(Renderer&, const Value& v, CallArgs&) { return v.is_none(); }
StatusOr<bool> TString(Renderer&, const Value& v, CallArgs&) { return v.is_string(); }
StatusOr<bool> TNumber(Renderer&, const Value& v, CallArgs&) { return v.is_number(); }
StatusOr<bool> TInteger(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kInt; }
StatusOr<bool> TFloat(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kFloat; }
StatusOr<bool> TBoolean(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kBool; }
StatusOr<bool> TTrue(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kBool && v.b; }
StatusOr<bool> TFalse(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kBool && !v.b; }
StatusOr<bool> TMapping(Renderer&, const Value& v, CallArgs&) { return v.is_dict(); }
StatusOr<bool> TIterable(Renderer&, const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
StatusOr<bool> TSequence(Renderer&, const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
StatusOr<bool> TCallable(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kCallable; }
StatusOr<bool> TEscaped(Renderer&, const Value&, CallArgs&) { return false; }

StatusOr<const Value*> Other(const CallArgs& a) {
  const Value* o = Arg(a, 0, "other");
  if (o == nullptr) return InvalidArgumentError("the test needs a value to compare with");
  return o;
}
StatusOr<bool> TEq(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  return jinja::Equal(v, *o);
}
StatusOr<bool> TNe(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  return !jinja::Equal(v, *o);
}
template <int kWhich>  // 0 <, 1 <=, 2 >, 3 >=
StatusOr<bool> TOrder(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  int c;
  MLARUN_ASSIGN_OR_RETURN(c, jinja::Compare(v, *o));
  return kWhich == 0 ? c < 0 : kWhich == 1 ? c <= 0 : kWhich == 2 ? c > 0 : c >= 0;
}
StatusOr<bool> TIn(Renderer& r, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  return r.Contains(*o, v);
}
StatusOr<bool> TSameAs(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  if (v.kind != o->kind) return false;
  switch (v.kind) {
    case Kind::kList:
      return v.list == o->list;
    case Kind::kDict:
      return v.dict == o->dict;
    case Kind::kNamespace:
      return v.ns == o->ns;
    case Kind::kCallable:
      return v.fn == o->fn;
    default:
      return jinja::Equal(v, *o);
  }
}
StatusOr<bool> TOddEven(const Value& v, bool odd) {
  if (v.is_undefined()) return InvalidArgumentError(v.s);
  if (!v.is_integral()) return InvalidArgumentError("odd/even need an integer, not ", jinja::TypeName(v));
  return (FloorMod(v.as_int(), 2) == 1) == odd;
}
StatusOr<bool> TOdd(Renderer&, const Value& v, CallArgs&) { return TOddEven(v, true); }
StatusOr<bool> TEven(Renderer&, const Value& v, CallArgs&) { return TOddEven(v, false); }
StatusOr<bool> TDivisibleBy(Renderer&, const Value& v, CallArgs& a) {
  const Value* o = Arg(a, 0, "num");
  if (o == nullptr || !o->is_integral() || !v.is_integral()) return InvalidArgumentError("divisibleby needs integers");
  if (o->as_int() == 0) return InvalidArgumentError("integer division or modulo by zero");
  return FloorMod(v.as_int(), o->as_int()) == 0;
}
StatusOr<bool> TLower(Renderer& r, const Value& v, CallArgs&) {
  CallArgs none;
  Value b;
  MLARUN_ASSIGN_OR_RETURN(b, r.CallMethod(Value::Str(jinja::ToStr(v)), "islower", none));
  return b.b;
}
StatusOr<bool> TUpper(Renderer& r, const Value& v, CallArgs&) {
  CallArgs none;
  Value b;
  MLARUN_ASSIGN_OR_RETURN(b, r.CallMethod(Value::Str(jinja::ToStr(v)), "isupper", none));
  return b.b;
}

const std::unordered_map<std::string, TestFn>& Tests() {
  static const auto* tests = new std::unordered_map<std::string, TestFn>{
      {"defined", TDefined},
      {"undefined", TUndefined},
      {"none", TNone},
      {"string", TString},
      {"number", TNumber},
      {"integer", TInteger},
      {"float", TFloat},
      {"boolean", TBoolean},
      {"true", TTrue},
      {"false", TFalse},
      {"mapping", TMapping},
      {"iterable", TIterable},
      {"sequence", TSequence},
      {"callable", TCallable},
      {"escaped", TEscaped},
      {"eq", TEq},
      {"equalto", TEq},
      {"==", TEq},
      {"ne", TNe},
      {"!=", TNe},
      {"lt", TOrder<0>},
      {"lessthan", TOrder<0>},
      {"<", TOrder<0>},
      {"le", TOrder<1>},
      {"<=", TOrder<1>},
      {"gt", TOrder<2>},
      {"greaterthan", TOrder<2>},
      {">", TOrder<2>},
      {"ge", TOrder<3>},
      {">=", TOrder<3>},
      {"in", TIn},
      {"sameas", TSameAs},
      {"odd", TOdd},
      {"even", TEven},
      {"divisibleby", TDivisibleBy},
      {"lower", TLower},
      {"upper", TUpper},
  };
  return *tests;
}

// ----- globals -----

void Renderer::InstallGlobals(Scope* root) {
  Renderer* self = this;
  root->vars["raise_exception"] = Value::MakeCallable("raise_exception", [](CallArgs& a) -> StatusOr<Value> {
    std::string msg = a.args.empty() ? "" : jinja::ToStr(a.args[0]);
    return Status(StatusCode::kInvalidArgument, "chat template raised an error: " + msg);
  });
  root->vars["strftime_now"] = Value::MakeCallable("strftime_now", [](CallArgs& a) -> StatusOr<Value> {
    const Value* fmt = Arg(a, 0, "format");
    if (fmt == nullptr || !fmt->is_string()) return InvalidArgumentError("strftime_now needs a format string");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    std::vector<char> buf(256 + fmt->s.size() * 8);
    size_t n = std::strftime(buf.data(), buf.size(), fmt->s.c_str(), &tm);
    return Value::Str(std::string(buf.data(), n));
  });
  root->vars["namespace"] = Value::MakeCallable("namespace", [self](CallArgs& a) -> StatusOr<Value> {
    Value v;
    v.kind = Kind::kNamespace;
    v.ns = std::make_shared<jinja::Namespace>();
    self->namespaces_.push_back(v.ns);
    for (const Value& init : a.args) {
      if (!init.is_dict()) return InvalidArgumentError("namespace() takes keyword arguments or a dict");
      for (const auto& [k, x] : init.dict->items) v.ns->attrs.Set(k, x);
    }
    for (const auto& [k, x] : a.kwargs) v.ns->attrs.Set(k, x);
    return v;
  });
  root->vars["dict"] = Value::MakeCallable("dict", [](CallArgs& a) -> StatusOr<Value> {
    Dict d;
    for (const Value& init : a.args) {
      if (!init.is_dict()) return InvalidArgumentError("dict() takes keyword arguments or a dict");
      for (const auto& [k, x] : init.dict->items) d.Set(k, x);
    }
    for (const auto& [k, x] : a.kwargs) d.Set(k, x);
    return Value::MakeDict(std::move(d));
  });
  root->vars["range"] = Value::MakeCallable("range", [self](CallArgs& a) -> StatusOr<Value> {
    if (a.args.empty() || a.args.size() > 3) return InvalidArgumentError("range expected 1 to 3 arguments");
    for (const Value& x : a.args) {
      if (!x.is_integral()) {
        return InvalidArgumentError("'", jinja::TypeName(x), "' object cannot be interpreted as an integer");
      }
    }
    int64_t start = 0, stop, step = 1;
    if (a.args.size() == 1) {
      stop = a.args[0].as_int();
    } else {
      start = a.args[0].as_int();
      stop = a.args[1].as_int();
      if (a.args.size() == 3) step = a.args[2].as_int();
    }
    if (step == 0) return InvalidArgumentError("range() arg 3 must not be zero");
    __int128 count = step > 0 ? (static_cast<__int128>(stop) - start + step - 1) / step
                              : (static_cast<__int128>(start) - stop - step - 1) / -step;
    if (count < 0) count = 0;
    if (count > kMaxRangeLength) {
      return ResourceExhaustedError("chat template: range() of ", static_cast<int64_t>(count),
                                    " items is more than the ", kMaxRangeLength, " allowed; a runaway template?");
    }
    MLARUN_RETURN_IF_ERROR(self->Step(static_cast<int64_t>(count)));
    ValueList out;
    out.reserve(static_cast<size_t>(count));
    for (int64_t k = 0; k < static_cast<int64_t>(count); ++k) out.push_back(Value::Int(start + k * step));
    return Value::List(std::move(out));
  });
}

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

namespace jinja {
bool IsKnownFilter(const std::string& name) { return Filters().count(name) > 0; }
bool IsKnownTest(const std::string& name) { return Tests().count(name) > 0; }
}  // namespace jinja

StatusOr<std::shared_ptr<const ChatTemplate>> ChatTemplate::Parse(const std::string& source) {
  NodeList nodes;
  MLARUN_ASSIGN_OR_RETURN(nodes, jinja::ParseTemplate(source));
  return std::shared_ptr<const ChatTemplate>(std::make_shared<ChatTemplateImpl>(std::move(nodes)));
}

}  // namespace mlarun::text
