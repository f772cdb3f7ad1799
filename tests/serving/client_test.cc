// serving/client: the deployment file, `submit` and `stats` against a fake
// Mlarun service; serving/sim: the simulated worker against a fake
// coordinator (serving/link's LinkEndpoint). Everything listens on 127.0.0.1
// port 0 and every wait has a deadline, so a broken client fails a test
// instead of hanging it.
#include "serving/client/client.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "base/cpu_isa.h"
#include "mlarun.grpc.pb.h"
#include "runtime/request/request.h"
#include "serving/link/link_server.h"
#include "serving/proto/proto_sampling.h"
#include "serving/sim/sim_worker.h"
#include "tests/serving/sim_worker_thread.h"
#include "tests/test_paths.h"

// The connect() that gRPC's client calls (this definition takes the place of
// libc's for the whole test binary): it fails the next `g_failing_connects`
// attempts to port `g_failing_port` (IPv4, or IPv6 as gRPC's dual-stack
// sockets dial IPv4) the way gRPC 1.51 can report one that is only in
// progress, with a stale errno.
std::atomic<int> g_failing_connects{0};
std::atomic<int> g_failing_port{0};

extern "C" int connect(int fd, const struct sockaddr* addr, socklen_t len) {
  int port = -1;
  if (addr != nullptr && addr->sa_family == AF_INET) port = ntohs(reinterpret_cast<const sockaddr_in*>(addr)->sin_port);
  if (addr != nullptr && addr->sa_family == AF_INET6)
    port = ntohs(reinterpret_cast<const sockaddr_in6*>(addr)->sin6_port);
  if (port == g_failing_port.load() && g_failing_connects.load() > 0 && g_failing_connects.fetch_sub(1) > 0) {
    errno = ENOENT;
    return -1;
  }
  return static_cast<int>(syscall(SYS_connect, fd, addr, len));
}

