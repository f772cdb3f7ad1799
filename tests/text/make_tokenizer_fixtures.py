#!/usr/bin/env python3
"""Makes the tokenizer fixtures of tests/text/ with Hugging Face tokenizers
and transformers (pip install tokenizers transformers); CI only reads them.

  tests/text/make_tokenizer_fixtures.py [--repo ROOT]

Writes
  configs/models/tiny-tokenizer/{tokenizer.json,tokenizer_config.json}
      the tiny model's tokenizer: byte-level BPE, 2 specials + 256 bytes +
      254 merges = 512 ids (configs/models/tiny.yaml's vocab_size);
  tests/text/fixtures/bpe6k/{tokenizer.json,tokenizer_config.json}
      a bigger one (6000 ids) with a few added non-special tokens, one with
      lstrip/rstrip and one single_word;
  tests/text/fixtures/{bpe6k,tiny}_encode.jsonl
      {"hex": raw bytes, "ids": add_special_tokens=False, "ids_special":
       add_special_tokens=True, "roundtrip": decode(ids) == text}
      (strings made from invalid UTF-8 are encoded as Python's
       bytes.decode("utf-8", errors="replace") makes them);
  tests/text/fixtures/tiny_variants.jsonl
      the tiny tokenizer with other pre-tokenizers (each Split behavior,
      invert, a String pattern, a lone ByteLevel with prefix space and
      GPT-2 regex): {"pre_tokenizer": {...}, "cases": [{"hex", "ids"}]};
  tests/text/fixtures/{bpe6k,tiny}_decode.jsonl
      {"ids": [...], "text": decode(skip_special_tokens=False),
       "text_skip": decode(skip_special_tokens=True)}.

Both tokenizers use DeepSeek-V3's pre-tokenizer (three Split regexes, then
ByteLevel without prefix space or regex) and its two special tokens. The
training text is made here from a fixed seed, so a rerun gives the same files
(for one version of tokenizers).
"""
import argparse
import json
import os
import random

os.environ["TOKENIZERS_PARALLELISM"] = "false"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"

# DeepSeek-V3's tokenizer.json pre_tokenizer.
DEEPSEEK_V3_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
                                               "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
                                               "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their can has more if will would about into time so what "
         "up out other could only new some these two may first then do any like my now over such our man me "
         "even most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while last might us "
         "great old year off come since against go came right used take three tokenizer model attention cache "
         "latent decode prefill expert router kernel tensor").split()
CODE = [
    "def {w}(x, y=None):\n    if y is None:\n        return x\n    return x + y\n",
    "for (int i = 0; i < n; ++i) {{\n    sum += a[i] * b[i];\n}}\n",
    "class {W}:\n    def __init__(self):\n        self.{w} = []\n",
    "#include <vector>\nint main() {{ std::vector<int> v{{1, 2, 3}}; return v.size(); }}\n",
    "SELECT {w}, COUNT(*) FROM t WHERE id > 42 GROUP BY {w};\n",
    "const {w} = (a, b) => a.map(x => x * 2).filter(Boolean);\n",
]
CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坏兴切"
KANA = "".join(chr(c) for c in range(0x3041, 0x3097)) + "".join(chr(c) for c in range(0x30A1, 0x30FB))
EMOJI = ["😀", "😂", "👍", "👍🏽", "👨‍👩‍👧‍👦", "👩‍💻", "🏳️‍🌈", "❤️", "🇯🇵", "🇺🇸", "✨", "🚀", "🤖", "🧠"]
COMBINING = ["e\u0301", "a\u0308", "n\u0303", "o\u0302\u0323", "\u0915\u094d\u0937", "Z\u0351\u0352\u0353"]
MISC = ["\u00a0", "\u3000", "\u0085", "\u180e", "\u2028", "\u2029", "\u200b", "\u200d", "\ufeff", "\t", "\v", "\f",
        "’", "“", "”", "…", "—", "€", "£", "¥", "©", "°", "±", "×", "÷", "µ", "ß", "Ω", "π", "∑", "√", "∞"]
