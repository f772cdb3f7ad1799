#include <cstdio>

#include "runtime/grammar/grammar.h"

namespace mlarun {

std::string ChoiceGrammar(std::span<const std::string> choices) {
  // Each choice a string literal: quote and backslash escaped, control
  // characters as \u00HH (an EBNF escape names a code point; \x would take
  // every hex digit after it).
  std::string ebnf = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) ebnf += " | ";
    ebnf += '"';
    for (unsigned char c : choices[i]) {
      if (c == '"' || c == '\\') {
        ebnf += '\\';
        ebnf += static_cast<char>(c);
      } else if (c < 0x20 || c == 0x7f) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "\\u%04x", c);
        ebnf += hex;
      } else {
        ebnf += static_cast<char>(c);
      }
    }
    ebnf += '"';
  }
  return ebnf + "\n";
}

}  // namespace mlarun
