// The HTTP API around the Dispatcher. One exchange (an HTTP request) is:
//   parse the JSON body (ParseCompletion, ParseChat: every field's JSON type,
//   the ranges of the fields only this API has; the engine's fields mapped
//   onto SamplingParams and checked by ValidateSamplingParams, the one place
//   of their ranges; a 400 naming the request's field), turn the prompt or
//   the messages into token ids, submit one
//   dispatcher request per choice with a ChoiceOutlet of the exchange, then
//   wait on the exchange's condition variable, turning each choice's tokens
//   into text (IncrementalDecoder, then StopMatcher), and answer: the whole
//   object, or server-sent events.
//
// A streamed answer commits to HTTP 200 only once every choice has a token
// (or an end): an error before that (a full queue, no DP group, a request
// the groups refuse) still gets its own status. Later errors are a
// `data: {"error": ...}` event before `data: [DONE]`.
//
// Connections, limits and deadlines are the transport's (http_server.h);
// this file decides on each request's header (CheckHead: origin, Host,
// token, Content-Type) before its body is read, and answers it on a handler
// thread. A client that goes away (its responder Gone()) has its requests
// cancelled at their groups.
#include "serving/http/openai_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "mlarun.pb.h"
#include "runtime/request/sampling_params.h"
#include "serving/coordinator/dispatcher.h"
#include "serving/http/http_server.h"
#include "serving/http/metrics.h"
#include "serving/http/structured_output_fields.h"
#include "serving/proto/proto_sampling.h"
#include "text/chat_template.h"
#include "text/reasoning_parser.h"
#include "text/tokenizer.h"
#include "text/tool_call_parser.h"

namespace mlarun {
namespace {

// Ordered: a request's objects keep their keys' order into the chat
// template (Python's dicts do), and answers list fields in OpenAI's order.
using json = nlohmann::ordered_json;
using internal::StrCat;

// How often a waiting handler looks whether its client is gone.
constexpr auto kProbeInterval = std::chrono::milliseconds(50);
// Bounds of what one request may ask for.
constexpr int64_t kMaxChoices = 128;       // n
constexpr size_t kMaxStops = 16;           // stop strings
constexpr size_t kMaxPrompts = 1024;       // a batch of prompts
constexpr size_t kMaxRequests = 1024;      // prompts x n: the dispatcher requests of one exchange
constexpr int64_t kDefaultMaxTokens = 16;  // completions, as OpenAI
// The largest token count this API takes: max_tokens (ValidateSamplingParams'
// max_tokens_limit here; the dispatcher checks it against the model's context
// again), min_tokens, and top_k. top_k's bound is this API's alone: the wire's
// top_k is any int64, and a gRPC client may ask for more than the vocabulary
// (all of it).
constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();

// ---- Errors -------------------------------------------------------------------

// An answer that is an OpenAI error object. Thrown only inside this file,
// from the parsing of a request to its reply (the handler catches it).
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // "" -> null
  std::string type = "invalid_request_error";
  std::string code;  // "" -> null
};

json ErrorBody(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", std::move(err)}};
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

ApiError BadField(const std::string& field, const std::string& what) {
  return ApiError{.status = 400, .message = StrCat(field, ": ", what), .param = field};
}

// A dispatcher's final status as the HTTP error OpenAI clients expect.
// `chat`: the prompt is `messages`.
ApiError FromDispatcher(grpc::StatusCode code, const std::string& message, bool chat) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::OUT_OF_RANGE: {
      // The dispatcher names its fields ("prompt_ids[3]: ...",
      // "sampling.max_tokens: ..."); the HTTP request's names are these.
      std::string param;
      if (message.starts_with("prompt_ids")) {
        param = chat ? "messages" : "prompt";
      } else if (message.starts_with("sampling.")) {
        const size_t end = message.find_first_of(":[ ", 9);
        param = message.substr(9, end == std::string::npos ? std::string::npos : end - 9);
      }
      // ... and the message is in the request's terms too.
      std::string said = message.starts_with("sampling.") ? message.substr(9) : message;
      for (size_t at; (at = said.find("prompt_ids")) != std::string::npos;) said.replace(at, 10, "prompt");
      return ApiError{.status = 400, .message = said, .param = param};
    }
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return ApiError{.status = 429, .message = message, .type = "rate_limit_error", .code = "queue_full"};
    case grpc::StatusCode::UNAVAILABLE:
      return ApiError{.status = 503, .message = message, .type = "service_unavailable", .code = "unavailable"};
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return ApiError{.status = 504, .message = message, .type = "timeout", .code = "deadline_exceeded"};
    case grpc::StatusCode::UNAUTHENTICATED:
      return ApiError{.status = 401, .message = message, .type = "authentication_error", .code = "invalid_api_key"};
    default:
      return ApiError{.status = 500, .message = message, .type = "server_error"};
  }
}

// ---- Request bodies -------------------------------------------------------------

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

// The body's field `name`, if present and not null.
const json* Field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

bool GetBool(const json& body, const char* name, bool fallback) {
  const json* v = Field(body, name);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) throw BadField(name, StrCat("must be a boolean, got ", TypeName(*v)));
  return v->get<bool>();
}

// The body's integer `name` (a float with an integral value too, as
// Python's JSON gives 1.0 for 1 sometimes). One beyond int64 (only a
// positive one parses as an integer) reads as INT64_MAX, *beyond set.
std::optional<int64_t> IntField(const json& body, const char* name, bool* beyond) {
  const json* v = Field(body, name);
  *beyond = false;
  if (v == nullptr) return std::nullopt;
  if (v->is_number_integer()) {
    *beyond =
        v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    return *beyond ? std::numeric_limits<int64_t>::max() : v->get<int64_t>();
  }
  if (v->is_number_float() && std::isfinite(v->get<double>()) && std::floor(v->get<double>()) == v->get<double>() &&
      std::fabs(v->get<double>()) < 9e15)
    return static_cast<int64_t>(v->get<double>());
  throw BadField(name, StrCat("must be an integer, got ", TypeName(*v)));
}

// An integer in [lo, hi]: the fields whose range is this API's alone (n,
// best_of, min_tokens, seed).
std::optional<int64_t> GetInt(const json& body, const char* name, int64_t lo, int64_t hi) {
  bool beyond = false;
  const std::optional<int64_t> x = IntField(body, name, &beyond);
  if (beyond) throw BadField(name, StrCat("must be at most ", hi));
  if (x && (*x < lo || *x > hi)) throw BadField(name, StrCat("must be in [", lo, ", ", hi, "], got ", *x));
  return x;
}

// An integer of the engine's (max_tokens, top_k, top_logprobs): its type
// only, its value is ValidateSamplingParams' to check (SamplingError). One
// beyond int64 reads as INT64_MAX, outside each of their ranges.
std::optional<int64_t> GetEngineInt(const json& body, const char* name) {
  bool beyond = false;
  return IntField(body, name, &beyond);
}

std::optional<double> GetNumber(const json& body, const char* name) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) throw BadField(name, StrCat("must be a number, got ", TypeName(*v)));
  const double x = v->get<double>();
  if (!std::isfinite(x)) throw BadField(name, "must be finite");
  return x;
}

std::vector<int32_t> TokenIds(const json& v, const std::string& field) {
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const json& t = v[i];
    if (!t.is_number_integer())
      throw BadField(field, StrCat("element ", i, " must be a token id (an integer), got ", TypeName(t)));
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      throw BadField(field, StrCat("token id ", id, " at ", i, " is out of range"));
    ids.push_back(static_cast<int32_t>(id));
  }
  if (ids.empty()) throw BadField(field, "must not be empty");
  return ids;
}

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

// stream, stream_options, n and best_of: how many choices, and how they come back.
void ParseChoices(const json& body, Params& p) {
  p.stream = GetBool(body, "stream", false);
  if (const json* so = Field(body, "stream_options")) {
    if (!so->is_object()) throw BadField("stream_options", StrCat("must be an object, got ", TypeName(*so)));
    if (!p.stream) throw BadField("stream_options", "only allowed with stream: true");
    p.include_usage = GetBool(*so, "include_usage", false);
  }
  p.n = GetInt(body, "n", 1, kMaxChoices).value_or(1);
  if (std::optional<int64_t> best_of = GetInt(body, "best_of", 1, kMaxChoices); best_of && *best_of != p.n)
    throw BadField("best_of", "only best_of == n is supported (each choice is one sample)");
}

