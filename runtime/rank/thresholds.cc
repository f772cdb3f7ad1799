#include "runtime/rank/thresholds.h"

#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/cpu_isa.h"

namespace mlarun {

Status WriteAbsorbThresholds(const std::string& path, const AbsorbThresholds& t) {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  const nlohmann::json j = {{"absorb_below_query_len", t.with_prefix},
                            {"absorb_below_query_len_no_prefix", t.no_prefix},
                            {"kernels", std::string(CpuIsaName(ActiveCpuIsa()))},
                            {"cpu", HostCpu().model_name},
                            {"date", date}};
  std::ofstream f(path);
  if (!f) return InvalidArgumentError("cannot write thresholds file ", path);
  f << j.dump(2) << "\n";
  if (!f) return InternalError("writing thresholds file ", path, " failed");
  return Status::Ok();
}

StatusOr<AbsorbThresholds> LoadAbsorbThresholds(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFoundError("thresholds file ", path, " cannot be read");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError("thresholds file ", path, " is not JSON: ", e.what());
  }
  if (!j.is_object()) return InvalidArgumentError("thresholds file ", path, ": expected a JSON object");
  auto field = [&](const char* name) -> StatusOr<int64_t> {
    if (!j.contains(name)) return InvalidArgumentError("thresholds file ", path, ": missing \"", name, "\"");
    const nlohmann::json& v = j[name];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      return InvalidArgumentError("thresholds file ", path, ": \"", name, "\" must be a non-negative integer, got ",
                                  v.dump());
    return v.get<int64_t>();
  };
  AbsorbThresholds t;
  MLARUN_ASSIGN_OR_RETURN(t.with_prefix, field("absorb_below_query_len"));
  MLARUN_ASSIGN_OR_RETURN(t.no_prefix, field("absorb_below_query_len_no_prefix"));
  if (j.contains("kernels")) {
    if (!j["kernels"].is_string())
      return InvalidArgumentError("thresholds file ", path, ": \"kernels\" must be a string");
    const std::string kernels = j["kernels"].get<std::string>();
    MLARUN_ASSIGN_OR_RETURN(const CpuIsa isa, ParseCpuIsa(kernels));
    if (isa != ActiveCpuIsa())
      return InvalidArgumentError("thresholds file ", path, " was measured with the ", kernels,
                                  " kernels; this process runs the ", CpuIsaName(ActiveCpuIsa()),
                                  " kernels (measure again with `mlarun bench attention --write-thresholds`)");
  }
  return t;
}

Status ApplyAbsorbThresholdsFile(const std::string& path, MlaConfig* c) {
  if (path.empty()) return Status::Ok();
  MLARUN_ASSIGN_OR_RETURN(const AbsorbThresholds t, LoadAbsorbThresholds(path));
  c->absorb_below_query_len = t.with_prefix;
  c->absorb_below_query_len_no_prefix = t.no_prefix;
  return Status::Ok();
}

}  // namespace mlarun
