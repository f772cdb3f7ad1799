// UTF-8 helpers of the tokenizer: validation, the lossy repair Rust's
// String::from_utf8_lossy and Python's bytes.decode("utf-8", errors="replace")
// both perform (each maximal subpart of an ill-formed sequence becomes one
// U+FFFD, as the Unicode standard recommends), and code point iteration.
//
// Maximal subparts, by example: F0 9F 98 41 -> U+FFFD 'A' (the three bytes
// start a valid sequence that 41 breaks); ED A0 80 -> three U+FFFD (ED may
// only be followed by 80..9F, so A0 is not part of it); C0 80 -> two U+FFFD
// (C0 never starts a sequence).
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mlarun::text::utf8 {

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

bool IsValid(std::string_view bytes);

// Appends `bytes` to `out` with every maximal ill-formed subpart replaced by
// U+FFFD; a sequence cut off by the end of `bytes` is one U+FFFD too.
void AppendLossy(std::string_view bytes, std::string* out);
inline std::string Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  AppendLossy(bytes, &out);
  return out;
}

// The length of the longest prefix of `bytes` whose lossy repair can no
// longer change when more bytes are appended: everything but a trailing
// sequence that is valid so far and incomplete (at most 3 bytes).
size_t FinalPrefixLength(std::string_view bytes);

// The code point starting at s[*i] and advances *i past it. REQUIRES: s is
// valid UTF-8 and *i < s.size() is the start of a character.
inline char32_t Next(std::string_view s, size_t* i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + *i;
  if (p[0] < 0x80) {
    *i += 1;
    return p[0];
  }
  if (p[0] < 0xE0) {
    *i += 2;
    return (char32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (p[0] < 0xF0) {
    *i += 3;
    return (char32_t(p[0] & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  *i += 4;
  return (char32_t(p[0] & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) | (char32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

// The code point ending just before s[end] and moves `end` to its start.
// REQUIRES: s valid, end > 0 at a character boundary.
char32_t Prev(std::string_view s, size_t* end);

void Append(char32_t cp, std::string* out);

// Unicode's White_Space property (what Rust's char::is_whitespace and
// regex `\s` match).
bool IsWhiteSpace(char32_t cp);

}  // namespace mlarun::text::utf8
