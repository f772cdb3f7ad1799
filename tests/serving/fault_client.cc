// A client for the live fault tests (coordinator_faults.sh), for what
// `mlarun submit` does not do: calls without a gRPC deadline, timing how soon
// the DP groups register again or drop out, and hundreds of concurrent
// streams each checked on its own.
//
//   fault_client generate ADDR N MAX_TOKENS WATCHDOG_S
//     N concurrent Generate calls without a deadline (prompt {i+5, 6, 7},
//     ignore_eos). Prints, as each ends, one JSON line: {"i", "code",
//     "message", "tokens", "end_s", "end_at"} (end_s: seconds since the calls
//     started; end_at: Unix time, s).
//     A call still open after WATCHDOG_S is cancelled here and reported with
//     "watchdog": true, so the process always ends.
//   fault_client rejoin ADDR GROUPS TIMEOUT_S
//     Polls Health every 10 ms. Prints {"answered_s", "rejoined_s"}: when the
//     coordinator first answered and when GROUPS groups were connected,
//     seconds after start; exits 1 if that did not happen within TIMEOUT_S.
//   fault_client watch ADDR SECONDS STOP_FILE
//     Polls Health every 20 ms (each call with a 500 ms deadline) until
//     STOP_FILE exists or SECONDS have passed. Prints one JSON line per
//     change of groups_connected, {"at", "groups_connected"} (at: Unix time,
//     s), then {"samples", "failed", "max_gap_s", "end"}: the Health calls
//     answered and not, and the longest time between two answers.
//   fault_client load ADDR N MAX_TOKENS PROMPTS_FILE WATCHDOG_S
//     N Generate calls opened at once (no deadline, ignore_eos, greedy), on
//     16 channels; call i has request_id "load-<i>" and the prompt on line
//     i % P of PROMPTS_FILE (P lines of space-separated token ids). Prints,
//     as each ends, {"i", "prompt", "code", "message", "tokens", "finish_reason",
//     "dp_group", "start_s", "end_s", "watchdog", "errors"}: tokens as a list;
//     errors lists what the stream got wrong (a response carrying another
//     request_id, a token index out of sequence, so a token repeated or
//     missing, anything after Finished, a second Finished, OK without
//     Finished, completion_tokens not the number streamed). Calls still open
//     after WATCHDOG_S are cancelled and reported with "watchdog": true.
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <latch>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mlarun.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double UnixNow() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

