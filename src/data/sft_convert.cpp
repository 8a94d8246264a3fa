// `dtrain data sft`: JSONL chat / prompt-completion rows -> SFT shards (sft.h, sft_shards.h).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "core/error.h"
#include "core/log.h"
#include "data/sft.h"
#include "data/sft_shards.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"
#include "data/utf8.h"

namespace dtrain::data {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A JSON value as a short, printable quote for a message.
std::string quote(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return log::printable(s);
}

std::string parse_message(const json& x, size_t k, sft::Message& m) {
  if (!x.is_object()) return fmt::format("message {} is not an object but {}", k, quote(x));
  for (const char* key : {"role", "content"})
    if (!x.contains(key)) return fmt::format("message {} has no \"{}\"", k, key);
  const json& role = x["role"];
  const json& content = x["content"];
  if (!role.is_string()) return fmt::format("message {}: \"role\" is not a string but {}", k, quote(role));
  if (!content.is_string()) return fmt::format("message {}: \"content\" is not a string but {}", k, quote(content));
  const std::string r = role.get<std::string>();
  if (r == "system")
    m.role = sft::Role::System;
  else if (r == "user")
    m.role = sft::Role::User;
  else if (r == "assistant")
    m.role = sft::Role::Assistant;
  else
    return fmt::format("message {} has the unknown role {} (expected system, user or assistant)", k, quote(role));
  m.content = content.get<std::string>();
  return "";
}

// The shards of one split, staged in a directory of their own until every row is read.
class SplitWriter {
 public:
  SplitWriter(std::string dir, std::string split, int64_t shard_tokens, bool wide)
      : dir_(std::move(dir)), split_(std::move(split)), cap_(size_t(shard_tokens)), wide_(wide) {
    side_.starts = {0};
  }
  void add(const sft::Encoded& e) {
    if (!ids_.empty() && ids_.size() + e.ids.size() > cap_) flush();
    if (ids_.size() + e.ids.size() > size_t(INT32_MAX))
      user_error("data sft: a document of {} tokens does not fit a shard", e.ids.size());
    ids_.insert(ids_.end(), e.ids.begin(), e.ids.end());
    side_.mask.insert(side_.mask.end(), e.mask.begin(), e.mask.end());
    side_.starts.push_back(uint32_t(ids_.size()));
    ++documents;
    tokens += int64_t(e.ids.size());
    targets += std::count(e.mask.begin(), e.mask.end(), uint8_t(1));
  }
  void flush() {
    if (ids_.empty() && !files.empty()) return;
    const std::string name = fmt::format("{}_{:06d}.bin", split_, files.size());
    const std::string path = (fs::path(dir_) / name).string();
    if (wide_) {
      write_token_shard(path, ids_.data(), ids_.size());
    } else {
      const std::vector<uint16_t> u16(ids_.begin(), ids_.end());
      write_token_shard(path, u16.data(), u16.size());
    }
    write_sft_side(sft_side_path(path), side_);
    files.push_back(name);
    ids_.clear();
    side_.mask.clear();
    side_.starts = {0};
  }
  std::vector<std::string> files;
  int64_t documents = 0, tokens = 0, targets = 0;

 private:
  std::string dir_, split_;
  size_t cap_;
  bool wide_;
  std::vector<uint32_t> ids_;
  SftSide side_;
};

// What an earlier run left in OUT's manifest.json, checked against this run: SFT shards of the
// same template and tokenizer (whose other splits are kept), or nothing.
json earlier_manifest(const SftSpec& a, const Tokenizer& tok) {
  const fs::path p = fs::path(a.out) / "manifest.json";
  std::error_code ec;
  if (!fs::exists(p, ec)) return json::object();
  json m;
  try {
    std::ifstream f(p);
    m = json::parse(f);
  } catch (const json::exception& e) {
    user_error("data sft: {}: not JSON ({}); give another --out", p.string(), e.what());
  }
  if (!m.is_object() || !m.contains("sft"))
    user_error("data sft: {} holds other shards (its manifest.json is not of `data sft`); give another --out", a.out);
  const json& s = m["sft"];
  if (s.value("template", "") != a.template_name || m.value("tokenizer", "") != tok.name() ||
      m.value("vocab_size", -1) != tok.vocab_size())
    user_error("data sft: {} holds SFT shards of template {} and tokenizer {} ({} ids); this run's are {} and {} ({} "
               "ids): give another --out",
               a.out, s.value("template", "?"), m.value("tokenizer", "?"), m.value("vocab_size", -1), a.template_name,
               tok.name(), tok.vocab_size());
  return m;
}

bool is_split_file(const std::string& name, const std::string& split) {
  return name.rfind(split + "_", 0) == 0 &&
         (fs::path(name).extension() == ".bin" || fs::path(name).extension() == ".sft");
}

// OUT/tokenizer_config.json with the template's Jinja as chat_template (and, for plain, the
// eos_token it writes), so that transformers' apply_chat_template renders what dtrain rendered.
void write_tokenizer_config(const SftSpec& a, const sft::ChatTemplate& t, std::vector<std::string>& names) {
  const fs::path p = fs::path(a.out) / "tokenizer_config.json";
  json cfg = json::object();
  std::error_code ec;
  if (fs::exists(p, ec)) {
    try {
      std::ifstream f(p);
      cfg = json::parse(f);
    } catch (const json::exception& e) {
      user_error("data sft: {}: not JSON ({})", p.string(), e.what());
    }
  }
  cfg["chat_template"] = t.jinja();
  if (!t.eos().empty() && !cfg.contains("eos_token")) cfg["eos_token"] = t.eos();
  std::ofstream f(p);
  f << cfg.dump(2) << "\n";
  if (!f) fault("data sft: cannot write {}", p.string());
  if (std::find(names.begin(), names.end(), "tokenizer_config.json") == names.end())
    names.push_back("tokenizer_config.json");
}

}  // namespace

