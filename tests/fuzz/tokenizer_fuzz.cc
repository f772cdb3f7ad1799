// Fuzz target: the tokenizer. The first byte picks what the rest is:
//   even: text for the tiny model's tokenizer (configs/models/tiny-tokenizer),
//         with the invariants a client relies on checked (abort on a breach):
//         ids in the vocabulary; Decode(Encode(x)) is x as repaired UTF-8
//         (without special tokens added or skipped); streaming the ids through
//         an IncrementalDecoder gives the same text in whole characters; a
//         StopMatcher over those deltas never returns a stop string and
//         returns all the text when none occurs;
//   odd:  a tokenizer.json to load (refused or loaded, never a crash), whose
//         encode of a fixed text must decode to that text.
// MLARUN_FUZZ_ROOT is the source tree (set by the fuzz and corpus builds).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "text/tokenizer.h"
#include "text/utf8.h"

namespace {

const mlarun::text::Tokenizer& Tiny() {
  static const std::unique_ptr<mlarun::text::Tokenizer> tok = [] {
    auto loaded = mlarun::text::Tokenizer::Load(MLARUN_FUZZ_ROOT "/configs/models/tiny-tokenizer");
    if (!loaded.ok()) {
      std::fprintf(stderr, "tokenizer_fuzz: %s\n", loaded.status().ToString().c_str());
      std::abort();
    }
    return std::move(*loaded);
  }();
  return *tok;
}

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "tokenizer_fuzz: invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t pick = data[0];
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (pick % 2 == 1) {
    auto tok = mlarun::text::Tokenizer::FromJson(rest, "");
    if (tok.ok()) {
      const std::string text = "Hello, world 123 \xe4\xbd\xa0\xe5\xa5\xbd\n";
      (void)(*tok)->Decode((*tok)->Encode(text, true), false);
    }
    return 0;
  }
  const mlarun::text::Tokenizer& tok = Tiny();
  const std::vector<int32_t> ids = tok.Encode(rest, /*add_special_tokens=*/pick % 4 == 0);
  for (int32_t id : ids) Check(id >= 0 && id < tok.vocab_size(), "an id outside the vocabulary");
  if (pick % 4 == 2)
    Check(tok.Decode(ids, /*skip_special_tokens=*/false) == mlarun::text::utf8::Lossy(rest),
          "Decode(Encode(x)) != x repaired");
  const std::string whole = tok.Decode(ids, /*skip_special_tokens=*/true);
  mlarun::text::IncrementalDecoder stream(tok, /*skip_special_tokens=*/true);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string delta = stream.Add(id);
    Check(mlarun::text::utf8::IsValid(delta), "a delta that is not whole UTF-8 characters");
    streamed += delta;
  }
  streamed += stream.Finish();
  Check(streamed == whole, "the streamed text differs from Decode");
  // A stop string taken from the input's own bytes (when long enough).
  const std::string stop = rest.size() > 6 ? mlarun::text::utf8::Lossy(rest.substr(rest.size() / 3, 3)) : "\x01\x02";
  mlarun::text::StopMatcher matcher({stop});
  std::string sent;
  bool stopped = false;
  for (size_t i = 0; i < whole.size() && !stopped; i += 1 + (pick >> 4)) {
    const auto r = matcher.Add(std::string_view(whole).substr(i, 1 + (pick >> 4)));
    sent += r.text;
    stopped = r.stopped;
  }
  if (!stopped) sent += matcher.Finish();
  const size_t at = whole.find(stop);
  if (at == std::string::npos) {
    Check(!stopped && sent == whole, "text lost without a stop string");
  } else {
    Check(stopped && sent == whole.substr(0, at), "not exactly the text before the first stop string");
  }
  return 0;
}