namespace mlarun {
namespace {

namespace v1 = ::mlarun::v1;
using Json = nlohmann::json;
using namespace std::chrono_literals;

// ============================================================================
// Deployment files
// ============================================================================

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/client_test_" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(DeploymentConfig, ParsesEveryKey) {
  const std::string path = WriteTemp("good.yaml",
                                     "# comment\n"
                                     "model: configs/models/tiny.yaml\n"
                                     "parallel: dp=4,attn_tp=1\n"
                                     "coordinator: 127.0.0.1:50051\n"
                                     "listen: 0.0.0.0:50051\n"
                                     "policy: prefix_affinity\n"
                                     "cache_bytes: 1073741824\n"
                                     "kv_dtype: bf16\n"
                                     "max_batched_tokens: 512\n");
  auto c = LoadDeploymentConfig(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model, "configs/models/tiny.yaml");
  EXPECT_EQ(c->parallel, "dp=4,attn_tp=1");
  EXPECT_EQ(c->coordinator, "127.0.0.1:50051");
  EXPECT_EQ(c->listen, "0.0.0.0:50051");
  EXPECT_EQ(c->policy, "prefix_affinity");
  EXPECT_EQ(c->cache_bytes, int64_t{1} << 30);
  EXPECT_EQ(c->kv_dtype, "bf16");
  EXPECT_EQ(c->max_batched_tokens, 512);
}

TEST(DeploymentConfig, MemoryGibSizesTheCacheInsteadOfBytes) {
  auto c = LoadDeploymentConfig(WriteTemp("memory.yaml", "memory_gib: 0.25\n"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->memory_gib, 0.25);
  EXPECT_EQ(c->cache_bytes, 0);
  auto both = LoadDeploymentConfig(WriteTemp("both.yaml", "memory_gib: 1\ncache_bytes: 1024\n"));
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("not both"), std::string::npos) << both.status();
}

TEST(DeploymentConfig, EmptyFileSetsNothing) {
  auto c = LoadDeploymentConfig(WriteTemp("empty.yaml", "# nothing here\n"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model, "");
  EXPECT_EQ(c->cache_bytes, 0);
}

TEST(DeploymentConfig, ShippedExamplesParse) {
  for (const char* name : {"local-dp4.yaml", "local-tp4.yaml"}) {
    auto c = LoadDeploymentConfig(ConfigPath("deploy/") + name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_EQ(c->model, "configs/models/tiny.yaml") << name;
    EXPECT_EQ(c->coordinator, "127.0.0.1:50051") << name;
    EXPECT_EQ(c->listen, "127.0.0.1:50051") << name;
    EXPECT_EQ(c->policy, "prefix_affinity") << name;
  }
  EXPECT_EQ(LoadDeploymentConfig(ConfigPath("deploy/local-dp4.yaml"))->parallel, "dp=4");
  EXPECT_EQ(LoadDeploymentConfig(ConfigPath("deploy/local-tp4.yaml"))->parallel, "attn_tp=4");
}

void ExpectInvalid(const std::string& name, const std::string& text, const std::string& key) {
  const std::string path = WriteTemp(name, text);
  auto c = LoadDeploymentConfig(path);
  ASSERT_FALSE(c.ok()) << name;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find(path), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("'" + key + "'"), std::string::npos) << c.status();
}

TEST(DeploymentConfig, UnknownKeyNamesFileAndKey) { ExpectInvalid("unknown.yaml", "model: x\nmodle: y\n", "modle"); }

TEST(DeploymentConfig, WrongTypesNameFileAndKey) {
  ExpectInvalid("wrong_int.yaml", "cache_bytes: lots\n", "cache_bytes");
  ExpectInvalid("wrong_float.yaml", "max_batched_tokens: 1.5\n", "max_batched_tokens");
  ExpectInvalid("negative.yaml", "cache_bytes: -5\n", "cache_bytes");
  ExpectInvalid("memory_word.yaml", "memory_gib: much\n", "memory_gib");
  ExpectInvalid("memory_zero.yaml", "memory_gib: 0\n", "memory_gib");
  ExpectInvalid("list.yaml", "model: [a, b]\n", "model");
  ExpectInvalid("map.yaml", "policy: {a: 1}\n", "policy");
  ExpectInvalid("null.yaml", "listen:\n", "listen");
  ExpectInvalid("twice.yaml", "model: a\nmodel: b\n", "model");
}

TEST(DeploymentConfig, SyntaxErrorsAndNonMappings) {
  for (const auto& [name, text] : std::vector<std::pair<std::string, std::string>>{
           {"syntax.yaml", "model: [unclosed\n"}, {"list_root.yaml", "- a\n- b\n"}, {"scalar_root.yaml", "hello\n"}}) {
    const std::string path = WriteTemp(name, text);
    auto c = LoadDeploymentConfig(path);
    ASSERT_FALSE(c.ok()) << name;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
    EXPECT_NE(c.status().message().find(path), std::string::npos) << c.status();
  }
}

TEST(DeploymentConfig, MissingFileIsNotFound) {
  auto c = LoadDeploymentConfig(testing::TempDir() + "/no_such_deployment.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("no_such_deployment.yaml"), std::string::npos);
}

// ============================================================================
// A fake Mlarun service for submit and stats
// ============================================================================

class FakeMlarun final : public v1::Mlarun::Service {
 public:
  grpc::Status Generate(grpc::ServerContext*, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_ = *req;
    }
    if (req->prompt_ids_size() == 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids is empty");
    if (req->prompt_ids(0) == 999) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "the queue is full");
    const std::string id = req->request_id().empty() ? "req-1" : req->request_id();
    const int64_t n = req->sampling().has_max_tokens() ? req->sampling().max_tokens() : 16;
    for (int64_t i = 0; i < n; ++i) {
      v1::GenerateResponse r;
      r.set_request_id(id);
      r.mutable_token()->set_token_id(100 + i);
      r.mutable_token()->set_logprob(-0.25 * static_cast<double>(i + 1));
      r.mutable_token()->set_index(i);
      for (int64_t j = 0; j < req->sampling().logprobs(); ++j) {  // token 200 + i + j, -0.125 (j + 1)
        v1::TokenLogprob* t = r.mutable_token()->add_top_logprobs();
        t->set_token_id(200 + i + j);
        t->set_logprob(-0.125 * static_cast<double>(j + 1));
      }
      if (!writer->Write(r)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
    v1::GenerateResponse r;
    r.set_request_id(id);
    v1::Finished* f = r.mutable_finished();
    f->set_finish_reason("length");
    f->set_dp_group(3);
    f->set_prompt_tokens(req->prompt_ids_size());
    f->set_completion_tokens(n);
    f->set_prefix_hit_tokens(64);
    f->mutable_timings()->set_total_ms(12.5);
    writer->Write(r);
    return grpc::Status::OK;
  }

  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*, v1::GetStatsResponse* resp) override {
    v1::RankStats* k = resp->add_ranks();
    k->set_worker_id("w0");
    k->set_rank(1);
    k->set_dp_group(1);
    k->set_host("hostA");
    k->set_attention_weight_bytes(int64_t{3} << 20);
    k->set_cache_bytes_capacity(int64_t{256} << 20);
    k->set_cache_bytes_used(int64_t{1} << 20);
    k->set_requests_running(2);
    k->set_tokens_per_s(123.4);
    k->set_cpu_model_name("Test CPU 9000");
    k->set_cpu_flags("avx2 fma f16c");
    k->set_cpu_isa("avx2");
    v1::GroupStats* g = resp->add_groups();
    g->set_worker_id("w0");
    g->set_dp_group(1);
    g->set_connected(true);
    g->set_requests_routed(7);
    g = resp->add_groups();
    g->set_worker_id("w0");
    g->set_dp_group(2);
    g->set_connected(false);
    g->set_disconnect_reason("its leader left: rank 2 cannot continue");
    resp->mutable_coordinator()->set_policy("prefix_affinity");
    resp->mutable_coordinator()->set_requests_received(9);
    return grpc::Status::OK;
  }

  v1::GenerateRequest last() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_;
  }

 private:
  std::mutex mu_;
  v1::GenerateRequest last_;
};

// A gRPC server on 127.0.0.1 with a kernel-chosen port (or a given one, to
// restart on the same address).
class TestServer {
 public:
  TestServer(grpc::Service* service, int port = 0) {
    auto server = GrpcServer::Start("127.0.0.1:" + std::to_string(port), {service});
    if (server.ok()) server_ = std::move(*server);
  }
  ~TestServer() { Shutdown(); }
  void Shutdown() {
    // A short deadline: open streams are cancelled instead of waited for.
    if (server_) server_->Shutdown(200ms);
    server_.reset();
  }
  bool ok() const { return server_ != nullptr; }
  int port() const { return server_->port(); }
  std::string address() const { return server_->address(); }

 private:
  std::unique_ptr<GrpcServer> server_;
};

std::vector<std::string> Lines(const std::string& s) {
  std::vector<std::string> lines;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

SubmitOptions Submit(const std::string& address) {
  SubmitOptions o;
  o.coordinator = address;
  o.prompt_ids = {5, 6, 7};
  o.sampling.max_tokens = 4;
  o.timeout_s = 10;
  return o;
}

TEST(Submit, JsonLineHasTheGenerateObjectPlusDpGroup) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  SubmitOptions o = Submit(server.address());
  o.json = true;
  o.request_id = "mine";
  o.sampling.seed = 42;
  o.sampling.top_p = 0.5;
  o.sampling.temperature = 0.7;
  o.sampling.top_k = 3;
  o.sampling.stop_token_ids = {9, 11};
  o.sampling.ignore_eos = true;
  std::ostringstream out, err;
  ASSERT_EQ(RunSubmit(o, out, err), 0) << err.str();
  const auto lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 1u) << out.str();
  const Json j = Json::parse(lines[0]);
  EXPECT_EQ(j.size(), 4u) << lines[0];
  EXPECT_EQ(j["tokens"], Json({100, 101, 102, 103}));
  EXPECT_EQ(j["logprobs"], Json({-0.25, -0.5, -0.75, -1.0}));
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_EQ(j["dp_group"], 3);

  // Every field travelled, the optional ones explicitly set.
  const v1::GenerateRequest req = svc.last();
  EXPECT_EQ(req.request_id(), "mine");
  EXPECT_EQ(std::vector<int32_t>(req.prompt_ids().begin(), req.prompt_ids().end()), (std::vector<int32_t>{5, 6, 7}));
  const v1::SamplingParams& s = req.sampling();
  EXPECT_TRUE(s.has_top_p());
  EXPECT_EQ(s.top_p(), 0.5);
  EXPECT_TRUE(s.has_max_tokens());
  EXPECT_EQ(s.max_tokens(), 4);
  EXPECT_EQ(s.seed(), 42u);
  EXPECT_EQ(s.temperature(), 0.7);
  EXPECT_EQ(s.top_k(), 3);
  EXPECT_EQ(std::vector<int64_t>(s.stop_token_ids().begin(), s.stop_token_ids().end()), (std::vector<int64_t>{9, 11}));
  EXPECT_TRUE(s.ignore_eos());
}

// The penalties and biases travel in the sampling message and read back as
// sent; absent from a message, the repetition penalty is 1 (off).
TEST(Submit, PenaltiesAndBiasesTravel) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  SubmitOptions o = Submit(server.address());
  o.sampling.presence_penalty = -1.25;
  o.sampling.frequency_penalty = 0.5;
  o.sampling.repetition_penalty = 1.75;
  o.sampling.logit_bias = {{3, -100.0}, {70, 12.5}};
  o.sampling.min_tokens = 2;
  std::ostringstream out, err;
  ASSERT_EQ(RunSubmit(o, out, err), 0) << err.str();
  const v1::SamplingParams s = svc.last().sampling();
  EXPECT_EQ(s.presence_penalty(), -1.25);
  EXPECT_EQ(s.frequency_penalty(), 0.5);
  EXPECT_TRUE(s.has_repetition_penalty());
  EXPECT_EQ(s.repetition_penalty(), 1.75);
  EXPECT_EQ(s.logit_bias().size(), 2u);
  EXPECT_EQ(s.logit_bias().at(70), 12.5);
  EXPECT_EQ(s.min_tokens(), 2);
  EXPECT_EQ(FromProto(s), o.sampling);
  EXPECT_EQ(FromProto(v1::SamplingParams()).repetition_penalty, 1.0);
}

// Each structured-output kind reads back as written; none stays absent.
TEST(SamplingProto, StructuredOutputRoundTrips) {
  using Kind = StructuredOutput::Kind;
  const StructuredOutput cases[] = {
      {.kind = Kind::kJsonObject, .spec = "", .choices = {}, .any_whitespace = false},
      {.kind = Kind::kJsonSchema, .spec = R"({"type":"integer"})", .choices = {}, .any_whitespace = true},
      {.kind = Kind::kRegex, .spec = "[a-z]{3}", .choices = {}, .any_whitespace = true},
      {.kind = Kind::kChoice, .spec = "", .choices = {"yes", "no", ""}, .any_whitespace = true},
      {.kind = Kind::kGrammar, .spec = "root ::= \"a\"", .choices = {}, .any_whitespace = true},
      {.kind = Kind::kRegex, .spec = "[0-9]+", .choices = {}, .any_whitespace = true, .start_after = {128799}},
      {.kind = Kind::kJsonObject, .spec = "", .choices = {}, .any_whitespace = true, .start_after = {7, 0, 1291}},
  };
  for (const StructuredOutput& c : cases) {
    SamplingParams p;
    p.structured = c;
    v1::SamplingParams wire;
    ToProto(p, &wire);
    EXPECT_TRUE(wire.has_structured());
    EXPECT_EQ(FromProto(wire).structured, c);
  }
  v1::SamplingParams wire;
  ToProto(SamplingParams{}, &wire);
  EXPECT_FALSE(wire.has_structured());
  EXPECT_FALSE(FromProto(wire).structured.active());
}

