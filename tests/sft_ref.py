"""transformers' apply_chat_template as the judge of `dtrain data sft` (tests/data/test_sft.cpp).

  sft_ref.py make OUT ROWS
      Trains two small byte-level BPEs with `tokenizers` on a generated multilingual text, with the
      special tokens of the built-in templates added (<|endoftext|>, ChatML's and Llama 3's) and a
      ByteLevel post-processor without offset trimming (as Qwen2's and Llama 3's files have it):
      OUT/tokenizer.json with GPT-2's pre-tokenizer, OUT/l3/tokenizer.json with Llama 3's (its
      Split pattern, then ByteLevel; ignore_merges). Writes OUT/corpus.jsonl: ROWS random
      rows, prompt/completion and multi-turn chats (a system prompt or none, an empty one, empty
      user turns, unicode of several scripts and emoji, leading and trailing white space of every
      kind that Python's str.strip() strips, "\\n\\n" inside turns, a special token's text inside
      a turn).
  sft_ref.py check CORPUS SHARD_DIR...
      For each SHARD_DIR that `dtrain data sft CORPUS --template NAME --out SHARD_DIR` wrote:
      AutoTokenizer.from_pretrained(SHARD_DIR) (tokenizer.json and the tokenizer_config.json
      holding dtrain's chat_template), then per row apply_chat_template(messages, tokenize=True,
      return_dict=True, return_assistant_tokens_mask=True): its input_ids must equal the row's
      document in the shards (the .bin tokens between the .sft's document offsets) and its
      assistant_masks the .sft's mask. The mask is transformers' own, from the {% generation %}
      blocks of the template. Prints "equal <rows> rows (<tokens> tokens, <targets> targets) in
      <dir>" per directory; exit 1 with the first difference.
"""
import json
import os
import random
import struct
import sys

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

WORDS = ["the", "The", "of", "and", "a", "to", "in", "is", "you", "that", "it", "was", "for", "on", "are",
         "with", "they", "I", "at", "be", "this", "have", "from", "or", "one", "what", "all", "when", "your",
         "can't", "don't", "we'll", "answer", "question", "Q:", "A:", "riddle", "fortune", "token", "model",
         "naïve", "café", "Straße", "Łódź", "привет", "мир", "Ελλάδα", "日本語", "中文", "한국어", "مرحبا",
         "😀", "🚀", "👍🏽", "x²", "½", "42", "2024", "3.14159", "1,000", "#include", "x = y + 1;", "{}",
         "<b>", "--", "...", "?!", "(", ")", "\"quoted\"", "'single'"]
# what Python's str.strip() strips (str.isspace): ASCII white space, U+001C..U+001F, NEL, NBSP,
# the Unicode spaces, line and paragraph separators
SPACES = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u2003",
          "\u3000", "\u2028", "\u202f"]


def sentence(rng, n=None):
    n = n if n is not None else rng.randint(1, 14)
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        out.append(w)
        out.append(rng.choice([" ", " ", " ", " ", ", ", ". ", "\n", "\n\n", "  ", "\t"]))
    return "".join(out).rstrip(" ")


def content(rng, allow_empty=False):
    r = rng.random()
    if allow_empty and r < 0.08:
        return ""
    s = sentence(rng)
    if rng.random() < 0.3:
        s = rng.choice(SPACES) + s
    if rng.random() < 0.3:
        s = s + rng.choice(SPACES)
    if rng.random() < 0.04:
        s = s + " " + rng.choice(SPECIALS) + " " + sentence(rng, 2)
    if rng.random() < 0.05:
        s = rng.choice(SPACES) * 2 + s  # only white space around it, several kinds
    return s


def make_row(rng):
    if rng.random() < 0.3:
        return {"prompt": content(rng, allow_empty=True), "completion": content(rng)}
    msgs = []
    r = rng.random()
    if r < 0.15:
        msgs.append({"role": "system", "content": ""})
    elif r < 0.55:
        msgs.append({"role": "system", "content": content(rng)})
    for t in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": content(rng, allow_empty=True)})
        a = content(rng)
        if not a.strip(" "):
            a = "ok"
        msgs.append({"role": "assistant", "content": a})
    return {"messages": msgs}


