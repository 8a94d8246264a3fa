"""Hugging Face `tokenizers` as the reference for dtrain's tokenizer.json support
(tests/test_hf_tokenizer.cpp).

  hf_tokenizer_ref.py make OUT
      Generates a multi-script corpus (English, accented Latin, Cyrillic, Greek, CJK, Arabic,
      emoji, digit runs, runs of every kind of white space, contractions, code, punctuation and
      control characters), trains byte-level BPE vocabularies on it WITH `tokenizers`, and writes
      into OUT:
        docs.jsonl           the test documents (not the training ones), one JSON string a line
        <name>.json          each tokenizer.json; <name>.ids: tokenizers' encode(doc,
                             add_special_tokens=False).ids of every document, one line each;
                             <name>.special.ids: the same with add_special_tokens=True
        <name>.roundtrip     a line per document: 1 when tokenizers' decode(ids,
                             skip_special_tokens=False) gives the document back (0: an added
                             token with lstrip / rstrip, or one of byte symbols, such as "ü")
        <name>.decode.jsonl  random id lists, one JSON list a line (decode checks)
      names: gpt2 (ByteLevel with GPT-2's pattern, added tokens with single_word / lstrip /
      rstrip / normalized), llama3 (Split with Llama 3's pattern, isolated, then ByteLevel without
      its pattern; ignore_merges; special tokens after the vocabulary; TemplateProcessing adding
      <|begin_of_text|>), llama3_eos (llama3 whose template also puts two tokens after the
      text), llama3_legacy (llama3 with its merges as "a b" strings), wide (llama3
      with its vocabulary filled up to id 70000, so its special tokens lie beyond 65535: pieces
      of the documents no merge makes whole, with which ignore_merges changes the ids of hundreds
      of documents, then unreachable tokens),
      variant_<k> (gpt2's model under other pre-tokenizers: every Split behavior, invert, a
      String pattern, Digits, \\w \\d patterns, a pattern with empty matches), and unsupported
      ones: wordpiece, unigram, wordlevel, nfc (a normalizer), metaspace (a pre-tokenizer),
      roberta (a post-processor).
  hf_tokenizer_ref.py decode OUT NAME GOT
      GOT holds dtrain's decoding of each id list of OUT/NAME.decode.jsonl (hex bytes, a line
      each); each must equal tokenizers' decode(ids, skip_special_tokens=False) once read as
      UTF-8 with U+FFFD for invalid sequences (what tokenizers returns). Prints "equal <n>".
  hf_tokenizer_ref.py shards OUT NAME SHARD_DIR INPUT...
      The shards `dtrain data tokenize INPUT... --tokenizer OUT/NAME.json` wrote, in order,
      against tokenizers' encode(file text, add_special_tokens=True) of each input file (with
      <|endoftext|> before it when the post-processor adds nothing). Prints "equal <n> in <k> shards".
  hf_tokenizer_ref.py gpt2json VOCAB_DIR OUT
      GPT-2's own tokenizer.json, as transformers converts OpenAI's encoder.json + vocab.bpe
      (GPT2TokenizerFast), written to OUT/tokenizer.json.
  hf_tokenizer_ref.py auto CHECKPOINT_DIR PROMPT NEW
      AutoTokenizer.from_pretrained(CHECKPOINT_DIR) and GPT2LMHeadModel.from_pretrained: prints
      "class <tokenizer class>", "prompt <ids of tokenizer(PROMPT)>" and "greedy <hex>" (NEW
      greedy tokens, decoded with the special tokens).
"""
import json
import os
import random
import sys

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = ["the", "The", "THE", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on",
         "are", "as", "with", "his", "they", "I", "at", "be", "this", "have", "from", "or", "one", "had", "by",
         "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an",
         "each", "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many",
         "hello", "Hello", "hellos", "O'Neil", "rock'n'roll", "don", "won", "isn", "tokenizer", "byte-level"]