// The engine's fields both endpoints share, into p.sampling: their JSON types
// only. Their values are checked by SamplingError, once the endpoint has
// mapped its own fields (logprobs, echo) too.
void ParseEngineFields(const json& body, Params& p) {
  SamplingParams& s = p.sampling;
  // max_completion_tokens, when present, is the one read (0 only with
  // completions' echo, ParseCompletionFields).
  if (Field(body, "max_completion_tokens") != nullptr) p.max_tokens_field = "max_completion_tokens";
  if (std::optional<int64_t> m = GetEngineInt(body, p.max_tokens_field.c_str())) {
    s.max_tokens = *m;
    p.max_tokens_given = true;
  }
  if (std::optional<double> t = GetNumber(body, "temperature")) s.temperature = *t;
  if (std::optional<double> t = GetNumber(body, "top_p")) s.top_p = *t;
  s.top_k = GetEngineInt(body, "top_k").value_or(0);
  // Any int64, as the wire's uint64 (-1 is 2^64 - 1).
  if (std::optional<int64_t> seed =
          GetInt(body, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()))
    p.seed = static_cast<uint64_t>(*seed);
  if (const json* ids = Field(body, "stop_token_ids")) {
    if (!ids->is_array())
      throw BadField("stop_token_ids", StrCat("must be an array of token ids, got ", TypeName(*ids)));
    for (const json& t : *ids) {
      if (!t.is_number_integer())
        throw BadField("stop_token_ids", StrCat("must hold token ids (integers), got ", TypeName(t)));
      s.stop_token_ids.push_back(t.get<int64_t>());
    }
  }
  s.ignore_eos = GetBool(body, "ignore_eos", false);
  if (const json* salt = Field(body, "cache_salt")) {
    if (!salt->is_string()) throw BadField("cache_salt", StrCat("must be a string, got ", TypeName(*salt)));
    p.cache_salt = salt->get<std::string>();
    if (p.cache_salt.empty()) throw BadField("cache_salt", "must not be empty");
    if (p.cache_salt.size() > kMaxCacheSaltBytes)
      throw BadField("cache_salt", StrCat("at most ", kMaxCacheSaltBytes, " bytes, got ", p.cache_salt.size()));
  }
}

// stop: a string or at most kMaxStops of them (this API matches them in the text).
void ParseStop(const json& body, Params& p) {
  const json* stop = Field(body, "stop");
  if (stop == nullptr) return;
  if (stop->is_string()) {
    p.stop.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    if (stop->size() > kMaxStops) throw BadField("stop", StrCat("at most ", kMaxStops, " strings, got ", stop->size()));
    for (const json& s : *stop) {
      if (!s.is_string())
        throw BadField("stop", StrCat("must be a string or an array of strings, got an array holding ", TypeName(s)));
      p.stop.push_back(s.get<std::string>());
    }
  } else {
    throw BadField("stop", StrCat("must be a string or an array of strings, got ", TypeName(*stop)));
  }
}

// The penalties, logit_bias (token-id strings to numbers) and min_tokens:
// their types here, their values by SamplingError.
void ParsePenalties(const json& body, SamplingParams& s) {
  if (std::optional<double> x = GetNumber(body, "presence_penalty")) s.presence_penalty = *x;
  if (std::optional<double> x = GetNumber(body, "frequency_penalty")) s.frequency_penalty = *x;
  if (std::optional<double> x = GetNumber(body, "repetition_penalty")) s.repetition_penalty = *x;
  s.min_tokens = GetInt(body, "min_tokens", 0, kMaxCount).value_or(0);
  const json* bias = Field(body, "logit_bias");
  if (bias == nullptr) return;
  if (!bias->is_object())
    throw BadField("logit_bias", StrCat("must be an object of token ids to numbers, got ", TypeName(*bias)));
  for (const auto& [key, value] : bias->items()) {
    int64_t id = -1;
    const char* end = key.data() + key.size();
    if (const auto [ptr, ec] = std::from_chars(key.data(), end, id); key.empty() || ec != std::errc() || ptr != end)
      throw BadField("logit_bias", StrCat("keys must be token ids (decimal integers), got \"", key, "\""));
    if (!value.is_number())
      throw BadField("logit_bias", StrCat("the bias of token ", key, " must be a number, got ", TypeName(value)));
    s.logit_bias[id] = value.get<double>();
  }
}

// Fields the engine has no use for: accepted only with the values that ask
// nothing of it (or, for user and model, of the right type).
void ParseUnsupported(const json& body) {
  if (const json* user = Field(body, "user"); user != nullptr && !user->is_string())
    throw BadField("user", StrCat("must be a string, got ", TypeName(*user)));
  if (const json* model = Field(body, "model"); model != nullptr && !model->is_string())
    throw BadField("model", StrCat("must be a string, got ", TypeName(*model)));
}

// Fields common to both endpoints (everything but the prompt), their types.
void ParseSampling(const json& body, Params& p) {
  ParseChoices(body, p);
  ParseEngineFields(body, p);
  ParsePenalties(body, p.sampling);
  ParseStop(body, p);
  p.skip_special_tokens = GetBool(body, "skip_special_tokens", true);
  ParseUnsupported(body);
}

// ValidateSamplingParams on what the request asks of the engine: its error as
// the 400 of the request's own field, nullopt when there is none. Its
// messages start with the SamplingParams field's name, which becomes the
// request's: p.max_tokens_field for max_tokens, `logprobs_field` for
// logprobs and prompt_logprobs. The model's own limits (its vocabulary, its
// context) are the dispatcher's to check, as for every request; max_tokens
// and top_k are at most kMaxCount here.
std::optional<ApiError> SamplingError(const Params& p, const std::string& logprobs_field) {
  SamplingParams s = p.sampling;
  // A chat without max_tokens runs up to the context (Submit): min_tokens is
  // the dispatcher's to check against that.
  if (p.chat && !p.max_tokens_given) s.max_tokens = kMaxCount;
  const Status st = ValidateSamplingParams(s, /*vocab_size=*/std::numeric_limits<int64_t>::max(), kMaxCount);
  if (st.ok()) {
    if (p.sampling.top_k <= kMaxCount) return std::nullopt;
    return BadField("top_k", StrCat("must be at most ", kMaxCount, ", got ", p.sampling.top_k));
  }
  const std::string& message = st.message();
  const size_t end = std::min(message.find_first_of(" ["), message.size());
  std::string field = message.substr(0, end);
  if (field == "max_tokens") {
    field = p.max_tokens_field;
  } else if (field == "logprobs" || field == "prompt_logprobs") {
    field = logprobs_field;
  }
  return ApiError{.status = 400, .message = field + message.substr(end), .param = field};
}

// Completions' own fields but the prompt: logprobs (an integer: the most
// likely tokens beside each), echo (max_tokens 0 only with it), suffix;
// then the engine's fields checked.
void ParseCompletionFields(const json& body, Params& p) {
  if (const json* lp = Field(body, "logprobs")) {
    if (!lp->is_number_integer()) throw BadField("logprobs", StrCat("must be an integer, got ", TypeName(*lp)));
    p.logprobs = true;
    p.sampling.logprobs = lp->get<int64_t>();
  }
  p.echo = GetBool(body, "echo", false);
  // echo with logprobs: the prompt's tokens come with theirs (as vLLM's
  // prompt_logprobs = logprobs), which the group computes from the whole prompt.
  if (p.echo && p.logprobs) p.sampling.prompt_logprobs = p.sampling.logprobs;
  // echo with max_tokens 0: the prompt alone (with its logprobs, if asked),
  // as vLLM: the group generates one token, which is not shown.
  if (p.echo && p.max_tokens_given && p.max_tokens_field == "max_tokens" && p.sampling.max_tokens == 0) {
    p.echo_only = true;
    p.sampling.max_tokens = 1;
  }
  if (std::optional<ApiError> e = SamplingError(p, "logprobs")) {
    if (e->param == "max_tokens" && p.sampling.max_tokens == 0) e->message += " (0 only with echo: the prompt alone)";
    throw *e;
  }
  if (const json* suffix = Field(body, "suffix");
      suffix != nullptr && !(suffix->is_string() && suffix->get<std::string>().empty()))
    throw BadField("suffix", "not supported");
}

// prompt: a string, an array of token ids, or a batch of either.
void ParsePrompt(const json& body, const text::Tokenizer& tokenizer, Params& p) {
  const json* prompt = Field(body, "prompt");
  if (prompt == nullptr) throw BadField("prompt", "required");
  auto add_text = [&](const std::string& text) {
    std::vector<int32_t> ids = tokenizer.Encode(text, /*add_special_tokens=*/true);
    if (ids.empty()) throw BadField("prompt", "must not be empty");
    p.prompts.push_back(std::move(ids));
    if (p.echo) p.echo_texts.push_back(text);
  };
  auto add_ids = [&](const json& arr) {
    p.prompts.push_back(TokenIds(arr, "prompt"));
    if (p.echo) p.echo_texts.push_back(tokenizer.Decode(p.prompts.back(), p.skip_special_tokens));
  };
  if (prompt->is_string()) {
    add_text(prompt->get<std::string>());
  } else if (prompt->is_array()) {
    if (prompt->empty()) throw BadField("prompt", "must not be empty");
    const json& first = (*prompt)[0];
    if (first.is_number_integer()) {
      add_ids(*prompt);
    } else {
      if (prompt->size() > kMaxPrompts)
        throw BadField("prompt", StrCat("a batch of at most ", kMaxPrompts, " prompts, got ", prompt->size()));
      for (const json& one : *prompt) {
        if (one.is_string()) {
          add_text(one.get<std::string>());
        } else if (one.is_array()) {
          add_ids(one);
        } else {
          throw BadField("prompt", StrCat("must be a string, an array of strings, an array of token ids or an array "
                                          "of such arrays; got an array holding ",
                                          TypeName(one)));
        }
      }
    }
  } else {
    throw BadField("prompt",
                   StrCat("must be a string, an array of strings or an array of token ids, got ", TypeName(*prompt)));
  }
}

