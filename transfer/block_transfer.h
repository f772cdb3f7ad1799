// The transfer plane for latent blocks: copies blocks of one rank's
// LatentPool into another rank's pool over UCX, on one host (shared memory)
// or across hosts (TCP, or InfiniBand / RoCE verbs: whatever UCX finds;
// UCX_TLS and UCX_NET_DEVICES narrow it), with one-sided gets: the
// destination reads the blocks it asked for straight out of the source's
// registered pool. Migrating a running request and handing a prefilled one
// to a decode group both come down to this: the new group allocates blocks,
// fetches the old group's into them, and the old group frees its own.
//
// Each rank makes one BlockTransfer over its pool. The pool is registered
// with UCX once, at creation (ucp_mem_map), and Descriptor() packs what a
// peer needs to read it: the rank's UCX worker address, the pool's remote
// key, its base address and its layout. There is no listener: a peer can
// connect only with a descriptor, which callers hand out over the
// deployment's authenticated channel (the worker link, or MPI). Whoever holds
// a descriptor can read the whole pool, and nothing else: peers only get,
// never put.
//
// Fetch() copies blocks of a connected peer into this pool, every layer,
// one get per run of consecutive block ids per layer, and returns once all
// of them landed or with an error naming what failed (a deadline, or UCX's
// status); it never returns while a get may still write into the pool. The
// source must call Progress() while peers connect to it and fetch from it
// (its serving loop between steps, or a thread of its own): UCX's
// connection handshake needs the source's worker on every transport, and a
// transport without remote memory access of its own (TCP) has it answer
// every get.
//
// Two paths (BlockTransferOptions::path), the same on both ranks:
//  * kAny: every transport UCX finds, with peer failure handling: a failed
//    peer ends a fetch with UNAVAILABLE, a deadline force-closes the peer.
//    UCX 1.13 has no peer failure handling on its shared-memory transports,
//    so ranks of one host then talk over TCP on the loopback.
//  * kSharedMemory: ranks of one host, over UCX's shared-memory transports
//    (sysv, posix, cma) and without peer failure handling. Once connected
//    a get is a copy this process makes out of the source's mapped pool, so
//    it needs nothing from the source and always ends: Connect waits for the
//    connection (up to its timeout), and a fetch waits for its gets. Many
//    times the loopback's rate (docs/cache-transfer.md). A source that dies
//    is not noticed here: the deployment's own channel says so.
//
// Not thread-safe: one thread drives an instance (its UCX worker is
// single-threaded); two instances may run on two threads. Host pools only
// for now: a pool in CUDA memory needs the memory type given to ucp_mem_map
// and a UCX built with CUDA.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/device_memory.h"
#include "base/status.h"
#include "kv/latent_pool.h"

namespace mlarun {

struct BlockTransferStats {
  int64_t fetches = 0;   // Fetch calls that succeeded
  int64_t blocks = 0;    // blocks they copied
  int64_t bytes = 0;     // bytes they copied (blocks x the pool's block_bytes)
  int64_t gets = 0;      // one-sided gets they issued (runs x layers)
  int64_t failures = 0;  // Fetch calls that failed after issuing gets
};

enum class TransferPath : uint8_t { kAny, kSharedMemory };

struct BlockTransferOptions {
  TransferPath path = TransferPath::kAny;
  // kSharedMemory: how long Connect waits for the connection.
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(10);
};

// Host memory that UCX allocates (ucp_mem_map with UCP_MEM_MAP_ALLOCATE: its
// own shared segments where it can), for the pool a BlockTransfer serves:
// UCX's shared-memory transports read such memory about twice as fast as
// process memory registered after the fact (docs/cache-transfer.md). Make
// the pool in it (LatentPool::Create(config, memory)) and the BlockTransfer
// over that pool with it; it must outlive both.
class TransferMemory final : public DeviceMemory {
 public:
  static StatusOr<std::unique_ptr<TransferMemory>> Create(const BlockTransferOptions& options = {});
  ~TransferMemory() override;
  TransferMemory(const TransferMemory&) = delete;
  TransferMemory& operator=(const TransferMemory&) = delete;

