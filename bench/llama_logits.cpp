// The logits llama.cpp computes for given token ids, for
// `mlarun bench accuracy --llama-logits`: every position of every sequence,
// teacher-forced, each sequence from an empty cache, as mlarun runs them.
//
//   llama_logits MODEL.gguf IDS_FILE OUT THREADS
//
// IDS_FILE is what `mlarun bench accuracy --write-ids` writes
// ("mlarun-accuracy-ids 1", "sequence_length L", "positions N", N ids).
// Writes OUT: raw little-endian f32 [N, vocab], row p the logits after id p;
// and OUT.ids: the ids it evaluated, in the same format. No BOS is added and
// nothing is tokenized. llama_cpp_compare.sh and accuracy_compare.sh build it
// against the vendored llama.cpp they built.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

struct Ids {
  long sequence_length = 0;
  std::vector<llama_token> ids;
};

bool ReadIds(const std::string& path, Ids* out) {
  std::ifstream is(path);
  std::string magic, key_l, key_n;
  long version = 0, positions = 0;
  if (!(is >> magic >> version >> key_l >> out->sequence_length >> key_n >> positions) ||
      magic != "mlarun-accuracy-ids" || version != 1 || key_l != "sequence_length" || key_n != "positions" ||
      out->sequence_length <= 0 || positions <= 0 || positions % out->sequence_length != 0) {
    std::fprintf(stderr, "%s: not an ids file of mlarun bench accuracy --write-ids (or N not a multiple of L)\n",
                 path.c_str());
    return false;
  }
  long v = 0;
  while (is >> v) out->ids.push_back(static_cast<llama_token>(v));
  if (static_cast<long>(out->ids.size()) != positions) {
    std::fprintf(stderr, "%s: says %ld positions, holds %zu ids\n", path.c_str(), positions, out->ids.size());
    return false;
  }
  return true;
}

bool WriteIds(const std::string& path, const Ids& ids) {
  std::ofstream os(path);
  os << "mlarun-accuracy-ids 1\nsequence_length " << ids.sequence_length << "\npositions " << ids.ids.size() << "\n";
  for (size_t i = 0; i < ids.ids.size(); ++i) os << ids.ids[i] << ((i + 1) % 16 == 0 ? '\n' : ' ');
  os << "\n";
  return static_cast<bool>(os.flush());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf IDS_FILE OUT THREADS\n", argv[0]);
    return 2;
  }
  const std::string model_path = argv[1], ids_path = argv[2], out_path = argv[3];
  const int threads = std::atoi(argv[4]);
  Ids ids;
  if (threads < 1 || !ReadIds(ids_path, &ids)) return 2;
  const int L = static_cast<int>(ids.sequence_length);

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", model_path.c_str());
    return 1;
  }
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  for (const llama_token t : ids.ids) {
    if (t < 0 || t >= n_vocab) {
      std::fprintf(stderr, "id %d outside the model's vocabulary of %d\n", t, n_vocab);
      return 1;
    }
  }

  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(L);
  cp.n_batch = static_cast<uint32_t>(L);
  cp.n_ubatch = static_cast<uint32_t>(L);
  cp.n_seq_max = 1;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot create a context of %d tokens\n", L);
    return 1;
  }

  std::FILE* out = std::fopen(out_path.c_str(), "wb");
  if (out == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
    return 1;
  }
  llama_batch batch = llama_batch_init(L, 0, 1);
  const size_t sequences = ids.ids.size() / static_cast<size_t>(L);
  for (size_t s = 0; s < sequences; ++s) {
    llama_memory_clear(llama_get_memory(ctx), true);  // every sequence from an empty cache
    batch.n_tokens = L;
    for (int i = 0; i < L; ++i) {
      batch.token[i] = ids.ids[s * static_cast<size_t>(L) + static_cast<size_t>(i)];
      batch.pos[i] = i;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = 1;
    }
    if (llama_decode(ctx, batch) != 0) {
      std::fprintf(stderr, "llama_decode failed on sequence %zu\n", s);
      return 1;
    }
    for (int i = 0; i < L; ++i) {
      const float* row = llama_get_logits_ith(ctx, i);
      if (row == nullptr ||
          std::fwrite(row, sizeof(float), static_cast<size_t>(n_vocab), out) != static_cast<size_t>(n_vocab)) {
        std::fprintf(stderr, "no logits for position %d of sequence %zu, or writing %s failed\n", i, s,
                     out_path.c_str());
        return 1;
      }
    }
    std::fprintf(stderr, "sequence %zu/%zu done\n", s + 1, sequences);
  }
  if (std::fclose(out) != 0 || !WriteIds(out_path + ".ids", ids)) {
    std::fprintf(stderr, "writing %s failed\n", out_path.c_str());
    return 1;
  }
  std::printf("{\"positions\": %zu, \"vocab\": %d, \"sequence_length\": %d}\n", ids.ids.size(), n_vocab, L);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