TEST(SamplingProto, BadWordsRoundTrip) {
  std::mt19937_64 rng(16);
  for (int trial = 0; trial < 20; ++trial) {
    SamplingParams p;
    for (uint64_t i = 0, n = rng() % 6; i < n; ++i) {
      std::vector<int64_t> word;
      for (uint64_t j = 0, len = 1 + rng() % 4; j < len; ++j) word.push_back(static_cast<int64_t>(rng() % 129280));
      p.bad_words.push_back(std::move(word));
    }
    v1::SamplingParams wire;
    wire.add_bad_words()->add_ids(99);  // replaced, not appended to
    ToProto(p, &wire);
    ASSERT_EQ(wire.bad_words_size(), static_cast<int>(p.bad_words.size()));
    EXPECT_EQ(FromProto(wire).bad_words, p.bad_words);
    EXPECT_EQ(FromProto(wire), p);
  }
}

TEST(Submit, JsonLineListsTheMostLikelyTokensWhenAsked) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  SubmitOptions o = Submit(server.address());
  o.json = true;
  o.sampling.max_tokens = 2;
  o.sampling.logprobs = 3;
  o.sampling.prompt_logprobs = 0;
  std::ostringstream out, err;
  ASSERT_EQ(RunSubmit(o, out, err), 0) << err.str();
  EXPECT_EQ(svc.last().sampling().logprobs(), 3);
  EXPECT_TRUE(svc.last().sampling().has_prompt_logprobs());
  EXPECT_EQ(svc.last().sampling().prompt_logprobs(), 0);
  const auto lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 1u) << out.str();
  const Json j = Json::parse(lines[0]);
  EXPECT_EQ(j["tokens"], Json({100, 101}));
  EXPECT_EQ(j["top_logprobs"], Json::parse("[[[200,-0.125],[201,-0.25],[202,-0.375]],"
                                           "[[201,-0.125],[202,-0.25],[203,-0.375]]]"))
      << lines[0];
}

TEST(Submit, DefaultsAreSentExplicitly) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  SubmitOptions o;
  o.coordinator = server.address();
  o.prompt_ids = {1};
  o.timeout_s = 10;
  std::ostringstream out, err;
  ASSERT_EQ(RunSubmit(o, out, err), 0) << err.str();
  const v1::SamplingParams s = svc.last().sampling();
  EXPECT_TRUE(s.has_top_p());
  EXPECT_EQ(s.top_p(), 1.0);
  EXPECT_TRUE(s.has_max_tokens());
  EXPECT_EQ(s.max_tokens(), 16);
  EXPECT_EQ(s.logprobs(), 0);
  EXPECT_FALSE(s.has_prompt_logprobs()) << "absent: off";
  EXPECT_EQ(svc.last().request_id(), "");
}

TEST(Submit, StreamPrintsEachTokenThenTheResult) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  SubmitOptions o = Submit(server.address());
  o.stream = true;
  {
    std::ostringstream out, err;
    ASSERT_EQ(RunSubmit(o, out, err), 0) << err.str();
    const auto lines = Lines(out.str());
    ASSERT_EQ(lines.size(), 5u) << out.str();
    EXPECT_EQ(lines[0], "0 100 -0.25");
    EXPECT_EQ(lines[3], "3 103 -1");
    EXPECT_EQ(lines[4].rfind("tokens: 100 101 102 103  (finish: length", 0), 0u) << lines[4];
    EXPECT_NE(lines[4].find("dp_group 3"), std::string::npos) << lines[4];
  }
  o.json = true;
  std::ostringstream out, err;
  ASSERT_EQ(RunSubmit(o, out, err), 0) << err.str();
  const auto lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 5u) << out.str();
  for (int i = 0; i < 4; ++i) {
    const Json t = Json::parse(lines[static_cast<size_t>(i)]);
    EXPECT_EQ(t["index"], i);
    EXPECT_EQ(t["token"], 100 + i);
    EXPECT_EQ(t["logprob"], -0.25 * (i + 1));
  }
  const Json j = Json::parse(lines[4]);
  EXPECT_EQ(j["tokens"].size(), 4u);
  EXPECT_EQ(j["dp_group"], 3);
}

TEST(Submit, ServerErrorsExitOneWithTheCodeName) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  SubmitOptions o = Submit(server.address());
  o.prompt_ids = {999};
  std::ostringstream out, err;
  EXPECT_EQ(RunSubmit(o, out, err), 1);
  EXPECT_EQ(err.str(), "mlarun submit: RESOURCE_EXHAUSTED: the queue is full\n");
  EXPECT_EQ(out.str(), "");

  // An empty prompt is the server's to reject, not a usage error.
  o.prompt_ids.clear();
  std::ostringstream out2, err2;
  EXPECT_EQ(RunSubmit(o, out2, err2), 1);
  EXPECT_NE(err2.str().find("INVALID_ARGUMENT: prompt_ids is empty"), std::string::npos) << err2.str();
}

TEST(Submit, UnreachableCoordinatorIsUnavailable) {
  int port;
  {
    FakeMlarun svc;
    TestServer server(&svc);
    ASSERT_TRUE(server.ok());
    port = server.port();
  }  // nothing listens there any more
  SubmitOptions o = Submit("127.0.0.1:" + std::to_string(port));
  o.timeout_s = 5;
  std::ostringstream out, err;
  EXPECT_EQ(RunSubmit(o, out, err), 1);
  EXPECT_EQ(err.str().rfind("mlarun submit: UNAVAILABLE: ", 0), 0u) << err.str();
}

// gRPC retries a failed first attempt at once by itself; a fail-fast call
// fails when the second fails too, as a loaded machine showed (500 calls,
// one channel's 31 calls failed this way). Two injected failures reproduce
// that message exactly.
TEST(Submit, ASpuriousConnectFailureIsRetried) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  g_failing_port = server.port();
  for (bool batch : {false, true}) {
    SubmitOptions o = Submit(server.address());
    if (batch) {
      o.prompts_path = WriteTemp("retry_prompts.jsonl", "{\"prompt_ids\": [5, 6], \"max_tokens\": 3}\n");
      o.prompt_ids.clear();
    }
    g_failing_connects = 2;
    std::ostringstream out, err;
    EXPECT_EQ(RunSubmit(o, out, err), 0) << (batch ? "batch: " : "") << err.str() << out.str();
    EXPECT_EQ(g_failing_connects.load(), 0) << "no connect went through the injected failure";
  }
  StatsOptions so;
  so.coordinator = server.address();
  g_failing_connects = 2;
  std::ostringstream out, err;
  EXPECT_EQ(RunStats(so, out, err), 0) << err.str();
  EXPECT_EQ(g_failing_connects.load(), 0) << "no connect went through the injected failure";
  g_failing_connects = 0;
  g_failing_port = 0;
}

TEST(Submit, BadUsageExitsTwo) {
  for (const std::string addr : {"", "localhost", "127.0.0.1:", "127.0.0.1:99999", "::1:5", "host:port"}) {
    SubmitOptions o = Submit(addr);
    std::ostringstream out, err;
    EXPECT_EQ(RunSubmit(o, out, err), 2) << addr;
    EXPECT_NE(err.str().find("--coordinator"), std::string::npos) << err.str();
  }
  SubmitOptions o = Submit("127.0.0.1:1");
  o.prompt_ids = {int64_t{1} << 40};
  std::ostringstream out, err;
  EXPECT_EQ(RunSubmit(o, out, err), 2);
  o = Submit("127.0.0.1:1");
  o.timeout_s = 0;
  EXPECT_EQ(RunSubmit(o, out, err), 2);
}

