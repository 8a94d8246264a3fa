#include "core/dtype.h"

namespace dtrain {

std::string_view dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
    case DType::U16: return "U16";
    case DType::F64: return "F64";
  }
  return "?";
}

bool dtype_from_safetensors_name(std::string_view s, DType* out) {
  static const std::pair<std::string_view, DType> table[] = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16},
      {"I32", DType::I32}, {"U8", DType::U8},     {"U16", DType::U16}};
  for (auto& [n, t] : table)
    if (n == s) {
      *out = t;
      return true;
    }
  return false;
}

float f16_to_f32(f16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        exp--;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

f16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t absu = u & 0x7fffffffu;
  if (absu >= 0x7f800000u)  // inf or nan
    return f16_t(sign | 0x7c00u | (absu > 0x7f800000u ? 0x200u : 0));
  if (absu >= 0x477ff000u)  // rounds to >= 65520 -> inf
    return f16_t(sign | 0x7c00u);
  if (absu < 0x38800000u) {  // result is subnormal or zero
    if (absu < 0x33000000u) return f16_t(sign);  // < 2^-25 rounds to 0
    uint32_t e = absu >> 23;
    uint32_t m = (absu & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (112 - e) + ...
    // value = m * 2^(e-150); f16 subnormal unit = 2^-24 -> shift = 150-24-e... = 126 - e
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return f16_t(sign | q);
  }
  uint32_t e = (absu >> 23) - 127 + 15;
  uint32_t m = absu & 0x7fffffu;
  uint32_t q = (e << 10) | (m >> 13);
  uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
  return f16_t(sign | q);
}

}  // namespace dtrain
