#include "bench/accuracy_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <sstream>

#include "bench/local_cache.h"
#include "runtime/model/model.h"
#include "runtime/rank/bootstrap.h"

namespace mlarun {

Status ValidateAccuracyOptions(const AccuracyBenchOptions& o) {
  if (o.positions <= 0) return InvalidArgumentError("--positions must be positive, got ", o.positions);
  if (o.sequence_length <= 0)
    return InvalidArgumentError("--sequence-length must be positive, got ", o.sequence_length);
  if (o.chunk_tokens < 0) return InvalidArgumentError("--chunk-tokens must be 0 or positive, got ", o.chunk_tokens);
  if (o.positions % o.sequence_length != 0)
    return InvalidArgumentError("--positions (", o.positions, ") must be a multiple of --sequence-length (",
                                o.sequence_length, ")");
  if (o.reference.empty()) return InvalidArgumentError("--reference is required");
  if (o.write_ids.empty() && o.models.empty() && o.llama_logits.empty())
    return InvalidArgumentError("nothing to compare with the reference: give --model or --llama-logits");
  return Status::Ok();
}

std::vector<int32_t> AccuracyIds(int64_t positions, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> id(0, vocab - 1);
  std::vector<int32_t> ids(static_cast<size_t>(positions));
  for (int32_t& t : ids) t = static_cast<int32_t>(id(rng));
  return ids;
}

namespace {
constexpr const char* kIdsMagic = "mlarun-accuracy-ids";
}  // namespace

Status WriteAccuracyIds(const std::string& path, const AccuracyIdsFile& f) {
  std::ofstream os(path);
  if (!os) return NotFoundError("cannot write the ids file ", path);
  os << kIdsMagic << " 1\nsequence_length " << f.sequence_length << "\npositions " << f.ids.size() << "\n";
  for (size_t i = 0; i < f.ids.size(); ++i) os << f.ids[i] << ((i + 1) % 16 == 0 ? '\n' : ' ');
  os << "\n";
  os.flush();
  if (!os) return InternalError("writing the ids file ", path, " failed");
  return Status::Ok();
}

StatusOr<AccuracyIdsFile> ReadAccuracyIds(const std::string& path) {
  std::ifstream is(path);
  if (!is) return NotFoundError("cannot open the ids file ", path);
  std::string magic, key_l, key_n;
  int64_t version = 0, positions = -1;
  AccuracyIdsFile f;
  if (!(is >> magic >> version) || magic != kIdsMagic || version != 1)
    return InvalidArgumentError(path, ": not an ids file (its first line must be '", kIdsMagic, " 1')");
  if (!(is >> key_l >> f.sequence_length) || key_l != "sequence_length" || f.sequence_length <= 0)
    return InvalidArgumentError(path, ": the second line must be 'sequence_length L' with L > 0");
  if (!(is >> key_n >> positions) || key_n != "positions" || positions <= 0)
    return InvalidArgumentError(path, ": the third line must be 'positions N' with N > 0");
  int64_t v = 0;
  while (is >> v) {
    if (v < 0 || v > std::numeric_limits<int32_t>::max())
      return InvalidArgumentError(path, ": id ", f.ids.size(), " is ", v, ", outside [0, 2^31)");
    f.ids.push_back(static_cast<int32_t>(v));
  }
  if (!is.eof()) return InvalidArgumentError(path, ": id ", f.ids.size(), " is not an integer");
  if (static_cast<int64_t>(f.ids.size()) != positions)
    return InvalidArgumentError(path, ": 'positions ", positions, "' but it holds ", f.ids.size(), " ids");
  return f;
}

double RelativeError(std::span<const float> ref, std::span<const float> x) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double r = ref[i], d = static_cast<double>(x[i]) - r;
    diff += d * d;
    norm += r * r;
  }
  if (norm == 0) return diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

namespace {
// log(sum(exp(x))), the maximum taken out first.
double LogSumExp(std::span<const float> x) {
  double m = -std::numeric_limits<double>::infinity();
  for (const float v : x) m = std::max(m, static_cast<double>(v));
  double s = 0;
  for (const float v : x) s += std::exp(static_cast<double>(v) - m);
  return m + std::log(s);
}
}  // namespace

