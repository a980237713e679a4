// teo's quantizer for GGUF's block types (docs/quantization.md, "Quantizing"): it makes valid
// blocks for cases and exports. Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 follow llama.cpp's reference
// quantizers (quantize_row_*_ref); the K types take one pass of min and max per sub-block (not
// llama.cpp's iterative search); MXFP4 and NVFP4 take the nearest E2M1 value under the block's
// scale. Only the dequantization is judged.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

#include "teo/errors.hpp"
#include "teo/fp8.hpp"
#include "teo/precision.hpp"
#include "teo/quant.hpp"

namespace teo::quant {

namespace {

void put_f16(std::uint8_t* p, float x, GgmlType t, const char* field) {
  const std::uint16_t h = to_bits(Precision::fp16, x);
  if ((h & 0x7C00) == 0x7C00) {
    throw InputError(std::string("quantizing to ") + to_string(t) + ": the scale " + field + " " +
                     std::to_string(x) + " is beyond F16's range (65504)");
  }
  p[0] = static_cast<std::uint8_t>(h & 0xFF);
  p[1] = static_cast<std::uint8_t>(h >> 8);
}

float f16_value(const std::uint8_t* p) {
  return from_bits(Precision::fp16, static_cast<std::uint16_t>(p[0] | p[1] << 8));
}

// 1 / d, or 0 where that is not finite (d is 0, or so small that 1 / d overflows): llama.cpp's
// id, without its undefined conversion of inf * x to an integer.
float inverse(float d) {
  const float id = d != 0 ? 1.0f / d : 0.0f;
  return std::isfinite(id) ? id : 0.0f;
}

// llama.cpp's nearest_int: to nearest, ties to even.
int nearest(float x) {
  return static_cast<int>(std::nearbyint(x));
}

// C's conversion of a non-negative float to int (truncation), as llama.cpp's reference quantizers
// use it after adding 0.5 or 8.5.
int truncated(float v) {
  return static_cast<int>(std::trunc(v));
}

int clamp(int v, int lo, int hi) {
  return std::min(std::max(v, lo), hi);
}

// The signed value of largest magnitude (the first of equals), as quantize_row_q4_0_ref finds it.
float signed_max(const float* x, int n) {
  float amax = 0, max = 0;
  for (int j = 0; j < n; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

// q4_0 / q5_0: d = max / -2^(bits-1), q = min(2^bits - 1, trunc(x / d + 2^(bits-1) + 0.5)).
void quantize_symmetric(const float* x, std::uint8_t* b, bool five, GgmlType t) {
  const float half = five ? 16.0f : 8.0f;
  const float d = signed_max(x, 32) / -half;
  const float id = inverse(d);
  put_f16(b, d, t, "d");
  std::uint32_t qh = 0;
  std::uint8_t* qs = b + (five ? 6 : 2);
  const int top = five ? 31 : 15;
  for (int j = 0; j < 16; ++j) {
    const int q0 = std::min(top, truncated(x[j] * id + half + 0.5f));
    const int q1 = std::min(top, truncated(x[j + 16] * id + half + 0.5f));
    qs[j] = static_cast<std::uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
    qh |= static_cast<std::uint32_t>((q0 & 0x10) >> 4) << j;
    qh |= static_cast<std::uint32_t>((q1 & 0x10) >> 4) << (j + 16);
  }
  if (five) std::memcpy(b + 2, &qh, 4);
}

// q4_1 / q5_1: d = (max - min) / (2^bits - 1), m = min, q = trunc((x - min) / d + 0.5).
void quantize_affine(const float* x, std::uint8_t* b, bool five, GgmlType t) {
  float lo = x[0], hi = x[0];
  for (int j = 1; j < 32; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  const int top = five ? 31 : 15;
  const float d = (hi - lo) / static_cast<float>(top);
  const float id = inverse(d);
  put_f16(b, d, t, "d");
  put_f16(b + 2, lo, t, "m");
  std::uint32_t qh = 0;
  std::uint8_t* qs = b + (five ? 8 : 4);
  for (int j = 0; j < 16; ++j) {
    const int q0 = std::min(top, truncated((x[j] - lo) * id + 0.5f));
    const int q1 = std::min(top, truncated((x[j + 16] - lo) * id + 0.5f));
    qs[j] = static_cast<std::uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
    qh |= static_cast<std::uint32_t>((q0 & 0x10) >> 4) << j;
    qh |= static_cast<std::uint32_t>((q1 & 0x10) >> 4) << (j + 16);
  }
  if (five) std::memcpy(b + 4, &qh, 4);
}

void quantize_q8_0(const float* x, std::uint8_t* b, GgmlType t) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = inverse(d);
  put_f16(b, d, t, "d");
  for (int j = 0; j < 32; ++j) {
    b[2 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(std::round(x[j] * id)));
  }
}

// Q4_K and Q5_K: per sub-block of 32, scale (max - min) / top and min offset -min(0, min); the
// superblock's d and dmin put the largest at 63; each value is nearest((x + M) / D), D = d * sc and
// M = dmin * m.
void quantize_k45(const float* x, std::uint8_t* b, bool five, GgmlType t) {
  const int top = five ? 31 : 15;
  std::array<float, 8> scale{}, offset{};
  for (int s = 0; s < 8; ++s) {
    float lo = 0, hi = x[static_cast<std::ptrdiff_t>(32) * s];
    for (int l = 0; l < 32; ++l) {
      lo = std::min(lo, x[32 * s + l]);
      hi = std::max(hi, x[32 * s + l]);
    }
    offset[s] = -lo;
    scale[s] = (hi - lo) / static_cast<float>(top);
  }
  const float max_scale = *std::max_element(scale.begin(), scale.end());
  const float max_offset = *std::max_element(offset.begin(), offset.end());
  put_f16(b, max_scale / 63.0f, t, "d");
  put_f16(b + 2, max_offset / 63.0f, t, "dmin");
  const float d = f16_value(b), dmin = f16_value(b + 2);
  std::array<int, 8> sc{}, m{};
  for (int s = 0; s < 8; ++s) {
    sc[s] = d > 0 ? clamp(nearest(scale[s] / d), 0, 63) : 0;
    m[s] = dmin > 0 ? clamp(nearest(offset[s] / dmin), 0, 63) : 0;
  }
  std::uint8_t* scales = b + 4;
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<std::uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<std::uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<std::uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
  std::uint8_t* qh = b + 16;
  std::uint8_t* qs = five ? b + 48 : b + 16;
  if (five) std::memset(qh, 0, 32);
  std::array<int, 256> q{};
  for (int s = 0; s < 8; ++s) {
    const float D = d * static_cast<float>(sc[s]);
    const float M = dmin * static_cast<float>(m[s]);
    for (int l = 0; l < 32; ++l) {
      const int v = D > 0 ? clamp(nearest((x[32 * s + l] + M) / D), 0, top) : 0;
      q[32 * s + l] = v;
      if (five) qh[l] = static_cast<std::uint8_t>(qh[l] | ((v >> 4) & 1) << s);
    }
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      qs[32 * c + l] =
          static_cast<std::uint8_t>((q[64 * c + l] & 0xF) | ((q[64 * c + 32 + l] & 0xF) << 4));
    }
  }
}

// Q6_K: per sub-block of 16, scale max / -32 (the signed value of largest magnitude); d puts the
// largest scale magnitude at 127; each value is nearest(x / (d * sc)) + 32.
void quantize_q6_k(const float* x, std::uint8_t* b, GgmlType t) {
  std::array<float, 16> scale{};
  float amax = 0;
  for (int s = 0; s < 16; ++s) {
    scale[s] = signed_max(x + static_cast<std::ptrdiff_t>(16) * s, 16) / -32.0f;
    amax = std::max(amax, std::fabs(scale[s]));
  }
  put_f16(b + 208, amax / 127.0f, t, "d");
  const float d = f16_value(b + 208);
  auto* sc = reinterpret_cast<std::int8_t*>(b + 192);
  std::array<int, 256> q{};
  for (int s = 0; s < 16; ++s) {
    const int v = d > 0 ? clamp(nearest(scale[s] / d), -128, 127) : 0;
    sc[s] = static_cast<std::int8_t>(v);
    const float D = d * static_cast<float>(v);
    for (int l = 0; l < 16; ++l)
      q[16 * s + l] = D != 0 ? clamp(nearest(x[16 * s + l] / D), -32, 31) + 32 : 32;
  }
  for (std::ptrdiff_t n = 0; n < 2; ++n) {
    std::uint8_t* ql = b + 64 * n;
    std::uint8_t* qh = b + 128 + 32 * n;
    const int* qn = q.data() + 128 * n;
    for (int l = 0; l < 32; ++l) {
      const int q1 = qn[l], q2 = qn[l + 32], q3 = qn[l + 64], q4 = qn[l + 96];
      ql[l] = static_cast<std::uint8_t>((q1 & 0xF) | ((q3 & 0xF) << 4));
      ql[l + 32] = static_cast<std::uint8_t>((q2 & 0xF) | ((q4 & 0xF) << 4));
      qh[l] = static_cast<std::uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) |
                                        ((q4 >> 4) << 6));
    }
  }
}

// MXFP4 (llama.cpp's): e = floor(log2 amax) - 2 + 127, so that amax / 2^(e - 127) is in [4, 8).
void quantize_mxfp4(const float* x, std::uint8_t* b) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  int e = 0;
  if (amax > 0) e = std::clamp(std::ilogb(amax) - 2 + 127, 0, 254);
  b[0] = static_cast<std::uint8_t>(e);
  const float scale = std::ldexp(1.0f, e - 127);
  for (int j = 0; j < 16; ++j) {
    const int lo = nearest_e2m1(x[j] / scale), hi = nearest_e2m1(x[j + 16] / scale);
    b[1 + j] = static_cast<std::uint8_t>(lo | hi << 4);
  }
}