  Backend backend() const override { return Backend::kCpu; }
  bool host_accessible() const override { return true; }
  void* Allocate(size_t bytes) override;
  void Free(void* p) override;
  Status CopyIn(void* dst, const void* src, size_t bytes) override;
  Status CopyOut(void* dst, const void* src, size_t bytes) override;
  Status Zero(void* dst, size_t bytes) override;

  const BlockTransferOptions& options() const { return options_; }

 private:
  friend class BlockTransfer;
  struct Ucx;
  explicit TransferMemory(const BlockTransferOptions& options);
  const BlockTransferOptions options_;
  std::unique_ptr<Ucx> ucx_;
};

// Waits until `fd` (BlockTransfer::Wakeup::fd) is readable or `most`
// passes; true when it is readable.
bool WaitForWakeup(int fd, std::chrono::microseconds most);

class BlockTransfer {
 public:
  // Registers `pool` (which must outlive this) with a UCX context and worker
  // of its own; or, with `memory` (the pool's memory, same options), serves
  // the pool from the allocation UCX made. kSharedMemory fails where UCX has
  // no shared-memory transport.
  static StatusOr<std::unique_ptr<BlockTransfer>> Create(const LatentPool& pool,
                                                         const BlockTransferOptions& options = {},
                                                         TransferMemory* memory = nullptr);
  ~BlockTransfer();
  BlockTransfer(const BlockTransfer&) = delete;
  BlockTransfer& operator=(const BlockTransfer&) = delete;

  // What a peer passes to Connect to read this pool (opaque bytes).
  std::vector<std::byte> Descriptor() const;

  // Connects to the rank that made `descriptor`; returns its peer id. Its
  // pool must have this pool's layout (layers, widths, block size, dtype;
  // any number of blocks), or the error names the field that differs.
  StatusOr<int> Connect(std::span<const std::byte> descriptor);

  // Copies the peer's blocks src[i] into this pool's blocks dst[i], every
  // layer. Refused before any transfer: sizes that differ, ids outside
  // either pool, a destination block named twice, an unknown or failed
  // peer. kAny: DEADLINE_EXCEEDED after `timeout` (the peer is then closed:
  // connect again), UNAVAILABLE when the peer fails. kSharedMemory waits
  // for its copies whatever `timeout` says.
  Status Fetch(int peer, std::span<const int32_t> src, std::span<const int32_t> dst,
               std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // Answers peers' gets where the transport needs it (see above); returns at
  // once, true when it had something to do (a caller polling it can back
  // off while it has not).
  bool Progress();

  // For a source that waits for its peers instead of polling: progresses
  // until nothing is left, then arms the worker so that its event fd turns
  // readable when a peer sends something (a get to answer over TCP, a
  // handshake). `fd` >= 0: armed; wait on it (WaitForWakeup) without holding
  // whatever lock guards this object, then call this again. `busy`: a
  // message came meanwhile; call this again at once. Neither: the
  // transports cannot wake a waiter; poll Progress with a back-off.
  struct Wakeup {
    int fd = -1;
    bool busy = false;
  };
  Wakeup ArmForWakeup();
  // For a source that owns this object alone (no lock around it): answers
  // what peers sent, then sleeps until a peer sends more or `most` passes;
  // where the transports cannot wake it, one Progress instead.
  void AnswerPeers(std::chrono::microseconds most);

  const BlockTransferStats& stats() const { return stats_; }

 private:
  struct Ucx;
  BlockTransfer(const LatentPool& pool, const BlockTransferOptions& options);
  Status WaitConnected(int peer);
  const LatentPool& pool_;
  const BlockTransferOptions options_;
  std::unique_ptr<Ucx> ucx_;
  BlockTransferStats stats_;
};

}  // namespace mlarun
