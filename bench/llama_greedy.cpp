// Greedy decoding from token ids with llama.cpp, for comparing tokens with
// `mlarun generate --prompt-ids ... --json`. No BOS is added and nothing is
// tokenized: the prompt is the ids given.
//
//   llama_greedy MODEL.gguf THREADS MAX_TOKENS ID[,ID...]
//
// Prints {"tokens": [...]} on stdout (llama.cpp's log goes to stderr).
// llama_cpp_compare.sh builds it against the vendored llama.cpp it built.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf THREADS MAX_TOKENS ID[,ID...]\n", argv[0]);
    return 2;
  }
  const std::string path = argv[1];
  const int threads = std::atoi(argv[2]);
  const int max_tokens = std::atoi(argv[3]);
  std::vector<llama_token> prompt;
  {
    std::stringstream ss(argv[4]);
    std::string item;
    while (std::getline(ss, item, ',')) prompt.push_back(static_cast<llama_token>(std::atoi(item.c_str())));
  }
  if (prompt.empty() || max_tokens < 1 || threads < 1) {
    std::fprintf(stderr, "need a non-empty prompt, MAX_TOKENS >= 1 and THREADS >= 1\n");
    return 2;
  }

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(path.c_str(), mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", path.c_str());
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);

  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(prompt.size() + max_tokens + 16);
  cp.n_batch = cp.n_ctx;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot create a context\n");
    return 1;
  }

  std::vector<llama_token> out;
  std::vector<llama_token> feed = prompt;
  for (int step = 0; step < max_tokens; ++step) {
    if (llama_decode(ctx, llama_batch_get_one(feed.data(), static_cast<int32_t>(feed.size()))) != 0) {
      std::fprintf(stderr, "llama_decode failed at step %d\n", step);
      return 1;
    }
    const float* logits = llama_get_logits_ith(ctx, -1);
    int best = 0;
    for (int i = 1; i < n_vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    out.push_back(best);
    feed.assign(1, best);
  }

  std::printf("{\"tokens\": [");
  for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? ", " : "", out[i]);
  std::printf("]}\n");
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
