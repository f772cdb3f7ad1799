// The coordinator's HTTP API in-process: a real Coordinator (gRPC and HTTP on
// 127.0.0.1, port 0) with simulated DP groups (SimWorkerThread), driven by
// cpp-httplib clients and, for the reference tokens, a gRPC Generate stub.
// Checks that text over HTTP (whole and streamed) is the tokenizer's decode
// of exactly the tokens the gRPC path yields for the same prompt and seed,
// the OpenAI error objects and statuses, disconnects, and /metrics.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench/http_bench.h"
#include "mlarun.grpc.pb.h"
#include "serving/coordinator/coordinator.h"
#include "tests/serving/sim_worker_thread.h"
#include "text/tokenizer.h"
#ifndef MLARUN_NO_CHAT_TEMPLATE
#include "text/chat_template.h"
#endif

namespace mlarun {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

// ---- A tokenizer -------------------------------------------------------------

// The tiny model's own (configs/models/tiny.yaml: tokenizer:).
std::shared_ptr<const text::Tokenizer> TestTokenizer() {
  static std::shared_ptr<const text::Tokenizer> tokenizer = [] {
    auto loaded = text::Tokenizer::Load(MLARUN_CONFIGS_DIR "/models/tiny.yaml");
    EXPECT_TRUE(loaded.ok()) << loaded.status().ToString();
    return loaded.ok() ? std::shared_ptr<const text::Tokenizer>(std::move(*loaded)) : nullptr;
  }();
  return tokenizer;
}

// ---- The Prometheus text format ----------------------------------------------

// Every line is a comment or `name{labels} value`; HELP and TYPE come before
// a family's samples; a histogram's buckets are cumulative and end in +Inf,
// equal to its _count. Returns the samples by `name{labels}` as printed.
std::map<std::string, double> ParsePrometheus(const std::string& text) {
  std::map<std::string, double> samples;
  std::map<std::string, std::string> types;
  std::set<std::string> helped;
  std::map<std::string, std::vector<std::pair<std::string, double>>> buckets;  // series (labels without le) -> (le, v)
  std::istringstream in(text);
  std::string line;
  auto family_of = [&](const std::string& name) {
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (name.size() > s.size() && name.ends_with(s) && types.contains(name.substr(0, name.size() - s.size())))
        return name.substr(0, name.size() - s.size());
    }
    return name;
  };
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::istringstream c(line);
      std::string hash, kind, name;
      c >> hash >> kind >> name;
      if (kind == "HELP") helped.insert(name);
      if (kind == "TYPE") {
        std::string type;
        c >> type;
        EXPECT_TRUE(type == "counter" || type == "gauge" || type == "histogram" || type == "summary" ||
                    type == "untyped")
            << line;
        types[name] = type;
      }
      continue;
    }
    size_t i = 0;
    while (i < line.size() && (std::isalnum(static_cast<unsigned char>(line[i])) || line[i] == '_' || line[i] == ':'))
      ++i;
    const std::string name = line.substr(0, i);
    EXPECT_FALSE(name.empty()) << line;
    std::string labels, le;
    if (i < line.size() && line[i] == '{') {
      const size_t start = i;
      bool quoted = false;
      for (++i; i < line.size(); ++i) {
        if (quoted && line[i] == '\\') {
          ++i;
        } else if (line[i] == '"') {
          quoted = !quoted;
        } else if (!quoted && line[i] == '}') {
          break;
        }
      }
      EXPECT_LT(i, line.size()) << "unterminated labels: " << line;
      labels = line.substr(start, i - start + 1);
      ++i;
      if (const size_t at = labels.find("le=\""); at != std::string::npos) {
        const size_t end = labels.find('"', at + 4);
        le = labels.substr(at + 4, end - at - 4);
        std::string rest = labels.substr(0, at) + labels.substr(end + 1);
        labels = rest;
      }
    }
    EXPECT_TRUE(i < line.size() && line[i] == ' ') << line;
    const std::string value_text = line.substr(i + 1, line.find(' ', i + 1) - i - 1);
    char* end = nullptr;
    const double value = std::strtod(value_text.c_str(), &end);
    EXPECT_TRUE(end != value_text.c_str() || value_text == "+Inf" || value_text == "NaN") << line;
    const std::string family = family_of(name);
    EXPECT_TRUE(types.contains(family)) << "sample before its TYPE: " << line;
    EXPECT_TRUE(helped.contains(family)) << "sample before its HELP: " << line;
    if (name.ends_with("_bucket") && types[family] == "histogram") {
      buckets[family + labels].emplace_back(le, value);
    } else {
      samples[name + labels] = value;
    }
  }
  for (const auto& [series, bs] : buckets) {
    EXPECT_FALSE(bs.empty());
    for (size_t k = 1; k < bs.size(); ++k) EXPECT_LE(bs[k - 1].second, bs[k].second) << series << " not cumulative";
    EXPECT_EQ(bs.back().first, "+Inf") << series;
    const size_t brace = series.find('{');
    const std::string fam = series.substr(0, brace);
    std::string lab = brace == std::string::npos ? "" : series.substr(brace);
    if (lab == "{}") lab = "";
    auto count = samples.find(fam + "_count" + lab);
    if (count == samples.end()) count = samples.find(fam + "_count");
    EXPECT_NE(count, samples.end()) << series;
    if (count != samples.end()) EXPECT_EQ(count->second, bs.back().second) << series;
    samples[fam + "_inf_bucket"] = bs.back().second;
  }
  return samples;
}

double Sample(const std::map<std::string, double>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? 0.0 : it->second;
}

// ---- The deployment ---------------------------------------------------------------

struct Deployment {
  // script: the groups' tokens for every request (SimWorkerOptions::script).
  // check: SimWorkerOptions::check.
  explicit Deployment(CoordinatorOptions o, int groups = 2, double tokens_per_s = 2000,
                      std::vector<int64_t> script = {}, std::function<Status(const SamplingParams&)> check = {}) {
    o.listen = "127.0.0.1:0";
    o.http_listen = "127.0.0.1:0";
    o.http_tokenizer = TestTokenizer();
    if (o.served_model_name.empty()) o.served_model_name = "tiny";
    auto started = Coordinator::Start(o);
    EXPECT_TRUE(started.ok()) << started.status().ToString();
    if (!started.ok()) return;
    coordinator = std::move(*started);
    const std::string http = coordinator->http_address();
    port = std::stoi(http.substr(http.rfind(':') + 1));
    if (groups > 0) {
      SimWorkerOptions s;
      s.coordinator = coordinator->address();
      s.worker_id = "sim-http";
      s.groups = groups;
      s.tokens_per_s = tokens_per_s;
      s.vocab_size = o.http_tokenizer->vocab_size();
      s.max_position_embeddings = 4096;
      s.block_size = 16;
      s.cache_blocks = 4096;
      s.script = std::move(script);
      s.check = std::move(check);
      sim = std::make_unique<SimWorkerThread>(s);
      for (int i = 0; i < 500; ++i) {
        auto res = Client().Get("/health");
        if (res && res->status == 200) break;
        std::this_thread::sleep_for(10ms);
      }
    }
  }
  ~Deployment() {
    sim.reset();
    if (coordinator) coordinator->Shutdown();
  }
  httplib::Client Client(const std::string& token = "") const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(30, 0);
    c.set_connection_timeout(5, 0);
    if (!token.empty()) c.set_bearer_token_auth(token);
    return c;
  }
  // A whole answer: status and body.
  std::pair<int, json> Post(const std::string& path, const json& body, const std::string& token = "") const {
    auto res = Client(token).Post(path, body.dump(), "application/json");
    if (!res) return {-1, json()};
    json parsed = json::parse(res->body, nullptr, false);
    return {res->status, parsed};
  }
  // A streamed answer: every `data:` payload in order (the last "[DONE]").
  std::pair<int, std::vector<std::string>> Stream(const std::string& path, json body) const {
    body["stream"] = true;
    std::string all;
    httplib::Headers headers;
    auto res = Client().Post(path, headers, body.dump(), "application/json");
    if (!res) return {-1, {}};
    all = res->body;
    std::vector<std::string> events;
    size_t at = 0;
    while (res->status == 200 && (at = all.find("data: ", at)) != std::string::npos) {
      const size_t end = all.find("\n\n", at);
      events.push_back(all.substr(at + 6, end - at - 6));
      at = end + 2;
    }
    if (res->status != 200) events.push_back(res->body);
    return {res->status, events};
  }
  std::map<std::string, double> Metrics() const {
    auto res = Client().Get("/metrics");
    EXPECT_TRUE(res && res->status == 200);
    return res ? ParsePrometheus(res->body) : std::map<std::string, double>{};
  }
  // The tokens the gRPC API gives for this prompt and sampling.
  std::vector<int32_t> GrpcTokens(const std::vector<int32_t>& prompt, uint64_t seed, int64_t max_tokens,
                                  double temperature) const {
    auto stub = v1::Mlarun::NewStub(grpc::CreateChannel(coordinator->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 20s);
    v1::GenerateRequest req;
    req.mutable_prompt_ids()->Assign(prompt.begin(), prompt.end());
    req.mutable_sampling()->set_seed(seed);
    req.mutable_sampling()->set_max_tokens(max_tokens);
    req.mutable_sampling()->set_temperature(temperature);
    auto reader = stub->Generate(&ctx, req);
    std::vector<int32_t> out;
    v1::GenerateResponse r;
    while (reader->Read(&r)) {
      if (r.has_token()) out.push_back(static_cast<int32_t>(r.token().token_id()));
    }
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  }
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<SimWorkerThread> sim;
  int port = 0;
};

const text::Tokenizer& Tok() { return *TestTokenizer(); }

std::string Decode(const std::vector<int32_t>& ids) { return Tok().Decode(ids, /*skip_special_tokens=*/true); }

// One token's text, as the completions form keys it.
std::string TokenText(int64_t id) {
  const int32_t one[1] = {static_cast<int32_t>(id)};
  return Tok().Decode(one, false);
}

// A completions top_logprobs object for the simulated group's token `tok`
// with n alternatives: SimWorkerTop's and the token itself, by text (texts
// that coincide keep the likelier one's logprob).
void ExpectSimCompletionTop(const json& top, const SimToken& tok, int64_t n) {
  std::map<std::string, double> expected;
  for (const TokenLogprob& t : SimWorkerTop(tok, n, Tok().vocab_size()))
    expected.emplace(TokenText(t.token), t.logprob);
  expected.emplace(TokenText(tok.token), tok.logprob);
  ASSERT_TRUE(top.is_object()) << top.dump();
  ASSERT_EQ(top.size(), expected.size()) << top.dump();
  for (const auto& [text, logprob] : expected) {
    ASSERT_TRUE(top.contains(text)) << text << " missing from " << top.dump();
    EXPECT_DOUBLE_EQ(top[text].get<double>(), logprob);
  }
}

// The text of a streamed completion or chat, choice by choice; checks the
// chunks' shape on the way.
std::map<int, std::string> Concatenate(const std::vector<std::string>& events, bool chat,
                                       std::map<int, std::string>* finish = nullptr, json* usage = nullptr) {
  std::map<int, std::string> text;
  EXPECT_FALSE(events.empty());
  if (events.empty()) return text;
  EXPECT_EQ(events.back(), "[DONE]");
  std::set<int> roles;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    EXPECT_FALSE(chunk.contains("error")) << events[i];
    EXPECT_EQ(chunk["object"], chat ? "chat.completion.chunk" : "text_completion");
    if (chunk["choices"].empty()) {
      if (usage != nullptr) *usage = chunk["usage"];
      continue;
    }
    for (const json& c : chunk["choices"]) {
      const int index = c["index"].get<int>();
      if (chat) {
        if (c["delta"].contains("role")) {
          EXPECT_EQ(c["delta"]["role"], "assistant");
          roles.insert(index);
        } else {
          EXPECT_TRUE(roles.contains(index)) << "a chat delta before its role chunk";
        }
        if (c["delta"].contains("content")) text[index] += c["delta"]["content"].get<std::string>();
      } else {
        text[index] += c["text"].get<std::string>();
      }
      if (!c["finish_reason"].is_null() && finish != nullptr) (*finish)[index] = c["finish_reason"];
    }
  }
  return text;
}

// ---- Tests ---------------------------------------------------------------------------

class HttpApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    CoordinatorOptions o;
    o.http_max_body_bytes = 64 << 10;
    d_ = new Deployment(o);
  }
  static void TearDownTestSuite() {
    delete d_;
    d_ = nullptr;
  }
  static Deployment* d_;
};
Deployment* HttpApiTest::d_ = nullptr;

