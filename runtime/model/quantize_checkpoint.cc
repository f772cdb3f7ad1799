#include "runtime/model/quantize_checkpoint.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "gemm/convert.h"
#include "runtime/model/checkpoint_writer.h"
#include "runtime/model/safetensors.h"
#include "runtime/ops/linear.h"

namespace mlarun {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The compressed-tensors release whose conventions the output follows (its
// quantization_config "version").
constexpr std::string_view kCompressedTensorsVersion = "0.20.1";
// llm-compressor's DeepSeek recipes leave the MoE router unquantized.
constexpr std::string_view kRouterIgnore = "re:.*mlp.gate$";

enum class Kind : uint8_t { kCopy, kToBf16, kQuantize };

// One input tensor and what becomes of it.
struct Item {
  std::string name;
  Kind kind = Kind::kCopy;
  std::vector<int64_t> shape;
  SafetensorsDType in_dtype = SafetensorsDType::kF32;
  DType work = DType::kBF16;  // kQuantize: the dtype the arithmetic (and the scales) are in
  DType qtype = DType::kInt4;
  int64_t group = 0;  // kQuantize: 0 = per channel
  bool symmetric = true;
};

struct Plan {
  std::vector<Item> items;
  std::vector<TensorSpec> specs;
  std::vector<std::string> unquantized;  // modules left as stored although targeted
  int64_t dropped_layers_tensors = 0;
};

bool EndsWith(std::string_view s, std::string_view end) {
  return s.size() >= end.size() && s.substr(s.size() - end.size()) == end;
}

// The decoder layer of "model.layers.<N>.…", or -1.
int64_t LayerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (name.substr(0, kPrefix.size()) != kPrefix) return -1;
  int64_t n = 0;
  size_t i = kPrefix.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && n < (int64_t{1} << 40); ++i)
    n = n * 10 + (name[i] - '0');
  return n;
}

// A decoder layer's projection (attention, dense MLP, routed or shared expert).
bool IsProjection(std::string_view name) {
  if (LayerOf(name) < 0) return false;
  static constexpr std::array<std::string_view, 6> kAttn = {
      ".self_attn.q_proj.weight",    ".self_attn.q_a_proj.weight",
      ".self_attn.q_b_proj.weight",  ".self_attn.kv_a_proj_with_mqa.weight",
      ".self_attn.kv_b_proj.weight", ".self_attn.o_proj.weight"};
  for (std::string_view a : kAttn)
    if (EndsWith(name, a)) return true;
  if (name.find(".mlp.") == std::string_view::npos) return false;
  return EndsWith(name, ".gate_proj.weight") || EndsWith(name, ".up_proj.weight") ||
         EndsWith(name, ".down_proj.weight");
}

std::string Module(std::string_view weight_name) {
  return std::string(weight_name.substr(0, weight_name.size() - std::string_view(".weight").size()));
}

