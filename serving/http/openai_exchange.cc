// One exchange of the HTTP API (openai_exchange.h).
#include "serving/http/openai_exchange.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <mutex>
#include <random>
#include <utility>

#include "serving/proto/proto_sampling.h"

namespace mlarun::openai {

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

namespace {

using internal::StrCat;

// How often a waiting handler looks whether its client is gone.
constexpr auto kProbeInterval = std::chrono::milliseconds(50);

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

}  // namespace

Exchange::Exchange(std::shared_ptr<coord::Dispatcher> dispatcher, const text::Tokenizer& tokenizer, Params params,
                   std::string id, std::string model, const HttpResponder& client)
    : dispatcher_(std::move(dispatcher)),
      tokenizer_(tokenizer),
      params_(std::move(params)),
      id_(std::move(id)),
      model_(std::move(model)),
      created_(static_cast<int64_t>(std::time(nullptr))),
      client_(client),
      state_(std::make_shared<ExchangeState>()) {}

Exchange::~Exchange() {
  for (Choice& c : choices_) {
    if (c.accepted && !c.ended) dispatcher_->ClientGone(c.accepted->wire_id, c.accepted->serial);
  }
}

void Exchange::Submit(const std::string& principal, double timeout_s, int64_t max_positions) {
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

bool Exchange::WaitUntil(const std::function<bool()>& done) {
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

bool Exchange::AllEnded() const {
  return std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return c.ended; });
}

bool Exchange::ReadyToStream() const {
  return AnyFailed() || std::all_of(choices_.begin(), choices_.end(),
                                    [](const Choice& c) { return c.ended || c.completion_tokens > 0; });
}

const Choice* Exchange::AnyFailed() const {
  for (const Choice& c : choices_)
    if (c.failed) return &c;
  return nullptr;
}

void Exchange::CancelLive() {
  for (Choice& c : choices_) {
    if (c.accepted && !c.ended) {
      dispatcher_->ClientGone(c.accepted->wire_id, c.accepted->serial);
      c.ended = true;
    }
  }
}

ApiError Exchange::ErrorOf(const Choice& c) const {
  ApiError e = FromDispatcher(c.code, c.message, params_.chat);
  // A grammar the group could not compile: the request's field that gave it.
  const bool grammar = e.param == "structured" || (e.param.empty() && c.code == grpc::StatusCode::INVALID_ARGUMENT);
  if (grammar && params_.sampling.structured.active()) e.param = params_.structured_field;
  return e;
}

std::string Exchange::Whole() {
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

json Exchange::WholeChoice(const Choice& c) const {
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

std::string Exchange::Chunks() {
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

std::string Exchange::Closing() {
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

std::string Exchange::Event(const json& j) { return "data: " + Dump(j) + "\n\n"; }

bool Exchange::WaitForNews() {
  const int64_t before = progress_;
  return WaitUntil([&] { return progress_ != before || AllEnded(); });
}

void Exchange::Take(Choice& c, const v1::GenerateResponse& msg) {
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

void Exchange::AddText(Choice& c, const std::string& text, bool last) {
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

void Exchange::AddContent(Choice& c, const std::string& text, bool last) {
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

std::string Exchange::CallId(const Choice& c, size_t call) const {
  return StrCat("call_", id_.substr(id_.find('-') + 1), "_", c.index, "_", call);
}

json Exchange::WholeToolCalls(const Choice& c) const {
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

json Exchange::StreamedToolCalls(const Choice& c) const {
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

std::string Exchange::TokenText(int64_t id) const {
  const int32_t one[1] = {static_cast<int32_t>(id)};
  return tokenizer_.Decode(one, false);
}

json Exchange::ChatLogprobs(const std::vector<LogprobEntry>& tokens) const {
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

json Exchange::CompletionLogprobs(const std::vector<LogprobEntry>& tokens, int64_t offset) const {
  json lp = EmptyCompletionLogprobs();
  for (const LogprobEntry& tok : tokens) AddCompletionToken(lp, tok.token.token, &tok, offset);
  return lp;
}

json Exchange::EchoLogprobs(const Choice& c, int64_t& offset) const {
  json lp = EmptyCompletionLogprobs();
  offset = 0;
  const std::vector<int32_t>& prompt = params_.prompts[c.prompt];
  for (size_t i = 0; i < prompt.size(); ++i)
    AddCompletionToken(lp, prompt[i], i == 0 || i > c.prompt_logprobs.size() ? nullptr : &c.prompt_logprobs[i - 1],
                       offset);
  return lp;
}

json Exchange::EmptyCompletionLogprobs() {
  return {{"tokens", json::array()},
          {"token_logprobs", json::array()},
          {"top_logprobs", json::array()},
          {"text_offset", json::array()}};
}

void Exchange::AddCompletionToken(json& lp, int64_t id, const LogprobEntry* scored, int64_t& offset) const {
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

json Exchange::Chunk(const Choice& c, json delta, json logprobs, json finish_reason) const {
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

json Exchange::Usage() const {
  // The prompt once per prompt of the batch (not per choice), as vLLM.
  int64_t prompt = 0, completion = 0;
  for (const auto& ids : params_.prompts) prompt += static_cast<int64_t>(ids.size());
  for (const Choice& c : choices_) completion += c.completion_tokens;
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

}  // namespace mlarun::openai
