// The coordinator over real gRPC on 127.0.0.1 (port 0), with fake DP groups:
// in-process WorkerLink clients (the workers' own, serving/link/) that
// answer routed requests with tokens derived from the prompt and seed. Every
// client call carries a deadline, so a bug shows up as a failure, never as a
// hang.
#include "serving/coordinator/coordinator.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "kv/latent_cache.h"
#include "mlarun.grpc.pb.h"
#include "serving/coordinator/router.h"
#include "serving/link/worker_link_client.h"

namespace mlarun {
namespace {

using namespace std::chrono_literals;
using Ms = std::chrono::milliseconds;
using SysClock = std::chrono::system_clock;

// The fake groups' tokens: a function of prompt, seed and index only.
int64_t ExpectedToken(const std::vector<int32_t>& prompt, uint64_t seed, int64_t index, int64_t vocab) {
  int64_t sum = 0;
  for (int32_t t : prompt) sum += t;
  return static_cast<int64_t>((static_cast<uint64_t>(sum) + seed + static_cast<uint64_t>(index)) %
                              static_cast<uint64_t>(vocab));
}

std::vector<int32_t> ToVector(const google::protobuf::RepeatedField<int32_t>& f) { return {f.begin(), f.end()}; }

// ---- A fake DP group --------------------------------------------------------

struct FakeWorkerOptions {
  std::string worker_id = "fake";
  int32_t dp_group = 0;
  int64_t vocab_size = 1000;
  int64_t max_position_embeddings = 4096;
  int64_t block_size = 4;
  int64_t cache_blocks = 256;
  int ranks = 1;                    // RankStats sent at registration (worker_id left empty on purpose)
  Ms token_delay{0};                // between steps (one token for every running request per step)
  int64_t stall_after = -1;         // tokens per request before going silent forever; -1: never
  bool hold = false;                // routed requests stay silent until Release()
  bool ignore_migrate_out = false;  // never answer MigrateOut (a group that dies mid-move)
  // Register.transfer_descriptors (one per rank); with them, a move's
  // Exported names blocks 100.. holding all but the last token.
  std::vector<std::string> descriptors;
  std::string role;  // Register.role
  // Register.exports_prefixes: ExportPrefix is answered with every token
  // asked for as cached, in blocks 200.. (unless hold_prefixes).
  bool exports_prefixes = false;
  // Asks are kept unanswered until AnswerPrefixes() (a slow or dying source).
  bool hold_prefixes = false;
  // Changes each PrefixExported before it is sent (the forged-answer tests).
  std::function<void(v1::PrefixExported&)> edit_prefix_exported;
  // Changes each Exported before it is sent (the forged-answer tests).
  std::function<void(v1::Exported&)> edit_exported;
  int32_t reject_code = 0;  // answer every request with this error (RequestDone.error_code)
  std::string reject_message;
  std::string secret;  // sent as the worker secret when not empty
  // Changes the registration before it is sent (the refusal tests).
  std::function<void(v1::Register&)> edit_register;
  // Changes each step's batch before it is sent (the forged-token tests);
  // `done` is the step's completions.
  std::function<void(v1::WorkerMessage& batch, std::vector<v1::WorkerMessage>& done)> edit_step;
};

// One WorkerLink stream through the workers' own link client (never
// reconnecting by itself) and a stepper thread that drains it: routes,
// cancels, and one token per running request per step, in one TokenBatch.
class FakeWorker {
 public:
  FakeWorker(std::string address, FakeWorkerOptions o) : address_(std::move(address)), options_(std::move(o)) {}
  ~FakeWorker() { Stop(); }

  FakeWorkerOptions& options() { return options_; }  // change only while disconnected

  // Opens the stream, registers, and waits for Registered. Like a worker's
  // back-off, tries again for a while when the coordinator has not yet seen
  // this group's previous stream end (ALREADY_EXISTS).
  bool Connect() {
    for (int attempt = 0;; ++attempt) {
      if (ConnectOnce()) return true;
      if (end_status().error_code() != grpc::StatusCode::ALREADY_EXISTS || attempt == 50) return false;
      Disconnect();
      std::this_thread::sleep_for(20ms);
    }
  }
  // One attempt, whatever it answers.
  bool ConnectOnce() {
    Disconnect();  // a refused attempt's stepper has returned; joined here
    {
      std::lock_guard lock(mu_);
      stop_ = ended_ = registered_ = false;
      hold_ = options_.hold;
      jobs_.clear();
    }
    v1::Register r;
    r.set_worker_id(options_.worker_id);
    r.set_dp_group(options_.dp_group);
    r.set_dp(options_.dp_group + 1);
    r.set_attn_tp(options_.ranks);
    r.set_vocab_size(options_.vocab_size);
    r.set_max_position_embeddings(options_.max_position_embeddings);
    r.set_block_size(options_.block_size);
    r.set_cache_blocks_total(options_.cache_blocks);
    for (int i = 0; i < options_.ranks; ++i) {
      v1::RankStats* s = r.add_ranks();
      s->set_rank(options_.dp_group * options_.ranks + i);
      s->set_dp_group(options_.dp_group);
      s->set_attn_tp_rank(i);
      s->set_cache_blocks_total(options_.cache_blocks);
    }
    for (const std::string& d : options_.descriptors) r.add_transfer_descriptors(d);
    r.set_role(options_.role);
    r.set_exports_prefixes(options_.exports_prefixes);
    if (options_.edit_register) options_.edit_register(r);
    link_ = std::make_unique<WorkerLinkClient>(WorkerLinkClient::Options{
        .coordinator = address_, .registration = std::move(r), .reconnect = false, .secret = options_.secret});
    stepper_ = std::thread([this] { StepLoop(); });
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 5s, [this] { return registered_ || ended_; }) && registered_;
  }

  // Breaks the stream as a crashing worker would (the link cancels the call).
  void Break() { Disconnect(); }

  // Says the group cannot continue (`leaving`, as a worker whose rank failed
  // for good) and waits for the coordinator to end the stream; returns the
  // stream's final status.
  grpc::Status Leave(const std::string& reason) {
    if (link_ == nullptr) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "not connected");
    link_->Leave(reason, 5.0);
    grpc::Status status(grpc::StatusCode::DEADLINE_EXCEEDED, "the stream did not end");
    {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, 5s, [this] { return ended_; })) status = end_status_;
    }
    Disconnect();
    return status;
  }

  // Closes the stream cleanly (the coordinator sees the end of the reads).
  void Stop() {
    if (link_ == nullptr) return;
    link_->Leave("", 5.0);
    Disconnect();
  }

  void SendStats(int64_t free_blocks) {
    v1::WorkerMessage m;
    m.mutable_stats()->set_free_blocks(free_blocks);
    link_->Send(m);
  }
  // While set, newly routed requests stay silent; clearing it releases them.
  void SetHold(bool hold) {
    {
      std::lock_guard lock(mu_);
      hold_ = hold;
    }
    if (link_ != nullptr) link_->Wake();
  }

  bool WaitRoutes(size_t n, Ms timeout = 5s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return routes_.size() >= n; });
  }
  bool WaitCancel(const std::string& id, Ms timeout = 5s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return cancels_.count(id) > 0; });
  }
  std::vector<std::string> routes() {
    std::lock_guard lock(mu_);
    return routes_;
  }
  // The MoveSource a request was routed here with (nullopt: none).
  std::optional<v1::MoveSource> source(const std::string& id) {
    std::lock_guard lock(mu_);
    auto it = sources_.find(id);
    return it == sources_.end() ? std::nullopt : std::optional<v1::MoveSource>(it->second);
  }
  // Whether ReleaseExported came for `id`.
  bool WaitReleased(const std::string& id, Ms timeout = 5s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return released_.count(id) > 0; });
  }
  // The generated_ids a request was routed here with (empty: a new one).
  std::vector<int32_t> resumed(const std::string& id) {
    std::lock_guard lock(mu_);
    return resumed_.count(id) ? resumed_[id] : std::vector<int32_t>{};
  }
  std::set<std::string> cancels() {
    std::lock_guard lock(mu_);
    return cancels_;
  }
  // ExportPrefix asks received (answered or held), in order.
  std::vector<v1::ExportPrefix> prefix_asks() {
    std::lock_guard lock(mu_);
    return prefix_asks_;
  }
  bool WaitPrefixAsks(size_t n, Ms timeout = 5s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return prefix_asks_.size() >= n; });
  }
  // Answers the asks held so far (FakeWorkerOptions::hold_prefixes).
  void AnswerPrefixes() {
    std::lock_guard lock(mu_);
    for (const v1::ExportPrefix& ask : held_asks_) AnswerPrefix(ask);
    held_asks_.clear();
  }
  // Whether ReleasePrefix came for `export_id`.
  bool WaitPrefixReleased(uint64_t export_id, Ms timeout = 5s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return prefix_released_.count(export_id) > 0; });
  }
  std::string coordinator_id() {
    std::lock_guard lock(mu_);
    return coordinator_id_;
  }
  // How the last stream ended (OK while it lasts).
  grpc::Status end_status() {
    std::lock_guard lock(mu_);
    return ended_ ? end_status_ : grpc::Status::OK;
  }
  // Waits for the stream to end; its status (DEADLINE_EXCEEDED if it did not).
  grpc::Status WaitEnded(Ms timeout = 5s) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [this] { return ended_; }))
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the stream did not end");
    return end_status_;
  }

 private:
  struct Job {
    std::string id;
    std::vector<int32_t> prompt;
    uint64_t seed = 0;
    int64_t max_tokens = 0;
    int64_t sent = 0;
    bool held = false;
  };

  // Stops the stepper, then drops the link (cancelling a call still open).
  void Disconnect() {
    if (link_ == nullptr) return;
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    link_->Wake();
    if (stepper_.joinable()) stepper_.join();
    link_.reset();
  }

  // REQUIRES mu_. A held job runs once SetHold(false) was called.
  bool Runnable(const Job& j) const {
    return (!j.held || !hold_) && (options_.stall_after < 0 || j.sent < options_.stall_after);
  }

  // REQUIRES mu_.
  void Handle(const WorkerLinkEvent& e) {
    const v1::CoordinatorMessage& m = e.message;
    if (e.ended) {
      ended_ = true;
      end_status_ = e.status;
    } else if (m.has_registered()) {
      registered_ = true;
      coordinator_id_ = m.registered().coordinator_id();
    } else if (m.has_route()) {
      routes_.push_back(m.route().request_id());
      if (options_.reject_code != 0) {
        v1::WorkerMessage done;
        done.mutable_done()->set_request_id(m.route().request_id());
        done.mutable_done()->set_error_code(options_.reject_code);
        done.mutable_done()->set_error_message(options_.reject_message);
        link_->Send(done);
      } else {
        // A resumed request goes on from the tokens it has.
        resumed_[m.route().request_id()] = ToVector(m.route().generated_ids());
        if (m.route().has_move_source()) sources_[m.route().request_id()] = m.route().move_source();
        jobs_.push_back(Job{.id = m.route().request_id(),
                            .prompt = ToVector(m.route().prompt_ids()),
                            .seed = m.route().sampling().seed(),
                            .max_tokens = m.route().sampling().max_tokens(),
                            .sent = m.route().generated_ids_size(),
                            .held = hold_});
      }
    } else if (m.has_migrate_out()) {
      auto it =
          std::find_if(jobs_.begin(), jobs_.end(), [&](const Job& j) { return j.id == m.migrate_out().request_id(); });
      if (options_.ignore_migrate_out || it == jobs_.end()) return;
      v1::WorkerMessage x;
      x.mutable_exported()->set_request_id(it->id);
      x.mutable_exported()->set_tokens(it->sent);
      if (!options_.descriptors.empty()) {
        const int64_t cached = static_cast<int64_t>(it->prompt.size()) + it->sent - 1;
        x.mutable_exported()->set_cached_tokens(cached);
        for (int64_t b = 0; b < (cached + options_.block_size - 1) / options_.block_size; ++b)
          x.mutable_exported()->add_block_ids(static_cast<int32_t>(100 + b));
      }
      if (options_.edit_exported) options_.edit_exported(*x.mutable_exported());
      link_->Send(x);
      jobs_.erase(it);
    } else if (m.has_release_exported()) {
      released_.insert(m.release_exported().request_id());
    } else if (m.has_export_prefix()) {
      prefix_asks_.push_back(m.export_prefix());
      if (options_.hold_prefixes) {
        held_asks_.push_back(m.export_prefix());
      } else {
        AnswerPrefix(m.export_prefix());
      }
    } else if (m.has_release_prefix()) {
      prefix_released_.insert(m.release_prefix().export_id());
    } else if (m.has_cancel()) {
      cancels_.insert(m.cancel().request_id());
      std::erase_if(jobs_, [&](const Job& j) { return j.id == m.cancel().request_id(); });
    }
  }

  // REQUIRES mu_.
  void AnswerPrefix(const v1::ExportPrefix& ask) {
    v1::WorkerMessage x;
    v1::PrefixExported* e = x.mutable_prefix_exported();
    e->set_export_id(ask.export_id());
    e->set_cached_tokens(ask.token_ids_size());
    for (int64_t b = 0; b < ask.token_ids_size() / options_.block_size; ++b)
      e->add_block_ids(static_cast<int32_t>(200 + b));
    if (options_.edit_prefix_exported) options_.edit_prefix_exported(*e);
    link_->Send(x);
  }

  void StepLoop() {
    while (true) {
      std::deque<WorkerLinkEvent> events = link_->Drain();
      std::unique_lock lock(mu_);
      for (const WorkerLinkEvent& e : events) Handle(e);
      cv_.notify_all();
      if (stop_ || ended_) return;
      if (std::none_of(jobs_.begin(), jobs_.end(), [this](const Job& j) { return Runnable(j); })) {
        lock.unlock();
        link_->WaitUntil(WorkerLinkClient::Clock::now() + 1s);
        continue;
      }
      v1::WorkerMessage batch;
      std::vector<v1::WorkerMessage> dones;
      for (auto it = jobs_.begin(); it != jobs_.end();) {
        if (!Runnable(*it)) {
          ++it;
          continue;
        }
        v1::TokenEvent* ev = batch.mutable_tokens()->add_events();
        ev->set_request_id(it->id);
        ev->set_token_id(ExpectedToken(it->prompt, it->seed, it->sent, options_.vocab_size));
        ev->set_logprob(-0.5);
        if (++it->sent == it->max_tokens) {
          v1::WorkerMessage& d = dones.emplace_back();
          d.mutable_done()->set_request_id(it->id);
          d.mutable_done()->set_finish_reason("length");
          d.mutable_done()->set_prefix_hit_tokens(0);
          it = jobs_.erase(it);
        } else {
          ++it;
        }
      }
      lock.unlock();
      if (options_.edit_step) options_.edit_step(batch, dones);
      link_->Send(batch);
      for (const auto& d : dones) link_->Send(d);
      if (options_.token_delay.count() > 0) std::this_thread::sleep_for(options_.token_delay);
    }
  }

  const std::string address_;
  FakeWorkerOptions options_;
  std::unique_ptr<WorkerLinkClient> link_;  // set and reset by the test thread, while no stepper runs
  std::thread stepper_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, ended_ = false, registered_ = false, hold_ = false;
  grpc::Status end_status_;  // once ended_
  std::string coordinator_id_;
  std::vector<Job> jobs_;
  std::vector<std::string> routes_;
  std::map<std::string, std::vector<int32_t>> resumed_;
  std::map<std::string, v1::MoveSource> sources_;
  std::set<std::string> released_;
  std::set<std::string> cancels_;
  std::vector<v1::ExportPrefix> prefix_asks_, held_asks_;
  std::set<uint64_t> prefix_released_;
};

// ---- Client helpers ------------------------------------------------------------

v1::GenerateRequest MakeRequest(std::vector<int32_t> prompt, int64_t max_tokens, uint64_t seed = 0,
                                std::string id = "") {
  v1::GenerateRequest r;
  r.set_request_id(std::move(id));
  for (int32_t t : prompt) r.add_prompt_ids(t);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_seed(seed);
  return r;
}

struct GenResult {
  grpc::Status status;
  std::vector<v1::Token> tokens;
  std::optional<v1::Finished> finished;
  std::set<std::string> ids;  // request_id of every response
  int after_finished = 0;     // responses after Finished (must be 0)
  std::vector<v1::PromptLogprobs> prompt_logprobs;
  int prompt_after_token = 0;  // prompt logprobs after a token (must be 0)
  double elapsed_ms = 0;
};