SafetensorsDType StoredDType(DType d) { return d == DType::kBF16 ? SafetensorsDType::kBF16 : SafetensorsDType::kF32; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The output tensors of a quantized item (see the header).
void AddQuantizedSpecs(const Item& it, std::vector<TensorSpec>& specs) {
  const std::string m = Module(it.name);
  const int64_t out = it.shape[0], in = it.shape[1];
  const int64_t groups = it.group > 0 ? CeilDiv(in, it.group) : 1;
  const SafetensorsDType sdt = StoredDType(it.work);
  if (it.qtype == DType::kInt4) {
    specs.push_back({m + ".weight_packed", SafetensorsDType::kI32, {out, CeilDiv(in, 8)}});
    specs.push_back({m + ".weight_shape", SafetensorsDType::kI64, {2}});
    if (!it.symmetric) specs.push_back({m + ".weight_zero_point", SafetensorsDType::kI32, {CeilDiv(out, 8), groups}});
  } else {
    specs.push_back({m + ".weight", SafetensorsDType::kI8, {out, in}});
    if (!it.symmetric) specs.push_back({m + ".weight_zero_point", SafetensorsDType::kI8, {out, groups}});
  }
  specs.push_back({m + ".weight_scale", sdt, {out, groups}});
}

// Whether (and how) tensor `t` is quantized; false leaves it as stored.
bool QuantizeAs(const TensorRef& t, const QuantizeCheckpointOptions& o, Item& it, Plan& plan) {
  const bool lm_head = t.name == "lm_head.weight";
  if (t.shape.size() != 2 || !(IsProjection(t.name) || (lm_head && o.lm_head != LmHeadMode::kKeep))) return false;
  it.qtype = o.dtype, it.group = o.group, it.symmetric = o.symmetric;
  if (lm_head && (o.lm_head == LmHeadMode::kInt8) != (o.dtype == DType::kInt8)) {
    it.qtype = o.lm_head == LmHeadMode::kInt8 ? DType::kInt8 : DType::kInt4;
    it.group = DefaultQuantizeGroup(it.qtype), it.symmetric = true;
  }
  if (it.group > 0 && t.shape[1] % it.group != 0) {
    plan.unquantized.push_back(Module(t.name));
    return false;
  }
  it.kind = Kind::kQuantize;
  it.work = t.dtype == SafetensorsDType::kBF16 || t.dtype == SafetensorsDType::kF8E4M3 ? DType::kBF16 : DType::kF32;
  return true;
}

StatusOr<Plan> MakePlan(const Checkpoint& ckpt, int64_t num_layers, const QuantizeCheckpointOptions& o) {
  Plan plan;
  for (const std::string& name : ckpt.Names()) {
    const TensorRef& t = *ckpt.Find(name);
    if (EndsWith(name, "_scale_inv")) {
      const TensorRef* base = ckpt.Find(std::string_view(name).substr(0, name.size() - 10));
      if (base != nullptr && base->dtype == SafetensorsDType::kF8E4M3) continue;  // consumed by the dequantization
    }
    if (LayerOf(name) >= num_layers) {
      ++plan.dropped_layers_tensors;
      continue;
    }
    Item it{.name = name, .shape = t.shape, .in_dtype = t.dtype};
    if (!QuantizeAs(t, o, it, plan)) it.kind = t.dtype == SafetensorsDType::kF8E4M3 ? Kind::kToBf16 : Kind::kCopy;
    if (it.kind == Kind::kQuantize) {
      AddQuantizedSpecs(it, plan.specs);
    } else {
      plan.specs.push_back({name, it.kind == Kind::kToBf16 ? SafetensorsDType::kBF16 : t.dtype, t.shape});
    }
    plan.items.push_back(std::move(it));
  }
  return plan;
}

// The int4 nibbles of q's row r as compressed-tensors' int32 words
// (little-endian: word j's byte k holds elements 8j + 2k and 8j + 2k + 1).
void PackRowsInt4(const Linear& q, std::vector<std::byte>& out) {
  const int64_t words = CeilDiv(q.in, 8), row_bytes = words * 4, used = CeilDiv(q.in, 2);
  out.assign(static_cast<size_t>(q.out * row_bytes), std::byte{0});
  for (int64_t r = 0; r < q.out; ++r) std::copy_n(q.row(r), used, out.data() + r * row_bytes);
}

// Integer zero point of group (r, g) of an asymmetric q (linear.h: offset =
// -(zp + 8 or 0) * scale).
int32_t ZeroPoint(const Linear& q, int64_t r, int64_t g) {
  const int64_t i = r * q.scale_ld + g;
  const int32_t shift = q.dtype == DType::kInt4 ? 8 : 0;
  return static_cast<int32_t>(std::lround(-q.offset[i] / q.scale[i])) - shift;
}

Status ProcessItem(const Item& it, const Checkpoint& ckpt, CheckpointWriter& w) {
  if (it.kind == Kind::kCopy) {
    const TensorRef& t = *ckpt.Find(it.name);
    Status s = w.Write(it.name, t.data, t.bytes);
    ckpt.Release(it.name);
    return s;
  }
  const DType load = it.kind == Kind::kToBf16 ? DType::kBF16 : it.work;
  int64_t n = 1;
  for (int64_t d : it.shape) n *= d;
  std::vector<std::byte> buf(static_cast<size_t>(n) * DTypeSize(load));
  MLARUN_RETURN_IF_ERROR(ckpt.Load(it.name, it.shape, load, buf.data()));
  ckpt.Release(it.name);
  if (it.kind == Kind::kToBf16) return w.Write(it.name, buf.data(), buf.size());
  Linear src;
  src.out = it.shape[0], src.in = it.shape[1], src.dtype = load, src.ld = src.in;
  src.data = buf.data();
  StatusOr<Linear> q = QuantizeLinear(src, {.dtype = it.qtype, .group = it.group, .symmetric = it.symmetric});
  if (!q.ok()) return InvalidArgumentError(it.name, ": ", q.status().message());
  for (const EncodedTensor& e : EncodeCompressedTensors(Module(it.name), *q, it.work))
    MLARUN_RETURN_IF_ERROR(w.Write(e.spec.name, e.data.data(), e.data.size()));
  return Status::Ok();
}

json WeightArgs(DType dtype, int64_t group, bool symmetric) {
  return {{"num_bits", dtype == DType::kInt4 ? 4 : 8},
          {"type", "int"},
          {"symmetric", symmetric},
          {"strategy", group > 0 ? "group" : "channel"},
          {"group_size", group > 0 ? json(group) : json(nullptr)},
          {"dynamic", false},
          {"observer", "minmax"}};
}

std::string_view FormatOf(DType dtype) { return dtype == DType::kInt4 ? "pack-quantized" : "int-quantized"; }

// quantization_config as llm-compressor writes it (ModelCompressor.update_config).
json QuantizationConfig(const QuantizeCheckpointOptions& o, const Plan& plan, bool has_lm_head) {
  json groups = {{"group_0",
                  {{"targets", {"Linear"}},
                   {"weights", WeightArgs(o.dtype, o.group, o.symmetric)},
                   {"input_activations", nullptr},
                   {"output_activations", nullptr},
                   {"format", nullptr}}}};
  std::string format(FormatOf(o.dtype));
  json ignore = json::array();
  if (o.lm_head == LmHeadMode::kKeep) ignore.push_back("lm_head");
  const DType lm = o.lm_head == LmHeadMode::kInt8 ? DType::kInt8 : DType::kInt4;
  if (o.lm_head != LmHeadMode::kKeep && lm != o.dtype && has_lm_head) {
    // Two formats: each group names its own, the whole "mixed-precision".
    groups["group_0"]["format"] = format;
    groups["group_1"] = {{"targets", {"lm_head"}},
                         {"weights", WeightArgs(lm, DefaultQuantizeGroup(lm), true)},
                         {"input_activations", nullptr},
                         {"output_activations", nullptr},
                         {"format", FormatOf(lm)}};
    format = "mixed-precision";
  }
  ignore.push_back(kRouterIgnore);
  for (const std::string& m : plan.unquantized) ignore.push_back(m);
  return {{"config_groups", groups},
          {"format", format},
          {"global_compression_ratio", nullptr},
          {"ignore", ignore},
          {"kv_cache_scheme", nullptr},
          {"moe_sparsity_config", nullptr},
          {"quant_method", "compressed-tensors"},
          {"quantization_status", "compressed"},
          {"sparsity_config", json::object()},
          {"transform_config", json::object()},
          {"version", kCompressedTensorsVersion}};
}

StatusOr<json> ReadJson(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return NotFoundError("cannot open ", path.string());
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgumentError(path.string(), " is not a JSON object");
  return j;
}

Status WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return FailedPreconditionError("cannot write ", path.string());
  return Status::Ok();
}