std::string parse_sft_row(const std::string& line, std::vector<sft::Message>& messages) {
  messages.clear();
  if (const size_t bad = utf8::first_invalid(line); bad != line.size())
    return fmt::format("not UTF-8 (byte {:#04x} at column {})", static_cast<unsigned char>(line[bad]), bad + 1);
  json j;
  try {
    j = json::parse(line);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    if (const size_t k = what.find("] "); what.rfind("[json.exception", 0) == 0 && k != std::string::npos)
      what = what.substr(k + 2);
    return "not JSON: " + log::printable(what);
  }
  if (!j.is_object()) return "not a JSON object but " + quote(j);
  const bool hm = j.contains("messages"), hp = j.contains("prompt"), hc = j.contains("completion");
  if (hm && (hp || hc)) return R"(has both "messages" and "prompt"/"completion")";
  if (hm) {
    const json& a = j["messages"];
    if (!a.is_array()) return "\"messages\" is not a list but " + quote(a);
    messages.resize(a.size());
    for (size_t k = 0; k < a.size(); ++k)
      if (std::string why = parse_message(a[k], k, messages[k]); !why.empty()) return why;
  } else if (hp || hc) {
    if (!hp) return "has \"completion\" but no \"prompt\"";
    if (!hc) return "has \"prompt\" but no \"completion\"";
    for (const char* key : {"prompt", "completion"})
      if (!j[key].is_string()) return fmt::format("\"{}\" is not a string but {}", key, quote(j[key]));
    if (j["completion"].get<std::string>().empty()) return "empty completion";
    messages = {{sft::Role::User, j["prompt"].get<std::string>()},
                {sft::Role::Assistant, j["completion"].get<std::string>()}};
  } else {
    return R"(has neither "messages" nor "prompt" and "completion")";
  }
  return sft::validate_messages(messages);
}

std::string sft_eos(const std::string& tokenizer_arg, const Tokenizer& tok) {
  if (tok.name() == "tokenizer.json") {
    const fs::path tj = find_hf_tokenizer(tokenizer_arg);
    const fs::path cfg = tj.parent_path() / "tokenizer_config.json";
    std::error_code ec;
    if (tj.filename() == "tokenizer.json" && fs::is_regular_file(cfg, ec)) {
      json c;
      try {
        std::ifstream f(cfg);
        c = json::parse(f);
      } catch (const json::exception& e) {
        user_error("{}: not JSON ({})", cfg.string(), e.what());
      }
      if (c.is_object() && c.contains("eos_token")) {
        const json& e = c["eos_token"];
        if (e.is_string()) return e.get<std::string>();
        if (e.is_object() && e.contains("content") && e["content"].is_string()) return e["content"].get<std::string>();
      }
    }
  }
  return tok.eot() >= 0 ? tok.decode({tok.eot()}) : "";
}

