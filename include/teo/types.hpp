// The vocabulary every part of teo shares: the index type and the enums that name a choice. It
// declares no function, so the per-ISA kernel translation units include it too.
#pragma once

#include <cstdint>

namespace teo {

using index_t = std::int64_t;  // sizes, indices and strides

// The feed-forward activation: relu, exact gelu (erf), gelu with the tanh approximation, or silu
// (x sigmoid(x), SwiGLU's).
enum class Activation { relu, gelu, gelu_tanh, silu };

// The elementary functions the vector kernels implement, as the accuracy tests call them.
enum class MathFn { exp, erf, tanh };

// The number format a computation stores its tensors in (teo/precision.hpp): float64, float32,
// float32 with tf32 matrix products, bfloat16 or IEEE half.
enum class Precision { fp64, fp32, tf32, bf16, fp16, fp8 };

// The two OCP 8-bit floating-point formats (teo/fp8.hpp): E4M3 ("fn": bias 7, no infinities,
// largest finite 448) and E5M2 (bias 15, IEEE-like, largest finite 57344).
enum class Fp8Format { e4m3, e5m2 };

}  // namespace teo
