#include "bench/http_bench.h"

#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <mutex>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/workload.h"
#include "mlarun.grpc.pb.h"
#include "serving/coordinator/coordinator.h"
#include "serving/sim/sim_worker.h"
#include "text/tokenizer.h"

namespace mlarun {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using internal::StrCat;

constexpr int64_t kAsciiVocab = 2 + 128;

double MsSince(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

using serve_bench::Percentile;

std::string Fmt(double v, int digits) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

// A byte-level tokenizer: ids 0 and 1 the DeepSeek specials, 2..257 the 256
// bytes (GPT-2's byte-to-unicode table), no merges.
StatusOr<std::unique_ptr<text::Tokenizer>> BytesTokenizer() {
  std::vector<int> cps(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    cps[b] = printable ? b : next++;
  }
  auto utf8 = [](int cp) {
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  };
  const std::string bos = "<｜begin▁of▁sentence｜>", eos = "<｜end▁of▁sentence｜>";
  json vocab = {{bos, 0}, {eos, 1}};
  for (int b = 0; b < 256; ++b) vocab[utf8(cps[b])] = b + 2;
  json added = json::array();
  for (int id = 0; id < 2; ++id)
    added.push_back({{"id", id},
                     {"content", id == 0 ? bos : eos},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  const json tok = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}})}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", json::array()}}}};
  const json config = {{"bos_token", bos}, {"eos_token", eos}, {"add_bos_token", false}};
  return text::Tokenizer::FromJson(tok.dump(), config.dump());
}

using Request = serve_bench::BenchRequest;

std::vector<Request> Requests(int64_t n, int64_t max_tokens, int64_t vocab, uint64_t seed) {
  return serve_bench::RandomRequests(n, max_tokens, vocab, seed);
}

// What the client saw of one request.
struct Outcome {
  bool ok = false;
  std::string error;
  double ttft_ms = NAN, total_ms = NAN;
  std::vector<double> gaps_ms;
};

// The simulated groups' tokens for `r`, and their text.
std::vector<int32_t> SimTokens(const Request& r, int64_t vocab) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < r.max_tokens; ++i)
    ids.push_back(static_cast<int32_t>(SimWorkerToken(r.prompt, r.seed, i, vocab).token));
  return ids;
}

Outcome CallGrpc(v1::Mlarun::Stub& stub, const Request& r, int64_t vocab) {
  v1::GenerateRequest req;
  req.mutable_prompt_ids()->Add(r.prompt.begin(), r.prompt.end());
  req.mutable_sampling()->set_seed(r.seed);
  req.mutable_sampling()->set_max_tokens(r.max_tokens);
  req.mutable_sampling()->set_temperature(1.0);
  req.mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  Outcome o;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point last = t0;
  std::vector<int32_t> got;
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    const Clock::time_point now = Clock::now();
    if (!resp.has_token()) continue;
    if (got.empty()) {
      o.ttft_ms = MsSince(t0, now);
    } else {
      o.gaps_ms.push_back(MsSince(last, now));
    }
    last = now;
    got.push_back(static_cast<int32_t>(resp.token().token_id()));
  }
  const grpc::Status st = reader->Finish();
  o.total_ms = MsSince(t0, Clock::now());
  if (!st.ok()) {
    o.error = st.error_message();
  } else if (got != SimTokens(r, vocab)) {
    o.error = "the tokens are not the simulated group's";
  }
  o.ok = o.error.empty();
  return o;
}

json Body(const Request& r, bool stream) {
  json b = {
      {"prompt", r.prompt}, {"max_tokens", r.max_tokens}, {"seed", r.seed}, {"temperature", 1.0}, {"ignore_eos", true}};
  if (stream) {
    b["stream"] = true;
    b["stream_options"] = {{"include_usage", true}};
  }
  return b;
}

