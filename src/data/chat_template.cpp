#include "data/chat_template.h"

#include <iterator>
#include <map>

#include "core/error.h"
#include "data/tokenizer.h"
#include "data/utf8.h"

namespace dtrain::sft {

namespace {

// The Jinja texts, one line each (transformers renders them with trim_blocks and lstrip_blocks,
// which then change nothing). A "\n" inside a Jinja string literal is Jinja's escape.
//
// chatml: Qwen2-Instruct's template (a default system prompt when the conversation has none),
// the assistant's content and <|im_end|> in a generation block.
const std::string kChatml =
    R"({% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})";

// llama3: Meta-Llama-3-Instruct's template (<|begin_of_text|> first, each content trimmed),
// the assistant's content and <|eot_id|> in a generation block.
const std::string kLlama3 =
    R"({{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %})";

// plain: "<system>\n\n" (when not empty), "### Prompt:\n<user>\n\n### Response:\n", then
// "<assistant><eos>" in a generation block, "\n\n" between turns.
const std::string kPlain =
    R"({% for message in messages %}{% if message['role'] == 'system' %}{% if message['content'] %}{{ message['content'] + '\n\n' }}{% endif %}{% elif message['role'] == 'user' %}{{ '### Prompt:\n' + message['content'] + '\n\n### Response:\n' }}{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% if not loop.last %}{{ '\n\n' }}{% endif %}{% endif %}{% endfor %})";

const std::map<std::string, const std::string*>& table() {
  static const std::map<std::string, const std::string*> t = {
      {"chatml", &kChatml}, {"llama3", &kLlama3}, {"plain", &kPlain}};
  return t;
}

// Python's str.isspace() for one code point: Unicode's White_Space and the four separators
// U+001C..U+001F (bidirectional class B or S).
bool py_space(char32_t c) { return utf8::is_white_space(c) || (c >= 0x1c && c <= 0x1f); }

}  // namespace

const char* role_name(Role r) {
  static constexpr const char* kNames[] = {"system", "user", "assistant"};  // in Role's order
  const auto i = size_t(r);
  return i < std::size(kNames) ? kNames[i] : "?";
}

std::string py_strip(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e) {
    const size_t n = utf8::seq_len(s, b);
    if (n == 0 || !py_space(utf8::decode(s, b, n))) break;
    b += n;
  }
  while (e > b) {
    size_t k = e - 1;
    while (k > b && (static_cast<unsigned char>(s[k]) & 0xc0) == 0x80) --k;
    const size_t n = utf8::seq_len(s, k);
    if (n != e - k || !py_space(utf8::decode(s, k, n))) break;
    e = k;
  }
  return std::string(s.substr(b, e - b));
}

std::vector<std::string> ChatTemplate::names() {
  std::vector<std::string> n;
  for (const auto& [k, v] : table()) n.push_back(k);
  return n;
}

const std::string& ChatTemplate::jinja(const std::string& name) {
  auto it = table().find(name);
  if (it == table().end()) user_error("chat template '{}': unknown (built in: chatml, llama3, plain)", name);
  return *it->second;
}

const std::string& ChatTemplate::jinja() const { return jinja(name_); }

ChatTemplate::ChatTemplate(const std::string& name, const Tokenizer& tok, const std::string& eos)
    : name_(name), tok_(tok) {
  jinja(name);  // known?
  std::vector<std::string> need;
  if (name == "chatml") need = {"<|im_start|>", "<|im_end|>"};
  if (name == "llama3") need = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  if (name == "plain" && !eos.empty()) {
    eos_ = eos;
    need = {eos};
  }
  for (const auto& t : need) {
    const int32_t id = tok.added_token_id(t);
    if (id < 0)
      user_error("chat template {} writes the special token {}, which tokenizer {} does not have (a tokenizer.json "
                 "with it among its added_tokens is needed)",
                 name, t, tok.name());
    special_.emplace_back(t, id);
  }
}

