// Internal to text/: Python's str semantics as chat templates use them, for
// the interpreter's methods (jinja_methods.cc), filters (jinja_filters.cc),
// tests and operators: case mapping, strip, split, replace, find, format,
// `str % values`, int(str) and float(str).
//
// Strings are UTF-8; operations that count or classify characters work on
// code points (DecodeUtf8). Case mapping covers ASCII, Latin-1, Latin
// Extended-A, Greek and Cyrillic. Pure functions: safe on any thread.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"
#include "text/jinja_value.h"

namespace mlarun::text::jinja {

// Python's str.islower()/isupper() for one code point: a cased character of
// that case.
bool IsLowerCp(char32_t c);
bool IsUpperCp(char32_t c);
bool IsAsciiAlpha(char32_t c);

// Python's str.lower() / str.upper() (ß upper-cases to "SS").
std::string PyLower(const std::string& s);
std::string PyUpper(const std::string& s);
// Python's str.title: a cased letter after an uncased character starts a
// word (upper case), the rest of the word goes lower case.
std::string PyTitle(const std::string& s);
// Python's str.capitalize: the first character title case, the rest lower.
std::string PyCapitalize(const std::string& s);
// jinja2's title filter: each word (split at whitespace, '-', '(', '{', '['
// and '<') gets its first character upper case and the rest lower case.
std::string JinjaTitle(const std::string& s);

// Python's str.strip/lstrip/rstrip (chars: the set to strip; null:
// whitespace).
std::string Strip(const std::string& s, const Value* chars, bool left, bool right);
// Python's str.split / rsplit (sep null or None: runs of whitespace;
// maxsplit < 0: no limit).
ValueList Split(const std::string& s, const Value* sep, int64_t maxsplit, bool from_right);
// Python's str.replace (count < 0: all).
std::string Replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count);
// Code point offsets of `sub` in `s` (find/rfind/count/index): the first
// (or, reverse, the last) match inside [start, end) with Python's negative
// index rules, or -1.
int64_t FindCp(const std::u32string& s, const std::u32string& sub, int64_t start, int64_t end, bool reverse);

// Python's str.format with {}, {0}, {name} and {{ }} (no format specs).
StatusOr<std::string> PyFormat(const std::string& fmt, const CallArgs& a);
// Python's `str % value` for %s %r %d %i %f %x %%, flags and widths as
// printf reads them (value: one value, or a tuple of them).
StatusOr<std::string> PrintfFormat(const std::string& fmt, const Value& v);

// Python's int(str) / float(str): surrounding whitespace and underscores
// between digits allowed. False when the text is not a number.
bool ParsePyInt(const std::string& text, int64_t base, int64_t* out);
bool ParsePyFloat(const std::string& text, double* out);

}  // namespace mlarun::text::jinja
