#include "launcher/worker/transfer_agent.h"

#include <algorithm>
#include <chrono>
#include <span>
#include <vector>

namespace mlarun {
namespace {

// The progress thread waits on its worker's event fd for peers' messages,
// at most kIdlePoll at a time (so it sees a stop). Where the transports
// cannot wake it, it polls instead, sleeping kBusyPoll while peers keep its
// worker busy (a TCP fetch waits for each of its gets' answers), doubling
// while nothing happens up to kIdlePoll (a connection's first handshake
// waits at most that long; polling a few thousand times a second would
// take CPU from the rank's own steps).
constexpr auto kBusyPoll = std::chrono::microseconds(50);
constexpr auto kIdlePoll = std::chrono::microseconds(5000);
// An import that takes longer ends (the request is computed instead).
constexpr auto kImportTimeout = std::chrono::seconds(30);

}  // namespace

StatusOr<TransferPath> ParseTransferPath(std::string_view name) {
  if (name == "shm") return TransferPath::kSharedMemory;
  if (name == "any") return TransferPath::kAny;
  return InvalidArgumentError("--transfer: '", name,
                              "' is not a transfer path: off, shm (ranks of one host) or any (any transport)");
}

std::string_view TransferPathName(TransferPath path) { return path == TransferPath::kSharedMemory ? "shm" : "any"; }

TransferAgent::~TransferAgent() {
  stop_ = true;
  if (progress_.joinable()) progress_.join();
}

Status TransferAgent::Start(const LatentPool& pool) {
  MLARUN_ASSIGN_OR_RETURN(auto transfer, BlockTransfer::Create(pool, BlockTransferOptions{.path = path_}));
  {
    MutexLock lock(mu_);
    transfer_ = std::move(transfer);
  }
  pool_ = &pool;
  progress_ = std::thread([this] { ProgressLoop(); });
  return Status::Ok();
}

std::string TransferAgent::Descriptor() const {
  MutexLock lock(mu_);
  if (transfer_ == nullptr) return {};
  const std::vector<std::byte> d = transfer_->Descriptor();
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

void TransferAgent::ProgressLoop() {
  auto period = kBusyPoll;
  while (!stop_.load()) {
    // Woken by a peer's message where the transports can (no lock held
    // while waiting: an import may use the worker meanwhile); else polled.
    BlockTransfer::Wakeup wake;
    {
      MutexLock lock(mu_);
      wake = transfer_->ArmForWakeup();
    }
    if (wake.busy) continue;
    if (wake.fd >= 0) {
      WaitForWakeup(wake.fd, kIdlePoll);
      continue;
    }
    bool busy = false;
    {
      MutexLock lock(mu_);
      busy = transfer_->Progress();
    }
    period = busy ? kBusyPoll : std::min<std::chrono::microseconds>(kIdlePoll, period * 2);
    std::this_thread::sleep_for(period);
  }
}

Status TransferAgent::Import(const StepPlan::Import& import, int rank_in_group, LatentPool& pool) {
  if (&pool != pool_) return FailedPreconditionError("transfer: an import into a pool this rank did not register");
  if (import.descriptors.empty()) return InvalidArgumentError("transfer: an import without descriptors");
  const std::string& descriptor = import.descriptors[static_cast<size_t>(rank_in_group) % import.descriptors.size()];
  MutexLock lock(mu_);
  auto it = peers_.find(descriptor);
  if (it == peers_.end()) {
    const auto* bytes = reinterpret_cast<const std::byte*>(descriptor.data());
    StatusOr<int> peer = transfer_->Connect(std::span<const std::byte>(bytes, descriptor.size()));
    if (!peer.ok()) {
      ++failures_;
      return peer.status().WithContext("transfer: connecting to the old group's rank");
    }
    it = peers_.emplace(descriptor, *peer).first;
  }
  Status st = transfer_->Fetch(it->second, import.src, import.dst,
                               std::chrono::duration_cast<std::chrono::milliseconds>(kImportTimeout));
  if (!st.ok()) {
    ++failures_;
    peers_.erase(it);  // connect again next time
    return st.WithContext("transfer: fetching a moved request's blocks");
  }
  return Status::Ok();
}

BlockImporter::Counters TransferAgent::counters() const {
  MutexLock lock(mu_);
  if (transfer_ == nullptr) return {};
  const BlockTransferStats& s = transfer_->stats();
  return Counters{.fetches = s.fetches, .bytes = s.bytes, .failures = failures_};
}

}  // namespace mlarun