// response_format, guided_* and structured_outputs (structured_output_fields.h).
void ParseStructured(const json& body, Params& p) {
  try {
    RequestedStructure r = ParseStructuredOutput(body);
    p.sampling.structured = std::move(r.structured);
    p.structured_field = std::move(r.field);
  } catch (const FieldError& e) {
    throw ApiError{.status = 400, .message = e.message, .param = e.field};
  }
}

// vLLM's bad_words: strings, each encoded as vLLM does (text::EncodeBadWords).
void ParseBadWords(const json& body, const text::Tokenizer& tokenizer, Params& p) {
  const json* words = Field(body, "bad_words");
  if (words == nullptr) return;
  if (!words->is_array()) throw BadField("bad_words", StrCat("must be an array of strings, got ", TypeName(*words)));
  std::vector<std::string> texts;
  for (const json& w : *words) {
    if (!w.is_string()) throw BadField("bad_words", StrCat("must hold strings, got ", TypeName(w)));
    texts.push_back(w.get<std::string>());
  }
  for (std::vector<int32_t>& ids : text::EncodeBadWords(tokenizer, texts))
    p.sampling.bad_words.emplace_back(ids.begin(), ids.end());
  if (p.sampling.bad_words.size() > kMaxBadWords)
    throw BadField("bad_words", StrCat("at most ", kMaxBadWords, " token sequences, got ", p.sampling.bad_words.size(),
                                       " from ", texts.size(), " words"));
}

void ParseCompletion(const json& body, const text::Tokenizer& tokenizer, Params& p) {
  ParseStructured(body, p);
  ParseSampling(body, p);
  ParseCompletionFields(body, p);
  ParsePrompt(body, tokenizer, p);
  ParseBadWords(body, tokenizer, p);
}

// A message's content as the templates take it: a string (or null); an
// array of text parts is joined with newlines, as vLLM does.
json MessageContent(const json& content, size_t i) {
  if (content.is_null() || content.is_string()) return content;
  const std::string field = StrCat("messages[", i, "].content");
  if (!content.is_array())
    throw BadField(field, StrCat("must be a string or an array of parts, got ", TypeName(content)));
  std::string joined;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    const std::string at = StrCat(field, "[", j, "]");
    if (!part.is_object()) throw BadField(at, StrCat("must be an object, got ", TypeName(part)));
    auto type = part.find("type");
    if (type == part.end() || !type->is_string() || *type != "text")
      throw BadField(at + ".type", "only 'text' parts are supported");
    auto t = part.find("text");
    if (t == part.end() || !t->is_string()) throw BadField(at + ".text", "must be a string");
    if (!joined.empty()) joined += "\n";
    joined += t->get<std::string>();
  }
  return joined;
}

// Chat's own fields but the messages: logprobs (a boolean: the chosen
// tokens'), top_logprobs (the most likely tokens beside each, only with
// logprobs); the engine's fields checked first.
void ParseChatFields(const json& body, Params& p) {
  p.chat = true;
  p.logprobs = GetBool(body, "logprobs", false);
  const std::optional<int64_t> top = GetEngineInt(body, "top_logprobs");
  p.sampling.logprobs = top.value_or(0);
  if (std::optional<ApiError> e = SamplingError(p, "top_logprobs")) throw *e;
  if (top && *top > 0 && !p.logprobs) throw BadField("top_logprobs", "needs \"logprobs\": true");
}

// tools, each {"type": "function", "function": {"name": ..., ...}}, and
// tool_choice (ParseToolChoice): "none" (the default without tools) gives the
// tools to the template only; "auto" (the default with tools) also parses the
// answer's calls, and needs the server's --enable-auto-tool-choice and
// --tool-call-parser; "required" and a named function constrain the answer to
// ToolChoiceSchema, which becomes the calls (ForcedToolCalls).
void ParseTools(const json& body, bool auto_tool_choice, Params& p) {
  try {
    p.tools = ParseToolsField(body);
    const ToolChoice choice = ParseToolChoice(body, p.tools);
    if (choice.kind == ToolChoice::Kind::kAuto && !auto_tool_choice)
      throw BadField("tool_choice",
                     "\"auto\" needs the server started with --enable-auto-tool-choice and --tool-call-parser "
                     "deepseek_v3; \"none\" gives the tools to the chat template only");
    p.parse_tool_calls = choice.kind == ToolChoice::Kind::kAuto;
    if (choice.kind != ToolChoice::Kind::kRequired && choice.kind != ToolChoice::Kind::kNamed) return;
    if (p.sampling.structured.active())
      throw BadField("tool_choice", StrCat("one structured-output constraint per request: both tool_choice and ",
                                           p.structured_field, " were given"));
    p.sampling.structured = {.kind = StructuredOutput::Kind::kJsonSchema,
                             .spec = Dump(ToolChoiceSchema(choice, p.tools)),
                             .any_whitespace = p.sampling.structured.any_whitespace};
    p.structured_field = "tool_choice";
    p.forced_tools = choice;
  } catch (const FieldError& e) {
    throw ApiError{.status = 400, .message = e.message, .param = e.field};
  }
}

// messages, each an object with a string role and its content as the
// templates take it (MessageContent); other keys as given.
json ChatMessages(const json& body) {
  const json* messages = Field(body, "messages");
  if (messages == nullptr) throw BadField("messages", "required");
  if (!messages->is_array()) throw BadField("messages", StrCat("must be an array, got ", TypeName(*messages)));
  if (messages->empty()) throw BadField("messages", "must not be empty");
  json msgs = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string at = StrCat("messages[", i, "]");
    if (!m.is_object()) throw BadField(at, StrCat("must be an object, got ", TypeName(m)));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) throw BadField(at + ".role", "required, a string");
    json copy = m;
    copy["content"] = MessageContent(m.value("content", json(nullptr)), i);
    msgs.push_back(std::move(copy));
  }
  return msgs;
}

void ParseChat(const json& body, const text::Tokenizer& tokenizer, const text::ChatTemplate* tmpl,
               const std::string& template_error, bool auto_tool_choice, Params& p) {
  ParseStructured(body, p);
  ParseSampling(body, p);
  ParseChatFields(body, p);
  ParseTools(body, auto_tool_choice, p);
  ParseBadWords(body, tokenizer, p);
  json msgs = ChatMessages(body);
  if (tmpl == nullptr) {
    throw ApiError{.status = 400, .message = template_error, .param = "messages", .code = "chat_template_unsupported"};
  }
  json context = {{"messages", std::move(msgs)},
                  {"add_generation_prompt", GetBool(body, "add_generation_prompt", true)},
                  {"bos_token", tokenizer.bos_token()},
                  {"eos_token", tokenizer.eos_token()}};
  if (!p.tools.empty()) context["tools"] = p.tools;
  if (const json* kw = Field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) throw BadField("chat_template_kwargs", StrCat("must be an object, got ", TypeName(*kw)));
    for (auto it = kw->begin(); it != kw->end(); ++it) {
      if (it.key() != "messages") context[it.key()] = it.value();
    }
  }
  StatusOr<std::string> rendered = tmpl->Render(context);
  if (!rendered.ok()) {
    throw ApiError{
        .status = 400,
        .message = StrCat("the model's chat template cannot render these messages: ", rendered.status().message(),
                          "; /v1/completions takes a prompt string rendered by the client instead"),
        .param = "messages",
        .code = "chat_template_error"};
  }
  std::vector<int32_t> ids =
      tokenizer.Encode(*rendered, /*add_special_tokens=*/GetBool(body, "add_special_tokens", false));
  if (ids.empty()) throw BadField("messages", "the rendered conversation has no tokens");
  p.prompts.push_back(std::move(ids));
}

// ---- One exchange: its choices' outlets ------------------------------------------

// What the outlets of one exchange share with its handler thread.
struct ExchangeState {
  struct Slot {
    std::deque<v1::GenerateResponse> events;  // tokens and Finished, as queued
    bool closed = false;                      // the request ended (code, message)
    bool close_seen = false;                  // ... and the handler has taken that in
    grpc::StatusCode code = grpc::StatusCode::OK;
    std::string message;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;  // one per choice; the vector is sized before any outlet exists
};

// One choice's request as the dispatcher sees its client. Queue and Close
// take only the exchange's lock (after the dispatcher's, as its lock order
// allows) and never call back; Flush wakes the handler.
class ChoiceOutlet final : public coord::ClientOutlet {
 public:
  ChoiceOutlet(std::shared_ptr<ExchangeState> state, size_t slot) : state_(std::move(state)), slot_(slot) {}
  void Queue(v1::GenerateResponse msg) override {
    std::lock_guard lock(state_->mu);
    ExchangeState::Slot& s = state_->slots[slot_];
    if (!s.closed) s.events.push_back(std::move(msg));
  }
  void Close(grpc::StatusCode code, std::string message) override {
    std::lock_guard lock(state_->mu);
    ExchangeState::Slot& s = state_->slots[slot_];
    if (s.closed) return;
    s.closed = true;
    s.code = code;
    s.message = std::move(message);
  }
  void Flush() override { state_->cv.notify_all(); }

