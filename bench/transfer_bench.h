// `mlarun bench transfer`: the transfer plane of latent blocks
// (transfer/block_transfer.h) between two ranks under mpirun, whatever
// transport UCX picks (UCX_TLS narrows it), at the sizes given, so it can be
// set against `ucx_perftest -t ucp_get` on the same transport and sizes
// (bench/transfer_vs_perftest.sh).
//
// Rank 0 holds the source pool (random bytes from a seed) and answers from a
// thread of its own (BlockTransfer::Progress); rank 1 connects with rank 0's
// descriptor (broadcast over MPI) and fetches. Each size is a run of
// consecutive blocks of one layer (one get), the pool's blocks of
// block_bytes = block_size x 576 x 2 (bf16, DeepSeek's widths); a size is
// rounded up to whole blocks. Each size is fetched once and checked byte for
// byte against the seed's bytes, then fetched `repetitions` times; the
// median time gives GB/s (bytes / time, 1e9 bytes per GB). A fetch of a
// request's blocks spread across the pool (one get per block) runs the same
// way with --scattered. The pools are allocated by UCX (TransferMemory), as
// a deployment makes them; --process-memory registers ordinary memory instead.
//
// Collective on the world, which must have two ranks: a bad option or
// another size is refused on both ranks with the same error.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

class MpiSession;

struct TransferBenchOptions {
  std::vector<int64_t> sizes = {int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 24, int64_t{1} << 26};  // bytes
  int64_t block_tokens = 64;    // tokens per block
  int repetitions = 20;         // timed fetches per size (median)
  bool scattered = false;       // the blocks of a size spread over the pool: one get per block
  std::string path = "any";     // BlockTransfer's path: any (peer failure handling) or shm (one host)
  bool process_memory = false;  // pools in process memory registered after the fact, not in TransferMemory
  bool json = false;            // one JSON document on rank 1's stdout; the table to stderr
};

// See the top of this file. `table` gets rank 1's table.
Status RunTransferBench(const TransferBenchOptions& o, MpiSession& session, std::ostream& table);

}  // namespace mlarun