TEST(Stats, JsonUsesProtoFieldNames) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  StatsOptions o;
  o.coordinator = server.address();
  o.json = true;
  std::ostringstream out, err;
  ASSERT_EQ(RunStats(o, out, err), 0) << err.str();
  const auto lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 1u);
  const Json j = Json::parse(lines[0]);
  ASSERT_EQ(j["ranks"].size(), 1u);
  EXPECT_EQ(j["ranks"][0]["worker_id"], "w0");
  EXPECT_EQ(j["ranks"][0]["tokens_per_s"], 123.4);
  ASSERT_EQ(j["groups"].size(), 2u);
  EXPECT_EQ(j["groups"][1]["connected"], false);  // defaults are printed too
  EXPECT_EQ(j["groups"][1]["disconnect_reason"], "its leader left: rank 2 cannot continue");
  EXPECT_EQ(j["ranks"][0]["cpu_model_name"], "Test CPU 9000");
  EXPECT_EQ(j["ranks"][0]["cpu_flags"], "avx2 fma f16c");
  EXPECT_EQ(j["ranks"][0]["cpu_isa"], "avx2");
  EXPECT_EQ(j["coordinator"]["policy"], "prefix_affinity");
  EXPECT_EQ(j["coordinator"]["requests_received"], "9");  // proto3 JSON: int64 as a string
}

TEST(Stats, TableHasRanksGroupsAndCounters) {
  FakeMlarun svc;
  TestServer server(&svc);
  ASSERT_TRUE(server.ok());
  StatsOptions o;
  o.coordinator = server.address();
  std::ostringstream out, err;
  ASSERT_EQ(RunStats(o, out, err), 0) << err.str();
  const std::string s = out.str();
  for (const char* want : {"worker", "hostA", "256.0", "123.4", "connected", "yes", "no", "policy prefix_affinity",
                           "received 9", "kernels", "Test CPU 9000", "avx2 fma f16c",
                           "group 2 of w0 went away: its leader left: rank 2 cannot continue"})
    EXPECT_NE(s.find(want), std::string::npos) << want << " in\n" << s;
}

TEST(Stats, ErrorsAndUsage) {
  StatsOptions o;
  o.coordinator = "nowhere";
  std::ostringstream out, err;
  EXPECT_EQ(RunStats(o, out, err), 2);
  // A server without the Mlarun service: gRPC's own error comes back.
  v1::WorkerLink::Service empty;
  TestServer server(&empty);
  ASSERT_TRUE(server.ok());
  o.coordinator = server.address();
  o.timeout_s = 5;
  std::ostringstream err2;
  EXPECT_EQ(RunStats(o, out, err2), 1);
  EXPECT_EQ(err2.str().rfind("mlarun stats: UNIMPLEMENTED: ", 0), 0u) << err2.str();
}

// ============================================================================
// A fake coordinator for the simulated worker
// ============================================================================

// One group's stream to the fake coordinator, and what the tests ask of it.
struct Link {
  std::shared_ptr<LinkPeer> peer;
  const v1::Register& reg;

  bool Route(const std::string& id, std::vector<int32_t> prompt, int64_t max_tokens, uint64_t seed = 0,
             std::vector<int64_t> stop_ids = {}, bool ignore_eos = false) {
    v1::CoordinatorMessage m;
    v1::RouteRequest* r = m.mutable_route();
    r->set_request_id(id);
    for (int32_t t : prompt) r->add_prompt_ids(t);
    r->mutable_sampling()->set_max_tokens(max_tokens);
    r->mutable_sampling()->set_seed(seed);
    for (int64_t s : stop_ids) r->mutable_sampling()->add_stop_token_ids(s);
    r->mutable_sampling()->set_ignore_eos(ignore_eos);
    return peer->Send(std::move(m));
  }
  bool Cancel(const std::string& id) {
    v1::CoordinatorMessage m;
    m.mutable_cancel()->set_request_id(id);
    return peer->Send(std::move(m));
  }

  // The first message from index 0 on for which `pick` returns true, waiting
  // up to `timeout` for it (0: only what arrived so far).
  template <typename Pick>
  bool Find(Pick pick, std::chrono::milliseconds timeout = 0ms) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    for (size_t i = 0;; ++i) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      const std::optional<v1::WorkerMessage> m = peer->Read(i, std::max(left, 0ms));
      if (!m.has_value()) return false;
      if (pick(*m)) return true;
    }
  }
  // The RequestDone of `id`, waiting up to `timeout` for it.
  std::optional<v1::RequestDone> WaitDone(const std::string& id, std::chrono::milliseconds timeout = 10s) {
    std::optional<v1::RequestDone> done;
    Find(
        [&](const v1::WorkerMessage& m) {
          if (m.has_done() && m.done().request_id() == id) done = m.done();
          return done.has_value();
        },
        timeout);
    return done;
  }
  // Every token event of `id` so far, in order.
  std::vector<v1::TokenEvent> Tokens(const std::string& id) {
    std::vector<v1::TokenEvent> out;
    Find([&](const v1::WorkerMessage& m) {
      for (const auto& e : m.tokens().events())
        if (e.request_id() == id) out.push_back(e);
      return false;
    });
    return out;
  }
  // Messages of any kind that mention `id`.
  int Mentions(const std::string& id) {
    int n = 0;
    Find([&](const v1::WorkerMessage& m) {
      if (m.has_done() && m.done().request_id() == id) ++n;
      for (const auto& e : m.tokens().events()) n += e.request_id() == id;
      return false;
    });
    return n;
  }
  // The newest WorkerStats so far, or the first to come within `timeout`.
  std::optional<v1::WorkerStats> WaitStats(std::chrono::milliseconds timeout) {
    std::optional<v1::WorkerStats> s;
    auto take = [&](const v1::WorkerMessage& m) {
      if (m.has_stats()) s = m.stats();
      return false;
    };
    Find(take);
    if (!s.has_value()) Find([&](const v1::WorkerMessage& m) { return take(m) || s.has_value(); }, timeout);
    return s;
  }
};

class FakeLink final : public LinkEndpoint {
 public:
  FakeLink() : LinkEndpoint("fake") {}
  // The newest live link of `dp_group`, waiting up to `timeout` for one.
  std::shared_ptr<Link> WaitLink(int dp_group, std::chrono::milliseconds timeout = 10s) {
    std::shared_ptr<LinkPeer> peer = WaitPeer(dp_group, timeout);
    return peer == nullptr ? nullptr : std::make_shared<Link>(Link{.peer = peer, .reg = peer->registration()});
  }
};

using SimWorker = SimWorkerThread;

struct Expected {
  std::vector<int64_t> tokens;
  std::string finish_reason;
};

// The simulated worker's token function written out again from its
// documentation (client.h, SimWorkerToken) and the fold in sim_worker.cc,
// with splitmix64's finalizer constants spelled out here: no code of
// base/hash.h or of the worker is used.
uint64_t RefMix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

SimToken RefSimToken(const std::vector<int32_t>& prompt, uint64_t seed, int64_t index, int64_t vocab) {
  const uint64_t kGamma = 0x9e3779b97f4a7c15ull;        // splitmix64's increment
  uint64_t h = RefMix64(seed ^ 0x73696d2d776f726bull);  // "sim-work" in ASCII
  for (int32_t t : prompt) h = RefMix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(t))) + kGamma;
  h = RefMix64(h ^ (static_cast<uint64_t>(index) * 0xd1b54a32d192ed03ull + 1));
  SimToken out;
  out.token = static_cast<int64_t>(h % static_cast<uint64_t>(vocab));
  // -8 * (top 53 bits of h) / 2^53
  out.logprob = -8.0 * std::ldexp(static_cast<double>(h >> 11), -53);
  return out;
}

// What the simulated worker must produce, from the reference token function
// and the stop rules.
Expected Expect(const std::vector<int32_t>& prompt, uint64_t seed, int64_t max_tokens, int64_t vocab,
                const std::vector<int64_t>& stop_ids = {}, int64_t eos = -1, bool ignore_eos = false) {
  Expected e;
  for (int64_t i = 0; i < max_tokens; ++i) {
    const int64_t t = RefSimToken(prompt, seed, i, vocab).token;
    e.tokens.push_back(t);
    if ((eos >= 0 && t == eos && !ignore_eos) || std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end()) {
      e.finish_reason = "stop";
      return e;
    }
  }
  e.finish_reason = "length";
  return e;
}