GenResult Generate(v1::Mlarun::Stub& stub, const v1::GenerateRequest& req, Ms timeout = 10s) {
  GenResult res;
  const auto start = std::chrono::steady_clock::now();
  grpc::ClientContext ctx;
  ctx.set_deadline(SysClock::now() + timeout);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    res.ids.insert(resp.request_id());
    if (res.finished) ++res.after_finished;
    if (resp.has_token()) res.tokens.push_back(resp.token());
    if (resp.has_finished()) res.finished = resp.finished();
    if (resp.has_prompt_logprobs()) {
      res.prompt_logprobs.push_back(resp.prompt_logprobs());
      res.prompt_after_token += !res.tokens.empty();
    }
  }
  res.status = reader->Finish();
  res.elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return res;
}

// Checks a successful result against the fake groups' token function.
void ExpectServed(const GenResult& r, const std::vector<int32_t>& prompt, uint64_t seed, int64_t max_tokens,
                  int64_t vocab = 1000) {
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << " " << r.status.error_message();
  ASSERT_EQ(static_cast<int64_t>(r.tokens.size()), max_tokens);
  for (int64_t i = 0; i < max_tokens; ++i) {
    EXPECT_EQ(r.tokens[static_cast<size_t>(i)].index(), i);
    EXPECT_EQ(r.tokens[static_cast<size_t>(i)].token_id(), ExpectedToken(prompt, seed, i, vocab)) << i;
  }
  ASSERT_TRUE(r.finished.has_value());
  EXPECT_EQ(r.finished->finish_reason(), "length");
  EXPECT_EQ(r.finished->completion_tokens(), max_tokens);
  EXPECT_EQ(r.finished->prompt_tokens(), static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(r.after_finished, 0);
  EXPECT_EQ(r.ids.size(), 1u);
}

// Runs a Generate call on its own thread (for calls that wait).
class AsyncGenerate {
 public:
  AsyncGenerate(v1::Mlarun::Stub& stub, v1::GenerateRequest req, Ms timeout = 10s)
      : thread_([this, &stub, req = std::move(req), timeout] { result_ = Generate(stub, req, timeout); }) {}
  ~AsyncGenerate() {
    if (thread_.joinable()) thread_.join();
  }
  const GenResult& Get() {
    if (thread_.joinable()) thread_.join();
    return result_;
  }

 private:
  GenResult result_;
  std::thread thread_;
};

// True once `count` reaches `n`, false after `within`.
bool WaitForCount(const std::atomic<int>& count, int n, Ms within) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (count < n && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(1ms);
  return count >= n;
}

// A streaming Generate on its own thread that counts the tokens as they
// arrive, so a test can act between them.
class StreamingGenerate {
 public:
  StreamingGenerate(v1::Mlarun::Stub& stub, v1::GenerateRequest req, Ms timeout = 10s)
      : thread_([this, &stub, req = std::move(req), timeout] {
          grpc::ClientContext ctx;
          ctx.set_deadline(SysClock::now() + timeout);
          auto reader = stub.Generate(&ctx, req);
          v1::GenerateResponse resp;
          while (reader->Read(&resp)) tokens_ += resp.has_token();
          status_ = reader->Finish();
        }) {}
  ~StreamingGenerate() {
    if (thread_.joinable()) thread_.join();
  }
  // True once `n` tokens arrived, false after `within`.
  bool WaitTokens(int n, Ms within = 5s) { return WaitForCount(tokens_, n, within); }
  // Waits for the call's end.
  const grpc::Status& Finish() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }
  int tokens() const { return tokens_; }

 private:
  std::atomic<int> tokens_{0};
  grpc::Status status_;
  std::thread thread_;
};

// A Generate call without a gRPC deadline, on its own thread, counting the
// tokens as they arrive. The call itself is unbounded, so a watchdog cancels
// it after `watchdog`: a coordinator that let it wait shows up as CANCELLED
// (and `watchdog_fired`), never as a hang.
class UnboundedGenerate {
 public:
  UnboundedGenerate(v1::Mlarun::Stub& stub, v1::GenerateRequest req, Ms watchdog = 15s)
      : start_(std::chrono::steady_clock::now()), thread_([this, &stub, req = std::move(req), watchdog] {
          std::thread dog([this, watchdog] {
            std::unique_lock lock(mu_);
            if (!cv_.wait_for(lock, watchdog, [this] { return done_; })) {
              watchdog_fired_ = true;
              ctx_.TryCancel();
            }
          });
          auto reader = stub.Generate(&ctx_, req);
          v1::GenerateResponse resp;
          while (reader->Read(&resp)) {
            result_.ids.insert(resp.request_id());
            if (resp.has_token()) {
              result_.tokens.push_back(resp.token());
              ++tokens_;
            }
            if (resp.has_finished()) result_.finished = resp.finished();
          }
          result_.status = reader->Finish();
          result_.elapsed_ms =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
          {
            std::lock_guard lock(mu_);
            done_ = true;
          }
          cv_.notify_all();
          dog.join();
        }) {}
  ~UnboundedGenerate() {
    if (thread_.joinable()) thread_.join();
  }
  bool WaitTokens(int n, Ms within = 5s) { return WaitForCount(tokens_, n, within); }
  const GenResult& Get() {
    if (thread_.joinable()) thread_.join();
    return result_;
  }
  // When the call ended, measured from `from`.
  double EndedMsAfter(std::chrono::steady_clock::time_point from) {
    Get();
    return std::chrono::duration<double, std::milli>(start_ - from).count() + result_.elapsed_ms;
  }
  bool watchdog_fired() {
    Get();
    return watchdog_fired_;
  }

 private:
  const std::chrono::steady_clock::time_point start_;
  grpc::ClientContext ctx_;  // no deadline on purpose
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool watchdog_fired_ = false;
  std::atomic<int> tokens_{0};
  GenResult result_;
  std::thread thread_;  // last: started once everything above is set
};

class CoordinatorTest : public ::testing::Test {
 protected:
  void StartCoordinator(CoordinatorOptions o = {}) {
    o.listen = "127.0.0.1:0";
    auto c = Coordinator::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    coord_ = std::move(*c);
    stub_ = v1::Mlarun::NewStub(grpc::CreateChannel(coord_->address(), grpc::InsecureChannelCredentials()));
  }
  FakeWorker& AddWorker(FakeWorkerOptions o) {
    workers_.push_back(std::make_unique<FakeWorker>(coord_->address(), std::move(o)));
    EXPECT_TRUE(workers_.back()->Connect());
    return *workers_.back();
  }
  void TearDown() override {
    workers_.clear();
    if (coord_) coord_->Shutdown();
  }

  v1::GetStatsResponse Stats() {
    grpc::ClientContext ctx;
    ctx.set_deadline(SysClock::now() + 5s);
    v1::GetStatsResponse resp;
    const grpc::Status s = stub_->GetStats(&ctx, v1::GetStatsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }
  v1::HealthResponse Health() {
    grpc::ClientContext ctx;
    ctx.set_deadline(SysClock::now() + 5s);
    v1::HealthResponse resp;
    EXPECT_TRUE(stub_->Health(&ctx, v1::HealthRequest(), &resp).ok());
    return resp;
  }
  bool CancelRpc(const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(SysClock::now() + 5s);
    v1::CancelRequest req;
    req.set_request_id(id);
    v1::CancelResponse resp;
    EXPECT_TRUE(stub_->Cancel(&ctx, req, &resp).ok());
    return resp.found();
  }
  // The Migrate RPC: to DP group `to` (-1: the coordinator picks).
  grpc::Status MigrateRpc(const std::string& id, int to, v1::MigrateResponse* out = nullptr,
                          const std::string& to_worker = "") {
    grpc::ClientContext ctx;
    ctx.set_deadline(SysClock::now() + 10s);
    v1::MigrateRequest req;
    req.set_request_id(id);
    if (to >= 0) req.set_to_group(to);
    req.set_to_worker_id(to_worker);
    v1::MigrateResponse resp;
    const grpc::Status st = stub_->Migrate(&ctx, req, &resp);
    if (out != nullptr) *out = resp;
    return st;
  }
  // Polls GetStats until `pred` holds.
  bool WaitStats(const std::function<bool(const v1::GetStatsResponse&)>& pred, Ms timeout = 5s) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      if (pred(Stats())) return true;
      std::this_thread::sleep_for(2ms);
    }
    return false;
  }
  static int64_t Routed(const v1::GetStatsResponse& s) {
    int64_t n = 0;
    for (const auto& g : s.groups()) n += g.requests_routed();
    return n;
  }
  static const v1::GroupStats* FindGroup(const v1::GetStatsResponse& s, const std::string& worker, int dp) {
    for (const auto& g : s.groups()) {
      if (g.worker_id() == worker && g.dp_group() == dp) return &g;
    }
    return nullptr;
  }

  std::unique_ptr<Coordinator> coord_;
  std::unique_ptr<v1::Mlarun::Stub> stub_;
  std::vector<std::unique_ptr<FakeWorker>> workers_;
};

// ---- Tests ------------------------------------------------------------------------

TEST_F(CoordinatorTest, StreamsTokensThenFinished) {
  StartCoordinator();
  AddWorker({.dp_group = 3});
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9};
  const GenResult r = Generate(*stub_, MakeRequest(prompt, 6, 11, "abc"));
  ExpectServed(r, prompt, 11, 6);
  EXPECT_EQ(*r.ids.begin(), "abc");
  EXPECT_EQ(r.finished->dp_group(), 3);
  const v1::Timings& t = r.finished->timings();
  EXPECT_GE(t.queued_ms(), 0);
  EXPECT_GE(t.first_token_ms(), t.queued_ms());
  EXPECT_GE(t.total_ms(), t.first_token_ms());

  // Without an id the coordinator names it; max_tokens defaults to 16.
  v1::GenerateRequest req = MakeRequest(prompt, 1);
  req.mutable_sampling()->clear_max_tokens();
  const GenResult r2 = Generate(*stub_, req);
  ExpectServed(r2, prompt, 0, 16);
  // ... "req-" and 128 random bits in hex.
  const std::string& id = *r2.ids.begin();
  EXPECT_EQ(id.rfind("req-", 0), 0u) << id;
  EXPECT_EQ(id.size(), 4u + 32u) << id;
  EXPECT_EQ(id.find_first_not_of("0123456789abcdef", 4), std::string::npos) << id;
}

TEST_F(CoordinatorTest, SixtyFourConcurrentClientsOverFourGroups) {
  StartCoordinator();  // prefix_affinity; distinct prompts fall back to least loaded
  for (int g = 0; g < 4; ++g) AddWorker({.worker_id = "job", .dp_group = g, .token_delay = 2ms});
  constexpr int kClients = 64;
  constexpr int64_t kMaxTokens = 8;
  std::vector<GenResult> results(kClients);
  std::vector<std::vector<int32_t>> prompts(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    prompts[i] = {i + 1, 2 * i + 3, 7, 11, i % 5};
    threads.emplace_back([&, i] {
      results[i] =
          Generate(*stub_, MakeRequest(prompts[i], kMaxTokens, static_cast<uint64_t>(i), "c" + std::to_string(i)));
    });
  }
  for (auto& t : threads) t.join();
  std::map<int, int64_t> per_group;
  for (int i = 0; i < kClients; ++i) {
    ExpectServed(results[i], prompts[i], static_cast<uint64_t>(i), kMaxTokens);
    if (results[i].finished) ++per_group[results[i].finished->dp_group()];
  }
  ASSERT_EQ(per_group.size(), 4u) << "every group serves some";
  // Exactly once: each id reached exactly one group, once.
  std::multiset<std::string> routed;
  for (auto& w : workers_) {
    for (const auto& id : w->routes()) routed.insert(id);
  }
  EXPECT_EQ(routed.size(), static_cast<size_t>(kClients));
  EXPECT_EQ(std::set<std::string>(routed.begin(), routed.end()).size(), static_cast<size_t>(kClients));

  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_received(), kClients);
  EXPECT_EQ(s.coordinator().requests_completed(), kClients);
  EXPECT_EQ(s.coordinator().requests_failed(), 0);
  EXPECT_EQ(s.coordinator().requests_queued(), 0);
  int64_t completed = 0, tokens = 0;
  for (const auto& g : s.groups()) {
    EXPECT_EQ(g.requests_completed(), per_group[g.dp_group()]);
    EXPECT_EQ(g.requests_routed(), g.requests_completed());
    EXPECT_EQ(g.requests_in_flight(), 0);
    EXPECT_EQ(g.queued_tokens(), 0);
    completed += g.requests_completed();
    tokens += g.tokens_generated();
  }
  EXPECT_EQ(completed, kClients);
  EXPECT_EQ(tokens, kClients * kMaxTokens);
}

TEST_F(CoordinatorTest, RoundRobinSpreadsEvenly) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
  for (int g = 0; g < 3; ++g) AddWorker({.dp_group = g});
  std::vector<int> order;
  for (int i = 0; i < 30; ++i) {
    const GenResult r = Generate(*stub_, MakeRequest({1, 2, 3}, 2, 0));
    ASSERT_TRUE(r.finished.has_value()) << r.status.error_message();
    order.push_back(r.finished->dp_group());
  }
  for (int i = 3; i < 30; ++i) EXPECT_EQ(order[i], order[i - 3]) << "a fixed rotation";
  for (int g = 0; g < 3; ++g) EXPECT_EQ(std::count(order.begin(), order.end(), g), 10) << g;
  EXPECT_EQ(Stats().coordinator().policy(), "round_robin");
}

// A burst with no stats in between must not all land on the group that looked
// idle at the last report: load is counted the moment a request is routed.
TEST_F(CoordinatorTest, LeastLoadedCountsRequestsWhenRouted) {
  StartCoordinator({.policy = RoutingPolicy::kLeastLoaded});
  FakeWorker& a = AddWorker({.dp_group = 0, .hold = true});
  FakeWorker& b = AddWorker({.dp_group = 1, .hold = true});
  constexpr int kBurst = 8;
  std::vector<std::unique_ptr<AsyncGenerate>> calls;
  for (int i = 0; i < kBurst; ++i)
    calls.push_back(std::make_unique<AsyncGenerate>(*stub_, MakeRequest({1, 2, 3, 4}, 4, 0, "ll" + std::to_string(i))));
  ASSERT_TRUE(WaitStats([&](const auto& s) { return Routed(s) == kBurst; }));
  const v1::GetStatsResponse s = Stats();
  ASSERT_EQ(s.groups_size(), 2);
  EXPECT_EQ(s.groups(0).requests_in_flight(), kBurst / 2);
  EXPECT_EQ(s.groups(1).requests_in_flight(), kBurst / 2);
  EXPECT_EQ(s.groups(0).queued_tokens(), kBurst / 2 * 8);
  EXPECT_EQ(s.groups(1).queued_tokens(), kBurst / 2 * 8);
  // The Cancel RPC ends each with CANCELLED and frees the groups' blocks.
  for (int i = 0; i < kBurst; ++i) EXPECT_TRUE(CancelRpc("ll" + std::to_string(i)));
  for (auto& c : calls) EXPECT_EQ(c->Get().status.error_code(), grpc::StatusCode::CANCELLED);
  for (FakeWorker* w : {&a, &b}) {
    ASSERT_TRUE(w->WaitRoutes(kBurst / 2));
    for (const auto& id : w->routes()) EXPECT_TRUE(w->WaitCancel(id)) << id;
  }
  const v1::GetStatsResponse after = Stats();
  EXPECT_EQ(after.coordinator().requests_cancelled(), kBurst);
  for (const auto& g : after.groups()) EXPECT_EQ(g.queued_tokens(), 0);
}

