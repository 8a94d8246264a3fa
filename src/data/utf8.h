#pragma once
// UTF-8 helpers of the tokenizers: well-formed sequences (Unicode table 3-7), encoding a code
// point, and the stand-in that lets PCRE2 (which matches valid UTF-8 only) see any bytes.
#include <cstddef>
#include <string>
#include <string_view>

namespace dtrain::utf8 {

// Length of the well-formed UTF-8 sequence at s[i], 0 when none starts there.
inline size_t seq_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u; };
  const unsigned b0 = b(0);
  auto cont = [&](size_t k, unsigned lo = 0x80, unsigned hi = 0xbf) { return b(k) >= lo && b(k) <= hi; };
  if (b0 < 0x80) return 1;
  if (b0 < 0xc2) return 0;
  if (b0 < 0xe0) return cont(1) ? 2 : 0;
  if (b0 < 0xf0) {
    const bool ok1 = b0 == 0xe0 ? cont(1, 0xa0) : b0 == 0xed ? cont(1, 0x80, 0x9f) : cont(1);
    return ok1 && cont(2) ? 3 : 0;
  }
  if (b0 < 0xf5) {
    const bool ok1 = b0 == 0xf0 ? cont(1, 0x90) : b0 == 0xf4 ? cont(1, 0x80, 0x8f) : cont(1);
    return ok1 && cont(2) && cont(3) ? 4 : 0;
  }
  return 0;
}

// Offset of the first byte outside a well-formed sequence; s.size() when s is valid UTF-8.
inline size_t first_invalid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = seq_len(s, i);
    if (n == 0) return i;
    i += n;
  }
  return s.size();
}

// s with every byte outside a well-formed sequence (from offset `from` on) replaced by \x01, a
// control character (neither letter, number nor space): valid UTF-8 of the same length, one
// symbol per stray byte, so matches found in it cut the original bytes at the same offsets.
inline std::string replace_invalid(std::string_view s, size_t from) {
  std::string out(s);
  for (size_t i = from; i < s.size();) {
    const size_t n = seq_len(s, i);
    if (n == 0) out[i] = '\x01';
    i += n ? n : 1;
  }
  return out;
}

// The UTF-8 bytes of code point c (c <= U+10FFFF).
inline std::string encode(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s.push_back(char(c));
  } else if (c < 0x800) {
    s += {char(0xc0 | (c >> 6)), char(0x80 | (c & 0x3f))};
  } else if (c < 0x10000) {
    s += {char(0xe0 | (c >> 12)), char(0x80 | ((c >> 6) & 0x3f)), char(0x80 | (c & 0x3f))};
  } else {
    s += {char(0xf0 | (c >> 18)), char(0x80 | ((c >> 12) & 0x3f)), char(0x80 | ((c >> 6) & 0x3f)),
          char(0x80 | (c & 0x3f))};
  }
  return s;
}

// The code point of the well-formed sequence of n = seq_len(s, i) > 0 bytes at s[i].
inline char32_t decode(std::string_view s, size_t i, size_t n) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  char32_t c = n == 1 ? b0 : n == 2 ? (b0 & 0x1f) : n == 3 ? (b0 & 0x0f) : (b0 & 0x07);
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return c;
}

// Unicode's White_Space property (25 code points, stable): what Rust's and Oniguruma's \s match.
inline bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

}  // namespace dtrain::utf8
