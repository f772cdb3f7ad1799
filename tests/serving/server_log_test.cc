// The coordinator's traffic log (serving/coordinator/server_log.h): the
// request line and the stats line against figures worked out here, the
// stats line's silence when nothing happened, and the writer thread: every
// observer call passed on, lines in order, none when turned off.
#include "serving/coordinator/server_log.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "serving/http/metrics.h"

namespace mlarun::coord {
namespace {

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

TEST(ServerLog, RequestLineHasTheCountsAndTimesButNoText) {
  std::mt19937 rng(11);
  for (int i = 0; i < 50; ++i) {
    const int64_t prompt = std::uniform_int_distribution<int64_t>(1, 100000)(rng);
    const int64_t out = std::uniform_int_distribution<int64_t>(0, 5000)(rng);
    const int64_t hit = std::uniform_int_distribution<int64_t>(0, prompt)(rng);
    const double ttft = std::uniform_real_distribution<double>(0, 3)(rng);
    const double total = ttft + std::uniform_real_distribution<double>(0, 60)(rng);
    const std::string id = "cmpl-" + std::to_string(rng());
    const RequestEnd end{.request_id = id,
                         .finish_reason = i % 2 ? "stop" : "length",
                         .prompt_tokens = prompt,
                         .completion_tokens = out,
                         .prefix_hit_tokens = hit,
                         .queued_s = 0.001,
                         .first_token_s = ttft,
                         .total_s = total};
    EXPECT_EQ(FormatRequestLine(end), "request " + id + " finished: prompt_tokens=" + std::to_string(prompt) +
                                          " output_tokens=" + std::to_string(out) + " ttft=" + Fixed(ttft, 3) +
                                          "s duration=" + Fixed(total, 3) + "s finish_reason=" +
                                          (i % 2 ? "stop" : "length") + " cached_tokens=" + std::to_string(hit));
  }
  // Ended without finishing: its status, no first token.
  EXPECT_EQ(FormatRequestLine(RequestEnd{.request_id = "r1", .status_code = 14, .prompt_tokens = 7, .total_s = 2.5}),
            "request r1 ended: prompt_tokens=7 output_tokens=0 ttft=- duration=2.500s status=UNAVAILABLE");
}

TEST(ServerLog, StatsLineHasTheIntervalsRatesAndTheState) {
  std::mt19937 rng(5);
  for (int i = 0; i < 50; ++i) {
    auto n = [&](int64_t hi) { return std::uniform_int_distribution<int64_t>(1, hi)(rng); };
    const ServerSample prev{.at_s = 100.0 + n(1000),
                            .prompt_tokens = n(1 << 20),
                            .generation_tokens = n(1 << 20),
                            .prefix_queries = n(1 << 20),
                            .prefix_hits = n(1 << 10)};
    const double dt = 0.5 + static_cast<double>(n(200)) / 10;
    const int64_t dp = n(100000), dg = n(100000), dq = n(50000),
                  dh = std::uniform_int_distribution<int64_t>(0, dq)(rng);
    const ServerSample now{.at_s = prev.at_s + dt,
                           .prompt_tokens = prev.prompt_tokens + dp,
                           .generation_tokens = prev.generation_tokens + dg,
                           .prefix_queries = prev.prefix_queries + dq,
                           .prefix_hits = prev.prefix_hits + dh,
                           .running = n(300),
                           .waiting = n(300) - 1,
                           .cache_blocks_used = n(1000),
                           .cache_blocks_total = 1000 + n(1000)};
    const std::string want =
        "stats: prompt throughput " + Fixed(static_cast<double>(dp) / dt, 1) + " tokens/s, generation throughput " +
        Fixed(static_cast<double>(dg) / dt, 1) + " tokens/s, running " + std::to_string(now.running) + ", waiting " +
        std::to_string(now.waiting) + ", cache use " +
        Fixed(100.0 * static_cast<double>(now.cache_blocks_used) / static_cast<double>(now.cache_blocks_total), 1) +
        "%, prefix-cache hit rate " + Fixed(100.0 * static_cast<double>(dh) / static_cast<double>(dq), 1) + "%";
    EXPECT_EQ(FormatStatsLine(prev, now, prev), want);
  }
}

TEST(ServerLog, StatsLineIsSilentWhenNothingHappened) {
  const ServerSample idle{.at_s = 10, .prompt_tokens = 50, .generation_tokens = 80, .cache_blocks_total = 100};
  ServerSample later = idle;
  later.at_s = 20;
  EXPECT_EQ(FormatStatsLine(idle, later, idle), "");
  // Requests running, with no token in the interval (a long prefill): said.
  ServerSample running = later;
  running.running = 1;
  EXPECT_NE(FormatStatsLine(idle, running, idle), "");
  // The last line showed one running; now none: said once, then silence.
  EXPECT_NE(FormatStatsLine(running, later, running), "");
  EXPECT_EQ(FormatStatsLine(later, later, later), "");
  // Cache blocks held after the requests ended (cached prefixes): said once.
  ServerSample cached = later;
  cached.cache_blocks_used = 3;
  EXPECT_NE(FormatStatsLine(later, cached, later), "");
  EXPECT_EQ(FormatStatsLine(cached, cached, cached), "");
}

// Counts what the log passes on.
struct Counting : DispatcherObserver {
  std::atomic<int> routed{0}, tokens{0}, ends{0};
  void OnRouted(std::string_view, int32_t) override { ++routed; }
  void OnToken(bool, double) override { ++tokens; }
  void OnEnd(const RequestEnd&) override { ++ends; }
};

struct Lines {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> Writer() {
    return [this](const std::string& l) {
      std::lock_guard lock(mu);
      lines.push_back(l);
    };
  }
  std::vector<std::string> Get() {
    std::lock_guard lock(mu);
    return lines;
  }
};

TEST(ServerLog, PassesEveryCallOnAndWritesTheRequestLinesInOrder) {
  for (const bool on : {true, false}) {
    auto next = std::make_shared<Counting>();
    Lines out;
    ServerLog log(next, {.log_requests = on, .stats_interval_s = 0, .write = out.Writer()});
    log.Start(nullptr);
    std::vector<std::string> want;
    for (int i = 0; i < 300; ++i) {
      log.OnRouted("w", 0);
      log.OnToken(true, 0.01);
      const std::string id = "req-" + std::to_string(i);
      const RequestEnd end{.request_id = id, .finish_reason = "length", .prompt_tokens = i, .total_s = 0.5};
      log.OnEnd(end);
      want.push_back(FormatRequestLine(end));
    }
    log.Stop();
    EXPECT_EQ(next->routed, 300);
    EXPECT_EQ(next->tokens, 300);
    EXPECT_EQ(next->ends, 300);
    EXPECT_EQ(out.Get(), on ? want : std::vector<std::string>{});
  }
}

TEST(ServerLog, StatsTicksSayTheIntervalThenFallSilent) {
  Lines out;
  std::atomic<int> calls{0};
  // Busy for the first three ticks (100 generated tokens each), then idle.
  auto sample = [&calls] {
    const int k = calls++;
    const int64_t busy = std::min(k, 3);
    return ServerSample{
        .at_s = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(),
        .generation_tokens = 100 * busy,
        .running = k <= 3 ? 1 : 0,
        .cache_blocks_total = 10};
  };
  ServerLog log(nullptr, {.log_requests = true, .stats_interval_s = 0.05, .write = out.Writer()});
  log.Start(sample);
  for (int i = 0; i < 1000 && calls < 12; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  log.Stop();
  ASSERT_GE(calls.load(), 8);
  const std::vector<std::string> lines = out.Get();
  // Ticks 1-3 busy, tick 4 the change to idle, then nothing.
  ASSERT_EQ(lines.size(), 4u) << (lines.empty() ? "" : lines.back());
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(lines[i].find("running 1,"), std::string::npos) << lines[i];
  EXPECT_NE(lines[3].find("generation throughput 0.0 tokens/s, running 0,"), std::string::npos) << lines[3];
}

// The counters the stats line reads, against sums kept here: prompt tokens
// of routed requests, every token sent, the prefix figures of finished ones.
TEST(ServerLog, MetricsTotalsAreTheCountersSums) {
  Metrics m("round_robin");
  std::mt19937 rng(9);
  Metrics::Totals want;
  for (int i = 0; i < 200; ++i) {
    const int64_t prompt = std::uniform_int_distribution<int64_t>(1, 3000)(rng);
    const int64_t tokens = std::uniform_int_distribution<int64_t>(0, 40)(rng);
    const int kind = i % 3;  // 0 finished, 1 failed after routing, 2 rejected unrouted
    for (int64_t t = 0; t < (kind == 2 ? 0 : tokens); ++t) m.OnToken(t == 0, 0.01);
    const int64_t hit = std::uniform_int_distribution<int64_t>(0, prompt)(rng);
    m.OnEnd(RequestEnd{.status_code = kind == 0   ? 0
                                      : kind == 1 ? 14
                                                  : 8,
                       .finish_reason = kind == 0 ? "length" : "",
                       .prompt_tokens = prompt,
                       .prefix_hit_tokens = kind == 0 ? hit : 0,
                       .queued_s = kind == 2 ? -1.0 : 0.01,
                       .total_s = 1});
    if (kind != 2) want.prompt_tokens += prompt, want.generation_tokens += tokens;
    if (kind == 0) want.prefix_queries += prompt, want.prefix_hits += hit;
  }
  const Metrics::Totals got = m.totals();
  EXPECT_EQ(got.prompt_tokens, want.prompt_tokens);
  EXPECT_EQ(got.generation_tokens, want.generation_tokens);
  EXPECT_EQ(got.prefix_queries, want.prefix_queries);
  EXPECT_EQ(got.prefix_hits, want.prefix_hits);
}

}  // namespace
}  // namespace mlarun::coord
