// tokenizer_bench: RunTokenizeBench without the mlarun binary.
//   tokenizer_bench <model> <text file> [--mode whole|lines] [--runs N] [--warmup N] [--threads N] [--json]
#include <cstdlib>
#include <iostream>
#include <string>

#include "bench/tokenize_bench.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tokenizer_bench <model> <text file> [--mode whole|lines] [--runs N] [--warmup N] [--threads "
                 "N] [--json]\n";
    return 2;
  }
  mlarun::text::TokenizeBenchOptions o{.model = argv[1], .text_file = argv[2]};
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      o.json = true;
    } else if (a == "--mode" && i + 1 < argc) {
      o.mode = argv[++i];
    } else if (a == "--runs" && i + 1 < argc) {
      o.runs = std::atoi(argv[++i]);
    } else if (a == "--warmup" && i + 1 < argc) {
      o.warmup_runs = std::atoi(argv[++i]);
    } else if (a == "--threads" && i + 1 < argc) {
      o.threads = std::atoi(argv[++i]);
    } else {
      std::cerr << "tokenizer_bench: unknown argument " << a << "\n";
      return 2;
    }
  }
  return mlarun::text::RunTokenizeBench(o, std::cout, std::cerr);
}