TEST_F(CoordinatorTest, PrefixAffinityKeepsSharedPrefixOnOneGroupUntilTooLoaded) {
  StartCoordinator({.policy = RoutingPolicy::kPrefixAffinity, .balance_abs_tokens = 100, .balance_rel = 1.5});
  FakeWorker& a = AddWorker({.dp_group = 0, .block_size = 4, .hold = true});
  FakeWorker& b = AddWorker({.dp_group = 1, .block_size = 4, .hold = true});
  std::vector<int32_t> shared;
  for (int i = 0; i < 32; ++i) shared.push_back(100 + i);  // 8 full blocks
  std::vector<std::unique_ptr<AsyncGenerate>> calls;
  // Each costs 34 + 16 = 50 queued tokens. One at a time, so the order is known.
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt = shared;
    prompt.push_back(500 + i);
    prompt.push_back(600 + i);
    calls.push_back(std::make_unique<AsyncGenerate>(*stub_, MakeRequest(prompt, 16, 0, "p" + std::to_string(i))));
    ASSERT_TRUE(WaitStats([&](const auto& s) { return Routed(s) == i + 1; }));
  }
  // p0: no match anywhere, both idle -> group 0. p1, p2: group 0 holds the
  // prefix and is only 50 / 100 tokens ahead (not > 100) -> group 0 although
  // group 1 is idle. p3: group 0 at 150 is > 100 ahead and > 1.5x -> group 1.
  ASSERT_TRUE(a.WaitRoutes(3));
  ASSERT_TRUE(b.WaitRoutes(1));
  EXPECT_EQ(a.routes(), (std::vector<std::string>{"p0", "p1", "p2"}));
  EXPECT_EQ(b.routes(), (std::vector<std::string>{"p3"}));
  // An unrelated prompt goes to the least loaded (group 1 at 50 < 150).
  calls.push_back(std::make_unique<AsyncGenerate>(*stub_, MakeRequest({7, 7, 7, 7, 7}, 16, 0, "other")));
  ASSERT_TRUE(b.WaitRoutes(2));
  EXPECT_EQ(b.routes().back(), "other");
  a.SetHold(false);
  b.SetHold(false);
  for (auto& c : calls) EXPECT_TRUE(c->Get().status.ok()) << c->Get().status.error_message();
}

TEST_F(CoordinatorTest, PrefixAffinityReturnsToTheGroupHoldingThePrefix) {
  StartCoordinator({.policy = RoutingPolicy::kPrefixAffinity});
  AddWorker({.dp_group = 0});
  AddWorker({.dp_group = 1});
  // Both idle: least loaded breaks the tie on free blocks. Group 0 reports
  // fewer, so the first prompt goes to group 1 ...
  workers_[0]->SendStats(10);
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.groups(0).free_blocks() == 10; }));
  const std::vector<int32_t> p(40, 9);
  ASSERT_EQ(Generate(*stub_, MakeRequest(p, 4)).finished->dp_group(), 1);
  // ... then group 1 reports even fewer: least loaded would now pick group 0,
  // but prompts extending p go back to group 1, which holds its blocks.
  workers_[1]->SendStats(5);
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.groups(1).free_blocks() == 5; }));
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> q = p;
    q.push_back(i);
    EXPECT_EQ(Generate(*stub_, MakeRequest(q, 4, static_cast<uint64_t>(i))).finished->dp_group(), 1);
  }
  // A prompt without a cached prefix goes to the least loaded.
  EXPECT_EQ(Generate(*stub_, MakeRequest({1, 2, 3, 4, 5}, 4)).finished->dp_group(), 0);
}

TEST_F(CoordinatorTest, ValidationErrorsNameTheField) {
  StartCoordinator();
  AddWorker({.vocab_size = 100, .max_position_embeddings = 64});
  struct Case {
    std::function<void(v1::GenerateRequest&)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.clear_prompt_ids(); }, "prompt_ids"},
      {[](auto& r) { r.set_prompt_ids(1, -4); }, "prompt_ids[1]"},
      {[](auto& r) { r.mutable_sampling()->set_temperature(-0.1); }, "sampling.temperature"},
      {[](auto& r) { r.mutable_sampling()->set_temperature(100.5); }, "sampling.temperature"},
      {[](auto& r) { r.mutable_sampling()->set_temperature(std::nan("")); }, "sampling.temperature"},
      {[](auto& r) { r.mutable_sampling()->set_top_p(0); }, "sampling.top_p"},
      {[](auto& r) { r.mutable_sampling()->set_top_p(1.01); }, "sampling.top_p"},
      {[](auto& r) { r.mutable_sampling()->set_max_tokens(0); }, "sampling.max_tokens"},
      {[](auto& r) { r.mutable_sampling()->add_stop_token_ids(-1); }, "sampling.stop_token_ids[0]"},
      {[](auto& r) { r.mutable_sampling()->add_stop_token_ids(100); }, "sampling.stop_token_ids[0]"},
      {[](auto& r) { r.mutable_sampling()->set_top_k(-2); }, "sampling.top_k"},
      {[](auto& r) { r.set_prompt_ids(2, 100); }, "vocab_size"},
      {[](auto& r) { r.mutable_sampling()->set_max_tokens(62); }, "max_position_embeddings"},
      {[](auto& r) { r.set_cache_salt(std::string(257, 's')); }, "cache_salt"},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest req = MakeRequest({1, 2, 3}, 4);
    c.mutate(req);
    const GenResult r = Generate(*stub_, req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_NE(r.status.error_message().find(c.field), std::string::npos) << r.status.error_message();
    EXPECT_TRUE(r.tokens.empty());
  }
  // Still serving; 3 + 61 = 64 positions is the limit and fits, as does a
  // 256-byte cache_salt.
  v1::GenerateRequest edge = MakeRequest({1, 2, 3}, 61);
  edge.set_cache_salt(std::string(256, 's'));
  ExpectServed(Generate(*stub_, edge), {1, 2, 3}, 0, 61, 100);
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_rejected(), static_cast<int64_t>(cases.size()));
  EXPECT_EQ(s.coordinator().requests_completed(), 1);
}

// Before any group registers the limits are unknown: the sampling checks
// still apply, only the bounds that need the model wait for the group.
TEST_F(CoordinatorTest, ValidationWithoutGroupsChecksWhatItCan) {
  StartCoordinator();
  v1::GenerateRequest bad = MakeRequest({1, 2}, 4);
  bad.mutable_sampling()->set_max_tokens(0);
  const GenResult r = Generate(*stub_, bad);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("sampling.max_tokens"), std::string::npos) << r.status.error_message();
  EXPECT_EQ(r.status.error_message().find("922337"), std::string::npos)  // no INT64_MAX bound
      << r.status.error_message();
  v1::GenerateRequest big = MakeRequest({1, 2}, 1000000);
  big.mutable_sampling()->add_stop_token_ids(1000000);
  EXPECT_EQ(Generate(*stub_, big, 300ms).status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(CoordinatorTest, GroupErrorIsForwarded) {
  StartCoordinator();
  AddWorker({.reject_code = 3, .reject_message = "sampling.top_k: 100000 exceeds the vocabulary"});
  const GenResult r = Generate(*stub_, MakeRequest({1, 2}, 4));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "sampling.top_k: 100000 exceeds the vocabulary");
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_rejected(), 1);
  EXPECT_EQ(s.groups(0).requests_in_flight(), 0);
  EXPECT_EQ(s.groups(0).queued_tokens(), 0);
}

TEST_F(CoordinatorTest, DuplicateLiveIdIsAlreadyExistsAndCancelRpcEndsTheStream) {
  StartCoordinator();
  FakeWorker& w = AddWorker({.hold = true});
  AsyncGenerate first(*stub_, MakeRequest({1, 2, 3}, 4, 0, "dup"));
  ASSERT_TRUE(w.WaitRoutes(1));
  const GenResult second = Generate(*stub_, MakeRequest({1, 2, 3}, 4, 0, "dup"));
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(second.status.error_message().find("dup"), std::string::npos);
  EXPECT_FALSE(CancelRpc("nope"));
  EXPECT_TRUE(CancelRpc("dup"));
  EXPECT_EQ(first.Get().status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(w.WaitCancel("dup"));
  EXPECT_FALSE(CancelRpc("dup"));
  // Once ended, the id may be used again.
  w.SetHold(false);
  ExpectServed(Generate(*stub_, MakeRequest({1, 2, 3}, 4, 0, "dup")), {1, 2, 3}, 0, 4);
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_rejected(), 1);
  EXPECT_EQ(s.coordinator().requests_cancelled(), 1);
  EXPECT_EQ(s.coordinator().requests_completed(), 1);
}

TEST_F(CoordinatorTest, FullQueueIsResourceExhausted) {
  StartCoordinator({.max_queued = 2});
  AsyncGenerate a(*stub_, MakeRequest({1}, 1), 600ms);
  AsyncGenerate b(*stub_, MakeRequest({2}, 1), 600ms);
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.coordinator().requests_queued() == 2; }));
  const GenResult c = Generate(*stub_, MakeRequest({3}, 1), 600ms);
  EXPECT_EQ(c.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_LT(c.elapsed_ms, 300);
  EXPECT_EQ(a.Get().status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(b.Get().status.error_code(), grpc::StatusCode::UNAVAILABLE);
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_rejected(), 1);
  EXPECT_EQ(s.coordinator().requests_failed(), 2);
  EXPECT_EQ(s.coordinator().requests_queued(), 0);
}

TEST_F(CoordinatorTest, NoGroupBeforeDeadlineIsUnavailable) {
  StartCoordinator();
  const GenResult r = Generate(*stub_, MakeRequest({1, 2}, 2), 300ms);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("no DP group registered"), std::string::npos) << r.status.error_message();
  EXPECT_GT(r.elapsed_ms, 200);
  EXPECT_TRUE(Health().serving());
  EXPECT_EQ(Health().groups_connected(), 0);
}

// A call without a gRPC deadline waits queue_timeout_s at most. The call
// itself has no deadline, so a watchdog cancels it if the coordinator hangs.
TEST_F(CoordinatorTest, NoClientDeadlineUsesDefaultDeadline) {
  StartCoordinator({.queue_timeout_s = 0.3});
  grpc::ClientContext ctx;  // no deadline on purpose
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 300 && !done; ++i) std::this_thread::sleep_for(10ms);
    if (!done) ctx.TryCancel();
  });
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub_->Generate(&ctx, MakeRequest({1, 2}, 2));
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
  }
  const grpc::Status status = reader->Finish();
  done = true;
  watchdog.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, 290ms);
  EXPECT_LT(elapsed, 2s);
}

// ... but once a group has it, a request without a deadline runs as long as
// it takes: the default bounds only the wait for a group.
TEST_F(CoordinatorTest, NoClientDeadlineDoesNotLimitARoutedRequest) {
  StartCoordinator({.queue_timeout_s = 0.3});
  FakeWorker& w = AddWorker({.hold = true});
  grpc::ClientContext ctx;  // no deadline on purpose
  std::atomic<bool> done{false};
  // The watchdog ends a call that would otherwise wait forever; it is joined
  // on every way out of the test (a failed ASSERT returns early, and a
  // joinable thread destroyed would abort the whole binary).
  std::thread watchdog([&] {
    for (int i = 0; i < 3000 && !done; ++i) std::this_thread::sleep_for(10ms);
    if (!done) ctx.TryCancel();
  });
  struct JoinWatchdog {
    std::thread& t;
    std::atomic<bool>& done;
    grpc::ClientContext& ctx;
    ~JoinWatchdog() {
      if (!done.exchange(true)) ctx.TryCancel();
      t.join();
    }
  } join_watchdog{watchdog, done, ctx};
  auto reader = stub_->Generate(&ctx, MakeRequest({1, 2}, 3));
  ASSERT_TRUE(w.WaitRoutes(1, 20s));
  std::this_thread::sleep_for(600ms);  // twice the default, held by the group
  w.SetHold(false);
  int tokens = 0;
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) tokens += resp.has_token() ? 1 : 0;
  done = true;  // read to the end: the watchdog need not cancel
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, 3);
}

TEST_F(CoordinatorTest, RequestQueuedBeforeAnyGroupIsServedWhenOneRegisters) {
  StartCoordinator();
  AsyncGenerate call(*stub_, MakeRequest({4, 5, 6}, 5, 2), 5s);
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.coordinator().requests_queued() == 1; }));
  std::this_thread::sleep_for(20ms);
  AddWorker({.dp_group = 1});
  const GenResult& r = call.Get();
  ExpectServed(r, {4, 5, 6}, 2, 5);
  EXPECT_EQ(r.finished->dp_group(), 1);
  EXPECT_GE(r.finished->timings().queued_ms(), 20);
}

TEST_F(CoordinatorTest, ClientCancellationMidStreamSendsCancelRoute) {
  StartCoordinator();
  FakeWorker& w = AddWorker({.token_delay = 5ms});
  grpc::ClientContext ctx;
  ctx.set_deadline(SysClock::now() + 10s);
  auto reader = stub_->Generate(&ctx, MakeRequest({1, 2, 3}, 1000, 0, "mid"));
  v1::GenerateResponse resp;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(reader->Read(&resp));
    ASSERT_TRUE(resp.has_token());
    EXPECT_EQ(resp.token().index(), i);
  }
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(w.WaitCancel("mid"));
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.coordinator().requests_cancelled() == 1; }));
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.groups(0).requests_in_flight(), 0);
  EXPECT_EQ(s.groups(0).queued_tokens(), 0);
}

TEST_F(CoordinatorTest, DeadlineAfterRoutingIsDeadlineExceededAndCancelsTheRoute) {
  StartCoordinator();
  FakeWorker& w = AddWorker({.hold = true});
  const GenResult r = Generate(*stub_, MakeRequest({1, 2, 3}, 4, 0, "late"), 300ms);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(w.WaitCancel("late"));
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.coordinator().requests_failed() == 1; }));
  EXPECT_EQ(Stats().groups(0).requests_in_flight(), 0);
}

// A group that breaks hands its requests to another: the one without a
// token is served from the start, the one with tokens resumes from them
// (the client's stream goes on without a gap or a repeat).
TEST_F(CoordinatorTest, BrokenGroupsRequestsResumeOnAnotherGroup) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 0, .stall_after = 2});
  // r1 gets 2 tokens from group a, then a goes silent.
  UnboundedGenerate r1(*stub_, MakeRequest({1, 2, 3}, 8, 0, "r1"));
  ASSERT_TRUE(r1.WaitTokens(2));
  // r2 reaches a but gets no token before a breaks.
  a.SetHold(true);
  AsyncGenerate r2(*stub_, MakeRequest({7, 8, 9}, 5, 3, "r2"));
  ASSERT_TRUE(a.WaitRoutes(2));
  FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1});
  a.Break();
  ExpectServed(r1.Get(), {1, 2, 3}, 0, 8);
  EXPECT_EQ(r1.Get().finished->dp_group(), 1);
  EXPECT_EQ(b.resumed("r1"), (std::vector<int32_t>{static_cast<int32_t>(ExpectedToken({1, 2, 3}, 0, 0, 1000)),
                                                   static_cast<int32_t>(ExpectedToken({1, 2, 3}, 0, 1, 1000))}));
  const GenResult& g2 = r2.Get();
  ExpectServed(g2, {7, 8, 9}, 3, 5);
  EXPECT_EQ(g2.finished->dp_group(), 1);
  EXPECT_TRUE(b.resumed("r2").empty());
  v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_rerouted(), 2);
  EXPECT_EQ(s.coordinator().requests_failed(), 0);
  ASSERT_NE(FindGroup(s, "a", 0), nullptr);
  EXPECT_FALSE(FindGroup(s, "a", 0)->connected());
  EXPECT_EQ(FindGroup(s, "a", 0)->requests_in_flight(), 0);
  EXPECT_EQ(Health().groups_connected(), 1);

  // a comes back: same group (counters kept), serving again.
  a.options().stall_after = -1;
  a.options().hold = false;
  ASSERT_TRUE(a.Connect());
  s = Stats();
  EXPECT_EQ(s.groups_size(), 2);
  EXPECT_TRUE(FindGroup(s, "a", 0)->connected());
  EXPECT_EQ(FindGroup(s, "a", 0)->requests_routed(), 2);
  std::set<int> served;
  for (int i = 0; i < 2; ++i) served.insert(Generate(*stub_, MakeRequest({1}, 2, i)).finished->dp_group());
  EXPECT_EQ(served, (std::set<int>{0, 1}));
  EXPECT_EQ(FindGroup(Stats(), "a", 0)->requests_completed(), 1);
}

