// Harness 4: `golden check` of an arbitrary candidate file against a real golden. A candidate
// either is rejected as a malformed file (teo::FormatError) or gets a report whose counts add up.
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.hpp"
#include "teo/golden.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace st = teo::safetensors;
  static const st::File golden =
      st::read(std::string(TEO_SOURCE_DIR) + "/golden/post_gelu_mean_f32.safetensors");
  st::File candidate;
  try {
    candidate = st::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const teo::FormatError&) {
    return 0;
  }
  teo::golden::CheckOptions opts;
  const auto rep = teo::golden::check(golden, candidate, opts);
  teo::fuzz::require(
      rep.passed + rep.failed + rep.not_checked == static_cast<int>(rep.tensors.size()),
      "every tensor is counted once");
  teo::fuzz::require(rep.failed == 0 || !rep.first_divergence.empty(),
                     "a failure names its first divergence");
  (void)teo::golden::junit_xml({rep});
  (void)teo::golden::json_report({rep});
  return 0;
}