double KlDivergence(std::span<const float> ref, std::span<const float> x) {
  const double lse_r = LogSumExp(ref), lse_x = LogSumExp(x);
  double kl = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double log_pr = static_cast<double>(ref[i]) - lse_r;
    const double log_px = static_cast<double>(x[i]) - lse_x;
    kl += std::exp(log_pr) * (log_pr - log_px);
  }
  return kl;
}

int64_t Argmax(std::span<const float> x) {
  int64_t best = 0;
  for (size_t i = 1; i < x.size(); ++i)
    if (x[i] > x[static_cast<size_t>(best)]) best = static_cast<int64_t>(i);
  return best;
}

bool Top1Agrees(std::span<const float> ref, std::span<const float> x) {
  return ref[static_cast<size_t>(Argmax(x))] == ref[static_cast<size_t>(Argmax(ref))];
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

Status LogitComparison::Add(std::span<const float> ref, std::span<const float> x, const std::string& what) {
  const size_t pos = rel_err_.size();
  if (ref.size() != x.size() || ref.empty())
    return InvalidArgumentError(what, ": position ", pos, " has ", x.size(), " logits, the reference ", ref.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return InvalidArgumentError(what, ": logit ", i, " at position ", pos, " is ", x[i]);
    if (!std::isfinite(ref[i]))
      return InvalidArgumentError("the reference's logit ", i, " at position ", pos, " is ", ref[i]);
  }
  rel_err_.push_back(RelativeError(ref, x));
  kl_.push_back(KlDivergence(ref, x));
  top1_ += Top1Agrees(ref, x);
  return Status::Ok();
}

LogitComparison::Summary LogitComparison::Summarize() const {
  Summary s;
  s.positions = static_cast<int64_t>(rel_err_.size());
  if (s.positions == 0) return s;
  const auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (const double e : v) sum += e;
    return sum / static_cast<double>(v.size());
  };
  s.rel_err_mean = mean(rel_err_);
  s.rel_err_median = Quantile(rel_err_, 0.5);
  s.rel_err_max = *std::max_element(rel_err_.begin(), rel_err_.end());
  s.kl_mean = mean(kl_);
  s.kl_p99 = Quantile(kl_, 0.99);
  s.kl_max = *std::max_element(kl_.begin(), kl_.end());
  s.top1_percent = 100.0 * static_cast<double>(top1_) / static_cast<double>(s.positions);
  return s;
}

namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The last part of a path ("a/b/" -> "b"), a ".logits" suffix dropped.
std::string ShortName(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).lexically_normal();
  std::string name = p.filename().string();
  if (name.empty()) name = p.parent_path().filename().string();
  const std::string suffix = ".logits";
  if (name.size() > suffix.size() && name.ends_with(suffix)) name.resize(name.size() - suffix.size());
  return name;
}

struct Run {
  const AccuracyBenchOptions& o;
  std::ostream& err;
  std::vector<int32_t> ids;
  int64_t vocab = 0;
  std::vector<float> ref;  // [positions, vocab]
};

using OnSequence = std::function<Status(int64_t seq, std::span<const float> logits)>;

// Loads `path` and runs every sequence of run.ids from an empty cache, all
// of its logits to `on_seq` ([sequence_length, vocab]).
Status RunModel(const Run& run, const std::string& path, const OnSequence& on_seq) {
  const auto t0 = std::chrono::steady_clock::now();
  MLARUN_ASSIGN_OR_RETURN(LoadedModel lm, LoadModelForSpec(DeploymentSpec{.model = path}, ModelShard{}));
  Model& model = *lm.model;
  const int64_t L = run.o.sequence_length;
  if (lm.config.max_position_embeddings > 0 && L > lm.config.max_position_embeddings)
    return InvalidArgumentError("--sequence-length ", L, " exceeds ", path, "'s max_position_embeddings ",
                                lm.config.max_position_embeddings);
  LatentCacheConfig cc = model.CacheConfig(0, 64);
  cc.enable_prefix_caching = false;
  cc.budget_bytes = cc.block_bytes() * ((L + cc.block_size - 1) / cc.block_size + 1);
  MLARUN_ASSIGN_OR_RETURN(LocalLatentCache cache, LocalLatentCache::Create(cc, model.memory()));
  run.err << "  " << path << ": loaded in " << Seconds(t0) << " s\n" << std::flush;
  const auto t1 = std::chrono::steady_clock::now();
  const int64_t sequences = run.o.positions / L;
  const int64_t chunk = run.o.chunk_tokens > 0 ? std::min(run.o.chunk_tokens, L) : L;
  for (int64_t s = 0; s < sequences; ++s) {
    std::vector<float> logits;
    for (int64_t t0 = 0; t0 < L; t0 += chunk) {
      const std::span<const int32_t> tokens(run.ids.data() + s * L + t0, static_cast<size_t>(std::min(chunk, L - t0)));
      MLARUN_ASSIGN_OR_RETURN(const ForwardSeq fs, cache.Append(s, tokens, ForwardSeq::Logits::kAll));
      MLARUN_ASSIGN_OR_RETURN(const std::vector<float> part,
                              model.Forward(std::span<const ForwardSeq>(&fs, 1), *cache.pool));
      logits.insert(logits.end(), part.begin(), part.end());
    }
    if (static_cast<int64_t>(logits.size()) != L * lm.config.vocab_size)
      return InternalError(path, ": sequence ", s, " gave ", logits.size(), " logits, expected ", L, " x ",
                           lm.config.vocab_size);
    MLARUN_RETURN_IF_ERROR(on_seq(s, logits));
    MLARUN_RETURN_IF_ERROR(cache.blocks->Release(s));
  }
  run.err << "  " << path << ": " << run.o.positions << " positions in " << Seconds(t1) << " s\n" << std::flush;
  return Status::Ok();
}

