// Quantizing an operand to fp8 with its scales, and the product an fp8 tensor core computes from
// two such operands (docs/fp8.md). The float32 path runs on the simd GEMM, whose every output is
// one chain of fused multiply-adds in increasing k: fp8 products are exact in float32, so that
// chain is the sum a tensor core accumulating in float32 forms, and its bits depend on neither the
// ISA nor the thread count. The limited-precision path is a plain loop per output, in parallel
// over rows.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/fp8_product.hpp"
#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"
#include "teo/errors.hpp"
#include "teo/fp8.hpp"

namespace teo {

namespace {

index_t ceil_div(index_t a, index_t b) {
  return (a + b - 1) / b;
}

// Each scale finite and positive, else a ConfigError "<prefix><index> is <value>; ...".
void check_scales(const std::vector<float>& scales, const std::string& prefix) {
  for (std::size_t i = 0; i < scales.size(); ++i) {
    if (!(std::isfinite(scales[i]) && scales[i] > 0)) {
      throw ConfigError(prefix + std::to_string(i) + " is " + std::to_string(scales[i]) +
                        "; a scale must be finite and positive");
    }
  }
}

// The block shape a recipe gives an operand of (rows, k).
void set_blocks(Fp8Operand& o, const Fp8Quantization& how, const std::string& what) {
  if (how.scaling == Fp8Scaling::block && (how.block_rows < 1 || how.block_k < 1)) {
    throw ConfigError(what + ": an fp8 scale block must be at least 1 x 1, got " +
                      std::to_string(how.block_rows) + " x " + std::to_string(how.block_k));
  }
  const Fp8Block b = fp8_block(how, o.rows, o.k);
  o.block_rows = b.rows;
  o.block_k = b.k;
}

// op(X) copied densely, row-major (rows, k); a non-finite value is a RangeError naming what.
void dense_copy(std::vector<float>& q, const float* x, index_t rows, index_t k, index_t ld,
                bool transposed, const std::string& what) {
  q.resize(static_cast<std::size_t>(rows * k));
  std::atomic<bool> bad{false};
  detail::for_blocks(rows, std::max<index_t>(1, 4096 / std::max<index_t>(k, 1)),
                     [&](index_t r0, index_t r1) {
                       for (index_t r = r0; r < r1; ++r) {
                         float* out = q.data() + r * k;
                         for (index_t p = 0; p < k; ++p) {
                           out[p] = transposed ? x[p * ld + r] : x[r * ld + p];
                           if (!std::isfinite(out[p])) bad.store(true, std::memory_order_relaxed);
                         }
                       }
                     });
  if (bad) {
    throw RangeError(what + ": holds a non-finite value (inf or NaN), which fp8 cannot scale");
  }
}

// q = round_to_fp8(q * mul of its block), or q / scale of its block where no multipliers are
// given, row by row.
void scale_and_round(Fp8Operand& o, bool saturate, const std::string& what,
                     const std::vector<float>* mul = nullptr) {
  const index_t sc = o.scale_cols();
  const auto& round = detail::isa_kernels().rounding.round_fp8;
  std::atomic<bool> over{false};
  detail::for_blocks(o.rows, std::max<index_t>(1, 4096 / std::max<index_t>(o.k, 1)),
                     [&](index_t r0, index_t r1) {
                       for (index_t r = r0; r < r1; ++r) {
                         float* row = o.q.data() + r * o.k;
                         const index_t at = (r / o.block_rows) * sc;
                         const float* s = o.scale.data() + at;
                         const float* m = mul ? mul->data() + at : nullptr;
                         for (index_t p = 0; p < o.k; ++p) {
                           const index_t b = p / o.block_k;
                           row[p] = m ? row[p] * m[b] : row[p] / s[b];
                         }
                         if (round(row, row, o.k, o.format, saturate)) over = true;
                       }
                     });
  if (over) {
    throw RangeError(what + ": a scaled value overflowed " + to_string(o.format) +
                     " (its largest finite value is " +
                     (o.format == Fp8Format::e4m3 ? "448" : "57344") + ") without saturation");
  }
}

Fp8Operand prepare(const float* x, index_t rows, index_t k, index_t ld, bool transposed,
                   const Fp8Quantization& how, const std::string& what) {
  if (rows < 0 || k < 0) throw ShapeError(what + ": negative size");
  Fp8Operand o;
  o.format = how.format;
  o.scaling = how.scaling;
  o.rows = rows;
  o.k = k;
  set_blocks(o, how, what);
  dense_copy(o.q, x, rows, k, ld, transposed, what);
  o.scale.assign(static_cast<std::size_t>(ceil_div(rows, o.block_rows) * o.scale_cols()), 0.0f);
  return o;
}

}  // namespace

Fp8Operand quantize_fp8(const float* x, index_t rows, index_t k, index_t ld, bool transposed,
                        const Fp8Quantization& how, const std::string& what) {
  Fp8Operand o = prepare(x, rows, k, ld, transposed, how, what);
  // Each block's amax: the maximum does not depend on the order it is taken in.
  const index_t sc = o.scale_cols();
  std::vector<float>& amax = o.scale;
  detail::for_blocks(ceil_div(rows, o.block_rows), 1, [&](index_t b0, index_t b1) {
    for (index_t br = b0; br < b1; ++br) {
      for (index_t r = br * o.block_rows; r < std::min(rows, (br + 1) * o.block_rows); ++r) {
        const float* row = o.q.data() + r * k;
        for (index_t p = 0; p < k; ++p) {
          float& m = amax[br * sc + p / o.block_k];
          m = std::max(m, std::fabs(row[p]));
        }
      }
    }
  });
  // The multiplier fl(fp8_max / amax) quantizes, as Transformer Engine, torchao and DeepGEMM's
  // reference casts apply it; the scale fl(amax / fp8_max) dequantizes. mx's are exact powers of
  // two.
  const float top = fp8_max(how.format);
  std::vector<float> mul(o.scale.size());
  for (std::size_t i = 0; i < o.scale.size(); ++i) {
    float& s = o.scale[i];
    if (how.scaling == Fp8Scaling::mx) {
      s = e8m0_value(mx_scale(s, how.format));
      mul[i] = 1.0f / s;
    } else {
      // An amax so small that fp8_max / amax overflows: the multiplier is clamped to float's
      // largest value (as Transformer Engine clamps it) and the scale is its reciprocal, so that
      // q * scale stays the value.
      const float ratio = s > 0 ? top / s : 1.0f;
      const float m = std::min(ratio, std::numeric_limits<float>::max());
      mul[i] = m;
      s = s > 0 ? (m < ratio ? 1.0f / m : s / top) : 1.0f;
    }
  }
  scale_and_round(o, how.saturate, what, &mul);
  return o;
}

Fp8Operand quantize_fp8(const float* x, index_t rows, index_t k, index_t ld, bool transposed,
                        const Fp8Quantization& how, const std::vector<float>& scales,
                        const std::string& what) {
  Fp8Operand o = prepare(x, rows, k, ld, transposed, how, what);
  if (scales.size() != o.scale.size()) {
    throw ConfigError(what + ": " + std::to_string(o.scale.size()) + " fp8 scale(s) needed (" +
                      std::to_string(ceil_div(rows, o.block_rows)) + " x " +
                      std::to_string(o.scale_cols()) + " blocks), got " +
                      std::to_string(scales.size()));
  }
  check_scales(scales, what + ": fp8 scale ");
  o.scale = scales;
  scale_and_round(o, how.saturate, what);
  return o;
}

namespace {

// An mx operand's values q * 2^e (exact but for results below float's normal range), row-major.
std::vector<float> dequantized(const Fp8Operand& o) {
  std::vector<float> d(o.q.size());
  const index_t sc = o.scale_cols(), k = o.k;
  detail::for_blocks(o.rows, 64, [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r)
      for (index_t p = 0; p < k; ++p) d[r * k + p] = o.q[r * k + p] * o.scale[r * sc + p / 32];
  });
  return d;
}

// v truncated toward zero to `bits` explicit mantissa bits (a normal double: clear the rest).
double chop(double v, int bits) {
  const auto mask = ~((std::uint64_t{1} << (52 - bits)) - 1);
  return std::bit_cast<double>(std::bit_cast<std::uint64_t>(v) & mask);
}

// The limited-precision product, one output at a time (docs/fp8.md, "Limited accumulation").
void limited_gemm(const Fp8Operand& a, const Fp8Operand& b, float* c, index_t ldc,
                  const Fp8Accumulation& acc) {
  const index_t m = a.rows, n = b.rows, k = a.k;
  const bool mx = a.scaling == Fp8Scaling::mx;
  // The k blocks whose scales apply to a partial sum: mx scales apply to each product instead.
  const index_t bk = mx ? std::max<index_t>(k, 1) : a.block_k;
  const index_t seg = acc.promote_every > 0 ? acc.promote_every : bk;
  const index_t asc = a.scale_cols(), bsc = b.scale_cols();
  std::vector<float> ax, bx;
  if (mx) {
    ax = dequantized(a);
    bx = dequantized(b);
  }
  detail::for_blocks(m, 1, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i) {
      const float* sa = a.scale.data() + (i / a.block_rows) * asc;
      const float* x = (mx ? ax.data() : a.q.data()) + i * k;
      for (index_t j = 0; j < n; ++j) {
        const float* sb = b.scale.data() + (j / b.block_rows) * bsc;
        const float* y = (mx ? bx.data() : b.q.data()) + j * k;
        float total = 0.0f;
        for (index_t k0 = 0; k0 < k; k0 += bk) {
          const index_t k1 = std::min(k, k0 + bk);
          float block = 0.0f;
          for (index_t s0 = k0; s0 < k1; s0 += seg) {
            const index_t s1 = std::min(k1, s0 + seg);
            double part = 0.0;
            for (index_t p = s0; p < s1; ++p)
              part = chop(part + static_cast<double>(x[p]) * static_cast<double>(y[p]),
                          acc.mantissa_bits);
            block += static_cast<float>(part);
          }
          const float scaled = mx ? block : block * (sa[k0 / bk] * sb[k0 / bk]);
          total = k0 == 0 ? scaled : total + scaled;
        }
        c[i * ldc + j] = total;
      }
    }
  });
}

