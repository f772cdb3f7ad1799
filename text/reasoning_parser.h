// DeepSeek-R1's reasoning split out of its answer text: the text up to the
// first `</think>` is reasoning (an opening `<think>` before it removed: the
// chat template may already have put it in the prompt), the rest is content,
// as vLLM's and SGLang's `deepseek_r1` reasoning parser give it.
#pragma once

#include <string>
#include <string_view>

namespace mlarun::text {

// The marker that ends the reasoning; a constrained answer's grammar holds
// after it (StructuredOutput::start_after).
inline constexpr std::string_view kReasoningEnd = "</think>";

struct ReasoningSplit {
  std::string reasoning;
  std::string content;
};

// The whole text at once.
ReasoningSplit SplitReasoning(std::string_view text);

// The same split over text that arrives in deltas (a marker may be cut
// across them). Add returns what is safe to send now, holding back only a
// suffix that may still become a marker; Finish returns what was held.
// Invariant, for any split of a text into deltas: the concatenation of the
// returned reasoning (and content) equals SplitReasoning(text)'s.
// Not thread-safe.
class ReasoningParser {
 public:
  ReasoningSplit Add(std::string_view delta);
  ReasoningSplit Finish();

 private:
  enum class State { kStart, kReasoning, kContent };
  State state_ = State::kStart;
  std::string held_;
};

}  // namespace mlarun::text
