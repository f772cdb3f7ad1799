// Parsing a request's body (openai_request.h).
#include "serving/http/openai_request.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <system_error>
#include <utility>

#include "serving/http/structured_output_fields.h"
#include "serving/security/security.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace mlarun::openai {
namespace {

using internal::StrCat;

// Bounds of what one request may ask for.
constexpr int64_t kMaxChoices = 128;  // n
constexpr size_t kMaxStops = 16;      // stop strings
constexpr size_t kMaxPrompts = 1024;  // a batch of prompts
// The largest token count this API takes: max_tokens (ValidateSamplingParams'
// max_tokens_limit here; the dispatcher checks it against the model's context
// again), min_tokens, and top_k. top_k's bound is this API's alone: the wire's
// top_k is any int64, and a gRPC client may ask for more than the vocabulary
// (all of it).
constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();

}  // namespace

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

void ParseCompletion(const json& body, const text::Tokenizer& tokenizer, Params& p) {
  ParseStructured(body, p);
  ParseSampling(body, p);
  ParseCompletionFields(body, p);
  ParsePrompt(body, tokenizer, p);
  ParseBadWords(body, tokenizer, p);
}

namespace {

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

}  // namespace

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

}  // namespace mlarun::openai