// A group that cannot continue says why (`leaving`) and no other group is
// connected: its requests (with tokens or not) wait only lost_group_wait_s
// (not their 10 s deadline) for another group, then fail naming the group,
// the tokens sent and the reason; GetStats keeps the reason.
TEST_F(CoordinatorTest, LeavingGroupEndsItsRequestsWithItsReasonWithinTheLostGroupWait) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin, .lost_group_wait_s = 0.3});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 0, .stall_after = 2});
  StreamingGenerate r1(*stub_, MakeRequest({1, 2, 3}, 8, 0, "r1"));
  ASSERT_TRUE(r1.WaitTokens(2));
  a.SetHold(true);
  AsyncGenerate r2(*stub_, MakeRequest({7, 8, 9}, 5, 3, "r2"), 10s);
  ASSERT_TRUE(a.WaitRoutes(2));
  const std::string why = "rank 2 (node7) cannot continue: step failed: ABORTED: collective: peer gone";
  const auto left = std::chrono::steady_clock::now();
  EXPECT_TRUE(a.Leave(why).ok());
  const grpc::Status& r1_status = r1.Finish();
  EXPECT_EQ(r1_status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(r1_status.error_message().find("after sending 2 tokens"), std::string::npos) << r1_status.error_message();
  EXPECT_NE(r1_status.error_message().find(why), std::string::npos) << r1_status.error_message();
  const GenResult& g2 = r2.Get();
  const double since_left_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - left).count();
  EXPECT_EQ(g2.status.error_code(), grpc::StatusCode::UNAVAILABLE) << g2.status.error_message();
  EXPECT_NE(g2.status.error_message().find("DP group 0 of worker 'a'"), std::string::npos) << g2.status.error_message();
  EXPECT_NE(g2.status.error_message().find(why), std::string::npos) << g2.status.error_message();
  EXPECT_GE(since_left_ms, 250) << "it waited for a group to come back";
  EXPECT_LT(since_left_ms, 3000) << "within the lost-group wait, not the 10 s deadline";
  const v1::GetStatsResponse s = Stats();
  ASSERT_NE(FindGroup(s, "a", 0), nullptr);
  EXPECT_FALSE(FindGroup(s, "a", 0)->connected());
  EXPECT_NE(FindGroup(s, "a", 0)->disconnect_reason().find(why), std::string::npos);
  EXPECT_EQ(s.coordinator().requests_failed(), 2);
  EXPECT_EQ(s.coordinator().requests_queued(), 0);
}

// A group that comes back within the lost-group wait takes over the request
// it had not answered.
TEST_F(CoordinatorTest, GroupBackWithinTheLostGroupWaitServesTheRequestItLost) {
  StartCoordinator({.lost_group_wait_s = 5});
  FakeWorker& a = AddWorker({.worker_id = "a", .hold = true});
  AsyncGenerate r(*stub_, MakeRequest({4, 5}, 3, 1, "back"), 10s);
  ASSERT_TRUE(a.WaitRoutes(1));
  a.Break();
  std::this_thread::sleep_for(100ms);
  a.options().hold = false;
  ASSERT_TRUE(a.Connect());
  ExpectServed(r.Get(), {4, 5}, 1, 3);
  EXPECT_EQ(Stats().coordinator().requests_rerouted(), 1);
}

// ---- Faults: every request ends, deadline or not ----------------------------------
// Each call below has no gRPC deadline; the coordinator's own bounds (queue,
// lost-group and stall timeouts, shortened here) must end it, well before the
// watchdog.

// A group accepts requests, sends no token for longer than the queue timeout
// (the old one-shot timer fired and was not re-armed), then breaks with no
// other group: the requests end UNAVAILABLE within the lost-group wait,
// naming the group and what happened, never "no DP group registered".
TEST_F(CoordinatorTest, FaultSilentGroupBreaksRequestsWithoutDeadlineEndWithinTheLostGroupWait) {
  StartCoordinator({.queue_timeout_s = 0.2, .lost_group_wait_s = 0.3});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 2, .hold = true});
  std::vector<std::unique_ptr<UnboundedGenerate>> calls;
  for (int i = 0; i < 3; ++i) calls.push_back(std::make_unique<UnboundedGenerate>(*stub_, MakeRequest({1, 2, i}, 4)));
  ASSERT_TRUE(a.WaitRoutes(3));
  std::this_thread::sleep_for(400ms);  // past the queue timeout, routed and silent
  const auto lost = std::chrono::steady_clock::now();
  a.Break();
  for (auto& c : calls) {
    const GenResult& r = c->Get();
    const std::string& m = r.status.error_message();
    EXPECT_FALSE(c->watchdog_fired());
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << m;
    EXPECT_NE(m.find("DP group 2 of worker 'a' went away"), std::string::npos) << m;
    EXPECT_NE(m.find("stream to the coordinator ended"), std::string::npos) << m;
    EXPECT_EQ(m.find("no DP group registered"), std::string::npos) << m;
    const double after_loss_ms = c->EndedMsAfter(lost);
    EXPECT_GE(after_loss_ms, 250) << "it waited for the group to come back";
    EXPECT_LT(after_loss_ms, 3000) << "within the lost-group wait";
  }
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_failed(), 3);
  EXPECT_EQ(s.coordinator().requests_rerouted(), 3);
  EXPECT_EQ(s.coordinator().requests_queued(), 0);
}

// The same with a second group: both requests go on there, the one that
// had tokens from its third.
TEST_F(CoordinatorTest, FaultBrokenGroupAfterSomeTokensResumesEveryRequestElsewhere) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin, .queue_timeout_s = 0.2, .lost_group_wait_s = 0.3});
  FakeWorker& a = AddWorker({.worker_id = "a", .stall_after = 2});
  UnboundedGenerate started(*stub_, MakeRequest({1, 2, 3}, 8));
  ASSERT_TRUE(started.WaitTokens(2));
  a.SetHold(true);
  UnboundedGenerate silent(*stub_, MakeRequest({7, 8, 9}, 5, 3));
  ASSERT_TRUE(a.WaitRoutes(2));
  std::this_thread::sleep_for(300ms);  // past the queue timeout
  AddWorker({.worker_id = "b", .dp_group = 1});
  a.Break();
  const GenResult& r1 = started.Get();
  ExpectServed(r1, {1, 2, 3}, 0, 8);
  EXPECT_EQ(r1.finished->dp_group(), 1);
  EXPECT_FALSE(started.watchdog_fired());
  const GenResult& r2 = silent.Get();
  ExpectServed(r2, {7, 8, 9}, 3, 5);
  EXPECT_EQ(r2.finished->dp_group(), 1);
  EXPECT_FALSE(silent.watchdog_fired());
  EXPECT_EQ(Stats().coordinator().requests_rerouted(), 2);
}

// A group that keeps its stream open but sends nothing while it has work (a
// rank stuck in a collective) is dropped after the stall timeout: both its
// requests go on on the other group (the one with tokens from them); the
// stalled group's stream is closed, and it can register again.
TEST_F(CoordinatorTest, FaultStalledGroupIsDroppedAndItsRequestsGoOnElsewhere) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin, .stall_timeout_s = 0.4});
  FakeWorker& a = AddWorker({.worker_id = "a", .stall_after = 2});
  UnboundedGenerate started(*stub_, MakeRequest({1, 2, 3}, 8));
  ASSERT_TRUE(started.WaitTokens(2));
  a.SetHold(true);
  UnboundedGenerate silent(*stub_, MakeRequest({7, 8, 9}, 5, 3));
  ASSERT_TRUE(a.WaitRoutes(2));
  const auto routed = std::chrono::steady_clock::now();
  AddWorker({.worker_id = "b", .dp_group = 1});
  const GenResult& r1 = started.Get();
  ExpectServed(r1, {1, 2, 3}, 0, 8);
  EXPECT_EQ(r1.finished->dp_group(), 1);
  EXPECT_GE(started.EndedMsAfter(routed), 250) << "not before the stall timeout";
  const GenResult& r2 = silent.Get();
  ExpectServed(r2, {7, 8, 9}, 3, 5);
  EXPECT_EQ(r2.finished->dp_group(), 1);
  const v1::GetStatsResponse s = Stats();
  ASSERT_NE(FindGroup(s, "a", 0), nullptr);
  EXPECT_FALSE(FindGroup(s, "a", 0)->connected());
  EXPECT_NE(FindGroup(s, "a", 0)->disconnect_reason().find("stalled"), std::string::npos);
  EXPECT_NE(FindGroup(s, "a", 0)->disconnect_reason().find("2 requests in flight"), std::string::npos);
  // Its stream was closed by the coordinator; it registers again and serves.
  a.Stop();
  a.options().stall_after = -1;
  a.options().hold = false;
  ASSERT_TRUE(a.Connect());
  std::set<int> served;
  for (int i = 0; i < 2; ++i) served.insert(Generate(*stub_, MakeRequest({1}, 2, i)).finished->dp_group());
  EXPECT_EQ(served, (std::set<int>{0, 1}));
}

// ---- Migration ----------------------------------------------------------------

// A running request moves to the other group and back between two of its
// steps: the stream has every token once, in order, each the one the
// request's seed gives at its index; the new group gets the tokens so far.
TEST_F(CoordinatorTest, MigrateMovesARunningRequestWithoutGapOrRepeat) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 0, .token_delay = 10ms});
  FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1, .token_delay = 10ms});
  UnboundedGenerate r(*stub_, MakeRequest({5, 6, 7}, 60, 9, "moving"));
  ASSERT_TRUE(r.WaitTokens(3));
  const bool on_a = !a.routes().empty();
  FakeWorker& there = on_a ? b : a;
  v1::MigrateResponse m;
  const grpc::Status st = MigrateRpc("moving", on_a ? 1 : 0, &m);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(m.from_group(), on_a ? 0 : 1);
  EXPECT_EQ(m.from_worker_id(), on_a ? "a" : "b");
  EXPECT_EQ(m.to_group(), on_a ? 1 : 0);
  EXPECT_EQ(m.to_worker_id(), on_a ? "b" : "a");
  EXPECT_GE(m.tokens_before(), 3);
  EXPECT_GE(m.pause_ms(), 0.0);
  const std::vector<int32_t> resumed = there.resumed("moving");
  ASSERT_EQ(static_cast<int64_t>(resumed.size()), m.tokens_before());
  for (size_t i = 0; i < resumed.size(); ++i)
    EXPECT_EQ(resumed[i], ExpectedToken({5, 6, 7}, 9, static_cast<int64_t>(i), 1000)) << i;
  // And back, the coordinator picking the only other group.
  ASSERT_TRUE(r.WaitTokens(static_cast<int>(m.tokens_before()) + 3));
  v1::MigrateResponse back;
  const grpc::Status st2 = MigrateRpc("moving", -1, &back);
  ASSERT_TRUE(st2.ok()) << st2.error_message();
  EXPECT_EQ(back.to_group(), m.from_group());
  EXPECT_GT(back.tokens_before(), m.tokens_before());
  ExpectServed(r.Get(), {5, 6, 7}, 9, 60);
  EXPECT_EQ(r.Get().finished->dp_group(), m.from_group());
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_migrated(), 2);
  EXPECT_EQ(s.coordinator().migrations_failed(), 0);
  EXPECT_EQ(s.coordinator().requests_rerouted(), 0);
  EXPECT_EQ(FindGroup(s, "a", 0)->migrated_out(), 1);
  EXPECT_EQ(FindGroup(s, "a", 0)->migrated_in(), 1);
  EXPECT_EQ(FindGroup(s, "b", 1)->migrated_out(), 1);
  EXPECT_EQ(FindGroup(s, "b", 1)->migrated_in(), 1);
  EXPECT_EQ(FindGroup(s, "a", 0)->requests_in_flight(), 0);
  EXPECT_EQ(FindGroup(s, "b", 1)->requests_in_flight(), 0);
}

// Groups that move blocks: the old group's blocks and descriptors reach the
// new group with the move, the old group is told to release them once the
// request runs on the new one; a group without descriptors gets no source.
TEST_F(CoordinatorTest, MigrateHandsTheOldGroupsBlocksToTheNewGroup) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 0, .token_delay = 10ms, .descriptors = {"ucx-a"}});
  FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1, .token_delay = 10ms, .descriptors = {"ucx-b"}});
  FakeWorker& c = AddWorker({.worker_id = "c", .dp_group = 2, .token_delay = 10ms});
  UnboundedGenerate r(*stub_, MakeRequest({5, 6, 7, 8, 9}, 200, 1, "blocks"));
  ASSERT_TRUE(r.WaitTokens(3));
  ASSERT_FALSE(a.routes().empty());
  v1::MigrateResponse m;
  ASSERT_TRUE(MigrateRpc("blocks", 1, &m).ok());
  const std::optional<v1::MoveSource> source = b.source("blocks");
  ASSERT_TRUE(source.has_value());
  ASSERT_EQ(source->descriptors_size(), 1);
  EXPECT_EQ(source->descriptors(0), "ucx-a");
  const int64_t cached = 5 + m.tokens_before() - 1;
  EXPECT_EQ(source->cached_tokens(), cached);
  EXPECT_EQ(source->block_ids_size(), (cached + 3) / 4);
  EXPECT_EQ(source->block_ids(0), 100);
  EXPECT_TRUE(a.WaitReleased("blocks"));
  // To a group that does not move blocks: no source, and b releases its own.
  ASSERT_TRUE(r.WaitTokens(static_cast<int>(m.tokens_before()) + 3));
  ASSERT_TRUE(MigrateRpc("blocks", 2).ok());
  EXPECT_FALSE(c.source("blocks").has_value());
  EXPECT_TRUE(b.WaitReleased("blocks"));
  ExpectServed(r.Get(), {5, 6, 7, 8, 9}, 1, 200);
}

// Exported blocks that cannot be right (more rows than the request has
// tokens, too few blocks for them, a negative id) disconnect the group that
// sent them; the request fails naming the violation.
TEST_F(CoordinatorTest, ForgedExportedBlocksDisconnectTheGroup) {
  const std::vector<std::pair<std::function<void(v1::Exported&)>, std::string>> forgeries = {
      {[](v1::Exported& x) { x.set_cached_tokens(1 << 20); }, "exported.cached_tokens"},
      {[](v1::Exported& x) { x.mutable_block_ids()->RemoveLast(); }, "exported.block_ids:"},
      {[](v1::Exported& x) { x.set_block_ids(0, -3); }, "exported.block_ids[0]: block id -3"},
      {[](v1::Exported& x) { x.set_tokens(x.tokens() + 1); }, "exported.tokens"},
  };
  for (size_t i = 0; i < forgeries.size(); ++i) {
    SCOPED_TRACE(forgeries[i].second);
    StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
    FakeWorker& a = AddWorker({.worker_id = "a",
                               .dp_group = 0,
                               .token_delay = 10ms,
                               .descriptors = {"ucx-a"},
                               .edit_exported = forgeries[i].first});
    AddWorker({.worker_id = "b", .dp_group = 1, .descriptors = {"ucx-b"}});
    UnboundedGenerate r(*stub_, MakeRequest({1, 2, 3, 4, 5, 6}, 500, 0, "forged"));
    ASSERT_TRUE(r.WaitTokens(3));
    ASSERT_FALSE(a.routes().empty());
    const grpc::Status st = MigrateRpc("forged", 1);
    EXPECT_FALSE(st.ok());
    EXPECT_EQ(r.Get().status.error_code(), grpc::StatusCode::INTERNAL) << r.Get().status.error_message();
    EXPECT_NE(r.Get().status.error_message().find(forgeries[i].second), std::string::npos)
        << r.Get().status.error_message();
    EXPECT_EQ(a.WaitEnded().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    TearDown();
    workers_.clear();
    coord_.reset();
  }
}

// A registration's transfer descriptors: none or one per rank, each
// non-empty and bounded; anything else is refused naming the field.
// ---- Prefix fetch between groups ----------------------------------------------

std::vector<int32_t> Iota(int32_t first, int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}
std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A request routed (round robin) away from the group whose cache holds its
// prompt's first 40 tokens goes with that group's blocks as its move source;
// the blocks are released after its first token. A shared prefix shorter
// than --prefix-fetch-min-tokens, a group that does not export, and a
// request that wants prompt logprobs are routed without asking.
TEST_F(CoordinatorTest, PrefixFetchRoutesWithTheBlocksOfTheGroupHoldingThePrefix) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin, .prefix_fetch_min_tokens = 12});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 0, .descriptors = {"ucx-a"}, .exports_prefixes = true});
  FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1, .descriptors = {"ucx-b"}, .exports_prefixes = true});
  const std::vector<int32_t> shared = Iota(10, 40);
  ExpectServed(Generate(*stub_, MakeRequest(Concat(shared, {1, 2}), 3, 1, "first")), Concat(shared, {1, 2}), 1, 3);
  ASSERT_EQ(a.routes(), std::vector<std::string>{"first"});
  // To b, which has none of it: a is asked for the 40 tokens (10 blocks).
  const std::vector<int32_t> second = Concat(shared, {7, 8, 9, 5, 4});
  ExpectServed(Generate(*stub_, MakeRequest(second, 4, 2, "second")), second, 2, 4);
  ASSERT_EQ(b.routes(), std::vector<std::string>{"second"});
  ASSERT_EQ(a.prefix_asks().size(), 1u);
  const v1::ExportPrefix ask = a.prefix_asks()[0];
  EXPECT_EQ(ToVector(ask.token_ids()), shared);
  const std::optional<v1::MoveSource> source = b.source("second");
  ASSERT_TRUE(source.has_value());
  ASSERT_EQ(source->descriptors_size(), 1);
  EXPECT_EQ(source->descriptors(0), "ucx-a");
  EXPECT_EQ(source->cached_tokens(), 40);
  ASSERT_EQ(source->block_ids_size(), 10);
  EXPECT_EQ(source->block_ids(9), 209);
  EXPECT_TRUE(b.resumed("second").empty());
  EXPECT_TRUE(a.WaitPrefixReleased(ask.export_id()));
  v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().prefix_fetches(), 1);
  EXPECT_EQ(s.coordinator().prefix_fetch_tokens(), 40);
  // 8 tokens in common with what a holds: below 12, computed.
  ExpectServed(Generate(*stub_, MakeRequest(Concat(Iota(300, 8), Iota(900, 30)), 2, 3, "third")),
               Concat(Iota(300, 8), Iota(900, 30)), 3, 2);
  const std::vector<int32_t> fourth = Concat(Iota(300, 8), Iota(600, 30));
  ExpectServed(Generate(*stub_, MakeRequest(fourth, 2, 4, "fourth")), fourth, 4, 2);
  EXPECT_FALSE(b.source("fourth").has_value());
  // 36 tokens b holds and a does not, but prompt logprobs need every row
  // computed.
  v1::GenerateRequest scored = MakeRequest(Concat(fourth, {1}), 2, 5, "fifth");
  scored.mutable_sampling()->set_prompt_logprobs(0);
  (void)Generate(*stub_, scored);
  ASSERT_EQ(a.routes().back(), "fifth");
  EXPECT_FALSE(a.source("fifth").has_value());
  EXPECT_EQ(a.prefix_asks().size() + b.prefix_asks().size(), 1u);
  EXPECT_EQ(Stats().coordinator().prefix_fetches(), 1);
}

