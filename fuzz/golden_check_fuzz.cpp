// Harness 4: `golden check` with an arbitrary file on either side. As a candidate against a real
// golden, the file is rejected as malformed (teo::FormatError) or gets a report whose counts add
// up. As a golden (a mutated golden: the seeds are goldens, some malformed), checked against itself
// and against the real golden's tensors, plainly and under a bf16 budget, it is rejected with a
// named teo::Error (validate()'s FormatError for a file its contract does not describe), or gets a
// report whose counts add up: never an over-read, whatever its shapes and indices say.
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
  const auto judge = [](const teo::golden::CaseReport& rep) {
    teo::fuzz::require(rep.passed + rep.failed + rep.not_checked + rep.vacuous ==
                           static_cast<int>(rep.tensors.size()),
                       "every tensor is counted once");
    // a candidate name the golden does not hold fails without being a stage that diverged
    teo::fuzz::require(rep.failed == rep.unknown || !rep.first_divergence.empty(),
                       "a failure of a golden tensor names its first divergence");
    (void)teo::golden::junit_xml({rep});
    (void)teo::golden::json_report({rep});
  };
  teo::golden::CheckOptions opts;
  judge(teo::golden::check(golden, candidate, opts));

  // The same file as the golden: validated before any of its values is read.
  bool valid = true;
  try {
    teo::golden::validate(candidate);
  } catch (const teo::FormatError&) {
    valid = false;
  }
  teo::golden::CheckOptions bf16 = opts;
  bf16.precision = teo::Precision::bf16;
  for (const st::File* c : {static_cast<const st::File*>(&candidate), &golden}) {
    for (const auto* o : {&opts, &bf16}) {
      try {
        judge(teo::golden::check(candidate, *c, *o));
        teo::fuzz::require(valid, "check accepts only a golden that validates");
      } catch (const teo::FormatError&) {
        teo::fuzz::require(!valid || o == &bf16, "a valid golden is read by the plain check");
      } catch (const teo::Error&) {  // a precision the candidate's dtypes contradict, say
      }
    }
  }
  return 0;
}