 private:
  const std::shared_ptr<ExchangeState> state_;
  const size_t slot_;
};

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
           std::string id, std::string model, const HttpResponder& client)
      : dispatcher_(std::move(dispatcher)),
        tokenizer_(tokenizer),
        params_(std::move(params)),
        id_(std::move(id)),
        model_(std::move(model)),
        created_(static_cast<int64_t>(std::time(nullptr))),
        client_(client),
        state_(std::make_shared<ExchangeState>()) {}
  ~Exchange() {
    for (Choice& c : choices_) {
      if (c.accepted && !c.ended) dispatcher_->ClientGone(c.accepted->wire_id, c.accepted->serial);
    }
  }

  const Params& params() const { return params_; }

  // One dispatcher request per choice.
  void Submit(const std::string& principal, double timeout_s, int64_t max_positions) {
    const size_t total = params_.prompts.size() * static_cast<size_t>(params_.n);
    state_->slots.resize(total);
    choices_.resize(total);
    static thread_local std::mt19937_64 rng(std::random_device{}());
    const auto deadline = timeout_s > 0 ? std::chrono::system_clock::now() +
                                              std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                                  std::chrono::duration<double>(timeout_s))
                                        : std::chrono::system_clock::time_point::max();
    for (size_t p = 0; p < params_.prompts.size(); ++p) {
      const std::vector<int32_t>& prompt = params_.prompts[p];
      SamplingParams sampling = params_.sampling;
      if (!params_.max_tokens_given && params_.chat && max_positions > static_cast<int64_t>(prompt.size()))
        sampling.max_tokens = max_positions - static_cast<int64_t>(prompt.size());  // chat: up to the context, as vLLM
      for (int64_t i = 0; i < params_.n; ++i) {
        const size_t k = p * static_cast<size_t>(params_.n) + static_cast<size_t>(i);
        Choice& c = choices_[k];
        c.index = k;
        c.prompt = p;
        c.decoder = std::make_unique<text::IncrementalDecoder>(tokenizer_, params_.skip_special_tokens);
        c.stop = std::make_unique<text::StopMatcher>(params_.stop);
        if (params_.reasoning) c.reasoning = std::make_unique<text::ReasoningParser>();
        if (params_.parse_tool_calls) {
          // The parser sees the calls' markers even where they are special
          // tokens; Take skips the other special tokens, as before.
          c.decoder = std::make_unique<text::IncrementalDecoder>(tokenizer_, false);
          c.tool_calls = std::make_unique<text::ToolCallParser>();
        }
        if (params_.forced_tools.kind != ToolChoice::Kind::kNone)
          c.forced = std::make_unique<ForcedToolCalls>(params_.forced_tools);
        v1::GenerateRequest request;
        // The response's id, for the coordinator's request log (choice k > 0: "-k").
        request.set_request_id(k == 0 ? id_ : StrCat(id_, "-", k));
        request.mutable_prompt_ids()->Assign(prompt.begin(), prompt.end());
        request.set_cache_salt(params_.cache_salt);
        // n choices of one request: seed, seed + 1, ... (reproducible, and
        // distinct when sampling); without a seed, each its own random one.
        sampling.seed = params_.seed ? *params_.seed + static_cast<uint64_t>(i) : rng();
        ToProto(sampling, request.mutable_sampling());
        c.accepted = dispatcher_->Submit(std::make_shared<ChoiceOutlet>(state_, k), request, principal, deadline);
      }
    }
  }

  // Waits for news and takes it in, until `done(choices)` holds or the
  // client goes away (false). Never holds the exchange's lock while calling
  // the dispatcher.
  template <class Done>
  bool WaitUntil(Done done) {
    while (!done()) {
      std::vector<std::pair<size_t, v1::GenerateResponse>> events;
      std::vector<size_t> closed;
      {
        std::unique_lock lock(state_->mu);
        auto news = [&] {
          for (const ExchangeState::Slot& s : state_->slots)
            if (!s.events.empty() || (s.closed && !s.close_seen)) return true;
          return false;
        };
        state_->cv.wait_for(lock, kProbeInterval, news);
        for (size_t k = 0; k < state_->slots.size(); ++k) {
          ExchangeState::Slot& s = state_->slots[k];
          while (!s.events.empty()) {
            events.emplace_back(k, std::move(s.events.front()));
            s.events.pop_front();
          }
          if (s.closed && !s.close_seen) {
            s.close_seen = true;
            closed.push_back(k);
            Choice& c = choices_[k];
            c.code = s.code;
            c.message = s.message;
          }
        }
      }
      if (!events.empty() || !closed.empty()) ++progress_;
      for (auto& [k, msg] : events) Take(choices_[k], msg);
      for (size_t k : closed) {
        Choice& c = choices_[k];
        if (!c.ended) {
          c.ended = true;
          c.failed = true;
          if (c.code == grpc::StatusCode::OK) {
            c.code = grpc::StatusCode::INTERNAL;
            c.message = "the request ended without finishing";
          }
        }
      }
      if (client_.Gone()) return false;
    }
    return true;
  }

  bool AllEnded() const {
    return std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return c.ended; });
  }
  // Every choice has something to show (a token or its end), or one failed.
  bool ReadyToStream() const {
    return AnyFailed() || std::all_of(choices_.begin(), choices_.end(),
                                      [](const Choice& c) { return c.ended || c.completion_tokens > 0; });
  }
  const Choice* AnyFailed() const {
    for (const Choice& c : choices_)
      if (c.failed) return &c;
    return nullptr;
  }
  // Ends the others when one failed (the exchange is answered with its error).
  void CancelLive() {
    for (Choice& c : choices_) {
      if (c.accepted && !c.ended) {
        dispatcher_->ClientGone(c.accepted->wire_id, c.accepted->serial);
        c.ended = true;
      }
    }
  }

  ApiError ErrorOf(const Choice& c) const {
    ApiError e = FromDispatcher(c.code, c.message, params_.chat);
    // A grammar the group could not compile: the request's field that gave it.
    const bool grammar = e.param == "structured" || (e.param.empty() && c.code == grpc::StatusCode::INVALID_ARGUMENT);
    if (grammar && params_.sampling.structured.active()) e.param = params_.structured_field;
    return e;
  }

  // ---- Whole answers ----
  // The answer's JSON, made one choice at a time (each choice's tokens are
  // let go once written): a big answer is held once, as text.
  std::string Whole() {
    json head = {{"id", id_},
                 {"object", params_.chat ? "chat.completion" : "text_completion"},
                 {"created", created_},
                 {"model", model_}};
    std::string out = Dump(head);
    out.pop_back();  // the closing brace: the choices and usage follow
    out += ",\"choices\":[";
    const json usage = Usage();
    for (Choice& c : choices_) {
      if (c.index > 0) out += ',';
      out += Dump(WholeChoice(c));
      c.tokens = {};
      c.prompt_logprobs = {};
    }
    return out + "],\"usage\":" + Dump(usage) + "}";
  }
  json WholeChoice(const Choice& c) const {
    json choice = {{"index", c.index}, {"finish_reason", c.finish_reason}};
    if (params_.return_token_ids) choice["token_ids"] = c.token_ids;
    if (params_.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      if (params_.reasoning) {
        // As vLLM's: null for an empty part.
        choice["message"]["content"] = c.text.empty() ? json(nullptr) : json(c.text);
        choice["message"]["reasoning_content"] = c.reasoning_text.empty() ? json(nullptr) : json(c.reasoning_text);
      }
      if (!c.call_deltas.empty()) {
        choice["message"]["content"] = c.text.empty() ? json(nullptr) : json(c.text);
        choice["message"]["tool_calls"] = WholeToolCalls(c);
      }
      choice["logprobs"] = params_.logprobs ? ChatLogprobs(c.tokens) : json(nullptr);
      return choice;
    }
    choice["text"] = (params_.echo ? params_.echo_texts[c.prompt] : std::string()) + c.text;
    choice["logprobs"] = json(nullptr);
    if (params_.logprobs && params_.echo) {
      // The completion's offsets run on after the prompt tokens' texts
      // (as vLLM's; they may differ from the echo: a BOS has a text).
      int64_t offset = 0;
      json lp = EchoLogprobs(c, offset);
      for (const LogprobEntry& t : c.tokens) AddCompletionToken(lp, t.token.token, &t, offset);
      choice["logprobs"] = std::move(lp);
    } else if (params_.logprobs) {
      choice["logprobs"] = CompletionLogprobs(c.tokens, 0);
    }
    return choice;
  }

  // ---- Streams ----
  // The chunks of everything taken in since the last call (and the final
  // chunks of the choices that ended), as `data: ...\n\n` events.
  std::string Chunks() {
    std::string out;
    for (Choice& c : choices_) {
      if (c.failed || c.finish_sent) continue;
      const bool first = !c.started;
      if (first) {
        // echo with logprobs: the echo's chunk waits for the prompt's
        // logprobs, which come before the first token.
        const bool prompt_complete = c.prompt_logprobs.size() + 1 >= params_.prompts[c.prompt].size();
        if (params_.sampling.prompt_logprobs >= 0 && !prompt_complete && c.completion_tokens == 0 && !c.ended) continue;
        c.started = true;
        if (params_.chat) {
          out += Event(Chunk(c, json{{"role", "assistant"}, {"content", ""}}, json(nullptr), json(nullptr)));
        } else if (params_.echo) {
          out += Event(Chunk(c, params_.echo_texts[c.prompt],
                             params_.logprobs ? EchoLogprobs(c, c.text_offset) : json(nullptr), json(nullptr)));
        }
      }
      const bool finish = c.ended && !c.finish_reason.empty() && !c.finish_sent;
      if (c.text.empty() && c.reasoning_text.empty() && c.call_deltas.empty() && !finish &&
          (c.tokens.empty() || !params_.logprobs) && c.token_ids.empty())
        continue;
      json logprobs = json(nullptr);
      if (params_.logprobs && !c.tokens.empty()) {
        logprobs = params_.chat ? ChatLogprobs(c.tokens) : CompletionLogprobs(c.tokens, c.text_offset);
        for (const LogprobEntry& t : c.tokens) c.text_offset += static_cast<int64_t>(TokenText(t.token.token).size());
      }
      json delta = params_.chat ? (c.text.empty() ? json::object() : json{{"content", c.text}}) : json(c.text);
      if (!c.reasoning_text.empty()) delta["reasoning_content"] = c.reasoning_text;
      if (!c.call_deltas.empty()) delta["tool_calls"] = StreamedToolCalls(c);
      out += Event(Chunk(c, std::move(delta), std::move(logprobs), finish ? json(c.finish_reason) : json(nullptr)));
      c.text.clear();
      c.reasoning_text.clear();
      c.call_deltas.clear();
      c.tokens.clear();
      c.token_ids.clear();
      if (finish) c.finish_sent = true;
    }
    return out;
  }
  std::string Closing() {
    std::string out;
    if (params_.include_usage) {
      out += Event({{"id", id_},
                    {"object", params_.chat ? "chat.completion.chunk" : "text_completion"},
                    {"created", created_},
                    {"model", model_},
                    {"choices", json::array()},
                    {"usage", Usage()}});
    }
    return out + "data: [DONE]\n\n";
  }
  static std::string Event(const json& j) { return "data: " + Dump(j) + "\n\n"; }

  bool WaitForNews() {
    const int64_t before = progress_;
    return WaitUntil([&] { return progress_ != before || AllEnded(); });
  }

 private:
  // Adds one message of the dispatcher to its choice.
  void Take(Choice& c, const v1::GenerateResponse& msg) {
    if (c.ended) return;  // stopped on a stop string: later tokens crossed the cancel
    if (msg.has_prompt_logprobs()) {
      for (const v1::PromptTokenLogprob& e : msg.prompt_logprobs().entries())
        c.prompt_logprobs.push_back(LogprobEntryFrom(e));
    } else if (msg.has_token() && params_.echo_only) {
      // Not shown: the prompt alone was asked for.
    } else if (msg.has_token()) {
      const int32_t id = static_cast<int32_t>(msg.token().token_id());
      ++c.completion_tokens;
      if (params_.logprobs) c.tokens.push_back(LogprobEntryFrom(msg.token()));
      if (params_.return_token_ids) c.token_ids.push_back(id);
      const bool hidden = c.tool_calls != nullptr && params_.skip_special_tokens && tokenizer_.IsSpecial(id) &&
                          !text::IsToolCallMarker(TokenText(id));
      text::StopMatcher::Result r = c.stop->Add(hidden ? std::string() : c.decoder->Add(id));
      AddText(c, r.text, r.stopped);
      if (r.stopped) {
        c.finish_reason = "stop";
        c.ended = true;
        // The rest is not wanted: the group stops generating it.
        dispatcher_->EndEarly(c.accepted->wire_id, c.accepted->serial, "stop");
      }
    } else if (msg.has_finished()) {
      text::StopMatcher::Result r = c.stop->Add(c.decoder->Finish());
      AddText(c, r.text + (r.stopped ? std::string() : c.stop->Finish()), true);
      c.finish_reason = r.stopped ? "stop" : params_.echo_only ? "length" : msg.finished().finish_reason();
      // As vLLM's: an answer that called tools and ended well.
      const bool called = (c.tool_calls != nullptr && c.tool_calls->called()) || (c.forced && c.forced->called());
      if (called && c.finish_reason == "stop") c.finish_reason = "tool_calls";
      c.ended = true;
    }
  }

  // The answer's text after the stop strings, into its parts. `last`: the
  // text ends here.
  static void AddText(Choice& c, const std::string& text, bool last) {
    if (c.reasoning == nullptr) {
      AddContent(c, text, last);
      return;
    }
    text::ReasoningSplit split = c.reasoning->Add(text);
    if (last) {
      text::ReasoningSplit rest = c.reasoning->Finish();
      split.reasoning += rest.reasoning;
      split.content += rest.content;
    }
    c.reasoning_text += split.reasoning;
    AddContent(c, split.content, last);
  }
  // The content after the reasoning, less the tool calls (with
  // Params::parse_tool_calls).
  static void AddContent(Choice& c, const std::string& text, bool last) {
    if (c.tool_calls == nullptr && c.forced == nullptr) {
      c.text += text;
      return;
    }
    text::ToolCallsDelta d =
        c.forced != nullptr ? text::ToolCallsDelta{.calls = c.forced->Add(text)} : c.tool_calls->Add(text);
    if (last && c.tool_calls != nullptr) {
      text::ToolCallsDelta rest = c.tool_calls->Finish();
      d.content += rest.content;
      d.calls.insert(d.calls.end(), rest.calls.begin(), rest.calls.end());
    }
    c.text += d.content;
    for (text::ToolCallDelta& call : d.calls) {
      if (!c.call_deltas.empty() && !call.begins && c.call_deltas.back().index == call.index) {
        c.call_deltas.back().arguments += call.arguments;
      } else {
        c.call_deltas.push_back(std::move(call));
      }
    }
  }
  // A call's id: unique, as the answer's id is.
  std::string CallId(const Choice& c, size_t call) const {
    return StrCat("call_", id_.substr(id_.find('-') + 1), "_", c.index, "_", call);
  }
  // OpenAI's message.tool_calls.
  json WholeToolCalls(const Choice& c) const {
    json calls = json::array();
    for (const text::ToolCallDelta& d : c.call_deltas) {
      if (d.begins) {
        calls.push_back(
            {{"id", CallId(c, d.index)}, {"type", "function"}, {"function", {{"name", d.name}, {"arguments", ""}}}});
      }
      calls[d.index]["function"]["arguments"].get_ref<std::string&>() += d.arguments;
    }
    return calls;
  }
  // delta.tool_calls: a call's index, id, type and name first, then its
  // arguments in pieces.
  json StreamedToolCalls(const Choice& c) const {
    json calls = json::array();
    for (const text::ToolCallDelta& d : c.call_deltas) {
      if (!d.begins) {
        calls.push_back({{"index", d.index}, {"function", {{"arguments", d.arguments}}}});
      } else {
        calls.push_back({{"index", d.index},
                         {"id", CallId(c, d.index)},
                         {"type", "function"},
                         {"function", {{"name", d.name}, {"arguments", d.arguments}}}});
      }
    }
    return calls;
  }

  std::string TokenText(int64_t id) const {
    const int32_t one[1] = {static_cast<int32_t>(id)};
    return tokenizer_.Decode(one, false);
  }
  // OpenAI's chat form: per token its text, logprob and bytes, and
  // top_logprobs the same for the step's most likely tokens (top_logprobs of
  // them; none asked: empty).
  json ChatLogprobs(const std::vector<LogprobEntry>& tokens) const {
    auto entry = [&](const TokenLogprob& t) {
      // bytes: the token's own bytes, so that tokens that split a character
      // (their text a replacement character) join into it again.
      std::vector<int> bytes;
      for (unsigned char ch : tokenizer_.TokenBytes(static_cast<int32_t>(t.token), false)) bytes.push_back(ch);
      return json{{"token", TokenText(t.token)}, {"logprob", t.logprob}, {"bytes", std::move(bytes)}};
    };
    json content = json::array();
    for (const LogprobEntry& tok : tokens) {
      json e = entry(tok.token);
      json top = json::array();
      for (const TokenLogprob& t : tok.top) top.push_back(entry(t));
      e["top_logprobs"] = std::move(top);
      content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}};
  }
  // The completions form. top_logprobs, as vLLM's: per token an object of
  // text -> logprob holding the `logprobs` most likely tokens and the sampled
  // one (so logprobs = 0 gives the sampled token alone). Tokens whose texts
  // coincide (partial UTF-8 sequences) share a key: the likelier one's.
  json CompletionLogprobs(const std::vector<LogprobEntry>& tokens, int64_t offset) const {
    json lp = EmptyCompletionLogprobs();
    for (const LogprobEntry& tok : tokens) AddCompletionToken(lp, tok.token.token, &tok, offset);
    return lp;
  }
  // The prompt's part of echo's completions logprobs: every prompt token's
  // text and offset; its logprob and most likely tokens (as
  // CompletionLogprobs) from the second token on, null for the first (and
  // for any the group did not send). `offset` ends past the last one's text.
  json EchoLogprobs(const Choice& c, int64_t& offset) const {
    json lp = EmptyCompletionLogprobs();
    offset = 0;
    const std::vector<int32_t>& prompt = params_.prompts[c.prompt];
    for (size_t i = 0; i < prompt.size(); ++i)
      AddCompletionToken(lp, prompt[i], i == 0 || i > c.prompt_logprobs.size() ? nullptr : &c.prompt_logprobs[i - 1],
                         offset);
    return lp;
  }
  static json EmptyCompletionLogprobs() {
    return {{"tokens", json::array()},
            {"token_logprobs", json::array()},
            {"top_logprobs", json::array()},
            {"text_offset", json::array()}};
  }
  // Token `id` at `offset` (advanced past its text), with its logprob and
  // most likely tokens when `scored`, else nulls.
  void AddCompletionToken(json& lp, int64_t id, const LogprobEntry* scored, int64_t& offset) const {
    const std::string t = TokenText(id);
    lp["tokens"].push_back(t);
    lp["text_offset"].push_back(offset);
    offset += static_cast<int64_t>(t.size());
    if (scored == nullptr) {
      lp["token_logprobs"].push_back(nullptr);
      lp["top_logprobs"].push_back(nullptr);
      return;
    }
    lp["token_logprobs"].push_back(scored->token.logprob);
    json top = json::object();
    for (const TokenLogprob& other : scored->top)
      top.emplace(TokenText(other.token), other.logprob);  // best first: emplace keeps it
    top.emplace(t, scored->token.logprob);
    lp["top_logprobs"].push_back(std::move(top));
  }
  json Chunk(const Choice& c, json delta, json logprobs, json finish_reason) const {
    json choice = {{"index", c.index}, {"logprobs", std::move(logprobs)}, {"finish_reason", std::move(finish_reason)}};
    choice[params_.chat ? "delta" : "text"] = std::move(delta);
    if (params_.return_token_ids) choice["token_ids"] = c.token_ids;
    json chunk = {{"id", id_},
                  {"object", params_.chat ? "chat.completion.chunk" : "text_completion"},
                  {"created", created_},
                  {"model", model_},
                  {"choices", json::array({std::move(choice)})}};
    if (params_.include_usage) chunk["usage"] = nullptr;  // as OpenAI: every chunk has it, null but the last
    return chunk;
  }
  json Usage() const {
    // The prompt once per prompt of the batch (not per choice), as vLLM.
    int64_t prompt = 0, completion = 0;
    for (const auto& ids : params_.prompts) prompt += static_cast<int64_t>(ids.size());
    for (const Choice& c : choices_) completion += c.completion_tokens;
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
  }

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

