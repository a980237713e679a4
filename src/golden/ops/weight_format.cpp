// A weight stored in a quantized format (golden/ops/weight_format.hpp): the spec's keys, the
// packed tensors' names and shapes, their draw by teo's quantizer and their exact dequantization.
#include "golden/ops/weight_format.hpp"

#include <algorithm>
#include <stdexcept>

#include "teo/dequant.hpp"
#include "teo/rng.hpp"

namespace teo::golden::ops {

namespace {

using quant::GgmlType;
using quant::TensorFormat;

constexpr const char* kGguf = "gguf:";

// The module a weight belongs to: its dense name less ".weight".
std::string module_of(const std::string& name) {
  return name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
}

std::string part_name(const WeightFormat& f, const std::string& name, const std::string& role) {
  if (f.kind == WeightFormat::Kind::gguf) return name;
  return quant::tensor_name(f.tensor, f.tensor == TensorFormat::mxfp4 ? name : module_of(name),
                            role);
}

// Each part of a weight (rows, cols) in f: its role, dtype and shape, as teo's quantizer writes it.
struct Part {
  const char* role;
  DType dtype;
  Dims shape;
};

std::vector<Part> parts_of(const WeightFormat& f, index_t rows, index_t cols) {
  if (f.kind == WeightFormat::Kind::gguf) {
    const auto bytes = static_cast<std::int64_t>(quant::row_bytes(f.gguf, cols, "a row"));
    return {{"weight", DType::U8, {rows, bytes}}};
  }
  const index_t groups = f.group_size > 0 ? cols / f.group_size : 1;
  switch (f.tensor) {
    case TensorFormat::int8:
      return {{"weight", DType::I8, {rows, cols}}, {"weight_scale", DType::F32, {rows, 1}}};
    case TensorFormat::gptq:
      return {{"qweight", DType::I32, {cols / 8, rows}},
              {"qzeros", DType::I32, {groups, rows / 8}},
              {"scales", DType::F16, {groups, rows}},
              {"g_idx", DType::I32, {cols}}};
    case TensorFormat::awq:
      return {{"qweight", DType::I32, {cols, rows / 8}},
              {"qzeros", DType::I32, {groups, rows / 8}},
              {"scales", DType::F16, {groups, rows}}};
    case TensorFormat::mxfp4:
      return {{"blocks", DType::U8, {rows, cols / 32, 16}},
              {"scales", DType::U8, {rows, cols / 32}}};
    case TensorFormat::nvfp4:
      return {{"weight", DType::U8, {rows, cols / 2}},
              {"weight_scale", DType::F8_E4M3, {rows, cols / 16}},
              {"weight_scale_2", DType::F32, {}}};
  }
  throw std::logic_error("a weight format without parts");
}

bool grouped(const WeightFormat& f) {
  return f.kind == WeightFormat::Kind::tensor &&
         (f.tensor == TensorFormat::gptq || f.tensor == TensorFormat::awq);
}

// The values a block of f holds along a row (int8: the whole row; gptq, awq: a group).
index_t block_of(const WeightFormat& f, index_t cols) {
  if (f.kind == WeightFormat::Kind::gguf) return quant::block_shape(f.gguf).values;
  switch (f.tensor) {
    case TensorFormat::int8:
      return cols;
    case TensorFormat::gptq:
    case TensorFormat::awq:
      return f.group_size;
    case TensorFormat::mxfp4:
      return 32;
    case TensorFormat::nvfp4:
      return 16;
  }
  return cols;
}

}  // namespace

std::string WeightFormat::name() const {
  switch (kind) {
    case Kind::dense:
      return "dense";
    case Kind::gguf:
      return std::string(kGguf) + quant::to_string(gguf);
    case Kind::tensor:
      return quant::to_string(tensor);
  }
  return "";
}

WeightFormat read_weight_format(Reader& r) {
  WeightFormat f;
  std::vector<std::string> names = {"int8", "gptq", "awq", "mxfp4", "nvfp4"};
  for (GgmlType t : quant::ggml_types()) names.push_back(std::string(kGguf) + quant::to_string(t));
  if (r.has("weight_format")) {
    const std::string n = r.choice("weight_format", names, "");
    if (n.starts_with(kGguf)) {
      f.kind = WeightFormat::Kind::gguf;
      f.gguf = quant::parse_ggml_type(n.substr(5), "spec.weight_format");
    } else {
      f.kind = WeightFormat::Kind::tensor;
      f.tensor = quant::parse_tensor_format(n, "spec.weight_format");
    }
  }
  const bool gptq = f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::gptq;
  const auto only = [&](const char* key, bool ok, const char* formats) {
    if (r.has(key) && !ok) {
      throw ConfigError(std::string("spec.") + key + " applies to a weight_format of " + formats +
                        ", not " + f.name());
    }
  };
  only("group_size", grouped(f), "gptq or awq");
  only("act_order", gptq, "gptq");
  only("zero_offset", gptq, "gptq");
  if (grouped(f)) f.group_size = r.has("group_size") ? r.size("group_size", 1) : 128;
  if (gptq) {
    f.act_order = r.flag("act_order", false);
    const index_t z = r.has("zero_offset") ? r.size("zero_offset", 0) : 1;
    if (z > 1) {
      throw ConfigError("spec.zero_offset must be 1 (a v1 gptq checkpoint) or 0 (gptq_v2), got " +
                        std::to_string(z));
    }
    f.zero_offset = static_cast<int>(z);
  }
  return f;
}

void write_weight_format(const WeightFormat& f, ojson& j) {
  if (f.dense()) return;
  j["weight_format"] = f.name();
  if (grouped(f)) j["group_size"] = f.group_size;
  if (f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::gptq) {
    j["act_order"] = f.act_order;
    j["zero_offset"] = f.zero_offset;
  }
}

void check_weight_shape(const WeightFormat& f, index_t rows, index_t cols,
                        const std::string& what) {
  if (f.dense()) return;
  const std::string pre = "spec.weight_format " + f.name() + ": ";
  const auto need = [&](bool ok, const std::string& why) {
    if (!ok) throw ConfigError(pre + why);
  };
  if (grouped(f)) {
    need(rows % 8 == 0 && cols % 8 == 0, what + " packs 8 values a 32-bit word: its rows and " +
                                             "columns are multiples of 8, got " +
                                             std::to_string(rows) + " x " + std::to_string(cols));
    need(cols % f.group_size == 0, "the group_size " + std::to_string(f.group_size) +
                                       " does not divide the " + std::to_string(cols) +
                                       " columns of " + what);
    return;
  }
  const index_t block = block_of(f, cols);
  need(cols % block == 0, what + " has " + std::to_string(cols) + " columns, not whole blocks of " +
                              std::to_string(block));
}

std::vector<Slot> weight_slots(const WeightFormat& f, const std::string& name, index_t rows,
                               index_t cols, Role role, index_t lead) {
  std::vector<Slot> out;
  for (Part& p : parts_of(f, rows, cols)) {
    if (lead > 0) p.shape.insert(p.shape.begin(), lead);
    Slot s{part_name(f, name, p.role), p.dtype, p.shape, role};
    s.packed = true;
    out.push_back(std::move(s));
  }
  return out;
}

void draw_weight(const WeightFormat& f, const std::string& name, index_t rows, index_t cols,
                 double amp, std::uint64_t seed, Values& v, index_t lead) {
  const std::uint64_t stream = rng::stream_id(name);
  const index_t slices = std::max<index_t>(lead, 1), n = rows * cols;
  std::vector<double> w(static_cast<std::size_t>(slices * n));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = amp * (2 * rng::uniform01(seed, stream, i) - 1);
  if (f.kind == WeightFormat::Kind::gguf) {
    const std::vector<float> x(w.begin(), w.end());
    std::vector<unsigned char> bytes(static_cast<std::size_t>(slices * rows) *
                                     quant::row_bytes(f.gguf, cols, name));
    teo::quantize(f.gguf, x.data(), slices * n, bytes.data());
    v.raw[name] = std::move(bytes);
    return;
  }
  // each slice (an expert's weight) packed on its own, the parts stacked along the lead
  for (index_t e = 0; e < slices; ++e) {
    const quant::Packed p = quant::quantize(
        f.tensor, std::vector<double>(w.begin() + e * n, w.begin() + (e + 1) * n), {rows, cols},
        {.group_size = f.group_size,
         .act_order = f.act_order,
         .seed = seed + static_cast<std::uint64_t>(e),
         .zero_offset = f.zero_offset});
    for (const Part& part : parts_of(f, rows, cols)) {
      const auto it = p.parts.find(part.role);
      if (it == p.parts.end() || it->second.dtype != part.dtype || it->second.shape != part.shape)
        throw std::logic_error("teo's quantizer packed " + name + " unlike its parts");
      const auto d = it->second.data();
      auto& to = v.raw[part_name(f, name, part.role)];
      to.insert(to.end(), d.begin(), d.end());
    }
  }
}

std::vector<double> dequantize_weight(const WeightFormat& f, const std::string& name, index_t rows,
                                      index_t cols, const Values& v, index_t lead) {
  const auto bytes_of = [&](const std::string& n) -> const std::vector<unsigned char>& {
    const auto it = v.raw.find(n);
    if (it == v.raw.end()) throw FormatError("the op case has no " + n);
    return it->second;
  };
  const index_t slices = std::max<index_t>(lead, 1), n = rows * cols;
  if (f.kind == WeightFormat::Kind::gguf) {
    const auto& b = bytes_of(name);
    const std::int64_t per_row = cols / quant::block_shape(f.gguf).values;
    std::string why;
    const std::int64_t bad =
        quant::first_invalid_block(f.gguf, b.data(), slices * rows * per_row, why);
    if (bad >= 0) {
      const std::int64_t row = bad / per_row;
      throw FormatError("the op case's " + name + ", " +
                        (lead > 0 ? "expert " + std::to_string(row / rows) + ", " : "") + "row " +
                        std::to_string(row % rows) + ", block " + std::to_string(bad % per_row) +
                        ": " + why);
    }
    std::vector<float> x(static_cast<std::size_t>(slices * n));
    teo::dequantize(f.gguf, b.data(), slices * n, x.data());
    return {x.begin(), x.end()};
  }
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(slices * n));
  for (index_t e = 0; e < slices; ++e) {
    quant::Packed p;
    p.format = f.tensor;
    for (const Part& part : parts_of(f, rows, cols)) {
      const std::string pn = part_name(f, name, part.role);
      const auto& all = bytes_of(pn);
      const std::size_t size = all.size() / static_cast<std::size_t>(slices);
      safetensors::Tensor t{pn, part.dtype, part.shape, {}};
      t.bytes.assign(all.begin() + static_cast<std::ptrdiff_t>(e * size),
                     all.begin() + static_cast<std::ptrdiff_t>((e + 1) * size));
      p.parts[part.role] = std::move(t);
    }
    const auto x = quant::dequantize(p,
                                     "the op case's " + module_of(name) +
                                         (lead > 0 ? " (expert " + std::to_string(e) + ")" : ""),
                                     {.zero_offset = f.zero_offset, .group_size = f.group_size});
    out.insert(out.end(), x.begin(), x.end());
  }
  return out;
}

