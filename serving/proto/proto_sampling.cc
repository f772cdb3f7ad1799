#include "serving/proto/proto_sampling.h"

#include "mlarun.pb.h"

namespace mlarun {

SamplingParams FromProto(const v1::SamplingParams& p) {
  SamplingParams s;  // the defaults of absent fields
  s.temperature = p.temperature();
  s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  s.seed = p.seed();
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.ignore_eos = p.ignore_eos();
  s.logprobs = p.logprobs();
  s.prompt_logprobs = p.has_prompt_logprobs() ? p.prompt_logprobs() : -1;
  s.presence_penalty = p.presence_penalty();
  s.frequency_penalty = p.frequency_penalty();
  if (p.has_repetition_penalty()) s.repetition_penalty = p.repetition_penalty();
  s.logit_bias.insert(p.logit_bias().begin(), p.logit_bias().end());
  s.min_tokens = p.min_tokens();
  if (p.has_structured()) s.structured = FromProto(p.structured());
  for (const v1::TokenIds& word : p.bad_words()) s.bad_words.emplace_back(word.ids().begin(), word.ids().end());
  return s;
}

StructuredOutput FromProto(const v1::StructuredOutput& p) {
  using Kind = StructuredOutput::Kind;
  StructuredOutput s;
  switch (p.kind_case()) {
    case v1::StructuredOutput::kJsonObject:
      if (p.json_object()) s.kind = Kind::kJsonObject;
      break;
    case v1::StructuredOutput::kJsonSchema:
      s.kind = Kind::kJsonSchema;
      s.spec = p.json_schema();
      break;
    case v1::StructuredOutput::kRegex:
      s.kind = Kind::kRegex;
      s.spec = p.regex();
      break;
    case v1::StructuredOutput::kChoice:
      s.kind = Kind::kChoice;
      s.choices.assign(p.choice().choice().begin(), p.choice().choice().end());
      break;
    case v1::StructuredOutput::kGrammar:
      s.kind = Kind::kGrammar;
      s.spec = p.grammar();
      break;
    case v1::StructuredOutput::KIND_NOT_SET:
      break;
  }
  if (p.has_any_whitespace()) s.any_whitespace = p.any_whitespace();
  s.start_after.assign(p.start_after_token_ids().begin(), p.start_after_token_ids().end());
  return s;
}

void ToProto(const StructuredOutput& s, v1::StructuredOutput* out) {
  using Kind = StructuredOutput::Kind;
  out->Clear();
  switch (s.kind) {
    case Kind::kNone:
      return;
    case Kind::kJsonObject:
      out->set_json_object(true);
      break;
    case Kind::kJsonSchema:
      out->set_json_schema(s.spec);
      break;
    case Kind::kRegex:
      out->set_regex(s.spec);
      break;
    case Kind::kChoice:
      out->mutable_choice()->mutable_choice()->Add(s.choices.begin(), s.choices.end());
      break;
    case Kind::kGrammar:
      out->set_grammar(s.spec);
      break;
  }
  out->set_any_whitespace(s.any_whitespace);
  out->mutable_start_after_token_ids()->Add(s.start_after.begin(), s.start_after.end());
}

void ToProto(const SamplingParams& p, v1::SamplingParams* out) {
  out->set_temperature(p.temperature);
  out->set_top_k(p.top_k);
  out->set_top_p(p.top_p);
  out->set_seed(p.seed);
  out->set_max_tokens(p.max_tokens);
  out->clear_stop_token_ids();
  out->mutable_stop_token_ids()->Add(p.stop_token_ids.begin(), p.stop_token_ids.end());
  out->set_ignore_eos(p.ignore_eos);
  out->set_logprobs(p.logprobs);
  if (p.prompt_logprobs >= 0) {
    out->set_prompt_logprobs(p.prompt_logprobs);
  } else {
    out->clear_prompt_logprobs();
  }
  out->set_presence_penalty(p.presence_penalty);
  out->set_frequency_penalty(p.frequency_penalty);
  out->set_repetition_penalty(p.repetition_penalty);
  out->mutable_logit_bias()->clear();
  out->mutable_logit_bias()->insert(p.logit_bias.begin(), p.logit_bias.end());
  out->set_min_tokens(p.min_tokens);
  out->clear_bad_words();
  for (const std::vector<int64_t>& word : p.bad_words)
    out->add_bad_words()->mutable_ids()->Add(word.begin(), word.end());
  if (p.structured.active()) {
    ToProto(p.structured, out->mutable_structured());
  } else {
    out->clear_structured();
  }
}

namespace {

template <typename Message>
LogprobEntry EntryFrom(const Message& m) {
  LogprobEntry e{.token = {m.token_id(), m.logprob()}, .top = {}};
  for (const v1::TokenLogprob& t : m.top_logprobs()) e.top.push_back({t.token_id(), t.logprob()});
  return e;
}

template <typename Message>
void AddTop(std::span<const TokenLogprob> top, Message* out) {
  for (const TokenLogprob& t : top) {
    v1::TokenLogprob* e = out->add_top_logprobs();
    e->set_token_id(t.token);
    e->set_logprob(t.logprob);
  }
}

}  // namespace

void AddTopLogprobs(std::span<const TokenLogprob> top, v1::TokenEvent* out) { AddTop(top, out); }
void AddTopLogprobs(std::span<const TokenLogprob> top, v1::PromptTokenLogprob* out) { AddTop(top, out); }
LogprobEntry LogprobEntryFrom(const v1::Token& t) { return EntryFrom(t); }
LogprobEntry LogprobEntryFrom(const v1::PromptTokenLogprob& t) { return EntryFrom(t); }

}  // namespace mlarun