LATIN = "café naïve résumé Ærøskøbing Straße Łódź İstanbul ĳssel Ǆemal ﬁnancial ＡＢＣ ｆｕｌｌｗｉｄｔｈ".split()


def training_text(rng, n_paragraphs):
    out = []
    for _ in range(n_paragraphs):
        k = rng.random()
        if k < 0.5:
            s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            out.append(s.capitalize() + rng.choice([".", "!", "?", ","]) + rng.choice([" ", "\n", "\n\n", "\r\n"]))
        elif k < 0.65:
            out.append(rng.choice(CODE).format(w=rng.choice(WORDS), W=rng.choice(WORDS).capitalize()))
        elif k < 0.8:
            out.append("".join(rng.choice(CJK) for _ in range(rng.randint(4, 30))) + rng.choice(["。", "，", "\n"]))
        elif k < 0.87:
            out.append("".join(rng.choice(KANA) for _ in range(rng.randint(3, 15))) + "。")
        elif k < 0.92:
            out.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 9))) for _ in range(rng.randint(1, 8))) + "\n")
        elif k < 0.96:
            out.append(" ".join(rng.choice(EMOJI + LATIN + COMBINING) for _ in range(rng.randint(1, 6))) + " ")
        else:
            out.append(rng.choice(["    ", "\t", "\n\n", "  \n", "\r\n\r\n"]))
    return "".join(out)


def train(text, vocab_size, added_tokens):
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    tok = Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": DEEPSEEK_V3_PRE_TOKENIZER,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {}, "merges": []},
    }))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    if added_tokens:
        from tokenizers import AddedToken
        specials = [t for t in added_tokens if t.special]
        normal = [t for t in added_tokens if not t.special]
        if specials:
            tok.add_special_tokens(specials)
        if normal:
            tok.add_tokens(normal)
    return tok


def write_tokenizer(tok, directory, chat_template, extra_config=None):
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"), pretty=False)
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True, "rstrip": False,
                      "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True, "rstrip": False,
                      "single_word": False},
        "pad_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True, "rstrip": False,
                      "single_word": False},
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 16384,
        "sp_model_kwargs": {},
        "unk_token": None,
        "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": chat_template,
    }
    config.update(extra_config or {})
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")


def invalid_utf8(rng):
    pieces = [b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xc0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\x80", b"\xbf\xbf",
              b"\xff", b"\xfe", b"\xc3", b"\xe0\x80\xaf", b"\xf8\x88\x80\x80\x80", b"\xef\xbf\xbd", b"\xf0\x90\x80"]
    good = [b"A", b"abc ", "é".encode(), "中".encode(), "😀".encode(), b" ", b"\n", b"12"]
    return b"".join(rng.choice(pieces + good) for _ in range(rng.randint(1, 8)))


