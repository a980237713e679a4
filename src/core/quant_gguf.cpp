// GGUF's block types, byte for byte as llama.cpp's block structs (ggml-common.h), dequantized by
// its float32 arithmetic operation for operation (ggml-quants.c, dequantize_row_*), which is also
// what the `gguf` Python package's numpy code computes (tests/interop/gguf_blocks.py checks the
// two agree bit for bit). Built with -ffp-contract=off, so that d * q - m stays two roundings.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "teo/errors.hpp"
#include "teo/fp8.hpp"
#include "teo/precision.hpp"
#include "teo/quant.hpp"

namespace teo::quant {

static_assert(std::endian::native == std::endian::little, "GGUF blocks are little-endian");

namespace {

struct TypeInfo {
  GgmlType type;
  const char* name;
  BlockShape shape;
};

// ggml-common.h: QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32, QK_K = 256, QK_MXFP4 = 32 and
// QK_NVFP4 = 64, and the structs' sizes.
constexpr TypeInfo kTypes[] = {
    {GgmlType::f32, "F32", {1, 4}},       {GgmlType::f16, "F16", {1, 2}},
    {GgmlType::q4_0, "Q4_0", {32, 18}},   {GgmlType::q4_1, "Q4_1", {32, 20}},
    {GgmlType::q5_0, "Q5_0", {32, 22}},   {GgmlType::q5_1, "Q5_1", {32, 24}},
    {GgmlType::q8_0, "Q8_0", {32, 34}},   {GgmlType::q4_k, "Q4_K", {256, 144}},
    {GgmlType::q5_k, "Q5_K", {256, 176}}, {GgmlType::q6_k, "Q6_K", {256, 210}},
    {GgmlType::bf16, "BF16", {1, 2}},     {GgmlType::mxfp4, "MXFP4", {32, 17}},
    {GgmlType::nvfp4, "NVFP4", {64, 36}},
};

// ggml's names of the types teo does not support (ggml.h's enum ggml_type); "" for gaps.
constexpr const char* kGgmlNames[] = {
    "F32",     "F16",   "Q4_0",   "Q4_1",  "",      "",       "Q5_0", "Q5_1",    "Q8_0",
    "Q8_1",    "Q2_K",  "Q3_K",   "Q4_K",  "Q5_K",  "Q6_K",   "Q8_K", "IQ2_XXS", "IQ2_XS",
    "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8",   "I16",     "I32",
    "I64",     "F64",   "IQ1_M",  "BF16",  "",      "",       "",     "TQ1_0",   "TQ2_0",
    "",        "",      "",       "MXFP4", "NVFP4", "Q1_0"};

const TypeInfo& info(GgmlType t) {
  for (const auto& i : kTypes)
    if (i.type == t) return i;
  throw ConfigError("ggml type " + std::to_string(static_cast<std::uint32_t>(t)) +
                    " is not supported");
}

float f16(const std::uint8_t* p) {
  return from_bits(Precision::fp16, static_cast<std::uint16_t>(p[0] | p[1] << 8));
}

std::uint32_t le32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  std::memcpy(&v, p, 4);
  return v;
}

// llama.cpp's tables: E2M1 doubled (kvalues_mxfp4), so that a half scale keeps every product exact.
constexpr int kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml_e8m0_to_fp32_half: 2^(e - 128), exactly (2^-128 and 2^-127 are float subnormals).
float e8m0_half(std::uint8_t e) {
  const std::uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<std::uint32_t>(e - 1) << 23;
  return std::bit_cast<float>(bits);
}

// ggml_ue4m3_to_fp32: half the unsigned E4M3 value (bias 7, 3 mantissa bits), exactly; 0 and 0x7F
// give 0.
float ue4m3_half(std::uint8_t x) {
  if (x == 0 || x == 0x7F) return 0.0f;
  const int exp = (x >> 3) & 0xF;
  const int man = x & 0x7;
  const float raw = exp == 0 ? std::ldexp(static_cast<float>(man), -9)
                             : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  return raw * 0.5f;
}

// get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) from a K block's 12 bytes.
void scale_min_k4(int j, const std::uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

float fl(int v) {
  return static_cast<float>(v);
}

void dequantize_k45(const std::uint8_t* b, float* y, bool five) {
  const float d = f16(b);
  const float min = f16(b + 2);
  const std::uint8_t* scales = b + 4;
  const std::uint8_t* qh = b + 16;
  const std::uint8_t* q = five ? b + 48 : b + 16;
  for (int j = 0; j < 4; ++j) {
    int sc = 0, m = 0;
    scale_min_k4(2 * j, scales, sc, m);
    const float d1 = d * fl(sc), m1 = min * fl(m);
    scale_min_k4(2 * j + 1, scales, sc, m);
    const float d2 = d * fl(sc), m2 = min * fl(m);
    const int u1 = 1 << (2 * j), u2 = 2 << (2 * j);
    for (int l = 0; l < 32; ++l) {
      const int h1 = five && (qh[l] & u1) ? 16 : 0, h2 = five && (qh[l] & u2) ? 16 : 0;
      y[64 * j + l] = d1 * fl((q[l] & 0xF) + h1) - m1;
      y[64 * j + 32 + l] = d2 * fl((q[l] >> 4) + h2) - m2;
    }
    q += 32;
  }
}

void dequantize_q6_k(const std::uint8_t* b, float* y) {
  const float d = f16(b + 208);
  for (std::ptrdiff_t n = 0; n < 2; ++n) {
    const std::uint8_t* ql = b + 64 * n;
    const std::uint8_t* qh = b + 128 + 32 * n;
    const auto* sc = reinterpret_cast<const std::int8_t*>(b + 192 + 8 * n);
    float* yn = y + 128 * n;
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      yn[l] = d * fl(sc[is]) * fl(q1);
      yn[l + 32] = d * fl(sc[is + 2]) * fl(q2);
      yn[l + 64] = d * fl(sc[is + 4]) * fl(q3);
      yn[l + 96] = d * fl(sc[is + 6]) * fl(q4);
    }
  }
}

}  // namespace

