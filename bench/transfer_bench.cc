#include "bench/transfer_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <thread>

#include "bench/comm_bench.h"
#include "bench/timing.h"
#include "parallel/communicator.h"
#include "parallel/mpi/mpi_world.h"
#include "transfer/block_transfer.h"

namespace mlarun {
namespace {

constexpr uint64_t kSeed = 0x6d6c6172756e;  // the source pool's bytes

Status CheckOptions(const TransferBenchOptions& o, int world) {
  if (world != 2) return InvalidArgumentError("bench transfer runs on 2 ranks (mpirun -np 2), not ", world);
  if (o.sizes.empty()) return InvalidArgumentError("bench transfer: no --sizes");
  for (int64_t s : o.sizes)
    if (s <= 0) return InvalidArgumentError("bench transfer: --sizes must be positive, got ", s);
  if (o.block_tokens <= 0) return InvalidArgumentError("bench transfer: --block-tokens must be positive");
  if (o.repetitions <= 0) return InvalidArgumentError("bench transfer: --repetitions must be positive");
  if (o.path != "any" && o.path != "shm")
    return InvalidArgumentError("bench transfer: --path must be any or shm, got '", o.path, "'");
  return Status::Ok();
}

// One layer of DeepSeek's latent rows (512 + 64, bf16), blocks of
// `block_tokens`, twice the blocks of the largest size (scattered fetches
// take every other block).
LatentCacheConfig PoolConfig(const TransferBenchOptions& o) {
  LatentCacheConfig c;
  c.num_layers = 1;
  c.kv_lora_rank = 512;
  c.rope_dim = 64;
  c.block_size = o.block_tokens;
  c.dtype = DType::kBF16;
  const int64_t max_size = *std::max_element(o.sizes.begin(), o.sizes.end());
  const int64_t max_blocks = (max_size + c.block_bytes() - 1) / c.block_bytes();
  c.budget_bytes = 2 * max_blocks * c.block_bytes();
  return c;
}

void FillFromSeed(std::byte* p, int64_t bytes) {
  std::mt19937_64 rng(kSeed);
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
}

// Rank 1's side: each size fetched, checked, then timed.
StatusOr<nlohmann::json> FetchSizes(const TransferBenchOptions& o, BlockTransfer& t, LatentPool& pool,
                                    const std::vector<std::byte>& source, int peer, std::ostream& table) {
  const int64_t block_bytes = pool.config().block_bytes();
  nlohmann::json rows = nlohmann::json::array();
  table << "bytes per fetch | blocks | gets | median us | min us | GB/s\n";
  for (int64_t size : o.sizes) {
    const int64_t blocks = (size + block_bytes - 1) / block_bytes;
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) ids[static_cast<size_t>(b)] = static_cast<int32_t>(o.scattered ? 2 * b : b);
    std::memset(pool.LayerData(0), 0xff, static_cast<size_t>(pool.bytes()));
    const int64_t gets_before = t.stats().gets;
    MLARUN_RETURN_IF_ERROR(t.Fetch(peer, ids, ids));
    const int64_t gets = t.stats().gets - gets_before;
    for (int32_t id : ids)
      if (std::memcmp(static_cast<std::byte*>(pool.LayerData(0)) + id * block_bytes, source.data() + id * block_bytes,
                      static_cast<size_t>(block_bytes)) != 0)
        return InternalError("bench transfer: block ", id, " arrived with other bytes than the source's");
    std::vector<double> us;
    for (int r = 0; r < o.repetitions; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      MLARUN_RETURN_IF_ERROR(t.Fetch(peer, ids, ids));
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    const double med = Median(us), least = *std::min_element(us.begin(), us.end());
    const double bytes = static_cast<double>(blocks * block_bytes);
    const double gbs = bytes / (med * 1e3);
    table << blocks * block_bytes << " | " << blocks << " | " << gets << " | " << Fmt(med, 1) << " | " << Fmt(least, 1)
          << " | " << Fmt(gbs, 2) << "\n";
    rows.push_back({{"bytes", blocks * block_bytes},
                    {"blocks", blocks},
                    {"gets_per_fetch", gets},
                    {"median_us", med},
                    {"min_us", least},
                    {"gb_per_s", gbs}});
  }
  return rows;
}

}  // namespace

Status RunTransferBench(const TransferBenchOptions& o, MpiSession& session, std::ostream& table) {
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world, session.World());
  MLARUN_RETURN_IF_ERROR(CheckOptions(o, world->size()));
  const LatentCacheConfig config = PoolConfig(o);
  const TransferPath path = o.path == "shm" ? TransferPath::kSharedMemory : TransferPath::kAny;
  std::unique_ptr<TransferMemory> memory;
  if (!o.process_memory) {
    MLARUN_ASSIGN_OR_RETURN(memory, TransferMemory::Create({.path = path}));
  }
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<LatentPool> pool,
                          LatentPool::Create(config, memory ? *memory : HostMemory()));
  const bool source = world->rank() == 0;
  if (source) FillFromSeed(static_cast<std::byte*>(pool->LayerData(0)), pool->bytes());
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<BlockTransfer> t, BlockTransfer::Create(*pool, {.path = path}, memory.get()));
  // Rank 0's descriptor to rank 1: its length, then its bytes.
  std::vector<std::byte> descriptor = source ? t->Descriptor() : std::vector<std::byte>();
  int64_t length = static_cast<int64_t>(descriptor.size());
  MLARUN_RETURN_IF_ERROR(world->Broadcast(&length, 1, CommType::kI64, 0));
  descriptor.resize(static_cast<size_t>(length));
  MLARUN_RETURN_IF_ERROR(world->Broadcast(descriptor.data(), length, CommType::kU8, 0));
  if (source) {  // answer until rank 1 is done (MPI stays on this thread)
    std::atomic<bool> done{false};
    // As a worker rank's agent answers: woken by its peer's messages, not
    // polling (a spinning answerer takes a core that the transport, or a
    // user-space link, needs on a small host).
    std::thread answer([&] {
      while (!done.load(std::memory_order_relaxed)) t->AnswerPeers(std::chrono::milliseconds(1));
    });
    const Status st = world->Barrier();
    done.store(true);
    answer.join();
    return st;
  }
  std::vector<std::byte> expected(static_cast<size_t>(pool->bytes()));
  FillFromSeed(expected.data(), pool->bytes());
  StatusOr<nlohmann::json> rows = InvalidArgumentError("not run");
  auto peer = t->Connect(descriptor);
  if (peer.ok()) rows = FetchSizes(o, *t, *pool, expected, *peer, table);
  const Status barrier = world->Barrier();  // always: rank 0 waits there
  if (!peer.ok()) return peer.status();
  if (!rows.ok()) return rows.status();
  MLARUN_RETURN_IF_ERROR(barrier);
  if (o.json) {
    nlohmann::json doc = {{"date", Today()},
                          {"cpu", CpuJson()},
                          {"transport", TransportFromEnvironment()},
                          {"path", o.path},
                          {"pool_memory", o.process_memory ? "process" : "ucx"},
                          {"block_bytes", config.block_bytes()},
                          {"scattered", o.scattered},
                          {"repetitions", o.repetitions},
                          {"rows", *rows}};
    std::cout << doc.dump(2) << "\n";
  }
  return Status::Ok();
}

}  // namespace mlarun
