// The serving path's security: TLS on the coordinator's port, workers
// authenticated by a client certificate or the shared secret, the client
// API's bearer tokens (one principal each: its own request ids, its own
// cancels), unguessable request ids, and GetStats' details only for
// authenticated callers. Every refusal is checked by its status code and
// message. Certificates are made here with the openssl command line
// (scripts/install-deps installs it): a CA, a server certificate for
// 127.0.0.1 and localhost, a worker client certificate, and a second CA
// with its own client certificate that the coordinator must not trust.
#include "serving/security/security.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "mlarun.grpc.pb.h"
#include "serving/client/client.h"
#include "serving/client/grpc_util.h"
#include "serving/coordinator/coordinator.h"
#include "serving/link/worker_link_client.h"
#include "serving/sim/sim_worker.h"
#include "tests/serving/sim_worker_thread.h"

namespace mlarun {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr int64_t kVocab = 512;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The certificates, made once for the suite.
struct Pki {
  fs::path dir;
  std::string error;  // why they could not be made
  fs::path ca, server_cert, server_key, worker_cert, worker_key, rogue_ca, rogue_cert, rogue_key;
};

bool Sh(const std::string& cmd, std::string* error) {
  if (std::system(("(" + cmd + ") >/dev/null 2>&1").c_str()) == 0) return true;
  *error = "failed: " + cmd;
  return false;
}

Pki MakePki() {
  Pki p;
  p.dir = fs::path(::testing::TempDir()) / ("mlarun_pki_" + std::to_string(getpid()));
  fs::create_directories(p.dir);
  const std::string d = p.dir.string();
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  auto ca = [&](const std::string& name) {
    return Sh("openssl req -x509 " + ec + " -keyout " + d + "/" + name + ".key -out " + d + "/" + name +
                  ".crt -days 3 -subj /CN=" + name,
              &p.error);
  };
  // A leaf signed by `ca`, with `ext` (subjectAltName, extendedKeyUsage).
  auto leaf = [&](const std::string& name, const std::string& ca_name, const std::string& ext) {
    std::ofstream(d + "/" + name + ".ext") << ext << "\n";
    return Sh("openssl req " + ec + " -keyout " + d + "/" + name + ".key -out " + d + "/" + name +
                  ".csr -subj /CN=" + name,
              &p.error) &&
           Sh("openssl x509 -req -in " + d + "/" + name + ".csr -CA " + d + "/" + ca_name + ".crt -CAkey " + d + "/" +
                  ca_name + ".key -CAcreateserial -days 3 -out " + d + "/" + name + ".crt -extfile " + d + "/" + name +
                  ".ext",
              &p.error);
  };
  if (!(ca("ca") && ca("rogue-ca") &&
        leaf("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth") &&
        leaf("worker", "ca", "extendedKeyUsage=clientAuth") &&
        leaf("rogue", "rogue-ca", "extendedKeyUsage=clientAuth")))
    return p;
  p.ca = p.dir / "ca.crt";
  p.server_cert = p.dir / "server.crt";
  p.server_key = p.dir / "server.key";
  p.worker_cert = p.dir / "worker.crt";
  p.worker_key = p.dir / "worker.key";
  p.rogue_ca = p.dir / "rogue-ca.crt";
  p.rogue_cert = p.dir / "rogue.crt";
  p.rogue_key = p.dir / "rogue.key";
  // openssl dates the certificates from the second they were made (3.0 has
  // no option to backdate them); a handshake in that same second fails
  // "certificate verify failed" if the clock then steps back even slightly,
  // as a VM's can (seen once in a full ctest run). Let them age past it.
  std::this_thread::sleep_for(1100ms);
  return p;
}

const Pki& GetPki() {
  static const Pki pki = MakePki();
  return pki;
}

TlsPem ServerTls(bool with_ca) {
  const Pki& p = GetPki();
  auto tls = LoadServerTls({.cert = p.server_cert, .key = p.server_key, .ca = with_ca ? p.ca.string() : ""});
  EXPECT_TRUE(tls.ok()) << tls.status();
  return tls.ok() ? *tls : TlsPem{};
}

// What a client or worker trusts, and the certificate it presents.
TlsPem ClientTls(const fs::path& ca, const fs::path& cert = {}, const fs::path& key = {}) {
  auto tls = LoadClientTls({.cert = cert, .key = key, .ca = ca});
  EXPECT_TRUE(tls.ok()) << tls.status();
  return tls.ok() ? *tls : TlsPem{};
}

SimWorkerOptions Sim(const std::string& address, double tokens_per_s = 0) {
  SimWorkerOptions o;
  o.coordinator = address;
  o.worker_id = "sim-secure";
  o.vocab_size = kVocab;
  o.tokens_per_s = tokens_per_s;
  return o;
}

// Health until a group is connected (or 20 s).
bool WaitConnected(v1::Mlarun::Stub& stub) {
  for (int i = 0; i < 400; ++i) {
    grpc::ClientContext ctx;
    client_internal::SetDeadline(ctx, 2);
    v1::HealthResponse h;
    if (stub.Health(&ctx, v1::HealthRequest(), &h).ok() && h.groups_connected() > 0) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

struct Call {
  grpc::Status status;
  std::string id;
  std::vector<int64_t> tokens;
  int64_t prefix_hit_tokens = -1;  // Finished's; -1 without one
  int32_t dp_group = -1;
};

Call Generate(v1::Mlarun::Stub& stub, const ClientSecurity& security, const std::string& id,
              std::vector<int32_t> prompt, int64_t max_tokens, grpc::ClientContext* ctx_out = nullptr,
              const std::string& cache_salt = "") {
  grpc::ClientContext local;
  grpc::ClientContext& ctx = ctx_out != nullptr ? *ctx_out : local;
  client_internal::SetDeadline(ctx, 30);
  client_internal::AddCredentials(ctx, security);
  v1::GenerateRequest req;
  req.set_request_id(id);
  req.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_ignore_eos(true);
  req.set_cache_salt(cache_salt);
  auto reader = stub.Generate(&ctx, req);
  Call c;
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    c.id = resp.request_id();
    if (resp.has_token()) c.tokens.push_back(resp.token().token_id());
    if (resp.has_finished()) {
      c.prefix_hit_tokens = resp.finished().prefix_hit_tokens();
      c.dp_group = resp.finished().dp_group();
    }
  }
  c.status = reader->Finish();
  return c;
}

std::vector<int64_t> SimTokens(const std::vector<int32_t>& prompt, int64_t n) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(SimWorkerToken(prompt, 0, i, kVocab).token);
  return t;
}

class Security : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!GetPki().error.empty()) GTEST_FAIL() << "cannot make test certificates: " << GetPki().error;
  }
};