// One request over HTTP, whole or streamed, on `client` (kept alive).
Outcome CallHttp(httplib::Client& client, const Request& r, bool stream, const text::Tokenizer& tok, int64_t vocab) {
  Outcome o;
  const std::string want = tok.Decode(SimTokens(r, vocab), true);
  const Clock::time_point t0 = Clock::now();
  if (!stream) {
    auto res = client.Post("/v1/completions", Body(r, false).dump(), "application/json");
    o.total_ms = MsSince(t0, Clock::now());
    if (!res || res->status != 200) {
      o.error = res ? StrCat("HTTP ", res->status, ": ", res->body) : "no answer";
      return o;
    }
    const json j = json::parse(res->body, nullptr, false);
    if (j.is_discarded() || j["choices"][0]["text"] != want || j["usage"]["completion_tokens"] != r.max_tokens)
      o.error = "the text or usage is not the simulated group's";
    o.ok = o.error.empty();
    return o;
  }
  std::string buffer, text;
  int64_t completion_tokens = -1;
  bool done = false;
  Clock::time_point last = t0;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = Body(r, true).dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const Clock::time_point now = Clock::now();
    buffer.append(data, n);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos; buffer.erase(0, end + 2)) {
      const std::string event = buffer.substr(0, end);
      if (!event.starts_with("data: ")) continue;
      if (event == "data: [DONE]") {
        done = true;
        continue;
      }
      const json j = json::parse(event.substr(6), nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("usage") && j["usage"].is_object()) completion_tokens = j["usage"]["completion_tokens"];
      if (j["choices"].empty()) continue;
      const std::string piece = j["choices"][0].value("text", "");
      if (piece.empty()) continue;
      if (text.empty()) {
        o.ttft_ms = MsSince(t0, now);
      } else {
        o.gaps_ms.push_back(MsSince(last, now));
      }
      last = now;
      text += piece;
    }
    return true;
  };
  auto res = client.send(req);
  o.total_ms = MsSince(t0, Clock::now());
  if (!res || res->status != 200) {
    o.error = res ? StrCat("HTTP ", res->status) : "no answer";
  } else if (!done || text != want || completion_tokens != r.max_tokens) {
    o.error = "the streamed text or usage is not the simulated group's";
  }
  o.ok = o.error.empty();
  return o;
}

// A coordinator with the HTTP API on 127.0.0.1 and simulated groups.
class Target {
 public:
  static StatusOr<std::unique_ptr<Target>> Start(std::shared_ptr<const text::Tokenizer> tok, int64_t vocab, int groups,
                                                 double tokens_per_s) {
    std::unique_ptr<Target> t(new Target());
    CoordinatorOptions co;
    co.listen = "127.0.0.1:0";
    co.http_listen = "127.0.0.1:0";
    co.http_tokenizer = tok;
    co.served_model_name = "bench";
    MLARUN_ASSIGN_OR_RETURN(t->coordinator_, Coordinator::Start(co));
    SimWorkerOptions s;
    s.coordinator = t->coordinator_->address();
    s.worker_id = "http-bench";
    s.groups = groups;
    s.tokens_per_s = tokens_per_s;
    s.vocab_size = vocab;
    s.cache_blocks = 4096;
    t->thread_ = std::thread([p = t.get(), s] { p->rc_ = RunSimWorker(s, &p->stop_, p->log_); });
    const std::string http = t->coordinator_->http_address();
    t->port_ = std::stoi(http.substr(http.rfind(':') + 1));
    for (int i = 0; i < 3000; ++i) {
      httplib::Client c("127.0.0.1", t->port_);
      auto res = c.Get("/health");
      if (res && res->status == 200) {
        auto j = json::parse(res->body, nullptr, false);
        if (!j.is_discarded() && j.value("dp_groups_connected", 0) == groups) return t;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    t->Stop();
    return UnavailableError("the ", groups, " simulated groups did not register: ", t->log_.str());
  }
  ~Target() { Stop(); }
  void Stop() {
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
    }
    if (coordinator_ != nullptr) coordinator_->Shutdown();
  }
  std::string grpc_address() const { return coordinator_->address(); }
  int port() const { return port_; }

 private:
  Target() = default;
  std::unique_ptr<Coordinator> coordinator_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::ostringstream log_;  // read after thread_ is joined
  int rc_ = 0;
  int port_ = 0;
};

std::unique_ptr<httplib::Client> NewClient(int port) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", port);
  c->set_keep_alive(true);
  c->set_tcp_nodelay(true);
  c->set_read_timeout(120, 0);
  return c;
}

json Summary(const std::vector<double>& v) { return {{"p50", Percentile(v, 50)}, {"p99", Percentile(v, 99)}}; }

// The overhead section's requests: kOverheadWarmUp first, then
// o.overhead_requests, in kOverheadRounds rounds.
constexpr int kOverheadWarmUp = 32, kOverheadRounds = 4;

// The overhead section's latencies, per path (gRPC, HTTP whole, HTTP
// streamed), after the warm-up, and the requests that failed.
struct OverheadTimes {
  std::vector<double> grpc_ms, whole_ms, stream_ms;
  int64_t failed = 0;
  std::string first_error;
};

