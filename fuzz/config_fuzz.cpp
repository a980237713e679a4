// Harness 2: the config and case JSON parsers (ModelConfig, a golden CASE.json, the training
// options) on arbitrary text. Each either throws a teo::Error or gives a value that survives a
// round trip through its own JSON.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.hpp"
#include "teo/config.hpp"
#include "teo/golden.hpp"
#include "teo/train/options.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto cfg = teo::ModelConfig::from_json_text(text);
    teo::fuzz::require(teo::ModelConfig::from_json(cfg.to_json()) == cfg,
                       "ModelConfig JSON round trip");
  } catch (const teo::Error&) {
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  try {
    const auto c = teo::golden::Case::from_json(j);
    nlohmann::json again = c.config.to_json();
    again["case"] = c.case_json();
    const auto d = teo::golden::Case::from_json(again);
    teo::fuzz::require(d.config == c.config && d.batch == c.batch && d.seq_len == c.seq_len &&
                           d.seed == c.seed && d.dtype == c.dtype,
                       "golden case round trip");
  } catch (const teo::Error&) {
  }
  try {
    teo::train::TrainOptions o;
    o.apply_json(j);
    o.validate();
  } catch (const teo::Error&) {
  }
  return 0;
}
