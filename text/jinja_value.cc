#include "text/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace mlarun::text::jinja {

Value Value::MakeDict(Dict d) {
  Value v;
  v.kind = Kind::kDict;
  for (const auto& kv : d.items) v.depth = std::max(v.depth, kv.second.depth);
  ++v.depth;
  v.dict = std::make_shared<const Dict>(std::move(d));
  return v;
}

Value Value::MakeCallable(std::string name, std::function<StatusOr<Value>(CallArgs&)> fn, bool is_macro) {
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn), is_macro});
  return v;
}

// Small dicts (a message: role, content) are searched in order; the index is
// built only once a dict grows past kIndexFrom entries.
namespace {
constexpr size_t kIndexFrom = 16;
}

const Value* Dict::Find(std::string_view key) const {
  if (items.size() < kIndexFrom || index_.size() != items.size()) {
    for (const auto& [k, v] : items) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  auto it = index_.find(std::string(key));
  return it == index_.end() ? nullptr : &items[it->second].second;
}

void Dict::Set(const std::string& key, Value v) {
  if (const Value* existing = Find(key)) {
    *const_cast<Value*>(existing) = std::move(v);
    return;
  }
  items.emplace_back(key, std::move(v));
  if (items.size() < kIndexFrom) return;
  if (index_.size() + 1 == items.size()) {
    index_[key] = items.size() - 1;
  } else {
    index_.clear();
    for (size_t i = 0; i < items.size(); ++i) index_[items[i].first] = i;
  }
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.b;
    case Kind::kInt:
      return v.i != 0;
    case Kind::kFloat:
      return v.f != 0;
    case Kind::kString:
      return !v.s.empty();
    case Kind::kList:
      return !v.list->empty();
    case Kind::kDict:
      return !v.dict->items.empty();
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
  }
  return false;
}

std::string TypeName(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return v.view != nullptr ? v.view : v.tuple ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
  }
  return "object";
}

std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  // The shortest digits that round-trip, as Python's repr chooses them.
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string s(buf, r.ptr);
  std::string out;
  if (s[0] == '-') {
    out = "-";
    s.erase(0, 1);
  }
  size_t e = s.find('e');
  std::string digits;
  for (size_t k = 0; k < e; ++k) {
    if (s[k] != '.') digits += s[k];
  }
  int exp = std::atoi(s.c_str() + e + 1);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  if (exp < -4 || exp >= 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += exp < 0 ? "e-" : "e+";
    int ae = std::abs(exp);
    if (ae < 10) out += "0";
    out += std::to_string(ae);
  } else if (exp >= 0) {
    size_t int_digits = static_cast<size_t>(exp) + 1;
    if (digits.size() <= int_digits) {
      out += digits + std::string(int_digits - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, int_digits) + "." + digits.substr(int_digits);
    }
  } else {
    out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  }
  return out;
}

void AppendUtf8(std::string* out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF) {  // an undecodable byte, given back
    out->push_back(static_cast<char>(c - 0xDC00));
  } else if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::u32string DecodeUtf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int len = 0;
    char32_t cp = 0;
    if (c < 0x80) {
      len = 1;
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
               (cp >= 0xD800 && cp <= 0xDFFF))) {
      ok = false;
    }
    if (!ok) {
      out.push_back(0xDC00 + c);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) AppendUtf8(&out, c);
  return out;
}

bool IsPyWhitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

namespace {

// Code points Python's repr() writes as escapes (str.isprintable() false):
// controls, the Latin-1 controls and no-break space, soft hyphen, the
// zero-width and direction marks, the line and paragraph separators, BOM.
bool PyNonPrintable(char32_t c) {
  return c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD || (c >= 0x2000 && c <= 0x200F) ||
         (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF ||
         (c >= 0xD800 && c <= 0xDFFF) || c == 0x1680 || c == 0xFFF9 || c == 0xFFFA || c == 0xFFFB;
}

std::string StrRepr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : DecodeUtf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (PyNonPrintable(c)) {
      char buf[16];
      if (c < 0x100) {
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      } else {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      }
      out += buf;
    } else {
      AppendUtf8(&out, c);
    }
  }
  out += quote;
  return out;
}

void JsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

Status JsonValue(const Value& v, int indent, bool sort_keys, int level, std::string* out) {
  if (level > 512) return InvalidArgumentError("tojson: the value nests too deeply");
  auto newline = [&](int lvl) {
    out->push_back('\n');
    out->append(static_cast<size_t>(indent) * static_cast<size_t>(lvl), ' ');
  };
  switch (v.kind) {
    case Kind::kUndefined:
      return InvalidArgumentError("Object of type Undefined is not JSON serializable",
                                  v.s.empty() ? "" : " (" + v.s + ")");
    case Kind::kNone:
      *out += "null";
      return Status::Ok();
    case Kind::kBool:
      *out += v.b ? "true" : "false";
      return Status::Ok();
    case Kind::kInt:
      *out += std::to_string(v.i);
      return Status::Ok();
    case Kind::kFloat:
      if (std::isnan(v.f)) {
        *out += "NaN";
      } else if (std::isinf(v.f)) {
        *out += v.f > 0 ? "Infinity" : "-Infinity";
      } else {
        *out += FloatRepr(v.f);
      }
      return Status::Ok();
    case Kind::kString:
      JsonString(v.s, out);
      return Status::Ok();
    case Kind::kList: {
      if (v.list->empty()) {
        *out += "[]";
        return Status::Ok();
      }
      out->push_back('[');
      bool first = true;
      for (const Value& item : *v.list) {
        if (!first) *out += indent >= 0 ? "," : ", ";
        first = false;
        if (indent >= 0) newline(level + 1);
        MLARUN_RETURN_IF_ERROR(JsonValue(item, indent, sort_keys, level + 1, out));
      }
      if (indent >= 0) newline(level);
      out->push_back(']');
      return Status::Ok();
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      if (v.kind == Kind::kNamespace) return InvalidArgumentError("Object of type Namespace is not JSON serializable");
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (sort_keys) {
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      }
      if (items.empty()) {
        *out += "{}";
        return Status::Ok();
      }
      out->push_back('{');
      bool first = true;
      for (const auto* kv : items) {
        if (!first) *out += indent >= 0 ? "," : ", ";
        first = false;
        if (indent >= 0) newline(level + 1);
        JsonString(kv->first, out);
        *out += ": ";
        MLARUN_RETURN_IF_ERROR(JsonValue(kv->second, indent, sort_keys, level + 1, out));
      }
      if (indent >= 0) newline(level);
      out->push_back('}');
      return Status::Ok();
    }
    case Kind::kCallable:
      return InvalidArgumentError("Object of type function is not JSON serializable");
  }
  return Status::Ok();
}

}  // namespace

