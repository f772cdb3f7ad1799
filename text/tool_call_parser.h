// DeepSeek-V3's tool calls out of its answer text, as vLLM's and SGLang's
// `deepseek_v3` tool parser read them:
//   content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//   ```json
//   ARGUMENTS
//   ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
// Text before the calls' block (and after it) is content; text between the
// calls is dropped. A call exists once its name's line is complete; its
// arguments are the text up to `\n```<｜tool▁call▁end｜>` (the fence
// optional), or to the end of the answer when that is cut short.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mlarun::text {

// Whether `text` is one of the markers (the tokens that DeepSeek-V3's
// tokenizer has for them), so that it reaches the parser when the other
// special tokens are skipped.
bool IsToolCallMarker(std::string_view text);

struct ToolCall {
  std::string name;
  std::string arguments;
};

struct ToolCalls {
  std::string content;
  std::vector<ToolCall> calls;
};

// The whole text at once.
ToolCalls ParseToolCalls(std::string_view text);

// A piece of a call as it streams: the first of each call (`begins`) has
// its name, later ones continue its arguments.
struct ToolCallDelta {
  size_t index = 0;  // the call's place among the answer's calls
  bool begins = false;
  std::string name;  // on the call's first delta only
  std::string arguments;
};

struct ToolCallsDelta {
  std::string content;
  std::vector<ToolCallDelta> calls;
};

// The same over text that arrives in deltas (markers may be cut across
// them). Holds back only a suffix that may still become a marker (and a
// call's name until its line ends). Invariant, for any split of a text:
// the concatenated content, and per call its name and concatenated
// arguments, equal ParseToolCalls(text)'s. Not thread-safe.
class ToolCallParser {
 public:
  ToolCallsDelta Add(std::string_view delta);
  ToolCallsDelta Finish();
  bool called() const { return calls_ > 0; }

 private:
  enum class State { kContent, kBetween, kType, kName, kFence, kArguments, kAfter };
  bool Step(ToolCallsDelta& out);  // one transition; false: needs more text
  void AddArguments(ToolCallsDelta& out, std::string text);
  State state_ = State::kContent;
  std::string held_;
  size_t calls_ = 0;
};

}  // namespace mlarun::text
