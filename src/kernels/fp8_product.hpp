// Internal: a matrix product with both operands quantized to fp8 under the thread's recipe
// (detail::fp8_recipe()), as a Precision::fp8 pass computes every linear layer's products.
#pragma once

#include <string>
#include <vector>

#include "teo/fp8.hpp"
#include "teo/types.hpp"

namespace teo::detail {

// One operand of fp8_product, as stored: op(X)(r, p) = x[r * ld + p], or x[p * ld + r] when
// `transposed`. `gradient` picks the recipe's backward format, `weight` its weight blocks.
struct Fp8Side {
  const float* x = nullptr;
  index_t ld = 0;
  bool transposed = false;
  bool gradient = false;
  bool weight = false;
  const char* what = "";  // names the operand in an error
  // names the operand among its op's products where an Fp8Recorder keeps them (e.g. "y.x")
  const char* kept = nullptr;
};

// Keeps, for its life, every operand fp8_product quantizes on this thread whose side names it
// (Fp8Side::kept), in the order quantized: the linear op case's fp8 operands (`--keep fp8.*`).
class Fp8Recorder {
 public:
  struct Operand {
    std::string name;
    Fp8Operand value;
  };
  Fp8Recorder();
  ~Fp8Recorder();
  Fp8Recorder(const Fp8Recorder&) = delete;
  Fp8Recorder& operator=(const Fp8Recorder&) = delete;
  const std::vector<Operand>& operands() const { return kept_; }
  void add(const char* name, const Fp8Operand& o) { kept_.push_back({name, o}); }

 private:
  std::vector<Operand> kept_;
  Fp8Recorder* outer_;
};

// Delayed scales (Fp8Recipe::delayed): the dequantization scale of a linear layer's input, weight
// and output gradient, one per tensor; each operand is quantized as round_to_fp8(x / scale).
struct Fp8DelayedScales {
  float input = 0, weight = 0, gradient = 0;
};
// The thread's delayed scales (all 0 outside a scope).
const Fp8DelayedScales& fp8_delayed_scales();
// Sets the thread's delayed scales for the scope's life (the linear op case's run).
class Fp8DelayedScope {
 public:
  explicit Fp8DelayedScope(const Fp8DelayedScales& s);
  ~Fp8DelayedScope();
  Fp8DelayedScope(const Fp8DelayedScope&) = delete;
  Fp8DelayedScope& operator=(const Fp8DelayedScope&) = delete;

 private:
  Fp8DelayedScales outer_;
};

// c (m, n, ldc) = op(A) (m, k) times op(B)^T, op(B) being (n, k), both quantized along k and
// multiplied with fp8_gemm under the recipe (with the thread's delayed scales when the recipe's
// scales are delayed: a ConfigError naming the operand where none is set); with `accumulate` the
// float32 product is added to c (one rounding more), otherwise it overwrites c.
void fp8_product(const Fp8Side& a, const Fp8Side& b, index_t m, index_t n, index_t k,
                 bool accumulate, float* c, index_t ldc);

}  // namespace teo::detail