std::string locate_weight(const WeightFormat& f, index_t rows, index_t cols, std::int64_t i,
                          index_t lead) {
  const index_t r = (i / cols) % rows, c = i % cols, block = block_of(f, cols);
  const std::string at = (lead > 0 ? "expert " + std::to_string(i / (rows * cols)) + ", " : "") +
                         "row " + std::to_string(r) + ", column " + std::to_string(c);
  if (f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::int8)
    return at + " (the row's scale)";
  if (f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::gptq && f.act_order)
    return at + " (its group is g_idx[" + std::to_string(c) + "])";
  const index_t b = c / block;
  std::string out = at + ": " + (grouped(f) ? "group " : "block ") + std::to_string(b) +
                    " of the row (columns " + std::to_string(b * block) + " to " +
                    std::to_string(b * block + block - 1) + ")";
  // a K type's block has sub-blocks of their own scale (Q6_K: 16 of 16; Q4_K, Q5_K: 8 of 32)
  const bool k = f.kind == WeightFormat::Kind::gguf &&
                 (f.gguf == GgmlType::q4_k || f.gguf == GgmlType::q5_k || f.gguf == GgmlType::q6_k);
  if (k) {
    const index_t sub = f.gguf == GgmlType::q6_k ? 16 : 32, j = (c % block) / sub;
    out += ", sub-block " + std::to_string(j) + " (columns " + std::to_string(b * block + j * sub) +
           " to " + std::to_string(b * block + j * sub + sub - 1) + ")";
  }
  return out;
}

}  // namespace teo::golden::ops