LATIN = ["naïve", "café", "résumé", "façade", "Ångström", "über", "Straße", "mañana", "smörgåsbord", "jalapeño",
         "œuvre", "Æsir", "ÉCOLE", "İstanbul", "Łódź", "Dvořák", "ſtraße", "ﬁnal"]
CYRILLIC = ["привет", "мир", "Москва", "ЁЖИК", "съешь", "ещё", "этих", "мягких", "французских", "булок", "Україна"]
GREEK = ["Καλημέρα", "κόσμε", "ΑΘΗΝΑ", "λόγος", "ψυχή", "ἀρχή", "Ὀδυσσεύς", "ς", "Σίσυφος"]
CJK = ["日本語", "のテキスト", "東京都", "漢字", "中文字符", "你好世界", "한국어", "ひらがな", "カタカナ", "。", "、", "「引用」"]
ARABIC = ["مرحبا", "بالعالم", "العربية", "كتاب", "٣٤٥", "שלום", "עולם"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🔥🔥", "🤖", "✨", "🏳️‍🌈", "☕"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Re", "'VE", "'M", "'LL", "'D",
                "'", "''", "'x", "'sa", "'dd", "'ſ", "’s", "'K"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000", "\u2009",
          "\u2028", "\u0085", "\x0b", "\x0c", " \t\n ", "\u200b", "\u180e", "\ufeff"]
CODE = ["def f(x):\n    return x**2 + 1\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "if x != None and y >= 3:", "#include <stdio.h>", "std::vector<int> v{1, 2, 3};",
        "const re = /^\\s*(\\w+)=(.*)$/gm;", "SELECT * FROM t WHERE id = 42;", "    x = {'a': [1, 2], \"b\": None}",
        "$ ls -la ~/src && echo \"done\" | tee log.txt", "<div class=\"x\">&amp;</div>", "0x1F, 0b1010, 1e-9, 3.14159"]
PUNCT = list("!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "--", "—", "–", "«»", "¿¡", "§", "©", "™", "°", "±", "√",
                                                     "∞", "≠", "€", "£", "¥", "•", "\x00", "\x01", "\x1b", "\x7f"]
# blocks of well-established characters (letters, marks, digits, symbols): random code points
BLOCKS = [(0x0041, 0x024F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0590, 0x05FF), (0x0600, 0x06FF), (0x0900, 0x097F),
          (0x0E00, 0x0E7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2070, 0x209F), (0x20A0, 0x20BF), (0x2150, 0x218F),
          (0x2190, 0x21FF), (0x2460, 0x24FF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
          (0xFF00, 0xFFEF), (0x1D400, 0x1D7FF), (0x1F300, 0x1F5FF)]
SPECIAL_TEXT = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_0|>", "[MASK]", " [MASK]",
                "<|pad|>", "hello", " hello ", "xhello", "ü", "<|endoftext|><|endoftext|>", "<|begin"]


def document(rng, specials):
    parts = []
    for _ in range(rng.randint(5, 60)):
        k = rng.randrange(16)
        if k < 4:
            parts.append((" " if rng.random() < 0.7 else "") + rng.choice(WORDS))
        elif k == 4:
            parts.append((" " if rng.random() < 0.5 else "") + rng.choice(LATIN + CYRILLIC + GREEK))
        elif k == 5:
            parts.append(rng.choice(CJK + ARABIC) + ("" if rng.random() < 0.5 else " "))
        elif k == 6:
            parts.append(rng.choice(EMOJI))
        elif k == 7:
            parts.append((" " if rng.random() < 0.5 else "") + str(rng.randrange(10 ** rng.randint(1, 12))))
        elif k == 8:
            parts.append(rng.choice(SPACES) * rng.randint(1, 3))
        elif k == 9:
            parts.append(rng.choice(CONTRACTIONS))
        elif k == 10:
            parts.append(rng.choice(CODE))
        elif k == 11:
            parts.append("".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4))))
        elif k == 12:
            lo, hi = rng.choice(BLOCKS)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 5))))
        elif k == 13 and specials:
            parts.append(rng.choice(SPECIAL_TEXT))
        elif k == 14:
            parts.append(rng.choice(WORDS) + rng.choice(CONTRACTIONS))
        else:
            parts.append(".\n" if rng.random() < 0.5 else ", ")
    return "".join(parts).replace("\ud800", "")