// ---- The server --------------------------------------------------------------------

HttpAnswer JsonAnswer(int status, const json& body) {
  return HttpAnswer{.status = status, .content_type = "application/json", .body = Dump(body)};
}

// 429 and 503 tell the client when to come back.
HttpAnswer ErrorAnswer(const ApiError& e) {
  HttpAnswer a = JsonAnswer(e.status, ErrorBody(e));
  if (e.status == 429 || e.status == 503) a.headers.emplace_back("Retry-After", "1");
  return a;
}

// The transport's own refusals, as OpenAI error objects.
HttpAnswer TransportError(int status, std::string_view message) {
  ApiError e{.status = status, .message = std::string(message)};
  switch (status) {
    case 408:
      e.code = "request_timeout";
      break;
    case 413:
      e.code = "request_too_large";
      break;
    case 431:
      e.code = "header_too_large";
      break;
    default:
      if (status >= 500) e.type = "server_error";
  }
  return ErrorAnswer(e);
}

// A Host field's name, without its port: "[::1]:8000" -> "::1".
std::string HostName(const std::string& host) {
  if (host.starts_with('[')) {
    const size_t end = host.find(']');
    return end == std::string::npos ? host : host.substr(1, end - 1);
  }
  const size_t colon = host.find(':');
  return LowerAscii(colon == std::string::npos ? host : host.substr(0, colon));
}

