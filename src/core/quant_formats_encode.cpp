// teo's quantizer for the safetensors formats (teo/quant_formats.hpp), which makes valid weights
// for cases and tests (only the dequantization is judged), and CUTLASS's swizzled scale layout.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "teo/errors.hpp"
#include "teo/fp8.hpp"
#include "teo/precision.hpp"
#include "teo/quant.hpp"
#include "teo/quant_formats.hpp"

namespace teo::quant {

namespace {

using safetensors::DType;
using safetensors::Tensor;

Tensor make(const std::string& name, DType dtype, std::vector<std::int64_t> shape, const void* data,
            std::size_t bytes) {
  Tensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.assign(static_cast<const unsigned char*>(data),
                 static_cast<const unsigned char*>(data) + bytes);
  return t;
}

void need(bool ok, const std::string& why) {
  if (!ok) throw ShapeError(why);
}

std::uint16_t f16_bits(double v) {
  return to_bits(Precision::fp16, static_cast<float>(v));
}

double f16_value(std::uint16_t h) {
  return from_bits(Precision::fp16, h);
}

// gptq and awq: per (group, row) an affine 4-bit code, s = (max - min) / 15 in fp16, z the code of
// 0, q = nearest(w / s) + z.
Packed quantize_int4(TensorFormat f, const std::vector<double>& w, index_t rows, index_t cols,
                     const Quantize& o) {
  const bool awq = f == TensorFormat::awq;
  need(rows % 8 == 0 && cols % 8 == 0, std::string(to_string(f)) +
                                           ": rows and columns are multiples of 8, got " +
                                           std::to_string(rows) + " x " + std::to_string(cols));
  const index_t gs = o.group_size < 0 ? cols : o.group_size;
  need(gs > 0 && cols % gs == 0, std::string(to_string(f)) + ": the group size " +
                                     std::to_string(gs) + " does not divide " +
                                     std::to_string(cols) + " columns");
  const index_t groups = cols / gs;
  std::vector<index_t> order(static_cast<std::size_t>(cols));
  std::iota(order.begin(), order.end(), index_t{0});
  if (!awq && o.act_order) {
    std::mt19937_64 rng(o.seed);
    std::shuffle(order.begin(), order.end(), rng);
  }
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(cols));
  for (index_t k = 0; k < cols; ++k) g_idx[order[k]] = static_cast<std::int32_t>(k / gs);
  const int lo_zero = awq ? 0 : o.zero_offset;
  std::vector<std::uint16_t> scales(static_cast<std::size_t>(groups * rows));
  std::vector<int> zeros(static_cast<std::size_t>(groups * rows));
  for (index_t g = 0; g < groups; ++g) {
    for (index_t r = 0; r < rows; ++r) {
      double lo = 0, hi = 0;
      for (index_t k = g * gs; k < (g + 1) * gs; ++k) {
        lo = std::min(lo, w[r * cols + order[k]]);
        hi = std::max(hi, w[r * cols + order[k]]);
      }
      std::uint16_t h = f16_bits((hi - lo) / 15);
      if (f16_value(h) == 0) h = f16_bits(1.0);
      scales[g * rows + r] = h;
      const int z = static_cast<int>(std::nearbyint(-lo / f16_value(h)));
      zeros[g * rows + r] = std::clamp(z, lo_zero, 15);
    }
  }
  std::vector<std::uint32_t> qw(static_cast<std::size_t>(rows * cols / 8), 0);
  std::vector<std::uint32_t> qz(static_cast<std::size_t>(groups * rows / 8), 0);
  for (index_t r = 0; r < rows; ++r) {
    for (index_t c = 0; c < cols; ++c) {
      const index_t g = g_idx[c];
      const double s = f16_value(scales[g * rows + r]);
      const int z = zeros[g * rows + r];
      const int q = std::clamp(static_cast<int>(std::nearbyint(w[r * cols + c] / s)) + z, 0, 15);
      const auto v = static_cast<std::uint32_t>(q);
      if (awq) {
        qw[c * (rows / 8) + r / 8] |= v << (4 * awq_nibble_of_column(static_cast<int>(r % 8)));
      } else {
        qw[(c / 8) * rows + r] |= v << (4 * (c % 8));
      }
    }
  }
  for (index_t g = 0; g < groups; ++g) {
    for (index_t r = 0; r < rows; ++r) {
      const auto z = static_cast<std::uint32_t>(zeros[g * rows + r] - lo_zero);
      const int k = awq ? awq_nibble_of_column(static_cast<int>(r % 8)) : static_cast<int>(r % 8);
      qz[g * (rows / 8) + r / 8] |= z << (4 * k);
    }
  }
  Packed p;
  p.format = f;
  p.parts["qweight"] = make(
      "qweight", DType::I32,
      awq ? std::vector<std::int64_t>{cols, rows / 8} : std::vector<std::int64_t>{cols / 8, rows},
      qw.data(), qw.size() * 4);
  p.parts["qzeros"] = make("qzeros", DType::I32, {groups, rows / 8}, qz.data(), qz.size() * 4);
  p.parts["scales"] = make("scales", DType::F16, {groups, rows}, scales.data(), scales.size() * 2);
  if (!awq) p.parts["g_idx"] = make("g_idx", DType::I32, {cols}, g_idx.data(), g_idx.size() * 4);
  return p;
}

}  // namespace