// ---- Parsing -------------------------------------------------------------------------

TEST(AuthTokens, ParsesNamesCommentsAndRefusesBadFiles) {
  auto t = AuthTokens::Parse("# tokens\n\n  0123456789abcdef0123 alice\nfedcba9876543210fedc\n", "f");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  const Principal* a = t->Authenticate("Bearer 0123456789abcdef0123");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->name, "alice");
  const Principal* b = t->Authenticate("bearer   fedcba9876543210fedc ");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->name, "token-4");  // its line
  for (std::string_view bad : {"", "Bearer", "Bearer ", "Basic 0123456789abcdef0123", "Bearer 0123456789abcdef012",
                               "Bearer 0123456789abcdef01234", "0123456789abcdef0123"})
    EXPECT_EQ(t->Authenticate(bad), nullptr) << bad;

  struct Bad {
    std::string text, says;
  };
  for (const Bad& bad : std::vector<Bad>{{"short\n", "at least 16"},
                                         {"0123456789abcdef0123 a\n0123456789abcdef0123 b\n", "same token as line 1"},
                                         {"0123456789abcdef0123 a\nfedcba9876543210fedc a\n", "principal name 'a'"},
                                         {"0123456789abcdef0123 a b\n", "TOKEN [NAME]"},
                                         {"# only a comment\n\n", "holds no token"},
                                         {"0123456789abcdef\x01\x02\x03\n", "printable ASCII"}}) {
    auto r = AuthTokens::Parse(bad.text, "tokens.txt");
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad.text;
    EXPECT_NE(r.status().message().find(bad.says), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("tokens.txt"), std::string::npos) << r.status();
  }
  // A client reads the first token of such a file.
  const fs::path file = fs::path(::testing::TempDir()) / "mlarun_client_tokens";
  std::ofstream(file) << "# mine first\n0123456789abcdef0123 alice\nfedcba9876543210fedc bob\n";
  auto mine = ReadClientTokenFile(file);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(*mine, "0123456789abcdef0123");
  auto missing = AuthTokens::ReadFile("/nonexistent/mlarun-tokens");
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("--auth-token-file"), std::string::npos) << missing.status();
}