def bpe_trainer(vocab_size, specials=()):
    from tokenizers import pre_tokenizers, trainers
    return trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def save(tok, out, name, docs, rng):
    tok.save(os.path.join(out, name + ".json"))
    with open(os.path.join(out, name + ".ids"), "w") as f, open(os.path.join(out, name + ".special.ids"), "w") as g, \
            open(os.path.join(out, name + ".roundtrip"), "w") as r:
        for doc, enc in zip(docs, tok.encode_batch(docs, add_special_tokens=False)):
            f.write(" ".join(map(str, enc.ids)) + "\n")
            r.write("1\n" if tok.decode(enc.ids, skip_special_tokens=False) == doc else "0\n")
        for enc in tok.encode_batch(docs, add_special_tokens=True):
            g.write(" ".join(map(str, enc.ids)) + "\n")
    n = tok.get_vocab_size(with_added_tokens=True)
    with open(os.path.join(out, name + ".decode.jsonl"), "w") as f:
        for _ in range(300):
            f.write(json.dumps([rng.randrange(n) for _ in range(rng.randint(1, 12))]) + "\n")


def make(out):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    os.makedirs(out, exist_ok=True)
    rng = random.Random(20240913)
    train = [document(rng, False) for _ in range(4000)]
    docs = [document(rng, True) for _ in range(2500)] + ["", " ", "\n", "a", "hello", "<|endoftext|>", "'s", "   x"]
    with open(os.path.join(out, "docs.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")

    # GPT-2's kind: ByteLevel splits with GPT-2's pattern; added tokens of every flavour
    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    gpt2.train_from_iterator(train, bpe_trainer(1500, ["<|endoftext|>"]))
    gpt2.add_special_tokens([AddedToken("<|pad|>", rstrip=True, normalized=False)])
    gpt2.add_tokens([AddedToken("hello", single_word=True), AddedToken("[MASK]", lstrip=True),
                     AddedToken("ü", normalized=True), AddedToken(" wow", normalized=False)])
    save(gpt2, out, "gpt2", docs, rng)

    # Llama 3's kind
    llama = Tokenizer(models.BPE(ignore_merges=True))
    llama.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    llama.decoder = decoders.ByteLevel()
    llama.train_from_iterator(train, bpe_trainer(2500))
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_0|>", "<|reserved_1|>"]
    llama.add_special_tokens(specials)
    bos = llama.token_to_id("<|begin_of_text|>")
    llama.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    save(llama, out, "llama3", docs, rng)
    eos = Tokenizer.from_str(llama.to_str())  # a template with tokens after the text too
    eos.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A <|end_of_text|> <|reserved_0|>",
        special_tokens=[(t, llama.token_to_id(t)) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_0|>")])
    save(eos, out, "llama3_eos", docs, rng)

    # the merges in the older "a b" form: tokenizers reads it to the same ids
    j = json.load(open(os.path.join(out, "llama3.json")))
    assert isinstance(j["model"]["merges"][0], list), "tokenizers wrote the merges as pairs"
    assert all(" " not in a and " " not in b for a, b in j["model"]["merges"])
    j["model"]["merges"] = [a + " " + b for a, b in j["model"]["merges"]]
    legacy = Tokenizer.from_str(json.dumps(j))
    assert [e.ids for e in legacy.encode_batch(docs, add_special_tokens=False)] == \
        [e.ids for e in llama.encode_batch(docs, add_special_tokens=False)]
    save(legacy, out, "llama3_legacy", docs, rng)
    with open(os.path.join(out, "llama3_legacy.json")) as f:  # tokenizers saves pairs again: keep the strings
        assert isinstance(json.load(f)["model"]["merges"][0], list)
    with open(os.path.join(out, "llama3_legacy.json"), "w") as f:
        json.dump(j, f, ensure_ascii=False)

    # beyond 65536 ids: the vocabulary filled up to 70000, the specials after it. The first fillers
    # are pieces of test documents that no merge makes whole (Llama 3's vocabulary, converted from
    # tiktoken's, has such tokens), which ignore_merges takes as they are; the rest are unreachable.
    j = json.load(open(os.path.join(out, "llama3.json")))
    vocab = j["model"]["vocab"]
    n = len(vocab)
    whole = []
    for d in docs[:1000]:
        whole += [p for p, _ in llama.pre_tokenizer.pre_tokenize_str(d) if len(p) > 1 and p not in vocab]
    whole = list(dict.fromkeys(whole))[:3000]
    for i in range(n, 70000):
        vocab[whole[i - n] if i - n < len(whole) else f"<unused_{i}>"] = i
    for k, t in enumerate(j["added_tokens"]):
        t["id"] = 70000 + k
    proc = j["post_processor"]["processors"][1]
    proc["special_tokens"]["<|begin_of_text|>"]["ids"] = [70000]
    wide = Tokenizer.from_str(json.dumps(j))
    assert wide.token_to_id("<|begin_of_text|>") == 70000
    j["model"]["ignore_merges"] = False
    merged = Tokenizer.from_str(json.dumps(j))
    differ = sum(a.ids != b.ids for a, b in zip(wide.encode_batch(docs), merged.encode_batch(docs)))
    assert differ > 100, f"ignore_merges changes only {differ} documents"
    print(f"wide: ignore_merges changes {differ} documents")
    save(wide, out, "wide", docs, rng)

    # gpt2's model under other pre-tokenizers
    base = json.loads(gpt2.to_str())
    Split, BL, Digits = pre_tokenizers.Split, pre_tokenizers.ByteLevel, pre_tokenizers.Digits
    variants = [
        pre_tokenizers.Sequence([Split(Regex(r"\s+"), "removed"), BL(add_prefix_space=True, use_regex=False)]),
        pre_tokenizers.Sequence([Split(Regex(r"[0-9]+|\p{P}"), "merged_with_previous"), BL(False, use_regex=True)]),
        pre_tokenizers.Sequence([Split(Regex(r"\p{Lu}"), "merged_with_next"), BL(False, use_regex=True)]),
        pre_tokenizers.Sequence([Split(Regex(r"\p{L}+"), "contiguous", invert=True), BL(False, use_regex=True)]),
        pre_tokenizers.Sequence([Split("'", "isolated"), Digits(individual_digits=True), BL(True, use_regex=True)]),
        pre_tokenizers.Sequence([Digits(individual_digits=False), BL(False, use_regex=True)]),
        pre_tokenizers.Sequence([Split(Regex(r"a*|\b"), "isolated"), BL(False, use_regex=False)]),
        pre_tokenizers.Sequence([Split(Regex(r"\w+|\d|[^\w\s]+|\s+"), "isolated"), BL(False, use_regex=False)]),
        pre_tokenizers.Sequence([Split(Regex(r"\S+"), "removed", invert=True), BL(False, use_regex=True)]),
        BL(add_prefix_space=True, use_regex=True),
    ]
    for k, pre in enumerate(variants):
        t = Tokenizer.from_str(json.dumps(base))
        t.pre_tokenizer = pre
        save(t, out, f"variant_{k}", docs, rng)

    # unsupported kinds
    small = ["the quick brown fox jumps over the lazy dog", "hello world, and hello again"] * 20
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.train_from_iterator(small, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                             show_progress=False))
    wp.save(os.path.join(out, "wordpiece.json"))
    ug = Tokenizer(models.Unigram())
    ug.pre_tokenizer = pre_tokenizers.Metaspace()
    ug.train_from_iterator(small, trainers.UnigramTrainer(vocab_size=60, show_progress=False))
    ug.save(os.path.join(out, "unigram.json"))
    wl = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.train_from_iterator(small, trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False))
    wl.save(os.path.join(out, "wordlevel.json"))
    for name, change in [("nfc", lambda t: setattr(t, "normalizer", normalizers.NFC())),
                         ("metaspace", lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace())),
                         ("roberta", lambda t: setattr(t, "post_processor",
                                                       processors.RobertaProcessing(("<|pad|>", 1), ("<|pad|>", 1))))]:
        t = Tokenizer.from_str(gpt2.to_str())
        change(t)
        t.save(os.path.join(out, name + ".json"))
    print(f"made {len(docs)} documents; vocab sizes gpt2 {gpt2.get_vocab_size()} llama3 {llama.get_vocab_size()} "
          f"wide {wide.get_vocab_size()}")


