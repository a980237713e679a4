// Harness 4: `golden check` of an arbitrary candidate file against a real golden. A candidate
// either is rejected as a malformed file (teo::FormatError) or gets a report whose counts add up.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "fuzz_util.hpp"
#include "teo/golden.hpp"

namespace {

// The golden to check against: beside the executable (where .clusterfuzzlite/build.sh puts it for
// the fuzzing engines' runners), else in the source tree this harness was built from.
std::string golden_path() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto beside = exe.parent_path() / (exe.filename().string() + ".golden.safetensors");
    if (std::filesystem::exists(beside, ec)) return beside.string();
  }
  return std::string(TEO_SOURCE_DIR) + "/golden/post_gelu_mean_f32.safetensors";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace st = teo::safetensors;
  static const st::File golden = st::read(golden_path());
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
