#include "serving/coordinator/server_log.h"

#include <chrono>
#include <cstdio>

#include "base/status.h"

namespace mlarun::coord {
namespace {

std::string Fixed(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

double Percent(int64_t part, int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

}  // namespace

std::string FormatRequestLine(const RequestEnd& end) {
  std::string line = "request " + std::string(end.request_id.empty() ? "-" : end.request_id);
  line += end.status_code == 0 ? " finished:" : " ended:";
  line += " prompt_tokens=" + std::to_string(end.prompt_tokens);
  line += " output_tokens=" + std::to_string(end.completion_tokens);
  line += " ttft=" + (end.first_token_s >= 0 ? Fixed(end.first_token_s, 3) + "s" : std::string("-"));
  line += " duration=" + Fixed(end.total_s, 3) + "s";
  if (end.status_code == 0) {
    line += " finish_reason=" + std::string(end.finish_reason);
    if (end.prompt_tokens > 0) line += " cached_tokens=" + std::to_string(end.prefix_hit_tokens);
  } else {
    line += " status=" + std::string(StatusCodeName(static_cast<StatusCode>(end.status_code)));
  }
  return line;
}

std::string FormatStatsLine(const ServerSample& prev, const ServerSample& now, const ServerSample& last_said) {
  const int64_t prompt = now.prompt_tokens - prev.prompt_tokens;
  const int64_t generated = now.generation_tokens - prev.generation_tokens;
  const bool same_state = now.running == last_said.running && now.waiting == last_said.waiting &&
                          now.cache_blocks_used == last_said.cache_blocks_used;
  if (prompt == 0 && generated == 0 && now.running == 0 && now.waiting == 0 && same_state) return "";
  const double seconds = now.at_s - prev.at_s;
  auto rate = [&](int64_t n) { return seconds > 0 ? static_cast<double>(n) / seconds : 0.0; };
  return "stats: prompt throughput " + Fixed(rate(prompt), 1) + " tokens/s, generation throughput " +
         Fixed(rate(generated), 1) + " tokens/s, running " + std::to_string(now.running) + ", waiting " +
         std::to_string(now.waiting) + ", cache use " +
         Fixed(Percent(now.cache_blocks_used, now.cache_blocks_total), 1) + "%, prefix-cache hit rate " +
         Fixed(Percent(now.prefix_hits - prev.prefix_hits, now.prefix_queries - prev.prefix_queries), 1) + "%";
}

ServerLog::ServerLog(std::shared_ptr<DispatcherObserver> next, Options options)
    : next_(std::move(next)), options_(std::move(options)) {}

ServerLog::~ServerLog() { Stop(); }

void ServerLog::Start(std::function<ServerSample()> sample) {
  sample_ = std::move(sample);
  thread_ = std::thread([this] { Loop(); });
}

void ServerLog::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ServerLog::OnRouted(std::string_view worker_id, int32_t dp_group) {
  if (next_ != nullptr) next_->OnRouted(worker_id, dp_group);
}

void ServerLog::OnToken(bool first, double since_s) {
  if (next_ != nullptr) next_->OnToken(first, since_s);
}

void ServerLog::OnEnd(const RequestEnd& end) {
  if (next_ != nullptr) next_->OnEnd(end);
  if (!options_.log_requests) return;
  std::string line = FormatRequestLine(end);
  {
    std::lock_guard lock(mu_);
    if (lines_.size() >= kMaxQueued) {
      ++dropped_;
      return;
    }
    lines_.push_back(std::move(line));
  }
  cv_.notify_one();
}

void ServerLog::Loop() {
  using Clock = std::chrono::steady_clock;
  const bool stats = options_.stats_interval_s > 0 && sample_ != nullptr;
  const auto interval = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(stats ? options_.stats_interval_s : 3600.0));
  ServerSample prev = stats ? sample_() : ServerSample{}, last_said = prev;
  auto next_tick = Clock::now() + interval;
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait_until(lock, next_tick, [this] { return stop_ || !lines_.empty(); });
    std::deque<std::string> lines;
    lines.swap(lines_);
    const int64_t dropped = std::exchange(dropped_, 0);
    const bool stopping = stop_;
    lock.unlock();
    for (const std::string& l : lines) options_.write(l);
    if (dropped > 0) options_.write(std::to_string(dropped) + " request line(s) dropped: the log could not keep up");
    if (stats && Clock::now() >= next_tick && !stopping) {
      const ServerSample now = sample_();
      if (std::string line = FormatStatsLine(prev, now, last_said); !line.empty()) {
        options_.write(line);
        last_said = now;
      }
      prev = now;
      next_tick += interval;
      if (next_tick < Clock::now()) next_tick = Clock::now() + interval;
    }
    lock.lock();
    if (stopping && lines_.empty()) return;
  }
}

}  // namespace mlarun::coord
