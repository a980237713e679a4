// Harness 1: the safetensors reader on arbitrary bytes. It either rejects them with a
// teo::FormatError, or reads a file that serialises and reads back to the same tensors.
#include <cstdint>
#include <string_view>

#include "fuzz_util.hpp"
#include "teo/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace st = teo::safetensors;
  st::Limits limits;
  limits.max_header_bytes = 1 << 20;
  st::File f;
  try {
    f = st::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz", limits);
  } catch (const teo::FormatError&) {
    return 0;
  }
  const std::string again = st::serialize(f);
  const st::File g = st::parse(again, "fuzz round trip");
  teo::fuzz::require(g.tensors.size() == f.tensors.size(), "round trip keeps every tensor");
  for (std::size_t i = 0; i < f.tensors.size(); ++i) {
    teo::fuzz::require(g.tensors[i].name == f.tensors[i].name &&
                           g.tensors[i].shape == f.tensors[i].shape &&
                           g.tensors[i].bytes == f.tensors[i].bytes,
                       "round trip keeps " + f.tensors[i].name);
    teo::fuzz::require(
        static_cast<std::size_t>(f.tensors[i].numel()) * st::dtype_size(f.tensors[i].dtype) ==
            f.tensors[i].bytes.size(),
        "size matches shape");
  }
  teo::fuzz::require(g.metadata == f.metadata, "round trip keeps the metadata");
  return 0;
}
