// `mlarun bench memory`: its options, and that the JSON reports every pass
// and their medians (the figures themselves are the machine's, not checked).
#include "bench/memory_bench.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

namespace mlarun {
namespace {

TEST(MemoryBench, RefusesBadOptions) {
  std::ostringstream out, err;
  const Status passes = RunMemoryBench({.passes = 0}, out, err);
  EXPECT_EQ(passes.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(passes.message().find("--passes"), std::string::npos) << passes;
  const Status bytes = RunMemoryBench({.passes = 1, .bytes = 4096}, out, err);
  EXPECT_EQ(bytes.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bytes.message().find("--bytes"), std::string::npos) << bytes;
  EXPECT_EQ(out.str(), "");
}

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

TEST(MemoryBench, JsonHasEveryPassAndTheirMedians) {
  for (int passes : {3, 4}) {
    std::ostringstream out, err;
    const Status st = RunMemoryBench({.passes = passes, .bytes = int64_t{64} << 20, .json = true}, out, err);
    ASSERT_TRUE(st.ok()) << st;
    const nlohmann::json doc = nlohmann::json::parse(out.str());
    ASSERT_EQ(doc["passes"].size(), static_cast<size_t>(passes));
    std::vector<double> plain, product, bound;
    for (const auto& p : doc["passes"]) {
      const double a = p["plain_gb_per_s"], b = p["product_gb_per_s"];
      ASSERT_TRUE(std::isfinite(a) && a > 0 && std::isfinite(b) && b > 0) << p.dump();
      plain.push_back(a);
      product.push_back(b);
      bound.push_back(std::max(a, b));
    }
    EXPECT_DOUBLE_EQ(doc["median"]["plain_gb_per_s"], MedianOf(plain));
    EXPECT_DOUBLE_EQ(doc["median"]["product_gb_per_s"], MedianOf(product));
    EXPECT_DOUBLE_EQ(doc["median"]["bound_gb_per_s"], MedianOf(bound));
    EXPECT_EQ(doc["buffer_bytes"].get<int64_t>() >> 20, 64);
    EXPECT_GE(doc["threads"].get<int>(), 1);
    EXPECT_TRUE(doc["cpu"].contains("kernels"));
    EXPECT_NE(err.str().find("median"), std::string::npos) << err.str();  // the table, beside the JSON
  }
}

}  // namespace
}  // namespace mlarun
