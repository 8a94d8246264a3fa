// tokenizer.json -> hf::Spec: every key read with its type checked; anything dtrain does not run
// as `tokenizers` runs it is refused with the file, the key and what is unsupported.
#include "data/hf_tokenizer_json.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "core/error.h"
#include "core/log.h"
#include "data/pcre_regex.h"

namespace dtrain::hf {
namespace {

using json = nlohmann::json;

// Token ids are below 2^24 (16,777,216, far beyond any vocabulary): the tables indexed by id stay
// bounded whatever a file claims.
constexpr int64_t kIdLimit = int64_t(1) << 24;
// JSON nested deeper than this is no tokenizer.json (theirs nest ~8 levels); the parser recurses
// once per level.
constexpr size_t kMaxNesting = 100;

// The deepest nesting of arrays and objects in `text`, strings skipped.
size_t nesting(std::string_view text) {
  size_t depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

const char* const kSupportedPre = "supported: ByteLevel, Split, Digits and a Sequence of them";
const char* const kSupportedPost = "supported: ByteLevel, TemplateProcessing and a Sequence of them";

class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    user_error("{}: {}: {}", file_, where, what);
  }
  [[noreturn]] void unsupported(const std::string& where, const std::string& what) const {
    user_error("{}: {} is not supported: {}", file_, where, what);
  }
  // obj[key]; a missing key fails.
  const json& need(const json& obj, const std::string& where, const char* key) const {
    auto it = obj.find(key);
    if (it == obj.end()) fail(where, fmt::format("missing key \"{}\"", key));
    return *it;
  }
  // obj[key], nullptr when it is absent or null.
  static const json* opt(const json& obj, const char* key) {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const json& object(const json& v, const std::string& where) const {
    if (!v.is_object()) fail(where, fmt::format("expected an object, got {}", v.type_name()));
    return v;
  }
  const json& array(const json& v, const std::string& where) const {
    if (!v.is_array()) fail(where, fmt::format("expected an array, got {}", v.type_name()));
    return v;
  }
  std::string str(const json& v, const std::string& where) const {
    if (!v.is_string()) fail(where, fmt::format("expected a string, got {}", v.type_name()));
    return v.get<std::string>();
  }
  int32_t id(const json& v, const std::string& where) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= kIdLimit)
      fail(where, fmt::format("expected a token id (an integer 0 to {}), got {}", kIdLimit - 1, v.dump()));
    return int32_t(v.get<int64_t>());
  }
  // obj[key] as a bool: `dflt` when absent or null.
  bool flag(const json& obj, const std::string& where, const char* key, bool dflt) const {
    const json* v = opt(obj, key);
    if (!v) return dflt;
    if (!v->is_boolean()) fail(where + "." + key, fmt::format("expected true or false, got {}", v->dump()));
    return v->get<bool>();
  }
  std::string type(const json& obj, const std::string& where) const {
    object(obj, where);
    return str(need(obj, where, "type"), where + ".type");
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

// The model: a BPE with its vocabulary and merges.
void read_model(const Reader& r, const json& m, Spec& s) {
  r.object(m, "model");
  if (const json* t = Reader::opt(m, "type")) {
    const std::string type = r.str(*t, "model.type");
    if (type != "BPE")
      r.unsupported(fmt::format("model.type \"{}\"", type),
                    "dtrain reads byte-level BPE tokenizers only (model.type \"BPE\")");
  } else if (!m.contains("merges")) {
    r.fail("model", "no \"type\" and no \"merges\": not a BPE model");
  }
  if (const json* d = Reader::opt(m, "dropout")) {
    if (!d->is_number()) r.fail("model.dropout", fmt::format("expected a number or null, got {}", d->dump()));
    if (d->get<double>() != 0.0)
      r.unsupported(fmt::format("model.dropout {}", d->dump()), "BPE-dropout draws merges at random; set it to null");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = Reader::opt(m, key); v && !r.str(*v, std::string("model.") + key).empty())
      r.unsupported(fmt::format("model.{} {}", key, v->dump()), "a byte-level BPE has no word prefix or suffix");
  if (r.flag(m, "model", "byte_fallback", false))
    r.unsupported("model.byte_fallback true",
                  "<0xNN> byte tokens belong to SentencePiece-style BPE, not byte-level BPE");
  s.fuse_unk = r.flag(m, "model", "fuse_unk", false);
  s.ignore_merges = r.flag(m, "model", "ignore_merges", false);
  if (const json* u = Reader::opt(m, "unk_token")) s.unk_token = r.str(*u, "model.unk_token");

  const json& vocab = r.object(r.need(m, "model", "vocab"), "model.vocab");
  std::unordered_map<std::string, int32_t> ids;
  ids.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int32_t id = r.id(it.value(), "model.vocab[\"" + it.key() + "\"]");
    s.vocab.emplace_back(it.key(), id);
    ids[it.key()] = id;
  }
  const json& merges = r.array(r.need(m, "model", "merges"), "model.merges");
  const bool legacy = !merges.empty() && merges[0].is_string();  // "a b" (older files) or ["a", "b"]
  auto lookup = [&](const std::string& tok, size_t i) {
    auto it = ids.find(tok);
    if (it == ids.end())
      r.fail(fmt::format("model.merges[{}]", i), fmt::format("token \"{}\" is not in model.vocab", tok));
    return it->second;
  };
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& e = merges[i];
    const std::string where = fmt::format("model.merges[{}]", i);
    std::string a, b;
    if (legacy) {
      const std::string line = r.str(e, where + " (the merges are strings \"a b\")");
      if (line.rfind("#version", 0) == 0) continue;
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
        r.fail(where, fmt::format("expected two tokens separated by one space, got \"{}\"", line));
      a = line.substr(0, sp), b = line.substr(sp + 1);
    } else {
      if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_string())
        r.fail(where, fmt::format("expected a pair of tokens [\"a\", \"b\"] (the merges are pairs), got {}", e.dump()));
      a = e[0].get<std::string>(), b = e[1].get<std::string>();
    }
    s.merges.emplace_back(lookup(a, i), lookup(b, i));
    s.merged.push_back(lookup(a + b, i));
  }
}