def test_strings(rng, added_contents, count):
    """(raw bytes) of the strings to encode."""
    fixed = ["", " ", "  ", "\n", "\r\n", "a", "Hello world", "Hello, world! It's 2026-12-01.", "don't stop",
             "  leading and trailing  ", "x" * 300, " " * 70 + "a", "中" * 120, "ab" * 200, "1234567890123",
             "3.14159 2,718 1e-9 0x1F -42", "a\nb\r\nc\rd\n\n\r\n\r\n", "\t\t\tindent\n    four", "$$$ ((( ))) !!! ???",
             "e\u0301\u0301\u0301", "\u0085\u180e\u2028\u2029\u00a0\u3000", "👨‍👩‍👧‍👦👨‍👩‍👧‍👦", "🏳️‍🌈 flag 🇯🇵🇺🇸",
             BOS, EOS, BOS + "Hello" + EOS, "<｜begin▁of▁sentence", "｜>", "<｜<｜begin▁of▁sentence｜>",
             "日本語のテキスト、カタカナとひらがな。", "中文，标点！「引号」", "Ｆｕｌｌ　ｗｉｄｔｈ", "ǅemal ﬁnancial"]
    out = [s.encode() for s in fixed]
    for c in added_contents:
        out += [c.encode(), ("a " + c + " b").encode(), ("a" + c + "b").encode(), ("  " + c + "  \n").encode(),
                (c + c).encode(), ("x" + c[:-1]).encode()]
    alphabet = (list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|") + list(CJK[:60]) +
                list(KANA[:40]) + EMOJI + COMBINING + MISC + ["\n", "\r\n", "\r", "  ", "\t"])
    while len(out) < count:
        k = rng.random()
        if k < 0.25:
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        elif k < 0.4:
            s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            if rng.random() < 0.5:
                s = s.capitalize() + rng.choice([".", "?", "!\n", ",", ""])
        elif k < 0.5:
            s = rng.choice(CODE).format(w=rng.choice(WORDS), W=rng.choice(WORDS).upper())
        elif k < 0.58:
            s = "".join(rng.choice(CJK + KANA + "，。、") for _ in range(rng.randint(1, 40)))
        elif k < 0.64:
            s = rng.choice(["", " ", "-", "+", "$", "x"]).join(
                "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 4)))
        elif k < 0.7:
            s = "".join(rng.choice([" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "x", "\n\n"])
                        for _ in range(rng.randint(1, 12)))
        elif k < 0.76:
            s = " ".join(rng.choice(EMOJI + COMBINING + LATIN) for _ in range(rng.randint(1, 6)))
        elif k < 0.84 and added_contents:
            parts = [rng.choice(added_contents) if rng.random() < 0.4 else rng.choice(WORDS + [" ", "\n", "中文", "  "])
                     for _ in range(rng.randint(1, 6))]
            s = rng.choice(["", " ", "\n"]).join(parts)
        elif k < 0.92:
            out.append(invalid_utf8(rng))
            continue
        else:
            s = "".join(rng.choice(alphabet + WORDS) for _ in range(rng.randint(20, 120)))
        out.append(s.encode())
    return out


def encode_fixtures(tok_dir, path, strings):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    # The config's add_bos_token / add_eos_token passed as transformers'
    # from_pretrained passed them up to 4.x (LlamaTokenizerFast: bos + $A);
    # transformers 5's from_pretrained leaves them out for ByteLevel files.
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
                                 add_bos_token=config["add_bos_token"], add_eos_token=config["add_eos_token"],
                                 bos_token=config["bos_token"]["content"], eos_token=config["eos_token"]["content"])
    with open(path, "w", encoding="utf-8") as f:
        for b in strings:
            text = b.decode("utf-8", errors="replace")
            ids = hf(text, add_special_tokens=False)["input_ids"]
            ids_special = hf(text, add_special_tokens=True)["input_ids"]
            assert ids == raw.encode(text, add_special_tokens=False).ids
            rt = raw.decode(ids, skip_special_tokens=False) == text
            f.write(json.dumps({"hex": b.hex(), "ids": ids, "ids_special": ids_special, "roundtrip": rt}) + "\n")


def decode_fixtures(tok_dir, path, rng, count):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    n = raw.get_vocab_size(with_added_tokens=True)
    vocab = raw.get_vocab(with_added_tokens=True)
    byte_chars = {}
    from tokenizers import pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # The byte map of GPT-2: each byte's stand-in character.
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    for b, c in zip(bs, cs):
        byte_chars[b] = vocab[chr(c)]
    assert len(alphabet) == 256
    multibyte = ["é", "中", "😀", "👨‍👩‍👧‍👦", "ひ", "€"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            kind = i % 4
            if kind == 0:
                ids = [rng.randrange(n) for _ in range(rng.randint(1, 20))]
            elif kind == 1:
                # Byte tokens of multi-byte characters, cut, reordered, mixed.
                ids = []
                for _ in range(rng.randint(1, 5)):
                    bb = rng.choice(multibyte).encode()
                    if rng.random() < 0.5:
                        bb = bb[:rng.randint(1, len(bb))]
                    ids += [byte_chars[x] for x in bb]
                    if rng.random() < 0.3:
                        ids.append(rng.randrange(n))
                if rng.random() < 0.3:
                    rng.shuffle(ids)
            elif kind == 2:
                ids = [byte_chars[rng.randrange(256)] for _ in range(rng.randint(1, 12))]
            else:
                ids = raw.encode("".join(rng.choice(multibyte + WORDS + [" ", BOS, EOS]) for _ in range(8))).ids
                if ids and rng.random() < 0.5:
                    ids = ids[rng.randrange(len(ids)):]
            f.write(json.dumps({"ids": ids, "text": raw.decode(ids, skip_special_tokens=False),
                                "text_skip": raw.decode(ids, skip_special_tokens=True)}, ensure_ascii=False) + "\n")


def variant_fixtures(tok_dir, path, rng):
    from tokenizers import Tokenizer

    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        base = json.load(f)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    variants = []
    for behavior in ["Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous", "Isolated"]:
        for invert in [False, True]:
            variants.append({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\s+|[0-9]"}, "behavior": behavior, "invert": invert},
                byte_level]})
    variants.append({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "a."}, "behavior": "Isolated", "invert": False}, byte_level]})
    variants.append({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]})
    variants.append({"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True})
    variants.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True})
    strings = test_strings(rng, [], 80)
    with open(path, "w", encoding="utf-8") as f:
        for v in variants:
            j = dict(base)
            j["pre_tokenizer"] = v
            tok = Tokenizer.from_str(json.dumps(j))
            cases = []
            for b in strings:
                text = b.decode("utf-8", errors="replace")
                cases.append({"hex": b.hex(), "ids": tok.encode(text, add_special_tokens=False).ids})
            f.write(json.dumps({"pre_tokenizer": v, "cases": cases}) + "\n")


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(here)))
    args = ap.parse_args()
    from tokenizers import AddedToken

    fixtures = os.path.join(args.repo, "tests", "text", "fixtures")
    template_path = os.path.join(fixtures, "chat_templates", "deepseek_v3.jinja")
    if os.path.exists(template_path):
        with open(template_path, encoding="utf-8") as f:
            chat_template = f.read()
    else:
        chat_template = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                         "{{ '<｜User｜>' + message['content'] }}{% elif message['role'] == 'assistant' %}"
                         "{{ '<｜Assistant｜>' + message['content'] + eos_token }}{% else %}{{ message['content'] }}"
                         "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")

    rng = random.Random(20261201)
    text = training_text(rng, 6000)

    tiny = train(text, 512, [])
    assert tiny.get_vocab_size() == 512, tiny.get_vocab_size()
    assert tiny.token_to_id(BOS) == 0 and tiny.token_to_id(EOS) == 1
    tiny_dir = os.path.join(args.repo, "configs", "models", "tiny-tokenizer")
    write_tokenizer(tiny, tiny_dir, chat_template)

    added = [AddedToken(PAD, special=True, normalized=False),
             AddedToken("<｜User｜>", special=False, normalized=True),
             AddedToken("<｜Assistant｜>", special=False, normalized=True),
             AddedToken("<think>", special=False, normalized=True),
             AddedToken("</think>", special=False, normalized=False),
             AddedToken("<mask>", special=True, normalized=False, lstrip=True, rstrip=True),
             AddedToken("[WORD]", special=False, normalized=True, single_word=True),
             AddedToken("<｜tool▁calls▁begin｜>", special=False, normalized=True)]
    big = train(text, 6000, added)
    big_dir = os.path.join(fixtures, "bpe6k")
    write_tokenizer(big, big_dir, chat_template)
    contents = [BOS, EOS] + [t.content for t in added]

    srng = random.Random(1)
    encode_fixtures(big_dir, os.path.join(fixtures, "bpe6k_encode.jsonl"), test_strings(srng, contents, 4000))
    decode_fixtures(big_dir, os.path.join(fixtures, "bpe6k_decode.jsonl"), random.Random(2), 2000)
    encode_fixtures(tiny_dir, os.path.join(fixtures, "tiny_encode.jsonl"), test_strings(random.Random(3), [BOS, EOS], 400))
    decode_fixtures(tiny_dir, os.path.join(fixtures, "tiny_decode.jsonl"), random.Random(4), 300)
    variant_fixtures(tiny_dir, os.path.join(fixtures, "tiny_variants.jsonl"), random.Random(5))


if __name__ == "__main__":
    main()
