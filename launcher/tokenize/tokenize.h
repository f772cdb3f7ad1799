// `mlarun tokenize`: the tokenizer of a model from the command line.
// launcher/commands/tokenize.cc parses the flags into these options and returns
// the function's exit code.
#pragma once

#include <iosfwd>
#include <string>

namespace mlarun::text {

struct TokenizeOptions {
  // What Tokenizer::Load takes: a model YAML (its tokenizer: key), a
  // checkpoint or tokenizer directory, or a tokenizer.json. Required.
  std::string model;
  // false: each input line is a JSON string, each output line the JSON array
  // of its ids. true: each input line is a JSON array of ids, each output
  // line the JSON string they decode to.
  bool decode = false;
  // Encoding: the post-processor's tokens (bos) as transformers'
  // add_special_tokens. Default: true.
  bool add_special_tokens = true;
  // Decoding: special tokens left out. Default: false.
  bool skip_special_tokens = false;
};

// Reads `in` line by line until its end and writes one line to `out` for
// each input line, so line n of the output answers line n of the input. A
// line that cannot be read (not a JSON string, or not an array of integers
// when decoding) gets {"error": "line N: ..."} in its place and the run goes
// on. Returns 0 when every line succeeded, 1 when some failed, 2 when the
// tokenizer does not load (the message on `err`). Blocks on `in`; not
// thread-safe with respect to its streams.
int RunTokenize(const TokenizeOptions& options, std::istream& in, std::ostream& out, std::ostream& err);

}  // namespace mlarun::text
