// SHA-256 (core/sha256.h): NIST FIPS 180-4 / CAVP known answers, incremental updates split at
// block-boundary lengths, sha256_file and sha256_hex against Python's hashlib (and CPython's own
// _sha256, which does not use OpenSSL) over seeded random files up to 10 MB, and the faults.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <ctime>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/rng.h"
#include "core/sha256.h"
#include "test_util.h"
#include "skip.h"

using namespace dtrain;
using test_util::TmpDir;

namespace {

std::string random_bytes(uint64_t seed, size_t n) {
  Rng r(seed, 17);
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = char(r.next_u32() & 0xff);
  return s;
}

std::string one_shot(const std::string& s) { return sha256_hex(s.data(), s.size()); }

// Hashes `s` fed as consecutive pieces of the given lengths (cycled until `s` is used up).
std::string in_pieces(const std::string& s, const std::vector<size_t>& lens) {
  Sha256 h;
  size_t at = 0, k = 0;
  while (at < s.size()) {
    size_t n = std::min(lens[k++ % lens.size()], s.size() - at);
    h.update(s.data() + at, n);
    at += n;
  }
  return h.hex();
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("sha256 NIST FIPS 180-4 vectors") {
  CHECK(one_shot("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(one_shot("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 448-bit message: padding leaves no room for the length, so a second block follows.
  CHECK(one_shot("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // 896-bit message
  CHECK(one_shot("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrs"
                 "mnopqrstnopqrstu") == "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  CHECK(one_shot(std::string(1000000, 'a')) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // digest() gives the same 32 bytes, most significant first.
  Sha256 h;
  h.update("abc", 3);
  auto d = h.digest();
  CHECK(d[0] == 0xba);
  CHECK(d[1] == 0x78);
  CHECK(d[31] == 0xad);
}

TEST_CASE("sha256 NIST long message of 1 GiB has a length beyond 32 bits") {
  // NIST's "extremely long message": 2^24 repetitions of a 64-byte pattern (2^33 bits).
  const std::string pat = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno";
  REQUIRE(pat.size() == 64);
  std::string mib;
  while (mib.size() < (size_t(1) << 20)) mib += pat;
  Sha256 h;
  for (int i = 0; i < 1024; ++i) h.update(mib.data(), mib.size());
  CHECK(h.hex() == "50e72a0e26442fe2552dc3938ac58658228c0cbfb1d2ca872ae435266fcd055e");
}

TEST_CASE("sha256 incremental updates at awkward boundaries equal one-shot") {
  const std::string s = random_bytes(1, 300);
  const std::string whole = one_shot(s);
  for (size_t a = 0; a <= s.size(); ++a) {  // every two-way split
    Sha256 h;
    h.update(s.data(), a);
    h.update(s.data() + a, s.size() - a);
    INFO("split at " << a);
    CHECK(h.hex() == whole);
  }
  const size_t edges[] = {0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129};
  for (size_t a : edges)  // three-way splits at block and padding edges, with empty updates between
    for (size_t b : edges) {
      Sha256 h;
      h.update(s.data(), a);
      h.update(nullptr, 0);
      h.update(s.data() + a, b);
      h.update(s.data() + a + b, s.size() - a - b);
      INFO("split at " << a << " and " << a + b);
      CHECK(h.hex() == whole);
    }
  CHECK(in_pieces(s, {1}) == whole);  // a byte at a time
  // Several MiB in pieces around the block size and sha256_file's 64 KiB read size.
  const std::string big = random_bytes(2, 3 * (size_t(1) << 20) + 77);
  const std::string big_whole = one_shot(big);
  CHECK(in_pieces(big, {1, 63, 64, 65, 4095, 65537, (size_t(1) << 20) + 1}) == big_whole);
  CHECK(in_pieces(big, {size_t(1) << 20}) == big_whole);
  CHECK(in_pieces(big, {7, 100003}) == big_whole);
  // Every length from 0 to 200: a byte at a time equals one-shot.
  for (size_t n = 0; n <= 200; ++n) {
    INFO("length " << n);
    CHECK(in_pieces(s.substr(0, n), {1}) == one_shot(s.substr(0, n)));
  }
}

TEST_CASE("sha256 matches Python hashlib over seeded random files from 0 to 10 MB") {
  const std::string py = DTRAIN_SOURCE_DIR "/.venv/bin/python";
  if (!std::filesystem::exists(py)) {
    SKIP_TEST(py << " is missing (scripts/setup.sh creates it)");
  }
  TmpDir t;
  // Sizes at the block, padding and read-buffer (64 KiB) edges, then seeded log-uniform ones.
  std::vector<size_t> sizes = {0,    1,    3,     55,    56,    57,    63,        64,        65,
                               119,  120,  127,   128,   129,   1000,  4095,      4096,      65535,
                               65536, 65537, 3 * 65536 + 1,
                               (size_t(1) << 20) - 1, size_t(1) << 20, (size_t(1) << 20) + 1,
                               10000000, 10 * (size_t(1) << 20) - 1};
  Rng r(20240517, 3);
  for (int i = 0; i < 16; ++i) sizes.push_back(size_t(std::exp(r.uniform_double() * std::log(10e6))));
  const std::string pool = random_bytes(3, 10 * (size_t(1) << 20) + 4096);
  std::map<std::string, std::string> mine;  // file name -> sha256_file
  std::ostringstream names;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t off = size_t(r.below(4096));  // unaligned starts for sha256_hex
    const std::string name = "f" + std::to_string(i) + "_" + std::to_string(sizes[i]) + ".bin";
    const std::string path = t.path + "/" + name;
    fs::write_file(path, pool.data() + off, sizes[i]);
    const std::string from_file = sha256_file(path);
    INFO(name);
    CHECK(from_file == sha256_hex(pool.data() + off, sizes[i]));
    mine[name] = from_file;
    names << "\"" << name << "\",";
  }
  const std::string out = test_util::run_python(t.path, R"(
import hashlib, os
try:
    import _sha256  # CPython's own SHA-256; hashlib.sha256 is OpenSSL's
except ImportError:
    _sha256 = None
d = ")" + t.path + R"("
for name in [)" + names.str() + R"(]:
    data = open(os.path.join(d, name), "rb").read()
    h = hashlib.sha256(data).hexdigest()
    if _sha256 is not None:
        assert _sha256.sha256(data).hexdigest() == h, name
    print(name, h)
print("independent", _sha256 is not None)
)");
  std::istringstream in(out);
  std::string name, hex;
  size_t seen = 0;
  while (in >> name >> hex) {
    if (name == "independent") {
      if (hex != "True") MESSAGE("CPython's _sha256 is missing: compared with hashlib (OpenSSL) only");
      continue;
    }
    INFO(name);
    REQUIRE(mine.count(name) == 1);
    CHECK(mine[name] == hex);
    ++seen;
  }
  CHECK(seen == sizes.size());
}

TEST_CASE("sha256 use after digest and unreadable files are faults") {
  Sha256 h;
  h.update("abc", 3);
  (void)h.hex();
  CHECK_THROWS_AS(h.update("x", 1), RuntimeFault);
  CHECK_THROWS_AS(h.digest(), RuntimeFault);
  TmpDir t;
  const std::string missing = t.path + "/missing.bin", dir_msg = "cannot read " + t.path;
  CHECK_THROWS_WITH_AS(sha256_file(missing), doctest::Contains(missing.c_str()), RuntimeFault);
  // A directory opens for reading on Linux but read() fails (EISDIR): not the hash of nothing.
  CHECK_THROWS_WITH_AS(sha256_file(t.path), doctest::Contains(dir_msg.c_str()), RuntimeFault);
}
}

// Raw throughput (docs/benchmarks.md, "Hashing"). Skipped by default; run with
//   ./build/dtrain_tests -tc="bench: sha256*" --no-skip
// Best of 5 in CPU seconds of this thread (wall time on a shared machine waits for others).
TEST_SUITE("bench") {
TEST_CASE("bench: sha256 throughput in memory and from a file" * doctest::skip()) {
  auto cpu_s = [] {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  };
  auto best = [&](const std::function<std::string()>& f) {
    double b = 1e30;
    std::string h;
    for (int r = 0; r < 5; ++r) {
      const double t0 = cpu_s();
      h = f();
      b = std::min(b, cpu_s() - t0);
    }
    return std::make_pair(b, h);
  };
  const size_t n = size_t(256) << 20;
  const std::string buf = random_bytes(4, n);
  auto [tm, hm] = best([&] { return sha256_hex(buf.data(), buf.size()); });
  MESSAGE("sha256_hex, 256 MiB in memory: " << tm << " s, " << int(double(n) / tm / 1e6) << " MB/s");
  auto [ts, hs] = best([&] {
    std::string h;
    for (size_t i = 0; i < 100000; ++i) h = sha256_hex(buf.data() + i, 100);
    return h;
  });
  MESSAGE("sha256_hex, 100000 messages of 100 bytes: " << ts / 100000 * 1e6 << " us each");
  TmpDir t;
  fs::write_file(t.path + "/256m.bin", buf.data(), buf.size());  // now in the page cache
  auto [tf, hf] = best([&] { return sha256_file(t.path + "/256m.bin"); });
  MESSAGE("sha256_file, 256 MiB in the page cache: " << tf << " s, " << int(double(n) / tf / 1e6)
                                                     << " MB/s (CPU time of the reading thread)");
  CHECK(hf == hm);
}
}