const std::vector<GgmlType>& ggml_types() {
  static const std::vector<GgmlType> all = [] {
    std::vector<GgmlType> v;
    for (const auto& i : kTypes) v.push_back(i.type);
    return v;
  }();
  return all;
}

const char* to_string(GgmlType t) {
  return info(t).name;
}

GgmlType parse_ggml_type(const std::string& name, const std::string& what) {
  std::string names;
  for (const auto& i : kTypes) {
    if (name == i.name) return i.type;
    names += names.empty() ? i.name : std::string(", ") + i.name;
  }
  throw ConfigError(what + " must be one of " + names + ", got \"" + name + "\"");
}

bool ggml_type_of(std::uint32_t number, GgmlType& t) {
  for (const auto& i : kTypes) {
    if (static_cast<std::uint32_t>(i.type) == number) {
      t = i.type;
      return true;
    }
  }
  return false;
}

const char* ggml_type_name(std::uint32_t number) {
  return number < std::size(kGgmlNames) ? kGgmlNames[number] : "";
}

BlockShape block_shape(GgmlType t) {
  return info(t).shape;
}

bool is_block_type(GgmlType t) {
  return block_shape(t).values > 1;
}

std::uint64_t row_bytes(GgmlType t, std::int64_t values, const std::string& what) {
  const BlockShape s = block_shape(t);
  if (values <= 0 || values % s.values != 0) {
    throw ShapeError(what + ": a row of " + to_string(t) + " holds a positive multiple of " +
                     std::to_string(s.values) + " values, got " + std::to_string(values));
  }
  return static_cast<std::uint64_t>(values / s.values) * static_cast<std::uint64_t>(s.bytes);
}

float e2m1_value(int code) {
  const float v = static_cast<float>(kE2m1Twice[code & 0xF]) * 0.5f;
  return (code & 0x8) ? -std::fabs(v) : v;
}

int e2m1_twice(int code) {
  return kE2m1Twice[code & 0xF];
}

int nearest_e2m1(double v) {
  const double a = std::fabs(v);
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double dc = std::fabs(a - e2m1_value(c)), db = std::fabs(a - e2m1_value(best));
    if (dc < db || (dc == db && c % 2 == 0)) best = c;
  }
  return best == 0 ? 0 : (std::signbit(v) ? best | 8 : best);
}