std::vector<int64_t> TokenIds(const std::vector<v1::TokenEvent>& events) {
  std::vector<int64_t> ids;
  for (const auto& e : events) ids.push_back(e.token_id());
  return ids;
}

std::vector<int32_t> Iota(int32_t first, int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

constexpr int64_t kVocab = 512;

SimWorkerOptions SimOptions(const std::string& address, int groups, double tokens_per_s) {
  SimWorkerOptions o;
  o.coordinator = address;
  o.worker_id = "sim-test";
  o.groups = groups;
  o.tokens_per_s = tokens_per_s;
  o.vocab_size = kVocab;
  o.max_position_embeddings = 256;
  o.block_size = 4;
  o.cache_blocks = 64;
  return o;
}

TEST(SimWorker, TokenFunctionMatchesItsDocumentation) {
  // The reference's finalizer against splitmix64's published outputs from
  // state 0 (the state advances by the increment before each mix).
  const uint64_t published[] = {0xE220A8397B1DCDAFull, 0x6E789E6AA1B965F4ull, 0x06C45D188009454Full};
  for (uint64_t k = 0; k < 3; ++k) EXPECT_EQ(RefMix64((k + 1) * 0x9e3779b97f4a7c15ull), published[k]) << k;
  // The token function against the reference: random prompts (empty, negative
  // and large ids too), seeds, indices and vocabulary sizes.
  std::mt19937_64 rng(20240611);
  std::vector<std::vector<int32_t>> prompts = {{}, {1, 2, 3}, {1, 2, 4}, {-1, 0, INT32_MAX, INT32_MIN}};
  for (int k = 0; k < 12; ++k) {
    std::vector<int32_t> p(1 + rng() % 40);
    for (int32_t& t : p) t = static_cast<int32_t>(rng() % 200000);
    prompts.push_back(p);
  }
  int checked = 0;
  for (const auto& p : prompts)
    for (uint64_t seed : {uint64_t{0}, uint64_t{7}, uint64_t{8}, rng(), ~uint64_t{0}})
      for (int64_t index : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{99}, static_cast<int64_t>(rng() % 100000)})
        for (int64_t vocab : {int64_t{1}, int64_t{2}, kVocab, int64_t{129280}}) {
          const SimToken got = SimWorkerToken(p, seed, index, vocab), want = RefSimToken(p, seed, index, vocab);
          EXPECT_EQ(got.token, want.token) << "seed " << seed << " index " << index << " vocab " << vocab;
          EXPECT_EQ(got.logprob, want.logprob) << "seed " << seed << " index " << index;
          EXPECT_GE(got.token, 0);
          EXPECT_LT(got.token, vocab);
          EXPECT_LE(got.logprob, 0.0);
          EXPECT_GT(got.logprob, -8.0);
          ++checked;
        }
  EXPECT_EQ(checked, 16 * 5 * 5 * 4);
  // The seed and the prompt matter.
  const std::vector<int32_t> p = {1, 2, 3}, q = {1, 2, 4};
  int same_seed = 0, same_prompt = 0;
  for (int64_t i = 0; i < 50; ++i) {
    same_seed += SimWorkerToken(p, 7, i, kVocab).token == SimWorkerToken(p, 8, i, kVocab).token;
    same_prompt += SimWorkerToken(p, 7, i, kVocab).token == SimWorkerToken(q, 7, i, kVocab).token;
  }
  EXPECT_LT(same_seed, 5);
  EXPECT_LT(same_prompt, 5);
}

TEST(SimWorker, RegistersServesAndRejects) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  SimWorker worker(SimOptions(server.address(), 2, 0));
  auto g0 = fake.WaitLink(0), g1 = fake.WaitLink(1);
  ASSERT_TRUE(g0 && g1) << worker.log();

  // Registration carries the group's limits and one synthetic rank.
  EXPECT_EQ(g0->reg.worker_id(), "sim-test");
  EXPECT_EQ(g0->reg.dp(), 2);
  EXPECT_EQ(g0->reg.attn_tp(), 1);
  EXPECT_EQ(g0->reg.vocab_size(), kVocab);
  EXPECT_EQ(g0->reg.max_position_embeddings(), 256);
  EXPECT_EQ(g0->reg.block_size(), 4);
  EXPECT_EQ(g0->reg.cache_blocks_total(), 64);
  ASSERT_EQ(g1->reg.ranks_size(), 1);
  EXPECT_EQ(g1->reg.ranks(0).rank(), 1);
  EXPECT_EQ(g1->reg.ranks(0).dp_group(), 1);
  EXPECT_EQ(g1->reg.ranks(0).cache_bytes_per_token(), 1024);
  EXPECT_FALSE(g1->reg.ranks(0).host().empty());
  // Mixed, without block moves, unless asked.
  EXPECT_EQ(g0->reg.role(), "mixed");
  EXPECT_EQ(g0->reg.transfer_descriptors_size(), 0);
  EXPECT_EQ(g0->reg.ranks(0).transfer_path(), "");

  // Deterministic tokens: equal requests on different groups agree.
  const std::vector<int32_t> prompt = Iota(10, 10);
  const Expected want = Expect(prompt, 7, 8, kVocab);
  ASSERT_TRUE(g0->Route("a", prompt, 8, 7));
  ASSERT_TRUE(g1->Route("b", prompt, 8, 7));
  auto da = g0->WaitDone("a"), db = g1->WaitDone("b");
  ASSERT_TRUE(da && db) << worker.log();
  EXPECT_EQ(TokenIds(g0->Tokens("a")), want.tokens);
  EXPECT_EQ(TokenIds(g1->Tokens("b")), want.tokens);
  EXPECT_EQ(g0->Tokens("a")[2].logprob(), RefSimToken(prompt, 7, 2, kVocab).logprob);
  EXPECT_EQ(da->finish_reason(), want.finish_reason);
  EXPECT_EQ(da->error_code(), 0);
  EXPECT_EQ(da->prefix_hit_tokens(), 0);
  EXPECT_EQ(db->prefix_hit_tokens(), 0);  // each group has its own cache

  // Prefix hits: "a" left blocks [10..14) and [14..18) (and more) cached on group 0.
  std::vector<int32_t> shared = Iota(10, 8);
  shared.push_back(400);
  ASSERT_TRUE(g0->Route("c", shared, 2));
  auto dc = g0->WaitDone("c");
  ASSERT_TRUE(dc);
  EXPECT_EQ(dc->prefix_hit_tokens(), 8);
  // A prompt of exactly two cached blocks reuses only one: a token is always recomputed.
  ASSERT_TRUE(g0->Route("d", Iota(10, 8), 2));
  auto dd = g0->WaitDone("d");
  ASSERT_TRUE(dd);
  EXPECT_EQ(dd->prefix_hit_tokens(), 4);
  // A different first block: no hit, although later tokens agree.
  std::vector<int32_t> other = Iota(10, 10);
  other[0] = 300;
  ASSERT_TRUE(g0->Route("e", other, 2));
  auto de = g0->WaitDone("e");
  ASSERT_TRUE(de);
  EXPECT_EQ(de->prefix_hit_tokens(), 0);

  // Stop ids end generation early, the stop token included.
  const std::vector<int32_t> sp = Iota(50, 6);
  const Expected full = Expect(sp, 3, 20, kVocab);
  const std::vector<int64_t> stops = {full.tokens[4]};
  const Expected stopped = Expect(sp, 3, 20, kVocab, stops);
  ASSERT_LE(stopped.tokens.size(), 5u);
  ASSERT_TRUE(g1->Route("s", sp, 20, 3, stops));
  auto ds = g1->WaitDone("s");
  ASSERT_TRUE(ds);
  EXPECT_EQ(ds->finish_reason(), "stop");
  EXPECT_EQ(TokenIds(g1->Tokens("s")), stopped.tokens);

  // Rejections: RequestDone with INVALID_ARGUMENT and a message, no tokens.
  ASSERT_TRUE(g1->Route("bad-id", {1, 2, static_cast<int32_t>(kVocab)}, 4));
  ASSERT_TRUE(g1->Route("too-long", Iota(0, 250), 10));
  ASSERT_TRUE(g1->Route("empty", {}, 4));
  for (const char* id : {"bad-id", "too-long", "empty"}) {
    auto d = g1->WaitDone(id);
    ASSERT_TRUE(d) << id;
    EXPECT_EQ(d->error_code(), 3) << id;
    EXPECT_FALSE(d->error_message().empty()) << id;
    EXPECT_EQ(d->finish_reason(), "") << id;
    EXPECT_TRUE(g1->Tokens(id).empty()) << id;
  }
  EXPECT_NE(g1->WaitDone("bad-id")->error_message().find("vocabulary"), std::string::npos);
  EXPECT_NE(g1->WaitDone("too-long")->error_message().find("max_position_embeddings"), std::string::npos);

  // Periodic stats with the rank.
  auto st = g0->WaitStats(2s);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->ranks_size(), 1);
  EXPECT_GT(st->free_blocks(), 0);
  EXPECT_LE(st->free_blocks(), 64);
  // Requests ran, so the peak is set, in blocks and in bytes alike.
  EXPECT_GT(st->ranks(0).cache_blocks_peak(), 0);
  EXPECT_EQ(st->ranks(0).cache_bytes_peak(), st->ranks(0).cache_blocks_peak() * st->ranks(0).cache_block_bytes());
  // The machine's CPU, as a worker's rank reports its own.
  EXPECT_EQ(st->ranks(0).cpu_model_name(), HostCpu().model_name);
  EXPECT_EQ(st->ranks(0).cpu_flags(), HostCpu().FlagList());
  EXPECT_EQ(st->ranks(0).cpu_isa(), CpuIsaName(ActiveCpuIsa()));
  EXPECT_EQ(worker.Stop(), 0);
}