// The source that never answers goes away: the waiting request is routed
// without a source and served. One whose client leaves while its source
// has not answered ends; the late answer's blocks are released.
TEST_F(CoordinatorTest, FaultPrefixSourceThatGoesAwayOrAnswersLate) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin, .prefix_fetch_min_tokens = 4});
  FakeWorker& a = AddWorker(
      {.worker_id = "a", .dp_group = 0, .descriptors = {"ucx-a"}, .exports_prefixes = true, .hold_prefixes = true});
  FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1, .descriptors = {"ucx-b"}, .exports_prefixes = true});
  const std::vector<int32_t> shared = Iota(10, 20);
  (void)Generate(*stub_, MakeRequest(Concat(shared, {1}), 2, 1, "warm"));
  {
    // Cancelled while a holds the ask.
    grpc::ClientContext ctx;
    v1::GenerateRequest req = MakeRequest(Concat(shared, {2}), 2, 2, "gone");
    auto reader = stub_->Generate(&ctx, req);
    ASSERT_TRUE(a.WaitPrefixAsks(1));
    EXPECT_TRUE(b.routes().empty());
    ctx.TryCancel();
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.coordinator().requests_cancelled() == 1; }));
  a.AnswerPrefixes();
  EXPECT_TRUE(a.WaitPrefixReleased(a.prefix_asks()[0].export_id()));
  // The next one (round robin: to a) brings a prefix only a holds; the one
  // after goes to b, asks a, and a breaks before answering.
  const std::vector<int32_t> other = Iota(700, 20);
  (void)Generate(*stub_, MakeRequest(Concat(other, {3}), 2, 3, "on-a"));
  AsyncGenerate late(*stub_, MakeRequest(Concat(other, {4}), 3, 4, "orphan"));
  ASSERT_TRUE(a.WaitPrefixAsks(2));
  a.Break();
  ExpectServed(late.Get(), Concat(other, {4}), 4, 3);
  EXPECT_EQ(b.routes().back(), "orphan");
  EXPECT_FALSE(b.source("orphan").has_value());
  EXPECT_EQ(Stats().coordinator().prefix_fetches(), 0);
}

// A PrefixExported that cannot be right (rows not whole blocks, more rows
// than were asked for, too few blocks, a negative id) disconnects the
// group that sent it; the request it was for is served without it.
TEST_F(CoordinatorTest, ForgedPrefixExportedDisconnectsTheGroup) {
  const std::vector<std::pair<std::function<void(v1::PrefixExported&)>, std::string>> forgeries = {
      {[](v1::PrefixExported& x) { x.set_cached_tokens(x.cached_tokens() - 1); }, "prefix_exported.cached_tokens"},
      {[](v1::PrefixExported& x) { x.set_cached_tokens(x.cached_tokens() + 4); }, "prefix_exported.cached_tokens"},
      {[](v1::PrefixExported& x) { x.mutable_block_ids()->RemoveLast(); }, "prefix_exported.block_ids:"},
      {[](v1::PrefixExported& x) { x.set_block_ids(0, -3); }, "prefix_exported.block_ids[0]: block id -3"},
  };
  for (size_t i = 0; i < forgeries.size(); ++i) {
    SCOPED_TRACE(forgeries[i].second);
    StartCoordinator({.policy = RoutingPolicy::kRoundRobin, .prefix_fetch_min_tokens = 4});
    FakeWorker& a = AddWorker({.worker_id = "a",
                               .dp_group = 0,
                               .descriptors = {"ucx-a"},
                               .exports_prefixes = true,
                               .edit_prefix_exported = forgeries[i].first});
    FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1, .descriptors = {"ucx-b"}, .exports_prefixes = true});
    const std::vector<int32_t> shared = Iota(10, 20);
    (void)Generate(*stub_, MakeRequest(Concat(shared, {1}), 2, 1, "warm"));
    ExpectServed(Generate(*stub_, MakeRequest(Concat(shared, {2}), 3, 2, "forged")), Concat(shared, {2}), 2, 3);
    EXPECT_FALSE(b.source("forged").has_value());
    const grpc::Status ended = a.WaitEnded();
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(ended.error_message().find(forgeries[i].second), std::string::npos) << ended.error_message();
    workers_.clear();
    coord_->Shutdown();
  }
}

TEST_F(CoordinatorTest, RegistrationDescriptorsAreBounded) {
  StartCoordinator();
  AddWorker({.worker_id = "ok", .descriptors = {"x"}});
  FakeWorker bad(coord_->address(), {.worker_id = "two", .descriptors = {"x", "y"}});
  EXPECT_FALSE(bad.ConnectOnce());
  EXPECT_EQ(bad.end_status().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.end_status().error_message().find("register.transfer_descriptors"), std::string::npos)
      << bad.end_status().error_message();
  FakeWorker role(coord_->address(), {.worker_id = "role", .role = "encode"});
  EXPECT_FALSE(role.ConnectOnce());
  EXPECT_NE(role.end_status().error_message().find("register.role: 'encode'"), std::string::npos)
      << role.end_status().error_message();
  FakeWorker empty(coord_->address(), {.worker_id = "empty", .descriptors = {""}});
  EXPECT_FALSE(empty.ConnectOnce());
  EXPECT_NE(empty.end_status().error_message().find("transfer_descriptors[0]"), std::string::npos)
      << empty.end_status().error_message();
}

// Prefill and decode groups: every new request goes to the prefill group
// and, after its first token, on to a decode group (with its blocks where
// both move blocks); the stream is whole. A decode group takes new requests
// only while no prefill or mixed group is connected.
TEST_F(CoordinatorTest, PrefillGroupsHandEachRequestToADecodeGroup) {
  StartCoordinator({.policy = RoutingPolicy::kLeastLoaded});
  FakeWorker& p =
      AddWorker({.worker_id = "p", .dp_group = 0, .token_delay = 5ms, .descriptors = {"ucx-p"}, .role = "prefill"});
  FakeWorker& d1 =
      AddWorker({.worker_id = "d", .dp_group = 0, .token_delay = 5ms, .descriptors = {"ucx-d"}, .role = "decode"});
  FakeWorker& d2 = AddWorker({.worker_id = "e", .dp_group = 0, .token_delay = 5ms, .role = "decode"});
  std::vector<std::unique_ptr<AsyncGenerate>> calls;
  for (int i = 0; i < 6; ++i)
    calls.push_back(std::make_unique<AsyncGenerate>(*stub_, MakeRequest({1, 2, i}, 30, i, "pd" + std::to_string(i))));
  for (int i = 0; i < 6; ++i) ExpectServed(calls[i]->Get(), {1, 2, i}, i, 30);
  EXPECT_EQ(p.routes().size(), 6u);
  EXPECT_EQ(d1.routes().size() + d2.routes().size(), 6u);
  for (int i = 0; i < 6; ++i) {
    const std::string id = "pd" + std::to_string(i);
    EXPECT_FALSE((d1.resumed(id).empty() && d2.resumed(id).empty())) << id;
    EXPECT_EQ(d1.source(id).has_value(), !d1.resumed(id).empty()) << id << ": blocks only to the group that moves them";
    EXPECT_FALSE(d2.source(id).has_value()) << id;
  }
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(FindGroup(s, "p", 0)->role(), "prefill");
  EXPECT_EQ(FindGroup(s, "d", 0)->role(), "decode");
  EXPECT_EQ(FindGroup(s, "p", 0)->migrated_out(), 6);
  EXPECT_EQ(s.coordinator().requests_migrated(), 6);
  // Without a prefill or mixed group, decode groups take new requests.
  p.Stop();
  ASSERT_TRUE(WaitStats([](const auto& st) { return !FindGroup(st, "p", 0)->connected(); }));
  ExpectServed(Generate(*stub_, MakeRequest({9, 9}, 5, 3)), {9, 9}, 3, 5);
}

// Rebalancing: six long requests pile up on group a before b connects; the
// coordinator moves them over one at a time until the two differ by less
// than the threshold, never the same request twice, and every stream is
// whole.
TEST_F(CoordinatorTest, RebalancingEvensOutGroupsWithoutBouncing) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin,
                    .rebalance_threshold = 2,
                    .rebalance_period_s = 0.05,
                    .rebalance_cooldown_s = 60});
  AddWorker({.worker_id = "a", .dp_group = 0, .token_delay = 5ms});
  std::vector<std::unique_ptr<UnboundedGenerate>> calls;
  for (int i = 0; i < 6; ++i)
    calls.push_back(std::make_unique<UnboundedGenerate>(*stub_, MakeRequest({4, 4, i}, 300 + 20 * i, i)));
  ASSERT_TRUE(calls[5]->WaitTokens(2));
  FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1, .token_delay = 5ms});
  for (int i = 0; i < 6; ++i) ExpectServed(calls[i]->Get(), {4, 4, i}, i, 300 + 20 * i);
  const v1::GetStatsResponse s = Stats();
  // 6 on a, 0 on b: moves until the gap is below 2 (a 4, b 2: two moves,
  // or a 3, b 3: three; requests that end meanwhile change the count).
  EXPECT_GE(s.coordinator().rebalance_moves(), 2);
  EXPECT_LE(s.coordinator().rebalance_moves(), 3);
  EXPECT_EQ(s.coordinator().requests_migrated(), s.coordinator().rebalance_moves());
  EXPECT_EQ(FindGroup(s, "b", 1)->migrated_in(), s.coordinator().rebalance_moves());
  EXPECT_EQ(FindGroup(s, "b", 1)->migrated_out(), 0) << "moved back: bounced";
  // The requests with the most tokens left went first: the longest ones.
  std::set<int> moved;
  for (int i = 0; i < 6; ++i)
    if (!b.resumed(calls[i]->Get().ids.empty() ? "" : *calls[i]->Get().ids.begin()).empty()) moved.insert(i);
  EXPECT_TRUE(moved.count(5)) << "the longest request stayed";
}

// Rebalancing against least_loaded routing: one long request on a, three
// short ones on b (least_loaded put them there: fewer queued tokens). b has
// the most requests in flight, but moving one to a would leave a with more
// queued tokens than b, and the router would send the next requests back to
// b: no move. (Moving by request count alone moves one at once.)
// Rebalancing by cache use: a holds a 400-token request (100 blocks of 4)
// and a short one, b a short one; a reports 92% of its 256 blocks in use,
// b 2%. The request holding the most rows (the long one) moves to b, once;
// requests in flight (2 against 1) would not have moved anything at this
// threshold. When b then reports itself 92% full and a 2%, the long one
// is in its cooldown: the short one on b moves instead.
TEST_F(CoordinatorTest, RebalancingByCacheUseMovesTheRequestHoldingTheMostRows) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin,
                    .rebalance_threshold = 5,
                    .rebalance_period_s = 0.02,
                    .rebalance_cooldown_s = 60,
                    .rebalance_cache_fraction = 0.3});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 0, .token_delay = 5ms});
  FakeWorker& b = AddWorker({.worker_id = "b", .dp_group = 1, .token_delay = 5ms});
  std::vector<int32_t> long_prompt(400);
  for (int i = 0; i < 400; ++i) long_prompt[static_cast<size_t>(i)] = 10 + i % 300;
  UnboundedGenerate big(*stub_, MakeRequest(long_prompt, 400, 1, "big"));  // round robin: a
  ASSERT_TRUE(big.WaitTokens(1));
  UnboundedGenerate small_b(*stub_, MakeRequest({7, 7}, 300, 2, "small-b"));  // b
  ASSERT_TRUE(small_b.WaitTokens(1));
  UnboundedGenerate small_a(*stub_, MakeRequest({8, 8}, 300, 3, "small-a"));  // a
  ASSERT_TRUE(small_a.WaitTokens(1));
  EXPECT_EQ(Stats().coordinator().rebalance_moves(), 0) << "nothing reported yet";
  b.SendStats(250);
  a.SendStats(20);
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.coordinator().requests_migrated() == 1; }));
  EXPECT_FALSE(b.resumed("big").empty()) << "the long request moved to b; b has: "
                                         << testing::PrintToString(b.routes());
  a.SendStats(250);
  b.SendStats(20);
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.coordinator().requests_migrated() == 2; }));
  EXPECT_FALSE(a.resumed("small-b").empty()) << "a has: " << testing::PrintToString(a.routes());
  ExpectServed(big.Get(), long_prompt, 1, 400);
  ExpectServed(small_a.Get(), {8, 8}, 3, 300);
  ExpectServed(small_b.Get(), {7, 7}, 2, 300);
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().rebalance_moves(), 2);
  EXPECT_EQ(FindGroup(s, "a", 0)->migrated_out(), 1);
  EXPECT_EQ(FindGroup(s, "b", 1)->migrated_out(), 1) << "big was not moved back";
}

TEST_F(CoordinatorTest, RebalancingDoesNotMoveAgainstLeastLoadedRouting) {
  StartCoordinator({.policy = RoutingPolicy::kLeastLoaded,
                    .rebalance_threshold = 2,
                    .rebalance_period_s = 0.02,
                    .rebalance_cooldown_s = 60});
  AddWorker({.worker_id = "a", .dp_group = 0, .token_delay = 2ms});
  AddWorker({.worker_id = "b", .dp_group = 1, .token_delay = 2ms});
  std::vector<std::unique_ptr<UnboundedGenerate>> calls;
  calls.push_back(std::make_unique<UnboundedGenerate>(*stub_, MakeRequest({5, 5}, 600, 1)));
  ASSERT_TRUE(calls[0]->WaitTokens(1));
  for (int i = 1; i <= 3; ++i) {
    calls.push_back(std::make_unique<UnboundedGenerate>(*stub_, MakeRequest({5, 6, i}, 150, i)));
    ASSERT_TRUE(calls.back()->WaitTokens(1));
  }
  ExpectServed(calls[0]->Get(), {5, 5}, 1, 600);
  for (int i = 1; i <= 3; ++i) {
    ExpectServed(calls[i]->Get(), {5, 6, i}, i, 150);
    EXPECT_EQ(calls[i]->Get().finished->dp_group(), 1) << "request " << i;
  }
  EXPECT_EQ(calls[0]->Get().finished->dp_group(), 0);
  EXPECT_EQ(Stats().coordinator().rebalance_moves(), 0);
}

