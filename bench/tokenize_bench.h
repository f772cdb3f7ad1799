// `mlarun bench tokenize` (and the tokenizer_bench binary): encoding speed of
// a model's tokenizer on one thread or several sharing it. launcher/commands/bench.cc parses the
// flags into these options and returns the function's exit code.
#pragma once

#include <iosfwd>
#include <string>

namespace mlarun::text {

struct TokenizeBenchOptions {
  std::string model;      // as TokenizeOptions::model. Required.
  std::string text_file;  // the text to encode. Required.
  // "whole": the file is one Encode call; "lines": one Encode call per line
  // (newline kept with its line). Default: "whole".
  std::string mode = "whole";
  int warmup_runs = 1;  // untimed runs first (they also fill the word cache)
  int runs = 5;         // timed runs; the median is reported
  // Threads encoding the whole text each, at once, on the one tokenizer; a
  // run's tokens and bytes are the sum over them. At least 1.
  int threads = 1;
  bool json = false;  // one JSON object on `out` in place of the text report
};

// Encodes the text on `threads` threads: first a check that Decode gives the
// text back (when it is valid UTF-8), then `warmup_runs` untimed and `runs`
// timed encodes. Reports bytes, tokens, the median seconds, tokens/s and MB/s
// (10^6 bytes), and every run's seconds. Returns 0, or 2 on a load, read or
// check failure or bad options (message on `err`).
int RunTokenizeBench(const TokenizeBenchOptions& options, std::ostream& out, std::ostream& err);

}  // namespace mlarun::text
