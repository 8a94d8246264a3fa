#pragma once
// Built-in chat templates of `dtrain data sft` (docs/finetune.md): chatml (Qwen2's), llama3
// (Llama 3 instruct's) and plain (a prompt/response text). Each is carried twice: as the Jinja
// text that Hugging Face's apply_chat_template renders (written into the output's
// tokenizer_config.json as "chat_template", and what tests/sft_ref.py judges dtrain by), and as
// C++ below that renders the same text. The Jinja marks what the model is trained to write with
// {% generation %} ... {% endgeneration %}, so transformers' return_assistant_tokens_mask gives the
// same loss mask as dtrain's: each assistant message's content and the token that closes it
// (<|im_end|>, <|eot_id|>, the end-of-text token), never the role header before it.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {
class Tokenizer;
}

namespace dtrain::sft {

enum class Role { System, User, Assistant };
const char* role_name(Role r);

struct Message {
  Role role = Role::User;
  std::string content;
};

// One piece of a rendered conversation: text, or a special token (its text and id); `target`
// inside a {% generation %} block.
struct Part {
  std::string text;
  int32_t special = -1;  // >= 0: the added token's id
  bool target = false;
};

// A conversation's token ids and loss mask (1 = a target: the model is trained to predict it).
struct Encoded {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
};

class ChatTemplate {
 public:
  // name: chatml | llama3 | plain. The special tokens it writes must be added tokens of `tok`
  // (chatml: <|im_start|> <|im_end|>; llama3: <|begin_of_text|> <|start_header_id|>
  // <|end_header_id|> <|eot_id|>; plain: the end-of-text token `eos`, e.g. "<|endoftext|>", or
  // none when `eos` is "": the byte tokenizer's responses end without one). UserError naming the
  // template and the missing token otherwise, or for an unknown name.
  ChatTemplate(const std::string& name, const Tokenizer& tok, const std::string& eos);

  const std::string& name() const { return name_; }
  const std::string& eos() const { return eos_; }  // plain's end-of-text token ("": none)
  // The Jinja text (Hugging Face's chat_template) this template renders as.
  const std::string& jinja() const;

  // The conversation rendered as apply_chat_template(messages, add_generation_prompt=False) renders
  // it, in parts. The messages are assumed valid (validate_messages).
  std::vector<Part> render(const std::vector<Message>& messages) const;
  // Ids and mask: each special part is its id (mask = its target flag); each run of text between
  // two special parts is encoded whole, as transformers encodes the rendered text (so a merge
  // may cross a text part's end), and a token is a target when its bytes overlap a target
  // part's. UserError when the run's tokens do not spell it (an added token in the text with
  // lstrip/rstrip).
  Encoded encode(const std::vector<Message>& messages) const;

  static std::vector<std::string> names();          // chatml, llama3, plain
  static const std::string& jinja(const std::string& name);  // UserError for an unknown name

 private:
  int32_t id(const std::string& token) const;
  std::string name_, eos_;
  const Tokenizer& tok_;
  std::vector<std::pair<std::string, int32_t>> special_;
};

// Why `messages` cannot be trained on, "" when they can: no message; an assistant message with
// empty content; the first message other than a system prompt not from the user; the last not
// from the assistant.
std::string validate_messages(const std::vector<Message>& messages);

// Python's str.strip() (Jinja's trim filter): the white space of str.isspace() off both ends.
std::string py_strip(std::string_view s);

}  // namespace dtrain::sft