Packed quantize(TensorFormat f, const std::vector<double>& w,
                const std::vector<std::int64_t>& shape, const Quantize& o) {
  need(shape.size() >= 2 && (f == TensorFormat::mxfp4 || shape.size() == 2),
       std::string(to_string(f)) + ": a weight is (rows, cols)" +
           (f == TensorFormat::mxfp4 ? " with leading dimensions" : ""));
  index_t n = 1;
  for (auto d : shape) {
    need(d > 0, std::string(to_string(f)) + ": every dimension of a weight is at least 1");
    n *= d;
  }
  need(static_cast<index_t>(w.size()) == n, "quantize: the values do not fill the shape");
  for (double v : w)
    if (!std::isfinite(v)) throw InputError("quantize: a weight is not finite");
  const index_t cols = shape.back(), rows = n / cols;
  Packed p;
  p.format = f;
  switch (f) {
    case TensorFormat::int8: {
      std::vector<float> scale(static_cast<std::size_t>(rows));
      std::vector<std::int8_t> q(static_cast<std::size_t>(n));
      for (index_t r = 0; r < rows; ++r) {
        double amax = 0;
        for (index_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
        scale[r] = static_cast<float>(amax / 127);
        if (!(scale[r] > 0)) scale[r] = 1.0f;  // a row of zeros, or one so small its scale is 0
        for (index_t c = 0; c < cols; ++c) {
          const double v = std::nearbyint(w[r * cols + c] / scale[r]);
          q[r * cols + c] = static_cast<std::int8_t>(std::clamp(v, -127.0, 127.0));
        }
      }
      p.parts["weight"] = make("weight", DType::I8, {rows, cols}, q.data(), q.size());
      p.parts["weight_scale"] =
          make("weight_scale", DType::F32, {rows, 1}, scale.data(), scale.size() * 4);
      return p;
    }
    case TensorFormat::gptq:
    case TensorFormat::awq:
      return quantize_int4(f, w, rows, cols, o);
    case TensorFormat::mxfp4: {
      need(cols % 32 == 0, "mxfp4: columns are whole blocks of 32, got " + std::to_string(cols));
      const index_t blocks = n / 32;
      std::vector<std::uint8_t> b(static_cast<std::size_t>(blocks * 16), 0);
      std::vector<std::uint8_t> e(static_cast<std::size_t>(blocks));
      for (index_t k = 0; k < blocks; ++k) {
        double amax = 0;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(w[k * 32 + j]));
        // OCP's shared exponent: floor(log2 amax) - 2 (E2M1's largest exponent).
        const int x = amax > 0 ? std::clamp(std::ilogb(amax) - 2 + 127, 0, 254) : 0;
        e[k] = static_cast<std::uint8_t>(x);
        for (int j = 0; j < 32; ++j) {
          const int code = nearest_e2m1(std::ldexp(w[k * 32 + j], 127 - x));
          b[k * 16 + j / 2] = static_cast<std::uint8_t>(b[k * 16 + j / 2] | code << (4 * (j % 2)));
        }
      }
      std::vector<std::int64_t> bs(shape.begin(), shape.end() - 1), es = bs;
      bs.push_back(cols / 32);
      bs.push_back(16);
      es.push_back(cols / 32);
      p.parts["blocks"] = make("blocks", DType::U8, bs, b.data(), b.size());
      p.parts["scales"] = make("scales", DType::U8, es, e.data(), e.size());
      return p;
    }
    case TensorFormat::nvfp4: {
      need(cols % 16 == 0, "nvfp4: columns are whole blocks of 16, got " + std::to_string(cols));
      double amax = 0;
      for (double v : w) amax = std::max(amax, std::fabs(v));
      // ModelOpt's global scale: the tensor's amax over E2M1's 6 times E4M3's 448.
      float global = static_cast<float>(amax / (6.0 * 448.0));
      if (!(global >= 0x1p-126f)) global = 1.0f;  // zeros, or so small the scale is not normal
      std::vector<std::uint8_t> q(static_cast<std::size_t>(n / 2), 0);
      std::vector<std::uint8_t> s(static_cast<std::size_t>(n / 16));
      for (index_t k = 0; k < n / 16; ++k) {
        double bmax = 0;
        for (int j = 0; j < 16; ++j) bmax = std::max(bmax, std::fabs(w[k * 16 + j]));
        s[k] = to_fp8_bits(Fp8Format::e4m3, true, static_cast<float>(bmax / 6.0 / global));
        const double scale = static_cast<double>(from_fp8_bits(Fp8Format::e4m3, s[k])) * global;
        for (int j = 0; j < 16; ++j) {
          const int code = scale > 0 ? nearest_e2m1(w[k * 16 + j] / scale) : 0;
          const index_t at = (k * 16 + j) / 2;
          q[at] = static_cast<std::uint8_t>(q[at] | code << (4 * (j % 2)));
        }
      }
      p.parts["weight"] = make("weight", DType::U8, {rows, cols / 2}, q.data(), q.size());
      p.parts["weight_scale"] =
          make("weight_scale", DType::F8_E4M3, {rows, cols / 16}, s.data(), s.size());
      p.parts["weight_scale_2"] = make("weight_scale_2", DType::F32, {}, &global, 4);
      return p;
    }
  }
  return p;
}