// Added tokens, with the ids `tokenizers` gives them: the vocabulary's id when the content is in
// it, else the next id after the vocabulary (or after the last added one).
void read_added(const Reader& r, const json& arr, Spec& s) {
  r.array(arr, "added_tokens");
  std::unordered_map<std::string, int32_t> vocab(s.vocab.begin(), s.vocab.end()), added;
  int64_t max_added = -1;
  for (size_t i = 0; i < arr.size(); ++i) {
    const std::string where = fmt::format("added_tokens[{}]", i);
    const json& e = r.object(arr[i], where);
    AddedToken t;
    t.content = r.str(r.need(e, where, "content"), where + ".content");
    const int32_t listed = r.id(r.need(e, where, "id"), where + ".id");
    t.single_word = r.flag(e, where, "single_word", false);
    t.lstrip = r.flag(e, where, "lstrip", false);
    t.rstrip = r.flag(e, where, "rstrip", false);
    t.normalized = r.flag(e, where, "normalized", true);
    t.special = r.flag(e, where, "special", false);
    if (t.content.empty()) continue;  // tokenizers ignores it
    if (added.count(t.content)) r.unsupported(where, fmt::format("the token \"{}\" is listed twice", t.content));
    if (auto v = vocab.find(t.content); v != vocab.end()) {
      t.id = v->second;
    } else {
      const int64_t n = int64_t(s.vocab.size());
      t.id = int32_t(max_added < 0 ? n : (max_added >= n || n == 0 ? max_added + 1 : n));
    }
    if (t.id != listed)
      log::warn("{}: {}: \"{}\" has id {} in the file; tokenizers gives it {}, and so does dtrain", r.file(), where,
                t.content, listed, t.id);
    added[t.content] = t.id;
    max_added = std::max<int64_t>(max_added, t.id);
    s.added.push_back(t);
  }
}

