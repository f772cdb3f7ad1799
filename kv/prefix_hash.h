// The hash chain of a token sequence's full cache blocks, as the latent cache
// publishes them for prefix reuse. Its own library (no cache, no model), so
// that a router (serving/coordinator) computes the same hashes without
// linking the cache.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace mlarun {

// The parent "hash" of a sequence's first block, unsalted.
inline constexpr uint64_t kPrefixChainSeed = 0x6d6c6172756e2d31ull;

// The parent of the first block of a sequence with prefix-cache salt `salt`
// (0: unsalted, kPrefixChainSeed). Distinct salts give distinct seeds, and
// PrefixChainHash is a bijection of its parent for given tokens, so the same
// tokens under two salts share no block hash: sequences reuse only the
// prefixes of sequences with their own salt (docs/security.md).
inline constexpr uint64_t PrefixChainSeed(uint64_t salt) { return kPrefixChainSeed ^ salt; }

// The hash of one block of `tokens` after blocks whose chain ends in `parent`.
uint64_t PrefixChainHash(uint64_t parent, std::span<const int32_t> tokens);

// Element i hashes blocks 0..i of `tokens` (only whole blocks of
// `block_size`; none when block_size <= 0) under `salt`: exactly the hashes
// the cache publishes full blocks under, so a router can tell which group
// already caches a prompt's prefix.
std::vector<uint64_t> PrefixBlockHashes(std::span<const int32_t> tokens, int64_t block_size, uint64_t salt = 0);

}  // namespace mlarun
