// The deployment file (configs/deploy/*.yaml): parsed here, without gRPC, so
// the parser can be tested and fuzzed on its own (tests/fuzz).
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "serving/client/client.h"

namespace mlarun {
namespace {

constexpr const char* kDeploymentKeys =
    "model, parallel, coordinator, listen, policy, cache_bytes, memory_gib, kv_dtype, max_batched_tokens";

// The line of a YAML node for messages ("file:line: ..."); yaml-cpp counts from 0.
std::string Where(const std::string& path, const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  return m.is_null() ? path : path + ":" + std::to_string(m.line + 1);
}

Status ReadString(const std::string& path, const std::string& key, const YAML::Node& v, std::string* out) {
  // A string-valued key takes any scalar (yaml-cpp keeps its text, so
  // `listen: 127.0.0.1:50051` and `policy: "x"` both work); `key:` with no
  // value, a list or a mapping is a wrong type.
  if (!v.IsScalar())
    return InvalidArgumentError(Where(path, v), ": key '", key, "' must be a string, got ",
                                v.IsNull()       ? "nothing"
                                : v.IsSequence() ? "a list"
                                                 : "a mapping");
  *out = v.Scalar();
  return Status::Ok();
}

Status ReadPositiveInt(const std::string& path, const std::string& key, const YAML::Node& v, int64_t* out) {
  int64_t x = 0;
  bool ok = v.IsScalar();
  if (ok) {
    try {
      x = v.as<int64_t>();
    } catch (const YAML::Exception&) {
      ok = false;
    }
  }
  if (!ok)
    return InvalidArgumentError(
        Where(path, v), ": key '", key, "' must be an integer, got ",
        v.IsScalar() ? "'" + v.Scalar() + "'" : std::string(v.IsNull() ? "nothing" : "a collection"));
  // 0 means "not set" in DeploymentConfig; writing it in a file is a mistake.
  if (x <= 0) return InvalidArgumentError(Where(path, v), ": key '", key, "' must be positive, got ", x);
  *out = x;
  return Status::Ok();
}

Status ParseDeployment(const std::string& path, const YAML::Node& root, DeploymentConfig* c) {
  if (root.IsNull()) return Status::Ok();  // empty, or comments only: nothing set
  if (!root.IsMap())
    return InvalidArgumentError(path, ": expected a mapping of deployment keys (", kDeploymentKeys, ")");
  std::set<std::string> seen;
  for (const auto& kv : root) {
    if (!kv.first.IsScalar()) return InvalidArgumentError(Where(path, kv.first), ": keys must be plain names");
    const std::string key = kv.first.Scalar();
    // yaml-cpp 0.7 keeps both entries of a duplicated key; say so instead of letting one silently win.
    if (!seen.insert(key).second) return InvalidArgumentError(Where(path, kv.first), ": key '", key, "' appears twice");
    const YAML::Node& v = kv.second;
    if (key == "model") {
      MLARUN_RETURN_IF_ERROR(ReadString(path, key, v, &c->model));
    } else if (key == "parallel") {
      MLARUN_RETURN_IF_ERROR(ReadString(path, key, v, &c->parallel));
    } else if (key == "coordinator") {
      MLARUN_RETURN_IF_ERROR(ReadString(path, key, v, &c->coordinator));
    } else if (key == "listen") {
      MLARUN_RETURN_IF_ERROR(ReadString(path, key, v, &c->listen));
    } else if (key == "policy") {
      MLARUN_RETURN_IF_ERROR(ReadString(path, key, v, &c->policy));
    } else if (key == "kv_dtype") {
      MLARUN_RETURN_IF_ERROR(ReadString(path, key, v, &c->kv_dtype));
    } else if (key == "cache_bytes") {
      MLARUN_RETURN_IF_ERROR(ReadPositiveInt(path, key, v, &c->cache_bytes));
    } else if (key == "memory_gib") {
      bool ok = v.IsScalar();
      double x = 0;
      if (ok) {
        try {
          x = v.as<double>();
        } catch (const YAML::Exception&) {
          ok = false;
        }
      }
      if (!ok || !(x > 0))
        return InvalidArgumentError(Where(path, v), ": key 'memory_gib' must be a positive number of GiB, got ",
                                    v.IsScalar() ? "'" + v.Scalar() + "'" : std::string("a collection or nothing"));
      c->memory_gib = x;
    } else if (key == "max_batched_tokens") {
      MLARUN_RETURN_IF_ERROR(ReadPositiveInt(path, key, v, &c->max_batched_tokens));
    } else {
      return InvalidArgumentError(Where(path, kv.first), ": unknown key '", key, "' (known: ", kDeploymentKeys, ")");
    }
  }
  if (c->cache_bytes > 0 && c->memory_gib > 0)
    return InvalidArgumentError(path, ": give cache_bytes or memory_gib, not both");
  return Status::Ok();
}

}  // namespace

StatusOr<DeploymentConfig> LoadDeploymentConfig(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return NotFoundError("deployment config ", path, ": no such file");
  if (std::filesystem::is_directory(path, ec))
    return InvalidArgumentError("deployment config ", path, ": is a directory");
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFoundError("deployment config ", path, ": cannot read the file");
  std::ostringstream text;
  text << f.rdbuf();
  if (f.bad()) return InvalidArgumentError("deployment config ", path, ": error reading the file");
  return ParseDeploymentConfig(text.str(), path);
}

StatusOr<DeploymentConfig> ParseDeploymentConfig(std::string_view yaml_text, const std::string& path) {
  DeploymentConfig c;
  // yaml-cpp reports syntax errors, bad conversions and even iterator misuse by
  // throwing; nothing may escape a library function, so every exception ends here.
  try {
    const YAML::Node root = YAML::Load(std::string(yaml_text));
    MLARUN_RETURN_IF_ERROR(ParseDeployment(path, root, &c));
  } catch (const YAML::Exception& e) {
    return InvalidArgumentError(path, e.mark.is_null() ? std::string() : ":" + std::to_string(e.mark.line + 1), ": ",
                                e.msg);
  } catch (const std::exception& e) {
    return InvalidArgumentError(path, ": ", e.what());
  }
  return c;
}

}  // namespace mlarun
