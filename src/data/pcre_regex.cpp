#include "data/pcre_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include "core/error.h"
#include "data/utf8.h"

namespace dtrain {

const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+)"
                                 R"(|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+)";

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  return pcre2_get_error_message(code, buf, sizeof buf) < 0 ? std::to_string(code) : reinterpret_cast<const char*>(buf);
}

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(const pcre2_code* c) : md(pcre2_match_data_create_from_pattern(c, nullptr)) {
    if (!md) fault("tokenizer: out of memory for PCRE2 match data");
  }
  ~MatchData() { pcre2_match_data_free(md); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
};

}  // namespace

struct PcreRegex::Impl {
  pcre2_code* code = nullptr;
  std::string pattern;
  ~Impl() { pcre2_code_free(code); }
  // pcre2_match, again without JIT when the JIT stack runs out (the interpreter keeps its
  // backtracking state on the heap). Returns rc (> 0 a match, PCRE2_ERROR_NOMATCH none).
  int match(std::string_view s, size_t at, uint32_t options, pcre2_match_data* md) const {
    const auto* p = reinterpret_cast<PCRE2_SPTR>(s.data());
    int rc = pcre2_match(code, p, s.size(), at, options | PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(code, p, s.size(), at, options | PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)
      fault("tokenizer: PCRE2 failed on pattern {} at byte {}: {}", pattern, at, pcre2_message(rc));
    return rc;
  }
};

PcreRegex::PcreRegex(const std::string& pattern, bool literal) : p_(std::make_unique<Impl>()) {
  p_->pattern = pattern;
  int err = 0;
  PCRE2_SIZE off = 0;
  const uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP | PCRE2_MULTILINE);
  p_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err, &off, nullptr);
  if (!p_->code)
    throw std::invalid_argument("PCRE2 rejects it at offset " + std::to_string(off) + ": " + pcre2_message(err));
  pcre2_jit_compile(p_->code, PCRE2_JIT_COMPLETE);  // where JIT is unavailable pcre2_match interprets
}

PcreRegex::~PcreRegex() = default;

std::vector<std::pair<size_t, size_t>> PcreRegex::find_all(std::string_view text) const {
  std::string fixed;
  std::string_view s = text;
  if (const size_t bad = utf8::first_invalid(text); bad != text.size()) {
    fixed = utf8::replace_invalid(text, bad);
    s = fixed;
  }
  MatchData md(p_->code);
  std::vector<std::pair<size_t, size_t>> out;
  bool skip_next_empty = false;
  for (size_t last_end = 0; last_end <= s.size();) {
    if (p_->match(s, last_end, 0, md.md) == PCRE2_ERROR_NOMATCH) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.md);
    const size_t b = ov[0], e = std::max(ov[0], ov[1]);  // (\K can put the start after the end)
    last_end = e;
    if (b == e) {
      last_end += e < s.size() ? std::max<size_t>(1, utf8::seq_len(s, e)) : 1;
      if (skip_next_empty) {
        skip_next_empty = false;
        continue;
      }
    } else {
      skip_next_empty = true;
    }
    out.emplace_back(b, e);
  }
  return out;
}

bool PcreRegex::matches_at(std::string_view text, size_t at) const {
  MatchData md(p_->code);
  return p_->match(text, at, PCRE2_ANCHORED, md.md) > 0;
}

std::string oniguruma_to_pcre2(const std::string& p) {
  const char* const kWord = R"(\p{L}\p{M}\p{Nd}\p{Pc})";  // Oniguruma's \w over Unicode
  const char* const kHex = "0-9a-fA-F";
  std::string out;
  bool in_class = false;
  auto unsupported = [&](size_t at, const std::string& what) {
    throw std::invalid_argument(what + " at offset " + std::to_string(at) + " has no PCRE2 form here");
  };
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) throw std::invalid_argument("it ends with a lone backslash");
      const char d = p[i + 1];
      switch (d) {
        case 's': out += R"(\p{White_Space})"; break;
        case 'S': out += R"(\P{White_Space})"; break;
        case 'd': out += R"(\p{Nd})"; break;
        case 'D': out += R"(\P{Nd})"; break;
        case 'w':
        case 'h':  // Oniguruma's word characters, hex digits
          if (!in_class) out += '[';
          out += d == 'w' ? kWord : kHex;
          if (!in_class) out += ']';
          break;
        case 'W':
        case 'H':
          if (in_class) unsupported(i, std::string("\\") + d + " inside a character class");
          out += "[^";
          out += d == 'W' ? kWord : kHex;
          out += ']';
          break;
        case 'u':
          if (i + 6 <= p.size() && std::all_of(p.begin() + long(i) + 2, p.begin() + long(i) + 6, [](char h) {
                return std::isxdigit(static_cast<unsigned char>(h)) != 0;
              })) {
            out += "\\x{" + p.substr(i + 2, 4) + "}";
            i += 6;
            continue;
          }
          out += "\\u";
          break;
        default: out += {c, d};
      }
      i += 2;
      continue;
    }
    if (in_class) {
      if (c == '[') {
        if (i + 1 < p.size() && p[i + 1] == ':') {  // a POSIX bracket, [:alpha:]
          const size_t end = p.find(":]", i + 2);
          if (end == std::string::npos) unsupported(i, "an unterminated [: bracket");
          out += p.substr(i, end + 2 - i);
          i = end + 2;
          continue;
        }
        unsupported(i, "a character class nested in a class (Oniguruma's [a[b]])");
      }
      if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') unsupported(i, "class intersection &&");
      if (c == ']') in_class = false;
      out += c;
      ++i;
      continue;
    }
    out += c;
    ++i;
    if (c == '[') {  // a leading ^ and then a leading ] belong to the class
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];
      in_class = true;
    }
  }
  return out;
}

}  // namespace dtrain
