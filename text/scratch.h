// Per-thread scratch buffers of the tokenizer: kept between calls so that a
// warm thread encodes without allocating, but only while small. After an
// input that grew one past kScratchKeepBytes (a prompt of a million
// characters makes megabytes of symbols or runs), it is released, so an idle
// thread holds little however large the inputs it has seen.
#pragma once

#include <cstddef>

namespace mlarun::text {

inline constexpr size_t kScratchKeepBytes = size_t{64} << 10;

template <typename Container>
void ReleaseIfLarge(Container& c) {
  if (c.capacity() * sizeof(typename Container::value_type) > kScratchKeepBytes) Container().swap(c);
}

// Calls ReleaseIfLarge on `c` when the scope ends.
template <typename Container>
class ReleaseIfLargeOnExit {
 public:
  explicit ReleaseIfLargeOnExit(Container& c) : c_(c) {}
  ~ReleaseIfLargeOnExit() { ReleaseIfLarge(c_); }
  ReleaseIfLargeOnExit(const ReleaseIfLargeOnExit&) = delete;
  ReleaseIfLargeOnExit& operator=(const ReleaseIfLargeOnExit&) = delete;

 private:
  Container& c_;
};

}  // namespace mlarun::text