void dequantize_block(GgmlType t, const std::uint8_t* b, float* y) {
  switch (t) {
    case GgmlType::f32:
      std::memcpy(y, b, 4);
      return;
    case GgmlType::f16:
      y[0] = f16(b);
      return;
    case GgmlType::bf16:
      y[0] = from_bits(Precision::bf16, static_cast<std::uint16_t>(b[0] | b[1] << 8));
      return;
    case GgmlType::q4_0: {
      const float d = f16(b);
      for (int j = 0; j < 16; ++j) {
        y[j] = fl((b[2 + j] & 0xF) - 8) * d;
        y[j + 16] = fl((b[2 + j] >> 4) - 8) * d;
      }
      return;
    }
    case GgmlType::q4_1: {
      const float d = f16(b), m = f16(b + 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = fl(b[4 + j] & 0xF) * d + m;
        y[j + 16] = fl(b[4 + j] >> 4) * d + m;
      }
      return;
    }
    case GgmlType::q5_0:
    case GgmlType::q5_1: {
      const bool one = t == GgmlType::q5_1;
      const float d = f16(b), m = one ? f16(b + 2) : 0.0f;
      const std::uint32_t qh = le32(b + (one ? 4 : 2));
      const std::uint8_t* qs = b + (one ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10);
        const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10);
        const int x0 = (qs[j] & 0xF) | h0, x1 = (qs[j] >> 4) | h1;
        if (one) {
          y[j] = fl(x0) * d + m;
          y[j + 16] = fl(x1) * d + m;
        } else {
          y[j] = fl(x0 - 16) * d;
          y[j + 16] = fl(x1 - 16) * d;
        }
      }
      return;
    }
    case GgmlType::q8_0: {
      const float d = f16(b);
      for (int j = 0; j < 32; ++j) y[j] = fl(static_cast<std::int8_t>(b[2 + j])) * d;
      return;
    }
    case GgmlType::q4_k:
      dequantize_k45(b, y, false);
      return;
    case GgmlType::q5_k:
      dequantize_k45(b, y, true);
      return;
    case GgmlType::q6_k:
      dequantize_q6_k(b, y);
      return;
    case GgmlType::mxfp4: {
      const float d = e8m0_half(b[0]);
      for (int j = 0; j < 16; ++j) {
        y[j] = fl(kE2m1Twice[b[1 + j] & 0xF]) * d;
        y[j + 16] = fl(kE2m1Twice[b[1 + j] >> 4]) * d;
      }
      return;
    }
    case GgmlType::nvfp4:
      for (std::ptrdiff_t s = 0; s < 4; ++s) {
        const float d = ue4m3_half(b[s]);
        const std::uint8_t* qs = b + 4 + 8 * s;
        for (int j = 0; j < 8; ++j) {
          y[16 * s + j] = fl(kE2m1Twice[qs[j] & 0xF]) * d;
          y[16 * s + 8 + j] = fl(kE2m1Twice[qs[j] >> 4]) * d;
        }
      }
      return;
  }
}

std::string check_block(GgmlType t, const std::uint8_t* b) {
  const auto scale = [&](int at, const char* field) -> std::string {
    if (std::isfinite(f16(b + at))) return "";
    const int h = b[at] | b[at + 1] << 8;
    char hex[8];
    std::snprintf(hex, sizeof hex, "%04x", h);
    return std::string("its F16 scale ") + field + " is 0x" + hex + ", which is not finite";
  };
  switch (t) {
    case GgmlType::f32:
    case GgmlType::f16:
    case GgmlType::bf16: {
      float v = 0;
      dequantize_block(t, b, &v);
      return std::isfinite(v) ? "" : "its value is not finite";
    }
    case GgmlType::q4_0:
    case GgmlType::q5_0:
    case GgmlType::q8_0:
      return scale(0, "d");
    case GgmlType::q4_1:
    case GgmlType::q5_1:
    case GgmlType::q4_k:
    case GgmlType::q5_k: {
      auto s = scale(0, "d");
      if (s.empty()) s = scale(2, t == GgmlType::q4_1 || t == GgmlType::q5_1 ? "m" : "dmin");
      return s;
    }
    case GgmlType::q6_k:
      return scale(208, "d");
    case GgmlType::mxfp4: {
      if (b[0] == 0xFF) return "its E8M0 scale is 0xff, which is NaN";
      // 2^(e - 127) times 4 or 6 is past float32's largest value for e of 253 and 254.
      float y[32];
      dequantize_block(t, b, y);
      for (int j = 0; j < 32; ++j) {
        if (!std::isfinite(y[j])) {
          return "its value " + std::to_string(j) + " (E8M0 scale " + std::to_string(b[0]) +
                 ") overflows float32";
        }
      }
      return "";
    }
    case GgmlType::nvfp4:
      for (int s = 0; s < 4; ++s) {
        if (b[s] == 0x7F || b[s] >= 0x80) {
          char hex[4];
          std::snprintf(hex, sizeof hex, "%02x", b[s]);
          return "its scale " + std::to_string(s) + " is 0x" + hex +
                 ", which is not an unsigned E4M3 value";
        }
      }
      return "";
  }
  return "";
}

std::int64_t first_invalid_block(GgmlType t, const std::uint8_t* bytes, std::int64_t blocks,
                                 std::string& why) {
  const auto size = static_cast<std::size_t>(block_shape(t).bytes);
  for (std::int64_t i = 0; i < blocks; ++i) {
    why = check_block(t, bytes + static_cast<std::size_t>(i) * size);
    if (!why.empty()) return i;
  }
  return -1;
}

}  // namespace teo::quant