TEST_F(Security, TlsFileCombinationsAreCheckedByFlag) {
  const Pki& p = GetPki();
  struct Case {
    bool server;
    TlsFiles files;
    std::string says;
  };
  const fs::path not_pem = p.dir / "not.pem";
  std::ofstream(not_pem) << "plain text\n";
  for (const Case& c : std::vector<Case>{
           {true, {.cert = p.server_cert}, "--tls-cert needs --tls-key"},
           {true, {.key = p.server_key}, "--tls-key needs --tls-cert"},
           {true, {.ca = p.ca}, "--tls-ca needs --tls-cert"},
           {false, {.cert = p.worker_cert, .key = p.worker_key}, "--tls-cert needs --tls-ca"},
           {false, {.ca = not_pem}, "no PEM block"},
           {false, {.ca = p.dir / "missing.pem"}, "cannot read"},
       }) {
    auto r = c.server ? LoadServerTls(c.files) : LoadClientTls(c.files);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.says;
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status();
  }
  auto none = LoadClientTls({});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->enabled());
  EXPECT_TRUE(ClientTls(p.ca).enabled());
}

TEST(RequestIds, AreRandom128BitHex) {
  std::set<std::string> seen;
  for (int i = 0; i < 20000; ++i) {
    const std::string id = NewRandomRequestId();
    ASSERT_EQ(id.size(), 36u) << id;
    ASSERT_EQ(id.rfind("req-", 0), 0u) << id;
    ASSERT_EQ(id.find_first_not_of("0123456789abcdef", 4), std::string::npos) << id;
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 20000u);
  // Every hex digit position takes many values (a counter or a clock would
  // leave the high digits fixed).
  for (size_t pos = 4; pos < 36; ++pos) {
    std::set<char> digits;
    for (const std::string& id : seen) digits.insert(id[pos]);
    EXPECT_EQ(digits.size(), 16u) << "position " << pos;
  }
}

// ---- TLS ----------------------------------------------------------------------------------

TEST_F(Security, TlsServesTlsClientsAndRefusesPlaintextAndOtherCas) {
  const Pki& p = GetPki();
  auto coord = Coordinator::Start({.listen = "127.0.0.1:0", .tls = ServerTls(false)});
  ASSERT_TRUE(coord.ok()) << coord.status();
  SimWorkerOptions so = Sim((*coord)->address());
  so.tls = ClientTls(p.ca);
  SimWorkerThread sim(so);
  auto stub = v1::Mlarun::NewStub(client_internal::MakeChannel((*coord)->address(), ClientTls(p.ca)));
  ASSERT_TRUE(WaitConnected(*stub)) << sim.log();
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  const Call ok = Generate(*stub, {}, "over-tls", prompt, 6);
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.tokens, SimTokens(prompt, 6));

  // The client library, as `mlarun submit --tls-ca` uses it.
  SubmitOptions sub;
  sub.coordinator = (*coord)->address();
  sub.prompt_ids = {3, 1, 4, 1, 5};
  sub.sampling.max_tokens = 6;
  sub.sampling.ignore_eos = true;
  sub.json = true;
  sub.timeout_s = 20;
  sub.security.tls = ClientTls(p.ca);
  std::ostringstream out, err;
  ASSERT_EQ(RunSubmit(sub, out, err), 0) << err.str();
  EXPECT_NE(out.str().find("\"tokens\":[" + std::to_string(ok.tokens[0]) + ","), std::string::npos) << out.str();

  // Plaintext to a TLS port, and TLS trusting another CA: no connection.
  for (const TlsPem& tls : {TlsPem{}, ClientTls(p.rogue_ca)}) {
    auto other = v1::Mlarun::NewStub(client_internal::MakeChannel((*coord)->address(), tls));
    grpc::ClientContext ctx;
    client_internal::SetDeadline(ctx, 3);
    v1::HealthResponse h;
    const grpc::Status st = other->Health(&ctx, v1::HealthRequest(), &h);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  }
  sub.security.tls = {};
  sub.timeout_s = 3;
  std::ostringstream out2, err2;
  EXPECT_EQ(RunSubmit(sub, out2, err2), 1);
  EXPECT_NE(err2.str().find("UNAVAILABLE"), std::string::npos) << err2.str();
}