// What Migrate refuses, each error naming why; a move whose request ends
// first answers with that end.
TEST_F(CoordinatorTest, MigrateRefusesWhatItCannotDo) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
  AddWorker({.worker_id = "a", .dp_group = 0, .hold = true, .ignore_migrate_out = true});
  EXPECT_EQ(MigrateRpc("nobody", -1).error_code(), grpc::StatusCode::NOT_FOUND);
  UnboundedGenerate r(*stub_, MakeRequest({1, 2}, 8, 0, "held"));
  ASSERT_TRUE(workers_[0]->WaitRoutes(1));
  grpc::Status st = MigrateRpc("held", -1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  st = MigrateRpc("held", 0);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("runs on DP group 0 already"), std::string::npos) << st.error_message();
  st = MigrateRpc("held", 5);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("no connected DP group 5"), std::string::npos) << st.error_message();
  AddWorker({.worker_id = "b", .dp_group = 1});
  AddWorker({.worker_id = "c", .dp_group = 1});
  st = MigrateRpc("held", 1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("several worker jobs"), std::string::npos) << st.error_message();
  // Group a never answers the move: it stays pending until the request ends.
  grpc::Status first;
  std::thread mover([&] { first = MigrateRpc("held", 1, nullptr, "c"); });
  std::this_thread::sleep_for(100ms);
  st = MigrateRpc("held", 1, nullptr, "b");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("moving already"), std::string::npos) << st.error_message();
  EXPECT_TRUE(CancelRpc("held"));
  mover.join();
  EXPECT_EQ(first.error_code(), grpc::StatusCode::CANCELLED) << first.error_message();
  EXPECT_NE(first.error_message().find("ended before it ran on its new group"), std::string::npos)
      << first.error_message();
  EXPECT_EQ(r.Get().status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(Stats().coordinator().migrations_failed(), 1);
}

// A request that finishes on its group before the group answers the move:
// Migrate says so, the client has its whole answer from the old group.
TEST_F(CoordinatorTest, MigrateOfARequestThatFinishesFirstIsFailedPrecondition) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
  AddWorker({.worker_id = "a", .dp_group = 0, .token_delay = 20ms, .ignore_migrate_out = true});
  AddWorker({.worker_id = "b", .dp_group = 1});
  UnboundedGenerate r(*stub_, MakeRequest({3, 1}, 10, 4, "short"));
  ASSERT_TRUE(r.WaitTokens(2));
  const grpc::Status st = MigrateRpc("short", 1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_NE(st.error_message().find("finished (length) before it could move"), std::string::npos) << st.error_message();
  ExpectServed(r.Get(), {3, 1}, 4, 10);
  EXPECT_EQ(r.Get().finished->dp_group(), 0);
}

// The old group dies before it hands the request over: the request goes on
// on the new group from the tokens its client has, and the move succeeds.
TEST_F(CoordinatorTest, FaultMigrateSourceDiesMidMoveAndTheRequestGoesOn) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
  FakeWorker& a = AddWorker({.worker_id = "a", .dp_group = 0, .token_delay = 10ms, .ignore_migrate_out = true});
  AddWorker({.worker_id = "b", .dp_group = 1, .token_delay = 10ms});
  UnboundedGenerate r(*stub_, MakeRequest({8, 8}, 40, 2, "orphan"));
  ASSERT_TRUE(r.WaitTokens(3));
  ASSERT_FALSE(a.routes().empty());
  v1::MigrateResponse m;
  grpc::Status st;
  std::thread mover([&] { st = MigrateRpc("orphan", 1, &m); });
  std::this_thread::sleep_for(50ms);
  a.Break();
  mover.join();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(m.to_group(), 1);
  ExpectServed(r.Get(), {8, 8}, 2, 40);
  EXPECT_EQ(r.Get().finished->dp_group(), 1);
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().requests_migrated(), 1);
  EXPECT_EQ(FindGroup(s, "a", 0)->migrated_out(), 1);
}

// A full registry forgets the group that went away first to make room for a
// new one (restarted jobs register under new worker ids); it refuses only
// when every group it knows is connected.
TEST_F(CoordinatorTest, AFullRegistryForgetsTheGroupThatLeftFirst) {
  StartCoordinator({.max_known_groups = 3});
  auto WaitHealth = [this](int connected) {
    for (int i = 0; i < 250; ++i) {
      if (Health().groups_connected() == connected) return true;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  };
  FakeWorker& w1 = AddWorker({.worker_id = "w1"});
  FakeWorker& w2 = AddWorker({.worker_id = "w2"});
  AddWorker({.worker_id = "w3"});
  FakeWorker w4(coord_->address(), {.worker_id = "w4"});
  EXPECT_FALSE(w4.Connect());
  EXPECT_EQ(w4.end_status().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(w4.end_status().error_message().find("every one of them is connected"), std::string::npos)
      << w4.end_status().error_message();
  w1.Break();
  ASSERT_TRUE(WaitHealth(2));
  std::this_thread::sleep_for(20ms);
  w2.Break();
  ASSERT_TRUE(WaitHealth(1));
  // w1 left first: it is forgotten, w2 is still listed as gone.
  AddWorker({.worker_id = "w5"});
  v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.groups_size(), 3);
  EXPECT_EQ(FindGroup(s, "w1", 0), nullptr);
  ASSERT_NE(FindGroup(s, "w2", 0), nullptr);
  EXPECT_FALSE(FindGroup(s, "w2", 0)->connected());
  ASSERT_NE(FindGroup(s, "w5", 0), nullptr);
  EXPECT_TRUE(FindGroup(s, "w5", 0)->connected());
  // The new group serves (its slot is fresh: no counters of w1's).
  EXPECT_EQ(FindGroup(s, "w5", 0)->requests_routed(), 0);
  for (int i = 0; i < 4; ++i) ExpectServed(Generate(*stub_, MakeRequest({2, 3}, 2, i)), {2, 3}, i, 2);
  // And a returning w2 takes its own remembered slot back.
  ASSERT_TRUE(w2.Connect());
  EXPECT_EQ(Health().groups_connected(), 3);
}

// An idle group that never reports stats is not a stalled one: silence
// without work is fine for a group that never promised a heartbeat.
TEST_F(CoordinatorTest, FaultIdleGroupIsNotStalled) {
  StartCoordinator({.stall_timeout_s = 0.2});
  AddWorker({});
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(Health().groups_connected(), 1);
  ExpectServed(Generate(*stub_, MakeRequest({1, 2}, 3)), {1, 2}, 0, 3);
}

// An idle group whose leader reported stats and then fell silent (its step
// loop froze: a stopped rank) is dropped after the stall timeout, so Health
// stops counting it and nothing is routed to it; while it keeps reporting it
// stays.
TEST_F(CoordinatorTest, FaultIdleGroupThatStopsReportingIsDropped) {
  StartCoordinator({.policy = RoutingPolicy::kRoundRobin, .stall_timeout_s = 0.4});
  FakeWorker& a = AddWorker({.worker_id = "a"});
  AddWorker({.worker_id = "b", .dp_group = 1});
  auto silent = std::chrono::steady_clock::now();
  for (int i = 0; i < 8; ++i) {  // 0.8 s of reports every 0.1 s: alive
    std::this_thread::sleep_for(100ms);
    a.SendStats(100);
    silent = std::chrono::steady_clock::now();
  }
  EXPECT_EQ(Health().groups_connected(), 2);
  bool dropped = false;
  while (!dropped && std::chrono::steady_clock::now() - silent < 5s) {
    std::this_thread::sleep_for(20ms);
    dropped = Health().groups_connected() == 1;
  }
  ASSERT_TRUE(dropped) << "the silent group is still counted 5 s later";
  EXPECT_GE(std::chrono::steady_clock::now() - silent, 300ms) << "not before the stall timeout";
  const v1::GetStatsResponse s = Stats();
  ASSERT_NE(FindGroup(s, "a", 0), nullptr);
  EXPECT_FALSE(FindGroup(s, "a", 0)->connected());
  EXPECT_NE(FindGroup(s, "a", 0)->disconnect_reason().find("sent nothing for"), std::string::npos)
      << FindGroup(s, "a", 0)->disconnect_reason();
  EXPECT_NE(FindGroup(s, "a", 0)->disconnect_reason().find("while idle"), std::string::npos);
  // Every request now goes to the other group.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Generate(*stub_, MakeRequest({4, 5}, 2, i)).finished->dp_group(), 1);
}

// No group at all: a request waits the queue timeout, even when its own
// deadline is later, and is told that none registered.
TEST_F(CoordinatorTest, FaultNoGroupEndsAtTheQueueTimeoutWithOrWithoutDeadline) {
  StartCoordinator({.queue_timeout_s = 0.3});
  UnboundedGenerate unbounded(*stub_, MakeRequest({1, 2}, 2));
  const GenResult with_deadline = Generate(*stub_, MakeRequest({1, 3}, 2), 20s);
  for (const GenResult* r : {&with_deadline, &unbounded.Get()}) {
    const std::string& m = r->status.error_message();
    EXPECT_EQ(r->status.error_code(), grpc::StatusCode::UNAVAILABLE) << m;
    EXPECT_NE(m.find("no DP group registered within the coordinator's queue timeout of 0.3 s"), std::string::npos) << m;
    EXPECT_GE(r->elapsed_ms, 250);
    EXPECT_LT(r->elapsed_ms, 3000);
  }
  EXPECT_FALSE(unbounded.watchdog_fired());
}

// The group comes back within the lost-group wait: the request it had not
// answered (no deadline, past the queue timeout) is served by it.
TEST_F(CoordinatorTest, FaultGroupBackServesTheRequestWithoutDeadlineItLost) {
  StartCoordinator({.queue_timeout_s = 0.2, .lost_group_wait_s = 5});
  FakeWorker& a = AddWorker({.worker_id = "a", .hold = true});
  UnboundedGenerate r(*stub_, MakeRequest({4, 5}, 3, 1));
  ASSERT_TRUE(a.WaitRoutes(1));
  std::this_thread::sleep_for(300ms);
  a.Break();
  std::this_thread::sleep_for(100ms);
  a.options().hold = false;
  ASSERT_TRUE(a.Connect());
  ExpectServed(r.Get(), {4, 5}, 1, 3);
  EXPECT_FALSE(r.watchdog_fired());
}

// Requests that do not parse (a string field that is not UTF-8, a truncated
// message) get INVALID_ARGUMENT with a message, on every Mlarun method; the
// service keeps serving.
TEST_F(CoordinatorTest, UnparsableRequestsAreInvalidArgumentWithAMessage) {
  StartCoordinator();
  AddWorker({});
  grpc::GenericStub generic(grpc::CreateChannel(coord_->address(), grpc::InsecureChannelCredentials()));
  auto call = [&](const std::string& method, const std::string& bytes) {
    grpc::ClientContext ctx;
    ctx.set_deadline(SysClock::now() + 5s);
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::CompletionQueue cq;
    auto rpc = generic.PrepareCall(&ctx, method, &cq);
    rpc->StartCall(reinterpret_cast<void*>(1));
    void* tag;
    bool ok;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    rpc->Write(request, grpc::WriteOptions().set_last_message(), reinterpret_cast<void*>(2));
    EXPECT_TRUE(cq.Next(&tag, &ok));
    grpc::ByteBuffer response;
    int reads = 0;
    for (;;) {
      rpc->Read(&response, reinterpret_cast<void*>(3));
      EXPECT_TRUE(cq.Next(&tag, &ok));
      if (!ok) break;
      ++reads;
    }
    grpc::Status status;
    rpc->Finish(&status, reinterpret_cast<void*>(4));
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reads, 0) << method;
    return status;
  };
  // Field 1 (request_id, a string) holding 0xff 0xfe: not UTF-8.
  const std::string bad_utf8("\x0a\x02\xff\xfe", 4);
  // Field 2 (prompt_ids, packed) claiming 10 bytes, holding 2.
  const std::string truncated("\x12\x0a\x01\x02", 4);
  for (const std::string& method :
       {std::string("/mlarun.v1.Mlarun/Generate"), std::string("/mlarun.v1.Mlarun/Cancel")}) {
    for (const std::string& bytes : {bad_utf8, truncated}) {
      const grpc::Status st = call(method, bytes);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method << ": " << st.error_message();
      EXPECT_NE(st.error_message().find("does not parse as mlarun.v1."), std::string::npos)
          << method << ": " << st.error_message();
    }
  }
  const grpc::Status stats = call("/mlarun.v1.Mlarun/GetStats", truncated);
  EXPECT_EQ(stats.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << stats.error_message();
  // The service keeps serving, parsed requests as before.
  ExpectServed(Generate(*stub_, MakeRequest({1, 2}, 3)), {1, 2}, 0, 3);
  EXPECT_TRUE(CancelRpc("nobody") == false);
  EXPECT_TRUE(Health().serving());
}

// Once every group has gone away, a request that waits for one in vain is
// told what happened to them, not only that none registered.
TEST_F(CoordinatorTest, NoGroupLeftSaysWhichGroupWentAwayAndWhy) {
  StartCoordinator();
  AddWorker({.worker_id = "a", .dp_group = 3});
  workers_.back()->Break();
  ASSERT_TRUE(WaitStats([](const auto& s) { return s.groups_size() == 1 && !s.groups(0).connected(); }));
  const GenResult r = Generate(*stub_, MakeRequest({1, 2}, 2), 400ms);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string& m = r.status.error_message();
  EXPECT_EQ(m.find("no DP group registered"), std::string::npos) << m;
  EXPECT_NE(m.find("DP group 3 of worker 'a'"), std::string::npos) << m;
  EXPECT_NE(m.find("went away"), std::string::npos) << m;
  EXPECT_NE(m.find("s ago"), std::string::npos) << m;
  EXPECT_NE(m.find("stream to the coordinator ended"), std::string::npos) << m;
  EXPECT_GT(r.elapsed_ms, 300) << "it waited for its deadline, as before";
}

// Completions, deadlines, client cancellations, Cancel calls and a group
// breaking and coming back, all at once: every request still ends exactly
// once and the books balance.
TEST_F(CoordinatorTest, MixedTrafficKeepsTheBooksBalanced) {
  StartCoordinator({.policy = RoutingPolicy::kLeastLoaded, .max_in_flight_per_group = 4});
  for (int g = 0; g < 3; ++g) AddWorker({.dp_group = g, .token_delay = 1ms});
  constexpr int kClients = 48;
  std::vector<grpc::StatusCode> codes(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const std::string id = "m" + std::to_string(i);
      grpc::ClientContext ctx;
      ctx.set_deadline(SysClock::now() + (i % 4 == 1 ? 40ms : Ms(5000)));
      auto reader = stub_->Generate(&ctx, MakeRequest({i + 1, 2, 3}, 20, 0, id));
      v1::GenerateResponse resp;
      int64_t next = 0;
      while (reader->Read(&resp)) {
        if (resp.has_token()) {
          EXPECT_EQ(resp.token().index(), next++);
        }
        if (i % 4 == 2 && next == 2) ctx.TryCancel();
        if (i % 4 == 3 && next == 1) {
          grpc::ClientContext c;
          c.set_deadline(SysClock::now() + 5s);
          v1::CancelRequest req;
          req.set_request_id(id);
          v1::CancelResponse cr;
          EXPECT_TRUE(stub_->Cancel(&c, req, &cr).ok());
        }
      }
      codes[i] = reader->Finish().error_code();
    });
  }
  std::this_thread::sleep_for(15ms);
  workers_[1]->Break();
  std::this_thread::sleep_for(15ms);
  ASSERT_TRUE(workers_[1]->Connect());
  for (auto& t : threads) t.join();
  std::map<grpc::StatusCode, int> by_code;
  for (grpc::StatusCode c : codes) ++by_code[c];
  EXPECT_GT(by_code[grpc::StatusCode::OK], 0);
  for (const auto& [code, n] : by_code) {
    EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::CANCELLED ||
                code == grpc::StatusCode::DEADLINE_EXCEEDED || code == grpc::StatusCode::UNAVAILABLE)
        << code;
  }
  // Client-side deadlines can beat the coordinator's answer, so compare the
  // coordinator's books with themselves: nothing live, nothing lost.
  ASSERT_TRUE(WaitStats([](const auto& s) {
    int64_t in_flight = 0;
    for (const auto& g : s.groups()) in_flight += g.requests_in_flight();
    return in_flight == 0;
  }));
  const v1::GetStatsResponse s = Stats();
  const v1::CoordinatorStats& c = s.coordinator();
  // A 40 ms client deadline on a loaded machine can expire before the call
  // reaches the coordinator at all: those calls are the only ones it may
  // not have seen.
  EXPECT_LE(c.requests_received(), kClients);
  EXPECT_GE(c.requests_received(), kClients - by_code[grpc::StatusCode::DEADLINE_EXCEEDED]);
  EXPECT_EQ(c.requests_completed() + c.requests_rejected() + c.requests_failed() + c.requests_cancelled(),
            c.requests_received());
  EXPECT_EQ(c.requests_queued(), 0);
  int64_t completed = 0;
  for (const auto& g : s.groups()) {
    EXPECT_EQ(g.queued_tokens(), 0);
    EXPECT_TRUE(g.connected());
    completed += g.requests_completed();
  }
  EXPECT_EQ(completed, c.requests_completed());
  EXPECT_GE(c.requests_completed(), by_code[grpc::StatusCode::OK]);
}

