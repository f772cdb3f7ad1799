// The filters (`x | name(args)`), as jinja2 defines them and transformers'
// environment adds `tojson`; Filters() maps each name to its function.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "text/jinja_runtime.h"
#include "text/jinja_string.h"

namespace mlarun::text::jinja {
namespace {

StatusOr<Value> FLength(Renderer&, const Value& v, CallArgs&) {
  switch (v.kind) {
    case Kind::kUndefined:
      return Value::Int(0);
    case Kind::kString:
      return Value::Int(static_cast<int64_t>(DecodeUtf8(v.s).size()));
    case Kind::kList:
      return Value::Int(static_cast<int64_t>(v.list->size()));
    case Kind::kDict:
      return Value::Int(static_cast<int64_t>(v.dict->items.size()));
    default:
      return InvalidArgumentError("object of type '", TypeName(v), "' has no len()");
  }
}

StatusOr<Value> FDefault(Renderer&, const Value& v, CallArgs& a) {
  const Value* def = Arg(a, 0, "default_value");
  const Value* boolean = Arg(a, 1, "boolean");
  bool use = v.is_undefined() || (boolean != nullptr && Truthy(*boolean) && !Truthy(v));
  if (!use) return v;
  return def != nullptr ? *def : Value::Str("");
}

StatusOr<Value> FTrim(Renderer&, const Value& v, CallArgs& a) {
  const Value* chars = Arg(a, 0, "chars");
  return Value::Str(Strip(ToStr(v), chars != nullptr && chars->is_string() ? chars : nullptr, true, true));
}

StatusOr<Value> FUpper(Renderer&, const Value& v, CallArgs&) { return Value::Str(PyUpper(ToStr(v))); }
StatusOr<Value> FLower(Renderer&, const Value& v, CallArgs&) { return Value::Str(PyLower(ToStr(v))); }
StatusOr<Value> FCapitalize(Renderer&, const Value& v, CallArgs&) { return Value::Str(PyCapitalize(ToStr(v))); }
StatusOr<Value> FTitle(Renderer&, const Value& v, CallArgs&) { return Value::Str(JinjaTitle(ToStr(v))); }
StatusOr<Value> FString(Renderer&, const Value& v, CallArgs&) { return Value::Str(ToStr(v)); }
StatusOr<Value> FSafe(Renderer&, const Value& v, CallArgs&) { return v; }

StatusOr<Value> FEscape(Renderer& r, const Value& v, CallArgs&) {
  std::string out;
  for (char c : ToStr(v)) {
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
  std::string d = sep != nullptr ? ToStr(*sep) : "";
  ValueList items;
  MLARUN_ASSIGN_OR_RETURN(items, r.Iterate(v));
  std::string out;
  for (size_t k = 0; k < items.size(); ++k) {
    Value item = items[k];
    if (attr != nullptr) {
      MLARUN_ASSIGN_OR_RETURN(item, r.AttributePath(item, *attr));
    }
    if (k > 0) out += d;
    std::string s = ToStr(item);
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
  std::string out = Replace(ToStr(v), ToStr(*old), ToStr(*repl), count);
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
  MLARUN_ASSIGN_OR_RETURN(out, ToJson(v, ind, sort_keys != nullptr && Truthy(*sort_keys)));
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
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
  if (!v.is_dict()) return InvalidArgumentError("can only get item pairs from a mapping, not ", TypeName(v));
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
  return InvalidArgumentError("bad operand type for abs(): '", TypeName(v), "'");
}

StatusOr<Value> FRound(Renderer&, const Value& v, CallArgs& a) {
  int64_t precision;
  MLARUN_ASSIGN_OR_RETURN(precision, IntArg(Arg(a, 0, "precision"), 0, "precision"));
  const Value* method = Arg(a, 1, "method");
  std::string m = method != nullptr ? ToStr(*method) : "common";
  if (!v.is_number()) return InvalidArgumentError("type ", TypeName(v), " doesn't define __round__ method");
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
    std::u32string u = DecodeUtf8(v.s);
    std::reverse(u.begin(), u.end());
    return Value::Str(EncodeUtf8(u));
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
    MLARUN_ASSIGN_OR_RETURN(k, SortKey(r, item, attr, cs != nullptr && Truthy(*cs)));
    keyed.emplace_back(std::move(k), item);
  }
  Status error;
  bool descending = rev != nullptr && Truthy(*rev);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    auto c = descending ? Compare(y.first, x.first) : Compare(x.first, y.first);
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
    MLARUN_ASSIGN_OR_RETURN(k, SortKey(r, item, attr, cs != nullptr && Truthy(*cs)));
    bool dup = false;
    for (const Value& s : seen) {
      if (Equal(s, k)) dup = true;
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
  MLARUN_ASSIGN_OR_RETURN(best_key, SortKey(r, items[0], attr, cs != nullptr && Truthy(*cs)));
  for (size_t k = 1; k < items.size(); ++k) {
    Value key;
    MLARUN_ASSIGN_OR_RETURN(key, SortKey(r, items[k], attr, cs != nullptr && Truthy(*cs)));
    int c;
    MLARUN_ASSIGN_OR_RETURN(c, Compare(key, best_key));
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
      return InvalidArgumentError("unsupported operand type(s) for +: '", TypeName(total), "' and '", TypeName(x), "'");
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
      pass = Truthy(x);
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
  std::string s = ToStr(v) + "\n";
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t nl = s.find_first_of("\r\n", pos);
    lines.push_back(s.substr(pos, nl - pos));
    pos = nl + ((s[nl] == '\r' && nl + 1 < s.size() && s[nl + 1] == '\n') ? 2 : 1);
  }
  std::string out;
  bool all = blank != nullptr && Truthy(*blank);
  for (size_t k = 0; k < lines.size(); ++k) {
    if (k > 0) {
      out += "\n";
      if (all || !lines[k].empty()) out += pad;
    }
    out += lines[k];
  }
  if (first != nullptr && Truthy(*first)) out = pad + out;
  MLARUN_RETURN_IF_ERROR(r.Charge(out.size()));
  return Value::Str(std::move(out));
}

// str.center(width) as jinja2's center filter calls it (default 80).
StatusOr<Value> FCenter(Renderer&, const Value& v, CallArgs& a) {
  int64_t width;
  MLARUN_ASSIGN_OR_RETURN(width, IntArg(Arg(a, 0, "width"), 80, "width"));
  width = std::min<int64_t>(width, 4096);
  std::string s = ToStr(v);
  int64_t len = static_cast<int64_t>(DecodeUtf8(s).size());
  if (width <= len) return Value::Str(s);
  int64_t pad = width - len;
  int64_t left = pad / 2 + (pad & width & 1);  // CPython's split of an odd padding
  return Value::Str(std::string(static_cast<size_t>(left), ' ') + s +
                    std::string(static_cast<size_t>(pad - left), ' '));
}

StatusOr<Value> FWordcount(Renderer&, const Value& v, CallArgs&) {
  return Value::Int(static_cast<int64_t>(Split(ToStr(v), nullptr, -1, false).size()));
}

StatusOr<Value> FDictsort(Renderer& r, const Value& v, CallArgs& a) {
  if (!v.is_dict()) return InvalidArgumentError("dictsort needs a mapping, not ", TypeName(v));
  const Value* cs = Arg(a, 0, "case_sensitive");
  const Value* by = Arg(a, 1, "by");
  const Value* rev = Arg(a, 2, "reverse");
  bool by_value = by != nullptr && ToStr(*by) == "value";
  CallArgs none;
  Value items;
  MLARUN_ASSIGN_OR_RETURN(items, r.CallMethod(v, "items", none));
  CallArgs sort_args;
  sort_args.args = {rev != nullptr ? *rev : Value::Bool(false), cs != nullptr ? *cs : Value::Bool(false),
                    Value::Int(by_value ? 1 : 0)};
  return FSort(r, items, sort_args);
}

}  // namespace

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

bool IsKnownFilter(const std::string& name) { return Filters().count(name) > 0; }

}  // namespace mlarun::text::jinja
