#include "launcher/generate/generate.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "base/cpu_isa.h"
#include "parallel/mpi/mpi_world.h"
#include "runtime/engine/rank_runner.h"
#include "runtime/grammar/grammar.h"
#include "runtime/rank/bootstrap.h"

namespace mlarun {
namespace {

using Json = nlohmann::json;

}  // namespace

namespace {

// The request text: the --prompts file, or one JSON line built from
// --prompt-ids (an empty list stays empty, so the engine rejects it as every
// empty prompt).
StatusOr<std::string> RequestText(const GenerateOptions& o) {
  if (o.prompts_path.empty()) {
    Json j{{"prompt_ids", o.prompt_ids}};
    return j.dump() + "\n";
  }
  std::ifstream f(o.prompts_path, std::ios::binary);
  if (!f) return NotFoundError("cannot read ", o.prompts_path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// One request per non-blank line; errors carry "file:line".
std::vector<StatusOr<GenerationRequest>> ParseRequests(const std::string& text, const GenerateOptions& o) {
  std::vector<StatusOr<GenerationRequest>> parsed;
  std::istringstream in(text);
  std::string line;
  int64_t line_no = 0;
  const std::string origin = o.prompts_path.empty() ? "--prompt-ids" : o.prompts_path;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto r = ParseRequestLine(line, o.sampling);
    parsed.push_back(
        r.ok() ? r : StatusOr<GenerationRequest>(r.status().WithContext(origin + ":" + std::to_string(line_no))));
  }
  return parsed;
}

// A finished request's result: its output, or the error of the step that
// ended it (FinishReason::kError).
StatusOr<GenerationOutput> ResultOf(const GenerationOutput& g) {
  if (g.finish_reason == FinishReason::kError) return g.error;
  return g;
}

// Structured output's grammars over the model's tokenizer; nullptr (and a
// line on `log` unless the model simply has none) without one.
std::shared_ptr<GrammarCompiler> GrammarFor(const GenerateOptions& o, const ModelConfig& mc, std::ostream& log) {
  auto grammar = GrammarCompiler::ForModel(o.deployment.model, mc.vocab_size, mc.eos_token_ids);
  if (grammar.ok()) return *grammar;
  if (grammar.status().code() != StatusCode::kNotFound)
    log << "mlarun generate: structured output is off: " << grammar.status() << "\n";
  return nullptr;
}

std::ostream& NullLog() {
  static std::ostream null(nullptr);
  return null;
}

std::string ResultLine(const StatusOr<GenerationOutput>& r, bool json) {
  std::ostringstream out;
  if (!r.ok()) {
    if (json) {
      out << Json{{"error", r.status().ToString()}}.dump();
    } else {
      out << "error: " << r.status();
    }
    return out.str();
  }
  if (json) {
    Json j{{"tokens", r->tokens},
           {"logprobs", r->logprobs},
           {"finish_reason", std::string(FinishReasonName(r->finish_reason))}};
    AddLogprobFields(j, r->top_logprobs, r->prompt_logprobs);
    out << j.dump();
  } else {
    out << "tokens:";
    for (int64_t t : r->tokens) out << " " << t;
    out << "  (finish: " << FinishReasonName(r->finish_reason) << ")";
  }
  return out.str();
}

}  // namespace

int RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& log) {
  // Requests first: a bad file is reported before spending time on the model.
  auto text = RequestText(o);
  if (!text.ok()) {
    log << "mlarun generate: " << text.status().message() << "\n";
    return 2;
  }
  // --prompt-ids becomes one JSON line; the sampling flags are every line's
  // defaults.
  std::vector<StatusOr<GenerationRequest>> parsed = ParseRequests(*text, o);

  // Loading progress rewrites one line on a terminal; logs get only the
  // summary.
  const bool tty = &log == &std::cerr && isatty(STDERR_FILENO);
  std::function<void(const std::string&)> progress;
  if (tty) progress = [&log](const std::string& s) { log << "\r" << s << std::flush; };
  const auto t0 = std::chrono::steady_clock::now();
  auto loaded = LoadModelForSpec(o.deployment, ModelShard{}, 0, progress);
  if (tty) log << "\n";
  if (!loaded.ok()) {
    log << "mlarun generate: " << loaded.status() << "\n";
    return 2;
  }
  Model& model = *loaded->model;
  log << "mlarun generate: cpu " << CpuSummary() << "\n";
  log << "loaded " << o.deployment.model << " (" << static_cast<double>(model.weight_bytes().total()) / (1 << 20)
      << " MiB of weights) in " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
      << " s\n";
  EngineConfig ec = o.engine;
  ec.grammar = GrammarFor(o, model.config(), log);
  auto engine = Engine::Create(model, ec);
  if (!engine.ok()) {
    log << "mlarun generate: " << engine.status() << "\n";
    return 2;
  }

  // Queue every valid request; remember where each result goes.
  std::vector<StatusOr<GenerationOutput>> results(parsed.size(), StatusOr<GenerationOutput>(InternalError("not run")));
  std::vector<std::pair<size_t, int64_t>> queued;
  for (size_t i = 0; i < parsed.size(); ++i) {
    if (!parsed[i].ok()) {
      results[i] = parsed[i].status();
      continue;
    }
    auto id = (*engine)->Add(std::move(*parsed[i]));
    if (!id.ok()) {
      results[i] = id.status();
      continue;
    }
    queued.emplace_back(i, *id);
  }
  auto last_report = std::chrono::steady_clock::now();
  Status failure;
  while ((*engine)->HasWork()) {
    auto step = (*engine)->Step();
    if (!step.ok()) {
      failure = step.status();
      break;
    }
    if (std::chrono::steady_clock::now() - last_report > std::chrono::seconds(2)) {
      const EngineStats& s = (*engine)->stats();
      log << "step " << s.steps << ": " << s.prefill_tokens << " prompt tokens and " << s.decode_tokens
          << " decode-step tokens so far\n";
      last_report = std::chrono::steady_clock::now();
    }
  }
  for (const auto& [i, id] : queued) {
    const GenerationOutput* g = (*engine)->Output(id);
    if (g->finish_reason == FinishReason::kNone) {
      results[i] = failure.ok() ? InternalError("request did not finish") : failure;
    } else {
      results[i] = ResultOf(*g);
    }
  }

  int code = 0;
  int64_t generated = 0;  // what was printed (the first token of each comes from
                          // its prefill step)
  for (const auto& r : results) {
    if (!r.ok()) code = 1;
    if (r.ok()) generated += static_cast<int64_t>(r->tokens.size());
    out << ResultLine(r, o.json) << "\n";
  }
  const EngineStats& s = (*engine)->stats();
  log << "done: " << s.steps << " steps, " << s.prefill_tokens << " prompt tokens, " << generated
      << " generated tokens, " << s.preemptions << " preemptions, " << s.forward_seconds << " s in the model\n";
  return code;
}

namespace {

// Rank 0 reads the requests and sends the text to every rank: on every rank,
// the text, or nullopt when rank 0 could not read it (it said why). Before
// loading anything: a missing prompts file should not wait for the model.
std::optional<std::string> ShareRequestText(const GenerateOptions& o, MpiSession& session, std::ostream& log) {
  std::string text;
  int64_t length = -1;
  if (session.rank() == 0) {
    auto t = RequestText(o);
    if (t.ok()) {
      text = std::move(*t);
      length = static_cast<int64_t>(text.size());
    } else {
      log << "mlarun generate: " << t.status().message() << "\n";
    }
  }
  auto world_or = session.World();
  if (!world_or.ok()) session.Abort(world_or.status().ToString(), 2);
  Communicator& requests_comm = **world_or;
  if (!requests_comm.Broadcast(&length, 1, CommType::kI64, 0).ok()) session.Abort("cannot broadcast the requests", 2);
  if (length < 0) return std::nullopt;
  text.resize(static_cast<size_t>(length));
  if (!requests_comm.Broadcast(text.data(), length, CommType::kU8, 0).ok())
    session.Abort("cannot broadcast the requests", 2);
  return text;
}

// The memory each rank holds, by category: one int64 record per rank.
struct RankMemory {
  int64_t rank, dp, tp, attention, moe, dense, embedding_and_head, cache_capacity, cache_peak, cache_written;
};
static_assert(sizeof(RankMemory) == 10 * sizeof(int64_t));

// Rank 0: every request's line in input order (`chunks`: each rank's
// "index\tline\n" lines), then the per-rank memory table on `log`. Returns
// the exit code: 1 when any request failed.
int PrintGathered(const GenerateOptions& o, const std::vector<StatusOr<GenerationRequest>>& parsed,
                  const std::vector<std::string>& chunks, const std::vector<RankMemory>& all_mem, std::ostream& out,
                  std::ostream& log) {
  int code = 0;
  std::map<size_t, std::string> by_index;
  for (const std::string& chunk : chunks) {
    std::istringstream in(chunk);
    std::string line;
    while (std::getline(in, line)) {
      const size_t tab = line.find('\t');
      by_index[std::stoul(line.substr(0, tab))] = line.substr(tab + 1);
    }
  }
  for (size_t i = 0; i < parsed.size(); ++i) {
    if (!parsed[i].ok()) {
      out << ResultLine(parsed[i].status(), o.json) << "\n";
      code = 1;
      continue;
    }
    const std::string& line = by_index[i];
    if (line.rfind(o.json ? "{\"error\"" : "error:", 0) == 0) code = 1;
    out << line << "\n";
  }
  auto mib = [](int64_t bytes) {
    std::ostringstream os;
    const double b = static_cast<double>(bytes);
    os << std::fixed << std::setprecision(b < (1 << 20) ? 3 : 1) << b / (1 << 20);
    return os.str();
  };
  log << "memory per rank (MiB): rank dp tp | attention moe dense emb+head | "
         "cache capacity peak written\n";
  for (const RankMemory& m : all_mem)
    log << "  " << m.rank << " " << m.dp << " " << m.tp << " | " << mib(m.attention) << " " << mib(m.moe) << " "
        << mib(m.dense) << " " << mib(m.embedding_and_head) << " | " << mib(m.cache_capacity) << " "
        << mib(m.cache_peak) << " " << mib(m.cache_written) << "\n";
  return code;
}

}  // namespace

int RunGenerateParallel(const GenerateOptions& o, MpiSession& session, std::ostream& out, std::ostream& log) {
  const bool root = session.rank() == 0;
  const std::optional<std::string> text = ShareRequestText(o, session, log);
  if (!text) return 2;
  std::vector<StatusOr<GenerationRequest>> parsed = ParseRequests(*text, o);

  // Every rank gets the same outcome: a start-up failure (different flags on
  // some rank, a bad layout, a model that does not load somewhere) ends every
  // rank with exit code 2, rank 0 says why.
  auto boot = BootstrapRank(o.deployment, session, log, "mlarun generate");
  if (!boot.ok()) {
    if (root) log << "mlarun generate: " << boot.status().message() << "\n";
    return 2;
  }
  const ParallelLayout& layout = boot->layout;
  ProcessGroups& groups = boot->groups;
  Model& model = *boot->loaded.model;
  Communicator& world = *groups.world;
  EngineConfig ec = o.engine;
  if (groups.is_leader()) ec.grammar = GrammarFor(o, model.config(), root ? log : NullLog());
  auto runner = RankRunner::Create(model, ec, groups, boot->name);
  if (!runner.ok()) session.Abort(runner.status().ToString(), 2);
  if (root)
    log << "loaded " << o.deployment.model << " on " << session.size() << " ranks (" << layout << ") in "
        << boot->load_seconds << " s\n";

  // Request i goes to DP group i % dp; its leader queues it.
  std::map<size_t, StatusOr<GenerationOutput>> mine;  // this leader's results by input index
  std::map<size_t, int64_t> queued;
  if ((*runner)->is_leader()) {
    for (size_t i = 0; i < parsed.size(); ++i) {
      if (static_cast<int>(i % static_cast<size_t>(layout.dp)) != groups.dp_rank() || !parsed[i].ok()) continue;
      auto id = (*runner)->Add(std::move(*parsed[i]));
      if (id.ok()) {
        queued[i] = *id;
      } else {
        mine.emplace(i, id.status());
      }
    }
  }
  for (;;) {
    auto more = (*runner)->Step();
    if (!more.ok()) session.Abort("step failed: " + more.status().ToString(), 1);
    if (!*more) break;
  }
  // Leaders send "index\tline\n" per request; rank 0 prints them in order.
  std::string lines;
  for (const auto& [i, id] : queued) mine.emplace(i, ResultOf(*(*runner)->Output(id)));
  for (const auto& [i, r] : mine) lines += std::to_string(i) + "\t" + ResultLine(r, o.json) + "\n";
  const WeightBytes wb = model.weight_bytes();
  const RankCacheStats& cs = (*runner)->cache_stats();
  const RankMemory mem{
      session.rank(), groups.dp_rank(),      groups.attn_tp_rank(), wb.attention,         wb.moe,
      wb.dense_mlp,   wb.embedding_and_head, cs.now.bytes_capacity, cs.peak_bytes_used(), cs.bytes_written};
  std::vector<RankMemory> all_mem(static_cast<size_t>(world.size()));
  if (!world.AllGather(&mem, 10, all_mem.data(), CommType::kI64).ok()) session.Abort("cannot gather the memory", 1);
  auto all_lines = AllGatherStrings(world, lines);
  if (!all_lines.ok()) session.Abort("cannot gather the results", 1);
  int64_t code64 = root ? PrintGathered(o, parsed, *all_lines, all_mem, out, log) : 0;
  (void)world.Broadcast(&code64, 1, CommType::kI64, 0);
  return static_cast<int>(code64);
}

}  // namespace mlarun