// A caller-built operand must be one quantize_fp8 could have built, or the product would read
// past its values or scales, or divide by a block of 0: sizes of at least 0, a block of at least
// 1 x 1 (MX: 1 x 32; tensor scaling: one block for the whole operand), q holding rows x k values
// and scale one per block, each finite and positive. Otherwise a ShapeError or ConfigError naming
// the operand.
void check_operand(const Fp8Operand& o, const char* which) {
  const std::string w = std::string("fp8_gemm: operand ") + which;
  const auto dims = [](index_t r, index_t c) {
    return std::to_string(r) + " x " + std::to_string(c);
  };
  if (o.rows < 0 || o.k < 0) throw ShapeError(w + " has a negative size, " + dims(o.rows, o.k));
  if (o.k > 0 && o.rows > std::numeric_limits<index_t>::max() / o.k) {
    throw ShapeError(w + "'s size " + dims(o.rows, o.k) + " overflows");
  }
  if (o.block_rows < 1 || o.block_k < 1) {
    throw ShapeError(w + "'s scale block is " + dims(o.block_rows, o.block_k) +
                     "; a block is at least 1 x 1");
  }
  if (o.scaling == Fp8Scaling::mx && (o.block_rows != 1 || o.block_k != 32)) {
    throw ShapeError(w + "'s scale block is " + dims(o.block_rows, o.block_k) +
                     "; under mx scaling it is 1 x 32");
  }
  if (static_cast<index_t>(o.q.size()) != o.rows * o.k) {
    throw ShapeError(w + " holds " + std::to_string(o.q.size()) + " values; its rows x k is " +
                     dims(o.rows, o.k));
  }
  const index_t blocks = ceil_div(o.rows, o.block_rows) * o.scale_cols();
  if (o.scaling == Fp8Scaling::tensor && blocks > 1) {
    throw ShapeError(w + " is scaled per tensor, but its scale block " +
                     dims(o.block_rows, o.block_k) + " does not cover its " + dims(o.rows, o.k) +
                     " values");
  }
  if (static_cast<index_t>(o.scale.size()) != blocks) {
    throw ShapeError(w + " holds " + std::to_string(o.scale.size()) + " scale(s); its " +
                     dims(ceil_div(o.rows, o.block_rows), o.scale_cols()) + " blocks need " +
                     std::to_string(blocks));
  }
  check_scales(o.scale, w + "'s scale ");
}

}  // namespace

