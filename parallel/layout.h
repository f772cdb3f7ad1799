// How W = dp x attn_tp ranks divide the work (docs/design.md "Processes").
//
//   dp_rank = rank / attn_tp, attn_tp_rank = rank % attn_tp.
// The attn-TP group of a DP group (ranks dp_rank * attn_tp .. + attn_tp - 1)
// shares its requests and splits attention heads; the DP peers (ranks with
// the same attn_tp_rank, one per DP group) exchange hidden states; the dense
// MLP and the MoE are sharded over the whole world.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>

#include "base/status.h"
#include "parallel/communicator.h"

namespace mlarun {

// How the MLP / MoE weights are split over the world.
enum class MoeSharding : uint8_t {
  kByExpert = 0,        // each rank holds n_routed_experts / W whole experts
  kByIntermediate = 1,  // each rank holds 1/W of every expert's intermediate dimension
};

struct ParallelLayout {
  int dp = 1;
  int attn_tp = 1;
  MoeSharding moe = MoeSharding::kByExpert;

  int world() const { return dp * attn_tp; }
  int dp_rank(int rank) const { return rank / attn_tp; }
  int attn_tp_rank(int rank) const { return rank % attn_tp; }
  // The DP group's leader: attn_tp_rank 0.
  int leader_of(int dp_rank) const { return dp_rank * attn_tp; }
  friend bool operator==(const ParallelLayout&, const ParallelLayout&) = default;
};
std::ostream& operator<<(std::ostream& os, const ParallelLayout& l);

// Parses "dp=2,attn_tp=2" (either key may be absent: 1), optionally
// ",moe=expert|intermediate", and the short names of `mlarun memory` in
// their place: "tp8", "dp8", "dp2xtp4" ("dp2xtp4,moe=intermediate"). The one
// layout parser of serve, worker and memory. Errors name the bad part.
StatusOr<ParallelLayout> ParseParallelLayout(std::string_view text);

// The communicators one rank uses, split from the world communicator.
struct ProcessGroups {
  ParallelLayout layout;
  int rank = 0;  // in the world
  std::unique_ptr<Communicator> world;
  std::unique_ptr<Communicator> attn_tp;   // this rank's DP group (size attn_tp)
  std::unique_ptr<Communicator> dp_peers;  // ranks with this attn_tp_rank (size dp)
  // With a device runner (CUDA): NCCL over the same ranks as attn_tp and
  // dp_peers, for the step's collectives on device buffers; nullptr for the
  // CPU, and for a group of one rank. The host-side agreements (the plan,
  // the lock-step report, a step's failure) stay on attn_tp / dp_peers.
  std::unique_ptr<Communicator> device_attn_tp;
  std::unique_ptr<Communicator> device_dp_peers;

  int dp_rank() const { return layout.dp_rank(rank); }
  int attn_tp_rank() const { return layout.attn_tp_rank(rank); }
  bool is_leader() const { return attn_tp_rank() == 0; }
};

}  // namespace mlarun