TEST_F(HttpApiTest, CompletionTextIsTheDecodeOfTheGrpcTokens) {
  ASSERT_NE(TestTokenizer(), nullptr);
  const std::string prompt = "The latent cache holds";
  const std::vector<int32_t> ids = Tok().Encode(prompt, /*add_special_tokens=*/true);
  const std::vector<int32_t> grpc_tokens = d_->GrpcTokens(ids, 7, 24, 0.8);
  ASSERT_EQ(grpc_tokens.size(), 24u);
  const json body = {{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 24}, {"seed", 7}, {"temperature", 0.8}};
  auto [status, whole] = d_->Post("/v1/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  EXPECT_EQ(whole["object"], "text_completion");
  EXPECT_EQ(whole["model"], "tiny");
  ASSERT_EQ(whole["choices"].size(), 1u);
  EXPECT_EQ(whole["choices"][0]["text"], Decode(grpc_tokens));
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(whole["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(whole["usage"]["completion_tokens"], 24);
  EXPECT_EQ(whole["usage"]["total_tokens"], ids.size() + 24);

  json stream_body = body;
  stream_body["stream_options"] = {{"include_usage", true}};
  auto [sstatus, events] = d_->Stream("/v1/completions", stream_body);
  ASSERT_EQ(sstatus, 200);
  std::map<int, std::string> finish;
  json usage;
  auto text = Concatenate(events, false, &finish, &usage);
  EXPECT_EQ(text[0], Decode(grpc_tokens));
  EXPECT_EQ(finish[0], "length");
  EXPECT_EQ(usage["completion_tokens"], 24);
  EXPECT_EQ(usage["prompt_tokens"], ids.size());

  // A prompt of token ids is taken as it is.
  auto [istatus, by_ids] =
      d_->Post("/v1/completions", {{"prompt", ids}, {"max_tokens", 24}, {"seed", 7}, {"temperature", 0.8}});
  ASSERT_EQ(istatus, 200);
  EXPECT_EQ(by_ids["choices"][0]["text"], Decode(grpc_tokens));
}

TEST_F(HttpApiTest, ChatUsesTheTemplate) {
  const json messages = json::array({{{"role", "user"}, {"content", "Route this to a group"}}});
  const json body = {{"messages", messages}, {"max_tokens", 16}, {"seed", 3}, {"temperature", 0.5}};
  auto [status, whole] = d_->Post("/v1/chat/completions", body);
#ifdef MLARUN_NO_CHAT_TEMPLATE
  ASSERT_EQ(status, 400) << whole.dump();
  EXPECT_NE(whole["error"]["message"].get<std::string>().find("/v1/completions"), std::string::npos);
  GTEST_SKIP() << "no chat-template interpreter in this build: " << whole.dump();
#else
  ASSERT_EQ(status, 200) << whole.dump();
  auto tmpl = text::ChatTemplate::Parse(Tok().chat_template());
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  auto rendered = (*tmpl)->Render(json{{"messages", messages},
                                       {"add_generation_prompt", true},
                                       {"bos_token", Tok().bos_token()},
                                       {"eos_token", Tok().eos_token()}});
  ASSERT_TRUE(rendered.ok());
  const std::vector<int32_t> ids = Tok().Encode(*rendered, /*add_special_tokens=*/false);
  const std::vector<int32_t> grpc_tokens = d_->GrpcTokens(ids, 3, 16, 0.5);
  EXPECT_EQ(whole["object"], "chat.completion");
  EXPECT_EQ(whole["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(whole["choices"][0]["message"]["content"], Decode(grpc_tokens));
  EXPECT_EQ(whole["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(whole["usage"]["completion_tokens"], 16);
  auto [sstatus, events] = d_->Stream("/v1/chat/completions", body);
  ASSERT_EQ(sstatus, 200);
  std::map<int, std::string> finish;
  EXPECT_EQ(Concatenate(events, true, &finish)[0], Decode(grpc_tokens));
  EXPECT_EQ(finish[0], "length");
#endif
}

TEST_F(HttpApiTest, StopStringsEndTheTextAndTheRequest) {
  const json base = {{"prompt", "stop here"}, {"max_tokens", 48}, {"seed", 11}, {"temperature", 1.0}};
  auto [status, whole] = d_->Post("/v1/completions", base);
  ASSERT_EQ(status, 200);
  const std::string full = whole["choices"][0]["text"];
  // A stop string from the middle of the text, on character boundaries.
  size_t from = full.size() / 2;
  while (from < full.size() && (static_cast<unsigned char>(full[from]) & 0xC0) == 0x80) ++from;
  size_t to = from + 1;
  while (to < full.size() && (static_cast<unsigned char>(full[to]) & 0xC0) == 0x80) ++to;
  ASSERT_LT(from, full.size());
  const std::string stop = full.substr(from, to - from);
  const std::string expected = full.substr(0, full.find(stop));
  const auto before = d_->Metrics();
  json body = base;
  body["stop"] = json::array({stop, "never-in-there"});
  auto [sstatus, stopped] = d_->Post("/v1/completions", body);
  ASSERT_EQ(sstatus, 200);
  EXPECT_EQ(stopped["choices"][0]["text"], expected);
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");
  EXPECT_LT(stopped["usage"]["completion_tokens"].get<int>(), 48);
  std::map<int, std::string> finish;
  auto [st, events] = d_->Stream("/v1/completions", body);
  ASSERT_EQ(st, 200);
  EXPECT_EQ(Concatenate(events, false, &finish)[0], expected);
  EXPECT_EQ(finish[0], "stop");
  // Both ended as finished (not cancelled), and nothing is left live.
  std::map<std::string, double> after;
  for (int i = 0; i < 200; ++i) {
    after = d_->Metrics();
    if (Sample(after, "mlarun:num_requests_live") == 0) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(Sample(after, "mlarun:num_requests_live"), 0);
  EXPECT_EQ(Sample(after, "mlarun:request_success_total{finished_reason=\"stop\"}") -
                Sample(before, "mlarun:request_success_total{finished_reason=\"stop\"}"),
            2);
}

TEST_F(HttpApiTest, TwoChoicesAreSeedAndSeedPlusOne) {
  const std::vector<int32_t> ids = Tok().Encode("two choices", true);
  const json body = {{"prompt", "two choices"}, {"max_tokens", 12}, {"seed", 40}, {"temperature", 0.9}, {"n", 2}};
  auto [status, whole] = d_->Post("/v1/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  ASSERT_EQ(whole["choices"].size(), 2u);
  EXPECT_EQ(whole["choices"][0]["index"], 0);
  EXPECT_EQ(whole["choices"][1]["index"], 1);
  EXPECT_EQ(whole["choices"][0]["text"], Decode(d_->GrpcTokens(ids, 40, 12, 0.9)));
  EXPECT_EQ(whole["choices"][1]["text"], Decode(d_->GrpcTokens(ids, 41, 12, 0.9)));
  EXPECT_NE(whole["choices"][0]["text"], whole["choices"][1]["text"]);
  EXPECT_EQ(whole["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(whole["usage"]["completion_tokens"], 24);
  auto [st, events] = d_->Stream("/v1/completions", body);
  ASSERT_EQ(st, 200);
  auto text = Concatenate(events, false);
  EXPECT_EQ(text[0], whole["choices"][0]["text"]);
  EXPECT_EQ(text[1], whole["choices"][1]["text"]);
  // A batch of two prompts: choice indexes 0..3, prompt by prompt.
  auto [bs, batch] = d_->Post("/v1/completions", {{"prompt", {"a", "b"}}, {"max_tokens", 4}, {"n", 2}, {"seed", 1}});
  ASSERT_EQ(bs, 200) << batch.dump();
  ASSERT_EQ(batch["choices"].size(), 4u);
  EXPECT_EQ(batch["choices"][2]["text"], Decode(d_->GrpcTokens(Tok().Encode("b", true), 1, 4, 1.0)));
}

TEST_F(HttpApiTest, LogprobsAreTheSampledTokens) {
  const json body = {{"prompt", "logprobs"}, {"max_tokens", 6}, {"seed", 2}, {"logprobs", 0}};
  auto [status, whole] = d_->Post("/v1/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  const json& lp = whole["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), 6u);
  const std::vector<int32_t> ids = Tok().Encode("logprobs", true);
  for (int i = 0; i < 6; ++i) {
    EXPECT_DOUBLE_EQ(lp["token_logprobs"][i].get<double>(), SimWorkerToken(ids, 2, i, Tok().vocab_size()).logprob);
  }
  // Streamed, every token's logprob arrives once, with the chunk of its text
  // (or a later one when its bytes end inside a character).
  auto [ss, events] =
      d_->Stream("/v1/chat/completions",
                 {{"messages", {{{"role", "user"}, {"content", "y"}}}}, {"max_tokens", 9}, {"logprobs", true}});
  ASSERT_EQ(ss, 200);
  size_t streamed_logprobs = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json c = json::parse(events[i]);
    if (!c["choices"].empty() && c["choices"][0]["logprobs"].is_object())
      streamed_logprobs += c["choices"][0]["logprobs"]["content"].size();
  }
  EXPECT_EQ(streamed_logprobs, 9u);
  // echo: the prompt's text comes first.
  auto [es, echoed] =
      d_->Post("/v1/completions", {{"prompt", "echo me"}, {"max_tokens", 3}, {"seed", 2}, {"echo", true}});
  ASSERT_EQ(es, 200);
  EXPECT_TRUE(echoed["choices"][0]["text"].get<std::string>().starts_with("echo me")) << echoed.dump();
  EXPECT_TRUE(echoed["choices"][0]["logprobs"].is_null());
}

// echo with logprobs: the prompt's tokens first, each (but the first, null)
// with the logprob and most likely tokens the group sent for it (the
// simulated group's: SimWorkerPromptToken, SimWorkerTop), then the
// completion's; offsets run on over both. A stream's first chunk carries the
// prompt's part.
TEST_F(HttpApiTest, EchoWithLogprobsListsThePromptsTokensFirst) {
  const int64_t vocab = Tok().vocab_size();
  const json body = {{"prompt", "echo this"}, {"max_tokens", 3}, {"seed", 6}, {"logprobs", 2}, {"echo", true}};
  auto [status, whole] = d_->Post("/v1/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  const std::vector<int32_t> ids = Tok().Encode("echo this", true);
  ASSERT_GE(ids.size(), 3u);
  const json& lp = whole["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size() + 3) << lp.dump();
  int64_t offset = 0;
  for (size_t i = 0; i < ids.size() + 3; ++i) {
    SCOPED_TRACE("token " + std::to_string(i));
    const bool prompt = i < ids.size();
    const SimToken tok = prompt ? SimWorkerPromptToken(ids, static_cast<int64_t>(i))
                                : SimWorkerToken(ids, 6, static_cast<int64_t>(i - ids.size()), vocab);
    EXPECT_EQ(lp["tokens"][i], TokenText(tok.token));
    EXPECT_EQ(lp["text_offset"][i], offset);
    offset += static_cast<int64_t>(TokenText(tok.token).size());
    if (i == 0) {
      EXPECT_TRUE(lp["token_logprobs"][i].is_null());
      EXPECT_TRUE(lp["top_logprobs"][i].is_null());
      continue;
    }
    EXPECT_DOUBLE_EQ(lp["token_logprobs"][i].get<double>(), tok.logprob);
    ExpectSimCompletionTop(lp["top_logprobs"][i], tok, 2);
  }
  // Streamed: the echo's chunk carries the prompt's part, then the tokens'.
  auto [ss, events] = d_->Stream("/v1/completions", body);
  ASSERT_EQ(ss, 200);
  json joined = {{"tokens", json::array()},
                 {"token_logprobs", json::array()},
                 {"top_logprobs", json::array()},
                 {"text_offset", json::array()}};
  for (size_t e = 0; e + 1 < events.size(); ++e) {
    const json c = json::parse(events[e]);
    if (c["choices"].empty() || !c["choices"][0]["logprobs"].is_object()) continue;
    if (e == 0) EXPECT_EQ(c["choices"][0]["logprobs"]["tokens"].size(), ids.size()) << "the echo's chunk";
    for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
      for (const json& v : c["choices"][0]["logprobs"][key]) joined[key].push_back(v);
  }
  EXPECT_EQ(joined, lp);

  // max_tokens 0: the prompt alone, with its logprobs (how a client scores a
  // text without a continuation), whole and streamed.
  json prompt_only = body;
  prompt_only["max_tokens"] = 0;
  auto [os, only] = d_->Post("/v1/completions", prompt_only);
  ASSERT_EQ(os, 200) << only.dump();
  EXPECT_EQ(only["choices"][0]["text"], "echo this");
  EXPECT_EQ(only["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(only["usage"]["completion_tokens"], 0);
  json prompt_part = json::object();
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    prompt_part[key] = json(std::vector<json>(lp[key].begin(), lp[key].begin() + static_cast<int64_t>(ids.size())));
  EXPECT_EQ(only["choices"][0]["logprobs"], prompt_part);
  auto [ost, only_events] = d_->Stream("/v1/completions", prompt_only);
  ASSERT_EQ(ost, 200);
  std::string streamed_text;
  json streamed_lp;
  for (size_t e = 0; e + 1 < only_events.size(); ++e) {
    const json c = json::parse(only_events[e]);
    streamed_text += c["choices"][0]["text"].get<std::string>();
    if (c["choices"][0]["logprobs"].is_object()) streamed_lp = c["choices"][0]["logprobs"];
  }
  EXPECT_EQ(streamed_text, "echo this");
  EXPECT_EQ(streamed_lp, prompt_part);
}

// The most likely tokens of each step, as the group sent them (the simulated
// group's are SimWorkerTop's), in each endpoint's form.
TEST_F(HttpApiTest, TopLogprobsAreTheGroupsInEachEndpointsForm) {
  const int64_t vocab = Tok().vocab_size();
  // Completions: per token an object of text -> logprob with the N most
  // likely and the sampled token (texts that coincide keep the likelier
  // entry's logprob). N = 1: the group's single entry is another token, so
  // the sampled one is added; N = 3: it is among them.
  for (int64_t n : {1, 3}) {
    SCOPED_TRACE("logprobs " + std::to_string(n));
    auto [status, whole] =
        d_->Post("/v1/completions", {{"prompt", "top"}, {"max_tokens", 5}, {"seed", 4}, {"logprobs", n}});
    ASSERT_EQ(status, 200) << whole.dump();
    const json& lp = whole["choices"][0]["logprobs"];
    ASSERT_EQ(lp["top_logprobs"].size(), 5u);
    const std::vector<int32_t> ids = Tok().Encode("top", true);
    for (int i = 0; i < 5; ++i) {
      const SimToken tok = SimWorkerToken(ids, 4, i, vocab);
      ASSERT_EQ(SimWorkerTop(tok, n, vocab).size(), static_cast<size_t>(n));
      ExpectSimCompletionTop(lp["top_logprobs"][i], tok, n);
      EXPECT_EQ(lp["tokens"][i], TokenText(tok.token));
    }
  }
  // Chat, top_logprobs = 2: per token a list of the 2 most likely, best
  // first, each with its text, logprob and the token's own bytes.
  {
    const json body = {{"messages", {{{"role", "user"}, {"content", "tops"}}}},
                       {"max_tokens", 4},
                       {"seed", 9},
                       {"logprobs", true},
                       {"top_logprobs", 2}};
    auto [status, chat] = d_->Post("/v1/chat/completions", body);
    ASSERT_EQ(status, 200) << chat.dump();
    const json& content = chat["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(content.size(), 4u);
    // Streamed: the same entries, token by token.
    auto [gs, streamed] = d_->Stream("/v1/chat/completions", body);
    ASSERT_EQ(gs, 200);
    size_t streamed_entries = 0;
    for (size_t e = 0; e + 1 < streamed.size(); ++e) {
      const json c = json::parse(streamed[e]);
      if (c["choices"].empty() || !c["choices"][0]["logprobs"].is_object()) continue;
      for (const json& entry : c["choices"][0]["logprobs"]["content"]) {
        ASSERT_LT(streamed_entries, content.size());
        EXPECT_EQ(entry, content[streamed_entries])
            << "streamed and whole answers differ at token " << streamed_entries;
        ++streamed_entries;
      }
    }
    EXPECT_EQ(streamed_entries, 4u);
    for (const json& entry : content) {
      ASSERT_EQ(entry["top_logprobs"].size(), 2u) << entry.dump();
      // SimWorkerTop: another token at half the sampled one's logprob, then
      // the sampled token itself.
      const json& best = entry["top_logprobs"][0];
      const json& second = entry["top_logprobs"][1];
      EXPECT_DOUBLE_EQ(best["logprob"].get<double>(), entry["logprob"].get<double>() / 2);
      EXPECT_EQ(second["token"], entry["token"]);
      EXPECT_EQ(second["bytes"], entry["bytes"]);
      EXPECT_DOUBLE_EQ(second["logprob"].get<double>(), entry["logprob"].get<double>());
      for (const json* e : {&best, &second}) {
        // bytes: the token's own; they decode to its text where whole.
        std::string bytes;
        for (const json& b : (*e)["bytes"]) bytes.push_back(static_cast<char>(b.get<int>()));
        ASSERT_FALSE(bytes.empty());
        const std::string text = (*e)["token"].get<std::string>();
        if (text.find("\xef\xbf\xbd") == std::string::npos) EXPECT_EQ(bytes, text);
      }
    }
  }
}

TEST_F(HttpApiTest, ErrorsAreOpenAiObjectsNamingTheField) {
  auto check = [&](const std::string& path, const std::string& raw, int status, const std::string& param) {
    auto res = d_->Client().Post(path, raw, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, status) << raw << " -> " << res->body;
    const json e = json::parse(res->body, nullptr, false);
    ASSERT_TRUE(e.contains("error")) << res->body;
    for (const char* k : {"message", "type", "param", "code"}) EXPECT_TRUE(e["error"].contains(k)) << res->body;
    if (!param.empty()) {
      EXPECT_EQ(e["error"]["param"], param) << res->body;
    }
  };
  check("/v1/completions", "{\"prompt\": \"x\",", 400, "");
  check("/v1/completions", "[1, 2]", 400, "");
  check("/v1/completions", R"({"prompt": "x", "max_tokens": "ten"})", 400, "max_tokens");
  check("/v1/completions", R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens");  // 0 only with echo
  check("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", 400,
        "max_tokens");
  // More alternatives than the engine lists, or top_logprobs without logprobs.
  check("/v1/completions", R"({"prompt": "x", "logprobs": 21})", 400, "logprobs");
  check("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", 400,
        "top_logprobs");
  check("/v1/chat/completions",
        R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})", 400,
        "top_logprobs");
  check("/v1/completions", R"({"prompt": "x", "temperature": -1})", 400, "temperature");
  check("/v1/completions", R"({"prompt": "x", "top_p": 0})", 400, "top_p");
  check("/v1/completions", R"({"prompt": "x", "n": "2"})", 400, "n");
  check("/v1/completions", R"({"prompt": "x", "stream": "yes"})", 400, "stream");
  check("/v1/completions", R"({"prompt": "x", "stop": 5})", 400, "stop");
  check("/v1/completions", R"({"prompt": 5})", 400, "prompt");
  check("/v1/completions", R"({"max_tokens": 3})", 400, "prompt");
  check("/v1/completions", R"({"prompt": "x", "max_tokens": 5000})", 400, "max_tokens");
  check("/v1/completions", R"({"prompt": [1, 99999]})", 400, "prompt");
  check("/v1/completions", json{{"prompt", std::vector<std::string>(20, "a")}, {"n", 100}}.dump(), 400, "n");
  check("/v1/chat/completions", R"({"messages": "hi"})", 400, "messages");
  check("/v1/chat/completions", R"({"messages": [{"content": "hi"}]})", 400, "messages[0].role");
  check("/v1/completions", R"({"model": "gpt-4", "prompt": "x"})", 404, "model");
  check("/v1/nothing", "{}", 404, "");
  // Unknown fields are ignored, as OpenAI servers do.
  auto [ok, body] = d_->Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}, {"frobnicate", {1, 2}}});
  EXPECT_EQ(ok, 200) << body.dump();
  // A body over the limit (64 KiB here).
  const std::string big = json{{"prompt", std::string(100 << 10, 'a')}}.dump();
  check("/v1/completions", big, 413, "");
  // The server keeps serving.
  auto [again, _] = d_->Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
  EXPECT_EQ(again, 200);
}

// A prompt of token ids is one prompt however long: 1,500 ids are taken
// (flat and as a batch of one), while a batch of more than 1,024 prompts is
// still refused.
TEST_F(HttpApiTest, ALongTokenIdPromptIsOnePrompt) {
  std::vector<int32_t> ids(1500);
  std::mt19937 rng(7);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 200 + 10);
  for (const json& prompt : {json(ids), json::array({ids})}) {
    auto [status, body] = d_->Post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 2}});
    ASSERT_EQ(status, 200) << body.dump().substr(0, 400);
    EXPECT_EQ(body["choices"].size(), 1u);
    EXPECT_EQ(body["usage"]["prompt_tokens"], 1500);
  }
  auto [status, body] = d_->Post("/v1/completions", {{"prompt", std::vector<std::string>(1025, "a")}});
  EXPECT_EQ(status, 400);
  EXPECT_NE(body["error"]["message"].get<std::string>().find("a batch of at most 1024 prompts"), std::string::npos)
      << body.dump();
}

// Constraints the engine cannot honour are refused by name, never ignored:
// vLLM's guided_* fields on both endpoints, and a tool_choice other than
// "none" (which, as vLLM, needs no tools).
// Prompt + max_tokens beyond the context (4096 here): 400 in vLLM's words,
// in the request's terms (no prompt_ids or sampling.max_tokens).
TEST_F(HttpApiTest, ContextLengthErrorsAreVllms) {
  std::vector<int32_t> ids(4000);
  std::mt19937 rng(11);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 200 + 10);
  auto [status, e] = d_->Post("/v1/completions", {{"prompt", ids}, {"max_tokens", 200}});
  ASSERT_EQ(status, 400) << e.dump();
  EXPECT_EQ(e["error"]["message"],
            "This model's maximum context length is 4096 tokens. However, you requested 4200 tokens (4000 in the "
            "prompt, 200 in the completion). Please reduce the length of the prompt or completion.");
  EXPECT_EQ(e["error"]["param"], "max_tokens");
  EXPECT_EQ(e["error"]["code"], "context_length_exceeded");
  // The default 16 of completions counts too, and on the edge it fits.
  ids.resize(4090);
  std::tie(status, e) = d_->Post("/v1/completions", {{"prompt", ids}});
  EXPECT_EQ(status, 400) << e.dump();
  EXPECT_NE(e["error"]["message"].get<std::string>().find("you requested 4106 tokens (4090 in the prompt, 16 in"),
            std::string::npos)
      << e.dump();
  EXPECT_EQ(e["error"]["param"], "prompt");
  std::tie(status, e) = d_->Post("/v1/completions", {{"prompt", ids}, {"max_tokens", 6}});
  EXPECT_EQ(status, 200) << e.dump().substr(0, 300);
#ifndef MLARUN_NO_CHAT_TEMPLATE
  // Chat: the rendered messages' tokens, as usage counts them.
  const json messages = json::array({{{"role", "user"}, {"content", "the latent cache"}}});
  std::tie(status, e) = d_->Post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 1}});
  ASSERT_EQ(status, 200) << e.dump();
  const int64_t prompt = e["usage"]["prompt_tokens"].get<int64_t>();
  std::tie(status, e) = d_->Post("/v1/chat/completions", {{"messages", messages}, {"max_completion_tokens", 4096}});
  ASSERT_EQ(status, 400) << e.dump();
  EXPECT_EQ(e["error"]["message"],
            "This model's maximum context length is 4096 tokens. However, you requested " +
                std::to_string(prompt + 4096) + " tokens (" + std::to_string(prompt) +
                " in the messages, 4096 in the completion). Please reduce the length of the messages or completion.");
  EXPECT_EQ(e["error"]["param"], "max_completion_tokens");
#endif
}

// The engine's fields take their ranges from ValidateSamplingParams: a value
// just outside one is a 400 naming the request's field and the range, on
// both endpoints; a value on the edge is accepted.
TEST_F(HttpApiTest, SamplingRangesAreValidateSamplingParams) {
  const json messages = json::array({{{"role", "user"}, {"content", "x"}}});
  // `fields` added to a request of each endpoint: 400 naming `param`, its
  // message holding `range`.
  auto refused = [&](const json& fields, const std::string& param, const std::string& range, bool chat) {
    json body = chat ? json{{"messages", messages}} : json{{"prompt", "x"}};
    body.update(fields);
    auto [status, e] = d_->Post(chat ? "/v1/chat/completions" : "/v1/completions", body);
    EXPECT_EQ(status, 400) << body.dump() << " -> " << e.dump();
    EXPECT_EQ(e["error"]["param"], param) << body.dump() << " -> " << e.dump();
    EXPECT_EQ(e["error"]["type"], "invalid_request_error") << e.dump();
    const std::string message = e["error"].value("message", "");
    EXPECT_TRUE(message.starts_with(param)) << message;
    EXPECT_NE(message.find(range), std::string::npos) << body.dump() << " -> " << message;
  };
  for (const bool chat : {false, true}) {
    SCOPED_TRACE(chat ? "chat" : "completions");
    refused({{"temperature", -0.5}}, "temperature", "[0, 100]", chat);
    refused({{"temperature", 100.5}}, "temperature", "[0, 100]", chat);
    refused({{"top_p", 0}}, "top_p", "(0, 1]", chat);
    refused({{"top_p", 1.01}}, "top_p", "(0, 1]", chat);
    refused({{"top_k", -2}}, "top_k", ">= -1", chat);
    refused({{"top_k", int64_t{1} << 31}}, "top_k", "at most 2147483647", chat);
    refused({{"max_tokens", 0}}, "max_tokens", ">= 1", chat);
    refused({{"max_tokens", -1}}, "max_tokens", ">= 1", chat);
    refused({{"max_tokens", int64_t{1} << 31}}, "max_tokens", "[1, 2147483647]", chat);
    refused({{"max_completion_tokens", 0}}, "max_completion_tokens", ">= 1", chat);
    refused({{"max_completion_tokens", int64_t{1} << 31}}, "max_completion_tokens", "[1, 2147483647]", chat);
    refused({{"stop_token_ids", {1, -1}}}, "stop_token_ids", ">= 0", chat);
    refused({{"presence_penalty", 2.5}}, "presence_penalty", "[-2, 2]", chat);
    refused({{"presence_penalty", "high"}}, "presence_penalty", "must be a number", chat);
    refused({{"frequency_penalty", -2.01}}, "frequency_penalty", "[-2, 2]", chat);
    refused({{"repetition_penalty", 0}}, "repetition_penalty", "> 0", chat);
    refused({{"repetition_penalty", -1}}, "repetition_penalty", "> 0", chat);
    refused({{"logit_bias", {{"5", 100.5}}}}, "logit_bias", "[-100, 100]", chat);
    refused({{"logit_bias", {{"5", -101}}}}, "logit_bias", "[-100, 100]", chat);
    refused({{"logit_bias", {{"-3", 1}}}}, "logit_bias", "token id -3 outside", chat);
    refused({{"logit_bias", {{"five", 1}}}}, "logit_bias", "keys must be token ids", chat);
    refused({{"logit_bias", {{"5", "1"}}}}, "logit_bias", "must be a number", chat);
    refused({{"logit_bias", {1, 2}}}, "logit_bias", "must be an object", chat);
    refused({{"min_tokens", -1}}, "min_tokens", "[0, 2147483647]", chat);
    refused({{"min_tokens", 5}, {"max_tokens", 4}}, "min_tokens", "[0, max_tokens = 4]", chat);
  }
  // The vocabulary and a chat's context are the group's to know: those
  // fields travel with the request and come back named by its check.
  auto refused_by_group = [&](const json& fields, const std::string& param, const std::string& range, bool chat) {
    json body = chat ? json{{"messages", messages}} : json{{"prompt", "x"}};
    body.update(fields);
    auto [status, e] = d_->Post(chat ? "/v1/chat/completions" : "/v1/completions", body);
    EXPECT_EQ(status, 400) << body.dump() << " -> " << e.dump();
    EXPECT_EQ(e["error"]["param"], param) << e.dump();
    const std::string message = e["error"].value("message", "");
    EXPECT_TRUE(message.starts_with(param)) << message;  // no internal field names
    EXPECT_NE(message.find(range), std::string::npos) << message;
  };
  const json beyond = {{"logit_bias", {{std::to_string(Tok().vocab_size()), 1}}}};
  refused_by_group(beyond, "logit_bias", "token id " + std::to_string(Tok().vocab_size()) + " outside", false);
#ifndef MLARUN_NO_CHAT_TEMPLATE
  refused_by_group(beyond, "logit_bias", "outside [0, ", true);
  // A chat without max_tokens runs up to the context: min_tokens is checked
  // against that.
  refused_by_group({{"min_tokens", 5000}}, "min_tokens", "[0, max_tokens = ", true);
#endif
  // max_tokens 0 is the prompt alone with echo, else refused; not through
  // max_completion_tokens.
  refused({{"max_tokens", 0}, {"echo", false}}, "max_tokens", "only with echo", false);
  refused({{"max_completion_tokens", 0}, {"echo", true}}, "max_completion_tokens", ">= 1", false);
  // The alternatives per token: completions' logprobs, chat's top_logprobs.
  refused({{"logprobs", -1}}, "logprobs", "[0, 20]", false);
  refused({{"logprobs", 21}}, "logprobs", "[0, 20]", false);
  refused({{"logprobs", 21}, {"echo", true}}, "logprobs", "[0, 20]", false);
  refused({{"logprobs", true}, {"top_logprobs", -1}}, "top_logprobs", "[0, 20]", true);
  refused({{"logprobs", true}, {"top_logprobs", 21}}, "top_logprobs", "[0, 20]", true);
  refused({{"top_logprobs", 21}}, "top_logprobs", "[0, 20]", true);  // the range before needing logprobs

  // On the edges: accepted (the chat template permitting).
  const json edges = {{"temperature", 100},
                      {"top_p", 1},
                      {"top_k", -1},
                      {"max_tokens", 1},
                      {"stop_token_ids", {0}},
                      {"presence_penalty", -2},
                      {"frequency_penalty", 2},
                      {"repetition_penalty", 0.01},
                      {"min_tokens", 1},
                      {"logit_bias", {{"0", -100}, {"1", 100}}}};
  json completion = edges;
  completion.update(json{{"prompt", "x"}, {"logprobs", 20}, {"echo", true}});
  auto [cs, cbody] = d_->Post("/v1/completions", completion);
  EXPECT_EQ(cs, 200) << cbody.dump();
  json only = {{"prompt", "x"}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}};
  auto [os, obody] = d_->Post("/v1/completions", only);
  EXPECT_EQ(os, 200) << obody.dump();
  json chat = edges;
  chat.update(json{{"messages", messages}, {"logprobs", true}, {"top_logprobs", 20}});
  auto [chs, chbody] = d_->Post("/v1/chat/completions", chat);
#ifdef MLARUN_NO_CHAT_TEMPLATE
  EXPECT_EQ(chbody["error"]["param"], "messages") << chbody.dump();
#else
  EXPECT_EQ(chs, 200) << chbody.dump();
#endif
}

// bad_words become token-id sequences (text::EncodeBadWords) that reach
// the group: the simulated group steps off a token that would end one, so
// its answer is the unconstrained one with that rule applied, here
// recomputed from the gRPC tokens.
TEST_F(HttpApiTest, BadWordsReachTheGroupAsTokenIds) {
  const std::vector<int32_t> prompt = Tok().Encode("Bad words are sequences", /*add_special_tokens=*/true);
  const std::vector<int32_t> plain = d_->GrpcTokens(prompt, 5, 12, 0.7);
  ASSERT_EQ(plain.size(), 12u);
  json body = {{"prompt", prompt}, {"max_tokens", 12}, {"seed", 5}, {"temperature", 0.7}, {"return_token_ids", true}};
  auto [s0, whole0] = d_->Post("/v1/completions", body);
  ASSERT_EQ(s0, 200) << whole0.dump();
  EXPECT_EQ(whole0["choices"][0]["token_ids"], json(plain));
  // Words made of the tokens the group would send: the second one's text,
  // and the text of the fourth and fifth together.
  const std::vector<std::string> words = {Decode({plain[1]}), Decode({plain[3], plain[4]})};
  const std::vector<std::vector<int32_t>> seqs = text::EncodeBadWords(Tok(), words);
  ASSERT_FALSE(seqs.empty());
  const int64_t vocab = Tok().vocab_size();
  std::vector<int64_t> want;
  for (const int32_t t : plain) {
    int64_t token = t;
    auto banned = [&](int64_t x) {
      for (const std::vector<int32_t>& w : seqs) {
        const size_t k = w.size() - 1;
        if (w.back() != x || k > want.size()) continue;
        if (std::equal(w.begin(), w.end() - 1, want.end() - static_cast<std::ptrdiff_t>(k))) return true;
      }
      return false;
    };
    while (banned(token)) token = (token + 1) % vocab;
    want.push_back(token);
  }
  body["bad_words"] = words;
  for (const bool chat : {false, true}) {
    json b = body;
    if (chat) {
      b.erase("prompt");
      b["messages"] = json::array({{{"role", "user"}, {"content", "x"}}});
    }
    auto [status, whole] = d_->Post(chat ? "/v1/chat/completions" : "/v1/completions", b);
#ifdef MLARUN_NO_CHAT_TEMPLATE
    if (chat) continue;
#endif
    ASSERT_EQ(status, 200) << whole.dump();
    if (!chat) {
      EXPECT_EQ(whole["choices"][0]["token_ids"], json(want));
      EXPECT_NE(want, std::vector<int64_t>(plain.begin(), plain.end())) << "no bad word applied: a weak test";
    }
  }
  auto [sstatus, events] = d_->Stream("/v1/completions", body);
  ASSERT_EQ(sstatus, 200);
  std::vector<int64_t> streamed;
  for (const std::string& e : events) {
    if (e == "[DONE]") continue;
    const json chunk = json::parse(e);
    for (const json& c : chunk["choices"])
      for (const json& id : c["token_ids"]) streamed.push_back(id.get<int64_t>());
  }
  EXPECT_EQ(streamed, want);
  // Bad input: a 400 naming the field.
  for (const json& bad : {json("x"), json::array({1}), json::array({"ok", nullptr})}) {
    json b = body;
    b["bad_words"] = bad;
    auto [status, e] = d_->Post("/v1/completions", b);
    EXPECT_EQ(status, 400) << e.dump();
    EXPECT_EQ(e["error"]["param"], "bad_words") << e.dump();
  }
}

// --skip-tokenizer-init: token ids in, token ids out; whatever needs text
// is a 400 saying why.
TEST(HttpApiNoTokenizer, TokenIdsInAndOut) {
  CoordinatorOptions o;
  o.http_skip_tokenizer_init = true;
  Deployment d(o, 1);
  const std::vector<int32_t> prompt = {11, 29, 3, 250, 7};
  const std::vector<int32_t> grpc = d.GrpcTokens(prompt, 9, 6, 0.9);
  const json body = {{"prompt", prompt}, {"max_tokens", 6}, {"seed", 9}, {"temperature", 0.9}};
  auto [status, whole] = d.Post("/v1/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  EXPECT_EQ(whole["choices"][0]["token_ids"], json(grpc));
  EXPECT_EQ(whole["choices"][0]["text"], "");
  EXPECT_EQ(whole["usage"]["completion_tokens"], 6);
  auto [sstatus, events] = d.Stream("/v1/completions", body);
  ASSERT_EQ(sstatus, 200);
  std::vector<int32_t> streamed;
  for (const std::string& e : events) {
    if (e == "[DONE]") continue;
    const json chunk = json::parse(e);
    for (const json& c : chunk["choices"])
      for (const json& id : c["token_ids"]) streamed.push_back(id.get<int32_t>());
  }
  EXPECT_EQ(streamed, grpc);
  struct Case {
    std::string path;
    json body;
    std::string want;
  };
  const Case refused[] = {
      {"/v1/completions", {{"prompt", "text"}}, "must be token ids"},
      {"/v1/completions", {{"prompt", {"a", "b"}}}, "must be token ids"},
      {"/v1/completions", {{"prompt", prompt}, {"stop", {"x"}}}, "needs a tokenizer"},
      {"/v1/completions", {{"prompt", prompt}, {"bad_words", {"x"}}}, "needs a tokenizer"},
      {"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}}}, "chat completion needs"},
      {"/tokenize", {{"prompt", "x"}}, "/tokenize needs a tokenizer"},
      {"/detokenize", {{"tokens", {1, 2}}}, "/detokenize needs a tokenizer"},
  };
  for (const Case& c : refused) {
    auto [code, e] = d.Post(c.path, c.body);
    EXPECT_EQ(code, 400) << c.path << " " << c.body.dump() << " -> " << e.dump();
    const std::string message = e["error"]["message"].get<std::string>();
    EXPECT_NE(message.find(c.want), std::string::npos) << message;
    EXPECT_NE(message.find("--skip-tokenizer-init"), std::string::npos) << message;
  }
}

#ifndef MLARUN_NO_CHAT_TEMPLATE
// --chat-template replaces the tokenizer's; one that does not parse stops
// the start.
TEST(HttpApiChatTemplate, TheFlagsTemplateRendersChat) {
  CoordinatorOptions o;
  o.http_chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}";
  Deployment d(o, 1);
  auto [status, answer] = d.Post(
      "/tokenize", {{"messages", {{{"role", "user"}, {"content", "one"}}, {{"role", "user"}, {"content", "two"}}}}});
  ASSERT_EQ(status, 200) << answer.dump();
  EXPECT_EQ(answer["tokens"], json(Tok().Encode("<<one>><<two>>", /*add_special_tokens=*/false)));
  CoordinatorOptions bad;
  bad.listen = "127.0.0.1:0";
  bad.http_listen = "127.0.0.1:0";
  bad.http_tokenizer = TestTokenizer();
  bad.http_chat_template = "{% for m in messages %}";
  auto started = Coordinator::Start(bad);
  ASSERT_FALSE(started.ok());
  EXPECT_NE(started.status().ToString().find("--chat-template"), std::string::npos) << started.status();
}
#endif

TEST_F(HttpApiTest, ModelsAndHealth) {
  auto res = d_->Client().Get("/v1/models");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  const json models = json::parse(res->body);
  EXPECT_EQ(models["object"], "list");
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  EXPECT_EQ(models["data"][0]["max_model_len"], 4096);
  auto health = d_->Client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// vLLM's /tokenize and /detokenize: the tokenizer's own Encode, the chat
// template's rendering as chat requests use it, and Decode back.
TEST_F(HttpApiTest, TokenizeIsTheTokenizersEncodeAndDetokenizeItsDecode) {
  const std::string text = "The latent cache holds a compressed key and value per token.";
  for (const bool special : {true, false}) {
    auto [status, t] = d_->Post("/tokenize", {{"model", "tiny"}, {"prompt", text}, {"add_special_tokens", special}});
    ASSERT_EQ(status, 200) << t.dump();
    const std::vector<int32_t> ids = Tok().Encode(text, special);
    EXPECT_EQ(t["tokens"].get<std::vector<int32_t>>(), ids);
    EXPECT_EQ(t["count"], ids.size());
    EXPECT_EQ(t["max_model_len"], 4096);
    auto [dstatus, d] = d_->Post("/detokenize", {{"model", "tiny"}, {"tokens", ids}});
    ASSERT_EQ(dstatus, 200) << d.dump();
    EXPECT_EQ(d["prompt"], Tok().Decode(ids, /*skip_special_tokens=*/false));
    if (!special) EXPECT_EQ(d["prompt"], text);
  }
  auto [sstatus, strs] = d_->Post("/tokenize", {{"prompt", "a b"}, {"return_token_strs", true}});
  ASSERT_EQ(sstatus, 200) << strs.dump();
  ASSERT_EQ(strs["token_strs"].size(), strs["tokens"].size());
  for (size_t i = 0; i < strs["tokens"].size(); ++i)
    EXPECT_EQ(strs["token_strs"][i], Tok().IdToToken(strs["tokens"][i].get<int32_t>()).value());
#ifndef MLARUN_NO_CHAT_TEMPLATE
  // Chat: as many tokens as a chat request's prompt.
  const json messages = json::array({{{"role", "user"}, {"content", "the latent cache"}}});
  auto [cstatus, c] = d_->Post("/tokenize", {{"messages", messages}});
  ASSERT_EQ(cstatus, 200) << c.dump();
  auto [gstatus, g] = d_->Post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 1}});
  ASSERT_EQ(gstatus, 200) << g.dump();
  EXPECT_EQ(c["count"], g["usage"]["prompt_tokens"]);
#endif
  // Errors name the field or the model.
  EXPECT_EQ(d_->Post("/tokenize", {{"prompt", 5}}).second["error"]["param"], "prompt");
  EXPECT_EQ(d_->Post("/tokenize", json::object()).second["error"]["param"], "prompt");
  EXPECT_EQ(d_->Post("/detokenize", {{"tokens", {1, 999999}}}).second["error"]["param"], "tokens");
  EXPECT_EQ(d_->Post("/detokenize", {{"tokens", "1"}}).second["error"]["param"], "tokens");
  EXPECT_EQ(d_->Post("/detokenize", {{"tokens", json::array()}}).second["prompt"], "");
  auto [mstatus, m] = d_->Post("/tokenize", {{"model", "other"}, {"prompt", "x"}});
  EXPECT_EQ(mstatus, 404);
  EXPECT_EQ(m["error"]["code"], "model_not_found");
}

