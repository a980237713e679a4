// teo/rng.hpp against the check values docs/semantics.md section 4 publishes, so that another
// implementation of the generator can be checked against the same numbers.
#include <gtest/gtest.h>

#include "teo/rng.hpp"

namespace teo {
namespace {

TEST(Rng, MatchesTheCheckValuesOfTheSpecification) {
  EXPECT_EQ(rng::mix64(0), 0xE220A8397B1DCDAFULL);
  const std::uint64_t stream = rng::stream_id("dropout.input");
  EXPECT_EQ(stream, 0xA614D457B7E3D0EEULL);
  EXPECT_EQ(rng::bits(0, stream, 0), 0x28E7246F2D7C0CFBULL);
  EXPECT_EQ(rng::uniform01(0, stream, 0), 0.15977695192621877);
  EXPECT_EQ(rng::uniform01(0, stream, 0),
            static_cast<double>(0x28E7246F2D7C0CFBULL >> 11) * 0x1p-53)
      << "uniform01 is the top 53 bits, exactly";
  // FNV-1a of the empty name is its offset basis.
  EXPECT_EQ(rng::stream_id(""), 0xCBF29CE484222325ULL);
}

}  // namespace
}  // namespace teo