TEST(SimWorker, EosStopsUnlessIgnored) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  const std::vector<int32_t> prompt = Iota(70, 5);
  SimWorkerOptions o = SimOptions(server.address(), 1, 0);
  o.eos_token_id = Expect(prompt, 1, 20, kVocab).tokens[2];
  SimWorker worker(o);
  auto g = fake.WaitLink(0);
  ASSERT_TRUE(g);
  ASSERT_TRUE(g->Route("eos", prompt, 20, 1));
  ASSERT_TRUE(g->Route("ignore", prompt, 20, 1, {}, /*ignore_eos=*/true));
  auto d1 = g->WaitDone("eos"), d2 = g->WaitDone("ignore");
  ASSERT_TRUE(d1 && d2);
  EXPECT_EQ(d1->finish_reason(), "stop");
  EXPECT_EQ(TokenIds(g->Tokens("eos")), Expect(prompt, 1, 20, kVocab, {}, o.eos_token_id).tokens);
  EXPECT_LE(g->Tokens("eos").size(), 3u);
  EXPECT_EQ(d2->finish_reason(), "length");
  EXPECT_EQ(g->Tokens("ignore").size(), 20u);
}

TEST(SimWorker, PacesTokensAndCancelStopsARequest) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  SimWorker worker(SimOptions(server.address(), 1, 50));
  auto g = fake.WaitLink(0);
  ASSERT_TRUE(g);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(g->Route("long", {1, 2, 3}, 200));
  // 50 tokens/s: after ~300 ms some tokens came, far from all 200.
  std::this_thread::sleep_for(300ms);
  const size_t early = g->Tokens("long").size();
  EXPECT_GE(early, 3u);
  EXPECT_LT(early, 60u);
  ASSERT_TRUE(g->Cancel("long"));
  std::this_thread::sleep_for(200ms);  // anything already on the wire lands
  const int after_cancel = g->Mentions("long");
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(g->Mentions("long"), after_cancel) << "tokens kept coming after CancelRoute";
  EXPECT_FALSE(g->WaitDone("long", 1ms));
  // The group still serves, at the configured pace: 10 tokens take ~200 ms.
  const auto t1 = std::chrono::steady_clock::now();
  ASSERT_TRUE(g->Route("next", {4, 5}, 10));
  auto d = g->WaitDone("next");
  ASSERT_TRUE(d);
  EXPECT_EQ(g->Tokens("next").size(), 10u);
  EXPECT_GE(std::chrono::steady_clock::now() - t1, 150ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST(SimWorker, StepMsIsAFixedCostPerStep) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  SimWorkerOptions o = SimOptions(server.address(), 1, 0);  // no cost per token
  o.step_ms = 40;
  SimWorker worker(o);
  auto g = fake.WaitLink(0);
  ASSERT_TRUE(g);
  // 6 tokens are 6 steps, each token at its step's end: at least 5 x 40 ms, where
  // without step_ms the group answers as fast as it can.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(g->Route("a", {1, 2, 3}, 6));
  ASSERT_TRUE(g->WaitDone("a"));
  EXPECT_EQ(g->Tokens("a").size(), 6u);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 190ms);
}

// Messages group `g` sent so far.
size_t Received(Link& g) {
  size_t n = 0;
  while (g.peer->Read(n, 0ms)) ++n;
  return n;
}

// Steps of group `g` from message `from` on until the first token of `id`:
// the batches that carry a token of `clock` (a request decoding all along,
// one token a step) up to and including the one with that first token; -1
// if none comes within 10 s.
int StepsUntilFirstToken(Link& g, size_t from, const std::string& clock, const std::string& id) {
  int steps = 0;
  for (size_t i = from;; ++i) {
    const std::optional<v1::WorkerMessage> m = g.peer->Read(i, 10s);
    if (!m) return -1;
    bool ticked = false, first = false;
    for (const auto& e : m->tokens().events()) {
      ticked |= e.request_id() == clock;
      first |= e.request_id() == id;
    }
    steps += ticked;
    if (first) return steps;
  }
}

// A route with the tokens the request generated elsewhere (a resumed request).
v1::CoordinatorMessage ResumeRoute(const std::string& id, const std::vector<int32_t>& prompt, int64_t max_tokens,
                                   const std::vector<int64_t>& generated) {
  v1::CoordinatorMessage m;
  v1::RouteRequest* r = m.mutable_route();
  r->set_request_id(id);
  for (int32_t t : prompt) r->add_prompt_ids(t);
  r->mutable_sampling()->set_max_tokens(max_tokens);
  for (int64_t t : generated) r->add_generated_ids(static_cast<int32_t>(t));
  return m;
}

TEST(SimWorker, PrefillIsComputedInChunksOfMaxBatchedTokens) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  SimWorkerOptions o = SimOptions(server.address(), 1, 0);
  o.step_ms = 40;                // steps long enough to count
  o.prefill_tokens_per_s = 1e9;  // prompts chunked, at no noticeable cost
  o.max_batched_tokens = 16;
  o.cache_blocks = 1024;  // no request waits for blocks
  SimWorker worker(o);
  auto g = fake.WaitLink(0);
  ASSERT_TRUE(g);
  // "clock" decodes one token a step beside the others' prefill.
  ASSERT_TRUE(g->Route("clock", {1, 2, 3}, 200));
  ASSERT_TRUE(g->Find([](const v1::WorkerMessage& m) { return m.tokens().events_size() > 0; }, 5s));
  // A prompt of N tokens takes ceil(N / 16) steps to its first token (one
  // more when it arrives during a step: it joins the next one).
  for (const auto& [id, n] : {std::pair<const char*, int32_t>{"p64", 64}, {"p16", 16}, {"p17", 17}}) {
    const size_t mark = Received(*g);
    ASSERT_TRUE(g->Route(id, Iota(100, n), 2));
    const int want = (n + 15) / 16;
    const int steps = StepsUntilFirstToken(*g, mark, "clock", id);
    EXPECT_GE(steps, want) << id;
    EXPECT_LE(steps, want + 1) << id;
    ASSERT_TRUE(g->WaitDone(id)) << id;
    EXPECT_EQ(TokenIds(g->Tokens(id)), Expect(Iota(100, n), 0, 2, kVocab).tokens) << id;
  }
  // A resumed request computes its prompt and the tokens it generated
  // elsewhere (16 + 16 rows: 2 steps), then goes on from token 16.
  const std::vector<int32_t> prompt = Iota(300, 16);
  const Expected full = Expect(prompt, 0, 20, kVocab);
  const size_t mark = Received(*g);
  ASSERT_TRUE(g->peer->Send(
      ResumeRoute("resumed", prompt, 20, std::vector<int64_t>(full.tokens.begin(), full.tokens.begin() + 16))));
  const int steps = StepsUntilFirstToken(*g, mark, "clock", "resumed");
  EXPECT_GE(steps, 2);
  EXPECT_LE(steps, 3);
  ASSERT_TRUE(g->WaitDone("resumed"));
  EXPECT_EQ(TokenIds(g->Tokens("resumed")), std::vector<int64_t>(full.tokens.begin() + 16, full.tokens.end()));
  EXPECT_EQ(worker.Stop(), 0);
}