void fp8_gemm(const Fp8Operand& a, const Fp8Operand& b, float* c, index_t ldc,
              const Fp8Accumulation& acc) {
  check_operand(a, "a");
  check_operand(b, "b");
  if (a.k != b.k) {
    throw ShapeError("fp8_gemm: the operands' k differ (" + std::to_string(a.k) + " and " +
                     std::to_string(b.k) + ")");
  }
  if (a.scaling != b.scaling) {
    throw ConfigError(std::string("fp8_gemm: one operand is scaled by ") + to_string(a.scaling) +
                      ", the other by " + to_string(b.scaling));
  }
  if (a.scaling == Fp8Scaling::block && a.block_k != b.block_k) {
    throw ShapeError("fp8_gemm: the operands' scale blocks span " + std::to_string(a.block_k) +
                     " and " + std::to_string(b.block_k) + " values of k");
  }
  if (acc.limited && (acc.mantissa_bits < 1 || acc.mantissa_bits > 23)) {
    throw ConfigError("fp8_gemm: a limited accumulator keeps 1 to 23 mantissa bits, got " +
                      std::to_string(acc.mantissa_bits));
  }
  if (acc.promote_every < 0) throw ConfigError("fp8_gemm: promote_every must be >= 0");
  const index_t m = a.rows, n = b.rows, k = a.k;
  if (ldc < n) throw ShapeError("fp8_gemm: ldc is below n");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (index_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  if (acc.limited) return limited_gemm(a, b, c, ldc, acc);

  const auto& tile = detail::gemm_tile<float>(detail::isa_kernels(), m, n);
  const auto product = [&](const float* x, const float* y, index_t k0, index_t len, float* out,
                           index_t ldo) {
    detail::simd_gemm(tile, Trans::no, Trans::yes, m, n, len, 1.0f, x + k0, k, y + k0, k, 0.0f, out,
                      ldo);
  };
  if (a.scaling == Fp8Scaling::mx) {
    // The power-of-two scales apply to each product: the operands' values q * 2^e.
    const std::vector<float> x = dequantized(a), y = dequantized(b);
    return product(x.data(), y.data(), 0, k, c, ldc);
  }
  // Per k block: its float32 sum times the product of the two blocks' scales, summed in order.
  const index_t bk = a.block_k;
  const index_t asc = a.scale_cols(), bsc = b.scale_cols();
  std::vector<float> part(static_cast<std::size_t>(m * n));
  for (index_t k0 = 0; k0 < k; k0 += bk) {
    product(a.q.data(), b.q.data(), k0, std::min(bk, k - k0), part.data(), n);
    const index_t kb = k0 / bk;
    detail::for_blocks(m, std::max<index_t>(1, 4096 / n), [&](index_t i0, index_t i1) {
      for (index_t i = i0; i < i1; ++i) {
        const float sa = a.scale[(i / a.block_rows) * asc + kb];
        for (index_t j = 0; j < n; ++j) {
          const float v = part[i * n + j] * (sa * b.scale[(j / b.block_rows) * bsc + kb]);
          float& out = c[i * ldc + j];
          out = kb == 0 ? v : out + v;
        }
      }
    });
  }
}

namespace detail {

namespace {
thread_local Fp8DelayedScales tl_delayed;
thread_local Fp8Recorder* tl_recorder = nullptr;
}  // namespace

Fp8Recorder::Fp8Recorder() : outer_(tl_recorder) {
  tl_recorder = this;
}

Fp8Recorder::~Fp8Recorder() {
  tl_recorder = outer_;
}

const Fp8DelayedScales& fp8_delayed_scales() {
  return tl_delayed;
}

Fp8DelayedScope::Fp8DelayedScope(const Fp8DelayedScales& s) : outer_(tl_delayed) {
  tl_delayed = s;
}

Fp8DelayedScope::~Fp8DelayedScope() {
  tl_delayed = outer_;
}

void fp8_product(const Fp8Side& a, const Fp8Side& b, index_t m, index_t n, index_t k,
                 bool accumulate, float* c, index_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate)
      for (index_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  const Fp8Recipe& r = fp8_recipe();
  const auto quantize = [&](const Fp8Side& s, index_t rows) {
    const Fp8Quantization how = fp8_quantization(r, s.gradient, s.weight);
    if (!r.delayed) return quantize_fp8(s.x, rows, k, s.ld, s.transposed, how, s.what);
    const Fp8DelayedScales& d = tl_delayed;
    const float given = s.gradient ? d.gradient : s.weight ? d.weight : d.input;
    if (given == 0) {
      throw ConfigError(std::string(s.what) +
                        ": the recipe's scales are delayed (fp8_scales) and none is given");
    }
    // one scale per tensor (validate(Fp8Recipe) refuses delayed blocks)
    return quantize_fp8(s.x, rows, k, s.ld, s.transposed, how, std::vector<float>{given}, s.what);
  };
  const Fp8Operand qa = quantize(a, m);
  const Fp8Operand qb = quantize(b, n);
  if (tl_recorder) {
    if (a.kept) tl_recorder->add(a.kept, qa);
    if (b.kept) tl_recorder->add(b.kept, qb);
  }
  if (!accumulate) return fp8_gemm(qa, qb, c, ldc, r.accumulate);
  std::vector<float> out(static_cast<std::size_t>(m * n));
  fp8_gemm(qa, qb, out.data(), n, r.accumulate);
  for_blocks(m, std::max<index_t>(1, 16384 / n), [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i)
      for (index_t j = 0; j < n; ++j) c[i * ldc + j] += out[i * n + j];
  });
}

}  // namespace detail

}  // namespace teo
