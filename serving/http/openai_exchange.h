// internal to serving/http; the API is openai_server.h.
// One exchange of the HTTP API: a dispatcher request per choice, each with
// an outlet of the exchange, and their tokens turned into the answer's text
// (IncrementalDecoder, then StopMatcher), whole or as server-sent events.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mlarun.pb.h"
#include "serving/coordinator/dispatcher.h"
#include "serving/http/http_server.h"
#include "serving/http/openai_request.h"
#include "serving/http/structured_output_fields.h"
#include "text/reasoning_parser.h"
#include "text/tokenizer.h"
#include "text/tool_call_parser.h"

namespace mlarun::openai {

// What the outlets of one exchange share with its handler thread
// (openai_exchange.cc).
struct ExchangeState;

// Where one choice's text stands.
struct Choice {
  size_t index = 0;                                     // the choice's index in the answer
  size_t prompt = 0;                                    // which prompt of the batch
  std::optional<coord::Dispatcher::Accepted> accepted;  // nullopt: rejected at Submit
  std::unique_ptr<text::IncrementalDecoder> decoder;
  std::unique_ptr<text::StopMatcher> stop;
  std::unique_ptr<text::ReasoningParser> reasoning;  // with Params::reasoning
  std::string text;                                  // not yet sent (streams) or all of it (whole answers)
  std::string reasoning_text;                        // the same, of the reasoning (with Params::reasoning)
  std::unique_ptr<text::ToolCallParser> tool_calls;  // with Params::parse_tool_calls
  std::unique_ptr<ForcedToolCalls> forced;           // with Params::forced_tools
  std::vector<text::ToolCallDelta> call_deltas;      // not yet sent (streams) or all (whole answers)
  bool started = false;                              // a stream's first chunk (role, echo) was sent
  std::vector<LogprobEntry> tokens;                  // not yet sent with logprobs (streams), or all
  std::vector<LogprobEntry> prompt_logprobs;         // prompt tokens 1, 2, ... (echo with logprobs)
  int64_t completion_tokens = 0;
  std::vector<int64_t> token_ids;  // with Params::return_token_ids: not yet sent (streams), or all
  std::string finish_reason;       // set when it ended well
  bool ended = false;              // finished, stopped or failed: nothing more comes
  bool failed = false;
  bool finish_sent = false;  // a stream's final chunk of this choice is out
  int64_t text_offset = 0;   // a stream's completions logprobs: offset of the next token's text
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
};

// One exchange from submission to its last byte. Owned by the handler,
// then by the stream's content provider; its destructor cancels whatever
// is still live (the client went away, a write failed, the server stops).
class Exchange {
 public:
  Exchange(std::shared_ptr<coord::Dispatcher> dispatcher, const text::Tokenizer& tokenizer, Params params,
           std::string id, std::string model, const HttpResponder& client);
  ~Exchange();

  const Params& params() const { return params_; }

  // One dispatcher request per choice.
  void Submit(const std::string& principal, double timeout_s, int64_t max_positions);

  // Waits for news and takes it in, until `done(choices)` holds or the
  // client goes away (false). Never holds the exchange's lock while calling
  // the dispatcher.
  bool WaitUntil(const std::function<bool()>& done);

  bool AllEnded() const;
  // Every choice has something to show (a token or its end), or one failed.
  bool ReadyToStream() const;
  const Choice* AnyFailed() const;
  // Ends the others when one failed (the exchange is answered with its error).
  void CancelLive();

  ApiError ErrorOf(const Choice& c) const;

  // ---- Whole answers ----
  // The answer's JSON, made one choice at a time (each choice's tokens are
  // let go once written): a big answer is held once, as text.
  std::string Whole();
  json WholeChoice(const Choice& c) const;

  // ---- Streams ----
  // The chunks of everything taken in since the last call (and the final
  // chunks of the choices that ended), as `data: ...\n\n` events.
  std::string Chunks();
  std::string Closing();
  static std::string Event(const json& j);

  bool WaitForNews();

 private:
  // Adds one message of the dispatcher to its choice.
  void Take(Choice& c, const v1::GenerateResponse& msg);

  // The answer's text after the stop strings, into its parts. `last`: the
  // text ends here.
  static void AddText(Choice& c, const std::string& text, bool last);
  // The content after the reasoning, less the tool calls (with
  // Params::parse_tool_calls).
  static void AddContent(Choice& c, const std::string& text, bool last);
  // A call's id: unique, as the answer's id is.
  std::string CallId(const Choice& c, size_t call) const;
  // OpenAI's message.tool_calls.
  json WholeToolCalls(const Choice& c) const;
  // delta.tool_calls: a call's index, id, type and name first, then its
  // arguments in pieces.
  json StreamedToolCalls(const Choice& c) const;

  std::string TokenText(int64_t id) const;
  // OpenAI's chat form: per token its text, logprob and bytes, and
  // top_logprobs the same for the step's most likely tokens (top_logprobs of
  // them; none asked: empty).
  json ChatLogprobs(const std::vector<LogprobEntry>& tokens) const;
  // The completions form. top_logprobs, as vLLM's: per token an object of
  // text -> logprob holding the `logprobs` most likely tokens and the sampled
  // one (so logprobs = 0 gives the sampled token alone). Tokens whose texts
  // coincide (partial UTF-8 sequences) share a key: the likelier one's.
  json CompletionLogprobs(const std::vector<LogprobEntry>& tokens, int64_t offset) const;
  // The prompt's part of echo's completions logprobs: every prompt token's
  // text and offset; its logprob and most likely tokens (as
  // CompletionLogprobs) from the second token on, null for the first (and
  // for any the group did not send). `offset` ends past the last one's text.
  json EchoLogprobs(const Choice& c, int64_t& offset) const;
  static json EmptyCompletionLogprobs();
  // Token `id` at `offset` (advanced past its text), with its logprob and
  // most likely tokens when `scored`, else nulls.
  void AddCompletionToken(json& lp, int64_t id, const LogprobEntry* scored, int64_t& offset) const;
  json Chunk(const Choice& c, json delta, json logprobs, json finish_reason) const;
  json Usage() const;

  const std::shared_ptr<coord::Dispatcher> dispatcher_;
  const text::Tokenizer& tokenizer_;
  const Params params_;
  const std::string id_;
  const std::string model_;
  const int64_t created_;
  const HttpResponder& client_;
  const std::shared_ptr<ExchangeState> state_;
  std::vector<Choice> choices_;
  int64_t progress_ = 0;  // rounds of WaitUntil that took something in
};

}  // namespace mlarun::openai
