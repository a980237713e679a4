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

std::string part_name(const WeightFormat& f, const std::string& name, const std::string& role) {
  return quant::weight_part_name(f, name, role);
}

std::string module_of(const std::string& name) {
  return name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
}

}  // namespace

WeightFormat read_weight_format(Reader& r) {
  WeightFormat f;
  if (r.has("weight_format")) {
    const std::string n = r.choice("weight_format", quant::weight_format_names(), "");
    f = quant::parse_weight_format(n, "spec.weight_format");
  }
  const bool gptq = f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::gptq;
  const auto only = [&](const char* key, bool ok, const char* formats) {
    if (r.has(key) && !ok) {
      throw ConfigError(std::string("spec.") + key + " applies to a weight_format of " + formats +
                        ", not " + f.name());
    }
  };
  only("group_size", f.grouped(), "gptq or awq");
  only("act_order", gptq, "gptq");
  only("zero_offset", gptq, "gptq");
  if (f.grouped()) f.group_size = r.has("group_size") ? r.size("group_size", 1) : 128;
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
  if (f.grouped()) j["group_size"] = f.group_size;
  if (f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::gptq) {
    j["act_order"] = f.act_order;
    j["zero_offset"] = f.zero_offset;
  }
}

void check_weight_shape(const WeightFormat& f, index_t rows, index_t cols,
                        const std::string& what) {
  if (f.dense()) return;
  const std::string why = quant::weight_shape_problem(f, rows, cols, what);
  if (!why.empty()) throw ConfigError("spec.weight_format " + f.name() + ": " + why);
}

std::vector<Slot> weight_slots(const WeightFormat& f, const std::string& name, index_t rows,
                               index_t cols, Role role, index_t lead) {
  std::vector<Slot> out;
  for (quant::WeightPart& p : quant::weight_parts(f, rows, cols)) {
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
  const index_t slices = std::max<index_t>(lead, 1);
  std::vector<double> w(static_cast<std::size_t>(slices * rows * cols));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = amp * (2 * rng::uniform01(seed, stream, i) - 1);
  pack_weight(f, name, rows, cols, w, seed, v.raw, lead);
}

void pack_weight(const WeightFormat& f, const std::string& name, index_t rows, index_t cols,
                 const std::vector<double>& w, std::uint64_t seed, Packed& raw, index_t lead) {
  const index_t slices = std::max<index_t>(lead, 1), n = rows * cols;
  if (f.kind == WeightFormat::Kind::gguf) {
    const std::vector<float> x(w.begin(), w.end());
    std::vector<unsigned char> bytes(static_cast<std::size_t>(slices * rows) *
                                     quant::row_bytes(f.gguf, cols, name));
    teo::quantize(f.gguf, x.data(), slices * n, bytes.data());
    raw[name] = std::move(bytes);
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
    for (const quant::WeightPart& part : quant::weight_parts(f, rows, cols)) {
      const auto it = p.parts.find(part.role);
      if (it == p.parts.end() || it->second.dtype != part.dtype || it->second.shape != part.shape)
        throw std::logic_error("teo's quantizer packed " + name + " unlike its parts");
      const auto d = it->second.data();
      auto& to = raw[part_name(f, name, part.role)];
      to.insert(to.end(), d.begin(), d.end());
    }
  }
}

std::vector<double> dequantize_weight(const WeightFormat& f, const std::string& name, index_t rows,
                                      index_t cols, const Values& v, index_t lead) {
  return dequantize_weight(f, name, rows, cols, v.raw, lead, "the op case");
}

std::vector<double> dequantize_weight(const WeightFormat& f, const std::string& name, index_t rows,
                                      index_t cols, const Packed& raw, index_t lead,
                                      const std::string& where) {
  const auto bytes_of = [&](const std::string& n) -> const std::vector<unsigned char>& {
    const auto it = raw.find(n);
    if (it == raw.end()) throw FormatError(where + " has no " + n);
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
      throw FormatError(where + "'s " + name + ", " +
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
    for (const quant::WeightPart& part : quant::weight_parts(f, rows, cols)) {
      const std::string pn = part_name(f, name, part.role);
      const auto& all = bytes_of(pn);
      const std::size_t size = all.size() / static_cast<std::size_t>(slices);
      safetensors::Tensor t{pn, part.dtype, part.shape, {}};
      t.bytes.assign(all.begin() + static_cast<std::ptrdiff_t>(e * size),
                     all.begin() + static_cast<std::ptrdiff_t>((e + 1) * size));
      p.parts[part.role] = std::move(t);
    }
    const auto x = quant::dequantize(
        p,
        where + "'s " + module_of(name) + (lead > 0 ? " (expert " + std::to_string(e) + ")" : ""),
        {.zero_offset = f.zero_offset, .group_size = f.group_size});
    out.insert(out.end(), x.begin(), x.end());
  }
  return out;
}

std::string locate_weight(const WeightFormat& f, index_t rows, index_t cols, std::int64_t i,
                          index_t lead) {
  const index_t r = (i / cols) % rows, c = i % cols, block = quant::weight_block(f, cols);
  const std::string at = (lead > 0 ? "expert " + std::to_string(i / (rows * cols)) + ", " : "") +
                         "row " + std::to_string(r) + ", column " + std::to_string(c);
  if (f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::int8)
    return at + " (the row's scale)";
  if (f.kind == WeightFormat::Kind::tensor && f.tensor == TensorFormat::gptq && f.act_order)
    return at + " (its group is g_idx[" + std::to_string(c) + "])";
  const index_t b = c / block;
  std::string out = at + ": " + (f.grouped() ? "group " : "block ") + std::to_string(b) +
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
