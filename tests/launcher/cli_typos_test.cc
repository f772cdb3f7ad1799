#include "launcher/cli_typos.h"

#include <gtest/gtest.h>

#include "base/suggest.h"

namespace mlarun {
namespace {

// A small command line shaped like mlarun's: subcommands, a nested one,
// options with one value, a vector option, flags.
struct Cli {
  CLI::App app{"test"};
  std::string model, parallel;
  std::vector<std::string> extra;
  bool json = false;
  Cli() {
    auto* gen = app.add_subcommand("generate");
    gen->add_option("--model", model);
    gen->add_option("--prompt-ids", extra)->delimiter(',');
    gen->add_flag("--json", json);
    auto* serve = app.add_subcommand("serve");
    serve->add_option("--model", model);
    serve->add_option("--worker-arg", extra);
    auto* bench = app.add_subcommand("bench");
    auto* attn = bench->add_subcommand("attention");
    attn->add_option("--parallel", parallel);
    app.require_subcommand(1);
  }
  std::optional<std::string> Typo(std::vector<const char*> words) {
    words.insert(words.begin(), "mlarun");
    return FindTypo(app, static_cast<int>(words.size()), words.data());
  }
};

TEST(EditDistance, CountsEdits) {
  EXPECT_EQ(EditDistance("", ""), 0u);
  EXPECT_EQ(EditDistance("abc", ""), 3u);
  EXPECT_EQ(EditDistance("generat", "generate"), 1u);
  EXPECT_EQ(EditDistance("modle", "model"), 2u);  // a swap is two substitutions
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
}

TEST(NearestName, ClosestWithinTheBoundOrNone) {
  const std::vector<std::string> names{"generate", "serve", "submit", "stats"};
  EXPECT_EQ(NearestName("generat", names), "generate");
  EXPECT_EQ(NearestName("serv", names), "serve");
  EXPECT_EQ(NearestName("gen", names), "generate");  // an abbreviation
  EXPECT_EQ(NearestName("xyzzy", names), "");
  EXPECT_EQ(NearestName("stat", names), "stats");
}

TEST(FindTypo, KnownWordsPass) {
  Cli cli;
  EXPECT_EQ(cli.Typo({"generate", "--model", "m.yaml", "--json", "--prompt-ids", "1,2"}), std::nullopt);
  EXPECT_EQ(cli.Typo({"generate", "--model=serve"}), std::nullopt);  // a value that looks like a subcommand
  EXPECT_EQ(cli.Typo({"bench", "attention", "--parallel", "dp=2"}), std::nullopt);
  EXPECT_EQ(cli.Typo({"serve", "--worker-arg=--kv-dtype", "--worker-arg", "fp32"}), std::nullopt);
  EXPECT_EQ(cli.Typo({"generate", "--help"}), std::nullopt);
  EXPECT_EQ(cli.Typo({"serve", "--", "--anything"}), std::nullopt);
}

TEST(FindTypo, MisspeltSubcommandIsNamedWithTheNearest) {
  Cli cli;
  EXPECT_EQ(cli.Typo({"generat", "--model", "m"}), "unknown subcommand 'generat' (did you mean 'generate'?)");
  EXPECT_EQ(cli.Typo({"bench", "atention"}), "bench: unknown subcommand 'atention' (did you mean 'attention'?)");
  EXPECT_EQ(cli.Typo({"frobnicate"}), "unknown subcommand 'frobnicate'");
}

TEST(FindTypo, MisspeltFlagIsNamedWithTheNearest) {
  Cli cli;
  EXPECT_EQ(cli.Typo({"generate", "--modle", "m.yaml"}), "generate: unknown flag --modle (did you mean --model?)");
  EXPECT_EQ(cli.Typo({"generate", "--jsno"}), "generate: unknown flag --jsno (did you mean --json?)");
  // A flag of another subcommand is unknown here.
  EXPECT_EQ(cli.Typo({"generate", "--worker-arg", "x"}), "generate: unknown flag --worker-arg");
  EXPECT_EQ(cli.Typo({"bench", "attention", "--paralel=dp=2"}),
            "bench attention: unknown flag --paralel (did you mean --parallel?)");
}

// vLLM's spellings of a flag: underscores, one dash, a long name off by
// three edits.
TEST(FindTypo, VllmSpellingsAreToldTheFlag) {
  Cli cli;
  auto* serve = cli.app.get_subcommand("serve");
  int64_t n = 0;
  serve->add_option("--max-model-len", n);
  serve->add_option("--max-num-batched-tokens", n);
  serve->add_option("--tensor-parallel-size", n);
  EXPECT_EQ(cli.Typo({"serve", "--max-modle-len", "5"}),
            "serve: unknown flag --max-modle-len (did you mean --max-model-len?)");
  EXPECT_EQ(cli.Typo({"serve", "--max_num_batched_tokens", "5"}),
            "serve: unknown flag --max_num_batched_tokens (did you mean --max-num-batched-tokens?)");
  EXPECT_EQ(cli.Typo({"serve", "--tensor_parallel_size=2"}),
            "serve: unknown flag --tensor_parallel_size (did you mean --tensor-parallel-size?)");
  EXPECT_EQ(cli.Typo({"serve", "--max-num-batchd-tokns", "5"}),  // three edits in a long name
            "serve: unknown flag --max-num-batchd-tokns (did you mean --max-num-batched-tokens?)");
  EXPECT_EQ(cli.Typo({"serve", "-max-model-len", "5"}),
            "serve: unknown flag -max-model-len (did you mean --max-model-len?)");
  EXPECT_EQ(cli.Typo({"serve", "-max-model-len=5"}),
            "serve: unknown flag -max-model-len (did you mean --max-model-len?)");
  EXPECT_EQ(cli.Typo({"serve", "-max_modle_len", "5"}),
            "serve: unknown flag -max_modle_len (did you mean --max-model-len?)");
  // A value that starts with a dash is not a flag; a short name CLI11 checks.
  EXPECT_EQ(cli.Typo({"serve", "--max-model-len", "-5"}), std::nullopt);
  EXPECT_EQ(cli.Typo({"serve", "--worker-arg", "-max-model-len"}), std::nullopt);
  EXPECT_EQ(cli.Typo({"serve", "--frobnicate", "x"}), "serve: unknown flag --frobnicate");
}

}  // namespace
}  // namespace mlarun