// Compares sequence s's rows with the reference's.
Status CompareRows(const Run& run, LogitComparison& cmp, int64_t s, std::span<const float> logits,
                   const std::string& what) {
  const int64_t L = run.o.sequence_length, V = run.vocab;
  if (static_cast<int64_t>(logits.size()) != L * V)
    return InvalidArgumentError(what, ": ", logits.size() / static_cast<size_t>(L),
                                " logits per position, the reference has ", V);
  for (int64_t t = 0; t < L; ++t) {
    const std::span<const float> r(run.ref.data() + (s * L + t) * V, static_cast<size_t>(V));
    MLARUN_RETURN_IF_ERROR(cmp.Add(r, logits.subspan(static_cast<size_t>(t * V), static_cast<size_t>(V)), what));
  }
  return Status::Ok();
}

Status CompareModel(const Run& run, const std::string& path, LogitComparison& cmp) {
  return RunModel(run, path,
                  [&](int64_t s, std::span<const float> logits) { return CompareRows(run, cmp, s, logits, path); });
}

// A llama_logits file: its ids must be this run's, its size positions x vocab.
Status CompareLlamaFile(const Run& run, const std::string& path, LogitComparison& cmp) {
  MLARUN_ASSIGN_OR_RETURN(const AccuracyIdsFile f, ReadAccuracyIds(path + ".ids"));
  const int64_t L = run.o.sequence_length, V = run.vocab;
  if (f.sequence_length != L)
    return InvalidArgumentError(path, ".ids: sequence_length ", f.sequence_length, ", this run's is ", L);
  if (f.ids.size() != run.ids.size())
    return InvalidArgumentError(path, ".ids: ", f.ids.size(), " positions, this run has ", run.ids.size());
  const auto diff = std::mismatch(f.ids.begin(), f.ids.end(), run.ids.begin());
  if (diff.first != f.ids.end())
    return InvalidArgumentError(path, ".ids: id ", diff.first - f.ids.begin(), " is ", *diff.first, ", this run's is ",
                                *diff.second, " (other --seed?)");
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  if (ec) return NotFoundError("cannot read the logits file ", path, ": ", ec.message());
  const uint64_t want = static_cast<uint64_t>(run.o.positions) * static_cast<uint64_t>(V) * sizeof(float);
  if (bytes != want)
    return InvalidArgumentError(path, ": ", bytes, " bytes, expected ", run.o.positions, " positions x ", V,
                                " logits x 4 = ", want, " (another vocabulary?)");
  std::ifstream is(path, std::ios::binary);
  std::vector<float> rows(static_cast<size_t>(L * V));
  for (int64_t s = 0; s < run.o.positions / L; ++s) {
    if (!is.read(reinterpret_cast<char*>(rows.data()), static_cast<std::streamsize>(rows.size() * sizeof(float))))
      return InternalError(path, ": reading sequence ", s, " failed");
    MLARUN_RETURN_IF_ERROR(CompareRows(run, cmp, s, rows, path));
  }
  return Status::Ok();
}

struct Row {
  std::string source, name, path;
  Status status;
  LogitComparison::Summary m;
};

