// The values a chat template computes with, and the Python semantics the
// rendering has to reproduce: truthiness, ==, <, str() and repr() of each
// type, and json.dumps (ensure_ascii=False) as transformers' `tojson` calls it.
//
// Values are immutable once built, except a Namespace's attributes (Jinja's
// `namespace(...)`, which `{% set ns.x = ... %}` changes). Lists and dicts are
// shared by pointer; copying a Value is cheap. A Value belongs to one render
// (one thread).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"

namespace mlarun::text::jinja {

struct Value;
struct Dict;
struct Namespace;
struct Callable;
using ValueList = std::vector<Value>;

enum class Kind : int {
  kUndefined = 0,  // jinja2's default Undefined: falsy, prints "", fails on use
  kNone = 1,
  kBool = 2,
  kInt = 3,
  kFloat = 4,
  kString = 5,
  kList = 6,  // a Python list, or a tuple when `tuple` is set
  kDict = 7,
  kNamespace = 8,
  kCallable = 9,
};

struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  // kString: the UTF-8 text. kUndefined: what was undefined, for messages
  // ("'tools' is undefined").
  std::string s;
  std::shared_ptr<const ValueList> list;
  bool tuple = false;
  // dict.items()/keys()/values(): a list that prints as Python's view
  // ("dict_items([('a', 1)])"); null for a plain list.
  const char* view = nullptr;
  // Container nesting: 0 for scalars, 1 + the deepest element for lists and
  // dicts (bounded so that printing and freeing never recurse too deep).
  int depth = 0;
  std::shared_ptr<const Dict> dict;
  std::shared_ptr<Namespace> ns;
  std::shared_ptr<const Callable> fn;

  static Value Undefined(std::string what) {
    Value v;
    v.s = std::move(what);
    return v;
  }
  static Value None() {
    Value v;
    v.kind = Kind::kNone;
    return v;
  }
  static Value Bool(bool b) {
    Value v;
    v.kind = Kind::kBool;
    v.b = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v;
    v.kind = Kind::kInt;
    v.i = i;
    return v;
  }
  static Value Float(double f) {
    Value v;
    v.kind = Kind::kFloat;
    v.f = f;
    return v;
  }
  static Value Str(std::string s) {
    Value v;
    v.kind = Kind::kString;
    v.s = std::move(s);
    return v;
  }
  static Value List(ValueList items, bool tuple = false) {
    Value v;
    v.kind = Kind::kList;
    for (const Value& item : items) v.depth = std::max(v.depth, item.depth);
    ++v.depth;
    v.list = std::make_shared<const ValueList>(std::move(items));
    v.tuple = tuple;
    return v;
  }
  static Value MakeDict(Dict d);
  static Value MakeCallable(std::string name, std::function<StatusOr<Value>(struct CallArgs&)> fn,
                            bool is_macro = false);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_dict() const { return kind == Kind::kDict; }
  // int, float or bool (Python's numbers.Number; bool is an int there).
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  // int or bool, as an int64.
  bool is_integral() const { return kind == Kind::kInt || kind == Kind::kBool; }
  int64_t as_int() const { return kind == Kind::kBool ? (b ? 1 : 0) : i; }
  double as_double() const { return kind == Kind::kFloat ? f : static_cast<double>(as_int()); }
};

// An insertion-ordered str -> Value map (Python dicts keep insertion order).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* Find(std::string_view key) const;
  void Set(const std::string& key, Value v);

 private:
  std::unordered_map<std::string, size_t> index_;
};

// Jinja's namespace(): attributes that `{% set ns.attr = v %}` may change from
// inside a loop. Shared by every Value that refers to it.
struct Namespace {
  Dict attrs;
};

// Positional and keyword arguments of a call, filter or test.
struct CallArgs {
  ValueList args;
  std::vector<std::pair<std::string, Value>> kwargs;
};

struct Callable {
  std::string name;
  std::function<StatusOr<Value>(CallArgs&)> fn;
  bool is_macro = false;  // prints as jinja2's "<Macro 'name'>"
};

// Python's bool(v).
bool Truthy(const Value& v);
// Python's type(v).__name__ ("str", "int", "NoneType", ...).
std::string TypeName(const Value& v);
// Python's str(v) as Jinja prints it: None -> "None", True -> "True",
// 1.0 -> "1.0", lists and dicts as their repr, undefined -> "".
std::string ToStr(const Value& v);
// Python's repr(v).
std::string Repr(const Value& v);
// Python's repr() of a float ("1.0", "0.1", "1e-05", "1e+16", "inf").
std::string FloatRepr(double d);
// Python's ==.
bool Equal(const Value& a, const Value& b);
// Python's <: -1, 0 or 1, or INVALID_ARGUMENT when the types don't order
// ("'<' not supported between instances of 'str' and 'int'").
StatusOr<int> Compare(const Value& a, const Value& b);
// json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: None).
StatusOr<std::string> ToJson(const Value& v, int indent, bool sort_keys = false);
// A JSON document as Python values (null -> None, objects -> dicts in order).
Value FromJson(const nlohmann::json& j);
Value FromJson(const nlohmann::ordered_json& j);  // objects keep their key order

// Code points of UTF-8 text. Bytes that are not UTF-8 decode as U+DC80 +
// byte (as Python's surrogateescape) so that encoding gives them back.
std::u32string DecodeUtf8(std::string_view s);
std::string EncodeUtf8(std::u32string_view s);
void AppendUtf8(std::string* out, char32_t c);
// Python's str.isspace() for one code point.
bool IsPyWhitespace(char32_t c);

}  // namespace mlarun::text::jinja
