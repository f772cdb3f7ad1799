#!/usr/bin/env python3
"""Makes tests/text/fixtures/unicode_classes.jsonl with Hugging Face tokenizers
(pip install tokenizers unicodedata2==16.0.0); CI only reads it.

tokenizers matches pre-tokenizer patterns with its own Unicode tables (16.0
in tokenizers 0.2x); these lines record what its regex engine says about
characters that Unicode 15.0 to 16.0 assigned or moved, and some others:

  {"codepoints": [...]}                      the sample, once, first
  {"pattern": P, "matches": "0110..."}       one character of the sample each:
                                             does P match it whole
  {"pattern": P, "hex": TEXT, "pieces": [..]}  Split(P, isolated) of TEXT

tests/text/tokenizer_test.cc (UnicodeClasses.*) compiles each pattern with
text::Regex and compares.
"""
import json
import os
import random
import unicodedata

import tokenizers
import unicodedata2
from tokenizers import Regex, pre_tokenizers

CLASS_PATTERNS = [r"\p{L}", r"\p{N}", r"\p{P}", r"\p{S}", r"\p{M}", r"\p{Lu}", r"\p{Ll}", r"\p{Lo}", r"\p{Nd}",
                  r"\p{Mn}", r"\p{Mc}", r"\p{So}", r"\P{L}", r"\P{N}", r"[\p{L}\p{M}]",
                  r"[^\r\n\p{L}\p{P}\p{S}]", r"[\p{P}\p{S}]"]
# DeepSeek-V3's pre-tokenizer regexes and GPT-2's.
SPLIT_PATTERNS = [
    r"\p{N}{1,3}",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
]


def matches(pattern, chars):
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    out = []
    for ch in chars:
        pieces = split.pre_tokenize_str(ch)
        out.append("1" if len(pieces) == 1 and pieces[0][0] == ch and
                   len(pre_tokenizers.Split(Regex(pattern), behavior="removed").pre_tokenize_str(ch)) == 0 else "0")
    return "".join(out)


def main():
    assert unicodedata2.unidata_version == "16.0.0" and unicodedata.unidata_version == "14.0.0"
    rng = random.Random(20261206)
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    changed = [c for c in cps if unicodedata.category(chr(c)) != unicodedata2.category(chr(c))]
    changed_set = set(changed)
    others = [c for c in cps if c > 32 and c not in changed_set]
    sample = sorted(set(rng.sample(changed, 1500)) | {0x1C89, 0x2429, 0x1171E} | set(rng.sample(others, 500)))
    chars = [chr(c) for c in sample]
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "fixtures", "unicode_classes.jsonl"), "w") as f:
        f.write(json.dumps({"codepoints": sample, "tokenizers": tokenizers.__version__}) + "\n")
        for p in CLASS_PATTERNS:
            f.write(json.dumps({"pattern": p, "matches": matches(p, chars)}) + "\n")
        filler = list("ab Z9 1, .;\n") + ["12", "345", " the", "x"]
        for p in SPLIT_PATTERNS:
            for _ in range(40):
                text = "".join(rng.choice(chars) if rng.random() < 0.5 else rng.choice(filler) for _ in range(24))
                pieces = [s for s, _ in pre_tokenizers.Split(Regex(p), behavior="isolated").pre_tokenize_str(text)]
                f.write(json.dumps({"pattern": p, "hex": text.encode().hex(), "pieces": pieces}) + "\n")


if __name__ == "__main__":
    main()
