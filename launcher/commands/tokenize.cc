// `mlarun tokenize`: the model's tokenizer on stdin/stdout (launcher/tokenize/).
#include "launcher/tokenize/tokenize.h"

#include <iostream>
#include <memory>

#include "launcher/commands/commands.h"

namespace mlarun::commands {

void AddTokenizeCommand(CLI::App& app, CommandTable& table) {
  auto tk = std::make_shared<text::TokenizeOptions>();
  auto* tokenize = app.add_subcommand(
      "tokenize", "The model's tokenizer: one JSON string per stdin line -> one JSON array of ids per stdout line");
  tokenize
      ->add_option("--model", tk->model, "Checkpoint or tokenizer directory, tokenizer.json, or configs/models/*.yaml")
      ->required();
  tokenize->add_flag("--decode", tk->decode, "The reverse: one JSON array of ids per line -> one JSON string");
  tokenize->add_flag("!--no-special-tokens", tk->add_special_tokens,
                     "Encoding: without the post-processor's tokens (bos), as add_special_tokens=False");
  tokenize->add_flag("--skip-special-tokens", tk->skip_special_tokens, "Decoding: leave special tokens out");
  table.Add(tokenize, [tk](ProcessArgs) { return text::RunTokenize(*tk, std::cin, std::cout, std::cerr); });
}

}  // namespace mlarun::commands