// The result of one registration attempt.
grpc::Status RegisterOnce(const std::string& address, TlsPem tls, std::string secret, bool* registered) {
  v1::Register reg;
  reg.set_worker_id("probe");
  reg.set_dp(1);
  reg.set_attn_tp(1);
  reg.set_vocab_size(kVocab);
  WorkerLinkClient link({.coordinator = address,
                         .registration = reg,
                         .reconnect = false,
                         .secret = std::move(secret),
                         .tls = std::move(tls)});
  const auto end = std::chrono::steady_clock::now() + 15s;
  *registered = false;
  while (std::chrono::steady_clock::now() < end) {
    link.WaitUntil(std::chrono::steady_clock::now() + 100ms);
    for (WorkerLinkEvent& e : link.Drain()) {
      if (e.message.has_registered()) *registered = true;
      if (e.ended) return e.status;
    }
    if (*registered) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "no answer in 15 s");
}

TEST_F(Security, WorkersAuthenticateByClientCertificateOrSecret) {
  const Pki& p = GetPki();
  // Beyond loopback a CA for client certificates stands in for the secret.
  auto coord = Coordinator::Start({.listen = "0.0.0.0:0", .tls = ServerTls(true)});
  ASSERT_TRUE(coord.ok()) << coord.status();
  const std::string address = "127.0.0.1:" + (*coord)->address().substr((*coord)->address().rfind(':') + 1);
  bool registered = false;
  grpc::Status st = RegisterOnce(address, ClientTls(p.ca, p.worker_cert, p.worker_key), "", &registered);
  EXPECT_TRUE(registered) << st.error_message();

  st = RegisterOnce(address, ClientTls(p.ca), "", &registered);
  EXPECT_FALSE(registered);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  EXPECT_NE(st.error_message().find("client certificate signed by its --tls-ca"), std::string::npos)
      << st.error_message();

  // A certificate of another CA fails the handshake: nothing is read.
  st = RegisterOnce(address, ClientTls(p.ca, p.rogue_cert, p.rogue_key), "", &registered);
  EXPECT_FALSE(registered);
  EXPECT_NE(st.error_code(), grpc::StatusCode::OK);

  // With a secret as well, either one admits a worker; a wrong secret
  // without a certificate does not.
  auto both = Coordinator::Start(
      {.listen = "127.0.0.1:0", .worker_secret = "s3cret-value-of-the-link", .tls = ServerTls(true)});
  ASSERT_TRUE(both.ok()) << both.status();
  RegisterOnce((*both)->address(), ClientTls(p.ca), "s3cret-value-of-the-link", &registered);
  EXPECT_TRUE(registered);
  RegisterOnce((*both)->address(), ClientTls(p.ca, p.worker_cert, p.worker_key), "", &registered);
  EXPECT_TRUE(registered);
  st = RegisterOnce((*both)->address(), ClientTls(p.ca), "wrong", &registered);
  EXPECT_FALSE(registered);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  st = RegisterOnce((*both)->address(), ClientTls(p.ca), "", &registered);
  EXPECT_FALSE(registered);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(st.error_message().find("worker secret (--worker-secret-file) or a client certificate"), std::string::npos)
      << st.error_message();
}

