// Which float32 bit patterns a rounding test runs through: all 2^32 of them (the exhaustive
// sweep, label `exhaustive`, run by `scripts/test.sh --full`), or the sampled sweep CI runs
// instead. The sampled set keeps the exhaustive sweep's power against the bugs it exists for,
// which live at rounding boundaries: for every sign and exponent field, and for every number d of
// dropped mantissa bits (1..23, so every target format's normal range and every depth of its
// subnormal range), kept mantissas {0, 1, 2, 3, the middle, max - 1, max, four random} (all of
// them when 23 - d <= 6) with dropped remainders {0, 1, half - 1, half, half + 1, quantum - 1,
// one random}: every tie, halfway +- 1 ulp, the carry into the next binade and into infinity,
// the subnormal edges and the NaN payloads. For d = 13 and d = 16 (fp16/tf32 and bf16 in their
// normal ranges) every kept pattern is there, so that every tie of those formats is checked.
// Then 2^24 random patterns drawn fresh each run; the seed is printed, and TEO_SWEEP_SEED
// replays it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "teo/backend.hpp"

namespace teo::test {

// The seed of this run's random part: TEO_SWEEP_SEED when it is set, a fresh one otherwise;
// printed, and recorded in the JUnit report, so that a failure can be replayed.
inline std::uint64_t sweep_seed() {
  std::uint64_t seed = 0;
  if (const char* s = std::getenv("TEO_SWEEP_SEED"); s && *s) {
    seed = std::strtoull(s, nullptr, 0);
  } else {
    std::random_device rd;
    seed = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  }
  std::cout << "float sweep: random part's seed " << seed << " (replay: TEO_SWEEP_SEED=" << seed
            << ")\n";
  ::testing::Test::RecordProperty("sweep_seed", std::to_string(seed));
  return seed;
}

// The sampled sweep's patterns (see above); `random` random ones from `seed` at the end.
inline std::vector<std::uint32_t> boundary_and_random_floats(std::uint64_t seed,
                                                             std::int64_t random = 1 << 24) {
  std::mt19937_64 gen(seed);
  std::vector<std::uint32_t> out;
  out.reserve(static_cast<std::size_t>(random) + (std::size_t{1} << 23));
  for (int d = 1; d <= 23; ++d) {
    const int kept_bits = 23 - d;
    const std::uint32_t quantum = 1u << d;
    const std::uint32_t half = quantum >> 1;
    const std::uint32_t kmax = (1u << kept_bits) - 1;
    const bool every_kept = kept_bits <= 6 || d == 13 || d == 16;
    for (std::uint32_t top = 0; top < 512; ++top) {  // sign and exponent field
      std::vector<std::uint32_t> kept;
      if (every_kept) {
        for (std::uint32_t k = 0; k <= kmax; ++k) kept.push_back(k);
      } else {
        kept = {0, 1, 2, 3, kmax / 2, kmax - 1, kmax};
        for (int r = 0; r < 4; ++r) kept.push_back(static_cast<std::uint32_t>(gen()) & kmax);
      }
      const std::uint32_t rems[] = {0,
                                    1,
                                    half - 1,
                                    half,
                                    half + 1,
                                    quantum - 1,
                                    static_cast<std::uint32_t>(gen()) & (quantum - 1)};
      for (std::uint32_t k : kept)
        for (std::uint32_t r : rems) out.push_back(top << 23 | k << d | (r & (quantum - 1)));
    }
  }
  for (std::int64_t i = 0; i < random; ++i) out.push_back(static_cast<std::uint32_t>(gen()));
  return out;
}

// Calls check(in, n) on chunks of at most 2^16 patterns, spread over the library's threads:
// every float bit pattern when `patterns` is null, those given otherwise.
inline void for_float_chunks(const std::vector<std::uint32_t>* patterns,
                             const std::function<void(const std::uint32_t*, std::int64_t)>& check) {
  constexpr std::int64_t kChunk = 1 << 16;
  const std::int64_t total =
      patterns ? static_cast<std::int64_t>(patterns->size()) : std::int64_t{1} << 32;
  parallel_tasks((total + kChunk - 1) / kChunk, [&](std::int64_t chunk) {
    const std::int64_t begin = chunk * kChunk;
    const std::int64_t n = std::min(kChunk, total - begin);
    if (patterns) {
      check(patterns->data() + begin, n);
      return;
    }
    thread_local std::vector<std::uint32_t> in(kChunk);
    for (std::int64_t i = 0; i < n; ++i) in[i] = static_cast<std::uint32_t>(begin + i);
    check(in.data(), n);
  });
}

}  // namespace teo::test