std::string Json(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

int Generate(const std::string& addr, int n, int64_t max_tokens, double watchdog_s) {
  auto stub = mlarun::v1::Mlarun::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  const Clock::time_point start = Clock::now();
  std::mutex out_mu;
  std::vector<std::thread> calls;
  for (int i = 0; i < n; ++i) {
    calls.emplace_back([&, i] {
      mlarun::v1::GenerateRequest req;
      for (int t : {i + 5, 6, 7}) req.add_prompt_ids(t);
      req.mutable_sampling()->set_max_tokens(max_tokens);
      req.mutable_sampling()->set_ignore_eos(true);
      grpc::ClientContext ctx;  // no deadline on purpose
      std::mutex mu;
      std::condition_variable cv;
      bool done = false, fired = false;
      std::thread dog([&] {
        std::unique_lock lock(mu);
        if (!cv.wait_for(lock, std::chrono::duration<double>(watchdog_s), [&] { return done; })) {
          fired = true;
          ctx.TryCancel();
        }
      });
      auto reader = stub->Generate(&ctx, req);
      mlarun::v1::GenerateResponse resp;
      int64_t tokens = 0;
      while (reader->Read(&resp)) tokens += resp.has_token();
      const grpc::Status st = reader->Finish();
      const double end_s = Since(start);
      {
        std::lock_guard lock(mu);
        done = true;
      }
      cv.notify_all();
      dog.join();
      std::lock_guard lock(out_mu);
      std::printf(
          "{\"i\": %d, \"code\": %d, \"message\": %s, \"tokens\": %lld, \"end_s\": %.3f, \"end_at\": %.3f, "
          "\"watchdog\": %s}\n",
          i, static_cast<int>(st.error_code()), Json(st.error_message()).c_str(), static_cast<long long>(tokens), end_s,
          UnixNow(), fired ? "true" : "false");
      std::fflush(stdout);
    });
  }
  for (auto& t : calls) t.join();
  return 0;
}

int Rejoin(const std::string& addr, int groups, double timeout_s) {
  const Clock::time_point start = Clock::now();
  double answered_s = -1;
  while (Since(start) < timeout_s) {
    // A fresh channel each time: no reconnect back-off of our own.
    auto stub = mlarun::v1::Mlarun::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    mlarun::v1::HealthResponse resp;
    if (stub->Health(&ctx, mlarun::v1::HealthRequest(), &resp).ok()) {
      if (answered_s < 0) answered_s = Since(start);
      if (resp.groups_connected() >= groups) {
        std::printf("{\"answered_s\": %.3f, \"rejoined_s\": %.3f}\n", answered_s, Since(start));
        return 0;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::printf("{\"answered_s\": %.3f, \"rejoined_s\": null}\n", answered_s);
  return 1;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

int Watch(const std::string& addr, double seconds, const std::string& stop_file) {
  auto stub = mlarun::v1::Mlarun::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  const Clock::time_point start = Clock::now();
  int last = -1;
  long samples = 0, failed = 0;
  double max_gap_s = 0;
  Clock::time_point last_answer = start;
  while (Since(start) < seconds && !Exists(stop_file)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    mlarun::v1::HealthResponse resp;
    if (stub->Health(&ctx, mlarun::v1::HealthRequest(), &resp).ok()) {
      const Clock::time_point now = Clock::now();
      max_gap_s = std::max(max_gap_s, std::chrono::duration<double>(now - last_answer).count());
      last_answer = now;
      ++samples;
      if (resp.groups_connected() != last) {
        last = resp.groups_connected();
        std::printf("{\"at\": %.3f, \"groups_connected\": %d}\n", UnixNow(), last);
        std::fflush(stdout);
      }
    } else {
      ++failed;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  max_gap_s = std::max(max_gap_s, Since(last_answer));
  std::printf("{\"samples\": %ld, \"failed\": %ld, \"max_gap_s\": %.3f, \"end\": %.3f}\n", samples, failed, max_gap_s,
              UnixNow());
  return 0;
}

int Load(const std::string& addr, int n, int64_t max_tokens, const std::string& prompts_file, double watchdog_s) {
  std::vector<std::vector<int32_t>> prompts;
  {
    std::ifstream in(prompts_file);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ids(line);
      std::vector<int32_t> p;
      for (int32_t t; ids >> t;) p.push_back(t);
      if (!p.empty()) prompts.push_back(std::move(p));
    }
  }
  if (prompts.empty()) {
    std::fprintf(stderr, "fault_client load: no prompt in %s\n", prompts_file.c_str());
    return 2;
  }
  // Several connections, as several clients would open.
  constexpr int kChannels = 16;
  std::vector<std::unique_ptr<mlarun::v1::Mlarun::Stub>> stubs;
  for (int c = 0; c < kChannels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("mlarun.fault_client.channel", c);
    auto channel = grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
    // Connected before the calls start, so they are all in flight at once,
    // and so spurious failures of gRPC 1.51's connection attempts (it can
    // read a stale errno after connect(); see AwaitConnection in
    // serving/client/grpc_util.h) are retried instead of failing the
    // channel's calls: what is tested is the coordinator under load, not the
    // client library's connect.
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30))) {
      std::fprintf(stderr, "fault_client load: channel %d did not connect to %s within 30 s\n", c, addr.c_str());
      return 1;
    }
    stubs.push_back(mlarun::v1::Mlarun::NewStub(channel));
  }
  std::vector<grpc::ClientContext> contexts(static_cast<size_t>(n));  // no deadline on purpose
  std::vector<char> ended(static_cast<size_t>(n), 0);
  std::mutex mu;  // guards ended, fired, and stdout
  std::condition_variable cv;
  int open = n;
  bool fired = false;
  std::latch go(n + 1);
  Clock::time_point start;
  std::vector<std::thread> calls;
  for (int i = 0; i < n; ++i) {
    calls.emplace_back([&, i] {
      const size_t p = static_cast<size_t>(i) % prompts.size();
      const std::string id = "load-" + std::to_string(i);
      mlarun::v1::GenerateRequest req;
      req.set_request_id(id);
      for (int32_t t : prompts[p]) req.add_prompt_ids(t);
      req.mutable_sampling()->set_max_tokens(max_tokens);
      req.mutable_sampling()->set_ignore_eos(true);
      grpc::ClientContext& ctx = contexts[static_cast<size_t>(i)];
      go.arrive_and_wait();
      const double start_s = Since(start);
      auto reader = stubs[static_cast<size_t>(i) % stubs.size()]->Generate(&ctx, req);
      mlarun::v1::GenerateResponse resp;
      std::vector<int64_t> tokens;
      std::vector<std::string> errors;
      int finished = 0;
      std::string finish_reason;
      int dp_group = -1;
      while (reader->Read(&resp)) {
        if (resp.request_id() != id) errors.push_back("a response for '" + resp.request_id() + "'");
        if (finished > 0) errors.push_back("a response after Finished");
        if (resp.has_token()) {
          if (resp.token().index() != static_cast<int64_t>(tokens.size()))
            errors.push_back("token index " + std::to_string(resp.token().index()) + " at position " +
                             std::to_string(tokens.size()));
          tokens.push_back(resp.token().token_id());
        } else if (resp.has_finished()) {
          ++finished;
          finish_reason = resp.finished().finish_reason();
          dp_group = resp.finished().dp_group();
          if (resp.finished().completion_tokens() != static_cast<int64_t>(tokens.size()))
            errors.push_back("completion_tokens " + std::to_string(resp.finished().completion_tokens()) + " after " +
                             std::to_string(tokens.size()) + " tokens");
        } else {
          errors.push_back("a response with neither token nor finished");
        }
      }
      const grpc::Status st = reader->Finish();
      const double end_s = Since(start);
      if (finished > 1) errors.push_back(std::to_string(finished) + " Finished messages");
      if (st.ok() && finished == 0) errors.push_back("OK without Finished");
      std::string toks = "[", errs = "[";
      for (size_t k = 0; k < tokens.size(); ++k) toks += (k ? ", " : "") + std::to_string(tokens[k]);
      for (size_t k = 0; k < errors.size(); ++k) errs += (k ? ", " : "") + Json(errors[k]);
      std::lock_guard lock(mu);
      ended[static_cast<size_t>(i)] = 1;
      std::printf(
          "{\"i\": %d, \"prompt\": %zu, \"code\": %d, \"message\": %s, \"tokens\": %s], \"finish_reason\": %s, "
          "\"dp_group\": %d, \"start_s\": %.3f, \"end_s\": %.3f, \"watchdog\": %s, \"errors\": %s]}\n",
          i, p, static_cast<int>(st.error_code()), Json(st.error_message()).c_str(), toks.c_str(),
          Json(finish_reason).c_str(), dp_group, start_s, end_s, fired ? "true" : "false", errs.c_str());
      std::fflush(stdout);
      if (--open == 0) cv.notify_all();
    });
  }
  start = Clock::now();
  go.arrive_and_wait();
  {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, std::chrono::duration<double>(watchdog_s), [&] { return open == 0; })) {
      fired = true;
      for (int i = 0; i < n; ++i)
        if (!ended[static_cast<size_t>(i)]) contexts[static_cast<size_t>(i)].TryCancel();
    }
  }
  for (auto& t : calls) t.join();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "generate" && argc == 6)
    return Generate(argv[2], std::atoi(argv[3]), std::atoll(argv[4]), std::atof(argv[5]));
  if (mode == "rejoin" && argc == 5) return Rejoin(argv[2], std::atoi(argv[3]), std::atof(argv[4]));
  if (mode == "watch" && argc == 5) return Watch(argv[2], std::atof(argv[3]), argv[4]);
  if (mode == "load" && argc == 7)
    return Load(argv[2], std::atoi(argv[3]), std::atoll(argv[4]), argv[5], std::atof(argv[6]));
  std::fprintf(
      stderr,
      "usage: fault_client generate ADDR N MAX_TOKENS WATCHDOG_S | fault_client rejoin ADDR GROUPS TIMEOUT_S |\n"
      "       fault_client watch ADDR SECONDS STOP_FILE | fault_client load ADDR N MAX_TOKENS PROMPTS_FILE "
      "WATCHDOG_S\n");
  return 2;
}