namespace {
// Namespaces are the one mutable container, so a template can make one hold
// itself: past this depth a repr prints "..." (as Python's does for a dict
// that contains itself).
constexpr int kMaxReprDepth = 300;

std::string ReprAt(const Value& v, int depth) {
  if (depth > kMaxReprDepth) return "...";
  switch (v.kind) {
    case Kind::kString:
      return StrRepr(v.s);
    case Kind::kList: {
      std::string out = v.tuple ? "(" : "[";
      bool first = true;
      for (const Value& item : *v.list) {
        if (!first) out += ", ";
        first = false;
        out += ReprAt(item, depth + 1);
      }
      if (v.tuple && v.list->size() == 1) out += ",";
      out += v.tuple ? ")" : "]";
      if (v.view != nullptr) return std::string(v.view) + "(" + out + ")";
      return out;
    }
    case Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, item] : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out += StrRepr(k) + ": " + ReprAt(item, depth + 1);
      }
      return out + "}";
    }
    case Kind::kNamespace: {
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [k, item] : v.ns->attrs.items) {
        if (!first) out += ", ";
        first = false;
        out += StrRepr(k) + ": " + ReprAt(item, depth + 1);
      }
      return out + "}>";
    }
    case Kind::kUndefined:
      return "Undefined";
    default:
      return ToStr(v);
  }
}
}  // namespace

std::string Repr(const Value& v) { return ReprAt(v, 0); }

std::string ToStr(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.b ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.i);
    case Kind::kFloat:
      return FloatRepr(v.f);
    case Kind::kString:
      return v.s;
    case Kind::kCallable:
      return v.fn->is_macro ? "<Macro '" + v.fn->name + "'>" : "<function " + v.fn->name + ">";
    default:
      return Repr(v);
  }
}

bool Equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.s == b.s;
    case Kind::kList:
      if (a.tuple != b.tuple || a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!Equal((*a.list)[k], (*b.list)[k])) return false;
      }
      return true;
    case Kind::kDict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, item] : a.dict->items) {
        const Value* other = b.dict->Find(k);
        if (other == nullptr || !Equal(item, *other)) return false;
      }
      return true;
    case Kind::kNamespace:
      return a.ns == b.ns;
    case Kind::kCallable:
      return a.fn == b.fn;
    default:
      return false;
  }
}

StatusOr<int> Compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) {
      double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order, as Python compares str.
    int c = a.s.compare(b.s);
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_list() && b.is_list() && a.tuple == b.tuple) {
    size_t n = std::min(a.list->size(), b.list->size());
    for (size_t k = 0; k < n; ++k) {
      if (Equal((*a.list)[k], (*b.list)[k])) continue;
      return Compare((*a.list)[k], (*b.list)[k]);
    }
    return a.list->size() < b.list->size() ? -1 : (a.list->size() > b.list->size() ? 1 : 0);
  }
  return InvalidArgumentError("'<' not supported between instances of '", TypeName(a), "' and '", TypeName(b), "'");
}

StatusOr<std::string> ToJson(const Value& v, int indent, bool sort_keys) {
  std::string out;
  MLARUN_RETURN_IF_ERROR(JsonValue(v, indent, sort_keys, 0, &out));
  return out;
}

template <class Json>
Value FromJsonOf(const Json& j) {
  switch (j.type()) {
    case nlohmann::detail::value_t::null:
      return Value::None();
    case nlohmann::detail::value_t::boolean:
      return Value::Bool(j.template get<bool>());
    case nlohmann::detail::value_t::number_integer:
      return Value::Int(j.template get<int64_t>());
    case nlohmann::detail::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::Float(static_cast<double>(u));
      return Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::detail::value_t::number_float:
      return Value::Float(j.template get<double>());
    case nlohmann::detail::value_t::string:
      return Value::Str(j.template get<std::string>());
    case nlohmann::detail::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(FromJsonOf(item));
      return Value::List(std::move(items));
    }
    case nlohmann::detail::value_t::object: {
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.Set(it.key(), FromJsonOf(it.value()));
      return Value::MakeDict(std::move(d));
    }
    default:
      return Value::None();
  }
}

Value FromJson(const nlohmann::json& j) { return FromJsonOf(j); }
Value FromJson(const nlohmann::ordered_json& j) { return FromJsonOf(j); }

}  // namespace mlarun::text::jinja
