#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

namespace dtrain {

// F64 holds reductions kept on the device (a step's loss sums); no op computes in it.
enum class DType : uint8_t { F32, BF16, F16, I32, U8, U16, F64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::U8: return 1;
    case DType::U16: return 2;
    case DType::F64: return 8;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::U8: return "u8";
    case DType::U16: return "u16";
    case DType::F64: return "f64";
  }
  return "?";
}

// safetensors dtype strings ("F32", "BF16", ...)
std::string_view dtype_safetensors_name(DType t);
bool dtype_from_safetensors_name(std::string_view s, DType* out);

inline bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

// ---- 16-bit float conversion (round to nearest even) ----
using bf16_t = uint16_t;
using f16_t = uint16_t;

inline float bf16_to_f32(bf16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))  // NaN: keep quiet NaN
    return bf16_t((u >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return bf16_t((u + rounding) >> 16);
}
float f16_to_f32(f16_t h);
f16_t f32_to_f16(float f);

}  // namespace dtrain
