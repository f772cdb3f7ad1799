// internal to serving/http; the API is openai_server.h.
// The parsing of a completion or chat request's body into Params (ParseCompletion,
// ParseChat): every field's JSON type, the ranges of the fields only this API has;
// the engine's fields mapped onto SamplingParams and checked by
// ValidateSamplingParams; a 400 naming the request's field (ApiError).
#pragma once

#include <grpcpp/support/status_code_enum.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "runtime/request/sampling_params.h"
#include "serving/http/structured_output_fields.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace mlarun::openai {

// Ordered: a request's objects keep their keys' order into the chat
// template (Python's dicts do), and answers list fields in OpenAI's order.
using json = nlohmann::ordered_json;

inline constexpr int64_t kDefaultMaxTokens = 16;  // completions, as OpenAI

// ---- Errors -------------------------------------------------------------------

// An answer that is an OpenAI error object. Thrown only inside the HTTP
// API (openai_*.cc), from the parsing of a request to its reply (the handler catches it).
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // "" -> null
  std::string type = "invalid_request_error";
  std::string code;  // "" -> null
};

json ErrorBody(const ApiError& e);

std::string Dump(const json& j);

ApiError BadField(const std::string& field, const std::string& what);

// A dispatcher's final status as the HTTP error OpenAI clients expect.
// `chat`: the prompt is `messages`.
ApiError FromDispatcher(grpc::StatusCode code, const std::string& message, bool chat);

// ---- Request bodies -------------------------------------------------------------

const char* TypeName(const json& v);

// The body's field `name`, if present and not null.
const json* Field(const json& body, const char* name);

bool GetBool(const json& body, const char* name, bool fallback);

std::vector<int32_t> TokenIds(const json& v, const std::string& field);

// What a completion or chat request asks for, checked.
struct Params {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  std::vector<std::vector<int32_t>> prompts;  // token ids, one per prompt of the batch
  std::vector<std::string> echo_texts;        // per prompt, when `echo`
  int64_t n = 1;
  // What every choice asks of the engine, checked by ValidateSamplingParams
  // (SamplingError). Submit sets each choice's seed, and a chat's max_tokens
  // when the request gives none. temperature: 1 unless given, as OpenAI's.
  // logprobs: the most likely tokens beside each generated one (completions'
  // logprobs, chat's top_logprobs); prompt_logprobs: completions' echo with
  // logprobs, the prompt's too, with this many beside each.
  SamplingParams sampling{.temperature = 1.0, .max_tokens = kDefaultMaxTokens};
  bool max_tokens_given = false;
  std::string max_tokens_field = "max_tokens";  // the request's name of sampling.max_tokens
  std::optional<uint64_t> seed;                 // none: each choice a random one
  std::vector<std::string> stop;
  bool logprobs = false;  // the chosen tokens' logprobs
  bool echo = false;
  bool echo_only = false;  // echo with max_tokens 0: the prompt alone; the one token generated is not shown
  bool skip_special_tokens = true;
  std::string cache_salt;         // vLLM's: narrows prefix-cache sharing (GenerateRequest.cache_salt)
  bool reasoning = false;         // chat: split the answer's reasoning out (--reasoning-parser deepseek_r1)
  json tools = json::array();     // chat: the request's tools, for the template
  bool parse_tool_calls = false;  // chat: tool_choice "auto" with --tool-call-parser
  ToolChoice forced_tools;        // chat: "required" or a named function (kRequired, kNamed)
  std::string structured_field;   // the request's field of sampling.structured
  bool return_token_ids = false;  // vLLM's: each choice's token_ids too (always without a tokenizer)
};

void ParseCompletion(const json& body, const text::Tokenizer& tokenizer, Params& p);

void ParseChat(const json& body, const text::Tokenizer& tokenizer, const text::ChatTemplate* tmpl,
               const std::string& template_error, bool auto_tool_choice, Params& p);

}  // namespace mlarun::openai
