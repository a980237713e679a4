// Harness 5: `teo golden op` specs. Any bytes either are not a JSON spec, or give a named error
// (ConfigError, ShapeError) before anything is allocated, or give a case: its normalised spec
// reads back to itself, the file it makes parses, holds every tensor of the op's contract with
// its shape, and passes the check against itself. Generation is capped at 8 MiB per case.
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_util.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace golden = teo::golden;
  namespace st = teo::safetensors;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  golden::OpCase c;
  try {
    c = golden::OpCase::from_json(j, "", std::uint64_t{8} << 20);
  } catch (const teo::ConfigError&) {
    return 0;
  } catch (const teo::ShapeError&) {
    return 0;
  }
  const golden::OpCase again = golden::OpCase::from_json(nlohmann::json(c.spec));
  teo::fuzz::require(again.spec == c.spec, "the normalised spec reads back to itself");
  st::File f;
  try {
    f = golden::make_op(c);
  } catch (const teo::IllConditioned&) {
    return 0;  // a named refusal: the float32 or precision case is not at rounding level
  } catch (const teo::RangeError&) {
    return 0;  // a named refusal: an fp16 overflow
  }
  const st::File parsed = st::parse(st::serialize(f), "fuzz");
  for (const auto& t : golden::op_contract(c)) {
    const auto* have = parsed.find(t.name);
    teo::fuzz::require(have != nullptr && have->shape == t.shape,
                       "the case holds every contract tensor with its shape");
  }
  const auto rep = golden::check(parsed, parsed, {});
  teo::fuzz::require(rep.failed == 0, "a case passes against itself");
  return 0;
}
