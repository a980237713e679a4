// The library's counter-based generator. Every random number teo draws (parameter initialisation,
// dropout masks, synthetic tokens) is a pure function of (seed, stream, index), so results do not
// depend on thread count, call order, standard library or machine. docs/semantics.md states the
// exact functions so that another backend can replay them.
#pragma once

#include <cstdint>
#include <string_view>

namespace teo::rng {

// SplitMix64's finaliser: a bijection on 64-bit words with full avalanche.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FNV-1a over the bytes of a name: turns "dropout.layers.0.attn" into a stream id.
constexpr std::uint64_t stream_id(std::string_view name) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001B3ull;
  }
  return h;
}

// 64 random bits for element `index` of stream `stream` under `seed`.
constexpr std::uint64_t bits(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return mix64(mix64(seed ^ mix64(stream)) + index);
}

// A double uniform in [0, 1) with 53 random bits; exact, so identical everywhere.
constexpr double uniform01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return static_cast<double>(bits(seed, stream, index) >> 11) * 0x1.0p-53;
}

}  // namespace teo::rng