// An address a DNS-rebinding page cannot make a browser send: an IP literal
// or localhost.
bool IsRebindingSafeHost(const std::string& name) {
  if (name == "localhost" || name.ends_with(".localhost")) return true;
  in6_addr v6;
  in_addr v4;
  return inet_pton(AF_INET, name.c_str(), &v4) == 1 || inet_pton(AF_INET6, name.c_str(), &v6) == 1;
}

bool IsGeneration(const HttpRequest& req) {
  return req.method == "POST" && (req.path == "/v1/completions" || req.path == "/v1/chat/completions");
}

// Work for a handler thread rather than the transport's I/O threads: the
// generation requests, and tokenizing, which is CPU work of any length.
bool NeedsHandlerThread(const HttpRequest& req) {
  return IsGeneration(req) || (req.method == "POST" && (req.path == "/tokenize" || req.path == "/detokenize"));
}

// Each logprob entry a whole answer holds costs a few hundred bytes until it
// is sent; a request may ask for this many at most (choices x scored tokens
// x (logprobs + 1)). Streams send theirs as they come and count only the
// echoed prompt's.
constexpr int64_t kMaxLogprobEntries = int64_t{1} << 21;

void CheckAnswerSize(const Params& p) {
  int64_t per_choice = 0;
  int64_t prompt_tokens = 0;
  for (const auto& ids : p.prompts) prompt_tokens = std::max<int64_t>(prompt_tokens, static_cast<int64_t>(ids.size()));
  if (p.sampling.prompt_logprobs >= 0) per_choice += prompt_tokens * (p.sampling.prompt_logprobs + 1);
  if (p.logprobs && !p.stream && p.max_tokens_given) per_choice += p.sampling.max_tokens * (p.sampling.logprobs + 1);
  const int64_t choices = static_cast<int64_t>(p.prompts.size()) * p.n;
  if (per_choice > 0 && per_choice > kMaxLogprobEntries / choices) {
    throw BadField(p.logprobs ? "logprobs" : "echo",
                   StrCat("the answer would hold ", choices, " choices x ", per_choice,
                          " logprob entries, more than this server's bound of ", kMaxLogprobEntries,
                          "; ask for fewer choices, tokens or logprobs, or stream"));
  }
}

// Prompt + completion beyond the model's context (max_len tokens; 0:
// unknown): 400 in vLLM's and OpenAI's words, before anything is submitted.
// Chat without max_tokens takes the context left, so only its prompt counts.
void CheckContextLength(const Params& p, int64_t max_len) {
  if (max_len <= 0) return;
  const char* what = p.chat ? "messages" : "prompt";
  const std::string head =
      StrCat("This model's maximum context length is ", max_len, " tokens. However, you requested ");
  for (const std::vector<int32_t>& ids : p.prompts) {
    const int64_t prompt = static_cast<int64_t>(ids.size());
    if (p.chat && !p.max_tokens_given) {
      if (prompt < max_len) continue;
      throw ApiError{
          .status = 400,
          .message = StrCat(head, prompt, " tokens in the ", what, ". Please reduce the length of the ", what, "."),
          .param = what,
          .code = "context_length_exceeded"};
    }
    const int64_t completion = p.sampling.max_tokens;
    if (prompt + completion <= max_len) continue;
    throw ApiError{.status = 400,
                   .message = StrCat(head, prompt + completion, " tokens (", prompt, " in the ", what, ", ", completion,
                                     " in the completion). Please reduce the length of the ", what, " or completion."),
                   .param = p.max_tokens_given ? p.max_tokens_field : what,
                   .code = "context_length_exceeded"};
  }
}

class HttpApiImpl final : public HttpApi {
 public:
  HttpApiImpl(const HttpApiOptions& options, std::shared_ptr<coord::Dispatcher> dispatcher,
              std::shared_ptr<Metrics> metrics)
      : options_(WithTokenizer(options)), dispatcher_(std::move(dispatcher)), metrics_(std::move(metrics)) {
    LoadTemplate(options_.tokenizer->chat_template());
  }
  ~HttpApiImpl() override { Shutdown(); }

  Status Listen() {
    HttpServer::Hooks hooks;
    hooks.check_head = [this](const HttpRequest& req) { return CheckHead(req); };
    hooks.quick = [](const HttpRequest& req) { return !NeedsHandlerThread(req); };
    hooks.handle = [this](const HttpRequest& req, HttpResponder& res) { Handle(req, res); };
    hooks.error = TransportError;
    hooks.extra_headers = [this](const HttpRequest& req) { return CorsHeaders(req); };
    if (metrics_ != nullptr)
      hooks.answered = [m = metrics_](std::string_view path, int status) { m->OnHttp(path, status); };
    MLARUN_ASSIGN_OR_RETURN(server_, HttpServer::Start(options_.transport, std::move(hooks)));
    return Status::Ok();
  }

  std::string address() const override { return server_->address(); }

  void Shutdown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

 private:
  // Without a tokenizer, one that has no vocabulary: the exchanges' text
  // is then empty (RefuseText keeps text out).
  static HttpApiOptions WithTokenizer(HttpApiOptions o) {
    if (o.skip_tokenizer_init) o.tokenizer = text::NoTokenizer();
    return o;
  }