def make(out, rows):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    os.makedirs(out, exist_ok=True)
    rng = random.Random(20261129)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    train_text = [sentence(rng, 40) for _ in range(400)]
    tok.train_from_iterator(train_text, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    # Llama 3's way: its split pattern, then ByteLevel without GPT-2's, ignore_merges
    l3 = Tokenizer(models.BPE(ignore_merges=True))
    l3.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    l3.post_processor = processors.ByteLevel(trim_offsets=False)
    l3.decoder = decoders.ByteLevel()
    l3.train_from_iterator(train_text, trainer)
    os.makedirs(os.path.join(out, "l3"), exist_ok=True)
    l3.save(os.path.join(out, "l3", "tokenizer.json"))
    with open(os.path.join(out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(rows):
            f.write(json.dumps(make_row(rng), ensure_ascii=rng.random() < 0.5) + "\n")
    print("made %d rows, vocabulary %d" % (rows, tok.get_vocab_size()))


def read_shards(d, split="train"):
    """The documents of a split: a list of (ids, mask)."""
    docs = []
    names = sorted(n for n in os.listdir(d) if n.startswith(split + "_") and n.endswith(".bin"))
    for n in names:
        with open(os.path.join(d, n), "rb") as f:
            h = struct.unpack("<256i", f.read(1024))
            width = {20240520: "H", 20240801: "I"}[h[0]]
            ids = list(struct.unpack("<%d%s" % (h[2], width), f.read(h[2] * struct.calcsize(width))))
        with open(os.path.join(d, n[:-4] + ".sft"), "rb") as f:
            s = struct.unpack("<256i", f.read(1024))
            assert s[0] == 0x54465344 and s[1] == 1 and s[2] == len(ids) and s[4] == 1, (n, s[:5])
            starts = struct.unpack("<%dI" % (s[3] + 1), f.read(4 * (s[3] + 1)))
            mask = list(f.read(s[2]))
            assert f.read() == b""
        for a, b in zip(starts, starts[1:]):
            docs.append((ids[a:b], mask[a:b]))
    return docs


def messages_of(row):
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]


def check(corpus, dirs):
    from transformers import AutoTokenizer
    rows = [json.loads(l) for l in open(corpus, encoding="utf-8") if l.strip()]
    bad = 0
    for d in dirs:
        tok = AutoTokenizer.from_pretrained(d)
        docs = read_shards(d)
        if len(docs) != len(rows):
            print("%s: %d documents for %d rows" % (d, len(docs), len(rows)))
            sys.exit(1)
        ntok = ntarget = 0
        for i, (row, (ids, mask)) in enumerate(zip(rows, docs)):
            out = tok.apply_chat_template(messages_of(row), tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            want_ids, want_mask = list(out["input_ids"]), list(out["assistant_masks"])
            if ids != want_ids or mask != want_mask:
                k = next((j for j in range(min(len(ids), len(want_ids)))
                          if ids[j] != want_ids[j] or mask[j] != want_mask[j]), min(len(ids), len(want_ids)))
                print("%s: row %d differs at token %d (dtrain %d tokens, transformers %d)" % (d, i, k, len(ids),
                                                                                           len(want_ids)))
                print("  row: %s" % json.dumps(row))
                print("  rendered: %r" % tok.apply_chat_template(messages_of(row), tokenize=False))
                print("  dtrain:       %s" % list(zip(ids, mask))[max(0, k - 3):k + 5])
                print("  transformers: %s" % list(zip(want_ids, want_mask))[max(0, k - 3):k + 5])
                print("  tokens: %r" % tok.convert_ids_to_tokens(want_ids[max(0, k - 3):k + 5]))
                bad += 1
                break
            ntok += len(ids)
            ntarget += sum(mask)
        else:
            print("equal %d rows (%d tokens, %d targets) in %s" % (len(rows), ntok, ntarget, d))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: sft_ref.py make OUT ROWS | check CORPUS SHARD_DIR...")
