#include "bench/tokenize_bench.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "text/tokenizer.h"
#include "text/utf8.h"

namespace mlarun::text {

using nlohmann::json;

int RunTokenizeBench(const TokenizeBenchOptions& options, std::ostream& out, std::ostream& err) {
  auto tok = Tokenizer::Load(options.model);
  if (!tok.ok()) {
    err << "mlarun bench tokenize: " << tok.status() << "\n";
    return 2;
  }
  const Tokenizer& t = **tok;
  std::ifstream f(options.text_file, std::ios::binary);
  if (!f) {
    err << "mlarun bench tokenize: cannot read " << options.text_file << "\n";
    return 2;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  if (options.mode != "whole" && options.mode != "lines") {
    err << "mlarun bench tokenize: mode must be whole or lines, not '" << options.mode << "'\n";
    return 2;
  }
  if (options.threads < 1) {
    err << "mlarun bench tokenize: threads must be at least 1, not " << options.threads << "\n";
    return 2;
  }
  std::vector<std::string_view> lines;
  if (options.mode == "lines") {
    size_t start = 0;
    while (start < text.size()) {
      size_t nl = text.find('\n', start);
      const size_t end = nl == std::string::npos ? text.size() : nl + 1;
      lines.push_back(std::string_view(text).substr(start, end - start));
      start = end;
    }
  } else {
    lines.push_back(text);
  }
  auto encode_once = [&] {
    size_t tokens = 0;
    for (std::string_view l : lines) tokens += t.Encode(l, false).size();
    return tokens;
  };
  // Every thread encodes the whole text; the tokens are summed.
  auto encode_all = [&] {
    if (options.threads == 1) return encode_once();
    std::vector<size_t> counts(options.threads, 0);
    std::vector<std::thread> pool;
    for (int k = 0; k < options.threads; ++k) pool.emplace_back([&, k] { counts[k] = encode_once(); });
    for (std::thread& th : pool) th.join();
    size_t tokens = 0;
    for (size_t c : counts) tokens += c;
    return tokens;
  };

  // Verify, then time.
  if (utf8::IsValid(text)) {
    for (std::string_view l : lines) {
      const std::vector<int32_t> ids = t.Encode(l, false);
      if (t.Decode(ids, false) != l) {
        err << "mlarun bench tokenize: Decode(Encode(text)) differs from the text\n";
        return 2;
      }
    }
  }
  size_t tokens = 0;
  for (int i = 0; i < options.warmup_runs; ++i) tokens = encode_all();
  std::vector<double> seconds;
  for (int i = 0; i < std::max(1, options.runs); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    tokens = encode_all();
    const auto t1 = std::chrono::steady_clock::now();
    seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median =
      sorted.size() % 2 ? sorted[sorted.size() / 2] : (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]) / 2;
  const double tokens_per_s = double(tokens) / median;
  const size_t bytes = text.size() * size_t(options.threads);
  const double mb_per_s = double(bytes) / 1e6 / median;
  if (options.json) {
    out << json{{"model", options.model}, {"text_file", options.text_file},
                {"mode", options.mode},   {"bytes", bytes},
                {"tokens", tokens},       {"threads", options.threads},
                {"median_s", median},     {"tokens_per_s", tokens_per_s},
                {"mb_per_s", mb_per_s},   {"runs_s", seconds}}
               .dump()
        << "\n";
  } else {
    out << "tokenize " << options.mode << ": " << bytes << " bytes, " << tokens << " tokens, " << options.threads
        << (options.threads == 1 ? " thread\n" : " threads\n") << "median " << median << " s over " << seconds.size()
        << " runs: " << tokens_per_s << " tokens/s, " << mb_per_s << " MB/s\n";
  }
  return 0;
}

}  // namespace mlarun::text
