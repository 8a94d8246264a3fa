#pragma once
// SHA-256 (FIPS 180-4) for checkpoint and shard checksums, computed by OpenSSL's EVP interface
// (libcrypto picks the SHA-NI / AVX2 code path for the CPU it runs on). An OpenSSL failure is a
// RuntimeFault naming the call.
//   Sha256 h; h.update(p, n); ...; std::string hex = h.hex();
#include <array>
#include <cstdint>
#include <memory>
#include <string>

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX; <openssl/evp.h> stays out of this header

namespace dtrain {

class Sha256 {
 public:
  Sha256();
  Sha256(Sha256&&) noexcept = default;
  Sha256& operator=(Sha256&&) noexcept = default;
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t len);
  std::array<uint8_t, 32> digest();  // finalises; update/digest/hex afterwards is a RuntimeFault
  std::string hex();                  // finalises

 private:
  struct CtxFree {
    void operator()(evp_md_ctx_st* c) const noexcept;
  };
  std::unique_ptr<evp_md_ctx_st, CtxFree> ctx_;
  bool done_ = false;
};

std::string sha256_hex(const void* data, size_t len);
std::string sha256_file(const std::string& path);  // throws RuntimeFault when unreadable

}  // namespace dtrain
