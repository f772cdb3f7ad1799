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
// The parsing is openai_request.h's, the exchange openai_exchange.h's; this
// file is the server around them.
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
#include <cmath>
#include <ctime>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mlarun.pb.h"
#include "serving/coordinator/dispatcher.h"
#include "serving/http/http_server.h"
#include "serving/http/metrics.h"
#include "serving/http/openai_exchange.h"
#include "serving/http/openai_request.h"
#include "text/chat_template.h"
#include "text/reasoning_parser.h"
#include "text/tokenizer.h"

namespace mlarun {
namespace {

using internal::StrCat;
using openai::ApiError;
using openai::BadField;
using openai::Choice;
using openai::Dump;
using openai::ErrorBody;
using openai::Exchange;
using openai::Field;
using openai::GetBool;
using openai::json;
using openai::Params;
using openai::ParseChat;
using openai::ParseCompletion;
using openai::TokenIds;
using openai::TypeName;

constexpr size_t kMaxRequests = 1024;  // prompts x n: the dispatcher requests of one exchange

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
      params.reasoning = options_.reasoning_parser == "deepseek_r1";
      StructuredOutput& so = params.sampling.structured;
      // As in vLLM the reasoning stays free; the grammar holds for the content after its end marker.
      if (params.reasoning && so.active()) {
        for (const int32_t id : options_.tokenizer->Encode(text::kReasoningEnd, false)) so.start_after.push_back(id);
        // No ids (no tokenizer): the grammar holds from the first token, so there is no reasoning part.
        params.reasoning = !so.start_after.empty();
      }
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
