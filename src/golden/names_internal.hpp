// Internal to the name maps: where each parameter of a config lies in a family's checkpoint
// (src/golden/names.cpp), which the quantized weights' packing (src/golden/names_packed.cpp) reads.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "teo/names.hpp"

namespace teo::names::detail {

// A parameter of the contract, or one expert's slice of it, with its rule and checkpoint name.
struct Placed {
  std::string teo;
  std::vector<std::int64_t> shape;  // teo's: the parameter's, or an expert's slice of it
  const Rule* rule;
  std::string checkpoint;
  std::int64_t offset = 0;         // of the slice in the parameter (elements)
  std::int64_t count = 0;          // the slice's elements
  std::vector<std::int64_t> full;  // the parameter's shape
};

// Every parameter of cfg (each expert's slice of a per-expert rule) where the map puts it;
// ConfigError for a parameter the map has no rule for, or rules that do not fit together.
std::vector<Placed> place(const NameMap& map, const ModelConfig& cfg);
// The checkpoint tensor's shape of a placed parameter.
std::vector<std::int64_t> checkpoint_shape(const Placed& p);
std::string shape_str(const std::vector<std::int64_t>& s);
// Index of teo element `e` (row-major in teo's shape) in the checkpoint tensor.
std::int64_t checkpoint_index(const Placed& p, std::int64_t e);
// The file's tensor `role` + name, the name with or without the map's base prefix.
const safetensors::Tensor* find_in(const safetensors::File& f, const NameMap& map,
                                   const std::string& name, const std::string& role = "");

// The packed tensors of cfg's quantized weights, read from the checkpoint into `packed` under the
// golden's names (contract::packed); the checkpoint tensors read are added to `read`. FormatError
// naming the tensor for a part that is missing or of the wrong dtype or shape; ConfigError for a
// fused tensor the format cannot split by rows.
void read_packed(const safetensors::File& checkpoint, const NameMap& map, const ModelConfig& cfg,
                 const std::vector<Placed>& placed,
                 std::map<std::string, std::vector<unsigned char>>& packed,
                 std::set<std::string>& read);
// The golden's packed tensors under the checkpoint's names, added to `out` in the order of the
// placed parameters; the inverse of read_packed, byte for byte.
void write_packed(const safetensors::File& golden, const NameMap& map, const ModelConfig& cfg,
                  const std::vector<Placed>& placed, safetensors::File& out);

// The Hugging Face quantization_config of q (gptq, awq, mxfp4, modelopt's NVFP4); ConfigError for a
// format none expresses. quantization_from_hf is its inverse, teo's "quantization" object (its
// targets the caller's: they follow from the checkpoint's tensors).
nlohmann::json hf_quantization_config(const QuantizationConfig& q);
nlohmann::json quantization_from_hf(const nlohmann::json& quantization_config);

}  // namespace teo::names::detail
