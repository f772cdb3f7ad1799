// Methods of str, dict and list as templates call them (`s.split(",")`,
// `d.get("k")`, `l.index(x)`): a table per receiver type from the method's
// name to its function. GetAttr binds `obj.name` to a method when HasMethod
// says the type has one; CallMethod runs it.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>

#include "text/jinja_runtime.h"
#include "text/jinja_string.h"

namespace mlarun::text::jinja {
namespace {

// A method of `self`; `name` is the one it was called by (one function may
// serve several, e.g. find/rfind/index/count).
using MethodFn = StatusOr<Value> (*)(Renderer& r, const Value& self, const std::string& name, CallArgs& a);
using MethodTable = std::unordered_map<std::string, MethodFn>;

// ----- dict -----

StatusOr<Value> DictGet(Renderer&, const Value& self, const std::string&, CallArgs& a) {
  const Value* key = Arg(a, 0, "key");
  if (key == nullptr) return InvalidArgumentError("get expected at least 1 argument, got 0");
  const Value* def = Arg(a, 1, "default");
  const Value* v = key->is_string() ? self.dict->Find(key->s) : nullptr;
  if (v != nullptr) return *v;
  return def != nullptr ? *def : Value::None();
}

// keys/values/items: a list that prints as Python's view of the dict.
StatusOr<Value> DictView(Renderer&, const Value& self, const std::string& name, CallArgs&) {
  ValueList out;
  for (const auto& [k, v] : self.dict->items) {
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

// ----- list -----

// index/count.
StatusOr<Value> ListFind(Renderer&, const Value& self, const std::string& name, CallArgs& a) {
  const Value* x = Arg(a, 0, "value");
  if (x == nullptr) return InvalidArgumentError(name, "() takes exactly one argument (0 given)");
  int64_t count = 0;
  for (size_t k = 0; k < self.list->size(); ++k) {
    if (Equal((*self.list)[k], *x)) {
      if (name == "index") return Value::Int(static_cast<int64_t>(k));
      ++count;
    }
  }
  if (name == "index") return InvalidArgumentError(Repr(*x), " is not in list");
  return Value::Int(count);
}

// ----- str -----

// split/rsplit.
StatusOr<Value> StrSplit(Renderer& r, const Value& self, const std::string& name, CallArgs& a) {
  const Value* sep = Arg(a, 0, "sep");
  if (sep != nullptr && !sep->is_none()) {
    if (!sep->is_string()) return InvalidArgumentError("must be str or None, not ", TypeName(*sep));
    if (sep->s.empty()) return InvalidArgumentError("empty separator");
  }
  int64_t maxsplit;
  MLARUN_ASSIGN_OR_RETURN(maxsplit, IntArg(Arg(a, 1, "maxsplit"), -1, "maxsplit"));
  ValueList parts = Split(self.s, sep, maxsplit, name == "rsplit");
  MLARUN_RETURN_IF_ERROR(r.Step(static_cast<int64_t>(parts.size())));
  return Value::List(std::move(parts));
}

StatusOr<Value> StrSplitlines(Renderer&, const Value& self, const std::string&, CallArgs&) {
  const std::string& s = self.s;
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

// strip/lstrip/rstrip.
StatusOr<Value> StrStrip(Renderer&, const Value& self, const std::string& name, CallArgs& a) {
  const Value* chars = Arg(a, 0, "chars");
  if (chars != nullptr && !chars->is_none() && !chars->is_string()) {
    return InvalidArgumentError(name, " arg must be None or str");
  }
  return Value::Str(Strip(self.s, chars, name != "rstrip", name != "lstrip"));
}

// startswith/endswith (a str or a tuple of them).
StatusOr<Value> StrStartsOrEndsWith(Renderer&, const Value& self, const std::string& name, CallArgs& a) {
  const std::string& s = self.s;
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
      return InvalidArgumentError(name, " first arg must be str or a tuple of str, not ", TypeName(o));
    }
    bool hit = name == "startswith"
                   ? s.compare(0, o.s.size(), o.s) == 0
                   : (s.size() >= o.s.size() && s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0);
    if (hit) return Value::Bool(true);
  }
  return Value::Bool(false);
}

StatusOr<Value> StrReplace(Renderer& r, const Value& self, const std::string&, CallArgs& a) {
  std::string old, repl;
  MLARUN_ASSIGN_OR_RETURN(old, StrArg(Arg(a, 0, "old"), "replace() old"));
  MLARUN_ASSIGN_OR_RETURN(repl, StrArg(Arg(a, 1, "new"), "replace() new"));
  int64_t count;
  MLARUN_ASSIGN_OR_RETURN(count, IntArg(Arg(a, 2, "count"), -1, "count"));
  std::string out = Replace(self.s, old, repl, count);
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
}

StatusOr<Value> StrUpper(Renderer&, const Value& self, const std::string&, CallArgs&) {
  return Value::Str(PyUpper(self.s));
}
StatusOr<Value> StrLower(Renderer&, const Value& self, const std::string&, CallArgs&) {
  return Value::Str(PyLower(self.s));
}
StatusOr<Value> StrTitle(Renderer&, const Value& self, const std::string&, CallArgs&) {
  return Value::Str(PyTitle(self.s));
}
StatusOr<Value> StrCapitalize(Renderer&, const Value& self, const std::string&, CallArgs&) {
  return Value::Str(PyCapitalize(self.s));
}

// find/rfind/index/count, in code points.
StatusOr<Value> StrFind(Renderer&, const Value& self, const std::string& name, CallArgs& a) {
  std::string sub;
  MLARUN_ASSIGN_OR_RETURN(sub, StrArg(Arg(a, 0, "sub"), (name + "() argument").c_str()));
  std::u32string u = DecodeUtf8(self.s), us = DecodeUtf8(sub);
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

StatusOr<Value> StrFormat(Renderer& r, const Value& self, const std::string&, CallArgs& a) {
  std::string out;
  MLARUN_ASSIGN_OR_RETURN(out, PyFormat(self.s, a));
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
}

StatusOr<Value> StrJoin(Renderer& r, const Value& self, const std::string&, CallArgs& a) {
  const std::string& s = self.s;
  const Value* it = Arg(a, 0, "iterable");
  if (it == nullptr) return InvalidArgumentError("join() takes exactly one argument (0 given)");
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(*it));
  std::string out;
  for (size_t k = 0; k < items.size(); ++k) {
    if (!items[k].is_string()) {
      return InvalidArgumentError("sequence item ", k, ": expected str instance, ", TypeName(items[k]), " found");
    }
    if (k > 0) out += s;
    out += items[k].s;
    MLARUN_RETURN_IF_ERROR(r.Charge(items[k].s.size() + s.size()));
  }
  return Value::Str(std::move(out));
}

// removeprefix/removesuffix.
StatusOr<Value> StrRemoveAffix(Renderer&, const Value& self, const std::string& name, CallArgs& a) {
  const std::string& s = self.s;
  std::string p;
  MLARUN_ASSIGN_OR_RETURN(p, StrArg(Arg(a, 0, "prefix"), (name + "() argument").c_str()));
  if (name == "removeprefix" && s.compare(0, p.size(), p) == 0) return Value::Str(s.substr(p.size()));
  if (name == "removesuffix" && !p.empty() && s.size() >= p.size() &&
      s.compare(s.size() - p.size(), p.size(), p) == 0) {
    return Value::Str(s.substr(0, s.size() - p.size()));
  }
  return Value::Str(s);
}

// isdigit/isalpha/isalnum/isspace: every character in the class (ASCII
// classes, Python's whitespace), and at least one.
bool IsDigitCp(char32_t c) { return c >= '0' && c <= '9'; }
bool IsAlnumCp(char32_t c) { return IsAsciiAlpha(c) || (c >= '0' && c <= '9'); }
template <bool (*kInClass)(char32_t)>
StatusOr<Value> StrIsAll(Renderer&, const Value& self, const std::string&, CallArgs&) {
  std::u32string u = DecodeUtf8(self.s);
  return Value::Bool(!u.empty() && std::all_of(u.begin(), u.end(), kInClass));
}

// islower/isupper: at least one cased character, none of the other case.
StatusOr<Value> StrIsCase(Renderer&, const Value& self, const std::string& name, CallArgs&) {
  bool cased = false, ok = true;
  for (char32_t c : DecodeUtf8(self.s)) {
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

// ----- the tables -----

const MethodTable& DictMethods() {
  static const auto* methods = new MethodTable{
      {"get", DictGet},
      {"items", DictView},
      {"keys", DictView},
      {"values", DictView},
  };
  return *methods;
}

const MethodTable& ListMethods() {
  static const auto* methods = new MethodTable{
      {"index", ListFind},
      {"count", ListFind},
  };
  return *methods;
}

const MethodTable& StrMethods() {
  static const auto* methods = new MethodTable{
      {"split", StrSplit},
      {"rsplit", StrSplit},
      {"splitlines", StrSplitlines},
      {"strip", StrStrip},
      {"lstrip", StrStrip},
      {"rstrip", StrStrip},
      {"startswith", StrStartsOrEndsWith},
      {"endswith", StrStartsOrEndsWith},
      {"replace", StrReplace},
      {"upper", StrUpper},
      {"lower", StrLower},
      {"title", StrTitle},
      {"capitalize", StrCapitalize},
      {"find", StrFind},
      {"rfind", StrFind},
      {"index", StrFind},
      {"count", StrFind},
      {"format", StrFormat},
      {"join", StrJoin},
      {"removeprefix", StrRemoveAffix},
      {"removesuffix", StrRemoveAffix},
      {"isdigit", StrIsAll<IsDigitCp>},
      {"isalpha", StrIsAll<IsAsciiAlpha>},
      {"isalnum", StrIsAll<IsAlnumCp>},
      {"isspace", StrIsAll<IsPyWhitespace>},
      {"islower", StrIsCase},
      {"isupper", StrIsCase},
  };
  return *methods;
}

}  // namespace

bool HasMethod(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Kind::kDict:
      return DictMethods().count(name) > 0;
    case Kind::kList:
      return ListMethods().count(name) > 0;
    case Kind::kString:
      return StrMethods().count(name) > 0;
    default:
      return false;
  }
}

// Dispatch on the receiver's type: dicts and lists to theirs, anything else
// to the str methods.
StatusOr<Value> Renderer::CallMethod(const Value& obj, const std::string& name, CallArgs& a) {
  const MethodTable& methods = obj.is_dict() ? DictMethods() : obj.is_list() ? ListMethods() : StrMethods();
  auto it = methods.find(name);
  if (it == methods.end()) return InvalidArgumentError("'", TypeName(obj), "' object has no method '", name, "'");
  return it->second(*this, obj, name, a);
}

}  // namespace mlarun::text::jinja
