#!/usr/bin/env python3
"""Makes the DeepSeek-V3 special-token fixtures of tests/text/ with Hugging
Face tokenizers (the version tests/serving/http/openai_client_test.sh pins:
pip install tokenizers==0.23.3); CI only reads them.

  tests/text/make_deepseek_v3_fixtures.py [--repo ROOT]

Reads tests/text/fixtures/bpe6k (make_tokenizer_fixtures.py) and writes
  tests/text/fixtures/bpe6k_dsv3/{tokenizer.json,tokenizer_config.json}
      bpe6k plus DeepSeek-V3's added tokens: the markers of its chat
      template, tool calls and reasoning, with DeepSeek-V3's `special` flags
      (ADDED below), each one id after bpe6k's own;
  tests/text/fixtures/bpe6k_dsv3_cases.jsonl
      {"text", "ids": encode(add_special_tokens=False),
       "text_keep": decode(ids, skip_special_tokens=False),
       "text_skip": decode(ids, skip_special_tokens=True)}
      for strings that hold the markers (alone, side by side, inside words,
      in a tool call and a reasoning answer as the model writes them).
"""
import argparse
import json
import os
import random

os.environ["TOKENIZERS_PARALLELISM"] = "false"

# DeepSeek-V3's added tokens beyond its BPE vocabulary (deepseek-ai/
# DeepSeek-V3 tokenizer.json, "added_tokens"), with their `special` flag:
# only the sentence markers, the pad and <|EOT|> are special there; the
# chat, tool and reasoning markers are plain added tokens, which is why
# decode(skip_special_tokens=True) keeps them. The place-holder tokens
# (<｜place▁holder▁no▁N｜>) are left out.
ADDED = [
    ("<｜begin▁of▁sentence｜>", True),
    ("<｜end▁of▁sentence｜>", True),
    ("<｜▁pad▁｜>", True),
    ("<think>", False),
    ("</think>", False),
    ("<｜fim▁hole｜>", False),
    ("<｜fim▁begin｜>", False),
    ("<｜fim▁end｜>", False),
    ("<｜User｜>", False),
    ("<｜Assistant｜>", False),
    ("<|EOT|>", True),
    ("<｜tool▁calls▁begin｜>", False),
    ("<｜tool▁calls▁end｜>", False),
    ("<｜tool▁call▁begin｜>", False),
    ("<｜tool▁call▁end｜>", False),
    ("<｜tool▁outputs▁begin｜>", False),
    ("<｜tool▁outputs▁end｜>", False),
    ("<｜tool▁output▁begin｜>", False),
    ("<｜tool▁output▁end｜>", False),
    ("<｜tool▁sep｜>", False),
]


def cases(rng):
    m = [t for t, _ in ADDED]
    words = ["hello", " world", "Paris", " 42", "\n", " ", "é", "日本", "{\"a\": 1}", "```json\n"]
    out = [t for t in m]
    out += ["".join(m), " ".join(m), "x" + "y".join(m) + "z"]
    out += [
        "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>What is the weather in Paris?<｜Assistant｜>",
        "<think>The user wants the weather.\nCall the tool.</think>I will check."
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        "{\"city\": \"Paris\", \"unit\": \"c\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
        "<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"CET\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        "<｜end▁of▁sentence｜>",
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{\"temp\": 21}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        "<｜tool▁calls▁begin｜ >not a marker<｜tool▁sep|>",
    ]
    for _ in range(60):
        out.append("".join(rng.choice(m + words) for _ in range(rng.randint(2, 12))))
    return out


def main():
    from tokenizers import AddedToken, Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    repo = ap.parse_args().repo
    fixtures = os.path.join(repo, "tests", "text", "fixtures")
    base = os.path.join(fixtures, "bpe6k")
    tok = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
    have = set(tok.get_vocab(with_added_tokens=True))
    for content, special in ADDED:
        if content in have:
            continue
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    out_dir = os.path.join(fixtures, "bpe6k_dsv3")
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    with open(os.path.join(base, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    with open(os.path.join(fixtures, "bpe6k_dsv3_cases.jsonl"), "w", encoding="utf-8") as f:
        for text in cases(random.Random(7)):
            ids = tok.encode(text, add_special_tokens=False).ids
            f.write(json.dumps({"text": text, "ids": ids, "text_keep": tok.decode(ids, skip_special_tokens=False),
                                "text_skip": tok.decode(ids, skip_special_tokens=True)}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
