// How the CUDA absorbed decode divides a batch among thread blocks (host
// code, plain C++, built in every configuration and host-tested).
//
// A sequence has q_len * h_q query rows (row = token * h_q + head). The
// decode kernel gives one thread block a tile of up to rows_per_block of them
// and a range of the sequence's keys; the block reads each cache row of its
// range once for all the tile's rows. A batch with few tiles (small batches,
// few heads) would leave most SMs idle, so long contexts are split
// (flash-decoding, as FlashMLA's num_splits): each split becomes its own
// block writing a partial (o, lse), and a combine kernel merges the splits of
// a row by log-sum-exp (attention/cuda/lse_merge.h).
//
// The rule (deterministic; a function of the batch and the config only):
//  * base = number of tiles (sum over sequences of ceil(q_len h_q / rows_per_block));
//    slots = num_sms * blocks_per_sm (one wave of resident blocks);
//  * target = 2 * slots blocks when the batch fills less than a wave (two
//    waves even out the last one), else target = base: the batch is already
//    parallel, and only sequences longer than its mean tile length are cut,
//    into pieces of about that mean (varlen balance). A uniform large batch is
//    therefore never split;
//  * the split length K = the total keys of all tiles / target, rounded up to
//    a whole number of pages and at least min_split_keys (each split writes
//    and the combine reads back rows_per_block * L floats, which must stay
//    small next to the keys it attends to);
//  * sequence i gets clamp(ceil(seq_len_i / K), 1, min(max_splits, pages_i))
//    splits, split k covering pages [pages_i k / n, pages_i (k + 1) / n):
//    page-aligned, contiguous, none empty, lengths within one page of each
//    other.
// Then sum over tiles of splits <= target + base: the number of work items is
// bounded by three waves of blocks (or twice the tiles of a large batch).
#pragma once

#include <cstdint>
#include <vector>

#include "attention/cuda/config.h"
#include "base/status.h"

namespace mlarun {

struct SplitSeq {
  int64_t q_len = 1;    // query tokens of the block (>= 1)
  int64_t seq_len = 1;  // keys, including the q_len new tokens (>= q_len)
};

struct SplitPlanConfig {
  int64_t h_q = 1;                                          // query heads: a sequence has q_len * h_q query rows
  int64_t rows_per_block = cuda_mla::kDefaultRowsPerBlock;  // query rows one thread block serves
  int64_t page_rows = 64;                            // split boundaries are multiples of this (the cache's block_size)
  int64_t num_sms = 1;                               // streaming multiprocessors of the device
  int64_t blocks_per_sm = 1;                         // decode blocks resident per SM (occupancy)
  int64_t min_split_keys = cuda_mla::kMinSplitKeys;  // shortest split worth a partial result (rounded up to pages)
  int64_t max_splits = cuda_mla::kMaxSplits;         // per sequence: bounds the partial buffer and the combine's loop
};

// One thread block of the decode kernel: query rows [row0, row0 + rows) of
// sequence `seq` against keys [key_begin, key_end) of split `split`.
struct SplitWorkItem {
  int32_t seq = 0;    // index into the batch given to PlanSplits
  int32_t split = 0;  // 0 .. num_splits[seq] - 1
  int32_t row0 = 0;   // first query row (token * h_q + head)
  int32_t rows = 0;   // 1 .. rows_per_block
  // The split's keys, clipped to those the tile's last token can see
  // (CausalVisibleKeys); rows of earlier tokens see fewer (the kernel masks
  // them). May be empty (key_end <= key_begin) when the last split lies
  // wholly in the block's own new tokens past what this tile sees: the
  // block then writes an empty partial (lse = -inf), which the merge drops.
  int64_t key_begin = 0;
  int64_t key_end = 0;
  // First row of this item's partial results, or -1 when the sequence is not
  // split (the block writes the final result).
  int64_t partial_row = -1;
};

struct SplitPlan {
  std::vector<int32_t> num_splits;      // per sequence, >= 1
  std::vector<int64_t> partial_offset;  // per sequence: first partial row, -1 when not split;
                                        //   split s, row r at partial_offset + s * q_len * h_q + r
  int64_t partial_rows = 0;             // sum over split sequences of num_splits * q_len * h_q
  int64_t split_keys = 0;               // K of the rule above
  int64_t base_tiles = 0;               // base of the rule above
  int64_t target_blocks = 0;            // target of the rule above
  std::vector<SplitWorkItem> items;     // sequence-major, then tile, then split
};

// Checks the config (positive sizes) and the batch (1 <= q_len <= seq_len,
// row indices in int32), naming what is wrong.
Status CheckSplitPlanInput(const SplitPlanConfig& c, const SplitSeq* seqs, int64_t n);

// Plans the batch into *plan, reusing its vectors' memory (planning a batch
// no larger than an earlier one allocates nothing). REQUIRES: CheckSplitPlanInput OK.
void PlanSplits(const SplitPlanConfig& c, const SplitSeq* seqs, int64_t n, SplitPlan* plan);

// Keys [begin, end) of split k of n over a sequence of seq_len keys in pages
// of page_rows.
struct KeyRange {
  int64_t begin = 0, end = 0;
};
inline KeyRange SplitKeyRange(int64_t seq_len, int64_t page_rows, int64_t k, int64_t n) {
  const int64_t pages = (seq_len + page_rows - 1) / page_rows;
  const int64_t b = pages * k / n * page_rows, e = pages * (k + 1) / n * page_rows;
  return {b, e < seq_len ? e : seq_len};
}

}  // namespace mlarun