// NVFP4 (llama.cpp's): per 16 values the unsigned E4M3 scale nearest to amax / 6 (at most 448).
void quantize_nvfp4(const float* x, std::uint8_t* b) {
  for (std::ptrdiff_t s = 0; s < 4; ++s) {
    float amax = 0;
    for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(x[16 * s + j]));
    const std::uint8_t code = to_fp8_bits(Fp8Format::e4m3, true, amax / 6.0f);
    b[s] = code;
    const float scale = from_fp8_bits(Fp8Format::e4m3, code);
    std::uint8_t* qs = b + 4 + 8 * s;
    for (int j = 0; j < 8; ++j) {
      const int lo = scale > 0 ? nearest_e2m1(x[16 * s + j] / scale) : 0;
      const int hi = scale > 0 ? nearest_e2m1(x[16 * s + 8 + j] / scale) : 0;
      qs[j] = static_cast<std::uint8_t>(lo | hi << 4);
    }
  }
}

}  // namespace

void quantize_block(GgmlType t, const float* in, std::uint8_t* b) {
  const BlockShape shape = block_shape(t);
  for (int j = 0; j < shape.values; ++j) {
    if (!std::isfinite(in[j])) {
      throw InputError(std::string("quantizing to ") + to_string(t) + ": value " +
                       std::to_string(j) + " of the block is not finite");
    }
  }
  switch (t) {
    case GgmlType::f32:
      std::memcpy(b, in, 4);
      return;
    case GgmlType::f16:
    case GgmlType::bf16: {
      const Precision p = t == GgmlType::f16 ? Precision::fp16 : Precision::bf16;
      const std::uint16_t h = to_bits(p, in[0]);
      if (!std::isfinite(from_bits(p, h))) {
        throw InputError(std::string("quantizing to ") + to_string(t) + ": " +
                         std::to_string(in[0]) + " is beyond its range");
      }
      b[0] = static_cast<std::uint8_t>(h & 0xFF);
      b[1] = static_cast<std::uint8_t>(h >> 8);
      return;
    }
    case GgmlType::q4_0:
      quantize_symmetric(in, b, false, t);
      return;
    case GgmlType::q5_0:
      quantize_symmetric(in, b, true, t);
      return;
    case GgmlType::q4_1:
      quantize_affine(in, b, false, t);
      return;
    case GgmlType::q5_1:
      quantize_affine(in, b, true, t);
      return;
    case GgmlType::q8_0:
      quantize_q8_0(in, b, t);
      return;
    case GgmlType::q4_k:
      quantize_k45(in, b, false, t);
      return;
    case GgmlType::q5_k:
      quantize_k45(in, b, true, t);
      return;
    case GgmlType::q6_k:
      quantize_q6_k(in, b, t);
      return;
    case GgmlType::mxfp4:
      quantize_mxfp4(in, b);
      return;
    case GgmlType::nvfp4:
      quantize_nvfp4(in, b);
      return;
  }
}

}  // namespace teo::quant