TEST(SimWorker, PrefillTakesItsTokensAtPrefillTokensPerS) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  SimWorkerOptions o = SimOptions(server.address(), 1, 0);  // decode rows cost nothing
  o.prefill_tokens_per_s = 1000;
  o.max_batched_tokens = 64;
  SimWorker worker(o);
  auto g = fake.WaitLink(0);
  ASSERT_TRUE(g);
  // 200 prompt tokens at 1000/s: 200 ms before the first token (4 chunks);
  // the next request's prompt shares its first 48 tokens (12 full blocks
  // cached), so it computes only the rest.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(g->Route("a", Iota(10, 200), 3));
  ASSERT_TRUE(g->Find([](const v1::WorkerMessage& m) { return m.tokens().events_size() > 0; }, 5s));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 190ms);
  auto da = g->WaitDone("a");
  ASSERT_TRUE(da);
  EXPECT_EQ(TokenIds(g->Tokens("a")), Expect(Iota(10, 200), 0, 3, kVocab).tokens);
  std::vector<int32_t> shared = Iota(10, 48);
  shared.push_back(500);
  ASSERT_TRUE(g->Route("b", shared, 2));
  auto db = g->WaitDone("b");
  ASSERT_TRUE(db);
  EXPECT_EQ(db->prefix_hit_tokens(), 48);
  EXPECT_EQ(worker.Stop(), 0);
}

// The first WorkerStats of group `g` from message `from` on for which `pick`
// is true, waiting up to 5 s for it.
template <typename Pick>
std::optional<v1::WorkerStats> StatsFrom(Link& g, size_t from, Pick pick) {
  for (size_t i = from;; ++i) {
    const std::optional<v1::WorkerMessage> m = g.peer->Read(i, 5s);
    if (!m) return std::nullopt;
    if (m->has_stats() && pick(m->stats())) return m->stats();
  }
}

int64_t BlocksUsed(const v1::WorkerStats& s) { return s.ranks(0).cache_blocks_used(); }

// Group `g`'s Exported of `id` from message `from` on, and the message's index.
std::optional<std::pair<v1::Exported, size_t>> WaitExported(Link& g, size_t from, const std::string& id) {
  for (size_t i = from;; ++i) {
    const std::optional<v1::WorkerMessage> m = g.peer->Read(i, 5s);
    if (!m) return std::nullopt;
    if (m->has_exported() && m->exported().request_id() == id) return std::pair{m->exported(), i};
  }
}

v1::CoordinatorMessage Migrate(const std::string& id) {
  v1::CoordinatorMessage m;
  m.mutable_migrate_out()->set_request_id(id);
  return m;
}

v1::CoordinatorMessage Release(const std::string& id) {
  v1::CoordinatorMessage m;
  m.mutable_release_exported()->set_request_id(id);
  return m;
}

TEST(SimWorker, RegistersItsRoleAndADescriptorWithBlockMoves) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  SimWorkerOptions o = SimOptions(server.address(), 1, 0);
  o.role = "decode";
  o.transfer_gbps = 25;
  SimWorker worker(o);
  auto g = fake.WaitLink(0);
  ASSERT_TRUE(g) << worker.log();
  EXPECT_EQ(g->reg.role(), "decode");
  // One per rank (attn_tp = 1), within the coordinator's 64 KiB.
  ASSERT_EQ(g->reg.transfer_descriptors_size(), 1);
  EXPECT_GT(g->reg.transfer_descriptors(0).size(), 0u);
  EXPECT_LE(g->reg.transfer_descriptors(0).size(), size_t{64} << 10);
  EXPECT_EQ(g->reg.ranks(0).transfer_path(), "sim");
  EXPECT_EQ(worker.Stop(), 0);
}

TEST(SimWorker, ExportsBlocksUntilReleasedAndImportsThem) {
  FakeLink fake;
  TestServer server(&fake);
  ASSERT_TRUE(server.ok());
  SimWorkerOptions o = SimOptions(server.address(), 2, 0);
  o.step_ms = 20;
  o.transfer_gbps = 0.001;  // 1 Mbit/s: a fetch of ~13 rows of 1 KiB takes ~100 ms
  SimWorker worker(o);
  auto g0 = fake.WaitLink(0), g1 = fake.WaitLink(1);
  ASSERT_TRUE(g0 && g1) << worker.log();
  const std::vector<int32_t> prompt = Iota(10, 10);
  const Expected want = Expect(prompt, 0, 40, kVocab);
  ASSERT_TRUE(g0->Route("a", prompt, 40));
  ASSERT_TRUE(g0->Find([](const v1::WorkerMessage& m) { return m.tokens().events_size() > 0; }, 5s));
  std::this_thread::sleep_for(50ms);  // a few more tokens

  // Exported names the blocks of its computed rows: every token's but the last.
  ASSERT_TRUE(g0->peer->Send(Migrate("a")));
  const auto exported = WaitExported(*g0, 0, "a");
  ASSERT_TRUE(exported) << worker.log();
  const v1::Exported& x = exported->first;
  const int64_t k = static_cast<int64_t>(g0->Tokens("a").size());
  EXPECT_EQ(x.tokens(), k);
  EXPECT_GE(k, 2);
  EXPECT_EQ(x.cached_tokens(), 10 + k - 1);
  const std::vector<int32_t> blocks(x.block_ids().begin(), x.block_ids().end());
  EXPECT_TRUE(CheckBlockTable(blocks, x.cached_tokens(), 4, "exported.block_ids").ok());
  // Held until ReleaseExported, and no token of it comes after the Exported.
  auto held = StatsFrom(*g0, exported->second, [](const v1::WorkerStats&) { return true; });
  ASSERT_TRUE(held);
  EXPECT_EQ(BlocksUsed(*held), std::ssize(blocks));

  // Its new group fetches them (not computing them) and goes on from token k.
  v1::CoordinatorMessage route =
      ResumeRoute("a", prompt, 40, std::vector<int64_t>(want.tokens.begin(), want.tokens.begin() + k));
  v1::MoveSource* source = route.mutable_route()->mutable_move_source();
  *source->mutable_descriptors() = g0->reg.transfer_descriptors();
  *source->mutable_block_ids() = x.block_ids();
  source->set_cached_tokens(x.cached_tokens());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(g1->peer->Send(route));
  ASSERT_TRUE(g1->Find([](const v1::WorkerMessage& m) { return m.tokens().events_size() > 0; }, 5s));
  const double fetch_s = static_cast<double>(x.cached_tokens() * 1024 * 8) / 1e6;
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), fetch_s - 0.005);
  ASSERT_TRUE(g1->WaitDone("a"));
  EXPECT_EQ(TokenIds(g1->Tokens("a")), std::vector<int64_t>(want.tokens.begin() + k, want.tokens.end()));
  const size_t after_done = Received(*g1);
  auto moved = StatsFrom(*g1, after_done, [](const v1::WorkerStats&) { return true; });
  ASSERT_TRUE(moved);
  EXPECT_EQ(moved->ranks(0).transfer_fetches(), 1);
  EXPECT_EQ(moved->ranks(0).transfer_bytes(), x.cached_tokens() * 1024);
  EXPECT_EQ(BlocksUsed(*moved), 0);
  EXPECT_EQ(g0->Mentions("a"), k);  // its tokens, and nothing after the Exported

  const size_t before_release = Received(*g0);
  ASSERT_TRUE(g0->peer->Send(Release("a")));
  EXPECT_TRUE(StatsFrom(*g0, before_release, [](const v1::WorkerStats& s) { return BlocksUsed(s) == 0; }));

  // A CancelRoute of an exported request frees its blocks too.
  ASSERT_TRUE(g0->Route("b", Iota(200, 10), 40));
  ASSERT_TRUE(g0->Find(
      [](const v1::WorkerMessage& m) {
        for (const auto& e : m.tokens().events())
          if (e.request_id() == "b") return true;
        return false;
      },
      5s));
  const size_t before_b = Received(*g0);
  ASSERT_TRUE(g0->peer->Send(Migrate("b")));
  const auto xb = WaitExported(*g0, before_b, "b");
  ASSERT_TRUE(xb);
  EXPECT_GT(xb->first.block_ids_size(), 0);
  ASSERT_TRUE(g0->Cancel("b"));
  const size_t after_cancel = Received(*g0);
  EXPECT_TRUE(StatsFrom(*g0, after_cancel, [](const v1::WorkerStats& s) { return BlocksUsed(s) == 0; }));
  EXPECT_EQ(worker.Stop(), 0);
}

