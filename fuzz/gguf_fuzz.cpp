// Harness 6: the GGUF reader on arbitrary bytes. It either rejects them with a teo::FormatError,
// or reads a file whose every block is valid and which serialises to the same bytes (its last
// tensor's padding completed) and reads back to the same metadata and tensors.
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.hpp"
#include "teo/errors.hpp"
#include "teo/gguf.hpp"
#include "teo/quant.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace gguf = teo::gguf;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  gguf::Limits limits;
  limits.max_metadata_items = 1 << 16;
  gguf::File f;
  try {
    f = gguf::parse(in, "fuzz", limits);
  } catch (const teo::FormatError&) {
    return 0;
  }
  const std::string again = gguf::serialize(f);
  teo::fuzz::require(again.size() >= size && again.compare(0, size, in) == 0 &&
                         again.find_first_not_of('\0', size) == std::string::npos,
                     "a file that reads writes back as itself");
  const gguf::File g = gguf::parse(again, "fuzz round trip");
  teo::fuzz::require(g.metadata.size() == f.metadata.size() && g.tensors.size() == f.tensors.size(),
                     "round trip keeps every key and tensor");
  for (std::size_t i = 0; i < f.metadata.size(); ++i) {
    teo::fuzz::require(
        g.metadata[i].first == f.metadata[i].first && g.metadata[i].second == f.metadata[i].second,
        "round trip keeps " + f.metadata[i].first);
  }
  for (const auto& t : f.tensors) {
    const auto shape = teo::quant::block_shape(t.type);
    std::string why;
    const auto blocks = static_cast<std::int64_t>(t.data().size()) / shape.bytes;
    teo::fuzz::require(
        t.numel() / shape.values == blocks &&
            teo::quant::first_invalid_block(t.type, t.data().data(), blocks, why) < 0,
        "every block of " + t.name + " is whole and valid");
  }
  return 0;
}