Status CheckOptions(const QuantizeCheckpointOptions& o) {
  if (o.dtype != DType::kInt8 && o.dtype != DType::kInt4)
    return InvalidArgumentError("quantize: format must be int8 or int4");
  if (o.group < 0 || o.group % 2 != 0)
    return InvalidArgumentError("quantize: --group-size ", o.group,
                                " must be 0 (per channel) or a positive even number (32, 64, 128)");
  std::error_code ec;
  if (!fs::is_directory(o.model_dir, ec))
    return NotFoundError("quantize: --model ", o.model_dir, " is not a directory");
  if (!fs::is_regular_file(fs::path(o.model_dir) / "config.json", ec))
    return NotFoundError("quantize: --model ", o.model_dir, " has no config.json");
  if (fs::exists(o.out_dir, ec) && (!fs::is_directory(o.out_dir, ec) || !fs::is_empty(o.out_dir, ec)))
    return FailedPreconditionError("quantize: --out ", o.out_dir, " exists and is not an empty directory");
  if (fs::equivalent(o.model_dir, o.out_dir, ec)) return InvalidArgumentError("quantize: --out is --model");
  return Status::Ok();
}

// Everything beside the weights and config.json: tokenizer files,
// generation_config.json, the remote-code modules DeepSeek-V2 ships.
Status CopySideFiles(const fs::path& in, const fs::path& out) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(in, ec)) {
    const std::string name = e.path().filename().string();
    const std::string ext = e.path().extension().string();
    if (!e.is_regular_file() || name == "config.json" || name == "model.safetensors.index.json" ||
        ext == ".safetensors" || ext == ".bin" || ext == ".pt" || ext == ".pth" || ext == ".gguf")
      continue;
    fs::copy_file(e.path(), out / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return FailedPreconditionError("quantize: cannot copy ", e.path().string(), ": ", ec.message());
  }
  if (ec) return FailedPreconditionError("quantize: cannot list ", in.string(), ": ", ec.message());
  return Status::Ok();
}