// One pre-tokenizer (a Sequence: its steps in order) appended to s.pre.
void read_pre(const Reader& r, const json& p, const std::string& where, Spec& s) {
  const std::string type = r.type(p, where);
  PreStep step;
  if (type == "Sequence") {
    const json& steps = r.array(r.need(p, where, "pretokenizers"), where + ".pretokenizers");
    for (size_t i = 0; i < steps.size(); ++i) read_pre(r, steps[i], fmt::format("{}.pretokenizers[{}]", where, i), s);
    return;
  }
  if (type == "ByteLevel") {
    step.byte_level = true;
    const json& aps = r.need(p, where, "add_prefix_space");
    if (!aps.is_boolean()) r.fail(where + ".add_prefix_space", "expected true or false");
    step.add_prefix_space = aps.get<bool>();
    step.use_regex = r.flag(p, where, "use_regex", true);
    step.pattern = kGpt2Pattern;
    step.source = "ByteLevel's GPT-2 pattern";
  } else if (type == "Digits") {
    step.pattern = R"(\p{N})";  // Rust's char::is_numeric, a match per character
    step.behavior = r.flag(p, where, "individual_digits", false) ? Behavior::Isolated : Behavior::Contiguous;
    step.source = "Digits";
    step.digits = true;
  } else if (type == "Split") {
    const json& pat = r.object(r.need(p, where, "pattern"), where + ".pattern");
    if (const json* re = Reader::opt(pat, "Regex")) {
      step.source = r.str(*re, where + ".pattern.Regex");
      try {
        step.pattern = oniguruma_to_pcre2(step.source);
      } catch (const std::invalid_argument& e) {
        r.unsupported(fmt::format("{}.pattern.Regex {}", where, json(step.source).dump()), e.what());
      }
    } else if (const json* lit = Reader::opt(pat, "String")) {
      step.source = r.str(*lit, where + ".pattern.String");
      step.pattern = step.source;
      step.literal = true;
    } else {
      r.fail(where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string b = r.str(r.need(p, where, "behavior"), where + ".behavior");
    static const std::pair<const char*, Behavior> kBehaviors[] = {{"Removed", Behavior::Removed},
                                                                  {"Isolated", Behavior::Isolated},
                                                                  {"MergedWithPrevious", Behavior::MergedWithPrevious},
                                                                  {"MergedWithNext", Behavior::MergedWithNext},
                                                                  {"Contiguous", Behavior::Contiguous}};
    bool known = false;
    for (const auto& [name, v] : kBehaviors)
      if (b == name) step.behavior = v, known = true;
    if (!known)
      r.fail(where + ".behavior", fmt::format("\"{}\": expected Removed, Isolated, MergedWithPrevious, MergedWithNext "
                                              "or Contiguous",
                                              b));
    const json& inv = r.need(p, where, "invert");
    if (!inv.is_boolean()) r.fail(where + ".invert", "expected true or false");
    step.invert = inv.get<bool>();
  } else {
    r.unsupported(fmt::format("{} {}", where, type), kSupportedPre);
  }
  if (!s.pre.empty() && s.pre.back().byte_level)
    r.unsupported(fmt::format("{} {} after ByteLevel", where, type),
                  "ByteLevel must be the last pre-tokenizer (later steps would see its byte symbols)");
  s.pre.push_back(step);
}

// The ids a post-processor adds around one text with add_special_tokens=True.
void read_post(const Reader& r, const json& p, const std::string& where, Spec& s) {
  const std::string type = r.type(p, where);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json& steps = r.array(r.need(p, where, "processors"), where + ".processors");
    for (size_t i = 0; i < steps.size(); ++i) read_post(r, steps[i], fmt::format("{}.processors[{}]", where, i), s);
    return;
  }
  if (type != "TemplateProcessing") r.unsupported(fmt::format("{} {}", where, type), kSupportedPost);
  const json& special = r.object(r.need(p, where, "special_tokens"), where + ".special_tokens");
  const json& single = r.array(r.need(p, where, "single"), where + ".single");
  std::vector<int32_t> before, after;
  int sequences = 0;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string w = fmt::format("{}.single[{}]", where, i);
    const json& piece = r.object(single[i], w);
    if (const json* seq = Reader::opt(piece, "Sequence")) {
      const std::string id = r.str(r.need(r.object(*seq, w + ".Sequence"), w + ".Sequence", "id"), w + ".Sequence.id");
      if (id != "A")
        r.unsupported(fmt::format("{} Sequence {}", w, id), "a single text's template holds sequence A only");
      ++sequences;
    } else if (const json* tok = Reader::opt(piece, "SpecialToken")) {
      const std::string name =
          r.str(r.need(r.object(*tok, w + ".SpecialToken"), w + ".SpecialToken", "id"), w + ".SpecialToken.id");
      auto it = special.find(name);
      if (it == special.end()) r.fail(w, fmt::format("special token \"{}\" is not in {}.special_tokens", name, where));
      const std::string sw = fmt::format("{}.special_tokens[\"{}\"]", where, name);
      const json& ids = r.array(r.need(r.object(*it, sw), sw, "ids"), sw + ".ids");
      for (size_t k = 0; k < ids.size(); ++k)
        (sequences ? after : before).push_back(r.id(ids[k], fmt::format("{}.ids[{}]", sw, k)));
    } else {
      r.fail(w, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
  }
  if (sequences != 1)
    r.unsupported(fmt::format("{}.single with {} sequences", where, sequences), "the template must hold $A once");
  // a later template wraps what the earlier ones made
  s.before.insert(s.before.begin(), before.begin(), before.end());
  s.after.insert(s.after.end(), after.begin(), after.end());
}

}  // namespace

Spec read_tokenizer_json(const std::string& file) {
  Reader r(file);
  std::ifstream f(file, std::ios::binary);
  if (!f) user_error("{}: cannot open", file);
  std::stringstream buf;
  buf << f.rdbuf();
  const std::string text = buf.str();
  if (nesting(text) > kMaxNesting) user_error("{}: nested deeper than {} levels: not a tokenizer.json", file, kMaxNesting);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    user_error("{}: not valid JSON: {}", file, e.what());
  }
  if (!j.is_object())
    user_error("{}: expected a JSON object (a Hugging Face tokenizer.json), got {}", file, j.type_name());
  Spec s;
  s.file = file;
  if (const json* v = Reader::opt(j, "version"); v && r.str(*v, "version") != "1.0")
    r.unsupported(fmt::format("version {}", v->dump()), "tokenizers reads version \"1.0\"");
  read_model(r, r.need(j, "(top level)", "model"), s);
  if (const json* a = Reader::opt(j, "added_tokens")) read_added(r, *a, s);

  if (const json* n = Reader::opt(j, "normalizer")) {
    const std::string type = r.type(*n, "normalizer");
    const json* list =
        type == "Sequence" ? &r.array(r.need(*n, "normalizer", "normalizers"), "normalizer.normalizers") : nullptr;
    if (!list || !list->empty()) {
      std::string name = type;
      if (list) {
        name += " of";
        for (const json& x : *list) name += " " + (x.is_object() && x.contains("type") ? x["type"].dump() : x.dump());
      }
      r.unsupported(
          "normalizer " + name,
          "dtrain applies no normalizer (the byte-level BPE tokenizers of GPT-2, Llama 3 and SmolLM have none)");
    }
  }
  const json* pre = Reader::opt(j, "pre_tokenizer");
  if (!pre) r.unsupported("pre_tokenizer null", "a byte-level BPE needs a ByteLevel pre-tokenizer");
  read_pre(r, *pre, "pre_tokenizer", s);
  if (s.pre.empty() || !s.pre.back().byte_level)
    r.unsupported("pre_tokenizer without ByteLevel", "dtrain reads byte-level BPE tokenizers only (ByteLevel, last)");

  if (const json* post = Reader::opt(j, "post_processor")) read_post(r, *post, "post_processor", s);
  const json* dec = Reader::opt(j, "decoder");
  const std::string dtype = dec ? r.type(*dec, "decoder") : "null";
  if (dtype != "ByteLevel")
    r.unsupported("decoder " + dtype, "dtrain decodes byte-level BPE with the ByteLevel decoder");
  return s;
}

}  // namespace dtrain::hf
