#include "bench/local_cache.h"

namespace mlarun {

StatusOr<LocalLatentCache> LocalLatentCache::Create(const LatentCacheConfig& config, DeviceMemory& memory) {
  LocalLatentCache c;
  MLARUN_ASSIGN_OR_RETURN(c.blocks, LatentCache::Create(config));
  MLARUN_ASSIGN_OR_RETURN(c.pool, LatentPool::Create(config, memory));
  return c;
}

StatusOr<ForwardSeq> LocalLatentCache::Append(SeqId id, std::span<const int32_t> tokens, ForwardSeq::Logits logits) {
  if (!blocks->HasSequence(id)) MLARUN_RETURN_IF_ERROR(blocks->AddSequence(id));
  const int64_t start = blocks->NumTokens(id);
  MLARUN_RETURN_IF_ERROR(blocks->Append(id, tokens));
  return ForwardSeq{
      .id = id, .tokens = tokens, .start_pos = start, .block_table = blocks->BlockTable(id), .logits = logits};
}

}  // namespace mlarun