// Runs every item on `threads` threads; the first error stops the rest.
Status RunItems(const Plan& plan, const Checkpoint& ckpt, CheckpointWriter& w, int threads,
                const QuantizeCheckpointOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  std::atomic<size_t> next{0};
  std::mutex mutex;
  Status first = Status::Ok();
  QuantizeProgress progress{.tensors_total = static_cast<int64_t>(plan.specs.size()), .bytes_total = w.tensor_bytes()};
  std::vector<int64_t> item_bytes(plan.items.size(), 0);
  std::vector<int64_t> item_tensors(plan.items.size(), 1);
  for (size_t i = 0, s = 0; i < plan.items.size(); ++i) {
    const bool q = plan.items[i].kind == Kind::kQuantize;
    const size_t k = !q                                    ? 1
                     : plan.items[i].qtype == DType::kInt4 ? (plan.items[i].symmetric ? 3 : 4)
                                                           : (plan.items[i].symmetric ? 2 : 3);
    item_tensors[i] = static_cast<int64_t>(k);
    for (size_t j = 0; j < k; ++j) item_bytes[i] += plan.specs[s + j].bytes();
    s += k;
  }
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < plan.items.size();) {
      Status s = ProcessItem(plan.items[i], ckpt, w);
      std::lock_guard<std::mutex> lock(mutex);
      if (!s.ok()) {
        if (first.ok()) first = s;
        next = plan.items.size();
        return;
      }
      progress.tensors_done += item_tensors[i], progress.bytes_done += item_bytes[i];
      progress.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (o.progress) o.progress(progress);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  return first;
}

}  // namespace

std::vector<EncodedTensor> EncodeCompressedTensors(std::string_view module, const Linear& q, DType scale_dtype) {
  const std::string m(module);
  const bool int4 = q.dtype == DType::kInt4, symmetric = q.offset == nullptr;
  const int64_t groups = q.groups();
  std::vector<EncodedTensor> out;
  if (int4) {
    out.push_back({{m + ".weight_packed", SafetensorsDType::kI32, {q.out, CeilDiv(q.in, 8)}}, {}});
    PackRowsInt4(q, out.back().data);
    const int64_t shape[2] = {q.out, q.in};
    const auto* p = reinterpret_cast<const std::byte*>(shape);
    out.push_back({{m + ".weight_shape", SafetensorsDType::kI64, {2}}, std::vector<std::byte>(p, p + sizeof(shape))});
  } else {
    out.push_back({{m + ".weight", SafetensorsDType::kI8, {q.out, q.in}}, {}});
    std::vector<std::byte>& d = out.back().data;
    d.resize(static_cast<size_t>(q.out * q.in));
    for (int64_t r = 0; r < q.out; ++r) std::copy_n(q.row(r), q.in, d.data() + r * q.in);
  }
  if (!symmetric && int4) {
    // Packed along `out`: word (r / 8, g) holds row r's zp + 8 in bits 4 (r % 8).
    std::vector<uint32_t> words(static_cast<size_t>(CeilDiv(q.out, 8) * groups), 0);
    for (int64_t r = 0; r < q.out; ++r)
      for (int64_t g = 0; g < groups; ++g)
        words[(r / 8) * groups + g] |= static_cast<uint32_t>(ZeroPoint(q, r, g) + 8) << (4 * (r % 8));
    const auto* p = reinterpret_cast<const std::byte*>(words.data());
    out.push_back({{m + ".weight_zero_point", SafetensorsDType::kI32, {CeilDiv(q.out, 8), groups}},
                   std::vector<std::byte>(p, p + words.size() * 4)});
  } else if (!symmetric) {
    out.push_back({{m + ".weight_zero_point", SafetensorsDType::kI8, {q.out, groups}}, {}});
    std::vector<std::byte>& d = out.back().data;
    for (int64_t r = 0; r < q.out; ++r)
      for (int64_t g = 0; g < groups; ++g) d.push_back(static_cast<std::byte>(ZeroPoint(q, r, g)));
  }
  // Scales in the weight's dtype (exact: QuantizeLinear made values of it).
  std::vector<float> s(static_cast<size_t>(q.out * groups));
  for (int64_t r = 0; r < q.out; ++r) std::copy_n(q.scale + r * q.scale_ld, groups, s.data() + r * groups);
  out.push_back({{m + ".weight_scale", StoredDType(scale_dtype), {q.out, groups}}, {}});
  out.back().data.resize(s.size() * DTypeSize(scale_dtype));
  StoreFromF32(s.data(), out.back().data.data(), scale_dtype, static_cast<int64_t>(s.size()));
  return out;
}