// One client, one group as fast as it can, max_tokens 1: the three paths
// alternating in rounds, one request at a time.
StatusOr<OverheadTimes> TimeOverhead(const HttpBenchOptions& o, const std::shared_ptr<const text::Tokenizer>& tok,
                                     int64_t vocab) {
  MLARUN_ASSIGN_OR_RETURN(auto target, Target::Start(tok, vocab, 1, 0));
  auto stub = v1::Mlarun::NewStub(grpc::CreateChannel(target->grpc_address(), grpc::InsecureChannelCredentials()));
  auto http = NewClient(target->port());
  const std::vector<Request> requests = Requests(o.overhead_requests + kOverheadWarmUp, 1, vocab, 3);
  OverheadTimes m;
  const size_t per_round = std::max<size_t>(1, requests.size() / kOverheadRounds);
  for (size_t start = 0; start < requests.size(); start += per_round) {
    const size_t end = std::min(requests.size(), start + per_round);
    for (int path = 0; path < 3; ++path) {
      for (size_t i = start; i < end; ++i) {
        const Outcome oc =
            path == 0 ? CallGrpc(*stub, requests[i], vocab) : CallHttp(*http, requests[i], path == 2, *tok, vocab);
        if (!oc.ok) {
          if (m.first_error.empty()) m.first_error = oc.error;
          ++m.failed;
          continue;
        }
        if (i < static_cast<size_t>(kOverheadWarmUp)) continue;
        (path == 0 ? m.grpc_ms : path == 1 ? m.whole_ms : m.stream_ms).push_back(oc.total_ms);
      }
    }
  }
  http.reset();  // its keep-alive connection would hold the server's shutdown for its timeout
  target->Stop();
  return m;
}

// ---- Overhead: one client, one group as fast as it can, max_tokens 1.
Status OverheadSection(const HttpBenchOptions& o, const std::shared_ptr<const text::Tokenizer>& tok, int64_t vocab,
                       std::ostream& t, bool* verified, json& doc) {
  MLARUN_ASSIGN_OR_RETURN(const OverheadTimes m, TimeOverhead(o, tok, vocab));
  const std::vector<double>&grpc_ms = m.grpc_ms, &whole_ms = m.whole_ms, &stream_ms = m.stream_ms;
  *verified = *verified && m.failed == 0;
  const double g50 = Percentile(grpc_ms, 50);
  t << "\nHTTP overhead (one client, one simulated group as fast as it can, max_tokens 1, " << o.overhead_requests
    << " requests per path after " << kOverheadWarmUp << " warm-up, alternating in rounds; HTTP keep-alive)\n"
    << "  path                 p50 ms   p99 ms   p50 - gRPC p50\n";
  auto row = [&](const char* name, const std::vector<double>& v) {
    t << "  " << std::left << std::setw(19) << name << std::right << std::setw(8) << Fmt(Percentile(v, 50), 3)
      << std::setw(9) << Fmt(Percentile(v, 99), 3) << std::setw(12) << Fmt(Percentile(v, 50) - g50, 3) << "\n";
  };
  row("gRPC Generate", grpc_ms);
  row("HTTP whole", whole_ms);
  row("HTTP streamed", stream_ms);
  if (m.failed > 0) t << "  NOT VERIFIED: " << m.failed << " requests failed; first: " << m.first_error << "\n";
  doc["overhead"] = {{"requests", o.overhead_requests},
                     {"grpc_ms", Summary(grpc_ms)},
                     {"http_whole_ms", Summary(whole_ms)},
                     {"http_stream_ms", Summary(stream_ms)},
                     {"http_whole_minus_grpc_p50_ms", Percentile(whole_ms, 50) - g50},
                     {"http_stream_minus_grpc_p50_ms", Percentile(stream_ms, 50) - g50},
                     {"failed", m.failed}};
  return Status::Ok();
}

// What the clients of one API saw under load: requests/s, every time to
// first token and every gap, and the requests that failed.
struct LoadTimes {
  double rps = 0;
  std::vector<double> ttft, gaps;
  int64_t failed = 0;
  std::string first_error;
};

