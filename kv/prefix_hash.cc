#include "kv/prefix_hash.h"

#include "base/hash.h"

namespace mlarun {

uint64_t PrefixChainHash(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = Mix64(parent ^ kGoldenGamma);
  for (int32_t t : tokens) h = Mix64(h ^ static_cast<uint32_t>(t)) + kGoldenGamma;
  return h;
}

std::vector<uint64_t> PrefixBlockHashes(std::span<const int32_t> tokens, int64_t block_size, uint64_t salt) {
  std::vector<uint64_t> chain;
  if (block_size <= 0) return chain;
  const size_t bs = static_cast<size_t>(block_size);
  uint64_t parent = PrefixChainSeed(salt);
  for (size_t n = 0; n + bs <= tokens.size(); n += bs) {
    parent = PrefixChainHash(parent, tokens.subspan(n, bs));
    chain.push_back(parent);
  }
  return chain;
}

}  // namespace mlarun