std::vector<std::uint8_t> swizzle_128x4(const std::vector<std::uint8_t>& scales, index_t rows,
                                        index_t cols) {
  need(rows >= 0 && cols >= 0 && static_cast<index_t>(scales.size()) == rows * cols,
       "swizzle_128x4: the scales do not fill rows x cols");
  const index_t pr = (rows + 127) / 128 * 128, pc = (cols + 3) / 4 * 4;
  std::vector<std::uint8_t> out(static_cast<std::size_t>(pr * pc), 0);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      const index_t at =
          (r / 128) * (128 * pc) + (c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
      out[at] = scales[r * cols + c];
    }
  return out;
}

std::vector<std::uint8_t> unswizzle_128x4(const std::vector<std::uint8_t>& swizzled, index_t rows,
                                          index_t cols) {
  const index_t pr = (rows + 127) / 128 * 128, pc = (cols + 3) / 4 * 4;
  need(rows >= 0 && cols >= 0 && static_cast<index_t>(swizzled.size()) == pr * pc,
       "unswizzle_128x4: " + std::to_string(swizzled.size()) + " bytes are not a padded " +
           std::to_string(rows) + " x " + std::to_string(cols) + " scale matrix");
  std::vector<std::uint8_t> out(static_cast<std::size_t>(rows * cols));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      const index_t at =
          (r / 128) * (128 * pc) + (c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
      out[r * cols + c] = swizzled[at];
    }
  return out;
}

}  // namespace teo::quant