  // --skip-tokenizer-init: what needs a tokenizer gets 400.
  // `endpoint`: what is refused whole ("" for completions).
  void RefuseText(const json& body, std::string_view endpoint) const {
    if (!options_.skip_tokenizer_init) return;
    constexpr std::string_view kWhy = "the server runs without a tokenizer (--skip-tokenizer-init)";
    if (!endpoint.empty()) throw ApiError{.status = 400, .message = StrCat(endpoint, " needs a tokenizer: ", kWhy)};
    const json* prompt = Field(body, "prompt");
    if (prompt != nullptr &&
        (prompt->is_string() || (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_string())))
      throw BadField("prompt", StrCat("must be token ids (an array of integers, or of such arrays): ", kWhy));
    for (const char* field : {"stop", "bad_words"}) {
      const json* f = Field(body, field);
      if (f != nullptr && !f->is_null() && !(f->is_array() && f->empty()))
        throw BadField(field, StrCat("needs a tokenizer: ", kWhy));
    }
  }

  // The chat template, parsed once; when it cannot be, template_error_ says
  // why (chat requests get it as their 400).
  void LoadTemplate(const std::string& source) {
    constexpr const char* kWayAround = "; /v1/completions takes a prompt string rendered by the client instead";
    if (source.empty()) {
      template_error_ =
          StrCat("the model's tokenizer has no chat template (tokenizer_config.json: chat_template)", kWayAround);
    } else if (auto parsed = text::ChatTemplate::Parse(source); parsed.ok()) {
      template_ = *parsed;
    } else {
      template_error_ = StrCat("the model's chat template cannot be used: ", parsed.status().message(), kWayAround);
    }
  }

  // The principal of the request's bearer token; throws 401 when the API
  // has tokens and the request lacks a good one.
  std::string Authenticate(const HttpRequest& req, bool* details) const {
    if (options_.auth_tokens.empty()) {
      *details = req.peer_loopback;
      return "";
    }
    const std::string* authorization = req.Header("Authorization");
    if (authorization == nullptr)
      throw ApiError{.status = 401,
                     .message =
                         "this server needs an API key: send `Authorization: Bearer TOKEN` with a token of "
                         "the coordinator's --auth-token-file",
                     .type = "authentication_error",
                     .code = "invalid_api_key"};
    const Principal* p = options_.auth_tokens.Authenticate(*authorization);
    if (p == nullptr)
      throw ApiError{.status = 401,
                     .message =
                         "the Authorization header is not `Bearer TOKEN` with a token of the coordinator's "
                         "--auth-token-file",
                     .type = "authentication_error",
                     .code = "invalid_api_key"};
    *details = true;
    return p->name;
  }

  bool OriginAllowed(const std::string& origin) const {
    const auto& allowed = options_.allowed_origins;
    return std::find(allowed.begin(), allowed.end(), "*") != allowed.end() ||
           std::find(allowed.begin(), allowed.end(), origin) != allowed.end();
  }

  HttpHeaders CorsHeaders(const HttpRequest& req) const {
    const std::string* origin = req.Header("Origin");
    if (origin == nullptr || !OriginAllowed(*origin)) return {};
    return {{"Access-Control-Allow-Origin", *origin}, {"Vary", "Origin"}};
  }

  // On the header alone, before the body is read: the origin, the Host (an
  // open server answers only names a rebinding page cannot use), the token,
  // and an open server's Content-Type (a page can POST text/plain without a
  // preflight, never application/json).
  std::optional<HttpAnswer> CheckHead(const HttpRequest& req) const {
    if (req.path == "/health" && req.method == "GET") return std::nullopt;
    try {
      if (const std::string* origin = req.Header("Origin"); origin != nullptr && !OriginAllowed(*origin))
        throw ApiError{.status = 403,
                       .message = StrCat("requests from web pages of origin '", *origin,
                                         "' are refused; the server takes them with --allowed-origins"),
                       .type = "permission_error",
                       .code = "origin_not_allowed"};
      if (req.method == "OPTIONS") return std::nullopt;  // a preflight carries no token
      const bool open = options_.auth_tokens.empty();
      if (const std::string* host = req.Header("Host"); open && host != nullptr) {
        const std::string name = HostName(*host);
        const auto& allowed = options_.allowed_hosts;
        if (!IsRebindingSafeHost(name) && std::find(allowed.begin(), allowed.end(), name) == allowed.end() &&
            std::find(allowed.begin(), allowed.end(), "*") == allowed.end())
          throw ApiError{.status = 403,
                         .message = StrCat("Host '", *host,
                                           "' is not this server's: a server without API tokens answers IP "
                                           "addresses and localhost, and the names of --allowed-hosts"),
                         .type = "permission_error",
                         .code = "host_not_allowed"};
      }
      bool details = false;
      Authenticate(req, &details);
      if (open && req.method == "POST") {
        const std::string* type = req.Header("Content-Type");
        const std::string media = type == nullptr ? "" : LowerAscii(type->substr(0, type->find(';')));
        if (media.find_first_not_of(' ') == std::string::npos ||
            media.substr(media.find_first_not_of(' '), 16) != "application/json")
          throw ApiError{.status = 415,
                         .message = StrCat("the request body must be sent as `Content-Type: application/json`, got '",
                                           type == nullptr ? "" : *type, "'"),
                         .code = "unsupported_media_type"};
      }
    } catch (const ApiError& e) {
      return ErrorAnswer(e);
    }
    return std::nullopt;
  }

  void Handle(const HttpRequest& req, HttpResponder& res) {
    try {
      Route(req, res);
    } catch (const ApiError& e) {
      res.Reply(ErrorAnswer(e));
    } catch (const json::exception& e) {
      res.Reply(ErrorAnswer(ApiError{.status = 400, .message = StrCat("the request body: ", e.what())}));
    } catch (const std::exception& e) {
      res.Reply(ErrorAnswer(ApiError{.status = 500, .message = e.what(), .type = "server_error"}));
    }
  }

  void Route(const HttpRequest& req, HttpResponder& res) {
    struct Path {
      const char* path;
      const char* method;
    };
    static constexpr Path kPaths[] = {{"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"},
                                      {"/v1/models", "GET"},       {"/v1/models/", "GET"},  // and a model's id
                                      {"/tokenize", "POST"},       {"/detokenize", "POST"},
                                      {"/version", "GET"},         {"/health", "GET"},
                                      {"/metrics", "GET"}};
    const Path* known = nullptr;
    for (const Path& p : kPaths)
      if (req.path == p.path || (req.path.starts_with("/v1/models/") && std::string_view(p.path) == "/v1/models/"))
        known = &p;
    if (known == nullptr)
      throw ApiError{
          .status = 404, .message = StrCat("no such path: ", req.method, " ", req.path), .code = "not_found"};
    if (req.method == "OPTIONS") {
      res.Reply(HttpAnswer{.status = 204,
                           .content_type = "",
                           .headers = {{"Access-Control-Allow-Methods", StrCat(known->method, ", OPTIONS")},
                                       {"Access-Control-Allow-Headers", "Authorization, Content-Type"},
                                       {"Access-Control-Max-Age", "600"}}});
      return;
    }
    const bool head_of_get = req.method == "HEAD" && std::string_view(known->method) == "GET";
    if (req.method != known->method && !head_of_get) {
      ApiError e{.status = 405, .message = StrCat(req.path, " takes ", known->method, ", not ", req.method)};
      HttpAnswer a = ErrorAnswer(e);
      a.headers.emplace_back("Allow", StrCat(known->method, ", OPTIONS"));
      res.Reply(std::move(a));
      return;
    }
    const std::string_view path = req.path;
    if (path == "/v1/completions") return Generate(req, res, /*chat=*/false);
    if (path == "/v1/chat/completions") return Generate(req, res, /*chat=*/true);
    if (path == "/v1/models") return res.Reply(Models(req));
    if (path.starts_with("/v1/models/")) return res.Reply(Model(path.substr(11)));
    if (path == "/tokenize") return res.Reply(Tokenize(req));
    if (path == "/detokenize") return res.Reply(Detokenize(req));
    if (path == "/version") return res.Reply(JsonAnswer(200, {{"version", MLARUN_VERSION}}));
    if (path == "/health") return res.Reply(Health());
    res.Reply(MetricsPage(req));
  }

  json ModelCard() const {
    json model = {{"id", options_.served_model_name},
                  {"object", "model"},
                  {"created", started_},
                  {"owned_by", "mlarun"},
                  {"root", options_.served_model_name}};
    if (const int64_t max_pos = dispatcher_->model_limits().max_position_embeddings; max_pos > 0)
      model["max_model_len"] = max_pos;
    return model;
  }

  HttpAnswer Models(const HttpRequest& req) const {
    bool details = false;
    Authenticate(req, &details);
    return JsonAnswer(200, {{"object", "list"}, {"data", json::array({ModelCard()})}});
  }

  // GET /v1/models/{id}: the served model's card, 404 for another id.
  HttpAnswer Model(std::string_view id) const {
    if (id != options_.served_model_name) throw ModelNotFound(std::string(id));
    return JsonAnswer(200, ModelCard());
  }

