// SamplingParams between the wire (mlarun.proto) and the engine, in one place
// for every process that speaks the protocol: the worker, the simulated
// worker, the coordinator and the client. It only forward-declares the
// generated message, so including it pulls in neither protobuf nor gRPC.
#pragma once

#include <span>

#include "runtime/request/sampling_params.h"

namespace mlarun {
namespace v1 {
class SamplingParams;
class StructuredOutput;
class TokenEvent;
class PromptTokenLogprob;
class Token;
}  // namespace v1

// Absent optional fields (top_p, max_tokens, repetition_penalty) take
// SamplingParams{}'s values, the one default of the whole system. No
// validation: see ValidateSamplingParams.
SamplingParams FromProto(const v1::SamplingParams& p);

// Sets every field, the optional ones included, so the receiver never has to
// guess what was meant.
void ToProto(const SamplingParams& p, v1::SamplingParams* out);

// StructuredOutput both ways; an unset oneof is Kind::kNone.
StructuredOutput FromProto(const v1::StructuredOutput& p);
void ToProto(const StructuredOutput& s, v1::StructuredOutput* out);

// Appends `top` (the most likely tokens, best first) to the message's top_logprobs.
void AddTopLogprobs(std::span<const TokenLogprob> top, v1::TokenEvent* out);
void AddTopLogprobs(std::span<const TokenLogprob> top, v1::PromptTokenLogprob* out);
// A generated token, or a prompt token, with its most likely tokens.
LogprobEntry LogprobEntryFrom(const v1::Token& t);
LogprobEntry LogprobEntryFrom(const v1::PromptTokenLogprob& t);

}  // namespace mlarun