TEST_F(HttpApiTest, VersionAndOneModel) {
  auto version = d_->Client().Get("/version");
  ASSERT_TRUE(version);
  EXPECT_EQ(version->status, 200);
  EXPECT_EQ(json::parse(version->body)["version"], MLARUN_VERSION);
  auto model = d_->Client().Get("/v1/models/tiny");
  ASSERT_TRUE(model);
  ASSERT_EQ(model->status, 200) << model->body;
  const json card = json::parse(model->body);
  EXPECT_EQ(card["id"], "tiny");
  EXPECT_EQ(card["object"], "model");
  EXPECT_EQ(card["max_model_len"], 4096);
  auto other = d_->Client().Get("/v1/models/gpt-4");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);
  EXPECT_EQ(json::parse(other->body)["error"]["code"], "model_not_found");
  auto post = d_->Client().Post("/version", "{}", "application/json");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
}

TEST_F(HttpApiTest, TwoHundredConcurrentStreamsComplete) {
  constexpr int kStreams = 200;
  std::atomic<int> complete{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i) {
    clients.emplace_back([&, i] {
      auto [status, events] = d_->Stream("/v1/completions", {{"prompt", "stream " + std::to_string(i)},
                                                             {"max_tokens", 8},
                                                             {"seed", i},
                                                             {"stream_options", {{"include_usage", true}}}});
      if (status != 200) return;
      json usage;
      Concatenate(events, false, nullptr, &usage);
      if (!events.empty() && events.back() == "[DONE]" && usage.value("completion_tokens", 0) == 8) ++complete;
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(complete.load(), kStreams);
}

// A raw connection to the HTTP API (reads time out after 10 s), and a request
// to send on it.
int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  timeval tv{.tv_sec = 10, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}
std::string HttpPost(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

TEST_F(HttpApiTest, ClientsThatGoAwayAreCancelled) {
  const auto before = d_->Metrics();
  // Mid-stream: the first chunk arrives, then the client closes.
  {
    const int fd = ConnectTo(d_->port);
    const std::string req =
        HttpPost("/v1/completions",
                 json{{"prompt", "a long one"}, {"max_tokens", 3000}, {"stream", true}, {"ignore_eos", true}}.dump());
    ASSERT_EQ(send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
    std::string got;
    char buf[4096];
    while (got.find("data: ") == std::string::npos) {
      const ssize_t n = recv(fd, buf, sizeof buf, 0);
      ASSERT_GT(n, 0);
      got.append(buf, static_cast<size_t>(n));
    }
    close(fd);
  }
  // While waiting for a whole answer.
  {
    const int fd = ConnectTo(d_->port);
    const std::string req = HttpPost(
        "/v1/completions", json{{"prompt", "a long one too"}, {"max_tokens", 3000}, {"ignore_eos", true}}.dump());
    ASSERT_EQ(send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
    std::this_thread::sleep_for(100ms);
    close(fd);
  }
  std::map<std::string, double> after;
  for (int i = 0; i < 300; ++i) {
    after = d_->Metrics();
    if (Sample(after, "mlarun:num_requests_live") == 0 &&
        Sample(after, "mlarun:request_error_total{code=\"CANCELLED\"}") -
                Sample(before, "mlarun:request_error_total{code=\"CANCELLED\"}") >=
            2)
      break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(Sample(after, "mlarun:num_requests_live"), 0);
  EXPECT_EQ(Sample(after, "mlarun:request_error_total{code=\"CANCELLED\"}") -
                Sample(before, "mlarun:request_error_total{code=\"CANCELLED\"}"),
            2);
  // Far fewer than the 2 x 3000 tokens asked for were generated.
  EXPECT_LT(Sample(after, "mlarun:generation_tokens_total") - Sample(before, "mlarun:generation_tokens_total"), 3000);
  auto [status, _] = d_->Post("/v1/completions", {{"prompt", "still serving"}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200);
}

// Every endpoint has its own path label; a model card's is one label
// whatever the id asked for, and unknown paths are "other".
TEST_F(HttpApiTest, MetricsLabelEveryEndpointAndNoClientChosenPath) {
  std::this_thread::sleep_for(200ms);  // earlier exchanges settle (below)
  const auto before = d_->Metrics();
  std::mt19937 rng(5);
  const std::string id = "m" + std::to_string(rng());
  EXPECT_EQ(d_->Client().Get("/version")->status, 200);
  EXPECT_EQ(d_->Client().Get("/v1/models/tiny")->status, 200);
  EXPECT_EQ(d_->Client().Get(("/v1/models/" + id).c_str())->status, 404);
  EXPECT_EQ(d_->Client().Get(("/nowhere/" + id).c_str())->status, 404);
  EXPECT_EQ(d_->Post("/tokenize", {{"prompt", "count me"}}).first, 200);
  EXPECT_EQ(d_->Post("/detokenize", {{"tokens", {5, 6}}}).first, 200);
  const std::vector<std::string> want = {"mlarun:http_requests_total{path=\"/version\",status=\"200\"}",
                                         "mlarun:http_requests_total{path=\"/v1/models/{id}\",status=\"200\"}",
                                         "mlarun:http_requests_total{path=\"/v1/models/{id}\",status=\"404\"}",
                                         "mlarun:http_requests_total{path=\"other\",status=\"404\"}",
                                         "mlarun:http_requests_total{path=\"/tokenize\",status=\"200\"}",
                                         "mlarun:http_requests_total{path=\"/detokenize\",status=\"200\"}"};
  auto after = d_->Metrics();
  auto counted = [&] {
    return std::all_of(want.begin(), want.end(),
                       [&](const std::string& k) { return Sample(after, k) > Sample(before, k); });
  };
  for (int i = 0; i < 100 && !counted(); ++i) {
    std::this_thread::sleep_for(10ms);
    after = d_->Metrics();
  }
  for (const std::string& k : want) EXPECT_EQ(Sample(after, k) - Sample(before, k), 1) << k;
  for (const auto& [k, v] : after) EXPECT_EQ(k.find(id), std::string::npos) << k;
}

TEST_F(HttpApiTest, MetricsCountRequestsOfBothApis) {
  // An HTTP exchange is counted once its answer is written, which may be just
  // after its client has read it: let the previous tests' exchanges settle.
  const std::string http_ok = "mlarun:http_requests_total{path=\"/v1/completions\",status=\"200\"}";
  std::this_thread::sleep_for(200ms);
  const auto before = d_->Metrics();
  auto [status, whole] = d_->Post("/v1/completions", {{"prompt", "count me"}, {"max_tokens", 5}});
  ASSERT_EQ(status, 200);
  const int64_t prompt_tokens = whole["usage"]["prompt_tokens"];
  d_->GrpcTokens({5, 6, 7}, 1, 4, 0);
  auto after = d_->Metrics();
  for (int i = 0; i < 100 && Sample(after, http_ok) == Sample(before, http_ok); ++i) {
    std::this_thread::sleep_for(10ms);
    after = d_->Metrics();
  }
  auto delta = [&](const std::string& k) { return Sample(after, k) - Sample(before, k); };
  EXPECT_EQ(delta("mlarun:request_success_total{finished_reason=\"length\"}"), 2);
  EXPECT_EQ(delta("mlarun:generation_tokens_total"), 9);
  EXPECT_EQ(delta("mlarun:prompt_tokens_total"), static_cast<double>(prompt_tokens + 3));
  EXPECT_EQ(delta("mlarun:prefix_cache_queries_total"), static_cast<double>(prompt_tokens + 3));
  EXPECT_EQ(delta("mlarun:e2e_request_latency_seconds_count"), 2);
  EXPECT_EQ(delta("mlarun:time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(delta("mlarun:inter_token_latency_seconds_count"), 7);
  EXPECT_EQ(delta("mlarun:requests_received_total"), 2);
  EXPECT_EQ(delta(http_ok), 1);
  double routed = 0;
  for (const auto& [k, v] : after) {
    if (k.starts_with("mlarun:routing_decisions_total{")) {
      EXPECT_NE(k.find("policy=\"prefix_affinity\""), std::string::npos) << k;
      routed += v - Sample(before, k);
    }
  }
  EXPECT_EQ(routed, 2);
  EXPECT_EQ(Sample(after, "mlarun:dp_groups_connected"), 2);
  EXPECT_GT(Sample(after, "mlarun:cache_blocks_total{dp_group=\"0\",rank=\"0\",worker=\"worker-0\"}"), 0);
  EXPECT_TRUE(after.contains("mlarun:num_requests_running{dp_group=\"1\",worker=\"worker-0\"}"));
  EXPECT_EQ(Sample(after, "mlarun:num_requests_queued"), 0);
  // Each rank's transfer counters, and the coordinator's prefix fetches
  // (nothing moved here: zero, but there).
  for (const char* name : {"transfer_fetches_total", "transfer_bytes_total", "transfer_failures_total"})
    EXPECT_TRUE(after.contains(std::string("mlarun:") + name + "{dp_group=\"0\",rank=\"0\",worker=\"worker-0\"}"))
        << name;
  EXPECT_TRUE(after.contains("mlarun:prefix_fetches_total"));
  EXPECT_TRUE(after.contains("mlarun:prefix_fetch_tokens_total"));
}

// cache_salt (vLLM's): a request reuses the cached prompt prefix only of
// requests with the same cache_salt (those without one share theirs); one
// that is not a string of 1 to 256 bytes is a 400 naming it.
TEST_F(HttpApiTest, CacheSaltNarrowsPrefixReuse) {
  std::mt19937_64 rng(20261209);
  std::vector<int32_t> prompt(50);  // 3 blocks of 16 reusable
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(Tok().vocab_size()));
  auto hits = [&](const json& salt) {
    json body = {{"prompt", prompt}, {"max_tokens", 1}};
    if (!salt.is_null()) body["cache_salt"] = salt;
    const double before = Sample(d_->Metrics(), "mlarun:prefix_cache_hits_total");
    auto [status, answer] = d_->Post("/v1/completions", body);
    EXPECT_EQ(status, 200) << answer.dump();
    return Sample(d_->Metrics(), "mlarun:prefix_cache_hits_total") - before;
  };
  EXPECT_EQ(hits(nullptr), 0);
  EXPECT_EQ(hits("tenant-a"), 0);
  EXPECT_EQ(hits("tenant-a"), 48);
  EXPECT_EQ(hits(nullptr), 48);
  EXPECT_EQ(hits("tenant-b"), 0);
  EXPECT_EQ(hits(std::string(256, 'x')), 0);

  for (const json& bad : {json(5), json(""), json(std::string(257, 'x')), json::array({"a"})}) {
    auto [status, e] = d_->Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}, {"cache_salt", bad}});
    EXPECT_EQ(status, 400) << bad.dump().substr(0, 20) << " -> " << e.dump();
    EXPECT_EQ(e["error"]["param"], "cache_salt") << e.dump();
  }
  const json messages = json::array({{{"role", "user"}, {"content", "x"}}});
  auto [status, e] = d_->Post("/v1/chat/completions", {{"messages", messages}, {"cache_salt", 1.5}});
  EXPECT_EQ(status, 400) << e.dump();
  EXPECT_EQ(e["error"]["param"], "cache_salt") << e.dump();
}

TEST(HttpApiAuth, BearerTokensAsTheGrpcApi) {
  CoordinatorOptions o;
  auto tokens = AuthTokens::Parse("0123456789abcdef0123 alice\n", "test-tokens");
  ASSERT_TRUE(tokens.ok());
  o.auth_tokens = *tokens;
  Deployment d(o, 1);
  const json body = {{"prompt", "x"}, {"max_tokens", 2}};
  auto [none, e1] = d.Post("/v1/completions", body);
  EXPECT_EQ(none, 401);
  EXPECT_EQ(e1["error"]["code"], "invalid_api_key");
  auto [wrong, e2] = d.Post("/v1/completions", body, "not-the-token-at-all");
  EXPECT_EQ(wrong, 401);
  auto [right, ok] = d.Post("/v1/completions", body, "0123456789abcdef0123");
  EXPECT_EQ(right, 200) << ok.dump();
  auto metrics = d.Client().Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 401);
  auto health = d.Client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST(HttpApiNoGroup, HealthAndRequestsAre503) {
  CoordinatorOptions o;
  o.queue_timeout_s = 0.3;
  Deployment d(o, /*groups=*/0);
  auto health = d.Client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  auto [status, e] = d.Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
  EXPECT_EQ(status, 503) << e.dump();
  EXPECT_NE(e["error"]["message"].get<std::string>().find("no DP group"), std::string::npos) << e.dump();
  auto [sstatus, events] = d.Stream("/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
  EXPECT_EQ(sstatus, 503);
}

TEST(HttpApiNoGroup, AFullQueueIs429WithRetryAfter) {
  CoordinatorOptions o;
  o.max_queued = 0;
  Deployment d(o, /*groups=*/0);
  auto res = d.Client().Post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 2}}.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 429) << res->body;
  EXPECT_EQ(json::parse(res->body)["error"]["code"], "queue_full");
  EXPECT_EQ(res->get_header_value("Retry-After"), "1");
  auto health = d.Client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  EXPECT_EQ(health->get_header_value("Retry-After"), "1");
}

// ---- The front door: limits before the body, slow clients, closed by default ----

// One raw request and its answer's status line and body ("" when none came).
std::string RawExchange(int port, const std::string& request, std::chrono::milliseconds limit = 5000ms) {
  const int fd = ConnectTo(port);
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string got;
  char buf[4096];
  timeval tv{.tv_sec = static_cast<time_t>(limit.count() / 1000), .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
    const size_t head = got.find("\r\n\r\n");
    const size_t cl = got.find("Content-Length: ");
    if (head != std::string::npos && cl != std::string::npos &&
        got.size() >= head + 4 + std::stoul(got.substr(cl + 16)))
      break;
  }
  close(fd);
  return got;
}
int RawStatus(const std::string& answer) { return answer.size() > 12 ? std::stoi(answer.substr(9, 3)) : -1; }

TEST(HttpApiFrontDoor, AChunkedBodyBeyondTheLimitIs413) {
  CoordinatorOptions o;
  o.http_max_body_bytes = 64 << 10;
  Deployment d(o, 1);
  const int fd = ConnectTo(d.port);
  std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  send(fd, head.data(), head.size(), MSG_NOSIGNAL);
  const std::string chunk = "4000\r\n" + std::string(0x4000, ' ') + "\r\n";
  size_t sent = 0;
  for (int i = 0; i < 4096 && send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL) > 0; ++i) sent += 0x4000;
  std::string got(256, '\0');
  const ssize_t n = recv(fd, got.data(), got.size(), 0);
  close(fd);
  ASSERT_GT(n, 12);
  EXPECT_EQ(RawStatus(got), 413) << got;
  EXPECT_LT(sent, size_t{32} << 20) << "the whole 64 MiB body was read";
}

TEST(HttpApiFrontDoor, NoBodyIsReadBeforeTheToken) {
  CoordinatorOptions o;
  auto tokens = AuthTokens::Parse("0123456789abcdef0123 alice\n", "test-tokens");
  ASSERT_TRUE(tokens.ok());
  o.auth_tokens = *tokens;
  Deployment d(o, 1);
  // A 30 MB body announced, a little of it sent: the 401 does not wait.
  const auto start = std::chrono::steady_clock::now();
  const std::string answer =
      RawExchange(d.port,
                  "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  "Content-Length: 30000000\r\n\r\n{\"prompt\": \"",
                  3000ms);
  EXPECT_EQ(RawStatus(answer), 401) << answer;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

TEST(HttpApiFrontDoor, SlowClientsLeaveHealthAndRequestsAnswered) {
  CoordinatorOptions o;
  o.http_threads = 64;
  Deployment d(o, 1);
  // More connections than handler threads, each trickling its header.
  std::vector<int> slow;
  for (int i = 0; i < 600; ++i) {
    const int fd = ConnectTo(d.port);
    const std::string part = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    send(fd, part.data(), part.size(), MSG_NOSIGNAL);
    slow.push_back(fd);
  }
  const auto start = std::chrono::steady_clock::now();
  auto health = d.Client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto [status, body] = d.Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << body.dump();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  for (int fd : slow) close(fd);
}

TEST(HttpApiFrontDoor, AnOpenServerIsClosedToWebPages) {
  Deployment d(CoordinatorOptions{}, 1);
  const std::string body = json{{"prompt", "x"}, {"max_tokens", 2}}.dump();
  auto post = [&](const std::string& fields) {
    return RawExchange(d.port, "POST /v1/completions HTTP/1.1\r\n" + fields +
                                   "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  };
  // A page's simple request (text/plain, no preflight) is refused.
  std::string a = post("Host: 127.0.0.1\r\nContent-Type: text/plain\r\n");
  EXPECT_EQ(RawStatus(a), 415) << a;
  EXPECT_NE(a.find("application/json"), std::string::npos);
  a = post("Host: 127.0.0.1\r\n");
  EXPECT_EQ(RawStatus(a), 415) << a;
  // A rebinding page's Host, and a foreign Origin.
  a = post("Host: evil.example:8000\r\nContent-Type: application/json\r\n");
  EXPECT_EQ(RawStatus(a), 403) << a;
  EXPECT_NE(a.find("host_not_allowed"), std::string::npos) << a;
  a = RawExchange(d.port, "GET /metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n");
  EXPECT_EQ(RawStatus(a), 403) << a;
  a = post("Host: 127.0.0.1\r\nOrigin: http://evil.example\r\nContent-Type: application/json\r\n");
  EXPECT_EQ(RawStatus(a), 403) << a;
  EXPECT_NE(a.find("origin_not_allowed"), std::string::npos) << a;
  // What clients send is answered: IP literals, localhost, charset.
  for (const char* host : {"127.0.0.1:1234", "localhost:8000", "[::1]:8000"}) {
    a = post(std::string("Host: ") + host + "\r\nContent-Type: application/json; charset=utf-8\r\n");
    EXPECT_EQ(RawStatus(a), 200) << host << "\n" << a;
  }
}

TEST(HttpApiFrontDoor, AllowedOriginsAndHostsAreAnswered) {
  CoordinatorOptions o;
  o.http_allowed_origins = {"https://app.example"};
  o.http_allowed_hosts = {"llm.internal"};
  Deployment d(o, 1);
  std::string a = RawExchange(d.port,
                              "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: llm.internal\r\n"
                              "Origin: https://app.example\r\nAccess-Control-Request-Method: POST\r\n\r\n");
  EXPECT_EQ(RawStatus(a), 204) << a;
  EXPECT_NE(a.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos) << a;
  EXPECT_NE(a.find("Access-Control-Allow-Headers: Authorization, Content-Type"), std::string::npos) << a;
  const std::string body = json{{"prompt", "x"}, {"max_tokens", 2}}.dump();
  a = RawExchange(d.port,
                  "POST /v1/completions HTTP/1.1\r\nHost: llm.internal\r\nOrigin: https://app.example\r\n"
                  "Content-Type: application/json\r\nContent-Length: " +
                      std::to_string(body.size()) + "\r\n\r\n" + body);
  EXPECT_EQ(RawStatus(a), 200) << a;
  EXPECT_NE(a.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos) << a;
  a = RawExchange(d.port, "GET /v1/models HTTP/1.1\r\nHost: other.internal\r\n\r\n");
  EXPECT_EQ(RawStatus(a), 403) << a;
}

TEST(HttpApiFrontDoor, AnAnswerTooBigToHoldIsRefused) {
  Deployment d(CoordinatorOptions{}, 1);
  // 128 choices x 4,000 echoed prompt tokens x 21 entries: beyond the bound.
  std::string prompt;
  for (int i = 0; i < 4000; ++i) prompt += " w" + std::to_string(i % 97);
  auto [status, e] =
      d.Post("/v1/completions", {{"prompt", prompt}, {"n", 128}, {"echo", true}, {"logprobs", 20}, {"max_tokens", 1}});
  EXPECT_EQ(status, 400) << e.dump();
  EXPECT_NE(e["error"]["message"].get<std::string>().find("logprob entries"), std::string::npos) << e.dump();
  auto [small, ok] =
      d.Post("/v1/completions", {{"prompt", "a b c"}, {"n", 2}, {"echo", true}, {"logprobs", 2}, {"max_tokens", 2}});
  EXPECT_EQ(small, 200) << ok.dump();
}

TEST(HttpApiFrontDoor, PipelinedRequestsAreBothAnswered) {
  Deployment d(CoordinatorOptions{}, 1);
  const std::string body = json{{"prompt", "x"}, {"max_tokens", 2}}.dump();
  const std::string one =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  const int fd = ConnectTo(d.port);
  const std::string two = one + one;
  send(fd, two.data(), two.size(), MSG_NOSIGNAL);
  std::string got;
  char buf[4096];
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  auto answers = [&] {
    size_t count = 0;
    for (size_t at = 0; (at = got.find("HTTP/1.1 200", at)) != std::string::npos; ++at) ++count;
    return count;
  };
  while (answers() < 2 || !got.ends_with("}}")) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  EXPECT_EQ(answers(), 2u) << got;
}

TEST(HttpApiFrontDoor, AHalfClosedClientIsAnswered) {
  Deployment d(CoordinatorOptions{}, 1, /*tokens_per_s=*/200);
  const std::string body = json{{"prompt", "x"}, {"max_tokens", 20}, {"ignore_eos", true}}.dump();
  const int fd = ConnectTo(d.port);
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  shutdown(fd, SHUT_WR);
  std::string got;
  char buf[4096];
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) got.append(buf, static_cast<size_t>(n));
  close(fd);
  EXPECT_NE(got.find("HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_NE(got.find("\"completion_tokens\":20"), std::string::npos) << got;
}

TEST(HttpApiDeadline, PassedDeadlineIs504) {
  CoordinatorOptions o;
  o.http_request_timeout_s = 0.2;
  Deployment d(o, /*groups=*/1, /*tokens_per_s=*/500);
  auto [status, e] = d.Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 2000}, {"ignore_eos", true}});
  EXPECT_EQ(status, 504) << e.dump();
  EXPECT_EQ(e["error"]["code"], "deadline_exceeded");
  // Streamed, the deadline comes after the 200: an error event, then [DONE].
  auto [sstatus, events] = d.Stream("/v1/completions", {{"prompt", "x"}, {"max_tokens", 2000}, {"ignore_eos", true}});
  ASSERT_EQ(sstatus, 200);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(json::parse(events[events.size() - 2])["error"]["code"], "deadline_exceeded");
}

// ---- Reasoning and tool calls ------------------------------------------------

#ifndef MLARUN_NO_CHAT_TEMPLATE
// A random answer of words with `<think>` and `</think>` (and pieces of
// them) at random places; scripted as the groups' tokens it reaches the
// parser in token-sized deltas, markers cut across them.
std::string RandomReasoningAnswer(std::mt19937_64& rng, bool open_tag) {
  static const std::vector<std::string> words = {"why", " so", " 2 < 3", "\n", " </thi", "nk", " é", "> ", " <"};
  std::string s = open_tag ? "<think>\n" : "";
  for (int i = 0; i < 12; ++i) s += words[rng() % words.size()];
  s += "</think>\n\n";
  for (int i = 0; i < 8; ++i) s += words[rng() % words.size()];
  return s + (rng() % 2 ? "<think>x</think>" : "");
}

std::vector<int64_t> Script(const std::string& text) {
  std::vector<int64_t> ids;
  for (int32_t id : Tok().Encode(text, /*add_special_tokens=*/false)) ids.push_back(id);
  return ids;
}

// A chat stream's parts of choice 0: content and reasoning_content.
std::pair<std::string, std::string> StreamedParts(const std::vector<std::string>& events, std::string* finish) {
  std::string content, reasoning;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    EXPECT_FALSE(chunk.contains("error")) << events[i];
    for (const json& c : chunk["choices"]) {
      if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
      if (c["delta"].contains("reasoning_content")) reasoning += c["delta"]["reasoning_content"].get<std::string>();
      if (!c["finish_reason"].is_null()) *finish = c["finish_reason"];
    }
  }
  return {content, reasoning};
}

TEST(HttpApiReasoning, TheTextUpToThinkEndIsReasoningContent) {
  std::mt19937_64 rng(std::random_device{}());
  for (bool open_tag : {true, false}) {
    const std::string answer = RandomReasoningAnswer(rng, open_tag);
    const std::vector<int64_t> script = Script(answer);
    const std::string text = Decode(std::vector<int32_t>(script.begin(), script.end()));
    ASSERT_EQ(text, answer);
    // The split, independently: up to the first </think>, less a <think>.
    const size_t end = text.find("</think>");
    std::string reasoning = text.substr(0, end);
    if (open_tag) reasoning.erase(0, 7);
    const std::string content = text.substr(end + 8);
    CoordinatorOptions o;
    o.http_reasoning_parser = "deepseek_r1";
    Deployment d(o, /*groups=*/1, /*tokens_per_s=*/0, script);
    const json body = {{"messages", json::array({{{"role", "user"}, {"content", "think first"}}})},
                       {"max_tokens", 1000}};
    auto [status, whole] = d.Post("/v1/chat/completions", body);
    ASSERT_EQ(status, 200) << whole.dump();
    const json& message = whole["choices"][0]["message"];
    EXPECT_EQ(message["reasoning_content"], reasoning) << answer;
    EXPECT_EQ(message["content"], content) << answer;
    EXPECT_EQ(whole["choices"][0]["finish_reason"], "stop");
    auto [sstatus, events] = d.Stream("/v1/chat/completions", body);
    ASSERT_EQ(sstatus, 200);
    std::string finish;
    auto [scontent, sreasoning] = StreamedParts(events, &finish);
    EXPECT_EQ(sreasoning, reasoning) << answer;
    EXPECT_EQ(scontent, content) << answer;
    EXPECT_EQ(finish, "stop");
  }
  // Without the flag, all of it is content.
  const std::string answer = RandomReasoningAnswer(rng, true);
  Deployment d(CoordinatorOptions{}, /*groups=*/1, /*tokens_per_s=*/0, Script(answer));
  auto [status, whole] =
      d.Post("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}});
  ASSERT_EQ(status, 200) << whole.dump();
  EXPECT_EQ(whole["choices"][0]["message"]["content"], answer);
  EXPECT_FALSE(whole["choices"][0]["message"].contains("reasoning_content"));
}

// A tool-calling answer as DeepSeek-V3 writes one: content, two calls with
// random arguments (JSON with fences, newlines and `<` in strings); the EOS
// token in the middle of the content stays hidden, as before.
TEST(HttpApiToolCalls, CallsAreToolCallsWholeAndStreamed) {
  std::mt19937_64 rng(std::random_device{}());
  auto args = [&] {
    return json{{"city", std::string("P<a\n```") + std::to_string(rng() % 1000)}, {"days", rng() % 10}}.dump();
  };
  const std::vector<std::pair<std::string, std::string>> calls = {{"get_weather", args()}, {"get_time", args()}};
  const std::string content = "Let me look. ";
  std::string answer = "<｜tool▁calls▁begin｜>";
  for (size_t i = 0; i < calls.size(); ++i) {
    answer += (i > 0 ? "\n" : "") + std::string("<｜tool▁call▁begin｜>function<｜tool▁sep｜>") + calls[i].first +
              "\n```json\n" + calls[i].second + "\n```<｜tool▁call▁end｜>";
  }
  answer += "<｜tool▁calls▁end｜>";
  std::vector<int64_t> script = Script(content);
  script.insert(script.begin() + 2, *Tok().eos_id());  // a special token: not shown
  for (int64_t id : Script(answer)) script.push_back(id);
  CoordinatorOptions o;
  o.http_tool_call_parser = "deepseek_v3";
  o.http_enable_auto_tool_choice = true;
  Deployment d(o, /*groups=*/1, /*tokens_per_s=*/0, script);
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
                                     {"type": "function", "function": {"name": "get_time"}}])");
  const json body = {{"messages", json::array({{{"role", "user"}, {"content", "Weather in Paris?"}}})},
                     {"tools", tools},
                     {"max_tokens", 1000}};
  auto [status, whole] = d.Post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  const json& message = whole["choices"][0]["message"];
  EXPECT_EQ(message["content"], content);
  ASSERT_EQ(message["tool_calls"].size(), calls.size()) << whole.dump();
  std::set<std::string> ids;
  for (size_t i = 0; i < calls.size(); ++i) {
    const json& c = message["tool_calls"][i];
    EXPECT_EQ(c["type"], "function");
    EXPECT_EQ(c["function"]["name"], calls[i].first);
    EXPECT_EQ(c["function"]["arguments"], calls[i].second);
    ids.insert(c["id"].get<std::string>());
  }
  EXPECT_EQ(ids.size(), calls.size());
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "tool_calls");

  auto [sstatus, events] = d.Stream("/v1/chat/completions", body);
  ASSERT_EQ(sstatus, 200);
  std::string scontent, finish;
  std::vector<json> scalls;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    for (const json& c : chunk["choices"]) {
      if (c["delta"].contains("content")) scontent += c["delta"]["content"].get<std::string>();
      for (const json& t : c["delta"].value("tool_calls", json::array())) {
        const size_t index = t["index"].get<size_t>();
        if (t.contains("id")) {
          ASSERT_EQ(index, scalls.size()) << "a call's first delta names it, in order";
          scalls.push_back({{"name", t["function"]["name"]}, {"arguments", ""}});
        }
        ASSERT_LT(index, scalls.size()) << events[i];
        scalls[index]["arguments"] =
            scalls[index]["arguments"].get<std::string>() + t["function"]["arguments"].get<std::string>();
      }
      if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    }
  }
  EXPECT_EQ(scontent, content);
  ASSERT_EQ(scalls.size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(scalls[i]["name"], calls[i].first);
    EXPECT_EQ(scalls[i]["arguments"], calls[i].second);
  }
  EXPECT_EQ(finish, "tool_calls");

  // tool_choice "none": the tools reach the template, the answer is text.
  json none = body;
  none["tool_choice"] = "none";
  auto [nstatus, nwhole] = d.Post("/v1/chat/completions", none);
  ASSERT_EQ(nstatus, 200) << nwhole.dump();
  EXPECT_EQ(nwhole["choices"][0]["message"]["content"], content + answer);
  EXPECT_FALSE(nwhole["choices"][0]["message"].contains("tool_calls"));
}