def decode(out, name, got):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(out, name + ".json"))
    lists = [json.loads(line) for line in open(os.path.join(out, name + ".decode.jsonl"))]
    hexes = open(got).read().split("\n")[:-1]
    assert len(hexes) == len(lists), (len(hexes), len(lists))
    bad = 0
    for ids, h in zip(lists, hexes):
        want = tok.decode(ids, skip_special_tokens=False)
        have = bytes.fromhex(h).decode("utf-8", "replace")
        if have != want:
            bad += 1
            if bad <= 3:
                print(f"differ: ids {ids}: dtrain {have!r} tokenizers {want!r}")
    if bad:
        sys.exit(f"{bad} of {len(lists)} decodings differ")
    print(f"equal {len(lists)}")


def shards(out, name, shard_dir, inputs):
    import numpy as np
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(out, name + ".json"))
    ref = []
    for path in inputs:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
        with_special = tok.encode(text, add_special_tokens=True).ids
        plain = tok.encode(text, add_special_tokens=False).ids
        eot = tok.token_to_id("<|endoftext|>")
        ref += with_special if with_special != plain or eot is None else [eot] + plain
    got = []
    files = ["val_000000.bin"] + sorted(f for f in os.listdir(shard_dir) if f.startswith("train_"))
    for fname in files:
        raw = open(os.path.join(shard_dir, fname), "rb").read()
        head = np.frombuffer(raw[:1024], dtype=np.int32)
        wide = head[0] == 20240801
        assert (head[0], head[1]) in ((20240520, 1), (20240801, 7)), head[:3]
        assert wide == (tok.get_vocab_size() > 65536), (fname, head[:2], tok.get_vocab_size())
        toks = np.frombuffer(raw[1024:], dtype=np.uint32 if wide else np.uint16).tolist()
        assert len(toks) == head[2], (fname, len(toks), head[2])
        got += toks
    if got != ref:
        i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        sys.exit(f"differ at token {i} of {len(ref)}: dtrain {got[i:i + 8]} tokenizers {ref[i:i + 8]}")
    print(f"equal {len(ref)} in {len(files)} shards")


def gpt2json(vocab, out):
    from transformers import GPT2TokenizerFast
    tok = GPT2TokenizerFast(vocab_file=os.path.join(vocab, "encoder.json"), merges_file=os.path.join(vocab, "vocab.bpe"))
    os.makedirs(out, exist_ok=True)
    tok.backend_tokenizer.save(os.path.join(out, "tokenizer.json"))


def auto(ckpt, prompt, new):
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = GPT2LMHeadModel.from_pretrained(ckpt).eval()
    ids = tok(prompt)["input_ids"]
    print("class " + type(tok).__name__)
    print("prompt " + " ".join(map(str, ids)))
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(int(new)):
            nxt = model(x).logits[0, -1].argmax()
            x = torch.cat([x, nxt.view(1, 1)], 1)
    print("greedy " + tok.decode(x[0].tolist(), skip_special_tokens=False).encode().hex())


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2])
    elif cmd == "decode":
        decode(*sys.argv[2:5])
    elif cmd == "shards":
        shards(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    elif cmd == "gpt2json":
        gpt2json(*sys.argv[2:4])
    elif cmd == "auto":
        auto(*sys.argv[2:5])
    else:
        sys.exit(__doc__)