void sft_convert(const SftSpec& spec) {
  const SftSpec& a = spec;
  if (a.inputs.empty()) user_error("data sft: give at least one JSONL file");
  if (a.out.empty()) user_error("data sft: --out DIR is required");
  if (a.split.empty() ||
      !std::all_of(a.split.begin(), a.split.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-'; }))
    user_error("data sft: --split {}: expected letters, digits and '-' (the name starts the shard files: "
               "{}_000000.bin)",
               a.split, a.split);
  if (a.shard_tokens < 1024 || a.shard_tokens > int64_t(INT32_MAX))
    user_error("--shard-tokens: expected 1024 to {}, got {}", INT32_MAX, a.shard_tokens);
  sft::ChatTemplate::jinja(a.template_name);  // a known name, before anything is read
  for (const auto& in : a.inputs) {
    std::error_code ec;
    if (!fs::is_regular_file(in, ec)) user_error("data sft: input {} is not a file", in);
  }
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(a.tokenizer, a.vocab);
  const sft::ChatTemplate tmpl(a.template_name, *tok,
                               a.template_name == "plain" ? sft_eos(a.tokenizer, *tok) : std::string());
  if (a.template_name == "plain" && tmpl.eos().empty())
    log::warn("data sft: tokenizer {} has no end-of-text token: the plain template ends each response without one "
              "(the documents are still kept apart by the .sft files)",
              tok->name());
  std::error_code ec;
  fs::create_directories(a.out, ec);
  if (ec) user_error("data sft: cannot create --out {}: {}", a.out, ec.message());
  json manifest = earlier_manifest(a, *tok);

  // rows -> shards in a staging directory; OUT changes only once every row is read
  const fs::path stage = fs::path(a.out) / fmt::format(".sft-tmp-{}", ::getpid());
  fs::remove_all(stage, ec);
  fs::create_directories(stage, ec);
  if (ec) fault("data sft: cannot create {}: {}", stage.string(), ec.message());
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code e;
      fs::remove_all(p, e);
    }
  } cleanup{stage};
  const bool wide = tok->vocab_size() > 65536;
  SplitWriter w(stage.string(), a.split, a.shard_tokens, wide);
  int64_t rows = 0, bad = 0;
  std::string bad_list, first_why;
  std::vector<sft::Message> messages;
  for (const auto& in : a.inputs) {
    std::ifstream f(in, std::ios::binary);
    if (!f) user_error("data sft: cannot open {}", in);
    int64_t lineno = 0;
    for (std::string line; std::getline(f, line);) {
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines are no rows
      ++rows;
      std::string why = parse_sft_row(line, messages);
      sft::Encoded e;
      if (why.empty()) {
        try {
          e = tmpl.encode(messages);
        } catch (const UserError& err) {
          why = err.what();
        }
      }
      if (why.empty()) {
        w.add(e);
        continue;
      }
      if (!a.skip_bad) user_error("data sft: {}:{}: {}", in, lineno, why);
      if (++bad <= 5) bad_list += fmt::format("{}{}:{}", bad_list.empty() ? "" : ", ", in, lineno);
      if (first_why.empty()) first_why = why;
    }
    if (f.bad()) user_error("data sft: cannot read {}", in);
  }
  if (w.documents == 0)
    user_error("data sft: no row to train on in {} ({} rows, {} bad)", fmt::join(a.inputs, ", "), rows, bad);
  w.flush();

  // the new split replaces the old one's shards; other splits stay
  for (const auto& e : fs::directory_iterator(a.out, ec))
    if (e.is_regular_file() && is_split_file(e.path().filename().string(), a.split)) fs::remove(e.path());
  std::vector<std::string> sides;
  for (const auto& name : w.files) {
    const std::string side = sft_side_path(name);
    for (const auto& n : {name, side}) {
      fs::rename(stage / n, fs::path(a.out) / n, ec);
      if (ec) fault("data sft: cannot move {} into {}: {}", n, a.out, ec.message());
    }
    sides.push_back(side);
  }
  std::vector<std::string> vocab_files = copy_tokenizer_files({a.tokenizer, a.vocab, a.out, "data sft"}, *tok);
  write_tokenizer_config(a, tmpl, vocab_files);

  manifest["format"] = fmt::format(
      "llm.c token shards ({}) with dtrain SFT side files (<shard>.sft, version {}: documents and loss mask)",
      wide ? "magic 20240801, version 7, uint32 tokens" : "magic 20240520, version 1, uint16 tokens", kSftVersion);
  manifest["tokenizer"] = tok->name();
  manifest["vocab_size"] = tok->vocab_size();
  manifest["eot"] = tok->eot();
  manifest["vocab_files"] = vocab_files;
  manifest["sft"] = {{"version", kSftVersion}, {"template", a.template_name}};
  if (!tmpl.eos().empty()) manifest["sft"]["eos_token"] = tmpl.eos();
  manifest[a.split] = {{"files", w.files},       {"side_files", sides},     {"tokens", w.tokens},
                       {"documents", w.documents}, {"target_tokens", w.targets}, {"inputs", a.inputs},
                       {"rows", rows},            {"skipped_rows", bad}};
  std::ofstream mf(fs::path(a.out) / "manifest.json");
  mf << manifest.dump(2) << "\n";
  if (!mf) fault("data sft: cannot write {}/manifest.json", a.out);
  if (bad > 0)
    log::warn("data sft: skipped {} bad row(s) of {}: {}{} (first: {})", bad, rows, bad_list, bad > 5 ? ", ..." : "",
              log::printable(first_why));
  log::console(fmt::format("data sft: {} document(s) with template {} and tokenizer {}: {} tokens ({} targets) in {} "
                           "shard(s) {}_*.bin + .sft -> {}",
                           w.documents, a.template_name, tok->name(), w.tokens, w.targets, w.files.size(), a.split,
                           a.out));
}

}  // namespace dtrain::data
