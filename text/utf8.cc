#include "text/utf8.h"

namespace mlarun::text::utf8 {
namespace {

// For a lead byte: the sequence length (0: never a lead byte) and the range
// the second byte must fall in; later bytes are always 80..BF.
struct Lead {
  int len;
  unsigned char lo, hi;
};

inline Lead LeadOf(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// How many bytes of a sequence starting at p[0] (n bytes available) are
// well-formed so far; `complete` when all of them are there.
inline int WellFormedPrefix(const unsigned char* p, size_t n, bool* complete) {
  const Lead lead = LeadOf(p[0]);
  *complete = false;
  if (lead.len == 0) return 0;
  if (lead.len == 1) {
    *complete = true;
    return 1;
  }
  int k = 1;
  for (; k < lead.len; ++k) {
    if (size_t(k) >= n) return k;
    const unsigned char lo = k == 1 ? lead.lo : 0x80;
    const unsigned char hi = k == 1 ? lead.hi : 0xBF;
    if (p[k] < lo || p[k] > hi) return k;
  }
  *complete = true;
  return k;
}

}  // namespace

bool IsValid(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    bool complete;
    const int k = WellFormedPrefix(p + i, n - i, &complete);
    if (!complete) return false;
    i += k;
  }
  return true;
}

void AppendLossy(std::string_view bytes, std::string* out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  size_t run = 0;  // start of the pending run of valid bytes
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    bool complete;
    const int k = WellFormedPrefix(p + i, n - i, &complete);
    if (complete) {
      i += k;
      continue;
    }
    out->append(bytes.data() + run, i - run);
    out->append(kReplacement);
    i += k == 0 ? 1 : k;  // a byte that starts nothing is a subpart by itself
    run = i;
  }
  out->append(bytes.data() + run, n - run);
}

size_t FinalPrefixLength(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  // A lead byte is never a continuation byte, so a trailing incomplete
  // sequence starts at the last lead byte among the final three.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t start = n - back;
    const unsigned char b = p[start];
    if (b >= 0x80 && b < 0xC0) continue;  // continuation byte: look further back
    bool complete;
    const int k = WellFormedPrefix(p + start, back, &complete);
    if (!complete && size_t(k) == back && LeadOf(b).len > int(back)) return start;
    return n;
  }
  return n;
}

char32_t Prev(std::string_view s, size_t* end) {
  size_t i = *end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  *end = i;
  return Next(s, &i);
}

void Append(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(char(cp));
  } else if (cp < 0x800) {
    out->push_back(char(0xC0 | (cp >> 6)));
    out->push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(char(0xE0 | (cp >> 12)));
    out->push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(char(0xF0 | (cp >> 18)));
    out->push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(char(0x80 | (cp & 0x3F)));
  }
}

bool IsWhiteSpace(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

}  // namespace mlarun::text::utf8