TEST_F(CoordinatorTest, HealthAndStatsReportGroupsAndRanks) {
  StartCoordinator();
  FakeWorker& w0 = AddWorker({.worker_id = "job", .dp_group = 0, .cache_blocks = 300, .ranks = 2});
  AddWorker({.worker_id = "job", .dp_group = 1, .cache_blocks = 300, .ranks = 2});
  EXPECT_FALSE(w0.coordinator_id().empty());
  const v1::HealthResponse h = Health();
  EXPECT_TRUE(h.serving());
  EXPECT_EQ(h.groups_connected(), 2);
  v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.coordinator().policy(), "prefix_affinity");
  ASSERT_EQ(s.ranks_size(), 4);
  std::set<int> ranks;
  for (const auto& r : s.ranks()) {
    EXPECT_EQ(r.worker_id(), "job") << "filled in by the coordinator";
    ranks.insert(r.rank());
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  ASSERT_EQ(s.groups_size(), 2);
  for (const auto& g : s.groups()) {
    EXPECT_TRUE(g.connected());
    EXPECT_EQ(g.worker_id(), "job");
    EXPECT_EQ(g.free_blocks(), 300);
  }
  w0.SendStats(123);
  EXPECT_TRUE(WaitStats([](const auto& st) { return st.groups(0).free_blocks() == 123; }));
  w0.Stop();
  EXPECT_TRUE(WaitStats([](const auto& st) { return !st.groups(0).connected(); }));
  EXPECT_EQ(Health().groups_connected(), 1);
  s = Stats();
  EXPECT_EQ(s.groups_size(), 2) << "a disconnected group stays known";
  EXPECT_EQ(s.ranks_size(), 4);
}

TEST_F(CoordinatorTest, ShutdownEndsLiveStreamsWithUnavailable) {
  StartCoordinator();
  FakeWorker& w = AddWorker({.hold = true});
  AsyncGenerate call(*stub_, MakeRequest({1, 2}, 4), 10s);
  ASSERT_TRUE(w.WaitRoutes(1));
  const auto start = std::chrono::steady_clock::now();
  coord_->Shutdown();
  coord_->Wait();  // returns at once after Shutdown
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms);
  EXPECT_EQ(call.Get().status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// ---- The worker link's guards ---------------------------------------------------

TEST_F(CoordinatorTest, RegistrationOutOfRangeIsRefusedNamingTheField) {
  StartCoordinator();
  struct Case {
    std::string field;  // in the message
    std::function<void(v1::Register&)> edit;
    grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  };
  const std::vector<Case> cases = {
      {"register.worker_id", [](v1::Register& r) { r.set_worker_id(std::string(300, 'w')); }},
      {"register.dp:", [](v1::Register& r) { r.set_dp(-5); }},
      {"register.dp:", [](v1::Register& r) { r.set_dp(1 << 30); }},
      {"register.attn_tp", [](v1::Register& r) { r.set_attn_tp(-1); }},
      {"register: dp * attn_tp",
       [](v1::Register& r) {
         r.set_dp(4096);
         r.set_attn_tp(1024);
       }},
      {"register.dp_group",
       [](v1::Register& r) {
         r.set_dp_group(2);
         r.set_dp(2);
       }},
      {"register.vocab_size", [](v1::Register& r) { r.set_vocab_size(int64_t{1} << 62); }},
      {"register.vocab_size", [](v1::Register& r) { r.set_vocab_size(0); }},
      {"register.max_position_embeddings", [](v1::Register& r) { r.set_max_position_embeddings(-1); }},
      {"register.block_size", [](v1::Register& r) { r.set_block_size(int64_t{1} << 40); }},
      {"register.cache_blocks_total", [](v1::Register& r) { r.set_cache_blocks_total(int64_t{1} << 62); }},
      {"register.ranks[0].rank", [](v1::Register& r) { r.mutable_ranks(0)->set_rank(-7); }},
      {"register.ranks[0].attn_tp_rank", [](v1::Register& r) { r.mutable_ranks(0)->set_attn_tp_rank(3); }},
      {"register.ranks[0].dp_group", [](v1::Register& r) { r.mutable_ranks(0)->set_dp_group(1); }},
      {"register.ranks: at most attn_tp",
       [](v1::Register& r) {
         for (int i = 0; i < 5; ++i) *r.add_ranks() = r.ranks(0);
       }},
      {"register.ranks[0]: at most 8192 bytes",
       [](v1::Register& r) { r.mutable_ranks(0)->set_host(std::string(9 << 10, 'h')); }},
      {"WorkerMessage may take at most",
       [](v1::Register& r) { r.mutable_ranks(0)->set_host(std::string(5 << 20, 'h')); },
       grpc::StatusCode::RESOURCE_EXHAUSTED},
  };
  for (const Case& c : cases) {
    FakeWorker bad(coord_->address(), {.worker_id = "bad", .edit_register = c.edit});
    EXPECT_FALSE(bad.ConnectOnce()) << c.field;
    const grpc::Status s = bad.WaitEnded();
    EXPECT_EQ(s.error_code(), c.code) << c.field << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.field), std::string::npos) << s.error_message();
  }
  // Nothing of them is known, and a real group serves.
  EXPECT_EQ(Health().groups_connected(), 0);
  FakeWorker& good = AddWorker({.worker_id = "good"});
  const std::vector<int32_t> prompt = {1, 2, 3};
  ExpectServed(Generate(*stub_, MakeRequest(prompt, 3, 5)), prompt, 5, 3);
  const v1::GetStatsResponse st = Stats();
  ASSERT_EQ(st.groups_size(), 1);
  EXPECT_EQ(st.groups(0).worker_id(), "good");
  EXPECT_EQ(good.routes().size(), 1u);
}

TEST_F(CoordinatorTest, RankStatsOfAllGroupsAreBoundedAndGetStatsKeepsWorking) {
  StartCoordinator();
  // 64 ranks of ~7 KiB each: ~450 KiB a group; the fifth such group passes
  // the 2 MiB all groups may keep.
  auto big = [](v1::Register& r) {
    r.set_attn_tp(64);
    r.clear_ranks();
    for (int i = 0; i < 64; ++i) {
      v1::RankStats* s = r.add_ranks();
      s->set_rank(i);
      s->set_attn_tp_rank(i);
      s->set_host(std::string(7 << 10, 'h'));
    }
  };
  std::vector<std::unique_ptr<FakeWorker>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<FakeWorker>(
        coord_->address(), FakeWorkerOptions{.worker_id = "big" + std::to_string(i), .edit_register = big}));
    ASSERT_TRUE(held.back()->ConnectOnce()) << i << ": " << held.back()->end_status().error_message();
  }
  FakeWorker fifth(coord_->address(), {.worker_id = "big4", .edit_register = big});
  EXPECT_FALSE(fifth.ConnectOnce());
  const grpc::Status s = fifth.WaitEnded();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("register.ranks: the rank stats of all groups may take at most"), std::string::npos)
      << s.error_message();
  grpc::ClientContext ctx;
  ctx.set_deadline(SysClock::now() + 10s);
  v1::GetStatsResponse resp;
  const grpc::Status st = stub_->GetStats(&ctx, v1::GetStatsRequest(), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.groups_size(), 4);
  EXPECT_EQ(resp.ranks_size(), 4 * 64);
}

TEST_F(CoordinatorTest, LeavingReasonIsKeptBounded) {
  StartCoordinator();
  FakeWorker& w = AddWorker({.worker_id = "job"});
  w.Leave(std::string(100 << 10, 'r'));
  EXPECT_TRUE(WaitStats([](const auto& st) { return st.groups_size() == 1 && !st.groups(0).connected(); }));
  const std::string reason = Stats().groups(0).disconnect_reason();
  EXPECT_LE(reason.size(), 1024u);
  EXPECT_EQ(reason.rfind("its leader left: rrr", 0), 0u) << reason.substr(0, 40);
}

TEST_F(CoordinatorTest, ConnectedGroupCannotBeTakenOver) {
  StartCoordinator();
  FakeWorker& owner = AddWorker({.worker_id = "job", .dp_group = 0});
  FakeWorker impostor(coord_->address(), {.worker_id = "job", .dp_group = 0});
  EXPECT_FALSE(impostor.ConnectOnce());
  const grpc::Status s = impostor.WaitEnded();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  EXPECT_NE(s.error_message().find("DP group 0 of worker 'job' is registered and connected"), std::string::npos)
      << s.error_message();
  const std::vector<int32_t> prompt = {4, 5};
  ExpectServed(Generate(*stub_, MakeRequest(prompt, 2, 1)), prompt, 1, 2);
  EXPECT_EQ(owner.routes().size(), 1u);
  EXPECT_TRUE(impostor.routes().empty());
  EXPECT_EQ(Health().groups_connected(), 1);
  // Once the owner's stream ended the group may register again.
  owner.Break();
  EXPECT_TRUE(impostor.Connect());
  ExpectServed(Generate(*stub_, MakeRequest(prompt, 2, 1)), prompt, 1, 2);
}

