// Shared by the fuzz harnesses: a reader that turns fuzz bytes into numbers, and a check that
// stops the run (a crash the fuzzer reports) when a property fails.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace teo::fuzz {

// Takes values off the front of the input; once it is exhausted every value is 0.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : p_(data), n_(size) {}
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | byte();
    return v;
  }
  std::uint8_t byte() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  // A value in [lo, hi], or now and then one of the extreme values that validation must reject.
  std::int64_t pick(std::int64_t lo, std::int64_t hi) {
    const std::uint8_t sel = byte();
    if (sel == 255) return static_cast<std::int64_t>(u64());  // anything at all
    if (sel == 254) return -1 - static_cast<std::int64_t>(byte());
    if (sel == 253) return std::int64_t{1} << (byte() % 63);
    if (hi <= lo) return lo;
    // In unsigned arithmetic, so that any [lo, hi] works; span 0 means the whole 64-bit range.
    const std::uint64_t span = static_cast<std::uint64_t>(hi) - static_cast<std::uint64_t>(lo) + 1;
    const std::uint64_t r = span == 0 ? u64() : u64() % span;
    return static_cast<std::int64_t>(static_cast<std::uint64_t>(lo) + r);
  }
  double real01() { return static_cast<double>(u64() >> 11) * 0x1.0p-53; }
  bool flag() { return byte() & 1; }
  std::string rest() {
    std::string s(reinterpret_cast<const char*>(p_), n_);
    p_ += n_;
    n_ = 0;
    return s;
  }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
};

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz property failed: %s\n", what.c_str());
  std::abort();
}

inline void require(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

}  // namespace teo::fuzz
