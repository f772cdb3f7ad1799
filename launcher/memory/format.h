// Number formatting shared by the memory report and the measurement.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace mlarun::memory_internal {

// 3221225472 -> "3,221,225,472".
inline std::string Thousands(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

// Exact when the value has at most 6 decimals (68.625, 4.765625, 320),
// otherwise 2 decimals (7.86, 71.11).
inline std::string Decimal(double v) {
  char buf[64];
  const double scaled = v * 1e6;
  if (std::fabs(scaled - std::round(scaled)) < 1e-3) {
    std::snprintf(buf, sizeof buf, "%.6f", v);
    std::string s = buf;
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  }
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

// Bytes in the largest binary unit that keeps the number >= 1 (2 decimals).
inline std::string Human(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = std::fabs(static_cast<double>(bytes));
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%s%lld B", bytes < 0 ? "-" : "", static_cast<long long>(std::llabs(bytes)));
  } else {
    std::snprintf(buf, sizeof buf, "%s%.2f %s", bytes < 0 ? "-" : "", v, units[u]);
  }
  return buf;
}

// Bytes in the largest binary unit that keeps the number >= 1, exact where
// the value allows (Decimal): 70,272 -> "68.625 KiB", 4,997,120 -> "4.765625 MiB".
inline std::string ExactUnit(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return Decimal(v) + " " + units[u];
}

// "70,272 B = 68.625 KiB"; just "320 B" below a KiB.
inline std::string BytesAndUnit(int64_t bytes) {
  return Thousands(bytes) + " B" + (std::llabs(bytes) >= 1024 ? " = " + ExactUnit(bytes) : std::string());
}

}  // namespace mlarun::memory_internal