TEST_F(CoordinatorTest, WorkerSecretIsRequiredWhenSet) {
  CoordinatorOptions o;
  o.worker_secret = "s3cret-value";
  StartCoordinator(o);
  FakeWorker none(coord_->address(), {.worker_id = "none"});
  EXPECT_FALSE(none.ConnectOnce());
  grpc::Status s = none.WaitEnded();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("--worker-secret-file"), std::string::npos) << s.error_message();
  for (const std::string& wrong :
       std::vector<std::string>{"s3cret-valuE", "s3cret-value2", "s", std::string(4000, 'x')}) {
    FakeWorker w(coord_->address(), {.worker_id = "wrong", .secret = wrong});
    EXPECT_FALSE(w.ConnectOnce());
    s = w.WaitEnded();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_NE(s.error_message().find("does not match"), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(Health().groups_connected(), 0);
  EXPECT_EQ(Stats().groups_size(), 0) << "a refused worker is never registered";
  FakeWorker& good = AddWorker({.worker_id = "good", .secret = "s3cret-value"});
  const std::vector<int32_t> prompt = {7, 8, 9};
  ExpectServed(Generate(*stub_, MakeRequest(prompt, 4, 2)), prompt, 2, 4);
  EXPECT_EQ(good.routes().size(), 1u);
  EXPECT_TRUE(none.routes().empty());
}

TEST(CoordinatorStart, BeyondLoopbackNeedsAWorkerSecret) {
  for (const std::string listen : std::vector<std::string>{"0.0.0.0:0", "[::]:0"}) {
    auto c = Coordinator::Start({.listen = listen});
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << listen;
    EXPECT_NE(c.status().message().find("--worker-secret-file"), std::string::npos) << c.status();
  }
  auto secured = Coordinator::Start({.listen = "0.0.0.0:0", .worker_secret = "abc"});
  EXPECT_TRUE(secured.ok()) << secured.status();
  auto open = Coordinator::Start({.listen = "0.0.0.0:0", .open_worker_link_off_loopback = true});
  EXPECT_TRUE(open.ok()) << open.status();
  EXPECT_TRUE(IsLoopbackListenAddress("127.0.0.1:1"));
  EXPECT_TRUE(IsLoopbackListenAddress("127.1.2.3:1"));
  EXPECT_TRUE(IsLoopbackListenAddress("[::1]:1"));
  EXPECT_TRUE(IsLoopbackListenAddress("localhost:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("0.0.0.0:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("[::]:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("127.example.com:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("host1:1"));
  for (const std::string listen : std::vector<std::string>{"127.0.0.1:0", "localhost:0"}) {
    auto c = Coordinator::Start({.listen = listen});
    EXPECT_TRUE(c.ok()) << listen << ": " << c.status();
  }
}

// The HTTP API beyond loopback needs client tokens or
// allow_unauthenticated_http. The check comes before the tokenizer is read,
// so an address it lets through fails next on the missing --model.
TEST(CoordinatorStart, HttpBeyondLoopbackNeedsTokensOrConsent) {
  auto message = [](const CoordinatorOptions& o) { return std::string(Coordinator::Start(o).status().message()); };
  const AuthTokens tokens({Principal{.token = RandomHex(16), .name = "alice"}});
  for (const std::string http : {"0.0.0.0:0", "[::]:0", "10.1.2.3:0", "128.0.0.1:0", "host1:0"}) {
    const std::string refused = message({.http_listen = http});
    EXPECT_NE(refused.find("--http binds beyond loopback (got '" + http + "')"), std::string::npos) << refused;
    EXPECT_NE(refused.find("--allow-unauthenticated"), std::string::npos) << refused;
    EXPECT_NE(message({.http_listen = http, .allow_unauthenticated_http = true}).find("--http needs --model"),
              std::string::npos)
        << http;
    EXPECT_NE(message({.auth_tokens = tokens, .http_listen = http}).find("--http needs --model"), std::string::npos)
        << http;
  }
  for (const std::string http : {"127.0.0.1:0", "127.9.8.7:0", "[::1]:0", "::1:0", "localhost:0"})
    EXPECT_NE(message({.http_listen = http}).find("--http needs --model"), std::string::npos) << http;
}

TEST(ReadSecretFile, TrimsAndRefusesEmptyOrUnreadable) {
  const std::string dir = ::testing::TempDir();
  const std::string good = dir + "/mlarun_secret_good", empty = dir + "/mlarun_secret_empty",
                    bad = dir + "/mlarun_secret_binary";
  { std::ofstream(good) << "  tok3n-value \n"; }
  { std::ofstream(empty) << " \n\t\n"; }
  { std::ofstream(bad) << "a\x01b"; }
  auto s = ReadSecretFile("--worker-secret-file", good);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, "tok3n-value");
  for (const std::string& path : {empty, bad, dir + "/mlarun_secret_missing"}) {
    auto r = ReadSecretFile("--worker-secret-file", path);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << path;
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("--worker-secret-file"), std::string::npos) << r.status();
  }
}

// A group that forges one kind of answer for the request "victim" (and sends
// nothing for the others, which are then re-routed): the victim fails naming
// the group and the violation, the group is disconnected, and a real group
// takes what it left.
TEST_F(CoordinatorTest, ForgedAnswersDisconnectTheGroupAndNeverReachTheClient) {
  using Step = std::function<void(v1::WorkerMessage&, std::vector<v1::WorkerMessage>&)>;
  auto only_victim = [](std::function<void(v1::TokenEvent&)> token,
                        std::function<void(v1::RequestDone&)> done) -> Step {
    return [token, done](v1::WorkerMessage& batch, std::vector<v1::WorkerMessage>& dones) {
      auto* events = batch.mutable_tokens()->mutable_events();
      for (int i = events->size() - 1; i >= 0; --i)
        if (events->Get(i).request_id() != "victim") events->DeleteSubrange(i, 1);
      for (auto& e : *events) token(e);
      std::erase_if(dones, [](const v1::WorkerMessage& d) { return d.done().request_id() != "victim"; });
      for (auto& d : dones) done(*d.mutable_done());
    };
  };
  auto keep_token = [](v1::TokenEvent&) {};
  auto keep_done = [](v1::RequestDone&) {};
  struct Case {
    std::string violation;  // in both messages
    Step step;
    int64_t tokens_before = 0;  // the victim's tokens the client saw
  };
  std::vector<Case> cases = {
      {"token id -5 for request 'victim' is outside its vocabulary [0, 1000)",
       only_victim([](v1::TokenEvent& e) { e.set_token_id(-5); }, keep_done)},
      {"token id 1152921504606846976 for request 'victim' is outside",
       only_victim([](v1::TokenEvent& e) { e.set_token_id(int64_t{1} << 60); }, keep_done)},
      {"token id 1000 for request 'victim' is outside",
       only_victim([](v1::TokenEvent& e) { e.set_token_id(1000); }, keep_done)},
      {"logprob nan for request 'victim' is not a finite log-probability",
       only_victim([](v1::TokenEvent& e) { e.set_logprob(std::nan("")); }, keep_done)},
      {"logprob inf for request 'victim'",
       only_victim([](v1::TokenEvent& e) { e.set_logprob(std::numeric_limits<double>::infinity()); }, keep_done)},
      {"logprob 3 for request 'victim'", only_victim([](v1::TokenEvent& e) { e.set_logprob(3); }, keep_done)},
      {"done.finish_reason 'bogus' for request 'victim' is neither 'length' nor 'stop'",
       only_victim(keep_token, [](v1::RequestDone& d) { d.set_finish_reason("bogus"); }), 4},
      {"done.prefix_hit_tokens 99 for request 'victim'",
       only_victim(keep_token, [](v1::RequestDone& d) { d.set_prefix_hit_tokens(99); }), 4},
      {"done.error_code 99 for request 'victim' is not a gRPC status code",
       only_victim(keep_token, [](v1::RequestDone& d) { d.set_error_code(99); }), 4},
  };
  // 12 tokens for max_tokens 4: the fifth is refused, the four before it were fine.
  Step flood = [](v1::WorkerMessage& batch, std::vector<v1::WorkerMessage>& dones) {
    auto* events = batch.mutable_tokens()->mutable_events();
    for (int i = events->size() - 1; i >= 0; --i)
      if (events->Get(i).request_id() != "victim") events->DeleteSubrange(i, 1);
    if (!events->empty()) {
      const v1::TokenEvent first = events->Get(0);
      for (int i = 1; i < 12; ++i) *events->Add() = first;
    }
    dones.clear();
  };
  cases.push_back({"request 'victim' got more than its max_tokens = 4 tokens", flood, 4});
  // The victim asks for 2 most likely tokens per step (the fake group lists
  // none, which is allowed): more, or entries that cannot be right, are not.
  auto with_top = [&](std::vector<std::pair<int64_t, double>> top) {
    return only_victim(
        [top](v1::TokenEvent& e) {
          for (const auto& [id, lp] : top) {
            v1::TokenLogprob* t = e.add_top_logprobs();
            t->set_token_id(id);
            t->set_logprob(lp);
          }
        },
        keep_done);
  };
  cases.push_back(
      {"request 'victim': 3 top_logprobs, more than the 2 asked for", with_top({{1, -1}, {2, -2}, {3, -3}})});
  cases.push_back({"request 'victim': top_logprobs[1] token id 1000 is outside its vocabulary [0, 1000)",
                   with_top({{1, -1}, {1000, -2}})});
  cases.push_back({"request 'victim': top_logprobs[0] token id -1 is outside", with_top({{-1, -1}})});
  cases.push_back(
      {"request 'victim': top_logprobs[0] logprob nan is not a finite log-probability", with_top({{1, std::nan("")}})});
  cases.push_back({"request 'victim': top_logprobs[1] logprob 0.5 is not a finite", with_top({{1, -1}, {2, 0.5}})});
  cases.push_back({"request 'victim': top_logprobs[1] logprob -1 is above the one before it (-2): not best first",
                   with_top({{1, -2}, {2, -1}})});
  // The victim's prompt {3, 4, 5} with prompt_logprobs = 1: tokens 1 and 2
  // may have theirs, consecutively, naming the prompt's ids.
  struct PromptEntry {
    int64_t id;
    double logprob;
    std::vector<std::pair<int64_t, double>> top;
  };
  auto with_prompt = [&](int64_t start, std::vector<PromptEntry> entries) -> Step {
    return [start, entries](v1::WorkerMessage& batch, std::vector<v1::WorkerMessage>& dones) {
      v1::PromptLogprobsEvent* e = batch.mutable_tokens()->add_prompt_logprobs();
      e->set_request_id("victim");
      e->mutable_logprobs()->set_start(start);
      for (const PromptEntry& p : entries) {
        v1::PromptTokenLogprob* x = e->mutable_logprobs()->add_entries();
        x->set_token_id(p.id);
        x->set_logprob(p.logprob);
        for (const auto& [id, lp] : p.top) {
          v1::TokenLogprob* t = x->add_top_logprobs();
          t->set_token_id(id);
          t->set_logprob(lp);
        }
      }
      auto* events = batch.mutable_tokens()->mutable_events();
      for (int i = events->size() - 1; i >= 0; --i)
        if (events->Get(i).request_id() != "victim") events->DeleteSubrange(i, 1);
      std::erase_if(dones, [](const v1::WorkerMessage& d) { return d.done().request_id() != "victim"; });
    };
  };
  cases.push_back({"request 'victim': prompt_logprobs.start 2 where 1 was next", with_prompt(2, {{5, -1, {}}})});
  cases.push_back({"request 'victim': prompt_logprobs for tokens 1 .. 3 of a prompt of 3",
                   with_prompt(1, {{4, -1, {}}, {5, -1, {}}, {6, -1, {}}})});
  cases.push_back({"request 'victim': prompt_logprobs for token 2 name id 9, the prompt has 5",
                   with_prompt(1, {{4, -1, {}}, {9, -1, {}}})});
  cases.push_back(
      {"request 'victim': prompt_logprobs for token 1: logprob 0.5 is not a finite", with_prompt(1, {{4, 0.5, {}}})});
  cases.push_back({"request 'victim': prompt_logprobs for token 1: 2 top_logprobs, more than the 1 asked for",
                   with_prompt(1, {{4, -1, {{4, -1}, {7, -2}}}})});

  for (const Case& c : cases) {
    SCOPED_TRACE(c.violation);
    workers_.clear();
    StartCoordinator({.policy = RoutingPolicy::kRoundRobin});
    FakeWorker& bad = AddWorker({.worker_id = "bad", .token_delay = 20ms, .edit_step = c.step});
    AsyncGenerate other(*stub_, MakeRequest({1, 2}, 4, 0, "other"), 10s);
    ASSERT_TRUE(bad.WaitRoutes(1));
    v1::GenerateRequest victim_request = MakeRequest({3, 4, 5}, 4, 0, "victim");
    victim_request.mutable_sampling()->set_logprobs(2);
    victim_request.mutable_sampling()->set_prompt_logprobs(1);
    const GenResult victim = Generate(*stub_, victim_request);
    EXPECT_EQ(victim.status.error_code(), grpc::StatusCode::INTERNAL) << victim.status.error_message();
    EXPECT_NE(victim.status.error_message().find("DP group 0 of worker 'bad' it violated the worker protocol"),
              std::string::npos)
        << victim.status.error_message();
    EXPECT_NE(victim.status.error_message().find(c.violation), std::string::npos) << victim.status.error_message();
    EXPECT_EQ(static_cast<int64_t>(victim.tokens.size()), c.tokens_before);
    EXPECT_FALSE(victim.finished.has_value());
    for (const v1::Token& t : victim.tokens) {
      EXPECT_GE(t.token_id(), 0);
      EXPECT_LT(t.token_id(), 1000);
      EXPECT_TRUE(std::isfinite(t.logprob()));
    }
    const grpc::Status end = bad.WaitEnded();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << end.error_message();
    EXPECT_NE(end.error_message().find(c.violation), std::string::npos) << end.error_message();
    EXPECT_TRUE(WaitStats([](const auto& st) { return st.groups_size() == 1 && !st.groups(0).connected(); }));
    EXPECT_NE(Stats().groups(0).disconnect_reason().find(c.violation), std::string::npos);
    // The request it held without a token goes to the real group.
    FakeWorker& good = AddWorker({.worker_id = "good"});
    ExpectServed(other.Get(), {1, 2}, 0, 4);
    EXPECT_EQ(good.routes(), std::vector<std::string>{"other"});
  }
}

// A group's prompt logprobs reach the client as sent, once, before the first
// token: the fake group sends the same ones with every step's batch (as a
// re-routed request's new group would send what the client already has).
TEST_F(CoordinatorTest, PromptLogprobsReachTheClientOnceBeforeTheFirstToken) {
  StartCoordinator();
  AddWorker({.worker_id = "job", .edit_step = [](v1::WorkerMessage& batch, std::vector<v1::WorkerMessage>&) {
               v1::PromptLogprobsEvent* e = batch.mutable_tokens()->add_prompt_logprobs();
               e->set_request_id("p");
               e->mutable_logprobs()->set_start(1);
               v1::PromptTokenLogprob* a = e->mutable_logprobs()->add_entries();
               a->set_token_id(4);
               a->set_logprob(-0.5);
               v1::TokenLogprob* t = a->add_top_logprobs();
               t->set_token_id(4);
               t->set_logprob(-0.5);
               v1::PromptTokenLogprob* b = e->mutable_logprobs()->add_entries();
               b->set_token_id(5);
               b->set_logprob(-1.5);
             }});
  v1::GenerateRequest req = MakeRequest({3, 4, 5}, 4, 0, "p");
  req.mutable_sampling()->set_prompt_logprobs(1);
  const GenResult r = Generate(*stub_, req);
  ExpectServed(r, {3, 4, 5}, 0, 4);
  ASSERT_EQ(r.prompt_logprobs.size(), 1u);
  EXPECT_EQ(r.prompt_after_token, 0);
  const v1::PromptLogprobs& lp = r.prompt_logprobs[0];
  EXPECT_EQ(lp.start(), 1);
  ASSERT_EQ(lp.entries_size(), 2);
  EXPECT_EQ(lp.entries(0).token_id(), 4);
  EXPECT_EQ(lp.entries(0).logprob(), -0.5);
  ASSERT_EQ(lp.entries(0).top_logprobs_size(), 1);
  EXPECT_EQ(lp.entries(0).top_logprobs(0).token_id(), 4);
  EXPECT_EQ(lp.entries(1).token_id(), 5);
  EXPECT_EQ(lp.entries(1).logprob(), -1.5);
  // A request that did not ask for them: the group violated the protocol.
  const GenResult q = Generate(*stub_, MakeRequest({3, 4, 5}, 4, 0, "p"));
  EXPECT_EQ(q.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_NE(q.status.error_message().find("request 'p': prompt_logprobs, which it did not ask for"), std::string::npos)
      << q.status.error_message();
}

TEST_F(CoordinatorTest, StatsOutOfRangeDisconnectTheGroup) {
  StartCoordinator();
  FakeWorker& w = AddWorker({.worker_id = "job"});
  w.SendStats(-1);
  const grpc::Status end = w.WaitEnded();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << end.error_message();
  EXPECT_NE(end.error_message().find("stats.free_blocks"), std::string::npos) << end.error_message();
  EXPECT_EQ(Health().groups_connected(), 0);
}

TEST(CoordinatorStart, RejectsBadOptions) {
  auto bad = Coordinator::Start({.listen = "no-port"});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Coordinator::Start({.listen = "127.0.0.1:99999"}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Coordinator::Start({.listen = "127.0.0.1:0", .max_in_flight_per_group = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Coordinator::Start({.listen = "127.0.0.1:0", .queue_timeout_s = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Coordinator::Start({.listen = "127.0.0.1:0", .stall_timeout_s = -1}).status().code(),
            StatusCode::kInvalidArgument);
  auto first = Coordinator::Start({.listen = "127.0.0.1:0"});
  ASSERT_TRUE(first.ok());
  auto second = Coordinator::Start({.listen = (*first)->address()});
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status();
}

TEST(RoutingPolicyNames, RoundTrip) {
  for (RoutingPolicy p : {RoutingPolicy::kRoundRobin, RoutingPolicy::kLeastLoaded, RoutingPolicy::kPrefixAffinity}) {
    auto parsed = ParseRoutingPolicy(RoutingPolicyName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_EQ(ParseRoutingPolicy("random").status().code(), StatusCode::kInvalidArgument);
}

// ---- Router, without gRPC ---------------------------------------------------------

// The chain the router matches prompts by (the one workers' caches publish).
TEST(PrefixBlockHashes, IsAChainOverFullBlocks) {
  const std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const auto chain = PrefixBlockHashes(t, 4);
  ASSERT_EQ(chain.size(), 2u);  // the partial block has no hash
  const auto prefix = PrefixBlockHashes(std::span(t).first(8), 4);
  EXPECT_EQ(prefix, chain);
  std::vector<int32_t> u = t;
  u[0] = 99;  // a different first block changes every later hash
  const auto other = PrefixBlockHashes(u, 4);
  EXPECT_NE(other[0], chain[0]);
  EXPECT_NE(other[1], chain[1]);
  u = t;
  u[5] = 99;  // only the second block differs
  EXPECT_EQ(PrefixBlockHashes(u, 4)[0], chain[0]);
  EXPECT_TRUE(PrefixBlockHashes(t, 0).empty());
}

TEST(PrefixIndex, MatchesLeadingRunAndStaysBounded) {
  coord::PrefixIndex index(16);
  const std::vector<uint64_t> chain = {10, 11, 12, 13};
  index.Insert(chain);
  EXPECT_EQ(index.LeadingMatch(chain), 4);
  EXPECT_EQ(index.LeadingMatch(std::vector<uint64_t>{10, 11, 99, 13}), 2);
  EXPECT_EQ(index.LeadingMatch(std::vector<uint64_t>{99, 10}), 0);
  for (uint64_t i = 0; i < 100; ++i) {
    index.Insert(std::vector<uint64_t>{1000 + 4 * i, 1001 + 4 * i, 1002 + 4 * i, 1003 + 4 * i});
    EXPECT_LE(index.size(), 16 + 16 / 8);
  }
  EXPECT_EQ(index.LeadingMatch(chain), 0) << "least recently routed forgotten";
  EXPECT_EQ(index.LeadingMatch(std::vector<uint64_t>{1396, 1397, 1398, 1399}), 4) << "most recent kept";
}

TEST(Router, Policies) {
  using coord::Candidate;
  coord::Router rr(RoutingPolicy::kRoundRobin, 0, 0);
  std::vector<Candidate> c = {{.index = 0}, {.index = 2}, {.index = 5}};
  std::vector<int> picks;
  for (int i = 0; i < 6; ++i) picks.push_back(c[rr.Pick(c)].index);
  EXPECT_EQ(picks, (std::vector<int>{0, 2, 5, 0, 2, 5}));

  coord::Router ll(RoutingPolicy::kLeastLoaded, 0, 0);
  EXPECT_EQ(ll.Pick(std::vector<Candidate>{{.index = 0, .queued_tokens = 5}, {.index = 1, .queued_tokens = 3}}), 1u);
  EXPECT_EQ(ll.Pick(std::vector<Candidate>{{.index = 0, .queued_tokens = 3, .free_blocks = 1},
                                           {.index = 1, .queued_tokens = 3, .free_blocks = 9}}),
            1u);
  EXPECT_EQ(ll.Pick(std::vector<Candidate>{{.index = 0, .queued_tokens = 3}, {.index = 1, .queued_tokens = 3}}), 0u);

  coord::Router pa(RoutingPolicy::kPrefixAffinity, 2048, 1.5);
  auto pick = [&](int64_t q_hit, int64_t q_other) {
    return pa.Pick(std::vector<Candidate>{{.index = 0, .queued_tokens = q_hit, .prefix_blocks = 3},
                                          {.index = 1, .queued_tokens = q_other, .prefix_blocks = 1}});
  };
  EXPECT_EQ(pick(3000, 2500), 0u) << "500 ahead: within the absolute threshold";
  EXPECT_EQ(pick(3000, 500), 1u) << "2500 ahead and 6x: too loaded";
  EXPECT_EQ(pick(10000, 7500), 0u) << "2500 ahead but only 1.33x";
  EXPECT_EQ(pick(20000, 7500), 1u);
  // No prefix anywhere: least loaded.
  EXPECT_EQ(pa.Pick(std::vector<Candidate>{{.index = 0, .queued_tokens = 9}, {.index = 1, .queued_tokens = 1}}), 1u);
}

}  // namespace
}  // namespace mlarun
