#include "bench/memory_bench.h"

#include <algorithm>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <ostream>
#include <utility>
#include <vector>

#include "base/cpu_isa.h"
#include "bench/timing.h"

namespace mlarun {

Status RunMemoryBench(const MemoryBenchOptions& o, std::ostream& out, std::ostream& err) {
  if (o.passes < 1) return InvalidArgumentError("--passes must be at least 1, got ", o.passes);
  if (o.bytes != 0 && o.bytes < (int64_t{1} << 20))
    return InvalidArgumentError("--bytes must be 0 (the default size) or at least 1 MiB, got ", o.bytes);
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<BandwidthProbe> probe, BandwidthProbe::Create(o.bytes));
  MLARUN_RETURN_IF_ERROR(probe->Pass().status());  // faults the buffer's pages in, warms the product
  std::vector<ReadBandwidth> passes;
  for (int i = 0; i < o.passes; ++i) {
    MLARUN_ASSIGN_OR_RETURN(const ReadBandwidth b, probe->Pass());
    passes.push_back(b);
  }
  const auto median = [&](double (*of)(const ReadBandwidth&)) {
    std::vector<double> v;
    for (const ReadBandwidth& b : passes) v.push_back(of(b));
    return Median(std::move(v));
  };
  const double plain = median([](const ReadBandwidth& b) { return b.plain_gb_per_s; });
  const double product = median([](const ReadBandwidth& b) { return b.product_gb_per_s; });
  const double bound = median([](const ReadBandwidth& b) { return b.bound_gb_per_s(); });
  std::ostream& table = o.json ? err : out;
  table << "mlarun bench memory: " << probe->bytes() / (1 << 20) << " MiB, " << probe->threads() << " threads\n"
        << "  cpu: " << CpuSummary() << "\n"
        << "  pass | plain read GB/s | one-row bf16 product GB/s\n";
  for (size_t i = 0; i < passes.size(); ++i)
    table << "  " << std::setw(4) << i + 1 << " | " << std::setw(15) << Fmt(passes[i].plain_gb_per_s, 1) << " | "
          << std::setw(25) << Fmt(passes[i].product_gb_per_s, 1) << "\n";
  table << "  median: plain " << Fmt(plain, 1) << " GB/s, product " << Fmt(product, 1)
        << " GB/s, bound (the faster of the two per pass) " << Fmt(bound, 1) << " GB/s\n";
  if (o.json) {
    nlohmann::json doc;
    doc["cpu"] = CpuJson();
    doc["buffer_bytes"] = probe->bytes();
    doc["threads"] = probe->threads();
    for (const ReadBandwidth& b : passes)
      doc["passes"].push_back({{"plain_gb_per_s", b.plain_gb_per_s}, {"product_gb_per_s", b.product_gb_per_s}});
    doc["median"] = {{"plain_gb_per_s", plain}, {"product_gb_per_s", product}, {"bound_gb_per_s", bound}};
    out << doc.dump(2) << "\n";
  }
  return Status::Ok();
}

}  // namespace mlarun
