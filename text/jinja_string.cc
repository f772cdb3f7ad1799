// Python's str semantics (see jinja_string.h).
#include "text/jinja_string.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace mlarun::text::jinja {
namespace {

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

bool IsCasedCp(char32_t c) { return IsLowerCp(c) || IsUpperCp(c); }

void AppendUpper(std::string* out, char32_t c) {
  if (c == 0xDF) {
    *out += "SS";
  } else {
    AppendUtf8(out, UpperCp(c));
  }
}

}  // namespace

bool IsLowerCp(char32_t c) { return UpperCp(c) != c || c == 0xDF || c == 0x138 || c == 0x149; }
bool IsUpperCp(char32_t c) { return LowerCp(c) != c || c == 0x130; }
bool IsAsciiAlpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string PyLower(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : DecodeUtf8(s)) AppendUtf8(&out, LowerCp(c));
  return out;
}
std::string PyUpper(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : DecodeUtf8(s)) AppendUpper(&out, c);
  return out;
}

// Python's str.strip/lstrip/rstrip (chars: the set to strip; null:
// whitespace).
std::string Strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::u32string u = DecodeUtf8(s);
  std::u32string set;
  bool use_set = chars != nullptr && chars->is_string();
  if (use_set) set = DecodeUtf8(chars->s);
  auto strip_it = [&](char32_t c) { return use_set ? set.find(c) != std::u32string::npos : IsPyWhitespace(c); };
  size_t b = 0, e = u.size();
  if (left) {
    while (b < e && strip_it(u[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(u[e - 1])) --e;
  }
  return EncodeUtf8(std::u32string_view(u).substr(b, e - b));
}

// Python's str.split / rsplit.
ValueList Split(const std::string& s, const Value* sep, int64_t maxsplit, bool from_right) {
  ValueList out;
  if (sep == nullptr || sep->is_none()) {
    std::u32string u = DecodeUtf8(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && IsPyWhitespace(u[i])) ++i;
      if (i >= u.size()) break;
      size_t j = i;
      while (j < u.size() && !IsPyWhitespace(u[j])) ++j;
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
    for (auto [b, e] : words) out.push_back(Value::Str(EncodeUtf8(std::u32string_view(u).substr(b, e - b))));
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
    std::u32string u = DecodeUtf8(s);
    int64_t n = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (i < u.size()) AppendUtf8(&out, u[i]);
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
  for (char32_t c : DecodeUtf8(s)) {
    if (prev_cased) {
      AppendUtf8(&out, LowerCp(c));
    } else if (c == 0xDF) {
      out += "Ss";
    } else {
      AppendUtf8(&out, UpperCp(c));
    }
    prev_cased = IsCasedCp(c);
  }
  return out;
}

// Python's str.capitalize: the first character title case, the rest lower.
std::string PyCapitalize(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  std::string out;
  for (size_t k = 0; k < u.size(); ++k) {
    if (k > 0) {
      AppendUtf8(&out, LowerCp(u[k]));
    } else if (u[k] == 0xDF) {
      out += "Ss";
    } else {
      AppendUtf8(&out, UpperCp(u[k]));
    }
  }
  return out;
}

// jinja2's title filter: each word (split at whitespace, '-', '(', '{', '['
// and '<') gets its first character upper case and the rest lower case.
std::string JinjaTitle(const std::string& s) {
  std::string out;
  bool word_start = true;
  for (char32_t c : DecodeUtf8(s)) {
    bool sep = IsPyWhitespace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      AppendUtf8(&out, c);
      word_start = true;
      continue;
    }
    if (word_start) {
      AppendUpper(&out, c);
    } else {
      AppendUtf8(&out, LowerCp(c));
    }
    word_start = false;
  }
  return out;
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
    out += ToStr(*v);
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
      std::string s = conv == 's' ? ToStr(a) : Repr(a);
      if (spec.empty()) {
        out += s;
      } else {
        std::snprintf(buf, sizeof(buf), ("%" + spec + "s").c_str(), s.c_str());
        out += buf;
      }
    } else if (conv == 'd' || conv == 'i' || conv == 'x' || conv == 'X' || conv == 'o') {
      if (!a.is_number())
        return InvalidArgumentError("%", conv, " format: a real number is required, not ", TypeName(a));
      long long x = a.kind == Kind::kFloat ? static_cast<long long>(a.f) : a.as_int();
      std::snprintf(buf, sizeof(buf), ("%" + spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(), x);
      out += buf;
    } else if (conv == 'f' || conv == 'F' || conv == 'e' || conv == 'E' || conv == 'g' || conv == 'G') {
      if (!a.is_number()) return InvalidArgumentError("must be real number, not ", TypeName(a));
      std::snprintf(buf, sizeof(buf), ("%" + spec + conv).c_str(), a.as_double());
      out += buf;
    } else {
      return InvalidArgumentError("unsupported format character '", std::string(1, conv), "'");
    }
  }
  if (next < args.size()) return InvalidArgumentError("not all arguments converted during string formatting");
  return out;
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

}  // namespace mlarun::text::jinja