Status QuantizeCheckpoint(const QuantizeCheckpointOptions& o) {
  MLARUN_RETURN_IF_ERROR(CheckOptions(o));
  const auto start = std::chrono::steady_clock::now();
  const fs::path in(o.model_dir), out(o.out_dir);
  MLARUN_ASSIGN_OR_RETURN(json config, ReadJson(in / "config.json"));
  const auto layers = config.find("num_hidden_layers");
  if (layers == config.end() || !layers->is_number_integer() || layers->get<int64_t>() < 0)
    return InvalidArgumentError("quantize: ", (in / "config.json").string(), ": num_hidden_layers is missing");
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(o.model_dir));
  MLARUN_ASSIGN_OR_RETURN(Plan plan, MakePlan(*ckpt, layers->get<int64_t>(), o));
  const bool any =
      std::any_of(plan.items.begin(), plan.items.end(), [](const Item& i) { return i.kind == Kind::kQuantize; });
  if (!any)
    return InvalidArgumentError("quantize: no projection of ", o.model_dir, " has an input width that --group-size ",
                                o.group, " divides; choose a smaller group size (or 0, per channel)");
  if (o.note && !plan.unquantized.empty()) {
    std::string names;
    for (size_t i = 0; i < plan.unquantized.size() && i < 4; ++i) names += (i ? ", " : "") + plan.unquantized[i];
    if (plan.unquantized.size() > 4) names += internal::StrCat(" and ", plan.unquantized.size() - 4, " more");
    o.note(internal::StrCat(plan.unquantized.size(), " modules stay unquantized (listed in ignore): their input width ",
                            "is not a multiple of --group-size ", o.group, ": ", names));
  }
  if (o.note) {
    if (plan.dropped_layers_tensors > 0)
      o.note(internal::StrCat("left out ", plan.dropped_layers_tensors, " tensors of layers past num_hidden_layers (",
                              layers->get<int64_t>(), "): the multi-token prediction layer"));
  }
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return FailedPreconditionError("quantize: cannot create ", out.string(), ": ", ec.message());
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                          CheckpointWriter::Create(o.out_dir, plan.specs, o.max_shard_bytes));
  // The specs of an item are contiguous and in item order (MakePlan), which
  // RunItems relies on to count progress.
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  MLARUN_RETURN_IF_ERROR(RunItems(plan, *ckpt, *w, threads, o));
  MLARUN_RETURN_IF_ERROR(w->Finish());
  config["quantization_config"] = QuantizationConfig(o, plan, ckpt->Find("lm_head.weight") != nullptr);
  MLARUN_RETURN_IF_ERROR(WriteText(out / "config.json", config.dump(2) + "\n"));
  MLARUN_RETURN_IF_ERROR(CopySideFiles(in, out));
  if (o.progress) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    QuantizeProgress done{.tensors_done = static_cast<int64_t>(plan.specs.size()),
                          .tensors_total = static_cast<int64_t>(plan.specs.size()),
                          .bytes_done = w->tensor_bytes(),
                          .bytes_total = w->tensor_bytes(),
                          .seconds = seconds,
                          .finished = true};
    o.progress(done);
  }
  return Status::Ok();
}

}  // namespace mlarun