TEST(SimWorker, ReconnectsAfterTheCoordinatorRestarts) {
  auto fake = std::make_unique<FakeLink>();
  auto server = std::make_unique<TestServer>(fake.get());
  ASSERT_TRUE(server->ok());
  const int port = server->port();
  SimWorker worker(SimOptions(server->address(), 2, 50));
  auto g0 = fake->WaitLink(0);
  ASSERT_TRUE(g0 && fake->WaitLink(1));
  ASSERT_TRUE(g0->Route("in-flight", {1, 2, 3}, 200));
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(g0->Tokens("in-flight").empty());

  server->Shutdown();
  server.reset();
  std::this_thread::sleep_for(300ms);  // the worker sees the failure and backs off
  auto fake2 = std::make_unique<FakeLink>();
  auto server2 = std::make_unique<TestServer>(fake2.get(), port);
  ASSERT_TRUE(server2->ok()) << "cannot listen on port " << port << " again";
  auto n0 = fake2->WaitLink(0, 15s), n1 = fake2->WaitLink(1, 15s);
  ASSERT_TRUE(n0 && n1) << worker.log();
  EXPECT_EQ(n0->reg.worker_id(), "sim-test");
  ASSERT_TRUE(n1->Route("after", {7, 8, 9}, 5));
  auto d = n1->WaitDone("after");
  ASSERT_TRUE(d) << worker.log();
  EXPECT_EQ(TokenIds(n1->Tokens("after")), Expect({7, 8, 9}, 0, 5, kVocab).tokens);
  // The request in flight at the restart was dropped, not resumed.
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(n0->Mentions("in-flight"), 0);
  EXPECT_EQ(worker.Stop(), 0);
  EXPECT_NE(worker.log().find("reconnecting"), std::string::npos) << worker.log();
  server2->Shutdown();
}

TEST(SimWorker, PresentsTheWorkerSecretAndSaysWhenRefused) {
  LinkEndpoint endpoint("secured", "sekrit-1");
  auto server = GrpcServer::Start("127.0.0.1:0", {&endpoint});
  ASSERT_TRUE(server.ok()) << server.status();
  {
    SimWorkerOptions o = SimOptions((*server)->address(), 1, 0);
    o.worker_secret = "wrong";
    SimWorker refused(o);
    EXPECT_EQ(endpoint.WaitPeer(0, 500ms), nullptr) << "a worker with the wrong secret is never registered";
    EXPECT_EQ(refused.Stop(), 0);
    EXPECT_NE(refused.log().find("UNAUTHENTICATED: the worker secret does not match"), std::string::npos)
        << refused.log();
  }
  SimWorkerOptions o = SimOptions((*server)->address(), 1, 0);
  o.worker_secret = "sekrit-1";
  SimWorker worker(o);
  auto peer = endpoint.WaitPeer(0, 5s);
  ASSERT_NE(peer, nullptr) << worker.log();
  EXPECT_EQ(peer->registration().worker_id(), "sim-test");
  EXPECT_EQ(worker.Stop(), 0);
  (*server)->Shutdown(std::chrono::milliseconds(0));
}

TEST(SimWorker, StopsWhileTheCoordinatorIsDown) {
  int port;
  {
    FakeLink fake;
    TestServer server(&fake);
    ASSERT_TRUE(server.ok());
    port = server.port();
  }
  SimWorker worker(SimOptions("127.0.0.1:" + std::to_string(port), 3, 0));
  std::this_thread::sleep_for(500ms);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(worker.Stop(), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
}

TEST(SimWorker, BadOptionsExitTwo) {
  std::atomic<bool> stop{true};
  std::ostringstream log;
  SimWorkerOptions o;
  o.groups = 0;
  EXPECT_EQ(RunSimWorker(o, &stop, log), 2);
  o = SimWorkerOptions();
  o.coordinator = "nowhere";
  EXPECT_EQ(RunSimWorker(o, &stop, log), 2);
  o = SimWorkerOptions();
  o.eos_token_id = o.vocab_size;
  EXPECT_EQ(RunSimWorker(o, &stop, log), 2);
  EXPECT_NE(log.str().find("--groups"), std::string::npos) << log.str();
}

TEST(SimWorker, PrefillOptionsAreChecked) {
  std::atomic<bool> stop{true};
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    std::ostringstream log;
    SimWorkerOptions o;
    o.prefill_tokens_per_s = bad;
    EXPECT_EQ(RunSimWorker(o, &stop, log), 2) << bad;
    EXPECT_NE(log.str().find("--prefill-tokens-per-s must be a finite number >= 0"), std::string::npos) << log.str();
  }
  for (int64_t bad : {int64_t{0}, int64_t{-5}, int64_t{1} << 31}) {
    std::ostringstream log;
    SimWorkerOptions o;
    o.max_batched_tokens = bad;
    EXPECT_EQ(RunSimWorker(o, &stop, log), 2) << bad;
    EXPECT_NE(log.str().find("--max-batched-tokens must be in [1, 2^31)"), std::string::npos) << log.str();
  }
}

TEST(SimWorker, RoleAndTransferOptionsAreChecked) {
  std::atomic<bool> stop{true};
  {
    std::ostringstream log;
    SimWorkerOptions o;
    o.role = "both";
    EXPECT_EQ(RunSimWorker(o, &stop, log), 2);
    EXPECT_NE(log.str().find("--role must be mixed, prefill or decode, got 'both'"), std::string::npos) << log.str();
  }
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    std::ostringstream log;
    SimWorkerOptions o;
    o.transfer_gbps = bad;
    EXPECT_EQ(RunSimWorker(o, &stop, log), 2) << bad;
    EXPECT_NE(log.str().find("--transfer-gbps must be a finite number >= 0"), std::string::npos) << log.str();
  }
}

TEST(SimWorker, StepMsMustBeFiniteAndNonNegative) {
  std::atomic<bool> stop{true};
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    std::ostringstream log;
    SimWorkerOptions o;
    o.step_ms = bad;
    EXPECT_EQ(RunSimWorker(o, &stop, log), 2) << bad;
    EXPECT_NE(log.str().find("--step-ms must be a finite number >= 0"), std::string::npos) << log.str();
  }
}

}  // namespace
}  // namespace mlarun
