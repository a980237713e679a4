// Exception types. Every rejection of bad input throws one of these, and its message names the
// offending field and its value. All derive from teo::Error so callers can catch them together.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "teo/types.hpp"

namespace teo {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An ModelConfig field is missing, of the wrong type, unknown or out of range.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A size is zero/negative where that makes no sense, inconsistent with the config, or its element
// or byte count overflows 64 bits.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A value inside an input tensor is invalid: a token id outside [0, vocab_size), a label outside
// [0, num_classes).
class InputError : public Error {
 public:
  using Error::Error;
};

// Training produced a loss that is not finite (`teo train` exits 3 on it, not 2).
class TrainingDiverged : public Error {
 public:
  using Error::Error;
};

// A value left the range of the precision being emulated: an fp16 run produced a finite value
// beyond 65504 (docs/semantics.md, "Reduced precision"); the message names the tensor.
class RangeError : public Error {
 public:
  using Error::Error;
};

// A golden case whose float32 (or emulated reduced-precision) error is not at rounding level, so
// that no error bound derived from it means anything; the message names the stage and the cause.
class IllConditioned : public Error {
 public:
  using Error::Error;
};

// A file or directory cannot be opened, read, created or renamed; the message names the path.
class FileError : public Error {
 public:
  using Error::Error;
};

// A file's contents break its format (a malformed safetensors file, a golden without the tensors
// its case needs); the message names the file and the rule broken.
class FormatError : public Error {
 public:
  using Error::Error;
};

// The user asked a long computation to stop (SIGINT or SIGTERM); what it was writing is removed.
class Interrupted : public Error {
 public:
  using Error::Error;
};

// a * b, or ShapeError naming `what` when the product leaves [0, INT64_MAX].
inline index_t checked_mul(index_t a, index_t b, const std::string& what) {
  index_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) {
    throw ShapeError(what + ": size " + std::to_string(a) + " x " + std::to_string(b) +
                     " overflows 64 bits");
  }
  return r;
}

// a + b for non-negative sizes, or ShapeError naming `what` on overflow.
inline index_t checked_add(index_t a, index_t b, const std::string& what) {
  index_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) {
    throw ShapeError(what + ": size " + std::to_string(a) + " + " + std::to_string(b) +
                     " overflows 64 bits");
  }
  return r;
}

}  // namespace teo
