// `mlarun sim-worker`: DP groups without a model that speak the WorkerLink
// protocol (for tests, examples and the serving benchmark). No gRPC header is
// visible here.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

#include "base/block_size.h"
#include "base/status.h"
#include "runtime/request/sampling_params.h"
#include "serving/security/security.h"

namespace mlarun {

// Simulated DP groups: one process opens `groups` WorkerLink streams and
// answers every routed request with deterministic tokens (a function of the
// prompt, the seed and the token index, so equal requests get equal tokens)
// at `tokens_per_s` per group, keeping a simulated prefix cache (hash chain of
// full blocks, LRU) so prefix hits are reported as a real group would.
// Reconnects when the coordinator restarts. Runs until `stop` is set.
struct SimWorkerOptions {
  std::string coordinator = "127.0.0.1:50051";
  std::string worker_id = "sim";
  // The worker link's shared secret (--worker-secret-file); empty: none.
  std::string worker_secret;
  TlsPem tls;  // TLS to the coordinator, as the worker's --tls-* flags
  int groups = 1;
  double tokens_per_s = 1000;  // per group; 0: as fast as possible
  // A fixed cost per step on top of the per-token one: a step of n tokens
  // takes step_ms + n / tokens_per_s, as a decode step reads the weights
  // once and then costs per sequence. 0 (the default): per token only.
  double step_ms = 0;
  // The cost of prompts: the rows a request computes before its first
  // token (its prompt less what the prefix cache holds; a resumed request's
  // prompt and generated tokens) are computed in chunks, at most
  // max_batched_tokens of them per step over the requests still
  // prefilling, in admission order, beside one decode token of every
  // request past its prefill; such a step takes prefill rows /
  // prefill_tokens_per_s more. 0 (the default): prompts cost nothing and
  // are never chunked (max_batched_tokens does not apply).
  double prefill_tokens_per_s = 0;
  int64_t max_batched_tokens = 2048;
  // What the groups serve (Register.role, as mlarun worker --role): "mixed"
  // (the default), "prefill" (new requests, each handed to a decode group
  // by the coordinator after its first token) or "decode".
  std::string role = "mixed";
  // Simulated block moves, as mlarun worker --transfer: > 0 registers a
  // transfer descriptor per group, so the coordinator moves a request's
  // cache blocks between such groups instead of having them computed again.
  // A MigrateOut then answers Exported with the blocks of the request's
  // computed rows, held until ReleaseExported (or a CancelRoute of it, or
  // the stream's end); a route with a MoveSource attaches what the group's
  // own prefix cache holds and fetches the rest of those rows in its next
  // step, which takes rows x cache_bytes_per_token / (transfer_gbps Gbit/s)
  // more, and decodes from the step after. 0 (the default): no descriptor;
  // moved requests are computed again.
  double transfer_gbps = 0;
  int64_t vocab_size = 512;
  int64_t max_position_embeddings = 4096;
  int64_t block_size = kDefaultBlockSize;
  int64_t cache_blocks = 1024;  // per group
  int64_t eos_token_id = -1;    // -1: never stops early
  // Set (tests): every request's tokens are these in order instead (the
  // logprobs stay SimWorkerToken's), and it stops ("stop") after the last.
  std::vector<int64_t> script;
  // Set (tests): sees every routed request's sampling parameters after
  // Engine::Add's checks; an error fails the request with its code and
  // message, as a group does that cannot compile a request's grammar.
  std::function<Status(const SamplingParams&)> check;
};
// In detail: each group registers as (worker_id, dp_group = i) with dp = groups, attn_tp =
// 1 and one synthetic rank (rank = dp_group = i, attn_tp_rank 0, host =
// gethostname()) whose fixed numbers are recognizably fake: weights 16 MiB
// attention, 64 MiB MoE, 8 MiB dense MLP, 4 MiB embedding + head;
// cache_bytes_per_token 1 KiB, so cache_block_bytes = block_size KiB. Cache
// used/peak/running/waiting/tokens_per_s are the simulation's real values,
// and with transfer_gbps the rank's transfer_path is "sim" and its
// transfer_fetches / transfer_bytes count the simulated fetches.
// Routed requests get Engine::Add's checks (RequestDone with error_code 3 and
// its message), then wait FIFO until their blocks (prompt + max_tokens - 1
// rows) fit and fewer than 256 run. The cache is a LatentCache with tiny rows,
// so prefix hits follow the engine's rules exactly (PrefixChainHash over full
// blocks under the route's prefix_cache_salt, LRU of released blocks, at least
// one token recomputed). A token that would end one of the request's
// bad_words becomes the next id that does not (so tests see them arrive).
// Steps: a step is planned when it starts (every running request's rows:
// a chunk of its prefill, or one decode row) and takes step_ms + decode
// rows / tokens_per_s + prefill rows / prefill_tokens_per_s (no per-token
// part for a rate of 0; with all 0 the steps follow one another at once);
// when it ends, its rows are written to the cache and it emits one
// TokenBatch with a token of every request whose rows are all computed
// (the end of its prefill, or a decode row), then the RequestDone of those
// that finished. A request routed while a step runs joins the next one.
// WorkerStats every 200 ms (free_blocks = allocatable blocks not reserved by
// running requests). A CancelRoute drops the request at once (the step in
// flight emits nothing for it); a MigrateOut answers Exported with the
// tokens generated (and its blocks with transfer_gbps) and drops it. A request routed with generated_ids (it
// moved, or its group went away) computes prompt + those tokens as its
// prefill and goes on from token index len(generated_ids), so its tokens
// are those it would have had on one group. When the stream breaks, the
// group drops its in-flight requests and reconnects with back-off 100 ms
// doubling to 2 s. Returns 0 once `*stop` is seen (polled every 20 ms), 2 for
// bad options (message on `log`). Blocks; thread-safe to call concurrently.
int RunSimWorker(const SimWorkerOptions& o, const std::atomic<bool>* stop, std::ostream& log);

// The simulated worker's output, exposed so tests and benchmarks can predict
// it: token `index` (0 = the first generated token) of a request is a
// splitmix64 fold h of (seed, prompt ids, index), token = h % vocab_size and
// logprob = -8 * (the top 53 bits of h as a fraction in [0, 1)). Temperature,
// top-k and top-p are validated but otherwise ignored (there are no logits).
struct SimToken {
  int64_t token = 0;
  double logprob = 0.0;
};
SimToken SimWorkerToken(std::span<const int32_t> prompt, uint64_t seed, int64_t index, int64_t vocab_size);
// Its most likely tokens, for a request with SamplingParams::logprobs = n:
// min(n, vocab_size) of them, best first: first token (tok.token + 1) %
// vocab_size with logprob tok.logprob / 2 (so with n = 1 the token itself is
// not listed), then the token itself, then for j >= 2 token (tok.token + j)
// % vocab_size with logprob tok.logprob - (j - 1).
std::vector<TokenLogprob> SimWorkerTop(const SimToken& tok, int64_t n, int64_t vocab_size);
// With SamplingParams::prompt_logprobs = n >= 0, prompt token i >= 1 gets
// logprob -0.5 - 0.25 (i % 8) and SimWorkerTop of {prompt[i], that} as its
// most likely tokens, all sent before the first token.
SimToken SimWorkerPromptToken(std::span<const int32_t> prompt, int64_t i);

}  // namespace mlarun