// o.clients concurrent streaming clients of `api` (0: gRPC, 1: HTTP) until
// every request is done.
LoadTimes RunApiLoad(const HttpBenchOptions& o, const Target& target, const std::vector<Request>& requests,
                     const text::Tokenizer& tok, int64_t vocab, int api) {
  std::atomic<int64_t> next{0};
  std::mutex mu;
  LoadTimes m;
  std::vector<double>&ttft = m.ttft, &gaps = m.gaps;
  int64_t& failed = m.failed;
  std::string& first_error = m.first_error;
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < o.clients; ++c) {
    clients.emplace_back([&] {
      auto stub = v1::Mlarun::NewStub(grpc::CreateChannel(target.grpc_address(), grpc::InsecureChannelCredentials()));
      auto http = NewClient(target.port());
      for (int64_t i; (i = next++) < static_cast<int64_t>(requests.size());) {
        const Request& r = requests[static_cast<size_t>(i)];
        const Outcome oc = api == 0 ? CallGrpc(*stub, r, vocab) : CallHttp(*http, r, true, tok, vocab);
        std::lock_guard lock(mu);
        if (!oc.ok) {
          if (first_error.empty()) first_error = oc.error;
          ++failed;
          continue;
        }
        ttft.push_back(oc.ttft_ms);
        gaps.insert(gaps.end(), oc.gaps_ms.begin(), oc.gaps_ms.end());
      }
    });
  }
  for (auto& th : clients) th.join();
  const double secs = MsSince(t0, Clock::now()) / 1000;
  m.rps = static_cast<double>(requests.size()) / secs;
  return m;
}

// ---- Load: N concurrent streaming clients, gRPC then HTTP, same coordinator.
Status LoadSection(const HttpBenchOptions& o, const std::shared_ptr<const text::Tokenizer>& tok, int64_t vocab,
                   std::ostream& t, bool* verified, json& doc) {
  MLARUN_ASSIGN_OR_RETURN(auto target, Target::Start(tok, vocab, o.groups, o.tokens_per_s));
  const std::vector<Request> requests = Requests(o.requests, o.max_tokens, vocab, 11);
  t << "\nHTTP vs gRPC under load (" << o.clients << " streaming clients, " << o.requests << " requests of "
    << o.max_tokens << " tokens, prompts 16-256 tokens, " << o.groups << " simulated groups at "
    << Fmt(o.tokens_per_s, 0) << " tokens/s each; HTTP gaps are between text chunks)\n"
    << "  api      req/s   ttft p50 ms  ttft p99 ms  itl p50 ms  itl p99 ms  verified\n";
  doc["load"] = json::array();
  for (int api = 0; api < 2; ++api) {
    const LoadTimes m = RunApiLoad(o, *target, requests, *tok, vocab, api);
    *verified = *verified && m.failed == 0;
    const char* name = api == 0 ? "gRPC" : "HTTP";
    t << "  " << std::left << std::setw(6) << name << std::right << std::setw(8) << Fmt(m.rps, 0) << std::setw(14)
      << Fmt(Percentile(m.ttft, 50), 2) << std::setw(13) << Fmt(Percentile(m.ttft, 99), 2) << std::setw(12)
      << Fmt(Percentile(m.gaps, 50), 2) << std::setw(12) << Fmt(Percentile(m.gaps, 99), 2) << "  "
      << (m.failed == 0 ? "yes" : StrCat("NO (", m.failed, "): ", m.first_error)) << "\n";
    doc["load"].push_back({{"api", name},
                           {"requests_per_s", m.rps},
                           {"ttft_ms", Summary(m.ttft)},
                           {"itl_ms", Summary(m.gaps)},
                           {"failed", m.failed}});
  }
  target->Stop();
  doc["load_config"] = {{"clients", o.clients},
                        {"requests", o.requests},
                        {"max_tokens", o.max_tokens},
                        {"groups", o.groups},
                        {"tokens_per_s", o.tokens_per_s}};
  return Status::Ok();
}

}  // namespace

StatusOr<json> RunHttpBench(const HttpBenchOptions& o, std::ostream& t, bool* verified) {
  *verified = true;
  MLARUN_ASSIGN_OR_RETURN(std::shared_ptr<const text::Tokenizer> tok, BytesTokenizer());
  // The groups' tokens are ids 0..129: the specials and the 128 ASCII bytes,
  // so that (but for the rare special) every token has text of its own and
  // the HTTP stream has one chunk per token, as the gRPC one has one message.
  const int64_t vocab = kAsciiVocab;
  json doc;
  MLARUN_RETURN_IF_ERROR(OverheadSection(o, tok, vocab, t, verified, doc));
  MLARUN_RETURN_IF_ERROR(LoadSection(o, tok, vocab, t, verified, doc));
  return doc;
}

}  // namespace mlarun