int32_t ChatTemplate::id(const std::string& token) const {
  for (const auto& [t, i] : special_)
    if (t == token) return i;
  fault("chat template {}: no id for {}", name_, token);
}

std::vector<Part> ChatTemplate::render(const std::vector<Message>& messages) const {
  std::vector<Part> p;
  auto text = [&](std::string s, bool target = false) {
    if (!s.empty()) p.push_back({std::move(s), -1, target});
  };
  auto special = [&](const std::string& t, bool target = false) { p.push_back({t, id(t), target}); };
  if (name_ == "chatml") {
    for (size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      if (i == 0 && m.role != Role::System) {
        special("<|im_start|>");
        text("system\nYou are a helpful assistant.");
        special("<|im_end|>");
        text("\n");
      }
      special("<|im_start|>");
      const bool a = m.role == Role::Assistant;
      if (a) {
        text("assistant\n");
        text(m.content, true);
      } else {
        text(std::string(role_name(m.role)) + "\n" + m.content);
      }
      special("<|im_end|>", a);
      text("\n");
    }
  } else if (name_ == "llama3") {
    special("<|begin_of_text|>");
    for (const Message& m : messages) {
      const bool a = m.role == Role::Assistant;
      special("<|start_header_id|>");
      text(role_name(m.role));
      special("<|end_header_id|>");
      text("\n\n");
      text(py_strip(m.content), a);
      special("<|eot_id|>", a);
    }
  } else {  // plain
    for (size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      if (m.role == Role::System) {
        if (!m.content.empty()) text(m.content + "\n\n");
      } else if (m.role == Role::User) {
        text("### Prompt:\n" + m.content + "\n\n### Response:\n");
      } else {
        text(m.content, true);
        if (!eos_.empty()) special(eos_, true);
        if (i + 1 < messages.size()) text("\n\n");
      }
    }
  }
  return p;
}

Encoded ChatTemplate::encode(const std::vector<Message>& messages) const {
  const std::vector<Part> parts = render(messages);
  Encoded out;
  std::string run;
  std::vector<std::pair<size_t, size_t>> targets;  // byte ranges of target parts in `run`
  auto flush = [&] {
    if (run.empty()) return;
    const std::vector<int32_t> ids = tok_.encode(run);
    size_t at = 0;
    size_t k = 0;  // first target range that may still overlap
    for (int32_t t : ids) {
      const size_t n = tok_.decode({t}).size();
      const size_t b = at, e = at + n;
      at = e;
      while (k < targets.size() && targets[k].second <= b) ++k;
      const bool target = k < targets.size() && targets[k].first < e && b < targets[k].second;
      out.ids.push_back(t);
      out.mask.push_back(target ? 1 : 0);
    }
    if (at != run.size())
      user_error("the text of a rendered message ({} bytes) is spelled by tokens of {} bytes (an added token with "
                 "lstrip or rstrip in the text?)",
                 run.size(), at);
    run.clear();
    targets.clear();
  };
  for (const Part& p : parts) {
    if (p.special >= 0) {
      flush();
      out.ids.push_back(p.special);
      out.mask.push_back(p.target ? 1 : 0);
      continue;
    }
    if (p.target) targets.emplace_back(run.size(), run.size() + p.text.size());
    run += p.text;
  }
  flush();
  return out;
}

std::string validate_messages(const std::vector<Message>& messages) {
  if (messages.empty()) return "no messages";
  for (size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role == Role::Assistant && messages[i].content.empty())
      return fmt::format("message {} (assistant) has empty content", i);
  size_t first = 0;
  while (first < messages.size() && messages[first].role == Role::System) ++first;
  if (first == messages.size()) return "only system messages";
  if (messages[first].role != Role::User)
    return fmt::format("message {} is the first after the system prompt and is from the {}, not the user", first,
                       role_name(messages[first].role));
  if (messages.back().role != Role::Assistant)
    return fmt::format("the last message is from the {}, not the assistant (nothing to train on)",
                       role_name(messages.back().role));
  return "";
}

}  // namespace dtrain::sft