TEST(HttpApiToolCalls, ToolChoiceRefusalsNameTheField) {
  const json messages = json::array({{{"role", "user"}, {"content", "x"}}});
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  auto refused = [](const Deployment& d, const json& body, const std::string& param) {
    auto [status, e] = d.Post("/v1/chat/completions", body);
    EXPECT_EQ(status, 400) << body.dump() << " -> " << e.dump();
    EXPECT_EQ(e["error"]["param"], param) << e.dump();
  };
  CoordinatorOptions o;
  o.http_tool_call_parser = "deepseek_v3";
  o.http_enable_auto_tool_choice = true;
  Deployment d(o, /*groups=*/1);
  refused(d, {{"messages", messages}, {"tool_choice", "required"}}, "tool_choice");
  refused(d,
          {{"messages", messages},
           {"tools", tools},
           {"tool_choice", {{"type", "function"}, {"function", {{"name", "g"}}}}}},
          "tool_choice");
  refused(d, {{"messages", messages}, {"tools", tools}, {"tool_choice", {{"type", "function"}}}},
          "tool_choice.function.name");
  refused(d, {{"messages", messages}, {"tools", tools}, {"tool_choice", "sometimes"}}, "tool_choice");
  refused(d, {{"messages", messages}, {"tool_choice", "auto"}}, "tool_choice");
  refused(d, {{"messages", messages}, {"tools", "f"}}, "tools");
  refused(d, {{"messages", messages}, {"tools", json::array({{{"type", "function"}}})}}, "tools[0].function.name");
  // Without the server's flags, "auto" (the default with tools) is refused.
  Deployment plain(CoordinatorOptions{}, /*groups=*/1);
  refused(plain, {{"messages", messages}, {"tools", tools}}, "tool_choice");
  auto [status, ok] = plain.Post(
      "/v1/chat/completions", {{"messages", messages}, {"tools", tools}, {"tool_choice", "none"}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << ok.dump();
}

// ---- Structured output and forced tool calls ----------------------------------

// What reached the groups: every routed request's constraint (the groups'
// SimWorkerOptions::check), and a group that cannot compile a grammar or a
// regex holding `bad` (in the engine's words, and prefixed with the field).
struct SeenConstraints {
  std::mutex mu;
  std::vector<StructuredOutput> seen;
  std::function<Status(const SamplingParams&)> Check() {
    return [this](const SamplingParams& s) {
      std::lock_guard lock(mu);
      seen.push_back(s.structured);
      if (s.structured.spec.find("bad") == std::string::npos) return Status::Ok();
      if (s.structured.kind == StructuredOutput::Kind::kGrammar)
        return InvalidArgumentError("structured output: the grammar does not compile: unknown rule 'bad'");
      return InvalidArgumentError("sampling.structured: the regex does not compile: unknown rule 'bad'");
    };
  }
  StructuredOutput Last() {
    std::lock_guard lock(mu);
    return seen.empty() ? StructuredOutput{.spec = "nothing reached the groups"} : seen.back();
  }
};

std::string RandomWord(std::mt19937_64& rng) {
  static const char* kParts[] = {"a", "zo", "q\"", "[x]", "{y}", "é", "\\\\", "7", " "};
  std::string w = "w";
  for (int i = 0, n = 1 + static_cast<int>(rng() % 5); i < n; ++i) w += kParts[rng() % std::size(kParts)];
  return w;
}

// A random JSON schema: an object of a few typed properties.
json RandomSchema(std::mt19937_64& rng) {
  json props = json::object();
  for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n; ++i)
    props[RandomWord(rng)] = {{"type", rng() % 2 ? "string" : "boolean"}};
  return {{"type", "object"}, {"properties", props}, {"additionalProperties", false}};
}

TEST(HttpApiStructured, EachFieldFormReachesTheGroupsAsItsConstraint) {
  using Kind = StructuredOutput::Kind;
  std::mt19937_64 rng(std::random_device{}());
  SeenConstraints seen;
  Deployment d(CoordinatorOptions{}, /*groups=*/1, /*tokens_per_s=*/0, {}, seen.Check());
  const json schema = RandomSchema(rng);
  const std::string regex = "[a-z]{" + std::to_string(1 + rng() % 9) + "}" + RandomWord(rng);
  const std::vector<std::string> choices = {RandomWord(rng), RandomWord(rng), RandomWord(rng)};
  const std::string grammar = "root ::= \"" + std::to_string(rng()) + "\"";
  const StructuredOutput as_schema{.kind = Kind::kJsonSchema, .spec = schema.dump()};
  const StructuredOutput as_regex{.kind = Kind::kRegex, .spec = regex};
  const StructuredOutput as_choice{.kind = Kind::kChoice, .choices = choices};
  const StructuredOutput as_grammar{.kind = Kind::kGrammar, .spec = grammar};
  const StructuredOutput any_object{.kind = Kind::kJsonObject};
  StructuredOutput tight = as_schema;
  tight.any_whitespace = false;
  const std::vector<std::pair<json, StructuredOutput>> cases = {
      {{{"response_format", {{"type", "text"}}}}, {}},
      {{{"response_format", {{"type", "json_object"}}}}, any_object},
      {{{"response_format",
         {{"type", "json_schema"}, {"json_schema", {{"name", "n"}, {"schema", schema}, {"strict", true}}}}}},
       as_schema},
      {{{"guided_json", schema}}, as_schema},
      {{{"guided_json", schema.dump()}}, as_schema},
      {{{"guided_regex", regex}}, as_regex},
      {{{"guided_choice", choices}}, as_choice},
      {{{"guided_grammar", grammar}}, as_grammar},
      {{{"structured_outputs", {{"json", schema}}}}, as_schema},
      {{{"structured_outputs", {{"json", schema}, {"disable_any_whitespace", true}}}}, tight},
      {{{"structured_outputs", {{"regex", regex}, {"backend", "xgrammar"}}}}, as_regex},
      {{{"structured_outputs", {{"choice", choices}}}}, as_choice},
      {{{"structured_outputs", {{"grammar", grammar}}}}, as_grammar},
      {{{"structured_outputs", {{"json_object", true}}}}, any_object},
  };
  for (const bool chat : {false, true}) {
    for (const auto& [fields, expected] : cases) {
      json body =
          chat ? json{{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}} : json{{"prompt", "x"}};
      body["max_tokens"] = 3;
      body.update(fields);
      auto [status, answer] = d.Post(chat ? "/v1/chat/completions" : "/v1/completions", body);
      ASSERT_EQ(status, 200) << body.dump() << " -> " << answer.dump();
      const StructuredOutput got = seen.Last();
      EXPECT_EQ(got.kind, expected.kind) << body.dump();
      EXPECT_EQ(got.any_whitespace, expected.any_whitespace) << body.dump();
      EXPECT_EQ(got.choices, expected.choices) << body.dump();
      // A schema as JSON (its text is this server's serialization).
      if (expected.kind == Kind::kJsonSchema) {
        EXPECT_EQ(json::parse(got.spec), json::parse(expected.spec)) << body.dump();
      } else {
        EXPECT_EQ(got.spec, expected.spec) << body.dump();
      }
    }
  }
}

// With a reasoning parser a constrained chat answer still reasons (as in
// vLLM): the constraint reaching the groups holds after `</think>`'s ids,
// and the answer splits into reasoning_content and content as usual, whole
// and streamed; a named tool call's arguments come from the content. A
// completion, or a server without the parser, keeps start_after empty.
TEST(HttpApiStructured, WithAReasoningParserTheGrammarHoldsAfterThinkEnd) {
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<int32_t> marker = Tok().Encode("</think>", false);
  ASSERT_FALSE(marker.empty());
  ASSERT_EQ(Tok().Decode(marker, false), "</think>");
  const std::vector<int64_t> want(marker.begin(), marker.end());
  const std::string reasoning = "why" + RandomWord(rng) + " so";
  const std::string content = "{\"k\": " + std::to_string(rng() % 1000) + "}";
  SeenConstraints seen;
  CoordinatorOptions o;
  o.http_reasoning_parser = "deepseek_r1";
  Deployment d(o, /*groups=*/1, /*tokens_per_s=*/0, Script("<think>" + reasoning + "</think>" + content), seen.Check());
  const json chat = {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}, {"max_tokens", 1000}};
  for (const json& fields : {json{{"response_format", {{"type", "json_object"}}}}, json{{"guided_regex", ".*"}}}) {
    json body = chat;
    body.update(fields);
    auto [status, whole] = d.Post("/v1/chat/completions", body);
    ASSERT_EQ(status, 200) << whole.dump();
    EXPECT_EQ(seen.Last().start_after, want) << body.dump();
    EXPECT_EQ(whole["choices"][0]["message"]["reasoning_content"], reasoning) << body.dump();
    EXPECT_EQ(whole["choices"][0]["message"]["content"], content) << body.dump();
    auto [sstatus, events] = d.Stream("/v1/chat/completions", body);
    ASSERT_EQ(sstatus, 200);
    EXPECT_EQ(seen.Last().start_after, want);
    std::string finish;
    auto [scontent, sreasoning] = StreamedParts(events, &finish);
    EXPECT_EQ(sreasoning, reasoning);
    EXPECT_EQ(scontent, content);
  }
  // tool_choice naming a function: its constraint too, arguments after the reasoning.
  json named = chat;
  named["tools"] = {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", {{"type", "object"}}}}}}};
  named["tool_choice"] = {{"type", "function"}, {"function", {{"name", "f"}}}};
  auto [tstatus, called] = d.Post("/v1/chat/completions", named);
  ASSERT_EQ(tstatus, 200) << called.dump();
  EXPECT_EQ(seen.Last().start_after, want);
  EXPECT_EQ(called["choices"][0]["message"]["reasoning_content"], reasoning);
  EXPECT_EQ(called["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], content) << called.dump();
  // A completion has no reasoning part.
  EXPECT_EQ(d.Post("/v1/completions", {{"prompt", "x"}, {"guided_regex", ".*"}}).first, 200);
  EXPECT_TRUE(seen.Last().start_after.empty());
  // Without the parser the grammar holds from the first token.
  SeenConstraints plain;
  Deployment without(CoordinatorOptions{}, /*groups=*/1, /*tokens_per_s=*/0, Script(content), plain.Check());
  json body = chat;
  body["guided_regex"] = ".*";
  ASSERT_EQ(without.Post("/v1/chat/completions", body).first, 200);
  EXPECT_EQ(plain.Last().kind, StructuredOutput::Kind::kRegex);
  EXPECT_TRUE(plain.Last().start_after.empty());
}

TEST(HttpApiStructured, BadConstraintsAre400sNamingTheField) {
  Deployment d(CoordinatorOptions{}, /*groups=*/1);
  const json schema = {{"type", "object"}};
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  const json named = {{"type", "function"}, {"function", {{"name", "f"}}}};
  // fields, param, words of the message
  const std::vector<std::tuple<json, std::string, std::string>> cases = {
      {{{"response_format", "json"}}, "response_format", "must be an object"},
      {{{"response_format", {{"type", "yaml"}}}}, "response_format.type", "json_schema"},
      {{{"response_format", {{"type", "json_schema"}}}}, "response_format.json_schema", "required"},
      {{{"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "n"}}}}}},
       "response_format.json_schema.schema",
       "required"},
      {{{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", "x"}}}}}},
       "response_format.json_schema.schema",
       "must be an object"},
      {{{"guided_json", 5}}, "guided_json", "JSON schema"},
      {{{"guided_json", "{not json"}}, "guided_json", "not the text of a JSON schema"},
      {{{"guided_regex", ""}}, "guided_regex", "must not be empty"},
      {{{"guided_choice", json::array()}}, "guided_choice", "non-empty array of strings"},
      {{{"guided_choice", {1, 2}}}, "guided_choice", "non-empty array of strings"},
      {{{"guided_grammar", 3}}, "guided_grammar", "must be a string"},
      {{{"guided_json", schema}, {"guided_whitespace_pattern", " *"}},
       "guided_whitespace_pattern",
       "disable_any_whitespace"},
      {{{"structured_outputs", "x"}}, "structured_outputs", "must be an object"},
      {{{"structured_outputs", {{"structural_tag", "x"}}}}, "structured_outputs.structural_tag", "not supported"},
      {{{"structured_outputs", {{"json_object", 1}}}}, "structured_outputs.json_object", "boolean"},
      {{{"guided_regex", "a"}, {"guided_choice", {"a"}}}, "guided_choice", "both guided_regex and guided_choice"},
      {{{"response_format", {{"type", "json_object"}}}, {"structured_outputs", {{"regex", "a"}}}},
       "structured_outputs.regex",
       "both response_format and structured_outputs.regex"},
      // (this json's keys are sorted)
      {{{"structured_outputs", {{"regex", "a"}, {"grammar", "g"}}}},
       "structured_outputs.regex",
       "both structured_outputs.grammar and structured_outputs.regex"},
      {{{"tools", tools}, {"tool_choice", named}, {"guided_json", schema}},
       "tool_choice",
       "both tool_choice and guided_json"},
      {{{"tools", tools}, {"tool_choice", "required"}, {"response_format", {{"type", "json_object"}}}},
       "tool_choice",
       "both tool_choice and response_format"},
  };
  for (const bool chat : {false, true}) {
    for (const auto& [fields, param, words] : cases) {
      if (!chat && fields.contains("tools")) continue;
      json body =
          chat ? json{{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}} : json{{"prompt", "x"}};
      body.update(fields);
      auto [status, e] = d.Post(chat ? "/v1/chat/completions" : "/v1/completions", body);
      EXPECT_EQ(status, 400) << body.dump() << " -> " << e.dump();
      EXPECT_EQ(e["error"]["param"], param) << e.dump();
      EXPECT_EQ(e["error"]["type"], "invalid_request_error") << e.dump();
      EXPECT_NE(e["error"]["message"].get<std::string>().find(words), std::string::npos) << e.dump();
    }
  }
}

// A grammar the groups cannot compile (INVALID_ARGUMENT from the worker):
// 400 naming the request's field and the reason, whole and streamed, on both
// endpoints; the deployment serves on.
TEST(HttpApiStructured, AGrammarTheGroupsRefuseIs400) {
  SeenConstraints seen;
  Deployment d(CoordinatorOptions{}, /*groups=*/1, /*tokens_per_s=*/0, {}, seen.Check());
  for (const bool chat : {false, true}) {
    const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
    for (const json& fields :
         {json{{"guided_grammar", "root ::= bad"}}, json{{"structured_outputs", {{"grammar", "root ::= bad"}}}},
          json{{"guided_regex", "(bad"}}}) {
      json body =
          chat ? json{{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}} : json{{"prompt", "x"}};
      body.update(fields);
      const std::string field =
          fields.begin().key() == "structured_outputs" ? "structured_outputs.grammar" : fields.begin().key();
      auto [status, e] = d.Post(path, body);
      ASSERT_EQ(status, 400) << e.dump();
      EXPECT_EQ(e["error"]["param"], field) << e.dump();
      EXPECT_NE(e["error"]["message"].get<std::string>().find("unknown rule 'bad'"), std::string::npos) << e.dump();
      body["n"] = 2;
      auto [sstatus, events] = d.Stream(path, body);
      ASSERT_EQ(sstatus, 400);
      ASSERT_EQ(events.size(), 1u);
      const json se = json::parse(events[0]);
      EXPECT_EQ(se["error"]["param"], field) << events[0];
      EXPECT_NE(se["error"]["message"].get<std::string>().find("unknown rule 'bad'"), std::string::npos);
    }
    json good = chat ? json{{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}} : json{{"prompt", "x"}};
    good["guided_grammar"] = "root ::= \"ok\"";
    good["max_tokens"] = 2;
    EXPECT_EQ(d.Post(path, good).first, 200);
  }
}

// A named function: the answer is constrained to its parameters' schema and
// comes back as one call, its arguments the text (whole; streamed in
// pieces), finish_reason tool_calls.
TEST(HttpApiStructured, ANamedFunctionIsOneToolCall) {
  std::mt19937_64 rng(std::random_device{}());
  const json params = RandomSchema(rng);
  json args = json::object();
  for (const auto& [key, type] : params["properties"].items())
    args[key] = type["type"] == "string" ? json(RandomWord(rng)) : json(rng() % 2 == 0);
  const std::string arguments = args.dump();
  SeenConstraints seen;
  Deployment d(CoordinatorOptions{}, /*groups=*/1, /*tokens_per_s=*/500, Script(arguments), seen.Check());
  const json tools = {{{"type", "function"}, {"function", {{"name", "other"}, {"parameters", RandomSchema(rng)}}}},
                      {{"type", "function"}, {"function", {{"name", "lookup"}, {"parameters", params}}}}};
  const json body = {{"messages", json::array({{{"role", "user"}, {"content", "Look it up"}}})},
                     {"tools", tools},
                     {"tool_choice", {{"type", "function"}, {"function", {{"name", "lookup"}}}}},
                     {"max_tokens", 1000}};
  auto [status, whole] = d.Post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  const StructuredOutput got = seen.Last();
  EXPECT_EQ(got.kind, StructuredOutput::Kind::kJsonSchema);
  EXPECT_EQ(json::parse(got.spec), params);
  EXPECT_TRUE(got.any_whitespace);
  json tight = body;
  tight["structured_outputs"] = {{"disable_any_whitespace", true}};
  EXPECT_EQ(d.Post("/v1/chat/completions", tight).first, 200);
  EXPECT_FALSE(seen.Last().any_whitespace) << "disable_any_whitespace holds for tool_choice's constraint too";
  EXPECT_EQ(json::parse(seen.Last().spec), params);
  const json& message = whole["choices"][0]["message"];
  EXPECT_TRUE(message["content"].is_null()) << whole.dump();
  ASSERT_EQ(message["tool_calls"].size(), 1u) << whole.dump();
  EXPECT_EQ(message["tool_calls"][0]["type"], "function");
  EXPECT_TRUE(message["tool_calls"][0]["id"].is_string());
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "lookup");
  EXPECT_EQ(message["tool_calls"][0]["function"]["arguments"], arguments);
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "tool_calls");

  auto [sstatus, events] = d.Stream("/v1/chat/completions", body);
  ASSERT_EQ(sstatus, 200);
  std::string streamed, finish, content;
  int pieces = 0, named = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    for (const json& c : chunk["choices"]) {
      if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
      for (const json& t : c["delta"].value("tool_calls", json::array())) {
        EXPECT_EQ(t["index"], 0);
        if (t.contains("id")) {
          ++named;
          EXPECT_EQ(t["function"]["name"], "lookup");
        }
        streamed += t["function"]["arguments"].get<std::string>();
        ++pieces;
      }
      if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    }
  }
  EXPECT_EQ(streamed, arguments);
  EXPECT_EQ(named, 1);
  EXPECT_GT(pieces, 1) << "the arguments come as deltas";
  EXPECT_EQ(content, "");
  EXPECT_EQ(finish, "tool_calls");
}

// "required": an array of {"name", "parameters"} (anyOf over the tools),
// each element one call, its arguments the parameters as JSON text.
TEST(HttpApiStructured, RequiredToolCallsAreTheArraysElements) {
  std::mt19937_64 rng(std::random_device{}());
  const json tools = {
      {{"type", "function"}, {"function", {{"name", "get_weather"}, {"parameters", RandomSchema(rng)}}}},
      {{"type", "function"}, {"function", {{"name", "get_time"}}}}};
  json calls = json::array();
  for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n; ++i) {
    const bool weather = rng() % 2 == 0;
    json args = json::object();
    if (weather) {
      for (const auto& [key, type] : tools[0]["function"]["parameters"]["properties"].items())
        args[key] = type["type"] == "string" ? json(RandomWord(rng) + "}]") : json(rng() % 2 == 0);
    }
    calls.push_back({{"name", weather ? "get_weather" : "get_time"}, {"parameters", args}});
  }
  SeenConstraints seen;
  Deployment d(CoordinatorOptions{}, /*groups=*/1, /*tokens_per_s=*/0, Script(calls.dump(1)), seen.Check());
  const json body = {{"messages", json::array({{{"role", "user"}, {"content", "Now?"}}})},
                     {"tools", tools},
                     {"tool_choice", "required"},
                     {"max_tokens", 1000}};
  auto [status, whole] = d.Post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << whole.dump();
  // vLLM's schema, spelled out.
  json any_of = json::array();
  for (const json& t : tools) {
    const json p = t["function"].value(
        "parameters", json{{"type", "object"}, {"properties", json::object()}, {"additionalProperties", false}});
    any_of.push_back(
        {{"properties", {{"name", {{"type", "string"}, {"enum", {t["function"]["name"]}}}}, {"parameters", p}}},
         {"required", {"name", "parameters"}}});
  }
  const json expected = {{"type", "array"}, {"minItems", 1}, {"items", {{"type", "object"}, {"anyOf", any_of}}}};
  EXPECT_EQ(json::parse(seen.Last().spec), expected);
  const json& got = whole["choices"][0]["message"]["tool_calls"];
  ASSERT_EQ(got.size(), calls.size()) << whole.dump();
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(got[i]["function"]["name"], calls[i]["name"]);
    EXPECT_EQ(json::parse(got[i]["function"]["arguments"].get<std::string>()), calls[i]["parameters"]);
  }
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "tool_calls");

  auto [sstatus, events] = d.Stream("/v1/chat/completions", body);
  ASSERT_EQ(sstatus, 200);
  json streamed = json::array();
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    for (const json& c : chunk["choices"]) {
      for (const json& t : c["delta"].value("tool_calls", json::array())) {
        ASSERT_EQ(t["index"], streamed.size()) << "each call once, whole, in order";
        streamed.push_back({{"name", t["function"]["name"]},
                            {"parameters", json::parse(t["function"]["arguments"].get<std::string>())}});
      }
    }
  }
  EXPECT_EQ(streamed, calls);
}
#endif

TEST(HttpBench, ASmallRunIsVerified) {
  std::ostringstream table;
  bool verified = false;
  auto doc = RunHttpBench(
      HttpBenchOptions{
          .clients = 4, .requests = 16, .max_tokens = 4, .groups = 2, .tokens_per_s = 0, .overhead_requests = 8},
      table, &verified);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  EXPECT_TRUE(verified) << table.str();
  ASSERT_EQ((*doc)["load"].size(), 2u);
  EXPECT_EQ((*doc)["load"][1]["api"], "HTTP");
  EXPECT_EQ((*doc)["load"][1]["failed"], 0);
  EXPECT_NE(table.str().find("HTTP streamed"), std::string::npos) << table.str();
}

}  // namespace
}  // namespace mlarun
