// A weight's storage format and its packed parts (teo/weight_format.hpp).
#include "teo/weight_format.hpp"

#include <algorithm>
#include <stdexcept>

#include "teo/errors.hpp"
#include "teo/suggest.hpp"

namespace teo::quant {

namespace {

constexpr const char* kGguf = "gguf:";

// The module a weight belongs to: its dense name less ".weight".
std::string module_of(const std::string& name) {
  return name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
}

}  // namespace

bool WeightFormat::grouped() const {
  return kind == Kind::tensor && (tensor == TensorFormat::gptq || tensor == TensorFormat::awq);
}

std::string WeightFormat::name() const {
  switch (kind) {
    case Kind::dense:
      return "dense";
    case Kind::gguf:
      return std::string(kGguf) + to_string(gguf);
    case Kind::tensor:
      return to_string(tensor);
  }
  return "";
}

std::vector<std::string> weight_format_names() {
  std::vector<std::string> names = {"int8", "gptq", "awq", "mxfp4", "nvfp4"};
  for (GgmlType t : ggml_types()) names.push_back(std::string(kGguf) + to_string(t));
  return names;
}

WeightFormat parse_weight_format(const std::string& name, const std::string& what) {
  WeightFormat f;
  if (name.starts_with(kGguf)) {
    f.kind = WeightFormat::Kind::gguf;
    f.gguf = parse_ggml_type(name.substr(5), what);
    return f;
  }
  const auto names = weight_format_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    throw ConfigError(what + " must be int8, gptq, awq, mxfp4, nvfp4 or gguf:TYPE, got \"" + name +
                      "\"" + did_you_mean(name, names));
  }
  f.kind = WeightFormat::Kind::tensor;
  f.tensor = parse_tensor_format(name, what);
  return f;
}

std::string weight_part_name(const WeightFormat& f, const std::string& name,
                             const std::string& role) {
  if (f.kind == WeightFormat::Kind::gguf) return name;
  return tensor_name(f.tensor, f.tensor == TensorFormat::mxfp4 ? name : module_of(name), role);
}

std::vector<WeightPart> weight_parts(const WeightFormat& f, index_t rows, index_t cols) {
  using D = safetensors::DType;
  if (f.kind == WeightFormat::Kind::gguf) {
    const auto bytes = static_cast<std::int64_t>(row_bytes(f.gguf, cols, "a row"));
    return {{"weight", D::U8, {rows, bytes}}};
  }
  const index_t groups = f.group_size > 0 ? cols / f.group_size : 1;
  switch (f.tensor) {
    case TensorFormat::int8:
      return {{"weight", D::I8, {rows, cols}}, {"weight_scale", D::F32, {rows, 1}}};
    case TensorFormat::gptq:
      return {{"qweight", D::I32, {cols / 8, rows}},
              {"qzeros", D::I32, {groups, rows / 8}},
              {"scales", D::F16, {groups, rows}},
              {"g_idx", D::I32, {cols}}};
    case TensorFormat::awq:
      return {{"qweight", D::I32, {cols, rows / 8}},
              {"qzeros", D::I32, {groups, rows / 8}},
              {"scales", D::F16, {groups, rows}}};
    case TensorFormat::mxfp4:
      return {{"blocks", D::U8, {rows, cols / 32, 16}}, {"scales", D::U8, {rows, cols / 32}}};
    case TensorFormat::nvfp4:
      return {{"weight", D::U8, {rows, cols / 2}},
              {"weight_scale", D::F8_E4M3, {rows, cols / 16}},
              {"weight_scale_2", D::F32, {}}};
  }
  throw std::logic_error("a weight format without parts");
}

index_t weight_block(const WeightFormat& f, index_t cols) {
  if (f.kind == WeightFormat::Kind::gguf) return block_shape(f.gguf).values;
  switch (f.tensor) {
    case TensorFormat::int8:
      return cols;
    case TensorFormat::gptq:
    case TensorFormat::awq:
      return f.group_size > 0 ? f.group_size : cols;
    case TensorFormat::mxfp4:
      return 32;
    case TensorFormat::nvfp4:
      return 16;
  }
  return cols;
}

std::string weight_shape_problem(const WeightFormat& f, index_t rows, index_t cols,
                                 const std::string& what) {
  if (f.dense()) return "";
  if (f.grouped()) {
    if (rows % 8 != 0 || cols % 8 != 0) {
      return what + " packs 8 values a 32-bit word: its rows and columns are multiples of 8, got " +
             std::to_string(rows) + " x " + std::to_string(cols);
    }
    if (f.group_size > 0 && cols % f.group_size != 0) {
      return "the group_size " + std::to_string(f.group_size) + " does not divide the " +
             std::to_string(cols) + " columns of " + what;
    }
    return "";
  }
  const index_t block = weight_block(f, cols);
  if (cols % block != 0) {
    return what + " has " + std::to_string(cols) + " columns, not whole blocks of " +
           std::to_string(block);
  }
  return "";
}

}  // namespace teo::quant
