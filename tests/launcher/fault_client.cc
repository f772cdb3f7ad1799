// A client for the live fault tests (coordinator_faults.sh), for what
// `mlarun submit` does not do: calls without a gRPC deadline, and timing how
// soon the DP groups register again.
//
//   fault_client generate ADDR N MAX_TOKENS WATCHDOG_S
//     N concurrent Generate calls without a deadline (prompt {i+5, 6, 7},
//     ignore_eos). Prints, as each ends, one JSON line: {"i", "code",
//     "message", "tokens", "end_s"} (end_s: seconds since the calls started).
//     A call still open after WATCHDOG_S is cancelled here and reported with
//     "watchdog": true, so the process always ends.
//   fault_client rejoin ADDR GROUPS TIMEOUT_S
//     Polls Health every 10 ms. Prints {"answered_s", "rejoined_s"}: when the
//     coordinator first answered and when GROUPS groups were connected,
//     seconds after start; exits 1 if that did not happen within TIMEOUT_S.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mlarun.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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
      std::printf("{\"i\": %d, \"code\": %d, \"message\": %s, \"tokens\": %lld, \"end_s\": %.3f, \"watchdog\": %s}\n", i,
                  static_cast<int>(st.error_code()), Json(st.error_message()).c_str(), static_cast<long long>(tokens),
                  end_s, fired ? "true" : "false");
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

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "generate" && argc == 6) return Generate(argv[2], std::atoi(argv[3]), std::atoll(argv[4]), std::atof(argv[5]));
  if (mode == "rejoin" && argc == 5) return Rejoin(argv[2], std::atoi(argv[3]), std::atof(argv[4]));
  std::fprintf(stderr,
               "usage: fault_client generate ADDR N MAX_TOKENS WATCHDOG_S | fault_client rejoin ADDR GROUPS TIMEOUT_S\n");
  return 2;
}
