// A generation request and its JSON-lines form, shared by `mlarun generate
// --prompts` and `mlarun submit --prompts`.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/block_size.h"
#include "base/status.h"
#include "runtime/request/sampling_params.h"

namespace mlarun {

// Where a moved request's cache rows are (GenerationRequest::import): the
// old group's pools, read by block id.
struct ImportSource {
  // Opaque, one per rank of the old group (its transfer descriptors, by attn_tp rank); non-empty.
  std::vector<std::string> descriptors;
  // Its block table there, in token order: block i holds positions [i * block_size, (i + 1) * block_size).
  std::vector<int32_t> blocks;
  // Tokens of prompt + generated whose rows those blocks hold (a prefix of them), 0 < rows < prompt + generated size.
  int64_t rows = 0;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  // Tokens this request already generated elsewhere (a request migrated
  // from another DP group, or resumed after its group went away): the
  // engine computes prompt + generated and draws the next token as the
  // (generated.size())-th, as the undisturbed request would have drawn it.
  // max_tokens and min_tokens count them. Empty for a new request.
  std::vector<int32_t> generated;
  // Where the rows of the first import->rows tokens of prompt + generated
  // already are (another group's pools, which keep them for this request):
  // a group that can import (EngineConfig::imports) fetches them instead of
  // computing them; one that cannot, or whose fetch fails, computes them.
  // Empty for a request computed from its tokens alone.
  std::optional<ImportSource> import;
  // The prefix cache's salt (kv/prefix_hash.h): the request reuses and
  // publishes cached prefixes only among requests with the same salt. 0:
  // unsalted, shared by every request without one. The coordinator derives
  // it from the principal and the request's cache_salt.
  uint64_t prefix_cache_salt = 0;
};

// A limit no registered model gave yet (the coordinator before any DP group
// registers): nothing is checked against it and no message prints it.
inline constexpr int64_t kLimitUnknown = std::numeric_limits<int64_t>::max();

// What a request must fit: the model's vocabulary and context length, and
// the latent cache it will live in.
struct RequestLimits {
  int64_t vocab_size = kLimitUnknown;
  int64_t max_position_embeddings = kLimitUnknown;
  int64_t block_size = kDefaultBlockSize;      // tokens per cache block, > 0
  int64_t cache_blocks_total = kLimitUnknown;  // blocks of the whole cache
  // Whose limits these are, in messages: "the model's", "the registered DP groups'".
  std::string_view whose = "the model's";
};

// A block table holding `rows` rows in blocks of `block_size` tokens:
// ceil(rows / block_size) ids (any number but none for rows == 0 when the
// block size is unknown), none negative. INVALID_ARGUMENT naming `field`
// ("import.blocks", "exported.block_ids") otherwise.
Status CheckBlockTable(std::span<const int32_t> blocks, int64_t rows, int64_t block_size, std::string_view field);

// The one check of a request's prompt and sampling parameters, made by
// everything that takes requests (Engine::Add, the simulated worker, and the
// coordinator with its groups' limits): INVALID_ARGUMENT whose message starts
// with the field as the wire and the JSON lines name it ("prompt_ids[3]: ...",
// "sampling.top_p: ..."). A non-empty prompt of ids in [0, vocab_size),
// ValidateSamplingParams (max_tokens at most max_position_embeddings), the
// tokens already generated (GenerationRequest::generated) of ids in [0,
// vocab_size) and fewer than max_tokens, prompt + max_tokens within
// max_position_embeddings, and the cache blocks of prompt + max_tokens
// within the whole cache.
Status ValidateRequest(std::span<const int32_t> prompt, const SamplingParams& sampling, const RequestLimits& limits,
                       std::span<const int32_t> generated = {});
// An import source for a request of `tokens` tokens (prompt + generated):
// rows in [1, tokens - 1], one block per block_size rows (rounded up) when
// limits.block_size is known, at least one descriptor. INVALID_ARGUMENT
// naming import.rows, import.blocks or import.descriptors.
Status ValidateImportSource(const ImportSource& import, int64_t tokens, const RequestLimits& limits);
// ValidateRequest, then the import source if there is one.
Status ValidateGenerationRequest(const GenerationRequest& request, const RequestLimits& limits);

// One JSON object: "prompt_ids" (required) and the sampling fields
// "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
// "ignore_eos", and "structured" (a StructuredOutput: {"kind": "json_object"
// | "json_schema" | "regex" | "choice" | "grammar", "spec", "choices",
// "any_whitespace"}); `defaults` fill absent fields. Errors name the field.
StatusOr<GenerationRequest> ParseRequestLine(const std::string& line, const SamplingParams& defaults);

// The logprob fields of a request's result line (`mlarun generate --json`,
// `mlarun submit --json`), added to `line` when asked for: "top_logprobs",
// per generated token its step's most likely tokens as [[id, logprob], ...]
// best first; "prompt_logprobs", [id, logprob] for each prompt token after
// the first, and "prompt_top_logprobs", each such position's most likely.
void AddLogprobFields(nlohmann::json& line, const std::vector<std::vector<TokenLogprob>>& top,
                      const std::vector<LogprobEntry>& prompt);

}  // namespace mlarun