void PrintTable(const Run& run, const std::vector<Row>& rows, std::ostream& os) {
  os << "\nagainst " << run.o.reference << ": " << run.o.positions << " positions ("
     << run.o.positions / run.o.sequence_length << " sequences of " << run.o.sequence_length << " random ids, seed "
     << run.o.seed << ")\n\n";
  os << "| format | rel err mean | rel err median | rel err max | KL mean | KL p99 | KL max | top-1 % |\n"
     << "|---|---|---|---|---|---|---|---|\n";
  for (const Row& r : rows) {
    os << "| " << r.source << " " << r.name << " | ";
    if (!r.status.ok()) {
      os << "error: " << r.status.message() << " |||||||\n";
      continue;
    }
    char line[256];
    std::snprintf(line, sizeof line, "%.3e | %.3e | %.3e | %.3e | %.3e | %.3e | %.2f |", r.m.rel_err_mean,
                  r.m.rel_err_median, r.m.rel_err_max, r.m.kl_mean, r.m.kl_p99, r.m.kl_max, r.m.top1_percent);
    os << line << "\n";
  }
}

nlohmann::json ToJson(const Run& run, const std::vector<Row>& rows) {
  nlohmann::json doc = {
      {"reference", run.o.reference}, {"positions", run.o.positions}, {"sequence_length", run.o.sequence_length},
      {"seed", run.o.seed},           {"vocab", run.vocab},           {"rows", nlohmann::json::array()}};
  for (const Row& r : rows) {
    nlohmann::json j = {{"source", r.source}, {"name", r.name}, {"path", r.path}};
    if (!r.status.ok()) {
      j["error"] = r.status.ToString();
    } else {
      j.update({{"rel_err_mean", r.m.rel_err_mean},
                {"rel_err_median", r.m.rel_err_median},
                {"rel_err_max", r.m.rel_err_max},
                {"kl_mean", r.m.kl_mean},
                {"kl_p99", r.m.kl_p99},
                {"kl_max", r.m.kl_max},
                {"top1_percent", r.m.top1_percent}});
    }
    doc["rows"].push_back(j);
  }
  return doc;
}

}  // namespace

Status RunAccuracyBench(const AccuracyBenchOptions& o, std::ostream& out, std::ostream& err) {
  MLARUN_RETURN_IF_ERROR(ValidateAccuracyOptions(o));
  MLARUN_ASSIGN_OR_RETURN(const ModelConfig rc, Model::LoadConfig(o.reference));
  Run run{.o = o, .err = err, .ids = AccuracyIds(o.positions, rc.vocab_size, o.seed), .vocab = rc.vocab_size};
  if (!o.write_ids.empty()) {
    MLARUN_RETURN_IF_ERROR(WriteAccuracyIds(o.write_ids, {.sequence_length = o.sequence_length, .ids = run.ids}));
    err << "wrote " << o.positions << " ids to " << o.write_ids << "\n";
    return Status::Ok();
  }
  err << "reference " << o.reference << ":\n";
  run.ref.resize(static_cast<size_t>(o.positions * run.vocab));
  MLARUN_RETURN_IF_ERROR(RunModel(run, o.reference, [&](int64_t s, std::span<const float> logits) -> Status {
    std::copy(logits.begin(), logits.end(), run.ref.begin() + s * o.sequence_length * run.vocab);
    return Status::Ok();
  }));
  std::vector<Row> rows;
  const auto add = [&](const std::string& source, const std::string& path, auto compare) {
    LogitComparison cmp;
    Row r{.source = source, .name = ShortName(path), .path = path, .status = compare(run, path, cmp)};
    r.m = cmp.Summarize();
    if (!r.status.ok()) err << "  " << path << ": " << r.status.ToString() << "\n";
    rows.push_back(std::move(r));
  };
  for (const std::string& m : o.models) add("mlarun", m, CompareModel);
  for (const std::string& f : o.llama_logits) add("llama.cpp", f, CompareLlamaFile);
  PrintTable(run, rows, o.json ? err : out);
  if (o.json) out << ToJson(run, rows).dump(1) << "\n";
  std::string failed;
  for (const Row& r : rows)
    if (!r.status.ok()) failed += (failed.empty() ? "" : "; ") + r.path + ": " + r.status.ToString();
  if (!failed.empty()) return InvalidArgumentError("some comparisons failed: ", failed);
  return Status::Ok();
}

}  // namespace mlarun