TEST_F(Security, StartRefusesAnOpenWorkerLinkBeyondLoopbackAndACaWithoutACertificate) {
  auto open = Coordinator::Start({.listen = "0.0.0.0:0"});
  EXPECT_EQ(open.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(open.status().message().find("--tls-ca"), std::string::npos) << open.status();
  TlsPem ca_only;
  ca_only.ca = ReadFile(GetPki().ca);
  auto bad = Coordinator::Start({.listen = "127.0.0.1:0", .tls = ca_only});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--tls-ca needs --tls-cert"), std::string::npos) << bad.status();
}

// ---- Bearer tokens -------------------------------------------------------------------------

constexpr char kAlice[] = "alice-token-0123456789abcdef";
constexpr char kBob[] = "bob-token-fedcba9876543210xyz";

AuthTokens AliceAndBob() { return AuthTokens({{.token = kAlice, .name = "alice"}, {.token = kBob, .name = "bob"}}); }

TEST_F(Security, TokensAreRequiredForGenerateCancelAndStatsButNotHealth) {
  auto coord = Coordinator::Start({.listen = "127.0.0.1:0", .auth_tokens = AliceAndBob()});
  ASSERT_TRUE(coord.ok()) << coord.status();
  SimWorkerThread sim(Sim((*coord)->address()));
  auto stub = v1::Mlarun::NewStub(client_internal::MakeChannel((*coord)->address()));
  ASSERT_TRUE(WaitConnected(*stub)) << sim.log();  // Health needs no token

  const std::vector<int32_t> prompt = {9, 8, 7};
  const Call none = Generate(*stub, {}, "", prompt, 4);
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(none.status.error_message().find("--auth-token-file"), std::string::npos) << none.status.error_message();
  EXPECT_TRUE(none.tokens.empty());
  const Call wrong = Generate(*stub, {.token = "not-a-token-of-this-coordinator"}, "", prompt, 4);
  EXPECT_EQ(wrong.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  {
    // Another scheme with a right token.
    grpc::ClientContext ctx;
    client_internal::SetDeadline(ctx, 10);
    ctx.AddMetadata("authorization", std::string("Basic ") + kAlice);
    v1::GenerateRequest req;
    req.add_prompt_ids(1);
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  const Call alice = Generate(*stub, {.token = kAlice}, "", prompt, 4);
  ASSERT_TRUE(alice.status.ok()) << alice.status.error_message();
  EXPECT_EQ(alice.tokens, SimTokens(prompt, 4));

  for (const std::string& token : {std::string(), std::string("wrong-token-wrong-token")}) {
    grpc::ClientContext ctx;
    client_internal::SetDeadline(ctx, 10);
    client_internal::AddCredentials(ctx, {.token = token});
    v1::GetStatsResponse stats;
    EXPECT_EQ(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext cctx;
    client_internal::SetDeadline(cctx, 10);
    client_internal::AddCredentials(cctx, {.token = token});
    v1::CancelRequest cancel;
    cancel.set_request_id(alice.id);
    v1::CancelResponse cr;
    EXPECT_EQ(stub->Cancel(&cctx, cancel, &cr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // An authenticated caller sees the details.
  grpc::ClientContext ctx;
  client_internal::SetDeadline(ctx, 10);
  client_internal::AddCredentials(ctx, {.token = kBob});
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  ASSERT_GT(stats.ranks_size(), 0);
  EXPECT_FALSE(stats.ranks(0).host().empty());
  EXPECT_EQ(stats.groups(0).worker_id(), "sim-secure");

  // `mlarun stats --auth-token-file`'s path: with the token it prints, without it fails naming the code.
  StatsOptions so;
  so.coordinator = (*coord)->address();
  so.json = true;
  so.security.token = kAlice;
  std::ostringstream out, err;
  EXPECT_EQ(RunStats(so, out, err), 0) << err.str();
  so.security.token.clear();
  std::ostringstream out2, err2;
  EXPECT_NE(RunStats(so, out2, err2), 0);
  EXPECT_NE(err2.str().find("UNAUTHENTICATED"), std::string::npos) << err2.str();
}

bool CancelAs(v1::Mlarun::Stub& stub, const char* token, const std::string& id) {
  grpc::ClientContext ctx;
  client_internal::SetDeadline(ctx, 10);
  client_internal::AddCredentials(ctx, {.token = token});
  v1::CancelRequest req;
  req.set_request_id(id);
  v1::CancelResponse resp;
  EXPECT_TRUE(stub.Cancel(&ctx, req, &resp).ok());
  return resp.found();
}

TEST_F(Security, RequestIdsAndCancelsArePerPrincipal) {
  auto coord = Coordinator::Start({.listen = "127.0.0.1:0", .auth_tokens = AliceAndBob()});
  ASSERT_TRUE(coord.ok()) << coord.status();
  SimWorkerThread sim(Sim((*coord)->address(), /*tokens_per_s=*/40));  // slow: requests stay live
  auto stub = v1::Mlarun::NewStub(client_internal::MakeChannel((*coord)->address()));
  ASSERT_TRUE(WaitConnected(*stub)) << sim.log();

  const std::vector<int32_t> pa = {1, 2, 3}, pb = {4, 5, 6};
  Call alice, bob;
  grpc::ClientContext alice_ctx, bob_ctx;
  std::thread ta([&] { alice = Generate(*stub, {.token = kAlice}, "shared", pa, 400, &alice_ctx); });
  // Bob uses the same id while Alice's request is live: his own namespace.
  std::this_thread::sleep_for(300ms);
  std::thread tb([&] { bob = Generate(*stub, {.token = kBob}, "shared", pb, 12, &bob_ctx); });
  std::this_thread::sleep_for(300ms);

  // Alice again with her live id: ALREADY_EXISTS, for her only.
  const Call again = Generate(*stub, {.token = kAlice}, "shared", pa, 2);
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << again.status.error_message();

  // Bob cannot cancel Alice's (he cancels his own "shared" only after his
  // finished, when it is gone), and Alice's cancel takes hers.
  tb.join();
  ASSERT_TRUE(bob.status.ok()) << bob.status.error_message();
  EXPECT_EQ(bob.id, "shared");
  EXPECT_EQ(bob.tokens, SimTokens(pb, 12));
  EXPECT_FALSE(CancelAs(*stub, kBob, "shared"));
  EXPECT_TRUE(CancelAs(*stub, kAlice, "shared"));
  ta.join();
  EXPECT_EQ(alice.status.error_code(), grpc::StatusCode::CANCELLED) << alice.status.error_message();
  EXPECT_LT(alice.tokens.size(), 400u);
  EXPECT_FALSE(CancelAs(*stub, kAlice, "shared"));  // gone now

  // Generated ids are random: nothing to guess from one's own.
  const Call g1 = Generate(*stub, {.token = kBob}, "", pb, 1);
  const Call g2 = Generate(*stub, {.token = kBob}, "", pb, 1);
  ASSERT_TRUE(g1.status.ok() && g2.status.ok());
  EXPECT_EQ(g1.id.size(), 36u) << g1.id;
  EXPECT_NE(g1.id, g2.id);
}

// ---- The prefix cache between principals -----------------------------------------

// The salt is SHA-256's first 8 bytes (little-endian) over a fixed label and
// both strings, each after its length as 8 little-endian bytes: checked
// against the openssl command line's digest. Both empty is 0 (unsalted);
// moving bytes between the two strings changes it.
TEST(PrefixCacheSalt, IsTheSha256OfBothLengthPrefixed) {
  EXPECT_EQ(PrefixCacheSalt("", ""), 0u);
  std::mt19937_64 rng(20261210);
  auto random_bytes = [&](size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  const fs::path file = fs::path(::testing::TempDir()) / ("mlarun_salt_" + std::to_string(getpid()));
  for (const auto& [principal, salt] : std::vector<std::pair<std::string, std::string>>{
           {"alice", ""}, {"", "x"}, {"bob", std::string(256, '\xff')}, {random_bytes(13), random_bytes(201)}}) {
    std::string message = "mlarun prefix cache salt";
    for (const std::string& part : {principal, salt}) {
      for (int i = 0; i < 8; ++i) message.push_back(static_cast<char>(static_cast<uint64_t>(part.size()) >> (8 * i)));
      message += part;
    }
    std::ofstream(file, std::ios::binary) << message;
    FILE* p = popen(("openssl dgst -sha256 -r " + file.string()).c_str(), "r");
    ASSERT_NE(p, nullptr);
    char hex[65] = {};
    ASSERT_EQ(fread(hex, 1, 64, p), 64u);
    pclose(p);
    uint64_t expected = 0;
    for (int i = 0; i < 8; ++i)
      expected |= static_cast<uint64_t>(std::stoul(std::string(hex + 2 * i, 2), nullptr, 16)) << (8 * i);
    EXPECT_EQ(PrefixCacheSalt(principal, salt), expected) << principal.size() << " + " << salt.size() << " bytes";
  }
  fs::remove(file);
  EXPECT_NE(PrefixCacheSalt("ab", "c"), PrefixCacheSalt("a", "bc"));
  EXPECT_NE(PrefixCacheSalt("alice", ""), PrefixCacheSalt("", "alice"));
}

std::vector<int32_t> RandomTokens(std::mt19937_64& rng, size_t n) {
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % kVocab);
  return t;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A prompt's cached prefix is reused by its own principal only, and by every
// principal with --prefix-cache-shared-across-principals; a cache_salt
// narrows reuse to the requests that send the same one. Bob learns nothing
// of Alice's prompts from his prefix hits (or his time to first token).
TEST(PrefixCacheIsolation, PrincipalsShareCachedPrefixesOnlyWhenOptedIn) {
  std::mt19937_64 rng(20261207);
  for (const bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared across principals" : "per principal");
    CoordinatorOptions o{.listen = "127.0.0.1:0", .auth_tokens = AliceAndBob()};
    o.prefix_cache_shared_across_principals = shared;
    auto coord = Coordinator::Start(o);
    ASSERT_TRUE(coord.ok()) << coord.status();
    SimWorkerOptions so = Sim((*coord)->address());
    so.block_size = 16;
    SimWorkerThread sim(so);
    auto stub = v1::Mlarun::NewStub(client_internal::MakeChannel((*coord)->address()));
    ASSERT_TRUE(WaitConnected(*stub)) << sim.log();

    // 70 tokens: 4 full blocks reusable, the last 6 tokens always computed.
    const std::vector<int32_t> prompt = RandomTokens(rng, 70);
    const int64_t reusable = 64;
    auto hits = [&](const char* token, const std::string& cache_salt) {
      const Call c = Generate(*stub, {.token = token}, "", prompt, 2, nullptr, cache_salt);
      EXPECT_TRUE(c.status.ok()) << c.status.error_message();
      EXPECT_EQ(c.tokens, SimTokens(prompt, 2));
      return c.prefix_hit_tokens;
    };
    EXPECT_EQ(hits(kAlice, ""), 0);
    EXPECT_EQ(hits(kBob, ""), shared ? reusable : 0);
    EXPECT_EQ(hits(kAlice, ""), reusable);
    EXPECT_EQ(hits(kBob, ""), reusable);
    EXPECT_EQ(hits(kAlice, "salt-1"), 0);
    EXPECT_EQ(hits(kAlice, "salt-1"), reusable);
    EXPECT_EQ(hits(kBob, "salt-1"), shared ? reusable : 0);
    EXPECT_EQ(hits(kBob, "salt-2"), 0);
    (*coord)->Shutdown();
  }
}

// prefix_affinity keeps a principal's common prefix on the group that caches
// it, against the load, and sends no other principal there for it: another
// principal's copy of the prompt is routed as a prompt nobody has sent.
TEST(PrefixCacheIsolation, AffinityFollowsAPrincipalsPrefixAndNoOneElses) {
  auto coord = Coordinator::Start({.listen = "127.0.0.1:0", .auth_tokens = AliceAndBob()});
  ASSERT_TRUE(coord.ok()) << coord.status();
  SimWorkerOptions so = Sim((*coord)->address(), /*tokens_per_s=*/200);
  so.groups = 2;
  so.block_size = 16;
  SimWorkerThread sim(so);
  auto stub = v1::Mlarun::NewStub(client_internal::MakeChannel((*coord)->address()));
  ASSERT_TRUE(WaitConnected(*stub)) << sim.log();
  auto stats = [&] {
    grpc::ClientContext ctx;
    client_internal::SetDeadline(ctx, 10);
    client_internal::AddCredentials(ctx, {.token = kAlice});
    v1::GetStatsResponse r;
    EXPECT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &r).ok());
    return r;
  };
  // Both groups idle, with all their blocks free, as they last reported.
  auto idle = [&] {
    for (int i = 0; i < 200; ++i) {
      const v1::GetStatsResponse s = stats();
      if (s.groups_size() == 2 && s.groups(0).requests_in_flight() == 0 && s.groups(1).requests_in_flight() == 0 &&
          s.groups(0).free_blocks() == so.cache_blocks && s.groups(1).free_blocks() == so.cache_blocks)
        return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  };
  ASSERT_TRUE(idle());

  std::mt19937_64 rng(20261208);
  const std::vector<int32_t> prefix = RandomTokens(rng, 48);  // 3 blocks
  const std::vector<int32_t> first = Concat(prefix, RandomTokens(rng, 5)),
                             second = Concat(prefix, RandomTokens(rng, 7));
  // Bob's long request keeps one group busy, so Alice's first goes to the other.
  const std::vector<int32_t> filler_prompt = RandomTokens(rng, 20);
  Call filler;
  grpc::ClientContext filler_ctx;
  std::thread t([&] { filler = Generate(*stub, {.token = kBob}, "", filler_prompt, 3000, &filler_ctx); });
  int busy = -1;
  for (int i = 0; i < 200 && busy < 0; ++i) {
    const v1::GetStatsResponse s = stats();
    for (const v1::GroupStats& g : s.groups())
      if (g.requests_in_flight() > 0) busy = g.dp_group();
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GE(busy, 0);
  const Call a1 = Generate(*stub, {.token = kAlice}, "", first, 1);
  ASSERT_TRUE(a1.status.ok()) << a1.status.error_message();
  EXPECT_NE(a1.dp_group, busy);
  EXPECT_EQ(a1.prefix_hit_tokens, 0);
  filler_ctx.TryCancel();
  t.join();
  EXPECT_EQ(filler.status.error_code(), grpc::StatusCode::CANCELLED);
  // Idle again: least loaded would now pick the filler's group (the first
  // of equals, as it was for the filler).
  ASSERT_TRUE(idle());
  const Call a2 = Generate(*stub, {.token = kAlice}, "", second, 1);
  ASSERT_TRUE(a2.status.ok()) << a2.status.error_message();
  EXPECT_EQ(a2.dp_group, a1.dp_group) << "affinity lost Alice's prefix";
  EXPECT_EQ(a2.prefix_hit_tokens, 48);
  ASSERT_TRUE(idle());
  const Call b = Generate(*stub, {.token = kBob}, "", first, 1);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(b.dp_group, busy) << "Bob's copy of Alice's prompt followed her prefix";
  EXPECT_EQ(b.prefix_hit_tokens, 0);
}

// A non-loopback IPv4 address of this machine, or "" (none).
std::string LocalNonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf)) != nullptr && std::string(buf).rfind("127.", 0) != 0)
      found = buf;
  }
  freeifaddrs(list);
  return found;
}

TEST_F(Security, WithoutTokensOnlyLoopbackCallersSeeStatsDetails) {
  const std::string local = LocalNonLoopbackAddress();
  if (local.empty()) GTEST_SKIP() << "this machine has no non-loopback IPv4 address to call from";
  auto coord = Coordinator::Start({.listen = "0.0.0.0:0", .worker_secret = "s3cret-value-of-the-link"});
  ASSERT_TRUE(coord.ok()) << coord.status();
  const std::string port = (*coord)->address().substr((*coord)->address().rfind(':') + 1);
  SimWorkerOptions so = Sim("127.0.0.1:" + port);
  so.worker_secret = "s3cret-value-of-the-link";
  SimWorkerThread sim(so);
  auto near = v1::Mlarun::NewStub(client_internal::MakeChannel("127.0.0.1:" + port));
  ASSERT_TRUE(WaitConnected(*near)) << sim.log();
  auto far = v1::Mlarun::NewStub(client_internal::MakeChannel(local + ":" + port));
  auto stats = [](v1::Mlarun::Stub& stub) {
    grpc::ClientContext ctx;
    client_internal::SetDeadline(ctx, 10);
    v1::GetStatsResponse r;
    EXPECT_TRUE(stub.GetStats(&ctx, v1::GetStatsRequest(), &r).ok());
    return r;
  };
  const v1::GetStatsResponse n = stats(*near), f = stats(*far);
  ASSERT_GT(n.ranks_size(), 0);
  ASSERT_EQ(f.ranks_size(), n.ranks_size());
  EXPECT_FALSE(n.ranks(0).host().empty());
  EXPECT_EQ(n.groups(0).worker_id(), "sim-secure");
  EXPECT_TRUE(f.ranks(0).host().empty());
  EXPECT_TRUE(f.ranks(0).model().empty());
  EXPECT_EQ(f.ranks(0).worker_id(), "worker-0");
  EXPECT_EQ(f.groups(0).worker_id(), "worker-0");
  // The figures themselves are there.
  EXPECT_EQ(f.ranks(0).cache_blocks_total(), n.ranks(0).cache_blocks_total());
  EXPECT_GT(f.ranks(0).moe_weight_bytes(), 0);
}

}  // namespace
}  // namespace mlarun