  ApiError ModelNotFound(const std::string& name) const {
    return ApiError{.status = 404,
                    .message = StrCat("The model `", name, "` does not exist; this server serves `",
                                      options_.served_model_name, "`"),
                    .param = "model",
                    .code = "model_not_found"};
  }

  // POST /tokenize, as vLLM's: a prompt (add_special_tokens, default true)
  // or chat messages rendered by the template (add_generation_prompt,
  // default true; add_special_tokens, default false).
  HttpAnswer Tokenize(const HttpRequest& req) const {
    const json body = BodyOf(req);
    RefuseText(body, "/tokenize");
    std::vector<int32_t> ids;
    if (Field(body, "messages") != nullptr) {
      Params p;
      ParseChat(body, *options_.tokenizer, template_.get(), template_error_,
                options_.enable_auto_tool_choice && !options_.tool_call_parser.empty(), p);
      ids = std::move(p.prompts[0]);
    } else {
      const json* prompt = Field(body, "prompt");
      if (prompt == nullptr) throw BadField("prompt", "required (or messages)");
      if (!prompt->is_string()) throw BadField("prompt", StrCat("must be a string, got ", TypeName(*prompt)));
      ids = options_.tokenizer->Encode(prompt->get<std::string>(), GetBool(body, "add_special_tokens", true));
    }
    const int64_t max_len = dispatcher_->model_limits().max_position_embeddings;
    json answer = {{"count", ids.size()},
                   {"max_model_len", max_len > 0 ? json(max_len) : json(nullptr)},
                   {"tokens", ids},
                   {"token_strs", nullptr}};
    if (GetBool(body, "return_token_strs", false)) {
      json strs = json::array();
      for (const int32_t id : ids) strs.push_back(options_.tokenizer->IdToToken(id).value_or(""));
      answer["token_strs"] = std::move(strs);
    }
    return JsonAnswer(200, answer);
  }

  // POST /detokenize, as vLLM's: the tokens' text, special tokens included.
  HttpAnswer Detokenize(const HttpRequest& req) const {
    const json body = BodyOf(req);
    RefuseText(body, "/detokenize");
    const json* tokens = Field(body, "tokens");
    if (tokens == nullptr) throw BadField("tokens", "required");
    if (!tokens->is_array()) throw BadField("tokens", StrCat("must be an array of token ids, got ", TypeName(*tokens)));
    std::vector<int32_t> ids;
    if (!tokens->empty()) ids = TokenIds(*tokens, "tokens");
    const int64_t vocab = options_.tokenizer->vocab_size();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= vocab)
        throw BadField("tokens", StrCat("token id ", ids[i], " at ", i, " is outside the vocabulary (", vocab, ")"));
    }
    return JsonAnswer(200, {{"prompt", options_.tokenizer->Decode(ids, /*skip_special_tokens=*/false)}});
  }

  HttpAnswer Health() const {
    v1::HealthResponse h;
    dispatcher_->FillHealth(&h);
    const bool ok = h.serving() && h.groups_connected() > 0;
    HttpAnswer a = JsonAnswer(ok ? 200 : 503,
                              {{"status", ok ? "ok" : "unavailable"}, {"dp_groups_connected", h.groups_connected()}});
    if (!ok) a.headers.emplace_back("Retry-After", "1");
    return a;
  }

  HttpAnswer MetricsPage(const HttpRequest& req) const {
    bool details = false;
    Authenticate(req, &details);
    if (metrics_ == nullptr) throw ApiError{.status = 404, .message = "metrics are off", .code = "not_found"};
    v1::GetStatsResponse stats;
    dispatcher_->FillStats(&stats, true);
    return HttpAnswer{.status = 200,
                      .content_type = "text/plain; version=0.0.4; charset=utf-8",
                      .body = metrics_->Render(stats, dispatcher_->live_requests(), details)};
  }

  // The request's JSON object, naming this server's model if any.
  json BodyOf(const HttpRequest& req) const {
    json body;
    try {
      body = json::parse(req.body);
    } catch (const json::parse_error& e) {
      throw ApiError{.status = 400, .message = StrCat("the request body is not valid JSON: ", e.what())};
    }
    if (!body.is_object()) throw ApiError{.status = 400, .message = "the request body must be a JSON object"};
    if (const json* model = Field(body, "model");
        model != nullptr && model->is_string() && model->get<std::string>() != options_.served_model_name)
      throw ModelNotFound(model->get<std::string>());
    return body;
  }

  Params ParseBody(const HttpRequest& req, bool chat) const {
    const json body = BodyOf(req);
    RefuseText(body, chat ? "chat completion" : "");
    Params params;
    params.return_token_ids = options_.skip_tokenizer_init || GetBool(body, "return_token_ids", false);
    if (chat) {
      ParseChat(body, *options_.tokenizer, template_.get(), template_error_,
                options_.enable_auto_tool_choice && !options_.tool_call_parser.empty(), params);
      // A constrained answer has no reasoning part: the grammar holds from its first token.
      params.reasoning = options_.reasoning_parser == "deepseek_r1" && !params.sampling.structured.active();
    } else {
      ParseCompletion(body, *options_.tokenizer, params);
    }
    if (params.prompts.size() * static_cast<size_t>(params.n) > kMaxRequests)
      throw BadField(
          "n", StrCat("prompts x n must be at most ", kMaxRequests, ", got ", params.prompts.size(), " x ", params.n));
    CheckAnswerSize(params);
    return params;
  }

  void Generate(const HttpRequest& req, HttpResponder& res, bool chat) {
    bool details = false;
    const std::string principal = Authenticate(req, &details);
    Params params = ParseBody(req, chat);
    CheckContextLength(params, dispatcher_->model_limits().max_position_embeddings);
    const std::string id = (chat ? "chatcmpl-" : "cmpl-") + NewRandomRequestId().substr(4);
    Exchange exchange(dispatcher_, *options_.tokenizer, std::move(params), id, options_.served_model_name, res);
    exchange.Submit(principal, options_.request_timeout_s, dispatcher_->model_limits().max_position_embeddings);
    const bool stream = exchange.params().stream;
    // A stream commits to 200 once every choice has shown something.
    const bool waited = stream ? exchange.WaitUntil([&] { return exchange.ReadyToStream(); })
                               : exchange.WaitUntil([&] { return exchange.AllEnded() || exchange.AnyFailed(); });
    if (!waited) return;  // the client went away
    if (const Choice* failed = exchange.AnyFailed()) {
      const ApiError e = exchange.ErrorOf(*failed);
      exchange.CancelLive();
      throw e;
    }
    if (!stream) {
      res.Reply(HttpAnswer{.status = 200, .content_type = "application/json", .body = exchange.Whole()});
      return;
    }
    if (!res.StartStream(200, "text/event-stream", {{"Cache-Control", "no-cache"}})) return;
    for (;;) {
      if (!res.Write(exchange.Chunks())) return;
      if (const Choice* failed = exchange.AnyFailed()) {
        const json err = ErrorBody(exchange.ErrorOf(*failed));
        exchange.CancelLive();
        if (res.Write(Exchange::Event(err)) && res.Write("data: [DONE]\n\n")) res.End();
        return;
      }
      if (exchange.AllEnded()) {
        if (res.Write(exchange.Closing())) res.End();
        return;
      }
      if (!exchange.WaitForNews()) return;  // the client went away
    }
  }

  const HttpApiOptions options_;
  const std::shared_ptr<coord::Dispatcher> dispatcher_;
  const std::shared_ptr<Metrics> metrics_;
  const int64_t started_ = static_cast<int64_t>(std::time(nullptr));
  std::shared_ptr<const text::ChatTemplate> template_;  // nullptr: template_error_ says why
  std::string template_error_;
  std::unique_ptr<HttpServer> server_;
};

}  // namespace

StatusOr<std::unique_ptr<HttpApi>> HttpApi::Start(const HttpApiOptions& options,
                                                  std::shared_ptr<coord::Dispatcher> dispatcher,
                                                  std::shared_ptr<Metrics> metrics) {
  if (options.tokenizer == nullptr && !options.skip_tokenizer_init)
    return InvalidArgumentError("http: a tokenizer is required (--model)");
  if (!(options.request_timeout_s >= 0) || !std::isfinite(options.request_timeout_s))
    return InvalidArgumentError("http_request_timeout_s: must be >= 0 and finite, got ", options.request_timeout_s);
  if (options.served_model_name.empty()) return InvalidArgumentError("served_model_name: must not be empty");
  if (!options.reasoning_parser.empty() && options.reasoning_parser != "deepseek_r1")
    return InvalidArgumentError("reasoning_parser: only deepseek_r1 is known, got ", options.reasoning_parser);
  if (!options.tool_call_parser.empty() && options.tool_call_parser != "deepseek_v3")
    return InvalidArgumentError("tool_call_parser: only deepseek_v3 is known, got ", options.tool_call_parser);
  auto impl = std::make_unique<HttpApiImpl>(options, std::move(dispatcher), std::move(metrics));
  MLARUN_RETURN_IF_ERROR(impl->Listen());
  return std::unique_ptr<HttpApi>(std::move(impl));
}

}  // namespace mlarun
