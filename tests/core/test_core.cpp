#include <doctest/doctest.h>

#include <cmath>
#include <set>
#include <vector>

#include "core/dtype.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/sha256.h"
#include "core/shape.h"

using namespace dtrain;

TEST_SUITE("unit") {
TEST_CASE("log::printable keeps valid UTF-8 and escapes control characters and ill-formed bytes") {
  using dtrain::log::printable;
  CHECK(printable("plain text: naïve café, 漢字, \xf0\x9f\x98\x80") == "plain text: naïve café, 漢字, \xf0\x9f\x98\x80");
  CHECK(printable("a\nb\tc\r\x01\x7f") == "a\\nb\\tc\\r\\x01\\x7f");
  CHECK(printable(std::string("nul\0byte", 8)) == "nul\\x00byte");
  // ill-formed: a lone continuation byte, overlong forms, a surrogate, beyond U+10FFFF, a
  // sequence cut short (at the end and before an ASCII byte)
  CHECK(printable("\x80") == "\\x80");
  CHECK(printable("\xc1\xbf") == "\\xc1\\xbf");
  CHECK(printable("\xe0\x80\xaf") == "\\xe0\\x80\\xaf");
  CHECK(printable("\xed\xa0\x80") == "\\xed\\xa0\\x80");
  CHECK(printable("\xf4\x90\x80\x80") == "\\xf4\\x90\\x80\\x80");
  CHECK(printable("\xe6\xbc") == "\\xe6\\xbc");
  CHECK(printable("\xe6x") == "\\xe6x");
  CHECK(printable("dtyp\xc1" "e") == "dtyp\\xc1e");
}

TEST_CASE("sha256 known vectors") {
  CHECK(sha256_hex("", 0) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc", 3) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  std::string m(1000, 'a');
  Sha256 s;
  for (int i = 0; i < 1000; ++i) s.update(m.data(), i % 7 == 0 ? 1000 : 1000);
  CHECK(s.hex() == sha256_hex(std::string(1000000, 'a').data(), 1000000));
  CHECK(sha256_hex(std::string(1000000, 'a').data(), 1000000) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("philox4x32-10 matches the Random123 known-answer test") {
  auto r = philox4x32_10({0, 0, 0, 0}, {0, 0});
  CHECK(r[0] == 0x6627e8d5u);
  CHECK(r[1] == 0xe169c58du);
  CHECK(r[2] == 0xbc57ac4cu);
  CHECK(r[3] == 0x9b00dbd8u);
  auto r2 = philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  CHECK(r2[0] == 0x408f276du);
  CHECK(r2[1] == 0x41c83b0eu);
  CHECK(r2[2] == 0xa20bc7c6u);
  CHECK(r2[3] == 0x6d5451fdu);
}

TEST_CASE("rng streams are reproducible and distinct and seekable") {
  Rng a(42, 1), b(42, 1), c(42, 2);
  std::vector<uint32_t> va, vc;
  for (int i = 0; i < 10; ++i) { va.push_back(a.next_u32()); vc.push_back(c.next_u32()); }
  for (int i = 0; i < 10; ++i) CHECK(b.next_u32() == va[i]);
  CHECK(va != vc);
  Rng d(42, 1);
  d.set_position(7);
  CHECK(d.next_u32() == va[7]);
  CHECK(d.position() == 8);
  Rng e(1);
  double sum = 0, sq = 0;
  for (int i = 0; i < 20000; ++i) { float x = e.normal(); sum += x; sq += x * x; }
  CHECK(std::abs(sum / 20000) < 0.03);
  CHECK(std::abs(sq / 20000 - 1.0) < 0.05);
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) { auto v = e.below(10); CHECK(v < 10); seen.insert(v); }
  CHECK(seen.size() == 10);
}

TEST_CASE("bf16 and f16 conversion round to nearest even") {
  CHECK(bf16_to_f32(f32_to_bf16(1.0f)) == 1.0f);
  CHECK(f32_to_bf16(1.0f + 1.0f / 256) == f32_to_bf16(1.0f));  // tie -> even
  CHECK(bf16_to_f32(f32_to_bf16(-3.5f)) == -3.5f);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  for (float x : {0.0f, 1.0f, -2.0f, 0.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f, 1000.5f})
    CHECK(f16_to_f32(f32_to_f16(x)) == x);
  CHECK(f32_to_f16(65520.0f) == 0x7c00);   // overflow -> inf
  CHECK(f32_to_f16(1e-9f) == 0);           // underflow -> 0
  CHECK(f16_to_f32(f32_to_f16(1.0f + 1.0f / 4096)) == 1.0f);  // rounds to even
  CHECK(std::isnan(f16_to_f32(f32_to_f16(NAN))));
  // every f16 bit pattern survives f16 -> f32 -> f16
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(f16_t(h));
    if (!std::isnan(f)) REQUIRE(f32_to_f16(f) == h);
  }
}

TEST_CASE("shape") {
  Shape s{2, 3, 4};
  CHECK(s.numel() == 24);
  CHECK(s[-1] == 4);
  CHECK(s.str() == "[2,3,4]");
  CHECK(s == Shape{2, 3, 4});
}
}
